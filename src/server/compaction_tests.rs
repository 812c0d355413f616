//! A compaction's slot and its outcome's bookkeeping, driven without a transport: a hub
//! over an in-memory store and a summarizer that answers at once, only its cancel, or
//! once the test lets it (to replace the session while the summary is written).

use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use tokio_util::sync::CancellationToken;

use super::*;
use crate::config::EngineConfig;
use crate::domain::{MessageInfo, Part, PartKind, Role, SessionInfo, TextPart};
use crate::engine::Update;
use crate::server::hub::CompactionConfig;
use crate::store::Store;

/// The session every test compacts.
const SID: &str = "s";

/// A summarizer that streams `deltas` deltas, then answers `text` (billed 900 tokens in,
/// 40 out and 0.25 when `billed`), or without one waits for its cancel.
#[derive(Debug, Default)]
struct Fake {
    text: Option<String>,
    deltas: usize,
    billed: bool,
    /// The model each request named.
    models: std::sync::Mutex<Vec<Option<String>>>,
}

impl Fake {
    /// Answers `text` at once.
    fn answering(text: &str) -> Fake {
        Fake {
            text: Some(text.into()),
            ..Fake::default()
        }
    }

    /// Answers only its cancel.
    fn waiting() -> Fake {
        Fake::default()
    }
}

#[tonic::async_trait]
impl Summarizer for Fake {
    async fn summarize(
        &self,
        request: SummaryRequest,
        progress: mpsc::Sender<Progress>,
        cancel: CancellationToken,
    ) -> Result<SummaryOutcome, SummarizeError> {
        if let Ok(mut models) = self.models.lock() {
            models.push(request.model);
        }
        for n in 0..self.deltas {
            let _ = progress.send(Progress::Delta(format!("delta {n} "))).await;
        }
        let Some(text) = &self.text else {
            cancel.cancelled().await;
            return Err(SummarizeError::Cancelled);
        };
        let usage = self.billed.then(|| crate::domain::TokenUsage {
            input: 900,
            output: 40,
            ..Default::default()
        });
        Ok(SummaryOutcome {
            text: text.clone(),
            usage,
            cost: if self.billed { 0.25 } else { 0.0 },
            model: None,
        })
    }

    fn model(&self) -> &str {
        "fake"
    }

    async fn window(&self, _model: Option<&str>) -> Option<Window> {
        None
    }
}

/// Three user turns with long texts: a compaction summarizes the first and keeps two.
fn turns() -> Vec<Update> {
    let mut updates = Vec::new();
    for n in 1..=3 {
        let id = format!("u{n}");
        updates.push(Update::UpsertMessage(MessageInfo::new(
            id.clone(),
            Role::User,
        )));
        let text: String = (0..400).map(|w| format!("word{w} of turn {n}. ")).collect();
        updates.push(Update::UpsertPart(Part {
            id: format!("{id}-t"),
            message_id: id,
            kind: PartKind::Text(TextPart {
                text,
                ..Default::default()
            }),
            mark: None,
            extra: Default::default(),
        }));
    }
    updates
}

/// A hub whose summarizer is `fake`, holding session [`SID`] with [`turns`].
async fn hub_with_session(fake: impl Summarizer + 'static) -> Arc<Hub> {
    hub_with(fake, crate::server::hub::DEFAULT_SLOW_READER_GRACE).await
}

/// [`hub_with_session`] with a slow-reader grace of `grace`.
async fn hub_with(fake: impl Summarizer + 'static, grace: std::time::Duration) -> Arc<Hub> {
    hub_over(Store::new(EngineConfig::default()), fake, grace).await
}

/// [`hub_with`] over `store`.
async fn hub_over(
    store: Store,
    fake: impl Summarizer + 'static,
    grace: std::time::Duration,
) -> Arc<Hub> {
    let store = Arc::new(store);
    let info = SessionInfo {
        id: SID.into(),
        ..Default::default()
    };
    open_with_turns(&store, info).await;
    let compaction = CompactionConfig {
        summarizer: Some(Arc::new(fake)),
        ..Default::default()
    };
    let mut hub = Hub::new(store, compaction);
    hub.slow_reader_grace = grace;
    Arc::new(hub)
}

