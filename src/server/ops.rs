//! Operations shared by the stream and the unary twins: decode a request into an [`Op`],
//! queue it on the session's actor, and turn the engine's answer into wire events.
//!
//! Queuing and waiting are separate ([`submit`] returns a [`Pending`]) so the stream can
//! keep many updates in flight (to different sessions) while still acking in order.

use std::sync::Arc;

use prost::Message as _;
use tokio::sync::oneshot;

use super::clock::now_ms;
use super::convert;
use super::hub::Hub;
use super::pb;
use super::pb::server_event::Event as Ev;
use super::status::Rejection;
use crate::domain::SessionInfo;
use crate::engine::{self, Event, PruneMode, Trigger, Update};

/// Default largest update accepted (`max_update_bytes`).
pub const DEFAULT_MAX_UPDATE_BYTES: usize = 16 * 1024 * 1024;

/// A decoded request for one session.
#[derive(Debug)]
pub enum Op {
    /// Open or reconfigure.
    Open(SessionInfo),
    /// Change the session.
    Apply(Update),
    /// Build the context.
    Context(pb::ContextFormat),
    /// Run prune.
    Prune {
        /// Report only.
        dry_run: bool,
    },
    /// Run the overflow check.
    CheckOverflow,
    /// Start a manual compaction (handled by the stream itself, which owns its events).
    Compact(super::compaction::Options),
    /// Stop the running compaction.
    CancelCompaction,
}

impl Op {
    /// Name used in acks, logs and metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Op::Open(_) => "open",
            Op::Apply(u) => u.kind(),
            Op::Context(_) => "get_context",
            Op::Prune { .. } => "prune",
            Op::CheckOverflow => "check_overflow",
            Op::Compact(_) => "compact",
            Op::CancelCompaction => "cancel_compaction",
        }
    }
}

/// The result of one op: events for the client (the ack or error is added by the caller).
pub type Outcome = Result<Done, Rejection>;

/// What an applied op produced.
#[derive(Debug, Default)]
pub struct Done {
    /// Events for the client, before the ack.
    pub events: Vec<Ev>,
    /// The op created something (session, message, part).
    pub created: bool,
    /// The engine asks for an automatic compaction (started after the ack).
    pub compact: bool,
}

impl Done {
    /// Just these events.
    pub fn events(events: Vec<Ev>) -> Done {
        Done {
            events,
            ..Done::default()
        }
    }
}

/// An op in flight: already answered, or waiting on its session's actor.
pub enum Pending {
    /// Answered without the actor (validation errors, session creation).
    Ready(Outcome),
    /// Queued on the actor; engine rejections get the field prefix when they arrive.
    Queued(oneshot::Receiver<Outcome>, &'static str),
}

impl Pending {
    /// Waits for the outcome.
    pub async fn outcome(self, session_id: &str) -> Outcome {
        match self {
            Pending::Ready(o) => o,
            Pending::Queued(rx, prefix) => rx
                .await
                .map_err(|_| {
                    Rejection::from(crate::store::StoreError::Closed(session_id.to_string()))
                })?
                .map_err(|r| r.within(prefix)),
        }
    }
}

/// Rejects an update larger than `max` bytes, naming the limit.
pub fn check_size(len: usize, max: usize) -> Result<(), Rejection> {
    if len > max {
        return Err(Rejection::too_large(
            "",
            format!("update is {len} bytes, over the max_update_bytes limit of {max} bytes"),
        ));
    }
    Ok(())
}

/// Decodes a stream update. Field names in errors are relative to the update
/// (`upsert_part.tool.state.status`).
pub fn decode_update(u: pb::ClientUpdate, max: usize) -> Result<Op, Rejection> {
    use pb::client_update::Update as U;
    check_size(u.encoded_len(), max)?;
    if u.session_id.is_empty() {
        return Err(Rejection::invalid("session_id", "required"));
    }
    let Some(update) = u.update else {
        return Err(Rejection::invalid(
            "update",
            "required: one of open, upsert_message, upsert_part, delete_part, report_usage, get_context, prune, check_overflow",
        ));
    };
    Ok(match update {
        U::Open(info) => {
            Op::Open(convert::session_from_pb(info, &u.session_id).map_err(|r| r.within("open"))?)
        }
        U::UpsertMessage(m) => Op::Apply(Update::UpsertMessage(
            convert::message_from_pb(m).map_err(|r| r.within("upsert_message"))?,
        )),
        U::UpsertPart(p) => Op::Apply(Update::UpsertPart(
            convert::part_from_pb(p).map_err(|r| r.within("upsert_part"))?,
        )),
        U::DeletePart(r) => {
            op_delete(r.message_id, r.part_id).map_err(|e| e.within("delete_part"))?
        }
        U::ReportUsage(r) => op_usage(r).map_err(|e| e.within("report_usage"))?,
        U::GetContext(c) => {
            Op::Context(context_format(c.format).map_err(|r| r.within("get_context"))?)
        }
        U::Prune(p) => Op::Prune { dry_run: p.dry_run },
        U::CheckOverflow(_) => Op::CheckOverflow,
        U::Compact(o) => Op::Compact(o.into()),
        U::CancelCompaction(_) => Op::CancelCompaction,
    })
}

/// Decodes a delete.
pub fn op_delete(message_id: String, part_id: String) -> Result<Op, Rejection> {
    if message_id.is_empty() {
        return Err(Rejection::invalid("message_id", "required"));
    }
    if part_id.is_empty() {
        return Err(Rejection::invalid("part_id", "required"));
    }
    Ok(Op::Apply(Update::DeletePart {
        message_id,
        part_id,
    }))
}

/// Decodes a usage report.
pub fn op_usage(r: pb::UsageReport) -> Result<Op, Rejection> {
    let Some(tokens) = r.tokens else {
        return Err(Rejection::invalid("tokens", "required"));
    };
    let message_id = (!r.message_id.is_empty()).then_some(r.message_id);
    Ok(Op::Apply(Update::ReportUsage {
        message_id,
        tokens: convert::usage_from_pb(tokens),
    }))
}

/// Validates a context format value.
pub fn context_format(v: i32) -> Result<pb::ContextFormat, Rejection> {
    pb::ContextFormat::try_from(v)
        .map_err(|_| Rejection::invalid("format", format!("unknown context format {v}")))
}

/// Where a request's payload sits, so an engine rejection names the field as the client
/// wrote it: `upsert_part.message_id` on the stream, `part.message_id` in `UpsertPart`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// A `ClientUpdate` on the stream: fields under the update's oneof name.
    Stream,
    /// A unary request: fields under the request's payload field.
    Unary,
}

