//! OpenCode's prune decision (seeds 01/02), kept up to date as messages arrive.
//!
//! Two implementations that must always agree:
//! - [`reference_scan`] is the seed's algorithm written out literally: walk messages newest
//!   first, skip the last `protect_turns` user turns, stop at a summary message or at an
//!   already compacted output, skip protected tools, protect the newest PRUNE_PROTECT
//!   tokens of completed tool output, prune the rest. It costs O(messages scanned).
//!   compactd's pins extend it: a pinned output is skipped like a protected tool's (it is
//!   never cleared and takes no room in the window); with nothing pinned it is the seed's.
//! - [`PruneIndex`] keeps the same answer up to date as messages arrive. Appending messages
//!   only ever slides the protection window forward, so it is maintained with two
//!   pointers in amortized O(1) per update; an edit to a tool part inside the already
//!   eligible region (rare: an old call completing late, a deletion) falls back to one
//!   reference scan. The property tests check that the two never disagree.

use serde::{Deserialize, Serialize};

use super::pins::Pins;
use super::stored::Message;
use crate::config::Settings;
use crate::domain::{PartKind, Role, ToolStatus};

#[cfg(test)]
thread_local! {
    /// Plans [`PruneIndex::plan`] built on this thread (tests count the list copies).
    pub(crate) static PLANS_BUILT: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// One prunable tool output: a completed, unprotected tool part in the eligible region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Candidate {
    /// Message position.
    pub msg: usize,
    /// Part position within the message.
    pub part: usize,
    /// Estimated tokens of its output.
    pub tokens: u64,
}

/// What prune decided: which outputs it clears and the figures behind the decision.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PrunePlan {
    /// Outputs to clear, oldest first.
    pub prune: Vec<Candidate>,
    /// Tokens those outputs hold.
    pub pruned: u64,
    /// Tokens of the protected (newest) outputs scanned.
    pub protected: u64,
}

/// Position of the newest message prune may look at: the `turns`-th user message from
/// the end (seed: messages are skipped while fewer than `turns` user messages were seen).
pub fn eligible_end(users: &[usize], len: usize, turns: u32) -> Option<usize> {
    if turns == 0 {
        return len.checked_sub(1);
    }
    let turns = turns as usize;
    (users.len() >= turns).then(|| users[users.len() - turns])
}

/// The seed's algorithm, literally: newest first from `end`, stop at a summary or a
/// compacted output.
pub fn reference_scan(messages: &[Message], end: Option<usize>, s: &Settings) -> PrunePlan {
    scan(messages, end, s, &Pins::default()).0
}

/// [`reference_scan`] skipping the pinned outputs, as the session's own window does.
#[cfg(test)]
pub(crate) fn reference_scan_pinned(
    messages: &[Message],
    end: Option<usize>,
    s: &Settings,
    pins: &Pins,
) -> PrunePlan {
    scan(messages, end, s, pins).0
}

/// The literal scan, also returning the protected candidates (oldest first), which the
/// incremental index keeps so its window can slide over them later.
fn scan(
    messages: &[Message],
    end: Option<usize>,
    s: &Settings,
    pins: &Pins,
) -> (PrunePlan, Vec<Candidate>) {
    let mut plan = PrunePlan::default();
    let mut protected = Vec::new();
    let Some(end) = end else {
        return (plan, protected);
    };
    let mut total = 0u64;
    'messages: for (mi, msg) in messages[..=end].iter().enumerate().rev() {
        if msg.info.role == Role::Assistant && msg.info.summary {
            break;
        }
        for (pi, stored) in msg.parts.iter().enumerate().rev() {
            let PartKind::Tool(tool) = &stored.part.kind else {
                continue;
            };
            if tool.state.status != ToolStatus::Completed {
                continue;
            }
            if s.is_protected_tool(&tool.tool) || pins.covers(mi, &stored.part.id) {
                continue;
            }
            if tool.state.time.compacted.is_some() {
                break 'messages;
            }
            let c = Candidate {
                msg: mi,
                part: pi,
                tokens: stored.est.output,
            };
            total += c.tokens;
            if total > s.prune_protect {
                plan.pruned += c.tokens;
                plan.prune.push(c);
            } else {
                plan.protected += c.tokens;
                protected.push(c);
            }
        }
    }
    plan.prune.reverse();
    protected.reverse();
    (plan, protected)
}

/// Incremental prune state: the candidates between the last stop point (summary or
/// compacted output) and the eligible end, split into "to prune" (oldest) and the
/// protection window (newest, at most PRUNE_PROTECT tokens).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PruneIndex {
    /// Eligible end the state reflects.
    end: Option<usize>,
    /// Candidates oldest first; `cands[..window]` are to be pruned.
    cands: Vec<Candidate>,
    /// Start of the protection window in `cands`.
    window: usize,
    /// Tokens in the protection window.
    protected: u64,
    /// Tokens in `cands[..window]`.
    pruned: u64,
    /// Set when a change inside the eligible region invalidates the state.
    dirty: bool,
}

