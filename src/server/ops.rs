//! Running ops on sessions: look the session up, queue the op on its actor, and hand back
//! the engine's typed reply. One function per op for the unary twins (each returns the
//! reply its handler encodes), and [`submit`] for the stream, which answers any op.
//!
//! Queuing and waiting are separate (each call returns a [`Pending`]) so the stream can
//! keep many updates in flight (to different sessions) while still acking in order.

use std::sync::Arc;

use tokio::sync::oneshot;

use super::clock::now_ms;
use super::compaction;
use super::counting;
use super::hub::Hub;
use super::reply::{self, ContextBody, ContextReply, Opened, Reply};
use super::request::Op;
use super::status::Rejection;
use crate::config::EngineConfig;
use crate::domain::{Part, SessionInfo};
use crate::engine::{
    Event, Generation, OverflowCheck, PruneMode, PruneReport, RecallKey, Recalled, StepReport,
    Trail, Trigger, Update, counted_texts,
};
use crate::store::{SessionHandle, StoreError, Tx};

/// An op in flight: already answered, or waiting on its session's actor.
#[derive(Debug)]
pub struct Pending<T> {
    state: State<T>,
    /// Where the request's payload sits: engine rejections get it before their field.
    prefix: &'static str,
}

#[derive(Debug)]
enum State<T> {
    /// Answered without the actor (validation errors, session creation, a job run inline).
    /// Boxed: a reply can be large while a queued op is one pointer.
    Ready(Box<Result<T, Rejection>>),
    /// Queued on the actor.
    Queued(oneshot::Receiver<Result<Result<T, Rejection>, StoreError>>),
}

impl<T> Pending<T> {
    /// An outcome known without the actor (a decoding error, a compaction's start), as it
    /// is: its field names are already the client's.
    pub fn answered(outcome: Result<T, Rejection>) -> Pending<T> {
        Pending {
            state: State::Ready(Box::new(outcome)),
            prefix: "",
        }
    }

    /// Answered already. A rejection gets the payload's prefix, unless it names the
    /// `session_id`, which sits beside the payload, not in it.
    fn ready(outcome: Result<T, Rejection>, prefix: &'static str) -> Pending<T> {
        let outcome = outcome.map_err(|r| r.within_payload(prefix));
        Pending {
            state: State::Ready(Box::new(outcome)),
            prefix,
        }
    }

    /// Waits for the outcome.
    pub async fn outcome(self, session_id: &str) -> Result<T, Rejection> {
        match self.state {
            State::Ready(o) => *o,
            State::Queued(rx) => rx
                .await
                .map_err(|_| Rejection::from(StoreError::Closed(session_id.to_string())))?
                .map_err(Rejection::from)?
                .map_err(|r| r.within(self.prefix)),
        }
    }
}

/// Applies an update; rejections name fields under the request's payload field
/// (`part.message_id`).
pub async fn apply(hub: &Arc<Hub>, session_id: &str, update: Update) -> Pending<StepReport> {
    let prefix = match &update {
        Update::UpsertMessage(_) => "message",
        Update::UpsertPart(_) => "part",
        Update::ReportUsage { .. } => "usage",
        _ => "",
    };
    apply_as(
        hub,
        session_id,
        prefix,
        Box::new(update),
        false,
        std::convert::identity,
    )
    .await
}

/// Queues `update` on its session, its long texts counted first off the async workers
/// (unless `counted_ahead`: [`count_ahead`] already put them in the count cache).
async fn apply_as<R: Send + 'static>(
    hub: &Arc<Hub>,
    session_id: &str,
    prefix: &'static str,
    update: Box<Update>,
    counted_ahead: bool,
    wrap: impl FnOnce(StepReport) -> R + Send + 'static,
) -> Pending<R> {
    let handle = match hub.store.get(session_id).await {
        Ok(handle) => handle,
        Err(e) => return Pending::ready(Err(e.into()), prefix),
    };
    if !counted_ahead {
        precount(hub, &handle, &update).await;
    }
    let job = step(hub, session_id, update);
    queue(hub, session_id, &handle, prefix, move |s, c| {
        job(s, c).map(wrap)
    })
    .await
}

