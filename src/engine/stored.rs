//! How the session holds its content: each message with its parts, each part with the
//! figures computed once when it was written (token estimate, rendered size when reduced,
//! bytes held). Only `Session` hands out mutable access, so only it changes them.

use serde::{Deserialize, Serialize};

use super::estimate::PartEstimate;
use super::render::is_compacted;
use crate::domain::{MessageInfo, Part, PartKind, Role};

/// A message and its parts, as held by the session.
#[derive(Clone, Serialize, Deserialize)]
pub struct Message {
    /// Message info.
    pub info: MessageInfo,
    /// Parts in arrival order, each with its cached estimate.
    pub parts: Vec<StoredPart>,
    /// The message's revision: a value no other message state in this process has held,
    /// taken whenever anything the context reads of it changes (see [`Revision`]). A
    /// rendering cached under it is still the message's. Not stored: a loaded message
    /// takes a new one.
    #[serde(skip)]
    pub(crate) rev: u64,
    /// A value no other message state in this process has held, taken whenever the host
    /// changes what the message holds (a part written or deleted, the message sent or not
    /// sent); the engine's own marks and pins leave it. A compaction's commit compares it
    /// with the plan's, so a summary never hides what it was not written from. Not stored:
    /// 0 in a loaded message, which the store's resume gives back (`edits.rs`).
    #[serde(skip)]
    pub(crate) edit: u64,
}

impl Message {
    /// Whether the context sends this message: OpenCode skips errored assistant messages
    /// unless they were aborted with real content. A call in a message not sent supersedes
    /// nothing (its result never reaches the model).
    pub(crate) fn is_sent(&self) -> bool {
        let Some(err) = &self.info.error else {
            return true;
        };
        if self.info.role != Role::Assistant {
            return true;
        }
        err.name == "MessageAbortedError"
            && self.parts.iter().any(|p| {
                !matches!(
                    p.part.kind,
                    PartKind::StepStart { .. } | PartKind::Reasoning(_)
                )
            })
    }

    /// Whether `other` holds what this message holds: the same info and parts (a part's
    /// estimate and byte figures aside), whatever either's stamps. The engine's own
    /// marks and prune stamps are no content (they take no edit live either): a rebuild
    /// that lacks those of a refused batch holds what the host wrote.
    pub(crate) fn same_content(&self, other: &Message) -> bool {
        self.info == other.info
            && self.parts.len() == other.parts.len()
            && self
                .parts
                .iter()
                .zip(&other.parts)
                .all(|(a, b)| same_written(&a.part, &b.part))
    }
}

/// Whether two parts hold what the host wrote alike: their strategy marks and prune
/// stamps aside (a copy is made only when the stamps differ, on a rebuild).
fn same_written(a: &crate::domain::Part, b: &crate::domain::Part) -> bool {
    use crate::domain::PartKind;
    if a.id != b.id || a.message_id != b.message_id || a.extra != b.extra {
        return false;
    }
    match (&a.kind, &b.kind) {
        (PartKind::Tool(x), PartKind::Tool(y))
            if x.state.time.compacted != y.state.time.compacted =>
        {
            let mut y = y.clone();
            y.state.time.compacted = x.state.time.compacted;
            **x == *y
        }
        (x, y) => x == y,
    }
}

impl std::fmt::Debug for Message {
    /// The content, as `PartialEq` compares it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Message")
            .field("info", &self.info)
            .field("parts", &self.parts)
            .finish_non_exhaustive()
    }
}

impl PartialEq for Message {
    /// The content: the revision only says when it last changed.
    fn eq(&self, other: &Message) -> bool {
        self.info == other.info && self.parts == other.parts
    }
}

/// Where message revisions come from: one counter for the process, so that a revision
/// names one state of one message, across sessions, copies and reloads alike.
pub(crate) struct Revision;

impl Revision {
    /// A revision never handed out before (0 is never one).
    pub(crate) fn next() -> u64 {
        use std::sync::atomic::{AtomicU64, Ordering};
        static NEXT: AtomicU64 = AtomicU64::new(1);
        NEXT.fetch_add(1, Ordering::Relaxed)
    }
}

/// A part with the token estimate computed when it was written.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StoredPart {
    /// The part.
    pub part: Part,
    /// Cached estimate of the part as stored.
    pub est: PartEstimate,
    /// Context tokens of the part as rendered, when prune or a strategy reduced it
    /// (computed once, when the mark is set).
    pub reduced: Option<u64>,
    /// Bytes the part holds (computed when written; see `memory.rs`). Not stored in a
    /// snapshot: a restored part counts its own (its capacities are the decoder's).
    #[serde(skip)]
    pub bytes: u64,
}

impl StoredPart {
    /// True when prune has cleared this part's output from the context.
    /// Only a completed output can be cleared: a stamp on a pending, running or failed
    /// call (which OpenCode never writes) changes nothing in the context.
    pub fn is_compacted(&self) -> bool {
        is_compacted(&self.part)
    }

    /// Context-view tokens of the part: its rendering when prune or a strategy reduced it,
    /// its stored content otherwise.
    pub fn context_tokens(&self) -> u64 {
        self.reduced
            .unwrap_or_else(|| self.est.base.saturating_add(self.est.output))
    }
}
