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

use std::borrow::Cow;

use serde_json::{Value, json};

use super::estimate::json_text;
use super::render::render_borrowed;
use super::session::Session;
use super::stored::{Message, StoredPart};
use crate::config::{COMPACTION_PROMPT_TEXT, INTERRUPTED};
use crate::domain::{Part, PartKind, Role, ToolStatus};

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
pub struct OpenAiContext {
    /// The chat-completions `messages` array.
    pub messages: Value,
    /// Estimated tokens of the context (as [`ContextView::tokens`]).
    pub tokens: u64,
    /// Native messages the context keeps (as `ContextView::messages.len()`).
    pub context_messages: usize,
    /// The message the context starts at when a compaction boundary exists.
    pub boundary_message_id: Option<String>,
}

/// Text a user `subtask` part reads as (OpenCode `toModelMessages`).
const SUBTASK_TEXT: &str = "The following tool was executed by the user";

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
    /// which sit before `B` in arrival order), skipping `B` and `S`; without a tail, every
    /// message after `B`. This is seed 02's `filterCompacted` extended with OpenCode's tail.
    pub(crate) fn context_order(&self) -> Vec<usize> {
        let len = self.messages().len();
        let Some(b) = self.boundary() else {
            return (0..len).collect();
        };
        let from = self.context_from();
        let mut order = Vec::with_capacity(len.saturating_sub(from) + 2);
        order.extend([b.start, b.summary]);
        order.extend((from..len).filter(|&i| i != b.start && i != b.summary));
        order
    }

    /// Summarized messages holding a pinned part, ascending: they are carried, with only
    /// their pinned parts, right after the summary. Empty without a compaction.
    pub(crate) fn carried(&self) -> Vec<usize> {
        let Some(b) = self.boundary() else {
            return Vec::new();
        };
        let mut held = self.pins().holders_below(self.context_from());
        held.retain(|&i| i != b.start && i != b.summary);
        held
    }

    /// What the context sends, in order: [`Self::context_order`] with the
    /// [`Self::carried`] messages (pinned parts only) right after the summary.
    fn context_slots(&self) -> Vec<(usize, Keep)> {
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
        i >= self.context_from()
            || self
                .boundary()
                .is_some_and(|b| i == b.start || i == b.summary)
    }

    /// Renders the given messages (positions, each whole or its pinned parts only, in
    /// order) as the model sees them.
    pub(crate) fn view_of(&self, slots: impl IntoIterator<Item = (usize, Keep)>) -> ContextView {
        let mut tokens = 0u64;
        let messages = self
            .sent(slots)
            .map(|(msg, parts)| Message {
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

    /// The context as OpenAI chat-completions `messages`, the same as
    /// `build_context().to_openai()` without copying the messages and parts first: parts
    /// that read as stored are borrowed.
    pub fn context_openai(&self) -> OpenAiContext {
        let (mut out, mut tokens, mut kept) = (Vec::new(), 0u64, 0usize);
        for (msg, parts) in self.sent(self.context_slots()) {
            kept += 1;
            tokens += parts
                .iter()
                .map(|(stored, _)| stored.context_tokens())
                .sum::<u64>();
            openai_messages(msg.info.role, parts.iter().map(|(_, p)| &**p), &mut out);
        }
        OpenAiContext {
            messages: Value::Array(out),
            tokens,
            context_messages: kept,
            boundary_message_id: self
                .boundary()
                .map(|b| self.messages()[b.start].info.id.clone()),
        }
    }

    /// The given messages as the context sends them: the messages it keeps, each with the
    /// parts it sends as they read (borrowed when unchanged). The one walk behind the view
    /// and the OpenAI messages, so the two cannot disagree.
    #[allow(clippy::type_complexity)]
    fn sent<'a>(
        &'a self,
        slots: impl IntoIterator<Item = (usize, Keep)> + 'a,
    ) -> impl Iterator<Item = (&'a Message, Vec<(&'a StoredPart, Cow<'a, Part>)>)> + 'a {
        slots.into_iter().filter_map(move |(i, keep)| {
            let msg = &self.messages()[i];
            if !keeps_message(msg) {
                return None;
            }
            let parts: Vec<_> = msg
                .parts
                .iter()
                .filter(|stored| self.sends(i, &stored.part.id, keep))
                .filter_map(|stored| {
                    render_borrowed(&stored.part, self.settings()).map(|p| (stored, p))
                })
                .collect();
            if parts
                .iter()
                .all(|(_, p)| matches!(p.kind, PartKind::StepStart { .. }))
            {
                return None;
            }
            Some((msg, parts))
        })
    }
}

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

/// OpenCode skips errored assistant messages unless they were aborted with real content.
fn keeps_message(msg: &Message) -> bool {
    let Some(err) = &msg.info.error else {
        return true;
    };
    if msg.info.role != Role::Assistant {
        return true;
    }
    err.name == "MessageAbortedError"
        && msg.parts.iter().any(|p| {
            !matches!(
                p.part.kind,
                PartKind::StepStart { .. } | PartKind::Reasoning(_)
            )
        })
}

impl ContextView {
    /// The context as OpenAI chat-completions `messages`: user content, assistant text with
    /// `tool_calls` (one assistant message per model step), then one `tool` message per call.
    pub fn to_openai(&self) -> Value {
        let mut out = Vec::new();
        for msg in &self.messages {
            openai_messages(msg.info.role, msg.parts.iter().map(|s| &s.part), &mut out);
        }
        Value::Array(out)
    }
}

/// Appends the OpenAI messages one context message (`role`, its rendered `parts`) reads as.
fn openai_messages<'a>(role: Role, parts: impl Iterator<Item = &'a Part>, out: &mut Vec<Value>) {
    match role {
        Role::User => {
            if let Some(m) = user_message(parts) {
                out.push(m);
            }
        }
        Role::Assistant => assistant_messages(parts, out),
    }
}

fn user_message<'a>(parts: impl Iterator<Item = &'a Part>) -> Option<Value> {
    let mut content = Vec::new();
    for part in parts {
        match &part.kind {
            PartKind::Text(t) => content.push(json!({"type": "text", "text": t.text})),
            PartKind::Compaction(_) => {
                content.push(json!({"type": "text", "text": COMPACTION_PROMPT_TEXT}))
            }
            PartKind::Subtask(_) => content.push(json!({"type": "text", "text": SUBTASK_TEXT})),
            // Text files and directories arrive as synthetic text parts already (OpenCode).
            PartKind::File(f) if f.mime == "text/plain" || f.mime == "application/x-directory" => {}
            PartKind::File(f) if f.mime.starts_with("image/") => {
                content.push(json!({"type": "image_url", "image_url": {"url": f.url}}))
            }
            PartKind::File(f) => content.push(json!({
                "type": "text",
                "text": format!("[File: {} ({})]", f.filename, f.mime),
            })),
            _ => {}
        }
    }
    match content.len() {
        0 => None,
        1 if content[0]["type"] == "text" => {
            Some(json!({"role": "user", "content": content[0]["text"].clone()}))
        }
        _ => Some(json!({"role": "user", "content": content})),
    }
}

