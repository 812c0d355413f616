//! Committing the strategies' pending decisions: each is checked against the session as it
//! is now (the part still exists, is in the context, is not pinned, not already compacted
//! or marked, is not protected, and the rewrite really shrinks it), then marked, and its
//! saving is reported by strategy. A dry run computes exactly what a commit would do.

use super::{PartRef, Strategy};
use crate::domain::{FastSet, PartKind, StrategyMark};
use crate::engine::render::active_mark;
use crate::engine::request_log::Scope;
use crate::engine::session::{Rendering, Session};

/// Parts and tokens one strategy saved in a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StrategySaving {
    /// The strategy.
    pub strategy: Strategy,
    /// Parts it marked (for `pruneToolInputs`: inputs it stripped).
    pub parts: u32,
    /// Context tokens it removed.
    pub tokens: u64,
}

/// A part a strategy marked (or would mark).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MarkedPart {
    /// Message id.
    pub message_id: String,
    /// Part id.
    pub part_id: String,
    /// Part type (`tool`, `file`, `text`).
    pub part_type: &'static str,
    /// Tool name and call id, for tool parts.
    pub tool: String,
    /// Provider call id, for tool parts.
    pub call_id: String,
    /// The strategy.
    pub strategy: Strategy,
    /// The newer call, for supersede strategies.
    pub superseded_by: String,
    /// Context tokens removed (the strategy's and the input-leak fix's together).
    pub tokens: u64,
}

/// What the strategies did (or would do) in one prune run.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StrategyRun {
    /// Savings by strategy, in [`Strategy::ALL`] order, only strategies that saved.
    pub savings: Vec<StrategySaving>,
    /// The parts, in decision order.
    pub parts: Vec<MarkedPart>,
}

impl StrategyRun {
    /// Adds `tokens` (and `parts`) to `strategy`'s saving.
    pub fn add(&mut self, strategy: Strategy, parts: u32, tokens: u64) {
        if parts == 0 && tokens == 0 {
            return;
        }
        match self.savings.iter_mut().find(|s| s.strategy == strategy) {
            Some(s) => {
                s.parts += parts;
                s.tokens += tokens;
            }
            None => {
                self.savings.push(StrategySaving {
                    strategy,
                    parts,
                    tokens,
                });
                self.savings
                    .sort_by_key(|s| Strategy::ALL.iter().position(|x| *x == s.strategy));
            }
        }
    }

    /// Context tokens removed by every strategy together.
    pub fn tokens(&self) -> u64 {
        self.savings.iter().map(|s| s.tokens).sum()
    }

    /// True when nothing was (or would be) marked.
    pub fn is_empty(&self) -> bool {
        self.parts.is_empty() && self.savings.is_empty()
    }
}

impl Session {
    /// What a committing [`Self::run_strategies`] over [`Scope::All`] does to the queue
    /// besides marking: it takes every decision (none is held). The cache scheduler calls
    /// it when it keeps the trial run it weighed instead of making the commit's run.
    pub(crate) fn strategies_committed(&mut self) {
        if !self.settings().strategies.is_empty() {
            let _ = self.strategy_decisions(true);
        }
    }

    /// Applies the pending strategy decisions within `scope`. With `commit` false the
    /// decisions stay queued (a dry run, which rolls the marks back); decisions outside the
    /// scope stay queued too.
    pub(crate) fn run_strategies(
        &mut self,
        commit: bool,
        now_ms: i64,
        scope: Scope,
    ) -> StrategyRun {
        let mut run = StrategyRun::default();
        if self.settings().strategies.is_empty() {
            return run;
        }
        let mut pending = self.strategy_decisions(commit);
        // Highest rank first: when a part is both stale and old, it is superseded, whichever
        // decision arrived first (a restart or import then decides the same).
        pending.sort_by_key(|p| std::cmp::Reverse(p.strategy.rank()));
        let mut done: FastSet<PartRef> = FastSet::default();
        let mut held = Vec::new();
        for p in pending {
            if done.contains(&p.at)
                || !self.settings().strategies.has(p.strategy)
                || !self.in_context(p.at.msg)
                || self.is_pinned(p.at.msg, &p.at.part)
            {
                continue; // a pinned part's decision is dropped; an unpin finds it again
            }
            let Some(pi) = self.part_position(p.at.msg, &p.at.part) else {
                continue; // deleted since
            };
            let stored = &self.messages()[p.at.msg].parts[pi];
            if stored.is_compacted() {
                continue; // compaction awareness: never processed twice
            }
            // One mark per part. A supersede (the part is stale) outranks masking (the part
            // is old), which outranks a shortening, so the order decisions arrive in does
            // not matter; a mark whose strategy is off no longer counts. Checked before a
            // decision is held: one already applied (a rebuild queues every decision the
            // history makes) changes nothing, and held it would count toward MAX_HELD.
            match active_mark(&stored.part, self.settings()) {
                Some(current) if current.rank() >= p.strategy.rank() => continue,
                _ => {}
            }
            if scope == Scope::Fresh && self.request_log().is_sent(p.at.msg, pi) {
                held.push(p); // the provider cached this part: the scheduler holds it
                continue;
            }
            if let PartKind::Tool(t) = &stored.part.kind
                && self.settings().is_strategy_protected(&t.tool)
                && p.strategy != Strategy::SupersedeTodos
            {
                continue;
            }
            let old = stored.context_tokens();
            let mark = StrategyMark {
                strategy: p.strategy,
                superseded_by: p.by.clone(),
                time: now_ms,
                keep: p.keep,
            };
            let part = &stored.part;
            let rendered = self.rendered_split(part, &stored.est, Some(&mark), false, true);
            let new = rendered.tokens;
            if new >= old {
                continue; // never larger: a rewrite that does not shrink is not applied
            }
            let unstripped = new.saturating_add(rendered.input_saved);
            let own = old - unstripped.min(old);
            let inputs = (old - new) - own;
            run.add(p.strategy, 1, own);
            run.add(Strategy::PruneToolInputs, u32::from(inputs > 0), inputs);
            let (tool, call_id) = match &part.kind {
                PartKind::Tool(t) => (t.tool.clone(), t.call_id.clone()),
                _ => (String::new(), String::new()),
            };
            run.parts.push(MarkedPart {
                message_id: part.message_id.clone(),
                part_id: part.id.clone(),
                part_type: part.kind.type_name(),
                tool,
                call_id,
                strategy: p.strategy,
                superseded_by: p.by,
                tokens: old - new,
            });
            done.insert(p.at.clone());
            self.rerender_known(p.at.msg, pi, Rendering::Mark(Some(mark)), true, Some(new));
        }
        if commit && !held.is_empty() {
            self.hold_decisions(held);
        }
        run
    }
}
