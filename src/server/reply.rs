//! What an op answers, typed: the engine's own reports (a step report, a context view, a
//! prune report, an overflow check). Unary handlers encode the one they asked for; the
//! stream turns any of them into its events and the ack.

use super::convert;
use super::list_value::ListValue;
use super::pb;
use super::pb::server_event::Event as Ev;
use super::status::Rejection;
use crate::engine::{ContextView, Event, OpenAiContext, OverflowCheck, PruneReport, StepReport};

/// What an open did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Opened {
    /// The session was created (not reconfigured).
    pub created: bool,
}

/// The context as the engine built it, with what its wire form needs.
#[derive(Debug)]
pub struct ContextReply {
    /// The messages to send, in the shape asked for.
    pub body: ContextBody,
    /// Messages the session holds (the context may hold fewer).
    pub session_messages: usize,
    /// The body's bytes, counted in flight until the reply is sent.
    pub _held: crate::store::Reservation,
}

/// A context reply's content.
#[derive(Debug)]
pub enum ContextBody {
    /// The view, for the native and protobuf OpenAI shapes (`format` says which).
    View {
        /// The rendered messages.
        view: ContextView,
        /// The wire format asked for.
        format: pb::ContextFormat,
    },
    /// `CONTEXT_FORMAT_OPENAI_JSON`: the OpenAI messages already serialized on the session's
    /// actor, with the view's figures.
    OpenAiJson(OpenAiContext),
    /// `CONTEXT_FORMAT_OPENAI`: the OpenAI messages already in protobuf wire form (a
    /// `ListValue`'s body) on the session's actor, with the view's figures.
    OpenAiList(OpenAiContext<ListValue>),
}

impl ContextBody {
    /// Bytes the body holds until it is sent (what its reply reserves in flight).
    pub fn held_bytes(&self) -> u64 {
        match self {
            ContextBody::View { view, .. } => view.held_bytes(),
            ContextBody::OpenAiJson(c) => c.json.capacity() as u64,
            ContextBody::OpenAiList(c) => c.json.held_bytes() as u64,
        }
    }
}

impl ContextReply {
    /// The wire form (the JSON text or values move into it).
    pub fn into_pb(self) -> pb::Context {
        let n = self.session_messages;
        match self.body {
            ContextBody::View { view, format } => convert::context_to_pb(&view, n, format),
            ContextBody::OpenAiList(c) => {
                let figures = openai_figures(&c, n);
                pb::Context {
                    openai_messages: Some(c.json),
                    ..figures
                }
            }
            ContextBody::OpenAiJson(c) => {
                let figures = openai_figures(&c, n);
                pb::Context {
                    openai_messages_json: c.json,
                    ..figures
                }
            }
        }
    }
}

/// A context reply holding only an OpenAI shape's figures (its messages are set by the
/// caller).
fn openai_figures<M>(c: &OpenAiContext<M>, session_messages: usize) -> pb::Context {
    pb::Context {
        estimated_tokens: c.tokens,
        boundary_message_id: c.boundary_message_id.clone().unwrap_or_default(),
        session_messages: u32::try_from(session_messages).unwrap_or(u32::MAX),
        context_messages: u32::try_from(c.context_messages).unwrap_or(u32::MAX),
        ..pb::Context::default()
    }
}

/// Any op's reply, for the stream (which answers every kind of op).
#[derive(Debug)]
pub enum Reply {
    /// A session was opened or reconfigured.
    Opened(Opened),
    /// An update was applied.
    Stepped(StepReport),
    /// The context.
    Context(ContextReply),
    /// A prune ran (or was dry-run).
    Pruned(PruneReport),
    /// The overflow check ran.
    Overflow(OverflowCheck),
    /// A manual compaction started: its `started` event.
    CompactionStarted(pb::CompactionEvent),
    /// The running compaction was cancelled.
    CompactionCancelled,
}

impl Reply {
    /// The events sent before the ack, and the ack's `created` flag.
    fn into_events(self) -> (Vec<Ev>, bool) {
        match self {
            Reply::Opened(o) => (Vec::new(), o.created),
            Reply::Stepped(report) => (step_events(&report), report.applied.created),
            Reply::Context(c) => (vec![Ev::Context(c.into_pb())], false),
            Reply::Pruned(r) => (vec![Ev::PruneReport(convert::prune_to_pb(&r))], false),
            Reply::Overflow(c) => (vec![Ev::OverflowCheck(convert::overflow_to_pb(&c))], false),
            Reply::CompactionStarted(e) => (vec![Ev::Compaction(e)], false),
            Reply::CompactionCancelled => (Vec::new(), false),
        }
    }
}

/// True when the engine asks the shell for an automatic compaction after this step.
pub fn needs_compaction(report: &StepReport) -> bool {
    report
        .events
        .iter()
        .any(|e| matches!(e, Event::CompactionNeeded(_)))
}

/// A step's engine events as wire events (signals meant for the server left out).
pub fn step_events(report: &StepReport) -> Vec<Ev> {
    report.events.iter().filter_map(event_to_pb).collect()
}

/// An engine event as a wire event.
fn event_to_pb(e: &Event) -> Option<Ev> {
    match e {
        Event::Overflow(c) => Some(Ev::Overflow(convert::overflow_to_pb(c))),
        Event::Pruned(r) => Some(Ev::Pruned(convert::prune_to_pb(r))),
        Event::CompactionNeeded(_) => None,
    }
}

/// An engine event as a `Subscribe` watcher sees it; `None` for signals meant for the
/// server.
pub fn bus_event(e: &Event) -> Option<pb::session_event::Event> {
    match e {
        Event::Overflow(c) => Some(pb::session_event::Event::Overflow(convert::overflow_to_pb(
            c,
        ))),
        Event::Pruned(r) => Some(pb::session_event::Event::Pruned(convert::prune_to_pb(r))),
        Event::CompactionNeeded(_) => None,
    }
}

/// Wraps an outcome into the events a stream client sees: the reply's events, then the
/// ack or the error, all carrying `seq`.
pub fn to_server_events(
    seq: u64,
    session_id: &str,
    kind: &str,
    outcome: Result<Reply, Rejection>,
) -> Vec<pb::ServerEvent> {
    let wrap = |event| pb::ServerEvent {
        seq,
        session_id: session_id.to_string(),
        event: Some(event),
    };
    match outcome {
        Ok(reply) => {
            let (events, created) = reply.into_events();
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