/// Opens `info`'s session in `store` and writes [`turns`] to it.
async fn open_with_turns(store: &Store, info: SessionInfo) {
    let (handle, _) = store.open(info).await.expect("open");
    handle
        .call(|s, _| turns().into_iter().try_for_each(|u| s.step(u, 1).map(drop)))
        .await
        .expect("the actor answers")
        .expect("the turns apply");
}

/// On tokio's paused clock: the slow-reader grace is a `tokio::time::sleep`, and in real
/// time a loaded machine could stretch the 100 ms before the cancel past the 300 ms
/// grace, which had then freed the slot already (no compaction left to cancel).
#[tokio::test(start_paused = true)]
async fn a_caller_that_reads_no_event_does_not_hold_a_cancelled_compaction() {
    // A `Compact` caller that keeps its call open and reads nothing: once its channel is
    // full the job waits to hand it a delta, and before, neither a cancel nor anything
    // else could end the job: the slot stayed claimed for as long as the call was open.
    let hub = hub_with(
        Fake {
            deltas: 8,
            ..Fake::default()
        },
        std::time::Duration::from_millis(300),
    )
    .await;
    let (tx, _unread) = mpsc::channel(1);
    start(&hub, SID, Options::default(), Some(Sink::owning(tx)), None)
        .await
        .expect("started");
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    assert!(hub.cancel(SID).is_some(), "the compaction runs");
    let again = tokio::time::timeout(std::time::Duration::from_secs(5), async {
        loop {
            if start(&hub, SID, Options::default(), None, None)
                .await
                .is_ok()
            {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(again.is_ok(), "the slot is still claimed after 5 s");
}

#[tokio::test]
async fn a_start_dropped_while_planning_frees_the_slot() {
    let hub = hub_with_session(Fake::answering("summary")).await;
    // tonic drops a `Compact` handler's future when its client goes away or its
    // deadline passes: here while it waits for the plan from the session's actor (which
    // this thread has not run yet).
    let mut starting = Box::pin(start(&hub, SID, Options::default(), None, None));
    let mut cx = Context::from_waker(Waker::noop());
    assert!(matches!(starting.as_mut().poll(&mut cx), Poll::Pending));
    assert!(
        hub.cancel(SID).is_some(),
        "the slot is claimed while planning"
    );
    drop(starting);
    assert_eq!(hub.cancel(SID), None, "the dropped start freed its slot");
    let started = start(&hub, SID, Options::default(), None, None)
        .await
        .expect("a new compaction starts");
    assert!(matches!(started.event, Some(Ce::Started(_))), "{started:?}");
}

/// The next compaction failure announced on `bus`.
async fn next_failure(
    bus: &mut tokio::sync::broadcast::Receiver<Arc<crate::server::hub::Published>>,
) -> pb::CompactionFailed {
    loop {
        let event = bus.recv().await.expect("the bus is open");
        if let Some(pb::session_event::Event::Compaction(c)) = &event.session_event.event
            && let Some(Ce::Failed(f)) = &c.event
        {
            return f.clone();
        }
    }
}

#[tokio::test]
async fn cancelled_automatic_compactions_leave_the_breaker_alone() {
    // A rolling restart cancels running compactions at the drain's deadline: that says
    // nothing of the session, so as many as would trip the breaker must not pause it.
    let hub = hub_with_session(Fake::waiting()).await;
    let handle = hub.store.get(SID).await.expect("the session");
    let before = handle.call(|s, _| s.auto_state()).await.expect("actor");
    let mut bus = hub.bus.subscribe();
    for _ in 0..=EngineConfig::default().breaker_failures {
        let started = start(&hub, SID, Options::automatic(), None, None)
            .await
            .expect("an automatic compaction starts");
        assert_eq!(hub.cancel(SID), Some(started.compaction_id));
        let failed = next_failure(&mut bus).await;
        assert_eq!(failed.kind, "cancelled", "{failed:?}");
        assert!(!failed.auto_compaction_paused, "{failed:?}");
    }
    let after = handle.call(|s, _| s.auto_state()).await.expect("actor");
    assert_eq!(after, before, "the breaker saw nothing");
}

/// A summarizer that says when it is asked, then answers `text` once let go (or ends
/// cancelled, when cancelled first).
#[derive(Debug, Clone)]
struct Gated {
    text: &'static str,
    asked: Arc<tokio::sync::Notify>,
    go: Arc<tokio::sync::Semaphore>,
}

impl Gated {
    fn new(text: &'static str) -> Gated {
        Gated {
            text,
            asked: Arc::default(),
            go: Arc::new(tokio::sync::Semaphore::new(0)),
        }
    }

    /// Lets the summary (one request) answer.
    fn release(&self) {
        self.go.add_permits(1);
    }
}

#[tonic::async_trait]
impl Summarizer for Gated {
    async fn summarize(
        &self,
        _request: SummaryRequest,
        _progress: mpsc::Sender<Progress>,
        cancel: CancellationToken,
    ) -> Result<SummaryOutcome, SummarizeError> {
        self.asked.notify_one();
        tokio::select! {
            permit = self.go.acquire() => drop(permit),
            _ = cancel.cancelled() => return Err(SummarizeError::Cancelled),
        }
        Ok(SummaryOutcome {
            text: self.text.into(),
            usage: None,
            cost: 0.0,
            model: None,
        })
    }

    fn model(&self) -> &str {
        "gated"
    }

    async fn window(&self, _model: Option<&str>) -> Option<Window> {
        None
    }
}

/// Session [`SID`] built again from [`turns`], as an import of the same export builds it:
/// the same message ids at the same positions, another session value.
fn same_conversation_again(config: &EngineConfig) -> crate::engine::Session {
    let info = SessionInfo {
        id: SID.into(),
        ..Default::default()
    };
    let mut s = crate::engine::Session::new(info, config);
    for u in turns() {
        s.apply(u, config).expect("the turns apply");
    }
    s
}

/// The session's whole value, encoded.
async fn encoded(hub: &Hub) -> Vec<u8> {
    let handle = hub.store.get(SID).await.expect("the session");
    handle
        .call(|s, _| crate::engine::encode_session(s))
        .await
        .expect("the actor answers")
}

/// The compaction's last event on `events`: compacted or failed.
async fn outcome(events: &mut mpsc::Receiver<Handed>) -> Ce {
    loop {
        let e = events
            .recv()
            .await
            .expect("the compaction reports its end")
            .event;
        match e.event {
            Some(ev @ (Ce::Compacted(_) | Ce::Failed(_))) => return ev,
            _ => continue,
        }
    }
}

#[tokio::test]
async fn a_summary_committed_on_a_reimport_of_the_same_ids_is_stale() {
    let gated = Gated::new("summary of the old conversation");
    let hub = hub_with_session(gated.clone()).await;
    let (tx, mut events) = mpsc::channel(64);
    start(
        &hub,
        SID,
        Options::default(),
        Some(Sink::listening(tx)),
        None,
    )
    .await
    .expect("the compaction starts");
    gated.asked.notified().await;
    // ImportSession{replace} of the same export puts the new session in place; its
    // summary written, the old compaction commits before the import's cancel takes effect.
    let again = same_conversation_again(hub.store.config());
    hub.store.insert(again, true).await.expect("replaced");
    let imported = encoded(&hub).await;
    gated.release();
    match outcome(&mut events).await {
        Ce::Failed(f) => {
            assert_eq!(f.kind, "stale", "{f:?}");
            assert!(f.retryable, "{f:?}");
        }
        other => panic!("the old summary must not land on the new session: {other:?}"),
    }
    assert_eq!(
        encoded(&hub).await,
        imported,
        "the imported session is unchanged"
    );
}

#[tokio::test]
async fn a_replacement_leaves_a_compaction_of_the_new_session_running() {
    let gated = Gated::new("summary of the imported conversation");
    let hub = hub_with_session(gated.clone()).await;
    // ImportSession{replace} put the new session in place and is still writing it (an
    // fsync under sync durability): a compaction of the new session starts meanwhile.
    let again = same_conversation_again(hub.store.config());
    let generation = again.generation();
    hub.store.insert(again, true).await.expect("replaced");
    let (tx, mut events) = mpsc::channel(64);
    start(
        &hub,
        SID,
        Options::default(),
        Some(Sink::listening(tx)),
        None,
    )
    .await
    .expect("the compaction of the new session starts");
    gated.asked.notified().await;
    // The import's write done, it cancels the replaced session's compaction: not this one.
    crate::server::ops::cancel_replaced(&hub, SID, Some(generation), "test: the import");
    gated.release();
    match outcome(&mut events).await {
        Ce::Compacted(_) => {}
        other => panic!("the new session's compaction must commit: {other:?}"),
    }
}

#[tokio::test]
async fn a_replacement_while_planning_cancels_only_a_plan_of_the_replaced_value() {
    for replaced in [true, false] {
        let hub = hub_with_session(Fake::answering("summary")).await;
        let handle = hub.store.get(SID).await.expect("the session");
        let held = handle.call(|s, _| s.generation()).await.expect("actor");
        // What the id holds once the import is written: another value, or (the import
        // done before this compaction's lookup) the very value it plans on.
        let now = if replaced {
            same_conversation_again(hub.store.config()).generation()
        } else {
            held
        };
        let (tx, mut events) = mpsc::channel(64);
        let mut starting = Box::pin(start(
            &hub,
            SID,
            Options::default(),
            Some(Sink::listening(tx)),
            None,
        ));
        let mut cx = Context::from_waker(Waker::noop());
        assert!(matches!(starting.as_mut().poll(&mut cx), Poll::Pending));
        // The slot is claimed, the plan not made yet: the cancel is decided once it is.
        crate::server::ops::cancel_replaced(&hub, SID, Some(now), "test: the import");
        starting.await.expect("the compaction starts");
        match (replaced, outcome(&mut events).await) {
            (true, Ce::Failed(f)) => assert_eq!(f.kind, "cancelled", "{f:?}"),
            (false, Ce::Compacted(_)) => {}
            (_, other) => panic!("replaced: {replaced}: {other:?}"),
        }
    }
}

#[tokio::test]
async fn a_delete_leaves_a_compaction_of_the_session_created_again_meanwhile_running() {
    let gated = Gated::new("summary of the new conversation");
    let hub = hub_with_session(gated.clone()).await;
    // DeleteSession removed the session and is writing the delete (an fsync under sync
    // durability); the session is created again and a compaction of it starts meanwhile.
    assert!(hub.store.remove(SID).await.expect("removed"));
    let again = same_conversation_again(hub.store.config());
    hub.store.insert(again, false).await.expect("created again");
    let (tx, mut events) = mpsc::channel(64);
    start(
        &hub,
        SID,
        Options::default(),
        Some(Sink::listening(tx)),
        None,
    )
    .await
    .expect("the new session's compaction starts");
    gated.asked.notified().await;
    // The delete written, it cancels the deleted session's compaction: not this one.
    let now = crate::server::ops::generation_held(&hub, SID).await;
    crate::server::ops::cancel_replaced(&hub, SID, now, "test: the delete");
    gated.release();
    match outcome(&mut events).await {
        Ce::Compacted(_) => {}
        other => panic!("the new session's compaction must commit: {other:?}"),
    }
}

/// An ImportSession{replace} whose caller stops waiting while the new session is written
/// (its deadline, a hang-up): the replace lands, and the replaced session's compaction is
/// cancelled all the same. Before, the import was dropped at the write's wait: the
/// compaction ran on, paid for, until its commit found itself stale.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_import_whose_caller_stopped_waiting_still_cancels_the_replaced_compaction() {
    use crate::server::abandoned_tests::SlowWrites;
    use crate::store::Write;
    let dir = tempfile::tempdir().expect("dir");
    let (store, mut began) = SlowWrites::store(dir.path(), |w| matches!(w, Write::Create { .. }));
    let gated = Gated::new("summary of the replaced conversation");
    let hub = hub_over(
        store,
        gated.clone(),
        crate::server::hub::DEFAULT_SLOW_READER_GRACE,
    )
    .await;
    let (tx, mut events) = mpsc::channel(64);
    start(
        &hub,
        SID,
        Options::default(),
        Some(Sink::listening(tx)),
        None,
    )
    .await
    .expect("the compaction starts");
    gated.asked.notified().await;
    let importer = super::super::import::Importer::new(hub.clone(), 4 << 20);
    let mut req = pb::ImportSessionRequest {
        export_json: std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/examples/session.json"
        ))
        .expect("example"),
        session_id: SID.into(),
        replace: true,
        ..Default::default()
    };
    let document = super::super::import::document(&mut req).expect("a document");
    // The caller stops waiting once the new session is being written.
    let created = *began.borrow();
    tokio::select! {
        done = importer.import(req, document, crate::store::Reservation::default()) => {
            panic!("the import cannot land before its write: {done:?}")
        }
        began = began.wait_for(|n| *n > created) => drop(began.expect("the store is up")),
    }
    let ended = tokio::time::timeout(std::time::Duration::from_secs(10), outcome(&mut events))
        .await
        .expect("the replaced session's compaction is cancelled, not left running");
    match ended {
        Ce::Failed(f) => assert_eq!(f.kind, "cancelled", "{f:?}"),
        other => panic!("the replaced session's summary cannot commit: {other:?}"),
    }
    gated.release();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_the_disk_refuses_is_a_storage_failure_worth_retrying() {
    use std::sync::atomic::Ordering::SeqCst;
    // Under sync the commit waits for its write: a full disk refuses it. The session is
    // there and the summary was fine: before, this read "session_gone", not retryable.
    let d = tempfile::tempdir().expect("dir");
    let backend = Arc::new(crate::store::durable_tests::Faulty::sync(d.path(), None));
    let store = Store::new(EngineConfig::default())
        .with_backend(backend.clone())
        .expect("listed");
    let hub = hub_over(
        store,
        Fake::answering("summary"),
        crate::server::hub::DEFAULT_SLOW_READER_GRACE,
    )
    .await;
    backend.fail_all.store(true, SeqCst);
    let (tx, mut events) = mpsc::channel(64);
    start(&hub, SID, Options::default(), Some(Sink::owning(tx)), None)
        .await
        .expect("started");
    match outcome(&mut events).await {
        Ce::Failed(f) => {
            assert_eq!(f.kind, "storage", "{f:?}");
            assert!(f.retryable, "{f:?}");
        }
        other => panic!("expected a failure, got {other:?}"),
    }
}

#[tokio::test]
async fn a_stream_busy_elsewhere_still_gets_every_event_of_its_compaction() {
    // A Stream listens to the compactions it started; its writer may leave their events
    // waiting while it answers updates (it has a slow-reader grace of its own). Its
    // events are waited for, past the grace, and none is dropped.
    let hub = hub_with(
        Fake {
            deltas: 8,
            ..Fake::answering("summary")
        },
        std::time::Duration::from_millis(100),
    )
    .await;
    let (tx, mut events) = mpsc::channel(1);
    start(
        &hub,
        SID,
        Options::default(),
        Some(Sink::listening(tx)),
        None,
    )
    .await
    .expect("started");
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    let mut deltas = 0;
    loop {
        let e = events
            .recv()
            .await
            .expect("every event, then the end")
            .event;
        match e.event {
            Some(Ce::Delta(_)) => deltas += 1,
            Some(Ce::Compacted(_)) => break,
            other => assert!(!matches!(other, Some(Ce::Failed(_))), "{other:?}"),
        }
    }
    assert_eq!(deltas, 8);
}

#[tokio::test]
async fn a_summary_refused_at_commit_still_reports_what_it_cost() {
    // An answer longer than what it replaces is refused (not_smaller): nothing is
    // committed, but the model was paid. Before, the failure said nothing of it.
    let hub = hub_with_session(Fake {
        billed: true,
        ..Fake::answering(&"word ".repeat(20_000))
    })
    .await;
    let (tx, mut events) = mpsc::channel(64);
    start(&hub, SID, Options::default(), Some(Sink::owning(tx)), None)
        .await
        .expect("started");
    match outcome(&mut events).await {
        Ce::Failed(f) => {
            assert_eq!(f.kind, "not_smaller", "{f:?}");
            let usage = f.usage.expect("what the answer cost");
            assert_eq!((usage.input, usage.output), (900, 40));
            assert_eq!(f.cost, 0.25);
        }
        other => panic!("expected a failure, got {other:?}"),
    }
}

/// A compaction of [`SID`] whose summary is written and whose commit waits in the
/// session's mailbox behind a job that blocks until the sender returned is used (or
/// dropped): its events, and the sender.
async fn a_commit_waiting_its_turn() -> (
    Arc<Hub>,
    mpsc::Receiver<Handed>,
    std::sync::mpsc::Sender<()>,
) {
    let gated = Gated::new("summary");
    let hub = hub_with_session(gated.clone()).await;
    let (tx, events) = mpsc::channel(64);
    start(
        &hub,
        SID,
        Options::default(),
        Some(Sink::listening(tx)),
        None,
    )
    .await
    .expect("the compaction starts");
    gated.asked.notified().await;
    let old = hub.store.get(SID).await.expect("the session");
    let (unblock, blocked) = std::sync::mpsc::channel::<()>();
    let _busy = old
        .submit(move |_, _| {
            let _ = blocked.recv();
        })
        .await
        .expect("queued");
    gated.release();
    // The commit queues behind the blocking job.
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    (hub, events, unblock)
}

/// A session deleted while the commit waited its turn: the summary commits nothing and
/// no `session.compacted` follows the delete. Before, the commit ran on the deleted
/// session's actor (its generation unchanged) and the compaction reported success.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_summary_whose_session_is_deleted_while_its_commit_waits_commits_nothing() {
    let (hub, mut events, unblock) = a_commit_waiting_its_turn().await;
    assert!(
        hub.store.remove(SID).await.expect("deleted"),
        "there was a session"
    );
    let _ = unblock.send(());
    match outcome(&mut events).await {
        Ce::Failed(f) => assert_eq!(f.kind, "session_gone", "{f:?}"),
        other => panic!("a deleted session's compaction must not commit: {other:?}"),
    }
}

/// CancelCompaction acknowledged while the commit waited its turn: "a cancelled
/// compaction commits nothing". Before, only a cancel before the summary was written
/// stopped it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compaction_cancelled_while_its_commit_waits_commits_nothing() {
    let (hub, mut events, unblock) = a_commit_waiting_its_turn().await;
    assert!(hub.cancel(SID).is_some(), "a compaction was running");
    let _ = unblock.send(());
    match outcome(&mut events).await {
        Ce::Failed(f) => assert_eq!(f.kind, "cancelled", "{f:?}"),
        other => panic!("a cancelled compaction must not commit: {other:?}"),
    }
    let handle = hub.store.get(SID).await.expect("the session");
    let summaries = handle
        .call(|s, _| s.messages().iter().filter(|m| m.info.is_summary()).count())
        .await
        .expect("the actor answers");
    assert_eq!(summaries, 0, "the session holds no summary");
}

