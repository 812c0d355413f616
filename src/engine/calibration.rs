//! Calibration: learning, from the usage reports a session already receives, how far the
//! tokenizer's estimate is from what the provider counts, by content class, and
//! correcting the next request's prediction with it.
//!
//! Every report says how many tokens the provider counted for a request whose size the
//! engine predicted as `anchor + Σ estimate_c` (the anchor being the previous request's
//! reported prompt plus its output, the estimates what was added since, by class). The
//! correction is the ridge regression `actual − anchor ≈ Σ f_c · estimate_c` over the
//! session's reports (older ones decayed), pulled toward a prior (1.0, or what sessions
//! of the same model learned): a class needs about [`RIDGE_TOKENS`] of evidence to move
//! its factor. Factors stay within [`MIN_FACTOR`, `MAX_FACTOR`]. Pure arithmetic, O(1)
//! per report.

use serde::{Deserialize, Serialize};

use crate::config::CacheCounting;
use crate::domain::TokenUsage;

/// The prompt one report says the provider counted: input, cache reads (unless the
/// input already includes them) and cache writes.
pub fn prompt_tokens(u: &TokenUsage, rule: CacheCounting) -> u64 {
    let read = match rule {
        CacheCounting::Separate => u.cache_read,
        CacheCounting::Included => 0,
    };
    u.input.saturating_add(read).saturating_add(u.cache_write)
}

/// What the next request starts from, by one report: the provider's total when it gives
/// one, else its prompt plus what the model wrote (which the next request carries as
/// input).
pub fn anchor_tokens(u: &TokenUsage, rule: CacheCounting) -> u64 {
    match u.total.filter(|t| *t > 0) {
        Some(total) => total,
        None => prompt_tokens(u, rule).saturating_add(u.output),
    }
}

/// Content classes the estimate is corrected by (tokenizers miss by different amounts on
/// each: chars ÷ 4 is close on code and far on command output).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Class {
    /// Tool outputs other than file contents: command output, logs, search results.
    ToolOutput,
    /// Source code: file contents tools read and the edits they apply.
    Code,
    /// Prose: user and assistant text, reasoning, everything else.
    Prose,
}

impl Class {
    /// Every class, in index order.
    pub const ALL: [Class; 3] = [Class::ToolOutput, Class::Code, Class::Prose];

    fn index(self) -> usize {
        match self {
            Class::ToolOutput => 0,
            Class::Code => 1,
            Class::Prose => 2,
        }
    }

    /// Name in reports.
    pub fn as_str(self) -> &'static str {
        match self {
            Class::ToolOutput => "tool_output",
            Class::Code => "code",
            Class::Prose => "prose",
        }
    }
}

/// Tools whose output is file content (code), by name.
const CODE_TOOLS: [&str; 7] = [
    "read",
    "view",
    "edit",
    "write",
    "multiedit",
    "apply_patch",
    "patch",
];

/// The class of a tool's output.
pub fn tool_class(tool: &str) -> Class {
    if CODE_TOOLS.iter().any(|t| t.eq_ignore_ascii_case(tool)) {
        Class::Code
    } else {
        Class::ToolOutput
    }
}

/// Signed token figures per class (what was added or removed since a point in time).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ByClass([i64; 3]);

impl ByClass {
    /// Adds `n` tokens (negative: removes) to `class`, saturating.
    pub fn add(&mut self, class: Class, n: i64) {
        let slot = &mut self.0[class.index()];
        *slot = slot.saturating_add(n);
    }

    /// The figure of one class.
    pub fn get(&self, class: Class) -> i64 {
        self.0[class.index()]
    }

    /// All classes together.
    pub fn total(&self) -> i64 {
        self.0.iter().fold(0i64, |a, b| a.saturating_add(*b))
    }

    /// `self − other`, class by class.
    pub fn minus(&self, other: &ByClass) -> ByClass {
        let mut out = *self;
        for (o, b) in out.0.iter_mut().zip(other.0) {
            *o = o.saturating_sub(b);
        }
        out
    }

    fn as_f64(&self) -> [f64; 3] {
        self.0.map(|v| v as f64)
    }
}

/// Tokens of evidence a class needs before its factor moves halfway from the prior.
pub const RIDGE_TOKENS: f64 = 1_000.0;
/// Weight each earlier report keeps when a new one arrives (about the last 20 count).
pub const DECAY: f64 = 0.95;
/// Smallest factor applied.
pub const MIN_FACTOR: f64 = 0.25;
/// Largest factor applied.
pub const MAX_FACTOR: f64 = 4.0;

/// Per-class correction factors.
pub type Factors = [f64; 3];

/// The neutral prior: trust the tokenizer.
pub const NEUTRAL: Factors = [1.0; 3];

/// What a session has learned: the decayed normal equations of the regression, and the
/// factors they give. Every figure is finite (an observation that would make one
/// infinite is skipped), so plain JSON numbers store them.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Calibration {
    /// Σ decay^age · e eᵀ.
    gram: [[f64; 3]; 3],
    /// Σ decay^age · e · (actual − anchor).
    moment: [f64; 3],
    /// Where the factors are pulled toward.
    prior: Factors,
    /// The factors applied to the next prediction.
    factors: Factors,
    /// Reports learned from.
    observations: u32,
}

impl Default for Calibration {
    fn default() -> Self {
        Calibration {
            gram: [[0.0; 3]; 3],
            moment: [0.0; 3],
            prior: NEUTRAL,
            factors: NEUTRAL,
            observations: 0,
        }
    }
}

