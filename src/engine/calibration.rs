//! Calibration: learning, from the usage reports a session already receives, how far the
//! tokenizer's estimate is from what the provider counts, by content class, and
//! correcting the next request's prediction with it.
//!
//! Every report says how many tokens the provider counted for a request whose size the
//! engine predicted as `base + Σ estimate_c`: the base is the previous request's reported
//! prompt, and the estimates are, by class, what the model wrote in that request (its
//! reported output: the text and the reasoning apart, since hosts and providers carry its
//! reasoning into the next request of the same turn or not at all), what a new user turn
//! removes (providers drop the reasoning of earlier turns: Anthropic documents it as
//! `(input_tokens − previous_thinking_tokens) + current_turn_tokens`, and OpenAI's
//! reasoning items before the last user message are not kept), and what was added since
//! (tool output, code, prose, as the session's tokenizer counts them). The correction is
//! the ridge regression `actual − base ≈ Σ f_c · estimate_c` over the session's reports
//! (older ones decayed), each report weighted by the inverse square of its estimate, so
//! every request counts alike whatever its size (one huge output the host truncated is
//! one request, not a thousand), pulled toward a prior ([`NEUTRAL`], or what sessions of
//! the same model learned) that weighs as [`PRIOR_REQUESTS`] requests against the
//! session's decayed evidence.
//! Factors stay within [`MIN_FACTOR`, `MAX_FACTOR`], except reasoning's, within 0 and 1: a
//! reported count, not an estimate, of which the next request carries some or none. A
//! report no factors within those bounds could explain, give or take a few requests'
//! unseen tokens, is not learned from.
//! Pure arithmetic, O(1) per report.

use serde::{Deserialize, Serialize};

use crate::config::CacheCounting;
use crate::domain::{FastMap, TokenUsage};

/// The prompt one report says the provider counted: input, cache reads (unless the
/// input already includes them) and cache writes.
pub fn prompt_tokens(u: &TokenUsage, rule: CacheCounting) -> u64 {
    u.input
        .saturating_add(u.cache_read_apart(rule))
        .saturating_add(u.cache_write)
}

/// What the next request starts from, by one report, in two parts: the prompt it counted,
/// and what the model wrote (which the next request carries as input). With a provider
/// total, the prompt is the total less the output.
pub fn split_anchor(u: &TokenUsage, rule: CacheCounting) -> (u64, u64) {
    match u.total.filter(|t| *t > 0) {
        Some(total) => (total.saturating_sub(u.output), u.output.min(total)),
        None => (prompt_tokens(u, rule), u.output),
    }
}

/// What one report anchors the next request on: the prompt it counted, and what the model
/// wrote, its reasoning apart (reasoning is part of the output for the providers that
/// report it; a figure above the output was reported apart from it, and is left out).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Anchor {
    /// The prompt the provider counted.
    pub prompt: u64,
    /// What the model wrote other than reasoning.
    pub text: u64,
    /// The reasoning the model wrote.
    pub reasoning: u64,
}

impl Anchor {
    /// The anchor of one report.
    pub fn of(u: &TokenUsage, rule: CacheCounting) -> Anchor {
        let (prompt, written) = split_anchor(u, rule);
        // Above the output, it was reported apart from it: not part of what is anchored on.
        let reasoning = if u.reasoning <= written {
            u.reasoning
        } else {
            0
        };
        Anchor {
            prompt,
            text: written.saturating_sub(reasoning),
            reasoning,
        }
    }

    /// What the model wrote, reasoning included.
    pub fn written(&self) -> u64 {
        self.text.saturating_add(self.reasoning)
    }
}

/// [`split_anchor`]'s two parts together.
pub fn anchor_tokens(u: &TokenUsage, rule: CacheCounting) -> u64 {
    let (prompt, written) = split_anchor(u, rule);
    prompt.saturating_add(written)
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
    /// What the model wrote in the previous request other than reasoning, by its reported
    /// output.
    Written,
    /// The reasoning the model wrote in the previous request, by its report; at the first
    /// request of a new user turn, minus the reasoning the turn's earlier requests carried
    /// (which the provider drops). Its factor is how much of its reasoning the host sends
    /// back within a turn.
    Reasoning,
}

/// Number of classes.
const N: usize = 5;

impl Class {
    /// Every class, in index order.
    pub const ALL: [Class; N] = [
        Class::ToolOutput,
        Class::Code,
        Class::Prose,
        Class::Written,
        Class::Reasoning,
    ];

