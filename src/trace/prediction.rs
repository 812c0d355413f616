//! How well compactd predicts the next request's size, per tokenizer: replay feeds a
//! recorded session through the engine once per tokenizer (no prune, no strategies, no
//! compaction, so the context is what the original run sent) and compares, at every usage
//! report, the prediction made when that request started with the prompt the provider
//! reported (input + cache read + cache write).
//!
//! A request is left out when the original run pruned or compacted since the report its
//! prediction builds on (the previous request that reported usage: the recorded prompt
//! then describes a context the replay does not have), and so is the first request of a
//! session (nothing reported yet to build on). The original run's prunes are applied
//! where its stamps say, so what such a request reports teaches the calibration nothing
//! false.
//! Modes: `chars4`, `o200k`, `cl100k` (the estimate as each tokenizer counts it, with no
//! correction: what the model wrote comes back whole, its reasoning until a user message
//! starts a new turn) and `calibrated` (what overflow detection uses: the session's own
//! tokenizer with the correction its earlier reports taught).

use serde_json::{Value, json};

use super::Export;
use crate::config::{EngineConfig, StrategySet};
use crate::domain::{PartKind, Role};
use crate::engine::calibration::{ModelPriors, PredictionSample};
use crate::engine::{Session, Update};
use crate::tokens::{Counting, Tokenizer};

/// Reported prompts above this size are where an under-prediction matters most: the
/// closing figure `worst_under_pct_large` is over them alone.
pub const LARGE_PROMPT: u64 = 50_000;

/// One mode's predictions of one or more sessions.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ModeErrors {
    /// Relative error of each request, in percent (negative: predicted too small), with
    /// the reported prompt.
    pub errors: Vec<(f64, u64)>,
}

/// Figures of one mode.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ModeFigures {
    /// Requests compared.
    pub requests: usize,
    /// Median of |relative error|, percent.
    pub median_abs_pct: f64,
    /// 95th percentile of |relative error|, percent.
    pub p95_abs_pct: f64,
    /// The worst under-prediction, percent (0 when none was under).
    pub worst_under_pct: f64,
    /// The worst under-prediction among prompts above [`LARGE_PROMPT`].
    pub worst_under_pct_large: f64,
}

impl ModeErrors {
    fn push(&mut self, predicted: u64, actual: u64) {
        if actual == 0 {
            return;
        }
        let pct = (predicted as f64 - actual as f64) / actual as f64 * 100.0;
        self.errors.push((pct, actual));
    }

    /// Adds another session's errors (for the total).
    pub fn extend(&mut self, other: &ModeErrors) {
        self.errors.extend_from_slice(&other.errors);
    }

    /// The figures over every request held.
    pub fn figures(&self) -> ModeFigures {
        let mut abs: Vec<f64> = self.errors.iter().map(|(e, _)| e.abs()).collect();
        abs.sort_by(f64::total_cmp);
        let under = |large: bool| {
            self.errors
                .iter()
                .filter(|(_, actual)| !large || *actual > LARGE_PROMPT)
                .map(|(e, _)| -e)
                .fold(0.0f64, f64::max)
        };
        ModeFigures {
            requests: abs.len(),
            median_abs_pct: median(&abs),
            p95_abs_pct: percentile(&abs, 0.95),
            worst_under_pct: under(false),
            worst_under_pct_large: under(true),
        }
    }
}

