//! Compactions a replacing import keeps. A host that lets compactd compact for it (the
//! OpenCode plugin's `compaction: "compactd"`) never holds compactd's own messages: the
//! compaction's request, its summary and the auto-continue. When it reloads the session
//! whole (after a restart, a rejected update, messages out of order), its export lacks
//! them; imported as it is, the session would send the summarized head again, and pay for
//! another summary to get back where it was.
//!
//! [`Session::compaction_trail`] records the replaced session's message order with a copy
//! of each completed compaction's messages; [`Trail::carry_into`] puts the ones the export
//! lacks back at their place, for as long as the export holds the replaced session's other
//! messages in the same order. A history that diverged (a message removed, a revert, an
//! order changed) ends the carrying there: a summary is never kept over messages it did
//! not see or that are gone.

use super::session::Session;
use super::stored::Message;
use crate::domain::{FastMap, FastSet, MessageInfo, Part, PartKind, Role};

/// One message of an export: its info and its parts, in order.
pub type ExportMessage = (MessageInfo, Vec<Part>);

/// The replaced session's messages in stored order, with a copy of each message that
/// belongs to a completed compaction (see [`Session::compaction_trail`]).
#[derive(Debug, Clone, Default)]
pub struct Trail {
    entries: Vec<Entry>,
}

#[derive(Debug, Clone)]
struct Entry {
    id: String,
    /// A compaction's message: a copy, and what it is.
    made: Option<(Made, ExportMessage)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Made {
    /// The user message holding the compaction part.
    Request,
    /// The completed summary answering it.
    Summary,
    /// The synthetic user message right after a summary (automatic compaction).
    Continue,
}

impl Session {
    /// The message order and the completed compactions' messages, copied, for a
    /// replacing import to keep ([`Trail::carry_into`]). O(messages) ids, but only the
    /// compactions' messages are copied.
    pub fn compaction_trail(&self) -> Trail {
        let messages = self.messages();
        let mut entries = Vec::with_capacity(messages.len());
        let mut after_summary = false;
        for (i, m) in messages.iter().enumerate() {
            let made = if self.is_compaction_pair(i) {
                Some(if m.info.role == Role::User {
                    Made::Request
                } else {
                    Made::Summary
                })
            } else if after_summary && is_continue(m) {
                Some(Made::Continue)
            } else {
                None
            };
            after_summary = made == Some(Made::Summary);
            entries.push(Entry {
                id: m.info.id.clone(),
                made: made.map(|kind| (kind, copy(m))),
            });
        }
        Trail { entries }
    }
}

impl Trail {
    /// Puts the compactions' messages `messages` lacks back in it, each right after the
    /// message it followed in the replaced session (or first). Walks the replaced
    /// session's messages: each that is not a compaction's must be in `messages`, after
    /// the one before it; the first that is missing or out of order stops the carrying.
    /// A compaction is carried only whole (its request and its summary; the continue only
    /// with them). Returns how many messages were put in.
    pub fn carry_into(self, messages: &mut Vec<ExportMessage>) -> usize {
        let at: FastMap<&str, usize> = messages
            .iter()
            .enumerate()
            .map(|(i, (info, _))| (info.id.as_str(), i))
            .collect();
        // (insert before this index of `messages`, what, the message)
        let mut carried: Vec<(usize, Made, ExportMessage)> = Vec::new();
        let mut next = 0usize;
        for entry in self.entries {
            match (at.get(entry.id.as_str()), entry.made) {
                (Some(&i), _) if i >= next => next = i.saturating_add(1),
                (None, Some((kind, message))) => carried.push((next, kind, message)),
                // Missing, or held out of the replaced session's order: the histories
                // part here.
                _ => break,
            }
        }
        drop(at);
        let carried = whole_compactions(carried);
        let n = carried.len();
        // Back to front, so each index still names the place it was computed for.
        for (before, _, message) in carried.into_iter().rev() {
            messages.insert(before, message);
        }
        n
    }
}

/// The carried messages that form whole compactions: a request with its summary (the
/// summary's parent), and a continue right after a carried summary.
fn whole_compactions(
    carried: Vec<(usize, Made, ExportMessage)>,
) -> Vec<(usize, Made, ExportMessage)> {
    let requests: FastSet<&str> = carried
        .iter()
        .filter(|(_, kind, _)| *kind == Made::Request)
        .map(|(_, _, (info, _))| info.id.as_str())
        .collect();
    let answered: FastSet<String> = carried
        .iter()
        .filter(|(_, kind, (info, _))| {
            *kind == Made::Summary && requests.contains(info.parent_id.as_str())
        })
        .map(|(_, _, (info, _))| info.parent_id.clone())
        .collect();
    drop(requests);
    let mut out = Vec::with_capacity(carried.len());
    let mut last_kept: Option<Made> = None;
    for (before, kind, message) in carried {
        let keep = match kind {
            Made::Request => answered.contains(&message.0.id),
            Made::Summary => answered.contains(&message.0.parent_id),
            Made::Continue => last_kept == Some(Made::Summary),
        };
        last_kept = keep.then_some(kind);
        if keep {
            out.push((before, kind, message));
        }
    }
    out
}

/// A synthetic user message, every part a synthetic text: the auto-continue a compaction
/// adds after its summary.
fn is_continue(m: &Message) -> bool {
    m.info.role == Role::User
        && !m.parts.is_empty()
        && m.parts
            .iter()
            .all(|p| matches!(&p.part.kind, PartKind::Text(t) if t.synthetic))
}

/// A message as an export holds it: the info and the parts as stored, without the marks
/// the engine set (the new session decides its own).
fn copy(m: &Message) -> ExportMessage {
    let parts = m
        .parts
        .iter()
        .map(|p| Part {
            mark: None,
            ..p.part.clone()
        })
        .collect();
    (m.info.clone(), parts)
}
