//! Compactions a replacing import keeps. A host that lets compactd compact for it (the
//! OpenCode plugin's `compaction: "compactd"`) never holds compactd's own messages: the
//! compaction's request, its summary and the auto-continue. When it reloads the session
//! whole (after a restart, a rejected update, messages out of order), its export lacks
//! them; imported as it is, the session would send the summarized head again, and pay for
//! another summary to get back where it was.
//!
//! [`Session::compaction_trail`] records the replaced session's message order with a copy
//! of each message a compaction commit made (told by the ids the commit gave it, so a
//! host's own compaction, which the host may have undone, is never brought back);
//! [`Trail::carry_into`] puts the ones the export lacks back at their place, for as long
//! as the export holds the replaced session's other messages in the same order. A history
//! that diverged (a message removed, a revert, an order changed, a message the summary
//! never saw where it would hide it) ends the carrying there: a summary is never kept over
//! messages it did not see or that are gone.
//!
//! The host's pins (compactd's own state too, set by the Pin call) are kept the same way:
//! [`Trail::repin`] sets each again on the imported session, by message and part id, where
//! the export still holds what it pinned.

use super::compaction::{CommitMessage, commit_message};
use super::session::Session;
use super::stored::Message;
use super::update::Update;
use crate::config::EngineConfig;
use crate::domain::{FastMap, FastSet, MessageInfo, Part, PartKind};

/// One message of an export: its info and its parts, in order.
pub type ExportMessage = (MessageInfo, Vec<Part>);

/// The replaced session's messages in stored order, with a copy of each message a
/// compaction commit made (see [`Session::compaction_trail`]).
#[derive(Debug, Clone, Default)]
pub struct Trail {
    entries: Vec<Entry>,
    /// The replaced session's pins: message id, part id (`None`: the whole message).
    pins: Vec<(String, Option<String>)>,
}

#[derive(Debug, Clone)]
struct Entry {
    id: String,
    /// A commit's message: which one, the commit's prefix, a copy.
    made: Option<(CommitMessage, String, ExportMessage)>,
}

/// A message put back: where, which commit, what.
struct Carried {
    before: usize,
    kind: CommitMessage,
    prefix: String,
    message: ExportMessage,
}

impl Session {
    /// The message order and a copy of every message a compaction commit made, for a
    /// replacing import to keep ([`Trail::carry_into`]). O(messages) ids; only the
    /// commits' messages are copied.
    pub fn compaction_trail(&self) -> Trail {
        let entries = self
            .messages()
            .iter()
            .map(|m| Entry {
                id: m.info.id.clone(),
                made: commit_message(m)
                    .map(|(kind, prefix)| (kind, prefix.to_string(), exported(m))),
            })
            .collect();
        let pins = self
            .pins()
            .each()
            .filter_map(|(m, part)| {
                let id = self.messages().get(m)?.info.id.clone();
                Some((id, part.map(str::to_string)))
            })
            .collect();
        Trail { entries, pins }
    }
}

impl Trail {
    /// The ids of the messages compaction commits made, in order: two reads of a
    /// session's trail with the same ids carry the same compactions.
    pub fn commit_ids(&self) -> Vec<&str> {
        self.entries
            .iter()
            .filter(|e| e.made.is_some())
            .map(|e| e.id.as_str())
            .collect()
    }

    /// Puts the commits' messages `messages` lacks back in it, each right after the
    /// message it followed in the replaced session (or first). Walks the replaced
    /// session's messages: each that is not a commit's must be in `messages`, after the
    /// one before it; the first that is missing or out of order stops the carrying, and
    /// so does a compaction that would hide a message of `messages` the replaced session
    /// never held (one before the compaction's verbatim tail). A compaction is carried
    /// only whole (its request and its finished summary; the continue only with them).
    /// Returns how many messages were put in.
    pub fn carry_into(&mut self, messages: &mut Vec<ExportMessage>) -> usize {
        let at: FastMap<&str, usize> = messages
            .iter()
            .enumerate()
            .map(|(i, (info, _))| (info.id.as_str(), i))
            .collect();
        let mut carried: Vec<Carried> = Vec::new();
        // The next index of `messages` a held message may match, and the first index
        // skipped over (a message the replaced session did not hold).
        let mut next = 0usize;
        let mut first_unseen: Option<usize> = None;
        for entry in std::mem::take(&mut self.entries) {
            match (at.get(entry.id.as_str()), entry.made) {
                (Some(&i), _) if i >= next => {
                    if i > next {
                        first_unseen.get_or_insert(next);
                    }
                    next = i.saturating_add(1);
                }
                (None, Some((kind, prefix, message))) => {
                    if kind == CommitMessage::Request
                        && first_unseen.is_some_and(|u| u < hidden_before(&message, &at, next))
                    {
                        break;
                    }
                    carried.push(Carried {
                        before: next,
                        kind,
                        prefix,
                        message,
                    });
                }
                // Missing, or held out of the replaced session's order: the histories
                // part here.
                _ => break,
            }
        }
        drop(at);
        let carried = whole_compactions(carried);
        let n = carried.len();
        // Back to front, so each index still names the place it was computed for.
        for c in carried.into_iter().rev() {
            messages.insert(c.before, c.message);
        }
        n
    }

    /// Sets the replaced session's pins on `session` (the import built), each where it
    /// still holds the message and part; a pin it cannot hold (its message or part gone,
    /// a limit) is left off. Returns how many were set.
    pub fn repin(self, session: &mut Session, config: &EngineConfig) -> usize {
        let mut set = 0usize;
        for (message_id, part_id) in self.pins {
            let pin = Update::Pin {
                message_id,
                part_id,
                pinned: true,
            };
            if session.apply(pin, config).is_ok() {
                set = set.saturating_add(1);
            }
        }
        set
    }
}

/// The index of `messages` before which a compaction request (carried before `next`)
/// hides what it summarized: its verbatim tail's first message, or itself when it kept
/// no tail.
fn hidden_before(request: &ExportMessage, at: &FastMap<&str, usize>, next: usize) -> usize {
    let tail = request.1.iter().find_map(|p| match &p.kind {
        PartKind::Compaction(c) if !c.tail_start_id.is_empty() => Some(c.tail_start_id.as_str()),
        _ => None,
    });
    tail.and_then(|t| at.get(t).copied()).unwrap_or(next)
}

/// The carried messages that form whole compactions: a commit's request and summary
/// both carried, and its continue with them.
fn whole_compactions(carried: Vec<Carried>) -> Vec<Carried> {
    let with = |kind: CommitMessage| -> FastSet<&str> {
        carried
            .iter()
            .filter(|c| c.kind == kind)
            .map(|c| c.prefix.as_str())
            .collect()
    };
    let (requests, summaries) = (with(CommitMessage::Request), with(CommitMessage::Summary));
    let whole: FastSet<String> = requests
        .intersection(&summaries)
        .map(|p| p.to_string())
        .collect();
    drop((requests, summaries));
    carried
        .into_iter()
        .filter(|c| whole.contains(&c.prefix))
        .collect()
}

/// A message as an export holds it: the info and the parts as stored, without the marks
/// the engine set (a session loaded from it decides its own).
pub(crate) fn exported(m: &Message) -> ExportMessage {
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
