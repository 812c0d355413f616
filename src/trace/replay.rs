//! `compactd replay`: feeds an export through the engine message by message, as a live
//! host would, and reports per step the context size in three lanes (without compactd,
//! OpenCode's prune only, prune plus the aggressive strategies as configured), what each
//! strategy saved, the provider-reported usage, and where overflow fired.
//!
//! Each assistant message is sent as the host sends it: info first (unfinished), then its
//! parts (a `step-finish` part is a usage report), then the info again, finished, which
//! runs the overflow check and the automatic prune.

use std::fmt;
use std::sync::Arc;

use super::Export;
use crate::config::{EngineConfig, StrategySet};
use crate::domain::{ModelLimits, Role};
use crate::engine::strategies::{Strategy, StrategyRun};
use crate::engine::{
    CommitIds, CompactionPlan, CompactionRequest, ContextView, Crossed, Event, Session,
    SummaryOutcome, TailOptions, Update, default_tail_tokens, step, usable_input,
};
use crate::tokens::TokenCounter;

/// One finished assistant message.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    /// Step number (1-based, finished assistant messages).
    pub step: usize,
    /// Message id.
    pub message_id: String,
    /// Context tokens with no compactd at all.
    pub baseline: u64,
    /// Context tokens with OpenCode's prune alone (no strategy).
    pub prune_only: u64,
    /// Context tokens with compactd as configured (prune and strategies).
    pub pruned: u64,
    /// What the strategies marked at this step, by strategy.
    pub strategies: StrategyRun,
    /// Provider-reported usage of the step (0 when the export has none).
    pub reported: u64,
    /// Overflow fired at this step: what crossed.
    pub overflow: Option<Crossed>,
    /// Tool outputs cleared at this step, and their tokens.
    pub pruned_parts: usize,
    /// Tokens cleared at this step.
    pub pruned_tokens: u64,
    /// A compaction ran after this step (only with a compactor).
    pub compaction: Option<CompactionRow>,
}

/// What a compaction during a replay did.
#[derive(Debug, Clone, PartialEq)]
pub struct CompactionRow {
    /// Context tokens before and after (equal when it failed).
    pub tokens_before: u64,
    /// Context tokens after.
    pub tokens_after: u64,
    /// Why it failed, when it did.
    pub error: Option<String>,
}

/// Writes a summary for a planned compaction (e.g. by calling an LLM). Given the session
/// as it is, the plan and the head as the summarizer should see it.
pub type Compactor<'a> =
    dyn FnMut(&Session, &CompactionPlan, &ContextView) -> Result<SummaryOutcome, String> + 'a;

/// The whole replay.
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    /// Session id.
    pub session_id: String,
    /// Limits used.
    pub limits: ModelLimits,
    /// Threshold in tokens.
    pub threshold: u64,
    /// One row per step.
    pub rows: Vec<Row>,
    /// Messages fed.
    pub messages: usize,
}

impl Report {
    /// Steps where overflow fired.
    pub fn overflow_steps(&self) -> impl Iterator<Item = &Row> {
        self.rows.iter().filter(|r| r.overflow.is_some())
    }

    /// Tool outputs cleared in total, and their tokens.
    pub fn total_pruned(&self) -> (usize, u64) {
        self.rows.iter().fold((0, 0), |(p, t), r| {
            (p + r.pruned_parts, t + r.pruned_tokens)
        })
    }

    /// What each strategy saved over the whole replay (tokens at the time of marking).
    pub fn strategy_totals(&self) -> StrategyRun {
        let mut total = StrategyRun::default();
        for s in self.rows.iter().flat_map(|r| &r.strategies.savings) {
            total.add(s.strategy, s.parts, s.tokens);
        }
        total
    }
}

/// Replays `export` with the given limits. The clock is the message's own creation time,
/// so a replay is deterministic.
pub fn replay(
    export: &Export,
    limits: ModelLimits,
    config: &EngineConfig,
    counter: Arc<dyn TokenCounter>,
) -> Report {
    replay_with(export, limits, config, counter, None)
}