/// Counts a new part's long texts with the session's tokenizer on the counting threads,
/// so the count its actor takes is a cache hit: real BPE runs at ~40 MB/s, and a 20 KB
/// tool output would otherwise hold a runtime worker for half a millisecond.
async fn precount(hub: &Hub, handle: &SessionHandle, update: &Update) {
    let Update::UpsertPart(part) = update else {
        return;
    };
    if let Some(mut counting) = start_count(hub, handle, part) {
        counting.done().await;
    }
}

/// Starts counting a stream update's long texts when its session is in memory, so a
/// stream counts the next updates on other cores while this one waits for its turn;
/// what it counts lands in the count cache, and the update's own [`submit`] finds it
/// there. None: nothing to count (or the session is not in memory).
pub fn count_ahead(hub: &Hub, session_id: &str, op: &Op) -> Option<counting::Queued> {
    let Op::Apply(update) = op else {
        return None;
    };
    let Update::UpsertPart(part) = &**update else {
        return None;
    };
    start_count(hub, &hub.store.hot(session_id)?, part)
}

/// Queues the count of `part`'s long texts not cached yet (None: all cached, which
/// chars/4 always is).
fn start_count(hub: &Hub, handle: &SessionHandle, part: &Part) -> Option<counting::Queued> {
    let counting = handle.counting();
    if counting.is_cheap() {
        return None;
    }
    let counter = counting.counter();
    let texts: Vec<String> = counted_texts(part)
        .into_iter()
        .filter(|t| !counter.is_cached(t))
        .map(std::borrow::Cow::into_owned)
        .collect();
    if texts.is_empty() {
        return None;
    }
    // The copies wait in the counting queue, counted in flight; past the in-flight share
    // the session's actor counts the texts itself.
    let bytes = texts
        .iter()
        .map(|t| t.len() as u64)
        .fold(0u64, u64::saturating_add);
    let held = hub.store.ledger().reserve(bytes, "counts").ok()?;
    Some(hub.count_pool.count(counter, texts, held))
}

/// Builds the context.
pub async fn context(
    hub: &Arc<Hub>,
    session_id: &str,
    format: super::pb::ContextFormat,
) -> Pending<ContextReply> {
    on_session(hub, session_id, "", build_context(hub, format, 0)).await
}

/// Runs prune, or reports what it would do.
pub async fn prune(hub: &Arc<Hub>, session_id: &str, dry_run: bool) -> Pending<PruneReport> {
    on_session(hub, session_id, "", run_prune(hub, session_id, dry_run)).await
}

/// Runs the overflow check.
pub async fn check_overflow(hub: &Arc<Hub>, session_id: &str) -> Pending<OverflowCheck> {
    on_session(hub, session_id, "", overflow_check).await
}

/// The message order and compactions of a session an import with `keep_compactions`
/// replaces (`engine::Trail`).
pub async fn compaction_trail(hub: &Arc<Hub>, session_id: &str) -> Pending<Trail> {
    on_session(hub, session_id, "", |s, _| Ok(s.compaction_trail())).await
}

/// Recalls a part's original content; NOT_FOUND names the key's field when no part has
/// that id.
pub async fn recall(hub: &Arc<Hub>, session_id: &str, key: RecallKey) -> Pending<Recalled> {
    on_session(hub, session_id, "", move |s, _| {
        s.recall(&key).ok_or_else(|| Rejection {
            code: tonic::Code::NotFound,
            field: key.field().to_string(),
            message: format!("no part with {} {}", key.field(), key.id()),
        })
    })
    .await
}

