//! OpenCode's prune (seeds 01/02): lazy deletion of old tool outputs, run together with
//! the aggressive strategies after a finished assistant message. What to clear is decided
//! by the incremental window in `prune_index.rs`; here it is committed (parts marked with
//! `time.compacted`, outputs kept) and reported. A dry run is a commit rolled back.
//! Pinned outputs never enter the window's plan, so what is reported is what is cleared.

use super::prune_index::Candidate;
use super::render::active_mark;
use super::request_log::Scope;
use super::session::{Rendering, Session};
use super::strategies::{Strategy, StrategyRun};
use crate::domain::PartKind;

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

/// Why a prune run committed nothing. Typed, and put in words only when a report is sent
/// ([`PruneReport::reason_text`], with the report's own figures): the automatic run after
/// nearly every finished message drops its report unread, and formatting the reason there
/// was about 1% of a strategy turn's instructions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotCommitted {
    /// A dry run (the report says what a commit would do).
    DryRun,
    /// The cache scheduler held prune's clearing: the rewrite would cost more than it saves.
    Held,
    /// No output lies beyond the protected window (`prune_protect`).
    NothingBeyond,
    /// The saving (`tokens_saved`) is not above `prune_minimum`.
    UnderMinimum,
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
    pub reason: Option<NotCommitted>,
    /// PRUNE_PROTECT used.
    pub prune_protect: u64,
    /// PRUNE_MINIMUM used.
    pub prune_minimum: u64,
    /// What the aggressive strategies did (or would do) in the same run, including the
    /// inputs `pruneToolInputs` stripped from the outputs prune cleared.
    pub strategies: StrategyRun,
}

impl PruneReport {
    /// The reason in words, for a client; None when the run committed.
    pub fn reason_text(&self) -> Option<String> {
        Some(match self.reason? {
            NotCommitted::DryRun => "dry run".to_string(),
            NotCommitted::Held => {
                "held by the cache scheduler: the rewrite would cost more than it saves".into()
            }
            NotCommitted::NothingBeyond => format!(
                "nothing beyond the protected window (PRUNE_PROTECT {})",
                self.prune_protect
            ),
            NotCommitted::UnderMinimum => format!(
                "saving {} is not above PRUNE_MINIMUM {}",
                self.tokens_saved, self.prune_minimum
            ),
        })
    }

    /// True when the run changed the session (prune committed or a strategy marked).
    pub fn changed(&self) -> bool {
        !self.dry_run && (self.committed || !self.strategies.parts.is_empty())
    }
}

impl Session {
    /// Runs the aggressive strategies, then prune. Prune commits (marks
    /// `time.compacted = now_ms`) only when its saving exceeds PRUNE_MINIMUM; the
    /// strategies commit whatever they decided. A dry run is the same run, rolled back at
    /// its end (and leaving the queued decisions queued): it reports exactly what a commit
    /// would do because it is one.
    pub fn prune(&mut self, mode: PruneMode, now_ms: i64) -> PruneReport {
        match mode {
            PruneMode::Commit => self.prune_run(now_ms, true, Scope::All, true),
            PruneMode::DryRun => {
                let mut report = self.dry_run(|s| s.prune_run(now_ms, false, Scope::All, true));
                report.dry_run = true;
                if report.committed {
                    report.committed = false;
                    report.reason = Some(NotCommitted::DryRun);
                }
                report
            }
        }
    }

    /// A committing run limited to `scope` (the cache-aware scheduler's choice).
    pub(crate) fn prune_scoped(&mut self, now_ms: i64, scope: Scope) -> PruneReport {
        self.prune_run(now_ms, true, scope, false)
    }

