//! `compactd replay`: feeds an export through the engine message by message, as a live
//! host would, and reports per step the context size without compactd and with prune,
//! the provider-reported usage, and where overflow fired.
//!
//! Each assistant message is sent as the host sends it: info first (unfinished), then its
//! parts (a `step-finish` part is a usage report), then the info again, finished, which
//! runs the overflow check and the automatic prune.

use std::fmt;
use std::sync::Arc;

use super::Export;
use crate::config::EngineConfig;
use crate::engine::{Crossed, Event, Session, Update, step};
use crate::session::{ModelLimits, Role};
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
    /// Context tokens after compactd's prune.
    pub pruned: u64,
    /// Provider-reported usage of the step (0 when the export has none).
    pub reported: u64,
    /// Overflow fired at this step: what crossed.
    pub overflow: Option<Crossed>,
    /// Tool outputs cleared at this step, and their tokens.
    pub pruned_parts: usize,
    /// Tokens cleared at this step.
    pub pruned_tokens: u64,
}

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
}

/// Replays `export` with the given limits. The clock is the message's own creation time,
/// so a replay is deterministic.
pub fn replay(
    export: &Export,
    limits: ModelLimits,
    config: &EngineConfig,
    counter: Arc<dyn TokenCounter>,
) -> Report {
    let mut info = export.info.clone();
    info.limits = limits;
    let mut live = Session::new(info.clone(), config, counter.clone());
    let baseline_cfg = EngineConfig {
        prune: false,
        auto_compact: false,
        ..config.clone()
    };
    let mut baseline = Session::new(info, &baseline_cfg, counter);
    let mut rows = Vec::new();
    for (minfo, parts) in &export.messages {
        let now = minfo.time.completed.unwrap_or(minfo.time.created);
        let mut events = Vec::new();
        let mut feed = |update: Update| {
            // Exports are well formed; an update the engine refuses is reported and skipped.
            match step(&mut live, update.clone(), config, now) {
                Ok(r) => events.extend(r.events),
                Err(e) => tracing::warn!(error = %e, "replay: update refused"),
            }
            let _ = baseline.apply(update, &baseline_cfg);
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
        let (pruned_parts, pruned_tokens) = events.iter().fold((0, 0), |acc, e| match e {
            Event::Pruned(r) => (acc.0 + r.parts.len(), acc.1 + r.tokens_saved),
            _ => acc,
        });
        rows.push(Row {
            step: rows.len() + 1,
            message_id: minfo.id.clone(),
            baseline: baseline.build_context().tokens,
            pruned: live.build_context().tokens,
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
            "{:>5}  {:<32}  {:>10}  {:>10}  {:>10}  {:>9}  {:>8}",
            "step", "message", "no-compactd", "with-prune", "reported", "overflow", "pruned"
        )?;
        for r in &self.rows {
            let overflow = match r.overflow {
                Some(Crossed::Used) => "USED",
                Some(Crossed::Predicted) => "PREDICTED",
                None => "",
            };
            let pruned = if r.pruned_parts > 0 {
                format!("{}/{}t", r.pruned_parts, r.pruned_tokens)
            } else {
                String::new()
            };
            writeln!(
                f,
                "{:>5}  {:<32}  {:>10}  {:>10}  {:>10}  {:>9}  {:>8}",
                r.step,
                truncate(&r.message_id, 32),
                r.baseline,
                r.pruned,
                r.reported,
                overflow,
                pruned
            )?;
        }
        let last = self.rows.last();
        let (parts, tokens) = self.total_pruned();
        let overflows: Vec<String> = self.overflow_steps().map(|r| r.step.to_string()).collect();
        writeln!(
            f,
            "total: steps {}  final context no-compactd {}  with-prune {}  pruned {} outputs / {} tokens  overflow at steps [{}]",
            self.rows.len(),
            last.map_or(0, |r| r.baseline),
            last.map_or(0, |r| r.pruned),
            parts,
            tokens,
            overflows.join(",")
        )
    }
}

fn truncate(s: &str, n: usize) -> &str {
    match s.char_indices().nth(n) {
        Some((i, _)) => &s[..i],
        None => s,
    }
}