/// Queues a stream update's op for `session_id`; rejections name fields under the
/// update's oneof name (`upsert_part.message_id`). Returns once the op is in the session's
/// mailbox (or answered), so the caller may queue the next one before this one completes.
/// `counted_ahead`: its long texts were counted by [`count_ahead`] (not counted again; if
/// that count failed, or an update between changed the tokenizer, the actor counts them).
/// `held`: the bytes the update itself holds in flight until it is answered.
pub async fn submit(
    hub: &Arc<Hub>,
    session_id: &str,
    op: Op,
    counted_ahead: bool,
    held: u64,
) -> Pending<Reply> {
    let prefix = op.kind();
    match op {
        Op::Open(info) => open_as(hub, *info, prefix, Reply::Opened).await,
        Op::Apply(update) => {
            apply_as(
                hub,
                session_id,
                prefix,
                update,
                counted_ahead,
                Reply::Stepped,
            )
            .await
        }
        Op::Context(format) => {
            let job = build_context(hub, format, held);
            on_session(hub, session_id, prefix, move |s, c| {
                job(s, c).map(Reply::Context)
            })
            .await
        }
        Op::Prune { dry_run } => {
            let job = run_prune(hub, session_id, dry_run);
            on_session(hub, session_id, prefix, move |s, c| {
                job(s, c).map(Reply::Pruned)
            })
            .await
        }
        Op::CheckOverflow => {
            on_session(hub, session_id, prefix, move |s, c| {
                overflow_check(s, c).map(Reply::Overflow)
            })
            .await
        }
        Op::Compact(options) => {
            // Without a sink: the events go to Subscribe watchers only.
            let started = compaction::start(hub, session_id, options, None, None).await;
            Pending::ready(started.map(Reply::CompactionStarted), prefix)
        }
        Op::CancelCompaction => Pending::ready(
            cancel_compaction(hub, session_id).map(|()| Reply::CompactionCancelled),
            prefix,
        ),
    }
}

/// Stops the session's running compaction.
pub fn cancel_compaction(hub: &Hub, session_id: &str) -> Result<(), Rejection> {
    match hub.cancel(session_id) {
        Some(id) => {
            tracing::info!(session_id, compaction_id = %id, "compaction cancelled by the client");
            Ok(())
        }
        None => Err(Rejection {
            code: tonic::Code::NotFound,
            field: String::new(),
            message: format!("no compaction is running for session {session_id}"),
        }),
    }
}

/// Stops the running compaction of a session that was deleted or replaced by an import:
/// its summary describes messages the session no longer holds (its commit would be
/// refused as stale), so its LLM request stops now rather than at its end. `now` is the
/// session value the id holds now (the import's; after a delete, a re-created one, see
/// [`generation_held`]): a compaction of that value, started while the delete or the
/// import was being written, goes on.
pub fn cancel_replaced(hub: &Hub, session_id: &str, now: Option<Generation>, why: &'static str) {
    if let Some(id) = hub.cancel_replaced(session_id, now) {
        tracing::info!(session_id, compaction_id = %id, why, "compaction cancelled");
    }
}

/// The session value `session_id` names now, when it is in memory: after a delete, a
/// session created again under the id while the delete was being written. `None` when
/// none is: a compaction still running then summarizes a value the id no longer holds
/// (deleted), or one sent to disk, which the store brings back as the same value when it
/// loads it in this process (`Map::resume`).
pub async fn generation_held(hub: &Hub, session_id: &str) -> Option<Generation> {
    let handle = hub.store.hot(session_id)?;
    handle.call(|s, _| s.generation()).await.ok()
}

/// Opens `info`'s session: created on the spot, or reconfigured on its actor.
async fn open_as<R: Send + 'static>(
    hub: &Arc<Hub>,
    info: SessionInfo,
    prefix: &'static str,
    wrap: impl FnOnce(Opened) -> R + Send + 'static,
) -> Pending<R> {
    let id = info.id.clone();
    match made(hub, info.clone(), prefix).await {
        Ok((_, true)) => Pending::ready(Ok(wrap(Opened { created: true })), prefix),
        Ok((handle, false)) => {
            queue(hub, &id, &handle, prefix, move |s, _| {
                configure(s, info).map(|()| wrap(Opened { created: false }))
            })
            .await
        }
        Err(pending) => pending,
    }
}

