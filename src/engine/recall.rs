//! Recall: the original content of a part, however the context reads it now. Prune and
//! the strategies delete lazily (a stamp or a mark; the content is kept), so what the
//! model sees as `[Old tool result content cleared]` can be handed back on request.
//!
//! A host gives its model the [`recall_tool`] definition; when the model calls
//! [`RECALL_TOOL`] with a call id, the host asks [`Session::recall`] (the `Recall` RPC)
//! and answers with the original output. Lookups scan the parts newest first: recall is
//! an explicit request, never part of an update.

use serde_json::{Value, json};

use super::render::{active_mark, is_compacted};
use super::session::Session;
use super::stored::StoredPart;
use crate::config::Strategy;
use crate::domain::{PartKind, ToolStatus};

/// Name of the tool a model calls to get a hidden output back.
pub const RECALL_TOOL: &str = "compactd_recall";

/// Which part to recall.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecallKey {
    /// A tool call by its provider call id (the newest part with it).
    CallId(String),
    /// A part by its id (the newest part with it).
    PartId(String),
}

impl RecallKey {
    /// The request field the key came from (`call_id`, `part_id`), for errors.
    pub fn field(&self) -> &'static str {
        match self {
            RecallKey::CallId(_) => "call_id",
            RecallKey::PartId(_) => "part_id",
        }
    }

    /// The id looked for.
    pub fn id(&self) -> &str {
        match self {
            RecallKey::CallId(id) | RecallKey::PartId(id) => id,
        }
    }
}

/// How the context shortens a part now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reduction {
    /// Prune cleared the output (the placeholder stands in).
    Cleared,
    /// A newer call superseded it (a note names the newer call).
    Superseded,
    /// It reads as a placeholder naming it: an output masked by observation masking, or
    /// an attached file's breadcrumb.
    Masked,
    /// An old error or user code block was cut short.
    Truncated,
    /// A compaction summarized its message; it is not in the context.
    Summarized,
}

impl Reduction {
    /// Wire name (`cleared`, `superseded`, `masked`, `truncated`, `summarized`).
    pub fn as_str(self) -> &'static str {
        match self {
            Reduction::Cleared => "cleared",
            Reduction::Superseded => "superseded",
            Reduction::Masked => "masked",
            Reduction::Truncated => "truncated",
            Reduction::Summarized => "summarized",
        }
    }
}

/// A tool call as stored.
#[derive(Debug, Clone, PartialEq)]
pub struct RecalledCall {
    /// Tool name.
    pub tool: String,
    /// Provider call id.
    pub call_id: String,
    /// Call status.
    pub status: ToolStatus,
    /// Call arguments.
    pub input: Value,
    /// The original output of a completed call.
    pub output: String,
    /// The original error of a failed call.
    pub error: String,
}

/// The stored content of a recalled part.
#[derive(Debug, Clone, PartialEq)]
pub enum RecalledContent {
    /// A tool call with its original output or error.
    Call(Box<RecalledCall>),
    /// The original text of a text or reasoning part.
    Text(String),
    /// An attached file.
    File {
        /// File name.
        filename: String,
        /// MIME type.
        mime: String,
        /// URL (`file://` or `data:`).
        url: String,
    },
    /// A part with no content to recall (step markers, snapshots, ...).
    Empty,
}

/// One part's original content and how the context reads it now.
#[derive(Debug, Clone, PartialEq)]
pub struct Recalled {
    /// Owning message.
    pub message_id: String,
    /// Part id.
    pub part_id: String,
    /// Part type (`tool`, `text`, `file`, ...).
    pub part_type: &'static str,
    /// The content as stored, never shortened.
    pub content: RecalledContent,
    /// How the context shortens it now; `None` when it reads verbatim.
    pub reduction: Option<Reduction>,
    /// The part is pinned (itself or through its message).
    pub pinned: bool,
    /// Tokens of the content as stored.
    pub tokens: u64,
    /// Tokens it takes in the context now (0 when summarized).
    pub context_tokens: u64,
}

