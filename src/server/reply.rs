//! What an op answers, typed: the engine's own reports (a step report, a context view, a
//! prune report, an overflow check). Unary handlers encode the one they asked for; the
//! stream turns any of them into its events and the ack.

use std::sync::Arc;

use super::convert;
use super::list_value::ListValue;
use super::pb;
use super::pb::server_event::Event as Ev;
use super::status::Rejection;
use super::wire_value::list_body;
use crate::engine::{
    ContextCache, Event, JsonArray, NativeContext, OpenAiContext, OverflowCheck, PruneReport,
    Session, StepReport,
};

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
    pub held: crate::store::Reservation,
}

/// A context reply's content.
#[derive(Debug)]
pub enum ContextBody {
    /// The native messages as their encoded bodies (shared with the session's context
    /// cache), and for `CONTEXT_FORMAT_UNSPECIFIED` the protobuf OpenAI messages too.
    Native {
        /// The messages' bodies, with the context's figures.
        native: NativeContext<Arc<[u8]>>,
        /// The OpenAI messages in wire form, when both shapes were asked for.
        openai: Option<ListValue>,
    },
    /// `CONTEXT_FORMAT_OPENAI_JSON`: the OpenAI messages serialized on the session's actor,
    /// as the JSON array's elements shared with its cache, with the view's figures.
    OpenAiJson(OpenAiContext<JsonArray>),
    /// `CONTEXT_FORMAT_OPENAI`: the OpenAI messages already in protobuf wire form (a
    /// `ListValue`'s body) on the session's actor, with the view's figures.
    OpenAiList(OpenAiContext<ListValue>),
}

impl ContextBody {
    /// The context of `s` in `format`, built from parts borrowed from the session (on its
    /// actor: this is the only place a context's reply is made). Every shape renders only
    /// the messages changed since `cache` last saw them.
    pub fn of(s: &Session, cache: &mut ContextCache, format: pb::ContextFormat) -> ContextBody {
        use pb::ContextFormat as F;
        match format {
            F::OpenaiJson => ContextBody::OpenAiJson(s.context_openai_json_array(cache)),
            F::Openai => ContextBody::OpenAiList(openai_list(s, cache)),
            F::Native | F::Unspecified => ContextBody::Native {
                native: native(s, cache),
                openai: (format == F::Unspecified).then(|| openai_list(s, cache).json),
            },
        }
    }

    /// Bytes the body holds until it is sent (what its reply reserves in flight).
    pub fn held_bytes(&self) -> u64 {
        match self {
            ContextBody::Native { native, openai } => native
                .held_bytes
                .saturating_add(openai.as_ref().map_or(0, |o| o.held_bytes() as u64)),
            ContextBody::OpenAiJson(c) => c.json.text_len() as u64,
            ContextBody::OpenAiList(c) => c.json.held_bytes() as u64,
        }
    }

    /// The wire form (the messages, JSON text or values move into it).
    pub fn into_pb(self, session_messages: usize) -> pb::Context {
        let n = session_messages;
        match self {
            ContextBody::Native { native, openai } => pb::Context {
                estimated_tokens: native.tokens,
                boundary_message_id: native.boundary_message_id.unwrap_or_default(),
                session_messages: u32::try_from(n).unwrap_or(u32::MAX),
                context_messages: u32::try_from(native.messages.len()).unwrap_or(u32::MAX),
                messages_encoded: native.messages,
                openai_messages: openai,
                ..pb::Context::default()
            },
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
                    openai_messages_json_array: Some(c.json),
                    ..figures
                }
            }
        }
    }
}

impl ContextReply {
    /// The wire form (the messages, JSON text or values move into it).
    pub fn into_pb(self) -> pb::Context {
        self.body.into_pb(self.session_messages)
    }

    /// The wire form and the reservation of its bytes, to be held until it is sent.
    pub fn into_parts(self) -> (pb::Context, crate::store::Reservation) {
        (self.body.into_pb(self.session_messages), self.held)
    }
}

