//! `compactd replay`: feeds an export through the engine message by message, as a live
//! host would, and reports per step the context size in three lanes (without compactd,
//! OpenCode's prune only, prune plus the aggressive strategies as configured), what each
//! strategy saved, the provider-reported usage, and where overflow fired.
//!
//! Each assistant message is sent as the host sends it: info first (unfinished), then its
//! parts (a `step-finish` part is a usage report), then the info again, finished, which
//! runs the overflow check and the automatic prune.

use std::collections::HashSet;
use std::fmt;

use super::Export;
use super::lanes::{LANES, LaneFigures, LaneRecord, lane_config};
use super::prediction::{MODES, Prediction};
use super::references::ReferenceIndex;
use crate::config::{CacheCounting, CacheModel, EngineConfig};
use crate::domain::{ModelLimits, Role};
use crate::engine::strategies::{Strategy, StrategyRun};
use crate::engine::{
    CommitIds, CompactionPlan, CompactionRequest, ContextView, Crossed, Event, Session,
    SummaryOutcome, TailOptions, Update, default_tail_tokens, step,
};

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
    /// Context tokens in the `masking-10` reference lane.
    pub masking: u64,
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
    /// What each lane sent, request by request ([`LANES`] order).
    pub lanes: Vec<LaneRecord>,
    /// Per request: the references the agent made.
    pub references: Vec<usize>,
    /// Tokens of the fixed prompt (system prompt, tool definitions) the export does not
    /// hold, estimated from the first reported usage.
    pub fixed_prefix: u64,
    /// How well each tokenizer predicted the recorded requests (`prediction.rs`; filled
    /// by the caller from the export as recorded, before its prune stamps are stripped).
    pub prediction: Prediction,
}

