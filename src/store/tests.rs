//! The store's own guarantees: idle actors evict themselves without losing a racing
//! update, and the byte total follows every session.
//!
//! The idle TTL runs on tokio's clock (the store's clock and the actors' timers are
//! `tokio::time`): tests of it on one thread pause that clock, so a loaded machine
//! cannot stretch the time between two steps past a TTL.

use std::time::Duration;

use tokio::sync::mpsc::error::TryRecvError;

use super::*;
use crate::domain::SessionInfo;

fn info(id: &str) -> SessionInfo {
    SessionInfo {
        id: id.into(),
        ..SessionInfo::default()
    }
}

fn store() -> Store {
    Store::new(EngineConfig::default())
}

async fn next_eviction(evictions: &mut mpsc::UnboundedReceiver<Evicted>) -> Evicted {
    tokio::time::timeout(Duration::from_secs(5), evictions.recv())
        .await
        .expect("an eviction in time")
        .expect("the store is alive")
}

#[tokio::test(start_paused = true)]
async fn an_idle_session_evicts_itself_and_a_handle_taken_before_cannot_reach_it() {
    let store = store();
    let mut evictions = store.evict_idle_after(Duration::from_millis(50));
    let (handle, _) = store.open(info("s")).await.expect("open");
    handle.call(|_, _| ()).await.expect("in use");
    let evicted = next_eviction(&mut evictions).await;
    assert_eq!(evicted.session_id, "s");
    assert!(evicted.idle >= Duration::from_millis(50), "{evicted:?}");
    assert!(matches!(store.get("s").await, Err(StoreError::NotFound(_))));
    // The old handle's update is refused rather than applied to a session no one can
    // see any more.
    let late = handle.call(|_, _| ()).await;
    assert_eq!(late, Err(StoreError::NotFound("s".into())));
}

#[tokio::test(start_paused = true)]
async fn sessions_used_within_the_ttl_are_kept() {
    let store = store();
    let mut evictions = store.evict_idle_after(Duration::from_millis(200));
    let (handle, _) = store.open(info("s")).await.expect("open");
    for _ in 0..10 {
        handle.call(|_, _| ()).await.expect("still served");
        tokio::time::sleep(Duration::from_millis(40)).await;
    }
    assert_eq!(evictions.try_recv(), Err(TryRecvError::Empty));
    assert_eq!(store.len(), 1);
}

/// Looking at a session (ListSessions' summary of it) is not using it: a session looked
/// at more often than its TTL still leaves one TTL after its last use. Before, each
/// listing counted as use (a dashboard polling faster than the TTL kept every session in
/// memory, and a session just listed ranked as recently used under memory pressure).
#[tokio::test(start_paused = true)]
async fn a_session_only_looked_at_leaves_a_ttl_after_its_last_use() {
    let store = store();
    let mut evictions = store.evict_idle_after(Duration::from_millis(200));
    let (handle, _) = store.open(info("s")).await.expect("open");
    handle.call(|_, _| ()).await.expect("used");
    let used = tokio::time::Instant::now();
    let looking = async {
        loop {
            if let Ok(rx) = handle.look(|s, _| s.messages().len()).await {
                let _ = rx.await;
            }
            tokio::time::sleep(Duration::from_millis(40)).await;
        }
    };
    let evicted = tokio::select! {
        e = next_eviction(&mut evictions) => e,
        () = looking => unreachable!("looks forever"),
    };
    assert_eq!(evicted.session_id, "s");
    assert!(used.elapsed() < Duration::from_secs(1), "{evicted:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[expect(
    clippy::await_holding_lock,
    reason = "the map lock is held on purpose while the update is queued"
)]
async fn an_update_queued_while_the_actor_decides_keeps_the_session() {
    // Real time (two threads, and the map lock held by a blocked one): the TTL is long
    // enough that the checks after the update fit in it on a loaded machine, and the lock
    // is held for several TTLs so the actor's has run out while it is held.
    const TTL: Duration = Duration::from_secs(1);
    let store = store();
    let mut evictions = store.evict_idle_after(TTL);
    let (handle, _) = store.open(info("s")).await.expect("open");
    let result = {
        // Holding the map lock: the actor's TTL runs out and it waits here to leave.
        let _map = store.write();
        std::thread::sleep(3 * TTL);
        // An update through a handle taken before: queued while the actor decides.
        handle.submit(|_, _| 42).await.expect("queued")
    };
    assert_eq!(result.await, Ok(Ok(42)), "the update ran");
    assert!(store.get("s").await.is_ok(), "and the session stayed");
    assert_eq!(evictions.try_recv(), Err(TryRecvError::Empty));
    // Left alone again, it goes.
    assert_eq!(next_eviction(&mut evictions).await.session_id, "s");
}

