//! OpenCode's prune (seeds 01/02): lazy deletion of old tool outputs.
//!
//! Two implementations that must always agree:
//! - [`reference_scan`] is the seed's algorithm written out literally: walk messages newest
//!   first, skip the last `protect_turns` user turns, stop at a summary message or at an
//!   already compacted output, skip protected tools, protect the newest PRUNE_PROTECT
//!   tokens of completed tool output, prune the rest. It costs O(messages scanned).
//! - [`PruneIndex`] keeps the same answer up to date as messages arrive. Appending messages
//!   only ever slides the protection window forward, so it is maintained with two
//!   pointers in amortized O(1) per update; an edit to a tool part inside the already
//!   eligible region (rare: an old call completing late, a deletion) falls back to one
//!   reference scan. The property tests check that the two never disagree.
//!
//! Committing marks parts with `time.compacted`; outputs are kept (lazy deletion).

use super::render::active_mark;
use super::session::{Message, Session};
use super::strategies::{Strategy, StrategyRun};
use crate::config::Settings;
use crate::domain::{PartKind, Role, StrategyMark, ToolStatus};

/// One prunable tool output: a completed, unprotected tool part in the eligible region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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
    scan(messages, end, s).0
}

/// The literal scan, also returning the protected candidates (oldest first), which the
/// incremental index keeps so its window can slide over them later.
fn scan(messages: &[Message], end: Option<usize>, s: &Settings) -> (PrunePlan, Vec<Candidate>) {
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
            if s.is_protected_tool(&tool.tool) {
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
#[derive(Debug, Clone, Default, PartialEq, Eq)]
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
    /// Notes a change to a tool part or a summary flag of message `msg`. Changes past the
    /// eligible end are picked up when the end moves over them.
    pub fn touch(&mut self, msg: usize) {
        if self.end.is_some_and(|end| msg <= end) {
            self.dirty = true;
        }
    }

    /// Forgets everything (settings changed).
    pub fn invalidate(&mut self) {
        *self = PruneIndex {
            dirty: true,
            ..PruneIndex::default()
        };
    }

    /// Brings the state up to date with the session and returns the current plan figures.
    pub(crate) fn sync(&mut self, messages: &[Message], users: &[usize], s: &Settings) {
        let target = eligible_end(users, messages.len(), s.protect_turns);
        let moved_back = match (self.end, target) {
            (Some(a), Some(b)) => b < a,
            (Some(_), None) => true,
            _ => false,
        };
        if self.dirty || moved_back {
            self.rebuild(messages, target, s);
            return;
        }
        if target == self.end {
            return;
        }
        let from = self.end.map_or(0, |e| e + 1);
        if let Some(to) = target {
            for (mi, msg) in messages.iter().enumerate().take(to + 1).skip(from) {
                self.append_message(mi, msg, s);
            }
        }
        self.end = target;
    }

    fn rebuild(&mut self, messages: &[Message], end: Option<usize>, s: &Settings) {
        let (plan, protected) = scan(messages, end, s);
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

    fn append_message(&mut self, mi: usize, msg: &Message, s: &Settings) {
        if msg.info.role == Role::Assistant && msg.info.summary {
            self.reset();
            return;
        }
        for (pi, stored) in msg.parts.iter().enumerate() {
            let PartKind::Tool(tool) = &stored.part.kind else {
                continue;
            };
            if tool.state.status != ToolStatus::Completed || s.is_protected_tool(&tool.tool) {
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

    /// The current plan (after `sync`).
    pub fn plan(&self) -> PrunePlan {
        PrunePlan {
            prune: self.cands[..self.window].to_vec(),
            pruned: self.pruned,
            protected: self.protected,
        }
    }

    /// Tokens prune would clear now (after `sync`), without building the list.
    pub fn pending(&self) -> u64 {
        self.pruned
    }

    /// Records that `cands[..window]` were marked compacted: the newest of them is now the
    /// stop point, so only the window remains.
    fn committed(&mut self) {
        self.cands.drain(..self.window);
        self.window = 0;
        self.pruned = 0;
    }
}

/// Whether a prune run may change the session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PruneMode {
    /// Mark the outputs when the saving clears PRUNE_MINIMUM.
    Commit,
    /// Report only.
    DryRun,
}

/// One output prune cleared (or would clear).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrunedPart {
    /// Message id.
    pub message_id: String,
    /// Part id.
    pub part_id: String,
    /// Provider call id.
    pub call_id: String,
    /// Tool name.
    pub tool: String,
    /// Tokens its output held.
    pub tokens: u64,
}

/// What a prune run did or would do.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PruneReport {
    /// Parts were marked.
    pub committed: bool,
    /// The run was a dry run.
    pub dry_run: bool,
    /// Tokens the (would-be) cleared outputs held: the seed's figure, which PRUNE_MINIMUM
    /// is compared with.
    pub tokens_saved: u64,
    /// Context tokens prune's own clearing removed (or would remove). Lower than
    /// `tokens_saved` when a strategy had already shortened an output, and negative when
    /// the placeholder is longer than the tiny outputs it replaced (OpenCode renders it
    /// regardless); with the strategies' savings it is the run's whole change, counted
    /// once.
    pub context_tokens_saved: i64,
    /// Tool output tokens scanned (protected + prunable).
    pub tokens_scanned: u64,
    /// The (would-be) cleared outputs, oldest first.
    pub parts: Vec<PrunedPart>,
    /// Why nothing was committed, when nothing was.
    pub reason: Option<String>,
    /// PRUNE_PROTECT used.
    pub prune_protect: u64,
    /// PRUNE_MINIMUM used.
    pub prune_minimum: u64,
    /// What the aggressive strategies did (or would do) in the same run, including the
    /// inputs `pruneToolInputs` stripped from the outputs prune cleared.
    pub strategies: StrategyRun,
}

impl PruneReport {
    /// True when the run changed the session (prune committed or a strategy marked).
    pub fn changed(&self) -> bool {
        !self.dry_run && (self.committed || !self.strategies.parts.is_empty())
    }
}

impl Session {
    /// Tokens a prune would clear right now; the cheap per-update decision.
    pub fn prune_pending(&mut self) -> u64 {
        self.prune.sync(&self.messages, &self.users, &self.settings);
        self.prune.pending()
    }

    /// Runs the aggressive strategies, then prune. Prune commits (marks
    /// `time.compacted = now_ms`) only when its saving exceeds PRUNE_MINIMUM; the
    /// strategies commit whatever they decided. Nothing is marked unless `mode` is
    /// `Commit`; a dry run reports exactly what a commit would do.
    pub fn prune(&mut self, mode: PruneMode, now_ms: i64) -> PruneReport {
        let strategies = self.run_strategies(mode == PruneMode::Commit, now_ms);
        self.prune.sync(&self.messages, &self.users, &self.settings);
        let plan = self.prune.plan();
        let minimum = self.settings.prune_minimum;
        let mut report = PruneReport {
            committed: false,
            dry_run: mode == PruneMode::DryRun,
            tokens_saved: plan.pruned,
            context_tokens_saved: 0,
            tokens_scanned: plan.pruned + plan.protected,
            parts: plan.prune.iter().filter_map(|c| self.describe(c)).collect(),
            reason: None,
            prune_protect: self.settings.prune_protect,
            prune_minimum: minimum,
            strategies,
        };
        if plan.pruned <= minimum {
            report.reason = Some(if plan.prune.is_empty() {
                format!(
                    "nothing beyond the protected window (PRUNE_PROTECT {})",
                    self.settings.prune_protect
                )
            } else {
                format!(
                    "saving {} is not above PRUNE_MINIMUM {minimum}",
                    plan.pruned
                )
            });
            return report;
        }
        let mut inputs = (0u32, 0u64);
        let mut own = 0i64;
        if mode == PruneMode::DryRun {
            // What a commit would do, part by part, without marking: the strategies' marks
            // of this run are applied in thought (they come first in a commit).
            let marked: std::collections::HashMap<(&str, &str), StrategyMark> = report
                .strategies
                .parts
                .iter()
                .map(|m| {
                    let mark = StrategyMark {
                        strategy: m.strategy,
                        superseded_by: m.superseded_by.clone(),
                        time: now_ms,
                    };
                    ((m.message_id.as_str(), m.part_id.as_str()), mark)
                })
                .collect();
            for c in &plan.prune {
                let Some(stored) = self.messages.get(c.msg).and_then(|m| m.parts.get(c.part))
                else {
                    continue;
                };
                let part = &stored.part;
                let key = (part.message_id.as_str(), part.id.as_str());
                if let Some(mark) = marked.get(&key) {
                    own += signed(self.rendered_tokens_as(part, Some(mark), false, true))
                        - signed(self.rendered_tokens_as(part, Some(mark), true, true));
                    continue;
                }
                if active_mark(part, &self.settings).is_some() {
                    own += signed(self.context_tokens_of(stored))
                        - signed(self.rendered_tokens_as(part, part.mark.as_ref(), true, true));
                    continue;
                }
                let unstripped = self.rendered_tokens_as(part, None, true, false);
                let saved =
                    unstripped.saturating_sub(self.rendered_tokens_as(part, None, true, true));
                own += signed(self.context_tokens_of(stored)) - signed(unstripped);
                inputs.0 += u32::from(saved > 0);
                inputs.1 += saved;
            }
            report.context_tokens_saved = own;
            report
                .strategies
                .add(Strategy::PruneToolInputs, inputs.0, inputs.1);
            report.reason = Some("dry run".to_string());
            return report;
        }
        for c in &plan.prune {
            let (saved, total) = self.mark_compacted(c, now_ms);
            inputs.0 += u32::from(saved > 0);
            inputs.1 += saved;
            own += total - signed(saved);
        }
        report.context_tokens_saved = own;
        report
            .strategies
            .add(Strategy::PruneToolInputs, inputs.0, inputs.1);
        self.prune.committed();
        report.committed = true;
        report
    }

    fn describe(&self, c: &Candidate) -> Option<PrunedPart> {
        let stored = self.messages.get(c.msg)?.parts.get(c.part)?;
        let PartKind::Tool(t) = &stored.part.kind else {
            return None;
        };
        Some(PrunedPart {
            message_id: stored.part.message_id.clone(),
            part_id: stored.part.id.clone(),
            call_id: t.call_id.clone(),
            tool: t.tool.clone(),
            tokens: c.tokens,
        })
    }

    /// Marks one output cleared; returns the input tokens `pruneToolInputs` stripped with it
    /// and the context tokens removed in all (negative when the placeholder is longer).
    fn mark_compacted(&mut self, c: &Candidate, now_ms: i64) -> (u64, i64) {
        let Some(stored) = self
            .messages
            .get_mut(c.msg)
            .and_then(|m| m.parts.get_mut(c.part))
        else {
            debug_assert!(false, "prune candidate {c:?} points nowhere");
            return (0, 0);
        };
        let PartKind::Tool(tool) = &mut stored.part.kind else {
            return (0, 0);
        };
        tool.state.time.compacted = Some(now_ms);
        let stored = &self.messages[c.msg].parts[c.part];
        let old = stored
            .reduced
            .unwrap_or(stored.est.base + stored.est.output);
        let new = self.rendered_tokens(&stored.part, true);
        // A part a strategy already reduced had its input stripped then, not now.
        let unstripped = if active_mark(&stored.part, &self.settings).is_some() {
            new
        } else {
            self.rendered_tokens(&stored.part, false)
        };
        self.messages[c.msg].parts[c.part].reduced = Some(new);
        self.compacted += 1;
        self.usage.pruned += old.saturating_sub(new);
        self.adjust_tokens(old, new);
        (unstripped.saturating_sub(new), signed(old) - signed(new))
    }
}

/// Token counts fit i64 (a context is far below 2^63 tokens).
fn signed(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}