impl Session {
    /// The original content of the part `key` names, or `None` when no part has that id.
    /// O(parts): scans newest first.
    pub fn recall(&self, key: &RecallKey) -> Option<Recalled> {
        let (msg, stored) = self.find_part(key)?;
        let part = &stored.part;
        let pinned = self.is_pinned(msg, &part.id);
        let summarized = !self.in_context(msg) && !pinned;
        let reduction = if summarized {
            Some(Reduction::Summarized)
        } else {
            self.reduction_of(stored)
        };
        Some(Recalled {
            message_id: part.message_id.clone(),
            part_id: part.id.clone(),
            part_type: part.kind.type_name(),
            content: content_of(&part.kind),
            reduction,
            pinned,
            tokens: stored.est.base.saturating_add(stored.est.output),
            context_tokens: if summarized {
                0
            } else {
                stored.context_tokens()
            },
        })
    }

    /// The part `key` names, with its message position: by part id the newest; by call
    /// id the newest the context hides (shortened or summarized), else the newest. Call
    /// ids may repeat (providers that number calls per response), and the agent recalls
    /// what it cannot read.
    fn find_part(&self, key: &RecallKey) -> Option<(usize, &StoredPart)> {
        let mut found = self
            .messages()
            .iter()
            .enumerate()
            .rev()
            .flat_map(|(i, m)| m.parts.iter().rev().map(move |p| (i, p)));
        match key {
            RecallKey::PartId(id) => found.find(|(_, p)| p.part.id == *id),
            RecallKey::CallId(id) => {
                let mut newest = None;
                for (i, p) in found {
                    if !matches!(&p.part.kind, PartKind::Tool(t) if t.call_id == *id) {
                        continue;
                    }
                    let pinned = self.is_pinned(i, &p.part.id);
                    if (!self.in_context(i) && !pinned) || self.reduction_of(p).is_some() {
                        return Some((i, p));
                    }
                    newest.get_or_insert((i, p));
                }
                newest
            }
        }
    }

    /// How prune or a strategy shortens the part in the context, if at all.
    fn reduction_of(&self, stored: &StoredPart) -> Option<Reduction> {
        // A superseded part reads as its strategy made it even once prune clears it too.
        match active_mark(&stored.part, self.settings()) {
            Some(st) if st.supersedes() => Some(Reduction::Superseded),
            Some(Strategy::PruneFiles | Strategy::MaskObservations) => Some(Reduction::Masked),
            Some(_) => Some(Reduction::Truncated),
            None => is_compacted(&stored.part).then_some(Reduction::Cleared),
        }
    }
}

fn content_of(kind: &PartKind) -> RecalledContent {
    match kind {
        PartKind::Tool(t) => RecalledContent::Call(Box::new(RecalledCall {
            tool: t.tool.clone(),
            call_id: t.call_id.clone(),
            status: t.state.status,
            input: t.state.input.clone(),
            output: t.state.output.clone(),
            error: t.state.error.clone(),
        })),
        PartKind::Text(t) => RecalledContent::Text(t.text.clone()),
        PartKind::Reasoning(r) => RecalledContent::Text(r.text.clone()),
        PartKind::File(f) => RecalledContent::File {
            filename: f.filename.clone(),
            mime: f.mime.clone(),
            url: f.url.clone(),
        },
        _ => RecalledContent::Empty,
    }
}

/// The [`RECALL_TOOL`] definition in OpenAI's function-calling schema, ready for a host
/// to add to its model's tools.
pub fn recall_tool() -> Value {
    json!({
        "type": "function",
        "function": {
            "name": RECALL_TOOL,
            "description": "Get back the full original output of an earlier tool call that your \
                context no longer shows in full: it was cleared (\"[Old tool result content \
                cleared]\"), superseded by a newer call, or shortened. Call it only when you \
                need that output again; pass the earlier call's id.",
            "parameters": {
                "type": "object",
                "properties": {
                    "call_id": {
                        "type": "string",
                        "description": "The id of the earlier tool call whose output you need."
                    }
                },
                "required": ["call_id"],
                "additionalProperties": false
            }
        }
    })
}

/// [`recall_tool`] as the JSON text the `GetRecallTool` RPC and `compactd recall-tool`
/// give out (pretty-printed, the same bytes everywhere).
pub fn recall_tool_json() -> String {
    format!("{:#}", recall_tool())
}