#[tokio::test(start_paused = true)]
async fn a_deleted_session_is_not_announced_as_evicted() {
    let store = store();
    let mut evictions = store.evict_idle_after(Duration::from_millis(30));
    let (handle, _) = store.open(info("gone")).await.expect("open");
    let (_other, _) = store.open(info("idle")).await.expect("open");
    assert_eq!(store.remove("gone").await, Ok(true));
    assert_eq!(next_eviction(&mut evictions).await.session_id, "idle");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(evictions.try_recv(), Err(TryRecvError::Empty));
    // Its remaining handle still reaches the actor, as before idle eviction existed.
    handle.call(|_, _| ()).await.expect("queued jobs still run");
}

#[tokio::test]
async fn without_a_listener_no_session_is_evicted() {
    let store = store();
    let evictions = store.evict_idle_after(Duration::from_millis(30));
    drop(evictions);
    let (handle, _) = store.open(info("s")).await.expect("open");
    tokio::time::sleep(Duration::from_millis(120)).await;
    assert!(store.get("s").await.is_ok());
    handle.call(|_, _| ()).await.expect("served");
}

#[tokio::test]
async fn the_total_follows_every_session_and_returns_to_zero() {
    let store = store();
    let (a, _) = store.open(info("a")).await.expect("open");
    let (b, _) = store.open(info("b")).await.expect("open");
    let held = a.held_bytes() + b.held_bytes();
    assert!(held > 0);
    assert_eq!(store.held_bytes(), held);
    store.remove("a").await.expect("removed");
    drop(a);
    for _ in 0..100 {
        if store.held_bytes() == b.held_bytes() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(store.held_bytes(), b.held_bytes());
}

#[tokio::test(start_paused = true)]
async fn an_evicted_session_gives_its_bytes_back() {
    let store = store();
    let mut evictions = store.evict_idle_after(Duration::from_millis(30));
    let (a, _) = store.open(info("a")).await.expect("open");
    assert!(store.held_bytes() > 0);
    next_eviction(&mut evictions).await;
    drop(a);
    for _ in 0..100 {
        if store.held_bytes() == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(store.held_bytes(), 0);
}

/// `id` of `model_id` (provider "anthropic").
pub(super) fn of_model(id: &str, model_id: &str) -> SessionInfo {
    SessionInfo {
        model: Some(crate::domain::ModelRef {
            provider_id: "anthropic".into(),
            model_id: model_id.into(),
        }),
        ..info(id)
    }
}

/// The session's calibration factors.
pub(super) async fn factors(h: &SessionHandle) -> crate::engine::calibration::Factors {
    h.call(|tx, _| tx.calibration().factors())
        .await
        .expect("served")
}

/// Session `id` of `model_id`, opened in `store`.
async fn opened(store: &Store, id: &str, model_id: &str) -> SessionHandle {
    store.open(of_model(id, model_id)).await.expect("open").0
}

/// Session "a" of claude-sonnet-4-5, taught by its reports that its provider counts
/// 1.6x what it estimates of tool output; and the factors it learned.
pub(super) async fn taught(store: &Store) -> (SessionHandle, crate::engine::calibration::Factors) {
    let first = opened(store, "a", "claude-sonnet-4-5").await;
    reports_counting_tool_output_more(&first, "m", 6).await;
    let learned = factors(&first).await;
    assert!(learned[0] > 1.2, "{learned:?}");
    (first, learned)
}

/// A session of a model whose sessions already taught the store something starts from it.
#[tokio::test]
async fn a_new_session_starts_from_what_sessions_of_its_model_learned() {
    let store = store();
    let (_first, learned) = taught(&store).await;
    let second = opened(&store, "b", "claude-sonnet-4-5").await;
    assert_eq!(factors(&second).await, learned);
    // Another model starts from 1.0.
    let (other, _) = store.open(info("c")).await.expect("open");
    assert_eq!(factors(&other).await, crate::engine::calibration::NEUTRAL);
}

/// A session switched to another model starts that model's calibration from its prior,
/// and what it learns after goes under the new model only. Found in review: it kept the
/// old model's factors (a ~1.6x tool-output correction applied to the new model's
/// counts) and, at its next report, shared them as the new model's, so every new session
/// of that model over-predicted by about half.
#[tokio::test]
async fn a_session_that_changes_model_learns_the_new_one_from_its_prior() {
    let store = store();
    let (first, learned) = taught(&store).await;
    let switch = crate::engine::Update::Configure(of_model("a", "claude-opus-4-1"));
    first
        .call(move |tx, _| tx.step(switch, 0).map(|_| ()))
        .await
        .expect("served")
        .expect("switched");
    assert_eq!(
        factors(&first).await,
        crate::engine::calibration::NEUTRAL,
        "the new model's prior (nothing learned of it yet)"
    );
    reports_counting_tool_output_more(&first, "n", 6).await;
    let fresh = opened(&store, "b", "claude-opus-4-1").await;
    assert_eq!(factors(&fresh).await, factors(&first).await);
    // The old model's sessions still start from what was learned of it.
    let old = opened(&store, "c", "claude-sonnet-4-5").await;
    assert_eq!(factors(&old).await, learned);
}

/// `n` requests on `h` whose provider counted 1.6x what the session estimates of each
/// new tool output (its messages named `{prefix}{i}`).
async fn reports_counting_tool_output_more(h: &SessionHandle, prefix: &str, n: u64) {
    use crate::domain::{
        MessageInfo, Part, PartKind, Role, TokenUsage, ToolPart, ToolState, ToolStatus,
    };
    use crate::engine::Update;
    let mut reported = h
        .call(|tx, _| tx.context_tokens())
        .await
        .expect("served")
        .saturating_add(10_000);
    for i in 0..n {
        let id = format!("{prefix}{i}");
        let output =
            format!("{prefix} line {i}: {}\n", "compiling crate_x v0.1.0 ... ok").repeat(200);
        let counting = h.call(|tx, _| tx.counting()).await.expect("served");
        let estimate = counting.counter().count(&output);
        let steps = vec![
            Update::UpsertMessage(MessageInfo::new(&id, Role::Assistant)),
            Update::UpsertPart(Part {
                id: format!("{id}_t"),
                message_id: id.clone(),
                kind: PartKind::Tool(Box::new(ToolPart {
                    call_id: format!("call_{id}"),
                    tool: "bash".into(),
                    state: ToolState {
                        output: output.clone(),
                        ..ToolState::new(ToolStatus::Completed)
                    },
                    metadata: None,
                })),
                mark: None,
                extra: Default::default(),
            }),
            Update::UpsertMessage(MessageInfo::new(format!("{id}_next"), Role::Assistant)),
            Update::ReportUsage {
                message_id: None,
                tokens: TokenUsage {
                    input: reported,
                    ..TokenUsage::default()
                },
            },
        ];
        reported += estimate * 16 / 10;
        for u in steps {
            h.call(move |tx, _| tx.step(u, 0).map(|_| ()))
                .await
                .expect("served")
                .expect("applied");
        }
    }
}

/// A session with one message holding `bytes` of text, opened in `store`.
async fn session_of_text(store: &Store, id: &str, bytes: usize) -> SessionHandle {
    use crate::domain::{MessageInfo, Part, PartKind, Role, TextPart};
    use crate::engine::Update;
    let (handle, _) = store.open(info(id)).await.expect("open");
    handle
        .call(move |tx, _| {
            tx.step(Update::UpsertMessage(MessageInfo::new("u1", Role::User)), 0)
                .expect("message");
            let part = Part {
                id: "t1".into(),
                message_id: "u1".into(),
                kind: PartKind::Text(TextPart {
                    text: "x".repeat(bytes),
                    ..Default::default()
                }),
                mark: None,
                extra: Default::default(),
            };
            tx.step(Update::UpsertPart(part), 0).expect("part");
        })
        .await
        .expect("served");
    handle
}

/// Renders `handle`'s context from its cache; the bytes the store then counts as cached.
async fn render(store: &Store, handle: &SessionHandle) -> u64 {
    handle
        .call(|tx, _| {
            let (s, cache) = tx.with_cache();
            s.context_openai_cached(cache).json.len()
        })
        .await
        .expect("served");
    store.ledger().cached()
}

/// A rendered context counts with its session (and on its own), goes with it, and the
/// contexts of all sessions together stay within their share of the budget: past it, a
/// session keeps none rather than being refused anything.
#[tokio::test]
async fn rendered_contexts_count_with_their_session_within_their_share_of_the_budget() {
    let store = store();
    let a = session_of_text(&store, "a", 100_000).await;
    let before = store.held_bytes();
    let cached = render(&store, &a).await;
    assert!(cached > 100_000, "the text's rendering is kept: {cached}");
    assert_eq!(store.held_bytes(), before + cached);
    assert_eq!(a.held_bytes(), store.held_bytes());
    store.remove("a").await.expect("removed");
    drop(a);
    for _ in 0..100 {
        if store.held_bytes() == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!((store.held_bytes(), store.ledger().cached()), (0, 0));

    // A budget whose eighth holds one such rendering, not two.
    let store = Store::new(EngineConfig::default()).with_limits(Limits {
        memory_budget: 8 * 150_000,
        ..Limits::default()
    });
    let a = session_of_text(&store, "a", 100_000).await;
    let b = session_of_text(&store, "b", 100_000).await;
    let one = render(&store, &a).await;
    assert!(one > 100_000);
    assert_eq!(render(&store, &b).await, one, "b keeps no rendering");
    let held = b.held_bytes();
    assert_eq!(
        render(&store, &b).await,
        one,
        "and renders its context anyway"
    );
    assert_eq!(b.held_bytes(), held);
}

/// An actor's span has no parent: the request that happened to open the session is not
/// the context of everything the session logs afterwards.
#[tokio::test(flavor = "current_thread")]
async fn an_actors_span_is_not_a_child_of_the_request_that_opened_it() {
    use tracing::Instrument;
    use tracing_subscriber::registry::LookupSpan;
    let _subscriber = tracing::subscriber::set_default(tracing_subscriber::registry());
    let store = store();
    let (handle, _) = store
        .open(info("s"))
        .instrument(tracing::info_span!("rpc"))
        .await
        .expect("open");
    let id = handle
        .call(|_, _| tracing::Span::current().id())
        .await
        .expect("served")
        .expect("the job runs in a span");
    let (name, parent) = tracing::dispatcher::get_default(|d| {
        let registry = d
            .downcast_ref::<tracing_subscriber::Registry>()
            .expect("the registry");
        let span = registry.span(&id).expect("open span");
        (span.name(), span.parent().map(|p| p.name()))
    });
    assert_eq!((name, parent), ("session", None));
}

/// What a job announces (`Tx::announce_when_durable`) reaches no one once its session is
/// deleted: a job queued before the delete still runs after it, and its events would
/// follow the session's `gone` on the bus, heard by a watcher of the session created
/// again under the id. What it counts (`Tx::when_durable`) still runs. Found in review
/// (stop 68's list).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_queued_before_a_delete_announces_nothing_after_it() {
    use std::sync::{Arc, Mutex};
    let store = store();
    let (h, _) = store.open(info("s")).await.expect("open");
    let said = Arc::new(Mutex::new(Vec::<&str>::new()));
    let job = |said: &Arc<Mutex<Vec<&'static str>>>| {
        let (counted, told) = (said.clone(), said.clone());
        move |s: &mut Tx<'_>, _: &EngineConfig| {
            s.when_durable(move || counted.lock().expect("log").push("counted"));
            s.announce_when_durable(move || told.lock().expect("log").push("announced"));
        }
    };
    // The session as it is: both run, the inline path and the actor's alike.
    h.call(job(&said)).await.expect("ran");
    // A job that holds the actor until the delete is done, and one queued behind it.
    let (started, wait) = std::sync::mpsc::channel::<()>();
    let (release, held) = std::sync::mpsc::channel::<()>();
    let busy = h
        .submit(move |_, _| {
            let _ = started.send(());
            let _ = held.recv_timeout(Duration::from_secs(10));
        })
        .await
        .expect("queued");
    let queued = h.submit(job(&said)).await.expect("queued behind it");
    wait.recv_timeout(Duration::from_secs(5))
        .expect("the first job runs");
    assert!(store.remove("s").await.expect("deleted"), "it existed");
    release.send(()).expect("the job waits");
    busy.await.expect("answered").expect("ran");
    queued
        .await
        .expect("answered")
        .expect("ran after the delete");
    assert_eq!(
        *said.lock().expect("log"),
        ["counted", "announced", "counted"],
        "the deleted session's job counted, announcing nothing"
    );
    // A session under the same id announces again.
    let (again, created) = store.open(info("s")).await.expect("open again");
    assert!(created);
    again.call(job(&said)).await.expect("ran");
    assert_eq!(said.lock().expect("log").len(), 5);
}