/// Like [`replay`], running a full compaction through `compactor` whenever the engine asks
/// for one (overflow that prune cannot fix).
pub fn replay_with(
    export: &Export,
    limits: ModelLimits,
    config: &EngineConfig,
    counter: Arc<dyn TokenCounter>,
    mut compactor: Option<&mut Compactor<'_>>,
) -> Report {
    let mut info = export.info.clone();
    info.limits = limits;
    let mut live = Session::new(info.clone(), config, counter.clone());
    let baseline_cfg = EngineConfig {
        prune: false,
        auto_compact: false,
        ..config.clone()
    };
    let prune_only_cfg = EngineConfig {
        strategies: StrategySet::NONE,
        auto_compact: false,
        ..config.clone()
    };
    let mut prune_only = Session::new(info.clone(), &prune_only_cfg, counter.clone());
    let mut baseline = Session::new(info, &baseline_cfg, counter);
    let mut rows = Vec::new();
    let mut compacted_once = false;
    for (minfo, parts) in &export.messages {
        let now = minfo.time.completed.unwrap_or(minfo.time.created);
        let mut events = Vec::new();
        let stale_usage = compacted_once;
        let mut feed = |update: Update| {
            let _ = baseline.apply(update.clone(), &baseline_cfg);
            let _ = step(&mut prune_only, update.clone(), &prune_only_cfg, now);
            // After a compaction the recorded usage describes the original, uncompacted run:
            // the replayed session goes by its prediction instead.
            let update = if stale_usage {
                without_usage(update)
            } else {
                update
            };
            // Exports are well formed; an update the engine refuses is reported and skipped.
            match step(&mut live, update, config, now) {
                Ok(r) => events.extend(r.events),
                Err(e) => tracing::warn!(error = %e, "replay: update refused"),
            }
        };
        let assistant = minfo.role == Role::Assistant;
        let mut first = minfo.clone();
        if assistant {
            first.finish.clear();
            first.time.completed = None;
        }
        feed(Update::UpsertMessage(first));
        for p in parts {
            feed(Update::UpsertPart(p.clone()));
        }
        if !assistant || !minfo.is_finished() {
            continue;
        }
        feed(Update::UpsertMessage(minfo.clone()));
        let overflow = events.iter().rev().find_map(|e| match e {
            Event::Overflow(c) => c.crossed,
            _ => None,
        });
        let (mut pruned_parts, mut pruned_tokens) = (0, 0);
        let mut strategies = StrategyRun::default();
        for e in &events {
            if let Event::Pruned(r) = e {
                if r.committed {
                    pruned_parts += r.parts.len();
                    pruned_tokens += r.tokens_saved;
                }
                for s in &r.strategies.savings {
                    strategies.add(s.strategy, s.parts, s.tokens);
                }
                strategies.parts.extend(r.strategies.parts.iter().cloned());
            }
        }
        let needed = events
            .iter()
            .any(|e| matches!(e, Event::CompactionNeeded(_)));
        let compaction = match (&mut compactor, needed) {
            (Some(compact), true) => {
                Some(run_compaction(&mut live, compact, config, now, rows.len()))
            }
            _ => None,
        };
        compacted_once |= compaction.as_ref().is_some_and(|c| c.error.is_none());
        rows.push(Row {
            step: rows.len() + 1,
            compaction,
            message_id: minfo.id.clone(),
            baseline: baseline.build_context().tokens,
            prune_only: prune_only.build_context().tokens,
            pruned: live.build_context().tokens,
            strategies,
            reported: minfo
                .tokens
                .map(|t| crate::engine::used_tokens(&t, live.settings().cache_counting).0)
                .unwrap_or(0),
            overflow,
            pruned_parts,
            pruned_tokens,
        });
    }
    Report {
        session_id: export.info.id.clone(),
        limits,
        threshold: live
            .check_overflow(crate::engine::Trigger::Request)
            .threshold,
        rows,
        messages: export.messages.len(),
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "session {}  messages {}  limits context={} input={} output={}  threshold {} tokens",
            self.session_id,
            self.messages,
            self.limits.context,
            self.limits.input,
            self.limits.output,
            self.threshold
        )?;
        writeln!(
            f,
            "{:>5}  {:<32}  {:>11}  {:>10}  {:>10}  {:>10}  {:>9}  {:<16}  strategies",
            "step",
            "message",
            "no-compactd",
            "prune-only",
            "compactd",
            "reported",
            "overflow",
            "pruned"
        )?;
        for r in &self.rows {
            let overflow = match r.overflow {
                Some(Crossed::Used) => "USED",
                Some(Crossed::Predicted) => "PREDICTED",
                None => "",
            };
            let mut pruned = if r.pruned_parts > 0 {
                format!("{}/{}t", r.pruned_parts, r.pruned_tokens)
            } else {
                String::new()
            };
            match &r.compaction {
                Some(CompactionRow {
                    tokens_before,
                    tokens_after,
                    error: None,
                }) => {
                    pruned.push_str(&format!(" COMPACTED {tokens_before}->{tokens_after}"));
                }
                Some(CompactionRow { error: Some(e), .. }) => {
                    pruned.push_str(&format!(" COMPACTION FAILED: {e}"));
                }
                None => {}
            }
            let strategies: Vec<String> = r
                .strategies
                .savings
                .iter()
                .map(|s| format!("{} {}/{}t", s.strategy, s.parts, s.tokens))
                .collect();
            writeln!(
                f,
                "{:>5}  {:<32}  {:>11}  {:>10}  {:>10}  {:>10}  {:>9}  {:<16}  {}",
                r.step,
                truncate(&r.message_id, 32),
                r.baseline,
                r.prune_only,
                r.pruned,
                r.reported,
                overflow,
                pruned,
                strategies.join(", ")
            )?;
        }
        let last = self.rows.last();
        let (parts, tokens) = self.total_pruned();
        let overflows: Vec<String> = self.overflow_steps().map(|r| r.step.to_string()).collect();
        writeln!(
            f,
            "total: steps {}  final context no-compactd {}  prune-only {}  compactd {}  prune cleared {} outputs / {} tokens  overflow at steps [{}]",
            self.rows.len(),
            last.map_or(0, |r| r.baseline),
            last.map_or(0, |r| r.prune_only),
            last.map_or(0, |r| r.pruned),
            parts,
            tokens,
            overflows.join(",")
        )?;
        let totals = self.strategy_totals();
        if totals.savings.is_empty() {
            return writeln!(f, "strategies: nothing to mark");
        }
        writeln!(f, "strategies (parts / tokens removed when marked):")?;
        for s in &totals.savings {
            writeln!(
                f,
                "  {:<22} {:>5} / {:>7}",
                s.strategy.name(),
                s.parts,
                s.tokens
            )?;
        }
        Ok(())
    }
}