/// The median of sorted values: the mean of the middle two for an even count (0 for
/// none).
fn median(sorted: &[f64]) -> f64 {
    let n = sorted.len();
    match n {
        0 => 0.0,
        _ if n % 2 == 1 => sorted[n / 2],
        _ => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

/// The nearest-rank percentile of sorted values (0 for none).
fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

impl ModeFigures {
    /// The JSON object replay prints per mode.
    pub fn to_json(&self) -> Value {
        let round = |v: f64| (v * 100.0).round() / 100.0;
        json!({
            "requests": self.requests,
            "median_abs_pct": round(self.median_abs_pct),
            "p95_abs_pct": round(self.p95_abs_pct),
            "worst_under_pct": round(self.worst_under_pct),
            "worst_under_pct_large": round(self.worst_under_pct_large),
        })
    }
}

/// Every mode's errors for one session (or a total), in [`MODES`] order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Prediction {
    /// Errors by mode.
    pub modes: [ModeErrors; 4],
}

/// The modes, in report order.
pub const MODES: [&str; 4] = ["chars4", "o200k", "cl100k", "calibrated"];

impl Prediction {
    /// Adds another session's errors.
    pub fn extend(&mut self, other: &Prediction) {
        for (a, b) in self.modes.iter_mut().zip(&other.modes) {
            a.extend(b);
        }
    }

    /// `{"chars4": {...}, "o200k": {...}, "cl100k": {...}, "calibrated": {...}}`.
    pub fn to_json(&self) -> Value {
        let map: serde_json::Map<String, Value> = MODES
            .iter()
            .zip(&self.modes)
            .map(|(m, e)| (m.to_string(), e.figures().to_json()))
            .collect();
        Value::Object(map)
    }

    /// One table row per mode, for the human report.
    pub fn rows(&self) -> Vec<(&'static str, ModeFigures)> {
        MODES
            .iter()
            .zip(&self.modes)
            .map(|(m, e)| (*m, e.figures()))
            .collect()
    }
}

/// Measures every mode on `export` (taken as recorded: its prune stamps say where the
/// original run pruned). `config` gives the cache counting rule and the tokenizer the
/// `calibrated` mode resolves to for the session's model. `priors` carries what earlier
/// sessions of the same model learned into this one, and what this one learned out, as
/// the server does across sessions.
pub fn measure(export: &Export, config: &EngineConfig, priors: &mut ModelPriors) -> Prediction {
    let model = model_of(export).map_or("", |m| m.model_id.as_str());
    let own = config.tokenizer.resolve(model);
    let mut out = Prediction::default();
    for (i, counting) in Counting::ALL.into_iter().enumerate() {
        let own_priors = (counting == own).then_some(&mut *priors);
        for s in samples(export, config, counting, own_priors) {
            out.modes[i].push(s.estimated, s.actual);
            if counting == own {
                out.modes[3].push(s.calibrated, s.actual);
            }
        }
    }
    out
}

/// The checks one tokenizer's session makes, less each one whose request followed a
/// prune or compaction of the original run made after the report the check builds on.
fn samples(
    export: &Export,
    config: &EngineConfig,
    counting: Counting,
    priors: Option<&mut ModelPriors>,
) -> Vec<PredictionSample> {
    let cfg = EngineConfig {
        auto_compact: false,
        prune: false,
        strategies: StrategySet::NONE,
        tokenizer: match counting {
            Counting::Chars4 => Tokenizer::Chars4,
            Counting::O200k => Tokenizer::O200k,
            Counting::Cl100k => Tokenizer::Cl100k,
        },
        ..config.clone()
    };
    let mut info = export.info.clone();
    info.config = Default::default();
    info.model = model_of(export).cloned();
    let mut session = Session::new(info, &cfg);
    let key = session.prior_key();
    if let (Some(p), Some(k)) = (priors.as_deref(), &key) {
        session.set_calibration_prior(p.prior(k));
    }
    let mut out = Vec::new();
    let mut last = 0u64;
    // Whether the original run pruned or compacted since the last report (the next
    // check's base): the next check is then left out. Set where the replay applies the
    // prune or feeds the compaction, cleared by the next report, whether or not it made
    // a check (a request with no base, the one after a summary, makes none).
    let mut disturbed = false;
    // The original run's prunes, seen where it saw them: each stamped output is written
    // whole with its message, then again stamped before the first message created
    // after its stamp. So the report of the request that followed the prune (left out
    // of the figures) does not teach the calibration a context the replay lacks.
    let mut stamped: Vec<(i64, crate::domain::Part)> = export
        .messages
        .iter()
        .flat_map(|(_, parts)| parts)
        .filter_map(|p| match &p.kind {
            PartKind::Tool(t) => t.state.time.compacted.map(|at| (at, p.clone())),
            _ => None,
        })
        .collect();
    stamped.sort_by_key(|(at, _)| *at);
    let mut stamps = stamped.into_iter().peekable();
    for (minfo, parts) in &export.messages {
        while let Some((_, part)) = stamps.next_if(|(at, _)| *at < minfo.time.created) {
            // A stamp older than its own message finds no part: left out.
            disturbed |= session.apply(Update::UpsertPart(part), &cfg).is_ok();
        }
        // A summary, or the message that asks for one: the compaction's own request and
        // the context after it are not the ones the last report described.
        disturbed |= minfo.summary
            || parts
                .iter()
                .any(|p| matches!(p.kind, PartKind::Compaction(_)));
        let mut feed = |update: Update, session: &mut Session| {
            // Exports are well formed; an update the engine refuses is skipped.
            let reported = session
                .apply(update, &cfg)
                .is_ok_and(|applied| applied.usage_reported);
            if let Some((n, s)) = session.prediction_sample()
                && n > last
            {
                last = n;
                if !disturbed {
                    out.push(s);
                }
            }
            disturbed &= !reported;
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
        feed(Update::UpsertMessage(first), &mut session);
        for p in parts {
            let mut p = p.clone();
            if let PartKind::Tool(t) = &mut p.kind {
                t.state.time.compacted = None;
            }
            feed(Update::UpsertPart(p), &mut session);
        }
        if assistant {
            feed(Update::UpsertMessage(minfo.clone()), &mut session);
        }
    }
    if let (Some(p), Some(k)) = (priors, &key) {
        p.learned(k, session.calibration());
    }
    out
}

/// The session's model: its own, else the first one an assistant message names (exports
/// carry it on the messages).
fn model_of(export: &Export) -> Option<&crate::domain::ModelRef> {
    export.info.model.as_ref().or_else(|| {
        export.messages.iter().find_map(|(m, _)| {
            (m.role == Role::Assistant)
                .then_some(m.model.as_ref())
                .flatten()
        })
    })
}

#[cfg(test)]
#[path = "prediction_tests.rs"]
mod tests;