/// Opens (or reconfigures) a session and answers its summary (OpenSession's reply;
/// rejections name fields under `session`): read by the job that reconfigured it, or
/// through the handle of the session the open created, never by looking its id up
/// again. A delete between the open and a second look-up made an open that was applied
/// answer NOT_FOUND.
pub async fn open_summary(hub: &Arc<Hub>, info: SessionInfo) -> Pending<super::pb::SessionSummary> {
    const PREFIX: &str = "session";
    let id = info.id.clone();
    match made(hub, info.clone(), PREFIX).await {
        Ok((handle, true)) => Pending::ready(summary_of(hub, &handle, true).await, PREFIX),
        Ok((handle, false)) => {
            queue(hub, &id, &handle, PREFIX, move |s, _| {
                configure(s, info).map(|()| super::convert::summary_to_pb(s, false))
            })
            .await
        }
        Err(pending) => pending,
    }
}

/// The session `info` opens, and whether the open created it (else it is to be
/// reconfigured); a refusal as the caller's answer.
async fn made<R>(
    hub: &Hub,
    info: SessionInfo,
    prefix: &'static str,
) -> Result<(SessionHandle, bool), Pending<R>> {
    if let Some(m) = &info.config.compaction_model
        && let Err(r) = hub.compaction.check_model("config.compaction_model", m)
    {
        return Err(Pending::ready(Err(r), prefix));
    }
    hub.store
        .open(info)
        .await
        .map_err(|e| Pending::ready(Err(e.into()), prefix))
}

/// Reconfigures an open session with `info` (the actor's side of an open that found it).
fn configure(s: &mut Tx<'_>, info: SessionInfo) -> Result<(), Rejection> {
    let update = Update::Configure(info);
    crate::telemetry::update(update.kind(), || s.step(update, now_ms()))
        .map(|_| ())
        .map_err(Rejection::from)
}

