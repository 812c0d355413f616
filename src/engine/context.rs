//! The model context: what the host should send next.
//!
//! Starts at the last completed compaction boundary (seed 02 `filterCompacted`), replaces
//! cleared outputs with the placeholder, and renders the rest as OpenCode's
//! `toModelMessages` does: pending/running tools become an error result
//! `[Tool execution was interrupted]`, errored assistant messages are skipped (unless
//! aborted with content), ignored text is dropped, and messages left with nothing but
//! `step-start` are dropped. Each part reads as `render.rs` says (placeholders, strategy
//! rewrites). Two shapes: native messages/parts, and OpenAI
//! chat-completions `messages` a host can send as is.
//!
//! Pins survive compaction: after a boundary, the pinned parts of the summarized messages
//! follow the summary, each in its own message (its info, only its pinned parts), oldest
//! first, before the verbatim tail. So a pinned part is never summarized away, reads
//! verbatim, and keeps its place in its message (a pinned tool call stays an assistant
//! call with its result). Finding them costs O(pins), never a scan of the head.

use serde_json::Value;

use super::openai::{ChatMessage, PartRead, chat_messages, json_len_hint};
use super::render::{Copying, Reading, render_reading};
use super::session::Session;
use super::stored::{Message, StoredPart};
use crate::domain::PartKind;

/// The rendered context.
#[derive(Debug, Clone, PartialEq)]
pub struct ContextView {
    /// Messages to send, with parts rewritten for the model.
    pub messages: Vec<Message>,
    /// Estimated tokens of those messages.
    pub tokens: u64,
    /// The message the context starts at when a compaction boundary exists.
    pub boundary_message_id: Option<String>,
}

/// The context in the OpenAI shape alone, with the figures a [`ContextView`] carries.
#[derive(Debug, Clone, PartialEq)]
pub struct OpenAiContext<M = String> {
    /// The chat-completions `messages` array: JSON text ([`Session::context_openai`]), or
    /// another shape made from the same messages.
    pub json: M,
    /// Estimated tokens of the context (as [`ContextView::tokens`]).
    pub tokens: u64,
    /// Native messages the context keeps (as `ContextView::messages.len()`).
    pub context_messages: usize,
    /// The message the context starts at when a compaction boundary exists.
    pub boundary_message_id: Option<String>,
}

/// The context as native messages in another shape (the server's protobuf messages),
/// rendered from parts borrowed from the session (`Session::context_native_chunks`),
/// with the figures a [`ContextView`] carries.
#[derive(Debug, Clone, PartialEq)]
pub struct NativeContext<M> {
    /// One item per message the context keeps, in order.
    pub messages: Vec<M>,
    /// Estimated tokens of the context (as [`ContextView::tokens`]).
    pub tokens: u64,
    /// Bytes the messages hold in flight (what a reply carrying them keeps alive).
    pub held_bytes: u64,
    /// The message the context starts at when a compaction boundary exists.
    pub boundary_message_id: Option<String>,
}

impl ContextView {
    /// Bytes the view holds (its messages and parts, as the memory limits count them):
    /// what a reply carrying it keeps in flight until it is sent.
    pub fn held_bytes(&self) -> u64 {
        use super::footprint::{message_bytes, part_bytes, part_slots_bytes};
        self.messages.iter().fold(0u64, |sum, m| {
            let parts = m
                .parts
                .iter()
                .fold(part_slots_bytes(m.parts.capacity()), |b, p| {
                    b.saturating_add(part_bytes(&p.part))
                });
            sum.saturating_add(message_bytes(&m.info))
                .saturating_add(parts)
        })
    }
}

impl Session {
    /// Builds the context view. Costs O(messages in the context), never touches the
    /// messages before the boundary but the pinned parts it carries.
    pub fn build_context(&self) -> ContextView {
        let mut view = self.view_of(self.context_slots());
        view.boundary_message_id = self
            .boundary()
            .map(|b| self.messages()[b.start].info.id.clone());
        view
    }

