//! Overflow detection (seed 02 `isOverflow`, with compactd's ratio and prediction).
//!
//! - Auto compaction off → never overflow, on every path. Context 0 → never (unlimited).
//! - used = `tokens.total` when the provider gives it, else `input + cache.read + output`
//!   (or `input + output` when the provider's input already includes cache reads).
//! - usable = `limit.input`, else `context − min(limit.output, 32000)` (32000 when 0).
//! - threshold = floor((usable − reserved) × ratio); default ratio 0.92, reserved 0;
//!   overflow above it. OpenCode today (`session/overflow.ts`) is the `OpenCode` preset:
//!   ratio 1.0, reserved = min(20000, max output) when the model has `limit.input` and 0
//!   without (its usable window is then the context less the max output), and overflow
//!   at the threshold (`count >= usable`).
//! - predicted = the report's whole prompt (with cache writes) plus its output, plus the
//!   context tokens added since that report (minus tokens pruned since), calibrated: each
//!   content class's estimate times the factor the session's usage reports taught it
//!   (`calibration.rs`). A report describes the request that started the current step, so
//!   what the model did not write since that request began (tool results) is not in it
//!   and counts as added. After a user message, the reasoning the turn's requests carried
//!   is taken off (providers drop earlier turns' reasoning). Overflow when `used` or
//!   `predicted` is above the threshold.

use super::calibration::{Anchor, anchor_tokens};
use super::session::Session;
use crate::config::{COMPACTION_BUFFER, CacheCounting, Reserved, Settings};
use crate::domain::{ModelLimits, TokenUsage};

/// What ran the check (reported with the numbers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trigger {
    /// A usage report arrived.
    Usage,
    /// An assistant message finished.
    Finished,
    /// The host asked.
    Request,
}

impl Trigger {
    /// Name in events.
    pub fn as_str(self) -> &'static str {
        match self {
            Trigger::Usage => "usage",
            Trigger::Finished => "finished",
            Trigger::Request => "request",
        }
    }
}

/// Which figure crossed the threshold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Crossed {
    /// The last reported usage.
    Used,
    /// The predicted next request.
    Predicted,
}

/// The decision and every number behind it, so a user can see why it fired.
#[derive(Debug, Clone, PartialEq)]
pub struct OverflowCheck {
    /// The decision.
    pub overflow: bool,
    /// Tokens of the last reported usage.
    pub used: u64,
    /// Predicted size of the next request.
    pub predicted: u64,
    /// Usable input before `reserved`.
    pub usable: u64,
    /// Reserved buffer.
    pub reserved: u64,
    /// Ratio applied.
    pub ratio: f64,
    /// floor((usable − reserved) × ratio).
    pub threshold: u64,
    /// Counting rule used for `used`.
    pub counting: &'static str,
    /// What crossed, when something did.
    pub crossed: Option<Crossed>,
    /// Why no decision could be made (auto off, unlimited context).
    pub reason: Option<&'static str>,
    /// What ran the check.
    pub trigger: Trigger,
}

/// Tokens one usage report stands for, and the rule used.
pub fn used_tokens(u: &TokenUsage, rule: CacheCounting) -> (u64, &'static str) {
    if let Some(total) = u.total.filter(|t| *t > 0) {
        return (total, "total");
    }
    let cache = u.cache_read_apart(rule);
    // Client-sent numbers: a sum past u64 saturates (and is an overflow), never wraps.
    let used = u.input.saturating_add(cache).saturating_add(u.output);
    let formula = match cache {
        0 => rule.formula(),
        _ => CacheCounting::Separate.formula(),
    };
    (used, formula)
}