/// A `Compact` caller slow to take the last event of a compaction that committed reads
/// it once it has read what came before. Before, the job gave up on it after the grace
/// and the call ended with "so it was cancelled", though the summary was committed: a
/// client retrying that compacted twice.
#[tokio::test]
async fn a_slow_compact_caller_still_reads_the_outcome_of_a_committed_compaction() {
    use tokio_stream::StreamExt;
    let hub = hub_with(
        Fake {
            deltas: 3,
            ..Fake::answering("summary")
        },
        std::time::Duration::from_millis(300),
    )
    .await;
    let (tx, rx) = mpsc::channel(3);
    let sink = Sink::owning(tx);
    let events = sink.until_outcome(rx);
    start(&hub, SID, Options::default(), Some(sink), None)
        .await
        .expect("started");
    // The three deltas fill the channel; the outcome waits past the grace.
    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    let read: Vec<_> = events.collect().await;
    assert_eq!(read.len(), 4, "three deltas, then the outcome: {read:?}");
    assert!(
        matches!(
            read.last(),
            Some(Ok(pb::CompactionEvent {
                event: Some(Ce::Compacted(_)),
                ..
            }))
        ),
        "{read:?}"
    );
    let handle = hub.store.get(SID).await.expect("the session");
    let summaries = handle
        .call(|s, _| s.messages().iter().filter(|m| m.info.is_summary()).count())
        .await
        .expect("the actor answers");
    assert_eq!(summaries, 1, "the summary is committed");
}