    /// One prune run; `commit` false keeps the strategies' queue and the prune window as
    /// they are (the caller rolls the marks back). Within [`Scope::Fresh`] prune's own
    /// clearing (which only reaches parts already sent) waits. The report lists the parts
    /// prune clears; those it would clear but does not (a saving under PRUNE_MINIMUM) only
    /// with `list_held`: the automatic runs after every finished message drop that list,
    /// and building it cost four strings per waiting output each time.
    pub(crate) fn prune_run(
        &mut self,
        now_ms: i64,
        commit: bool,
        scope: Scope,
        list_held: bool,
    ) -> PruneReport {
        let strategies = self.run_strategies(commit, now_ms, scope);
        if scope == Scope::Fresh && self.prune_pending() > 0 {
            // Prune only reaches parts already sent: held whole, not even listed (the
            // list grows while it is held).
            let settings = self.settings();
            return PruneReport {
                reason: Some(NotCommitted::Held),
                prune_protect: settings.prune_protect,
                prune_minimum: settings.prune_minimum,
                strategies,
                ..PruneReport::default()
            };
        }
        let minimum = self.settings().prune_minimum;
        let (pending, protected, window) = self.prune_figures();
        if pending <= minimum && !list_held {
            // Nothing commits and no list is wanted: the figures alone, without copying
            // the waiting outputs (the automatic run after nearly every finished message).
            let settings = self.settings();
            return PruneReport {
                tokens_saved: pending,
                tokens_scanned: pending.saturating_add(protected),
                reason: Some(under_minimum(window)),
                prune_protect: settings.prune_protect,
                prune_minimum: minimum,
                strategies,
                ..PruneReport::default()
            };
        }
        let plan = self.prune_plan();
        let settings = self.settings();
        let mut report = PruneReport {
            committed: false,
            dry_run: false,
            tokens_saved: plan.pruned,
            context_tokens_saved: 0,
            tokens_scanned: plan.pruned.saturating_add(plan.protected),
            parts: Vec::new(),
            reason: None,
            prune_protect: settings.prune_protect,
            prune_minimum: minimum,
            strategies,
        };
        if plan.pruned > minimum || list_held {
            report.parts = plan.prune.iter().filter_map(|c| self.describe(c)).collect();
        }
        if plan.pruned <= minimum {
            report.reason = Some(under_minimum(plan.prune.len()));
            return report;
        }
        let (mut inputs, mut own) = ((0u32, 0u64), 0i64);
        for c in &plan.prune {
            // The seed's scan may reach parts no request sends (after an automatic
            // compaction it walks past the compaction request into what the summary
            // replaced): they are marked as the seed marks them, and save no context.
            let sent = self
                .messages()
                .get(c.msg)
                .and_then(|m| m.parts.get(c.part))
                .is_some_and(|p| self.sends_part(c.msg, &p.part.id));
            let (saved, total) = self.mark_compacted(c, now_ms);
            if !sent {
                continue;
            }
            inputs.0 += u32::from(saved > 0);
            inputs.1 = inputs.1.saturating_add(saved);
            own = own.saturating_add(total.saturating_sub(signed(saved)));
        }
        report.context_tokens_saved = own;
        report
            .strategies
            .add(Strategy::PruneToolInputs, inputs.0, inputs.1);
        if commit {
            self.prune_plan_committed();
        }
        report.committed = true;
        report
    }

    fn describe(&self, c: &Candidate) -> Option<PrunedPart> {
        let stored = self.messages().get(c.msg)?.parts.get(c.part)?;
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
        let Some(stored) = self.messages().get(c.msg).and_then(|m| m.parts.get(c.part)) else {
            debug_assert!(false, "prune candidate {c:?} points nowhere");
            return (0, 0);
        };
        if !matches!(stored.part.kind, PartKind::Tool(_)) {
            return (0, 0);
        }
        // A part a supersede already reduced had its input stripped then, not now. Only a
        // supersede strips it (render.rs): a masked, capped or aged call still sent its
        // input until this clearing.
        let stripped_before =
            active_mark(&stored.part, self.settings()).is_some_and(Strategy::supersedes);
        // Counted once, as cleared: the same figure tells what the input leaves out, so
        // the part is not rendered again without the fix (once per held output and
        // trial run of the cache scheduler).
        let cleared = self.rendered_split(
            &stored.part,
            &stored.est,
            stored.part.mark.as_ref(),
            true,
            true,
        );
        let (old, new) = self.rerender_known(
            c.msg,
            c.part,
            Rendering::Cleared(now_ms),
            true,
            Some(cleared.tokens),
        );
        let stripped = if stripped_before {
            0
        } else {
            cleared.input_saved
        };
        (stripped, signed(old) - signed(new))
    }
}

/// Why a run whose saving is not above PRUNE_MINIMUM commits nothing, `outputs` being how
/// many outputs it would clear.
fn under_minimum(outputs: usize) -> NotCommitted {
    if outputs == 0 {
        NotCommitted::NothingBeyond
    } else {
        NotCommitted::UnderMinimum
    }
}

/// Token counts fit i64 (a context is far below 2^63 tokens).
fn signed(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}