/// A Markdown table comparing several replays: final context in the three lanes and what
/// each strategy removed (tokens, parts), one row per trace.
pub fn summary_table(reports: &[(String, Report)]) -> String {
    let used: Vec<Strategy> = Strategy::ALL
        .into_iter()
        .filter(|st| {
            reports.iter().any(|(_, r)| {
                r.strategy_totals()
                    .savings
                    .iter()
                    .any(|s| s.strategy == *st)
            })
        })
        .collect();
    let mut out = String::from("| trace | steps | no compactd | prune only | prune + strategies |");
    for st in &used {
        out.push_str(&format!(" {} |", st.name()));
    }
    out.push_str("\n|---|---:|---:|---:|---:|");
    out.push_str(&"---:|".repeat(used.len()));
    out.push('\n');
    for (name, r) in reports {
        let last = r.rows.last();
        let (base, prune, all) = last.map_or((0, 0, 0), |l| (l.baseline, l.prune_only, l.pruned));
        out.push_str(&format!(
            "| {name} | {} | {} | {} | {} |",
            r.rows.len(),
            base,
            prune,
            all
        ));
        let totals = r.strategy_totals();
        for st in &used {
            match totals.savings.iter().find(|s| s.strategy == *st) {
                Some(s) => out.push_str(&format!(" {} ({}) |", s.tokens, s.parts)),
                None => out.push_str(" – |"),
            }
        }
        out.push('\n');
    }
    out
}

/// The update without provider usage (message tokens, step-finish tokens).
fn without_usage(update: Update) -> Update {
    match update {
        Update::UpsertMessage(mut m) => {
            m.tokens = None;
            Update::UpsertMessage(m)
        }
        Update::UpsertPart(mut p) => {
            if let crate::domain::PartKind::StepFinish(f) = &mut p.kind {
                f.tokens = None;
            }
            Update::UpsertPart(p)
        }
        other => other,
    }
}

/// Plans, summarizes (through the compactor) and commits one automatic compaction.
fn run_compaction(
    live: &mut Session,
    compact: &mut Compactor<'_>,
    config: &EngineConfig,
    now: i64,
    step: usize,
) -> CompactionRow {
    let tail = TailOptions {
        turns: 2,
        max_tokens: default_tail_tokens(usable_input(&live.info().limits)),
    };
    let request = CompactionRequest {
        tail,
        auto: true,
        overflow: true,
    };
    let before = live.context_tokens();
    let result = live
        .plan_compaction(request)
        .map_err(|e| e.to_string())
        .and_then(|plan| {
            let head = live.head_view(&plan);
            let outcome = compact(live, &plan, &head)?;
            let ids = CommitIds {
                prefix: format!("replay_cmp_{step}"),
            };
            live.commit_compaction(&plan, &outcome, &ids, now, config)
                .map_err(|e| e.to_string())
        });
    live.record_compaction(true, result.is_ok());
    match result {
        Ok(done) => CompactionRow {
            tokens_before: before,
            tokens_after: done.tokens_after,
            error: None,
        },
        Err(e) => CompactionRow {
            tokens_before: before,
            tokens_after: before,
            error: Some(e),
        },
    }
}

fn truncate(s: &str, n: usize) -> &str {
    match s.char_indices().nth(n) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}