/// A job on the session's actor that publishes, once durable as an update's events are,
/// whether the session held a summary when it ran (an overflow whose `reason` says it).
async fn probe(
    hub: &Arc<Hub>,
    handle: &crate::store::SessionHandle,
) -> oneshot::Receiver<Result<bool, crate::store::StoreError>> {
    let hub = hub.clone();
    handle
        .submit(move |s, _| {
            let after = s.messages().iter().any(|m| m.info.is_summary());
            let check = pb::OverflowCheck {
                reason: if after { "after" } else { "before" }.into(),
                ..Default::default()
            };
            s.when_durable(move || hub.publish(SID, pb::session_event::Event::Overflow(check)));
            after
        })
        .await
        .expect("queued")
}

/// Watchers hear `session.compacted` before anything the session's later jobs publish,
/// in the order the session ran them. Before, the job published it after asking the actor
/// to record the outcome, behind the jobs queued meanwhile: an overflow of the compacted
/// context then came first, and read as one from before the compaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watchers_hear_compacted_before_what_later_jobs_publish() {
    let gated = Gated::new("summary");
    let hub = hub_with_session(gated.clone()).await;
    let handle = hub.store.get(SID).await.expect("the session");
    let mut bus = hub.bus.subscribe();
    start(&hub, SID, Options::default(), None, None)
        .await
        .expect("the compaction starts");
    gated.asked.notified().await;
    gated.release();
    // Keeps jobs queued behind the commit (and the job's next call) until several
    // batches ran after it.
    let mut after = 0;
    for _ in 0..10_000 {
        let mut last = None;
        for _ in 0..16 {
            last = Some(probe(&hub, &handle).await);
        }
        let ran_after = last
            .expect("a batch")
            .await
            .expect("answered")
            .expect("ran");
        if ran_after {
            after += 1;
            if after == 4 {
                break;
            }
        }
    }
    assert_eq!(after, 4, "the compaction committed");
    let mut heard_after = 0;
    loop {
        let e = bus.recv().await.expect("the bus kept up");
        match &e.session_event.event {
            Some(pb::session_event::Event::Overflow(c)) if c.reason == "after" => heard_after += 1,
            Some(pb::session_event::Event::Compaction(c)) => match &c.event {
                Some(Ce::Compacted(_)) => break,
                Some(Ce::Failed(f)) => panic!("the compaction failed: {f:?}"),
                _ => {}
            },
            _ => {}
        }
    }
    assert_eq!(
        heard_after, 0,
        "jobs run after the commit were heard before session.compacted"
    );
}