/// One predicted request and what the provider reported for it (replay reports these).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PredictionSample {
    /// The previous request's reported prompt plus its output.
    pub anchor: u64,
    /// The prediction with the tokenizer's estimate as it is.
    pub estimated: u64,
    /// The prediction with the calibrated estimate (what overflow detection uses).
    pub calibrated: u64,
    /// The prompt the provider reported (input + cache read + cache write).
    pub actual: u64,
}

impl Calibration {
    /// The factors the next prediction uses.
    pub fn factors(&self) -> Factors {
        self.factors
    }

    /// Reports learned from.
    pub fn observations(&self) -> u32 {
        self.observations
    }

    /// Starts from `prior` (what other sessions of the model learned) where this session
    /// has learned nothing yet of its own.
    pub fn set_prior(&mut self, prior: Factors) {
        self.prior = prior.map(clamp);
        self.factors = self.solve().unwrap_or(self.prior);
    }

    /// `estimate` corrected: Σ f_c · e_c, rounded, saturating.
    pub fn apply(&self, estimate: &ByClass) -> i64 {
        let v: f64 = estimate
            .as_f64()
            .iter()
            .zip(self.factors)
            .map(|(e, f)| e * f)
            .sum();
        // `as` saturates at the i64 range (and maps NaN to 0).
        v.round() as i64
    }

    /// Learns from one report: `added` was estimated, `actual_added` is what the provider
    /// counted on top of the anchor.
    pub fn observe(&mut self, added: &ByClass, actual_added: i64) {
        let e = added.as_f64();
        if e.iter().all(|v| *v == 0.0) {
            return;
        }
        let a = actual_added as f64;
        let (mut gram, mut moment) = (self.gram, self.moment);
        for i in 0..3 {
            moment[i] = moment[i] * DECAY + e[i] * a;
            for j in 0..3 {
                gram[i][j] = gram[i][j] * DECAY + e[i] * e[j];
            }
        }
        if !(moment.iter().chain(gram.iter().flatten())).all(|v| v.is_finite()) {
            return;
        }
        (self.gram, self.moment) = (gram, moment);
        self.observations = self.observations.saturating_add(1);
        if let Some(f) = self.solve() {
            self.factors = f;
        }
    }

    /// (G + λI) f = m + λ p, by Gaussian elimination with partial pivoting; `None` when the
    /// figures are not finite (they never are singular: λ > 0).
    #[allow(clippy::needless_range_loop)] // matrix arithmetic reads best with indices
    fn solve(&self) -> Option<Factors> {
        let lambda = RIDGE_TOKENS * RIDGE_TOKENS;
        let mut m = [[0.0f64; 4]; 3];
        for i in 0..3 {
            for j in 0..3 {
                m[i][j] = self.gram[i][j] + if i == j { lambda } else { 0.0 };
            }
            m[i][3] = self.moment[i] + lambda * self.prior[i];
        }
        for col in 0..3 {
            let pivot = (col..3).max_by(|a, b| m[*a][col].abs().total_cmp(&m[*b][col].abs()))?;
            m.swap(col, pivot);
            let p = m[col][col];
            if !p.is_finite() || p.abs() < f64::MIN_POSITIVE {
                return None;
            }
            for row in 0..3 {
                if row != col {
                    let k = m[row][col] / p;
                    for c in col..4 {
                        m[row][c] -= k * m[col][c];
                    }
                }
            }
        }
        let f = [m[0][3] / m[0][0], m[1][3] / m[1][1], m[2][3] / m[2][2]];
        f.iter().all(|v| v.is_finite()).then(|| f.map(clamp))
    }
}

fn clamp(f: f64) -> f64 {
    if f.is_finite() {
        f.clamp(MIN_FACTOR, MAX_FACTOR)
    } else {
        1.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn by(out: i64, code: i64, prose: i64) -> ByClass {
        let mut b = ByClass::default();
        b.add(Class::ToolOutput, out);
        b.add(Class::Code, code);
        b.add(Class::Prose, prose);
        b
    }

    #[test]
    fn learns_a_factor_per_class() {
        let mut c = Calibration::default();
        // The provider counts 1.7× the estimate of tool output and 0.9× of prose.
        for i in 0..30 {
            let (out, prose) = (2_000 + 100 * i, 500 + 300 * ((3 * i) % 7));
            let actual = (1.7 * out as f64 + 0.9 * prose as f64) as i64;
            c.observe(&by(out, 0, prose), actual);
        }
        let f = c.factors();
        assert!((f[0] - 1.7).abs() < 0.02, "{f:?}");
        assert!((f[2] - 0.9).abs() < 0.1, "{f:?}");
        // Code was never seen: it stays at the prior.
        assert!((f[1] - 1.0).abs() < 1e-9, "{f:?}");
        assert!((c.apply(&by(1_000, 0, 0)) - 1_700).abs() <= 20);
    }

    #[test]
    fn little_evidence_stays_near_the_prior() {
        let mut c = Calibration::default();
        c.observe(&by(10, 0, 0), 40);
        assert!((c.factors()[0] - 1.0).abs() < 0.01, "{:?}", c.factors());
        c.set_prior([2.0, 1.0, 1.0]);
        assert!((c.factors()[0] - 2.0).abs() < 0.01, "{:?}", c.factors());
    }

    #[test]
    fn wild_reports_stay_within_bounds() {
        let mut c = Calibration::default();
        for _ in 0..10 {
            c.observe(&by(5_000, 0, 0), 1_000_000_000);
        }
        assert_eq!(c.factors()[0], MAX_FACTOR);
        c.observe(&by(i64::MAX, i64::MIN, 0), i64::MIN);
        assert!(c.factors().iter().all(|f| f.is_finite()));
        assert!(
            c.factors()
                .iter()
                .all(|f| (MIN_FACTOR..=MAX_FACTOR).contains(f))
        );
    }
}