/// The pure decision from numbers: the session method below only gathers them. `delta` is
/// the (calibrated) estimate of what was added since the last report.
pub fn check(
    limits: &ModelLimits,
    s: &Settings,
    last: Option<&TokenUsage>,
    delta: i64,
    trigger: Trigger,
) -> OverflowCheck {
    let (used, counting) = match last {
        Some(u) => used_tokens(u, s.cache_counting),
        None => (0, s.cache_counting.formula()),
    };
    let anchor = last.map_or(0, |u| anchor_tokens(u, s.cache_counting));
    let predicted = predict(used.max(anchor), delta);
    let usable = limits.usable_input();
    let reserved = match s.reserved {
        Reserved::Fixed(n) => n,
        // OpenCode keeps its buffer off an input limit; without one, the window less the
        // answer's room (already off `usable`) is all it keeps (`session/overflow.ts`).
        Reserved::OpenCode if limits.input > 0 => COMPACTION_BUFFER.min(limits.max_output()),
        Reserved::OpenCode => 0,
    };
    let threshold = floor_ratio(usable.saturating_sub(reserved), s.ratio_clamped());
    let mut c = OverflowCheck {
        overflow: false,
        used,
        predicted,
        usable,
        reserved,
        ratio: s.threshold,
        threshold,
        counting,
        crossed: None,
        reason: None,
        trigger,
    };
    if !s.auto_compact {
        c.reason = Some("auto compaction is off");
        return c;
    }
    if limits.context == 0 {
        c.reason = Some("unlimited context (limit.context = 0)");
        return c;
    }
    let over = |tokens: u64| crosses(s, tokens, threshold);
    c.crossed = if over(used) {
        Some(Crossed::Used)
    } else if over(predicted) {
        Some(Crossed::Predicted)
    } else {
        None
    };
    c.overflow = c.crossed.is_some();
    c
}

/// Whether `tokens` overflow at `threshold`. OpenCode compacts at its limit
/// (`count >= usable`); compactd's threshold is the last count that still fits.
fn crosses(s: &Settings, tokens: u64, threshold: u64) -> bool {
    match s.reserved {
        Reserved::OpenCode => tokens >= threshold,
        Reserved::Fixed(_) => tokens > threshold,
    }
}

/// `used + delta`, clamped to `0..=u64::MAX` (both can be anywhere in their range: `used`
/// comes from the client).
fn predict(used: u64, delta: i64) -> u64 {
    if delta >= 0 {
        used.saturating_add(delta.unsigned_abs())
    } else {
        used.saturating_sub(delta.unsigned_abs())
    }
}

/// `floor(tokens × ratio)` as a person computes it: 168000 × 0.7 is 117600, although the
/// binary product is 117599.99999999999. Products within a millionth of a token of an
/// integer are taken as that integer.
fn floor_ratio(tokens: u64, ratio: f64) -> u64 {
    let product = tokens as f64 * ratio;
    let nearest = product.round();
    if (product - nearest).abs() < 1e-6 {
        nearest as u64
    } else {
        product.floor() as u64
    }
}

impl Settings {
    /// The ratio as used in arithmetic; validated to (0, 1] at the boundary.
    fn ratio_clamped(&self) -> f64 {
        self.threshold.clamp(0.0, 1.0)
    }
}

impl Session {
    /// What the next request adds to the last report's prompt and output, calibrated:
    /// the estimate of what was added since, and the correction of how that report's
    /// output reads back (less a finished turn's reasoning), by what the session's reports
    /// taught. With no report since the context began (a new session, a compaction), the
    /// whole context is estimated as counted: the factors were learned on what requests
    /// added on top of a report.
    fn calibrated_delta(&self) -> i64 {
        let Some(last) = self.usage().last() else {
            return self.usage().delta_by().total();
        };
        let anchor = Anchor::of(last, self.settings().cache_counting);
        let added = self.usage().added_on(&anchor);
        let written = i64::try_from(anchor.written()).unwrap_or(i64::MAX);
        self.calibration().apply(&added).saturating_sub(written)
    }

    /// Runs the overflow check on the session's current figures.
    pub fn check_overflow(&self, trigger: Trigger) -> OverflowCheck {
        let mut c = check(
            &self.info().limits,
            self.settings(),
            self.usage().last(),
            self.calibrated_delta(),
            trigger,
        );
        // Prune cleared outputs that the last report counted: that request is history, and
        // the next one is the prediction (which subtracts what was cleared).
        if self.usage().pruned() > 0
            && c.crossed == Some(Crossed::Used)
            && !crosses(self.settings(), c.predicted, c.threshold)
        {
            c.crossed = None;
            c.overflow = false;
        }
        c
    }
}