#[tokio::test]
async fn a_session_model_the_allow_list_no_longer_holds_gives_way_to_the_servers() {
    // Set when "old" was allowed; the server now allows only "new" (a restart on the same
    // data). Before, every compaction of the session, automatic ones too, failed with
    // PERMISSION_DENIED naming options.model, a field the request never set.
    let store = Arc::new(Store::new(EngineConfig::default()));
    let mut info = SessionInfo {
        id: SID.into(),
        ..Default::default()
    };
    info.config.compaction_model = Some("old".into());
    open_with_turns(&store, info).await;
    let recording = Arc::new(Fake::answering("summary"));
    let compaction = CompactionConfig {
        summarizer: Some(recording.clone()),
        allowed_models: vec!["new".into()],
        ..Default::default()
    };
    let hub = Arc::new(Hub::new(store, compaction));
    let (tx, mut events) = mpsc::channel(64);
    start(&hub, SID, Options::default(), Some(Sink::owning(tx)), None)
        .await
        .expect("started");
    match outcome(&mut events).await {
        Ce::Compacted(_) => {}
        other => panic!("expected the compaction to succeed, got {other:?}"),
    }
    let models = recording
        .models
        .lock()
        .map(|m| m.clone())
        .unwrap_or_default();
    assert_eq!(models, [None], "the server's model, not the session's");
    // A request's own model is still held to the list: settings.rs
    // models_outside_the_operators_allow_list_are_refused.
}