impl Op {
    /// The field the op's payload sits in, for error names.
    fn payload_field(&self, scope: Scope) -> &'static str {
        match (scope, self) {
            (Scope::Stream, op) => op.kind(),
            (Scope::Unary, Op::Open(_)) => "session",
            (Scope::Unary, Op::Apply(Update::UpsertMessage(_))) => "message",
            (Scope::Unary, Op::Apply(Update::UpsertPart(_))) => "part",
            (Scope::Unary, Op::Apply(Update::ReportUsage { .. })) => "usage",
            (Scope::Unary, _) => "",
        }
    }
}

/// Queues `op` for `session_id`. Returns once the op is in the session's mailbox (or
/// answered), so the caller may queue the next one before this one completes.
pub async fn submit(hub: &Arc<Hub>, session_id: &str, op: Op, scope: Scope) -> Pending {
    let prefix = op.payload_field(scope);
    match submit_op(hub, session_id, op).await {
        // `session_id` sits beside the payload, not in it.
        Pending::Ready(Err(r)) if r.field != "session_id" => Pending::Ready(Err(r.within(prefix))),
        Pending::Queued(rx, _) => Pending::Queued(rx, prefix),
        other => other,
    }
}

async fn submit_op(hub: &Arc<Hub>, session_id: &str, op: Op) -> Pending {
    let store = &hub.store;
    let handle = match &op {
        Op::Open(info) => {
            if let Some(m) = &info.config.compaction_model
                && let Err(r) = hub.compaction.check_model("config.compaction_model", m)
            {
                return Pending::Ready(Err(r));
            }
            let (handle, created) = match store.open(info.clone()) {
                Ok(h) => h,
                Err(e) => return Pending::Ready(Err(e.into())),
            };
            if created {
                return Pending::Ready(Ok(Done {
                    created: true,
                    ..Done::default()
                }));
            }
            handle
        }
        _ => match store.get(session_id) {
            Ok(h) => h,
            Err(e) => return Pending::Ready(Err(e.into())),
        },
    };
    match op {
        Op::Open(info) => {
            queue(&handle, move |s, c| {
                engine::step(s, Update::Configure(info), c, now_ms())
                    .map(|_| Done::default())
                    .map_err(Rejection::from)
            })
            .await
        }
        Op::Apply(update) => {
            let hub = hub.clone();
            let sid = session_id.to_string();
            queue(&handle, move |s, c| {
                let kind = update.kind();
                let began = std::time::Instant::now();
                let report = engine::step(s, update, c, now_ms());
                crate::telemetry::update(kind, report.is_ok(), began.elapsed());
                let report = report?;
                let mut done = Done {
                    created: report.applied.created,
                    ..Done::default()
                };
                for e in &report.events {
                    match e {
                        Event::Overflow(check) => crate::telemetry::overflow(check),
                        Event::Pruned(r) => crate::telemetry::pruned(r, "auto"),
                        _ => {}
                    }
                    done.compact |= matches!(e, Event::CompactionNeeded(_));
                    if let Some(b) = bus_event(e) {
                        hub.publish(&sid, b);
                    }
                    done.events.extend(event_to_pb(e));
                }
                Ok(done)
            })
            .await
        }
        Op::Compact(options) => {
            // Outside a stream (which starts compactions itself) there is no sink.
            match super::compaction::start(hub, session_id, options, None, None).await {
                Ok(started) => Pending::Ready(Ok(Done::events(vec![Ev::Compaction(started)]))),
                Err(r) => Pending::Ready(Err(r)),
            }
        }
        Op::CancelCompaction => match hub.cancel(session_id) {
            Some(id) => {
                tracing::info!(session_id, compaction_id = %id, "compaction cancelled by the client");
                Pending::Ready(Ok(Done::default()))
            }
            None => Pending::Ready(Err(Rejection {
                code: tonic::Code::NotFound,
                field: String::new(),
                message: format!("no compaction is running for session {session_id}"),
            })),
        },
        Op::Context(format) => {
            queue(&handle, move |s, _| {
                let view = s.build_context();
                Ok(Done::events(vec![Ev::Context(convert::context_to_pb(
                    &view,
                    s.messages().len(),
                    format,
                ))]))
            })
            .await
        }
        Op::Prune { dry_run } => {
            queue(&handle, move |s, _| {
                let mode = if dry_run {
                    PruneMode::DryRun
                } else {
                    PruneMode::Commit
                };
                let report = s.prune(mode, now_ms());
                crate::telemetry::pruned(&report, "request");
                Ok(Done::events(vec![Ev::PruneReport(convert::prune_to_pb(
                    &report,
                ))]))
            })
            .await
        }
        Op::CheckOverflow => {
            queue(&handle, move |s, _| {
                let check = s.check_overflow(Trigger::Request);
                Ok(Done::events(vec![Ev::OverflowCheck(
                    convert::overflow_to_pb(&check),
                )]))
            })
            .await
        }
    }
}