/// Queues `job` on the session's actor.
async fn on_session<T, J>(hub: &Hub, session_id: &str, prefix: &'static str, job: J) -> Pending<T>
where
    T: Send + 'static,
    J: FnOnce(&mut Tx<'_>, &EngineConfig) -> Result<T, Rejection> + Send + 'static,
{
    match hub.store.get(session_id).await {
        Ok(handle) => queue(hub, session_id, &handle, prefix, job).await,
        Err(e) => Pending::ready(Err(e.into()), prefix),
    }
}

/// Runs `job` on the session: at once on this task when its actor is idle
/// (`SessionHandle::try_run`), else queued on the actor. A session sent cold between the
/// caller's `get` and here (its idle TTL or the memory budget) is loaded back and the job
/// queued there: the client never hears "does not exist" about a session on disk.
async fn queue<T, J>(
    hub: &Hub,
    session_id: &str,
    handle: &SessionHandle,
    prefix: &'static str,
    job: J,
) -> Pending<T>
where
    T: Send + 'static,
    J: FnOnce(&mut Tx<'_>, &EngineConfig) -> Result<T, Rejection> + Send + 'static,
{
    let job = match handle.try_run(job) {
        // As `Pending::outcome` maps a queued job's result.
        Ok(ran) => {
            let outcome = match ran {
                Ok(outcome) => outcome.map_err(|r| r.within(prefix)),
                Err(e) => Err(Rejection::from(e)),
            };
            return Pending {
                state: State::Ready(Box::new(outcome)),
                prefix,
            };
        }
        Err(job) => job,
    };
    let (mut handle, mut job, mut loads) = (handle.clone(), job, 0);
    loop {
        match handle.try_submit(job).await {
            Ok(rx) => {
                return Pending {
                    state: State::Queued(rx),
                    prefix,
                };
            }
            Err((StoreError::NotFound(_), back)) if loads < MAX_RELOADS => {
                loads += 1;
                job = back;
                handle = match hub.store.get(session_id).await {
                    Ok(h) => h,
                    Err(e) => return Pending::ready(Err(e.into()), prefix),
                };
            }
            Err((e, _)) => return Pending::ready(Err(e.into()), prefix),
        }
    }
}

/// Times a job follows its session back from disk before giving up (each time it was sent
/// cold again between the load and the queueing).
const MAX_RELOADS: u32 = 3;

/// The actor's side of an update: apply it, count it, and publish what the engine noticed
/// to the watchers (from the actor, so the bus keeps the session's order, once the update
/// is durable: under `sync` a change the disk refuses is undone, and watchers must not
/// have heard of it).
fn step(
    hub: &Arc<Hub>,
    session_id: &str,
    update: Box<Update>,
) -> impl FnOnce(&mut Tx<'_>, &EngineConfig) -> Result<StepReport, Rejection> + Send + 'static {
    let hub = hub.clone();
    let sid = session_id.to_string();
    move |s, _| {
        let kind = update.kind();
        let report = crate::telemetry::update(kind, || s.step(*update, now_ms()))?;
        for e in &report.events {
            match e {
                Event::Overflow(check) => {
                    let check = check.clone();
                    s.when_durable(move || crate::telemetry::overflow(&check));
                }
                Event::Pruned(r) => {
                    let r = r.clone();
                    s.when_durable(move || crate::telemetry::pruned(&r, "auto"));
                }
                Event::CompactionNeeded(_) => {}
            }
            if let Some(b) = reply::bus_event(e) {
                let (hub, sid) = (hub.clone(), sid.clone());
                s.announce_when_durable(move || hub.publish(&sid, b));
            }
        }
        Ok(report)
    }
}

/// Builds the context inside the actor. The view is held until the reply is sent (a
/// stream's replies wait in order behind a slow client), so its bytes are reserved in
/// flight; past the in-flight share the request is `RESOURCE_EXHAUSTED`, unless nothing
/// else is in flight (but the request's own `own` bytes): a session whose context is
/// larger than the share can still be read back, alone, as GetSession's reply can.
fn build_context(
    hub: &Arc<Hub>,
    format: super::pb::ContextFormat,
    own: u64,
) -> impl FnOnce(&mut Tx<'_>, &EngineConfig) -> Result<ContextReply, Rejection> + Send + 'static {
    let ledger = hub.store.ledger().clone();
    move |s, _| {
        let (session, cache) = s.with_cache();
        let body = ContextBody::of(session, cache, format);
        let held = ledger.reserve_or_alone_beside(body.held_bytes(), "contexts", own)?;
        Ok(ContextReply {
            body,
            session_messages: s.messages().len(),
            held,
        })
    }
}

/// A prune on request (the unary `Prune`, a Stream's `prune` update). One that changed
/// the session is published to Subscribe watchers as a `pruned` event once durable, as
/// an automatic one is ([`step`]); a dry run, or a run that found nothing, is not.
fn run_prune(
    hub: &Arc<Hub>,
    session_id: &str,
    dry_run: bool,
) -> impl FnOnce(&mut Tx<'_>, &EngineConfig) -> Result<PruneReport, Rejection> + Send + 'static {
    let hub = hub.clone();
    let sid = session_id.to_string();
    move |s, _| {
        let mode = if dry_run {
            PruneMode::DryRun
        } else {
            PruneMode::Commit
        };
        let report = s.prune(mode, now_ms());
        let counted = report.clone();
        s.when_durable(move || crate::telemetry::pruned(&counted, "request"));
        if report.changed() {
            let event =
                super::pb::session_event::Event::Pruned(super::convert::prune_to_pb(&report));
            s.announce_when_durable(move || hub.publish(&sid, event));
        }
        Ok(report)
    }
}

fn overflow_check(s: &mut Tx<'_>, _: &EngineConfig) -> Result<OverflowCheck, Rejection> {
    Ok(s.check_overflow(Trigger::Request))
}

/// The summary of the session behind `handle` (one an open created or an import placed):
/// read through its handle, not by looking the id up again, which a delete in between
/// would answer NOT_FOUND, or a session re-created under the id with its own summary.
/// Only a session sent cold meanwhile is looked up again (and loaded). A read: a closing
/// store still answers it, as the session it describes is among those it writes.
pub async fn summary_of(
    hub: &Hub,
    handle: &SessionHandle,
    created: bool,
) -> Result<super::pb::SessionSummary, Rejection> {
    let read = move |s: &mut Tx<'_>, _: &EngineConfig| super::convert::summary_to_pb(s, created);
    let rx = match handle.look(read).await {
        Err(StoreError::NotFound(id)) => hub.store.get(&id).await?.look(read).await?,
        other => other?,
    };
    let id = handle.id();
    rx.await
        .map_err(|_| Rejection::from(StoreError::Closed(id.to_string())))?
        .map_err(Rejection::from)
}