    /// Positions of the messages the context holds, in the order they are sent.
    ///
    /// Without a compaction: every message. After one (boundary `B` = the compaction's user
    /// message, `S` = its summary): `B`, `S`, then every message from the compaction part's
    /// `tail_start_id` on (the verbatim tail and whatever arrived while the compaction ran,
    /// which sit before `B` in arrival order), skipping `B`, `S` and any earlier
    /// compaction's pair (a second compaction's tail may start before the first's);
    /// without a tail, every message after `B`. This is seed 02's `filterCompacted`
    /// extended with OpenCode's tail.
    pub(crate) fn context_order(&self) -> Vec<usize> {
        let len = self.messages().len();
        let Some(b) = self.boundary() else {
            return (0..len).collect();
        };
        let from = self.context_from();
        let mut order = Vec::with_capacity(len.saturating_sub(from) + 2);
        order.extend([b.start, b.summary]);
        order.extend((from..len).filter(|&i| !self.is_compaction_pair(i)));
        order
    }

    /// Summarized messages holding a pinned part, ascending: they are carried, with only
    /// their pinned parts, right after the summary. So is an earlier compaction's pair
    /// inside the tail (a second compaction's tail may start before the first's), which
    /// the order skips. Empty without a compaction. O(pins).
    pub(crate) fn carried(&self) -> Vec<usize> {
        let Some(b) = self.boundary() else {
            return Vec::new();
        };
        let from = self.context_from();
        let mut held = self.pins().holders_below(usize::MAX);
        held.retain(|&i| {
            i != b.start && i != b.summary && (i < from || self.is_compaction_pair(i))
        });
        held
    }

    /// What the context sends, in order: [`Self::context_order`] with the
    /// [`Self::carried`] messages (pinned parts only) right after the summary.
    pub(super) fn context_slots(&self) -> Vec<(usize, Keep)> {
        let order = self.context_order();
        let carried = self.carried();
        let at = if self.boundary().is_some() { 2 } else { 0 };
        let mut slots = Vec::with_capacity(order.len() + carried.len());
        slots.extend(order[..at.min(order.len())].iter().map(|&i| (i, Keep::All)));
        slots.extend(carried.into_iter().map(|i| (i, Keep::Pinned)));
        slots.extend(order.iter().skip(at).map(|&i| (i, Keep::All)));
        slots
    }

    /// True when the context sends the part `part_id` of message `i` under `keep`.
    fn sends(&self, i: usize, part_id: &str, keep: Keep) -> bool {
        keep == Keep::All || self.is_pinned(i, part_id)
    }

    /// First position of the context after the boundary's own two messages (0 without a
    /// compaction): messages before it, other than `B` and `S`, are summarized.
    pub(crate) fn context_from(&self) -> usize {
        let Some(b) = self.boundary() else {
            return 0;
        };
        tail_start_id(&self.messages()[b.start])
            .and_then(|id| self.position(id))
            .filter(|&t| t != b.start && t != b.summary)
            .unwrap_or(b.start + 1)
    }

    /// True when message `i` is in the context.
    pub(crate) fn in_context(&self, i: usize) -> bool {
        let Some(b) = self.boundary() else {
            return true;
        };
        i == b.start || i == b.summary || (i >= self.context_from() && !self.is_compaction_pair(i))
    }

    /// Renders the given messages (positions, each whole or its pinned parts only, in
    /// order) as the model sees them.
    pub(crate) fn view_of(&self, slots: impl IntoIterator<Item = (usize, Keep)>) -> ContextView {
        let mut tokens = 0u64;
        let messages = self
            .sent(slots, Copying::Whole)
            .map(|(msg, parts)| Message {
                rev: 0, // a copy for the view: never cached
                edit: 0,
                info: msg.info.clone(),
                parts: parts
                    .into_iter()
                    .map(|(stored, part)| {
                        tokens += stored.context_tokens();
                        StoredPart {
                            part: part.into_owned(),
                            est: stored.est,
                            reduced: stored.reduced,
                            bytes: stored.bytes,
                        }
                    })
                    .collect(),
            })
            .collect();
        ContextView {
            messages,
            tokens,
            boundary_message_id: None,
        }
    }

    /// The context as OpenAI chat-completions `messages` in JSON text, the same as
    /// `build_context().to_openai()` serialized, without copying the messages and parts
    /// first (parts that read as stored are borrowed) or building values.
    pub fn context_openai(&self) -> OpenAiContext {
        // Strings, options and vectors of them always serialize. sonic-rs escapes with
        // SIMD (the bulk of this call on a large context), same bytes as serde_json, into
        // a buffer sized for the whole text; checking it is UTF-8 costs ~10 µs a MB.
        self.context_openai_as(|m| {
            let mut text = Vec::with_capacity(json_len_hint(m));
            sonic_rs::to_writer(&mut text, m)
                .ok()
                .and_then(|()| String::from_utf8(text).ok())
                .unwrap_or_else(|| "[]".to_string())
        })
    }