async fn queue<F>(handle: &crate::store::SessionHandle, f: F) -> Pending
where
    F: FnOnce(&mut engine::Session, &crate::config::EngineConfig) -> Outcome + Send + 'static,
{
    match handle.submit(f).await {
        Ok(rx) => Pending::Queued(rx, ""),
        Err(e) => Pending::Ready(Err(e.into())),
    }
}

/// An engine event as a watcher sees it; `None` for signals meant for the server.
fn bus_event(e: &Event) -> Option<pb::session_event::Event> {
    match e {
        Event::Overflow(c) => Some(pb::session_event::Event::Overflow(convert::overflow_to_pb(
            c,
        ))),
        Event::Pruned(r) => Some(pb::session_event::Event::Pruned(convert::prune_to_pb(r))),
        Event::CompactionNeeded(_) => None,
    }
}

/// An engine event as a wire event.
pub fn event_to_pb(e: &Event) -> Option<Ev> {
    match e {
        Event::Overflow(c) => Some(Ev::Overflow(convert::overflow_to_pb(c))),
        Event::Pruned(r) => Some(Ev::Pruned(convert::prune_to_pb(r))),
        Event::CompactionNeeded(_) => None,
    }
}

/// Wraps an outcome into the events a stream client sees: the events, then the ack or
/// the error, all carrying `seq`.
pub fn to_server_events(
    seq: u64,
    session_id: &str,
    kind: &str,
    outcome: Outcome,
) -> Vec<pb::ServerEvent> {
    let wrap = |event| pb::ServerEvent {
        seq,
        session_id: session_id.to_string(),
        event: Some(event),
    };
    match outcome {
        Ok(Done {
            events, created, ..
        }) => {
            let mut out: Vec<_> = events.into_iter().map(wrap).collect();
            out.push(wrap(Ev::Ack(pb::Ack {
                kind: kind.to_string(),
                created,
            })));
            out
        }
        Err(r) => vec![wrap(Ev::Error(r.into()))],
    }
}