    fn index(self) -> usize {
        match self {
            Class::ToolOutput => 0,
            Class::Code => 1,
            Class::Prose => 2,
            Class::Written => 3,
            Class::Reasoning => 4,
        }
    }

    /// Name in reports.
    pub fn as_str(self) -> &'static str {
        match self {
            Class::ToolOutput => "tool_output",
            Class::Code => "code",
            Class::Prose => "prose",
            Class::Written => "written",
            Class::Reasoning => "reasoning",
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
pub struct ByClass([i64; N]);

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

    fn as_f64(&self) -> [f64; N] {
        self.0.map(|v| v as f64)
    }
}

/// The prior's weight, in requests.
pub const PRIOR_REQUESTS: f64 = 2.0;
/// Weight each earlier report keeps when a new one arrives (about the last 20 count).
pub const DECAY: f64 = 0.95;
/// Tokens a request may carry beyond every estimate of what was added (each message's
/// framing, a tool call's wrapper, a provider's reminder): a report that added less than
/// about this teaches the factors little, as its ratio is mostly these.
pub const UNSEEN_PER_REQUEST: f64 = 256.0;
/// Tokens past what factors within their bounds allow that a report may still be off by
/// and be learned from: a few requests' worth of what no estimate sees.
pub const UNEXPLAINED_SLACK: f64 = 4.0 * UNSEEN_PER_REQUEST;
/// Smallest factor applied.
pub const MIN_FACTOR: f64 = 0.25;
/// Largest factor applied.
pub const MAX_FACTOR: f64 = 4.0;

/// Per-class correction factors.
pub type Factors = [f64; N];

/// The neutral prior: trust the tokenizer, and take the model's reasoning as not sent
/// back until the reports show it is (a drop of reasoning that was never there would be
/// an under-prediction at every new turn; reasoning taken as absent is one step's).
pub const NEUTRAL: Factors = [1.0, 1.0, 1.0, 1.0, 0.0];

/// What a session has learned: the decayed normal equations of the regression, and the
/// factors they give. Every figure is finite (an observation that would make one
/// infinite is skipped), so plain JSON numbers store them.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Calibration {
    /// Σ decay^age · e eᵀ.
    gram: [[f64; N]; N],
    /// Σ decay^age · e · (actual − base).
    moment: [f64; N],
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
            gram: [[0.0; N]; N],
            moment: [0.0; N],
            prior: NEUTRAL,
            factors: NEUTRAL,
            observations: 0,
        }
    }
}