impl Report {
    /// Every lane's figures under `model`, in [`LANES`] order.
    pub fn lane_figures(&self, model: CacheModel) -> Vec<(&str, LaneFigures)> {
        self.lanes
            .iter()
            .map(|l| {
                (
                    l.name.as_str(),
                    l.figures(model, self.fixed_prefix, &self.references),
                )
            })
            .collect()
    }

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
pub fn replay(export: &Export, limits: ModelLimits, config: &EngineConfig) -> Report {
    replay_with(export, limits, config, None)
}

/// Like [`replay`], running a full compaction through `compactor` whenever the engine asks
/// for one (overflow that prune cannot fix).
pub fn replay_with(
    export: &Export,
    limits: ModelLimits,
    config: &EngineConfig,
    mut compactor: Option<&mut Compactor<'_>>,
) -> Report {
    let mut info = export.info.clone();
    info.limits = limits;
    let [baseline_cfg, prune_only_cfg, masking_cfg, _] = LANES.map(|l| lane_config(l, config));
    let mut live = Session::new(info.clone(), config);
    let mut prune_only = Session::new(info.clone(), &prune_only_cfg);
    let mut masking = Session::new(info.clone(), &masking_cfg);
    let mut baseline = Session::new(info, &baseline_cfg);
    let refs = ReferenceIndex::build(export);
    let originals: HashSet<String> = export
        .messages
        .iter()
        .flat_map(|(_, parts)| parts.iter().map(|p| p.id.clone()))
        .collect();
    let mut lanes: Vec<LaneRecord> = LANES.iter().map(|l| LaneRecord::new(l)).collect();
    let mut references = Vec::new();
    let mut fixed_prefix = None;
    let mut rows = Vec::new();
    let mut compacted_once = false;
    // Tokens the compactd lane's prompt is smaller than the unmanaged one at the current
    // request: the provider would have counted that much less.
    let mut saved_now = 0u64;
    for (position, (minfo, parts)) in export.messages.iter().enumerate() {
        let now = minfo.time.completed.unwrap_or(minfo.time.created);
        if minfo.role == Role::Assistant && minfo.is_finished() {
            // One request: each lane's prompt as it stands before the reply.
            for (lane, session) in lanes
                .iter_mut()
                .zip([&baseline, &prune_only, &masking, &live])
            {
                lane.request(
                    &session.build_context(),
                    minfo.time.created,
                    position,
                    &refs,
                    &originals,
                );
            }
            references.push(refs.of_request(position).len());
            saved_now = lanes[0]
                .last_prompt_tokens()
                .saturating_sub(lanes[3].last_prompt_tokens());
            if fixed_prefix.is_none()
                && let Some(t) = minfo.tokens.filter(|t| !t.is_empty())
            {
                let sent = crate::engine::calibration::prompt_tokens(&t, config.cache_counting);
                let estimated = lanes[0].last_prompt_tokens();
                fixed_prefix = Some(sent.saturating_sub(estimated));
            }
        }
        let mut events = Vec::new();
        let stale_usage = compacted_once;
        let mut feed = |update: Update| {
            let _ = baseline.apply(update.clone(), &baseline_cfg);
            let _ = step(&mut prune_only, update.clone(), &prune_only_cfg, now);
            let _ = step(&mut masking, update.clone(), &masking_cfg, now);
            // After a compaction the recorded usage describes the original, uncompacted run:
            // the replayed session goes by its prediction instead.
            // Before it, the recorded usage counted the unmanaged prompt: the replayed
            // session's provider would have counted its own, `saved_now` smaller.
            let update = if stale_usage {
                without_usage(update)
            } else {
                usage_less(update, saved_now, config.cache_counting)
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
            // As a live host opens it: unfinished, and with no usage yet (the message's
            // own is its last step's, reported as the message finishes).
            first.finish.clear();
            first.time.completed = None;
            first.tokens = None;
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
        let needed = events
            .iter()
            .any(|e| matches!(e, Event::CompactionNeeded(_)));
        let compaction = match (&mut compactor, needed) {
            (Some(compact), true) => {
                let (row, pruned) = run_compaction(&mut live, compact, config, now, rows.len());
                // What the commit applied of the held decisions counts as this step's.
                events.extend(pruned.map(Event::Pruned));
                Some(row)
            }
            _ => None,
        };
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
        let compacted = compaction.as_ref().is_some_and(|c| c.error.is_none());
        compacted_once |= compacted;
        lanes[3].compactions += usize::from(compacted);
        rows.push(Row {
            step: rows.len() + 1,
            compaction,
            message_id: minfo.id.clone(),
            baseline: baseline.build_context().tokens,
            prune_only: prune_only.build_context().tokens,
            pruned: live.build_context().tokens,
            masking: masking.build_context().tokens,
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
        lanes,
        references,
        fixed_prefix: fixed_prefix.unwrap_or(0),
        prediction: Prediction::default(),
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
            "{:>5}  {:<32}  {:>11}  {:>10}  {:>10}  {:>10}  {:>10}  {:>9}  {:<16}  strategies",
            "step",
            "message",
            "no-compactd",
            "prune-only",
            "masking-10",
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
                "{:>5}  {:<32}  {:>11}  {:>10}  {:>10}  {:>10}  {:>10}  {:>9}  {:<16}  {}",
                r.step,
                truncate(&r.message_id, 32),
                r.baseline,
                r.prune_only,
                r.masking,
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

/// The update with `saved` fewer prompt tokens in its provider usage, taken from the
/// fields `rule` counts: cache reads first, then input, then cache writes (`Separate`);
/// input, then cache writes, with the cache reads input holds lowered alike
/// (`Included`: input already counts them; a report whose reads exceed its input counted
/// them apart, `TokenUsage::cache_read_apart`, and is lowered as under `Separate`).
fn usage_less(update: Update, saved: u64, rule: CacheCounting) -> Update {
    fn less(t: &mut crate::domain::TokenUsage, saved: u64, rule: CacheCounting) {
        let mut left = saved;
        let mut take_from = |field: &mut u64| {
            let take = left.min(*field);
            *field = field.saturating_sub(take);
            left = left.saturating_sub(take);
            take
        };
        if rule == CacheCounting::Separate || t.cache_read_apart(rule) > 0 {
            take_from(&mut t.cache_read);
            take_from(&mut t.input);
        } else {
            // The saving is of the cached prefix first, as under `Separate`.
            let take = take_from(&mut t.input);
            t.cache_read = t.cache_read.saturating_sub(take).min(t.input);
        }
        take_from(&mut t.cache_write);
        if let Some(total) = &mut t.total {
            *total = total.saturating_sub(saved.saturating_sub(left));
        }
    }
    if saved == 0 {
        return update;
    }
    match update {
        Update::UpsertMessage(mut m) => {
            if let Some(t) = &mut m.tokens {
                less(t, saved, rule);
            }
            Update::UpsertMessage(m)
        }
        Update::UpsertPart(mut p) => {
            if let crate::domain::PartKind::StepFinish(f) = &mut p.kind
                && let Some(t) = &mut f.tokens
            {
                less(t, saved, rule);
            }
            Update::UpsertPart(p)
        }
        other => other,
    }
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
) -> (CompactionRow, Option<crate::engine::PruneReport>) {
    let tail = TailOptions {
        turns: 2,
        max_tokens: default_tail_tokens(live.info().limits.usable_input()),
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
        Ok(done) => (
            CompactionRow {
                tokens_before: before,
                tokens_after: done.tokens_after,
                error: None,
            },
            done.pruned,
        ),
        Err(e) => (
            CompactionRow {
                tokens_before: before,
                tokens_after: before,
                error: Some(e),
            },
            None,
        ),
    }
}

fn truncate(s: &str, n: usize) -> &str {
    match s.char_indices().nth(n) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}

/// The `replay --json` document: per trace and in total, every lane's figures under
/// `model`. Key names are a contract other tools read.
pub fn json_document(reports: &[(String, Report)], model: CacheModel) -> serde_json::Value {
    let mut total: Vec<(String, LaneFigures)> = LANES
        .iter()
        .map(|l| (l.to_string(), LaneFigures::default()))
        .collect();
    let mut prediction = Prediction::default();
    let traces: Vec<serde_json::Value> = reports
        .iter()
        .map(|(file, r)| {
            let mut lanes = serde_json::Map::new();
            for (name, f) in r.lane_figures(model) {
                if let Some((_, t)) = total.iter_mut().find(|(n, _)| n == name) {
                    t.add(&f);
                }
                lanes.insert(name.to_string(), f.to_json());
            }
            prediction.extend(&r.prediction);
            serde_json::json!({
                "file": file,
                "requests": r.references.len(),
                "lanes": lanes,
                "prediction": r.prediction.to_json(),
            })
        })
        .collect();
    let lanes: serde_json::Map<String, serde_json::Value> = total
        .iter()
        .map(|(n, f)| (n.clone(), f.to_json()))
        .collect();
    serde_json::json!({
        "cache_model": model.to_string(),
        "traces": traces,
        "total": {"lanes": lanes, "prediction": prediction.to_json()},
    })
}

/// A Markdown table of every lane of every trace under `model`: prompt tokens, cost,
/// cache breaks and dangling references, with the change against `none`, and the total.
pub fn lanes_table(reports: &[(String, Report)], model: CacheModel) -> String {
    let mut out = format!(
        "cache model {model}\n\n| trace | lane | requests | prompt tokens | vs none | cost | vs none | cache breaks | dangling / references |\n|---|---|---:|---:|---:|---:|---:|---:|---:|\n"
    );
    let mut total: Vec<LaneFigures> = vec![LaneFigures::default(); LANES.len()];
    let mut requests = 0;
    let row = |out: &mut String,
               name: &str,
               lane: &str,
               n: usize,
               f: &LaneFigures,
               none: &LaneFigures| {
        out.push_str(&format!(
            "| {name} | {lane} | {n} | {} | {} | {:.0} | {} | {} | {} / {} ({:.1}%) |\n",
            f.prompt_tokens,
            pct(f.prompt_tokens as f64, none.prompt_tokens as f64),
            f.cost,
            pct(f.cost, none.cost),
            f.cache_breaks,
            f.dangling_references,
            f.references,
            100.0 * f.dangling_rate()
        ));
    };
    for (name, r) in reports {
        let figures = r.lane_figures(model);
        requests += r.references.len();
        let none = figures.first().map(|(_, f)| *f).unwrap_or_default();
        for (i, (lane, f)) in figures.iter().enumerate() {
            row(&mut out, name, lane, r.references.len(), f, &none);
            if let Some(t) = total.get_mut(i) {
                t.add(f);
            }
        }
    }
    if reports.len() > 1 {
        let none = total[0];
        for (lane, f) in LANES.iter().zip(&total) {
            row(&mut out, "**total**", lane, requests, f, &none);
        }
    }
    out
}

/// `-12.3%`: the change of `v` against `base`.
fn pct(v: f64, base: f64) -> String {
    if base <= 0.0 {
        return "–".to_string();
    }
    format!("{:+.1}%", 100.0 * (v - base) / base)
}

/// A Markdown table of how well each tokenizer predicted the recorded requests, per trace
/// and in total: relative error of the predicted prompt against the reported one.
pub fn prediction_table(reports: &[(String, Report)]) -> String {
    let mut out = String::from(
        "prediction of the next request (predicted vs reported prompt; requests after a \
         prune or compaction of the original run are left out)\n\n\
         | trace | mode | requests | median abs err | p95 abs err | worst under | worst under, prompts > 50k |\n\
         |---|---|---:|---:|---:|---:|---:|\n",
    );
    let mut total = Prediction::default();
    let rows = |out: &mut String, name: &str, p: &Prediction| {
        for (mode, f) in p.rows() {
            out.push_str(&format!(
                "| {name} | {mode} | {} | {:.1}% | {:.1}% | {:.1}% | {:.1}% |\n",
                f.requests,
                f.median_abs_pct,
                f.p95_abs_pct,
                f.worst_under_pct,
                f.worst_under_pct_large
            ));
        }
    };
    for (name, r) in reports {
        rows(&mut out, name, &r.prediction);
        total.extend(&r.prediction);
    }
    if reports.len() > 1 {
        rows(&mut out, "**total**", &total);
    }
    debug_assert_eq!(MODES.len(), total.modes.len());
    out
}

#[cfg(test)]
#[path = "replay_tests.rs"]
mod tests;