/// A model the request names outside the allow-list is refused first, naming it. Before,
/// the session was loaded, claimed and planned (its head copied out) before the model
/// was looked at: a request for a session with nothing to compact, or one compacting
/// already, was told that instead, and never learned its model was refused.
#[tokio::test]
async fn a_refused_model_is_named_before_the_session_is_looked_at() {
    let store = Arc::new(Store::new(EngineConfig::default()));
    let info = SessionInfo {
        id: SID.into(),
        ..Default::default()
    };
    store.open(info).await.expect("open");
    let compaction = CompactionConfig {
        summarizer: Some(Arc::new(Fake::answering("summary"))),
        allowed_models: vec!["new".into()],
        ..Default::default()
    };
    let hub = Arc::new(Hub::new(store, compaction));
    // An empty session (nothing to compact) and one that does not exist.
    for session_id in [SID, "missing"] {
        let options = Options {
            model: "other".into(),
            ..Default::default()
        };
        let refused = start(&hub, session_id, options, None, None)
            .await
            .expect_err("a model outside the list");
        assert_eq!(refused.code, tonic::Code::PermissionDenied, "{refused:?}");
        assert_eq!(refused.field, "model", "{refused:?}");
    }
    // The claim was never taken: the slot is free.
    assert!(hub.claim(SID).is_ok());
}