/// The context's OpenAI messages as a protobuf `ListValue` in wire form, one chunk per
/// message, each rendered only when the message changed since `cache` last saw it.
fn openai_list(s: &Session, cache: &mut ContextCache) -> OpenAiContext<ListValue> {
    let c = s.context_openai_chunks(cache, "openai_list", |m, out| match list_body(m) {
        Ok(body) => out.extend_from_slice(&body),
        Err(e) => tracing::warn!(error = %e, "a message could not be written as protobuf values"),
    });
    OpenAiContext {
        json: ListValue::from_chunks(c.json),
        tokens: c.tokens,
        context_messages: c.context_messages,
        boundary_message_id: c.boundary_message_id,
    }
}

/// The context's native messages, each carried as its encoded body, rendered only when
/// the message changed since `cache` last saw it.
fn native(s: &Session, cache: &mut ContextCache) -> NativeContext<Arc<[u8]>> {
    use prost::Message as _;
    s.context_native_chunks(cache, "native", |info, parts, out| {
        let m = convert::sent_message_to_pb(info, parts);
        out.reserve(m.encoded_len());
        m.encode_raw(out);
    })
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
    // An id past the bound was refused for it: not echoed (a client may send megabytes).
    let session_id = match session_id.len() {
        n if n > crate::domain::MAX_ID_BYTES => "",
        _ => session_id,
    };
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

#[cfg(test)]
mod tests {
    use prost::Message as _;

    use super::ContextBody;
    use crate::engine::{ContextCache, json_len_hint};
    use crate::server::test_traces::each_trace_session;
    use crate::server::{convert, pb, wire_value};

    /// Every shape of a context reply, made from parts borrowed from the session, reads
    /// exactly as the same reply made from the context view (every part copied, then
    /// converted), on every trace: rendered from nothing, and again from the cache the
    /// first replies filled (the formats in turn, so each shape also replaces another's).
    #[test]
    fn replies_equal_the_views_on_every_trace() {
        use pb::ContextFormat as F;
        each_trace_session(|name, s| {
            let n = s.messages().len();
            let view = s.build_context();
            let messages: Vec<pb::Message> =
                view.messages.iter().map(convert::message_to_pb).collect();
            let openai = view
                .openai_as(|m| wire_value::list_value(m))
                .encode_to_vec();
            let mut cache = ContextCache::default();
            let formats = [F::Unspecified, F::Native, F::Openai, F::OpenaiJson];
            for format in formats.into_iter().chain(formats).chain([F::Openai]) {
                let got = ContextBody::of(s, &mut cache, format).into_pb(n);
                assert_eq!(got.estimated_tokens, view.tokens, "{name} {format:?}");
                assert_eq!(got.context_messages as usize, view.messages.len());
                assert_eq!(got.session_messages as usize, n);
                let boundary = view.boundary_message_id.clone().unwrap_or_default();
                assert_eq!(got.boundary_message_id, boundary, "{name} {format:?}");
                let list = got.openai_messages.as_ref().map(|l| l.encode_to_vec());
                let with_list = matches!(format, F::Unspecified | F::Openai);
                assert_eq!(list, with_list.then(|| openai.clone()), "{name} {format:?}");
                // As a client reads it: the native messages and the JSON text are written
                // from their chunks.
                let read = pb::Context::decode(got.encode_to_vec().as_slice()).expect("decodes");
                let native = matches!(format, F::Unspecified | F::Native);
                let want: &[pb::Message] = if native { &messages } else { &[] };
                assert_eq!(read.messages, want, "{name} {format:?}");
                if format == F::OpenaiJson {
                    let parsed: serde_json::Value =
                        serde_json::from_str(&read.openai_messages_json).expect("JSON");
                    assert_eq!(parsed, view.to_openai(), "{name}");
                    // Message by message, the very text of the whole array.
                    assert_eq!(read.openai_messages_json, s.context_openai().json, "{name}");
                } else {
                    assert!(read.openai_messages_json.is_empty(), "{name} {format:?}");
                }
            }
        });
    }

    /// The JSON shape's buffer is sized from the messages: never short of the text on any
    /// trace's context, so it is written without regrowing, and not much larger.
    #[test]
    fn the_json_length_hint_covers_every_trace_context() {
        each_trace_session(|name, s| {
            let (hint, len) = s
                .context_openai_as(|m| {
                    let text = serde_json::to_string(m).unwrap_or_default();
                    (json_len_hint(m), text.len())
                })
                .json;
            assert!(hint >= len, "{name}: hint {hint} < {len}");
            assert!(
                hint <= len + len / 2 + 4096,
                "{name}: hint {hint} for {len}"
            );
        });
    }
}