/// Splits an assistant message at `step-start` parts: each model step is one assistant
/// message followed by its tool results, as the provider saw it.
fn assistant_messages<'a>(parts: impl Iterator<Item = &'a Part>, out: &mut Vec<Value>) {
    let mut text = Vec::new();
    let mut calls = Vec::new();
    let mut results = Vec::new();
    let flush = |text: &mut Vec<String>,
                 calls: &mut Vec<Value>,
                 results: &mut Vec<Value>,
                 out: &mut Vec<Value>| {
        if text.is_empty() && calls.is_empty() {
            return;
        }
        let mut m = json!({"role": "assistant", "content": Value::Null});
        if !text.is_empty() {
            m["content"] = Value::String(text.join("\n\n"));
        }
        if !calls.is_empty() {
            m["tool_calls"] = Value::Array(std::mem::take(calls));
        }
        text.clear();
        out.push(m);
        out.append(results);
    };
    for part in parts {
        match &part.kind {
            PartKind::StepStart { .. } => flush(&mut text, &mut calls, &mut results, out),
            // Text after tool calls starts the next step, with or without a step marker
            // (`pruneStepMarkers` drops them).
            PartKind::Text(t) => {
                if !calls.is_empty() {
                    flush(&mut text, &mut calls, &mut results, out);
                }
                text.push(t.text.clone())
            }
            PartKind::Tool(t) => {
                calls.push(json!({
                    "id": t.call_id,
                    "type": "function",
                    "function": {"name": t.tool, "arguments": json_text(&t.state.input)},
                }));
                let content = match t.state.status {
                    ToolStatus::Completed => t.state.output.clone(),
                    ToolStatus::Error => t.state.error.clone(),
                    ToolStatus::Pending | ToolStatus::Running => INTERRUPTED.to_string(),
                };
                results
                    .push(json!({"role": "tool", "tool_call_id": t.call_id, "content": content}));
            }
            _ => {}
        }
    }
    flush(&mut text, &mut calls, &mut results, out);
}

impl Session {
    /// Estimated tokens of the context view without building it.
    pub fn context_tokens(&self) -> u64 {
        self.context_slots()
            .into_iter()
            .filter(|&(i, _)| keeps_message(&self.messages()[i]))
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