    /// The OpenAI messages of the context, built from parts borrowed from the session, in
    /// the form `shape` makes of them (JSON text here; protobuf wire bytes in the server).
    pub(crate) fn context_openai_as<M>(
        &self,
        shape: impl FnOnce(&[ChatMessage<'_>]) -> M,
    ) -> OpenAiContext<M> {
        let sent: Vec<_> = self.sent(self.context_slots(), Copying::Sent).collect();
        let mut out = Vec::new();
        let mut tokens = 0u64;
        for (msg, parts) in &sent {
            tokens += parts
                .iter()
                .map(|(stored, _)| stored.context_tokens())
                .sum::<u64>();
            chat_messages(msg.info.role, parts.iter().map(|(_, p)| p.read()), &mut out);
        }
        OpenAiContext {
            json: shape(&out),
            tokens,
            context_messages: sent.len(),
            boundary_message_id: self
                .boundary()
                .map(|b| self.messages()[b.start].info.id.clone()),
        }
    }

    /// The given messages as the context sends them: the messages it keeps, each with the
    /// parts it sends as they read (borrowed when unchanged; a rewritten copy keeps what
    /// `copying` says). The one walk behind the view and the OpenAI messages, so the two
    /// cannot disagree.
    pub(super) fn sent<'a>(
        &'a self,
        slots: impl IntoIterator<Item = (usize, Keep)> + 'a,
        copying: Copying,
    ) -> impl Iterator<Item = Sent<'a>> + 'a {
        slots.into_iter().filter_map(move |(i, keep)| {
            let msg = &self.messages()[i];
            if !msg.is_sent() {
                return None;
            }
            // Sized for every part up front: the list never grows.
            let mut parts = Vec::with_capacity(msg.parts.len());
            parts.extend(
                msg.parts
                    .iter()
                    .filter(|stored| self.sends(i, &stored.part.id, keep))
                    .filter_map(|stored| {
                        render_reading(&stored.part, self.settings(), copying).map(|p| (stored, p))
                    }),
            );
            if parts
                .iter()
                .all(|(_, p)| matches!(p.kind(), PartKind::StepStart { .. }))
            {
                return None;
            }
            Some((msg, parts))
        })
    }
}

/// A message the context sends, with its parts as they read (and as stored). A
/// [`Reading`] is about 70 bytes where a `Cow<Part>` was 320: a context lists every
/// part it sends.
type Sent<'a> = (&'a Message, Vec<(&'a StoredPart, Reading<'a>)>);

/// How much of a message the context sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Keep {
    /// Every part.
    All,
    /// Only its pinned parts (a summarized message carried after the summary).
    Pinned,
}

/// The `tail_start_id` of a message's compaction part, when set.
fn tail_start_id(m: &Message) -> Option<&str> {
    m.parts.iter().find_map(|p| match &p.part.kind {
        PartKind::Compaction(c) if !c.tail_start_id.is_empty() => Some(c.tail_start_id.as_str()),
        _ => None,
    })
}

impl ContextView {
    /// The context as OpenAI chat-completions `messages`: user content, assistant text with
    /// `tool_calls` (one assistant message per model step), then one `tool` message per call.
    pub fn to_openai(&self) -> Value {
        // Strings, options and vectors of them always convert.
        self.openai_as(|m| serde_json::to_value(m).unwrap_or_else(|_| Value::Array(Vec::new())))
    }

    /// The same messages, in the form `shape` makes of them.
    pub(crate) fn openai_as<M>(&self, shape: impl FnOnce(&[ChatMessage<'_>]) -> M) -> M {
        let mut out = Vec::new();
        for msg in &self.messages {
            chat_messages(
                msg.info.role,
                msg.parts.iter().map(|s| PartRead::Part(&s.part)),
                &mut out,
            );
        }
        shape(&out)
    }
}

impl Session {
    /// Estimated tokens of the context view without building it.
    pub fn context_tokens(&self) -> u64 {
        self.context_slots()
            .into_iter()
            .filter(|&(i, _)| self.messages()[i].is_sent())
            .flat_map(|(i, keep)| {
                self.messages()[i]
                    .parts
                    .iter()
                    .filter(move |p| self.sends(i, &p.part.id, keep))
            })
            .map(|p| p.context_tokens())
            .sum()
    }
}