/// One predicted request and what the provider reported for it (replay reports these).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PredictionSample {
    /// The previous request's reported prompt (the prediction's base).
    pub base: u64,
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

    /// Where the factors are pulled toward: the store gives a session its model's prior
    /// only when it is not this one already.
    pub fn prior(&self) -> Factors {
        self.prior
    }

    /// Starts from `prior` (what other sessions of the model learned) where this session
    /// has learned nothing yet of its own.
    pub fn set_prior(&mut self, prior: Factors) {
        self.prior = clamp_all(prior);
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
    /// counted on top of the anchor. A report no factors within their bounds could
    /// explain teaches nothing (one such figure would otherwise pin a factor at its bound
    /// for dozens of reports, and other sessions of the model start from it).
    pub fn observe(&mut self, added: &ByClass, actual_added: i64) {
        let e = added.as_f64();
        if e.iter().all(|v| *v == 0.0) {
            return;
        }
        let a = actual_added as f64;
        if !explainable(&e, a) {
            return;
        }
        let size: f64 = e.iter().map(|v| v.abs()).sum();
        // Each report weighs as one request in ratio space (1 / size²), less when what
        // was added is small beside the tokens every request carries that no estimate
        // sees (framing, a provider's own additions): their ratio is mostly that.
        let w = 1.0 / (size * size + UNSEEN_PER_REQUEST * UNSEEN_PER_REQUEST);
        let (mut gram, mut moment) = (self.gram, self.moment);
        for i in 0..N {
            moment[i] = moment[i] * DECAY + w * e[i] * a;
            for j in 0..N {
                gram[i][j] = gram[i][j] * DECAY + w * e[i] * e[j];
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
        // The prior weighs as PRIOR_REQUESTS requests against the session's own decayed
        // evidence (at most 1 / (1 − DECAY) = 20 requests): a steady pull toward it,
        // which keeps a class seen rarely near its prior.
        let lambda = PRIOR_REQUESTS;
        let mut m = [[0.0f64; N + 1]; N];
        for i in 0..N {
            for j in 0..N {
                m[i][j] = self.gram[i][j] + if i == j { lambda } else { 0.0 };
            }
            m[i][N] = self.moment[i] + lambda * self.prior[i];
        }
        for col in 0..N {
            let pivot = (col..N).max_by(|a, b| m[*a][col].abs().total_cmp(&m[*b][col].abs()))?;
            m.swap(col, pivot);
            let p = m[col][col];
            if !p.is_finite() || p.abs() < f64::MIN_POSITIVE {
                return None;
            }
            for row in 0..N {
                if row != col {
                    let k = m[row][col] / p;
                    for c in col..=N {
                        m[row][c] -= k * m[col][c];
                    }
                }
            }
        }
        let mut f = [0.0; N];
        for (i, v) in f.iter_mut().enumerate() {
            *v = m[i][N] / m[i][i];
        }
        f.iter().all(|v| v.is_finite()).then(|| clamp_all(f))
    }
}

/// Reports a session must have learned from before its factors seed other sessions.
pub const SHARE_AFTER: u32 = 3;
/// Models remembered (model ids come from clients: the map must stay bounded).
pub const MAX_MODELS: usize = 1024;

/// What sessions of each model learned, so a new session of the model starts from it
/// instead of from 1.0. Keyed by tokenizer and model (a correction of o200k's counts says
/// nothing about chars ÷ 4's).
#[derive(Debug, Clone, Default)]
pub struct ModelPriors {
    by_model: FastMap<String, Factors>,
}

impl ModelPriors {
    /// The key of a session's model under `counting`; None when the session names no model.
    pub fn key(
        info: &crate::domain::SessionInfo,
        counting: crate::tokens::Counting,
    ) -> Option<String> {
        let m = info.model.as_ref()?;
        (!m.model_id.is_empty())
            .then(|| format!("{}:{}/{}", counting.as_str(), m.provider_id, m.model_id))
    }

    /// Where a new session of `key`'s model starts.
    pub fn prior(&self, key: &str) -> Factors {
        self.by_model.get(key).copied().unwrap_or(NEUTRAL)
    }

    /// Takes what a session of `key`'s model learned (the latest session with enough
    /// evidence speaks for the model). A new model past [`MAX_MODELS`] is not kept.
    pub fn learned(&mut self, key: &str, c: &Calibration) {
        if c.observations() < SHARE_AFTER {
            return;
        }
        if let Some(f) = self.by_model.get_mut(key) {
            *f = c.factors();
        } else if self.by_model.len() < MAX_MODELS {
            self.by_model.insert(key.to_string(), c.factors());
        }
    }
}

/// Every factor within its class's bounds (a non-finite one is 1.0).
fn clamp_all(mut f: Factors) -> Factors {
    for (v, class) in f.iter_mut().zip(Class::ALL) {
        let (lo, hi) = bounds(class);
        *v = if v.is_finite() { v.clamp(lo, hi) } else { 1.0 };
    }
    f
}

/// The range a class's factor is kept within.
fn bounds(class: Class) -> (f64, f64) {
    match class {
        Class::Reasoning => (0.0, 1.0),
        _ => (MIN_FACTOR, MAX_FACTOR),
    }
}

/// Whether factors within their bounds could explain a request that added `actual`
/// tokens where `e` was estimated, give or take [`UNEXPLAINED_SLACK`]: a report outside
/// says nothing of the tokenizer (a client's bad figure, a context compactd did not see,
/// such as a provider's reset cache counting or another system prompt).
fn explainable(e: &[f64; N], actual: f64) -> bool {
    let (mut lo, mut hi) = (0.0, 0.0);
    for (v, class) in e.iter().zip(Class::ALL) {
        let (min, max) = bounds(class);
        let (a, b) = (v * min, v * max);
        lo += a.min(b);
        hi += a.max(b);
    }
    actual >= lo - UNEXPLAINED_SLACK && actual <= hi + UNEXPLAINED_SLACK
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prompt_counts_cache_reads_the_input_cannot_hold() {
        let u = |input, cache_read| TokenUsage {
            input,
            cache_read,
            cache_write: 7,
            output: 3,
            ..TokenUsage::default()
        };
        assert_eq!(
            prompt_tokens(&u(1_000, 400), CacheCounting::Separate),
            1_407
        );
        assert_eq!(
            prompt_tokens(&u(1_000, 400), CacheCounting::Included),
            1_007
        );
        // Reads above the input were counted apart, whatever the session's rule.
        assert_eq!(
            prompt_tokens(&u(50, 180_000), CacheCounting::Included),
            180_057
        );
        assert_eq!(
            split_anchor(&u(50, 180_000), CacheCounting::Included),
            (180_057, 3)
        );
    }

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
        // Most of the way (about 20 requests of evidence, the decay's memory, against the
        // prior's 2, each request's weight shared by its classes).
        assert!((1.45..1.7).contains(&f[0]), "{f:?}");
        assert!((0.85..1.15).contains(&f[2]), "{f:?}");
        // Code was never seen: it stays at the prior.
        assert!((f[1] - 1.0).abs() < 1e-9, "{f:?}");
        assert_eq!(c.apply(&by(1_000, 0, 0)), (1_000.0 * f[0]).round() as i64);
    }

    #[test]
    fn one_request_weighs_half_as_much_as_the_prior() {
        // One request of tool output that counted 2.5× its estimate: the prior (1.0,
        // worth two requests) and this request (2.5) average to 1.5.
        let mut big = Calibration::default();
        big.observe(&by(100_000, 0, 0), 250_000);
        assert!((big.factors()[0] - 1.5).abs() < 0.01, "{:?}", big.factors());
        // A prior from other sessions of the model moves the start.
        big.set_prior([2.0, 1.0, 1.0, 1.0, 1.0]);
        assert!(
            (big.factors()[0] - 2.166).abs() < 0.01,
            "{:?}",
            big.factors()
        );
    }

    #[test]
    fn a_request_that_added_little_weighs_little() {
        // 10 tokens estimated, 25 counted: the 15 more are as likely framing as the
        // tokenizer's error, and weigh as about 1/655 of a request.
        let mut c = Calibration::default();
        c.observe(&by(10, 0, 0), 25);
        assert!((c.factors()[0] - 1.0).abs() < 0.01, "{:?}", c.factors());
        // At 256 tokens added, half a request.
        let mut c = Calibration::default();
        c.observe(&by(256, 0, 0), 640);
        assert!((c.factors()[0] - 1.3).abs() < 0.01, "{:?}", c.factors());
    }

    #[test]
    fn wild_reports_stay_within_bounds() {
        let mut c = Calibration::default();
        for _ in 0..10 {
            c.observe(&by(5_000, 0, 0), 1_000_000_000);
        }
        assert_eq!(
            c.factors()[0],
            1.0,
            "no factor in bounds explains it: not learned"
        );
        assert_eq!(c.observations(), 0);
        // Just past the largest factor, within the slack: learned, and kept in bounds.
        for _ in 0..40 {
            c.observe(&by(5_000, 0, 0), 21_000);
        }
        assert!(
            (3.5..=MAX_FACTOR).contains(&c.factors()[0]),
            "{:?}",
            c.factors()
        );
        c.observe(&by(i64::MAX, i64::MIN, 0), i64::MIN);
        assert!(c.factors().iter().all(|f| f.is_finite()));
        assert!(
            c.factors()[..4]
                .iter()
                .all(|f| (MIN_FACTOR..=MAX_FACTOR).contains(f))
        );
        assert!((0.0..=1.0).contains(&c.factors()[4]));
    }

    /// A host that never sends the model's reasoning back (it reports it, and the next
    /// prompt grows by the text alone) keeps reasoning's factor near 0, below the other
    /// classes' floor; one that sends it back teaches a factor near 1.
    #[test]
    fn reasoning_learns_whether_the_host_sends_it_back() {
        let written = |text: i64, reasoning: i64| {
            let mut b = ByClass::default();
            b.add(Class::Written, text);
            b.add(Class::Reasoning, reasoning);
            b
        };
        let (mut dropped, mut kept) = (Calibration::default(), Calibration::default());
        for i in 0..30 {
            let (text, reasoning) = (100 + 37 * (i % 5), 200 + 450 * ((i * 3) % 7));
            dropped.observe(&written(text, reasoning), text);
            kept.observe(&written(text, reasoning), text + reasoning);
        }
        let r = Class::Reasoning.index();
        assert!(dropped.factors()[r] < 0.05, "{:?}", dropped.factors());
        assert!(kept.factors()[r] > 0.75, "{:?}", kept.factors());
        // What each predicts for the next request's text and reasoning (150 and 1,650
        // tokens). The prior of none still holds the second back by a share of one step's
        // reasoning: the price of never dropping reasoning that was not there.
        let next = written(150, 1_500);
        assert!(
            (140..=160).contains(&dropped.apply(&next)),
            "{:?}",
            dropped.factors()
        );
        assert!(
            (1_400..=1_700).contains(&kept.apply(&next)),
            "{:?}",
            kept.factors()
        );
    }
}