impl PruneIndex {
    /// Notes a change to a tool part, a pin or a summary flag of message `msg`. Changes
    /// past the eligible end are picked up when the end moves over them.
    pub fn touch(&mut self, msg: usize) {
        if self.end.is_some_and(|end| msg <= end) {
            self.dirty = true;
        }
    }

    /// True when every position points into `messages` and the figures add up (a
    /// restored snapshot is checked with it: the window's arithmetic relies on both). A
    /// dirty index is rebuilt before it is read, so its stale candidates (a part deleted
    /// since) are not checked.
    pub(crate) fn fits(&self, messages: &[Message]) -> bool {
        let sum = |c: &[Candidate]| c.iter().try_fold(0u64, |a, c| a.checked_add(c.tokens));
        if self.dirty {
            return self.end.is_none_or(|e| e < messages.len());
        }
        self.end.is_none_or(|e| e < messages.len())
            && self.window <= self.cands.len()
            && self
                .cands
                .iter()
                .all(|c| messages.get(c.msg).is_some_and(|m| c.part < m.parts.len()))
            && sum(&self.cands[..self.window]) == Some(self.pruned)
            && sum(&self.cands[self.window..]) == Some(self.protected)
    }

    /// Forgets everything (settings changed).
    pub fn invalidate(&mut self) {
        *self = PruneIndex {
            dirty: true,
            ..PruneIndex::default()
        };
    }

    /// Brings the state up to date with the session and returns the current plan figures.
    pub(crate) fn sync(
        &mut self,
        messages: &[Message],
        users: &[usize],
        s: &Settings,
        pins: &Pins,
    ) {
        let target = eligible_end(users, messages.len(), s.protect_turns);
        let moved_back = match (self.end, target) {
            (Some(a), Some(b)) => b < a,
            (Some(_), None) => true,
            _ => false,
        };
        if self.dirty || moved_back {
            self.rebuild(messages, target, s, pins);
            return;
        }
        if target == self.end {
            return;
        }
        let from = self.end.map_or(0, |e| e + 1);
        if let Some(to) = target {
            for (mi, msg) in messages.iter().enumerate().take(to + 1).skip(from) {
                self.append_message(mi, msg, s, pins);
            }
        }
        self.end = target;
    }

    fn rebuild(&mut self, messages: &[Message], end: Option<usize>, s: &Settings, pins: &Pins) {
        let (plan, protected) = scan(messages, end, s, pins);
        let mut cands = plan.prune;
        let window = cands.len();
        cands.extend(protected);
        *self = PruneIndex {
            end,
            cands,
            window,
            protected: plan.protected,
            pruned: plan.pruned,
            dirty: false,
        };
    }

    fn append_message(&mut self, mi: usize, msg: &Message, s: &Settings, pins: &Pins) {
        if msg.info.role == Role::Assistant && msg.info.summary {
            self.reset();
            return;
        }
        for (pi, stored) in msg.parts.iter().enumerate() {
            let PartKind::Tool(tool) = &stored.part.kind else {
                continue;
            };
            if tool.state.status != ToolStatus::Completed
                || s.is_protected_tool(&tool.tool)
                || pins.covers(mi, &stored.part.id)
            {
                continue;
            }
            if tool.state.time.compacted.is_some() {
                self.reset();
                continue;
            }
            self.push(
                Candidate {
                    msg: mi,
                    part: pi,
                    tokens: stored.est.output,
                },
                s.prune_protect,
            );
        }
    }

    fn reset(&mut self) {
        self.cands.clear();
        self.window = 0;
        self.protected = 0;
        self.pruned = 0;
    }

    /// Adds the newest candidate and slides the window until it holds at most `protect`.
    fn push(&mut self, c: Candidate, protect: u64) {
        self.cands.push(c);
        self.protected += c.tokens;
        while self.protected > protect {
            let oldest = self.cands[self.window];
            self.protected -= oldest.tokens;
            self.pruned += oldest.tokens;
            self.window += 1;
        }
    }

    /// The current plan (after `sync`). Copies the list of outputs to clear: a run that
    /// cannot commit reads [`Self::pending`], [`Self::protected`] and [`Self::window_len`]
    /// instead.
    pub fn plan(&self) -> PrunePlan {
        #[cfg(test)]
        PLANS_BUILT.with(|n| n.set(n.get() + 1));
        PrunePlan {
            prune: self.cands[..self.window].to_vec(),
            pruned: self.pruned,
            protected: self.protected,
        }
    }

    /// Outputs prune would clear now (after `sync`).
    pub fn window_len(&self) -> usize {
        self.window
    }

    /// Tokens prune would clear now (after `sync`), without building the list.
    pub fn pending(&self) -> u64 {
        self.pruned
    }

    /// Tokens of the protected (newest) outputs scanned (after `sync`).
    pub fn protected(&self) -> u64 {
        self.protected
    }

    /// Records that `cands[..window]` were marked compacted: the newest of them is now the
    /// stop point, so only the window remains.
    pub(crate) fn committed(&mut self) {
        self.cands.drain(..self.window);
        self.window = 0;
        self.pruned = 0;
    }
}
