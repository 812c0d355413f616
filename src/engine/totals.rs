//! The session's running figures: context tokens, parts, cleared outputs, bytes held and
//! the usage bookkeeping behind the overflow check. They make every per-update decision
//! independent of session length, so they must never drift from a recount: the fields
//! are private to this file and change only through the named events below, which the
//! session calls (`session.rs` is their one caller).

use serde::{Deserialize, Serialize};

use super::calibration::{Anchor, ByClass, Calibration, Class, PredictionSample};
use crate::domain::TokenUsage;

/// For serde: a zero is not written.
fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// Usage bookkeeping behind the overflow check.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct UsageState {
    /// Last reported usage.
    last: Option<TokenUsage>,
    /// Context tokens prune and the strategies cleared since that report: when non-zero
    /// the report describes a request bigger than the next one will be.
    pruned: u64,
    /// The part of `pruned` cleared since the current request started: that request was
    /// sent before, so its report will count them whole too. (Written only when set:
    /// snapshots of format 3 stay as they were.)
    #[serde(default, skip_serializing_if = "is_zero")]
    pruned_since: u64,
    /// A request started and has not reported yet: a change of rendering now comes after
    /// it was sent, so its report will not hold it. (Written only when set.)
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    requesting: bool,
    /// Context tokens added (positive) or removed (negative) since that report, by
    /// content class.
    delta_by: ByClass,
    /// Context tokens the model did not write (tool results, user text, ...) added since
    /// the current request started (a `step-start`, a new assistant message, or a report),
    /// by content class. A report does not cover them: tool results of a step arrive
    /// before its `step-finish` but are input to the next request.
    since_by: ByClass,
    /// The prediction made when the current request started, which its report checks.
    at_request: Option<RequestStart>,
    /// Reasoning tokens the reports of the current user turn counted (the last report's
    /// included): what the turn's next request may carry, and what a new turn drops.
    #[serde(default)]
    turn_reasoning: u64,
    /// A user message arrived since the current request started: the next request starts
    /// a new turn, without the reasoning of this one.
    #[serde(default)]
    turn_ended: bool,
    /// The current request (started, not reported yet) began a new turn: it does not carry
    /// the reasoning counted in `turn_reasoning`, and its report starts the count afresh.
    #[serde(default)]
    request_new_turn: bool,
    /// The last report was a summary message's: a compaction request, whose prompt (the
    /// summarized head, to another model perhaps) is not the session's. It is no baseline
    /// (`summary_reported`), and the next request's report checks no prediction, so the
    /// calibration never learns from it. (Written only when set: snapshots of format 3
    /// stay as they were.)
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    last_of_summary: bool,
}

/// What the engine predicted when a request started: the previous report's prompt, and
/// by class what was added on top of it (that report's output included, as `written`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct RequestStart {
    base: u64,
    added: ByClass,
}

impl UsageState {
    /// The last reported usage, if any since the last compaction.
    pub(crate) fn last(&self) -> Option<&TokenUsage> {
        self.last.as_ref()
    }

    /// Context tokens added (or removed, negative) since the last report.
    #[cfg(test)]
    pub(crate) fn delta(&self) -> i64 {
        self.delta_by.total()
    }

    /// Context tokens cleared since the last report.
    pub(crate) fn pruned(&self) -> u64 {
        self.pruned
    }

    /// What the next request adds to the last report's prompt, by class: what was added
    /// since, what the model wrote (`anchor`, the last report's), and at a new user turn
    /// the reasoning the turn's earlier requests carried, removed.
    pub(crate) fn added_on(&self, anchor: &Anchor) -> ByClass {
        let mut added = self.delta_by;
        added.add(Class::Written, signed(anchor.text));
        let carried = signed(anchor.reasoning);
        added.add(
            Class::Reasoning,
            carried.saturating_sub(signed(self.dropped())),
        );
        added
    }

    /// The reasoning the next request drops: the turn's, when a user message ended it.
    fn dropped(&self) -> u64 {
        if self.turn_ended || self.request_new_turn {
            self.turn_reasoning
        } else {
            0
        }
    }

    /// Context tokens added since the last report, by content class.
    pub(crate) fn delta_by(&self) -> &ByClass {
        &self.delta_by
    }
}

/// What one stored part contributes to the running figures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PartFigures {
    /// Context-view tokens.
    pub tokens: u64,
    /// Of those, tokens no provider report covers yet (all but what the model wrote).
    pub unwritten: u64,
    /// Prune has cleared its output.
    pub compacted: bool,
    /// The content class its tokens count under.
    pub class: Class,
    /// Bytes it holds.
    pub bytes: u64,
}

/// The running figures of one session.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub(crate) struct Totals {
    /// Context-view tokens of all messages.
    tokens: u64,
    /// Parts held.
    parts: usize,
    /// Tool parts whose output prune cleared.
    compacted: usize,
    /// Heap bytes of the content (see `memory.rs`). Not stored: a restored session
    /// recounts its own values ([`Totals::restored`]).
    #[serde(skip)]
    bytes: u64,
    /// Slots allocated in all part vectors (their capacities summed). Not stored: a
    /// restored session recounts its own vectors.
    #[serde(skip)]
    part_slots: usize,
    usage: UsageState,
    /// What the usage reports taught about this session's estimates (kept across
    /// compactions: the content and the model stay).
    calibration: Calibration,
    /// The last report's check of the prediction, numbered (replay reads it; not stored).
    #[serde(skip)]
    sample: Option<(u64, PredictionSample)>,
    /// Resets of the calibration (another model or tokenizer) since the session was
    /// built (not stored: the store compares it between jobs).
    #[serde(skip)]
    calibration_resets: u32,
}

/// `n` as a signed token figure (contexts are far below 2^63 tokens; saturates).
fn signed(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

impl Totals {
    /// The figures of an empty session holding `bytes`.
    pub(crate) fn new(bytes: u64) -> Totals {
        Totals {
            bytes,
            ..Totals::default()
        }
    }

    /// Context-view tokens of all messages.
    pub(crate) fn tokens(&self) -> u64 {
        self.tokens
    }

    /// Parts held.
    pub(crate) fn parts(&self) -> usize {
        self.parts
    }

    /// Tool parts whose output prune cleared.
    pub(crate) fn compacted(&self) -> usize {
        self.compacted
    }

    /// Heap bytes of the content.
    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Slots allocated in all part vectors.
    pub(crate) fn part_slots(&self) -> usize {
        self.part_slots
    }

    /// The usage bookkeeping.
    pub(crate) fn usage(&self) -> &UsageState {
        &self.usage
    }

    /// What the reports taught so far.
    pub(crate) fn calibration(&self) -> &Calibration {
        &self.calibration
    }

    /// Where the calibration starts from (what other sessions of the model learned).
    pub(crate) fn set_calibration_prior(&mut self, prior: super::calibration::Factors) {
        self.calibration.set_prior(prior);
    }

    /// Forgets what the reports taught (another model or tokenizer), counting the reset
    /// so the store gives the session the new key's prior.
    pub(crate) fn reset_calibration(&mut self) {
        self.calibration = Calibration::default();
        self.calibration_resets = self.calibration_resets.wrapping_add(1);
    }

    /// How many times the calibration was reset.
    pub(crate) fn calibration_resets(&self) -> u32 {
        self.calibration_resets
    }

    /// The last report's check of the prediction made when its request started.
    pub(crate) fn sample(&self) -> Option<(u64, PredictionSample)> {
        self.sample
    }

    /// The same figures for a copy whose part vectors hold `slots` slots.
    pub(crate) fn with_part_slots(self, slots: usize) -> Totals {
        Totals {
            part_slots: slots,
            ..self
        }
    }

    /// The same figures for a restored session, whose values hold `bytes` and whose part
    /// vectors hold `slots` slots (counted from the decoded values).
    pub(crate) fn restored(self, bytes: u64, slots: usize) -> Totals {
        Totals {
            bytes,
            part_slots: slots,
            ..self
        }
    }

    /// A part was written, replaced or deleted (`None`: absent before or after).
    /// `sent`: the part's message is one the context sends; a part of one it does not
    /// (an errored assistant message) moves only the session's figures, not the next
    /// request's.
    pub(crate) fn part_changed(
        &mut self,
        old: Option<PartFigures>,
        new: Option<PartFigures>,
        sent: bool,
    ) {
        match (old.is_some(), new.is_some()) {
            (false, true) => self.parts = self.parts.saturating_add(1),
            (true, false) => self.parts = self.parts.saturating_sub(1),
            _ => {}
        }
        if let Some(o) = old {
            if sent {
                // Replaced, it leaves what it added (what the model wrote of it is in a
                // report's output); deleted, it leaves whole: a request under way was
                // sent with it, as its report will count, and the next one is not.
                let left = if new.is_some() { o.unwritten } else { o.tokens };
                self.usage.since_by.add(o.class, -signed(left));
                self.move_tokens(o.class, o.tokens, 0);
            } else {
                self.tokens = self.tokens.saturating_sub(o.tokens);
            }
            self.move_compacted(o.compacted, false);
            self.bytes_changed(o.bytes, 0);
        }
        if let Some(n) = new {
            if sent {
                self.usage.since_by.add(n.class, signed(n.unwritten));
                self.move_tokens(n.class, 0, n.tokens);
            } else {
                self.tokens = self.tokens.saturating_add(n.tokens);
            }
            self.move_compacted(false, n.compacted);
            self.bytes_changed(0, n.bytes);
        }
    }

    /// A message's parts, `parts`, became sent (`now`) or stopped being sent (an error set
    /// on it or cleared): they join or leave what the next request adds.
    pub(crate) fn sending_changed(&mut self, parts: impl Iterator<Item = PartFigures>, now: bool) {
        for p in parts {
            let (unwritten, tokens) = (signed(p.unwritten), signed(p.tokens));
            let (unwritten, tokens) = if now {
                (unwritten, tokens)
            } else {
                (unwritten.saturating_neg(), tokens.saturating_neg())
            };
            self.usage.since_by.add(p.class, unwritten);
            self.usage.delta_by.add(p.class, tokens);
        }
    }

    /// A part's rendering changed (a strategy's mark set or removed, prune's stamp): its
    /// context tokens move from `old` to `new`. A `reduction` (prune or a strategy clearing
    /// content) also counts toward what the last report over-states. A part the context
    /// does not `send` moves only the session's total: no request holds it.
    pub(crate) fn rendering_changed(
        &mut self,
        class: Class,
        (old, new): (u64, u64),
        (was_compacted, now_compacted): (bool, bool),
        reduction: bool,
        sent: bool,
    ) {
        self.move_compacted(was_compacted, now_compacted);
        if !sent {
            self.tokens = self.tokens.saturating_sub(old).saturating_add(new);
            return;
        }
        self.move_tokens(class, old, new);
        // A request in flight was sent before this change: its report will not hold it.
        if self.usage.requesting {
            self.usage
                .since_by
                .add(class, signed(new).saturating_sub(signed(old)));
        }
        if reduction {
            let cleared = old.saturating_sub(new);
            self.usage.pruned = self.usage.pruned.saturating_add(cleared);
            if self.usage.requesting {
                self.usage.pruned_since = self.usage.pruned_since.saturating_add(cleared);
            }
        }
    }

    /// Bytes held outside parts (session or message info) moved from `old` to `new`.
    pub(crate) fn bytes_changed(&mut self, old: u64, new: u64) {
        self.bytes = self.bytes.saturating_sub(old).saturating_add(new);
    }

    /// The part vectors grew by `slots` slots.
    pub(crate) fn slots_grew(&mut self, slots: usize) {
        self.part_slots = self.part_slots.saturating_add(slots);
    }

    /// The model is called again (a new assistant message or a `step-start`): what was
    /// added so far is input to this request, which its report will cover. `anchor` is
    /// the last report's prompt and output (None: no report since the context began), on
    /// which the prediction this request's report checks is built.
    pub(crate) fn request_started(&mut self, anchor: Option<Anchor>) {
        self.usage.since_by = ByClass::default();
        self.usage.pruned_since = 0;
        self.usage.requesting = true;
        // Starts with no report between them are one request (a message and its first
        // `step-start`), or one that never reported: either way the next report's.
        self.usage.request_new_turn |= self.usage.turn_ended;
        self.usage.turn_ended = false;
        let anchor = anchor.filter(|_| !self.usage.last_of_summary);
        self.usage.at_request = anchor.map(|a| RequestStart {
            base: a.prompt,
            added: self.usage.added_on(&a),
        });
    }

    /// A user message arrived: the next request starts a new turn, which does not carry
    /// the reasoning of this one.
    pub(crate) fn user_turn(&mut self) {
        self.usage.turn_ended = true;
    }

    /// A provider report is the new baseline of the next request's size; what the model
    /// did not write since that request started is not in it. The same report twice (a
    /// `step-finish` and then its message) is one report. `prompt` is the prompt it
    /// reports (input + cache read + cache write): it checks, and teaches the calibration,
    /// the prediction made when its request started.
    pub(crate) fn usage_reported(&mut self, tokens: TokenUsage, prompt: u64, reasoning: u64) {
        if self.usage.last == Some(tokens) {
            return;
        }
        // The turn's reasoning so far: a request that began a new turn starts it afresh.
        let turn_reasoning = if self.usage.request_new_turn {
            reasoning
        } else {
            self.usage.turn_reasoning.saturating_add(reasoning)
        };
        if let Some(start) = self.usage.at_request.take() {
            // The tokenizer's estimate as it is: what was added, what the model wrote and
            // what a new turn drops, with no correction.
            let estimated = start.base.saturating_add_signed(start.added.total());
            let calibrated = start
                .base
                .saturating_add_signed(self.calibration.apply(&start.added));
            let n = self.sample.map_or(1, |(n, _)| n.saturating_add(1));
            let sample = PredictionSample {
                base: start.base,
                estimated,
                calibrated,
                actual: prompt,
            };
            self.sample = Some((n, sample));
            let actual_added = signed(prompt).saturating_sub(signed(start.base));
            self.calibration.observe(&start.added, actual_added);
        }
        self.usage = UsageState {
            last: Some(tokens),
            pruned: self.usage.pruned_since,
            pruned_since: 0,
            requesting: false,
            delta_by: self.usage.since_by,
            since_by: ByClass::default(),
            at_request: None,
            turn_reasoning,
            turn_ended: self.usage.turn_ended,
            request_new_turn: false,
            last_of_summary: false,
        };
    }

    /// A summary message reported its usage: a compaction request's (the summarized
    /// head, to another model perhaps), no base for the session's next request. The last
    /// report stays the baseline (the context is the same until the compaction completes,
    /// which starts it afresh, `compaction_committed`); the compaction request is over,
    /// and the next request's report checks no prediction. O(1).
    pub(crate) fn summary_reported(&mut self) {
        self.usage.requesting = false;
        self.usage.at_request = None;
        self.usage.last_of_summary = true;
    }

    /// A compaction committed: the last report described the old context, and the next
    /// request is the new one, of `tokens_after` context tokens.
    pub(crate) fn compaction_committed(&mut self, tokens_after: u64) {
        let mut delta_by = ByClass::default();
        delta_by.add(Class::Prose, signed(tokens_after));
        self.usage = UsageState {
            delta_by,
            ..UsageState::default()
        };
    }

    /// Every part was counted again: the session holds `total` tokens, and (when the
    /// settings changed what is sent) the context went from `context.0` to `context.1`:
    /// what the next request sends moves by that alone. None: the same content measured
    /// by another tokenizer, which moves nothing the provider counts.
    pub(crate) fn recounted(&mut self, total: u64, context: Option<(u64, u64)>) {
        self.tokens = total;
        let Some(context) = context else {
            return;
        };
        let moved = signed(context.1).saturating_sub(signed(context.0));
        // A request in flight was sent before the recount: its report will not hold it.
        if self.usage.requesting {
            self.usage.since_by.add(Class::Prose, moved);
        }
        self.usage.delta_by.add(Class::Prose, moved);
    }

    fn move_tokens(&mut self, class: Class, old: u64, new: u64) {
        self.tokens = self.tokens.saturating_sub(old).saturating_add(new);
        let moved = signed(new).saturating_sub(signed(old));
        self.usage.delta_by.add(class, moved);
    }

    fn move_compacted(&mut self, was: bool, now: bool) {
        self.compacted = match (was, now) {
            (false, true) => self.compacted.saturating_add(1),
            (true, false) => self.compacted.saturating_sub(1),
            _ => self.compacted,
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn figures(tokens: u64, unwritten: u64, compacted: bool) -> PartFigures {
        PartFigures {
            tokens,
            unwritten,
            compacted,
            class: Class::ToolOutput,
            bytes: 10,
        }
    }

    #[test]
    fn a_part_written_replaced_and_deleted_leaves_nothing_behind() {
        let mut t = Totals::new(100);
        t.part_changed(None, Some(figures(50, 50, false)), true);
        assert_eq!((t.tokens(), t.parts(), t.bytes()), (50, 1, 110));
        t.part_changed(
            Some(figures(50, 50, false)),
            Some(figures(70, 20, true)),
            true,
        );
        assert_eq!((t.tokens(), t.parts(), t.compacted()), (70, 1, 1));
        t.part_changed(Some(figures(70, 20, true)), None, true);
        // Deleted, it leaves whole: what the model wrote of it (50) is in the report's
        // output of the request under way, and the next request does not hold it.
        let mut expected = Totals::new(100);
        expected.usage.since_by.add(Class::ToolOutput, -50);
        assert_eq!(t, expected);
    }

    #[test]
    fn a_report_takes_what_the_model_did_not_write_as_its_delta() {
        let mut t = Totals::default();
        t.part_changed(None, Some(figures(30, 12, false)), true);
        let usage = TokenUsage {
            input: 1000,
            ..TokenUsage::default()
        };
        t.usage_reported(usage, 1000, 0);
        assert_eq!((t.usage().delta(), t.usage().last()), (12, Some(&usage)));
        // The same report twice is one report.
        t.part_changed(None, Some(figures(5, 5, false)), true);
        t.usage_reported(usage, 1000, 0);
        assert_eq!(t.usage().delta(), 17);
    }

    /// A report of `prompt` tokens whose output of `output` held `reasoning`.
    fn report(t: &mut Totals, prompt: u64, output: u64, reasoning: u64) {
        let usage = TokenUsage {
            input: prompt,
            output,
            reasoning,
            ..TokenUsage::default()
        };
        t.usage_reported(usage, prompt, reasoning);
    }

    fn anchor(prompt: u64, output: u64, reasoning: u64) -> Anchor {
        Anchor {
            prompt,
            text: output - reasoning,
            reasoning,
        }
    }

    #[test]
    fn a_new_user_turn_drops_the_reasoning_its_requests_carried() {
        let mut t = Totals::default();
        t.request_started(None);
        report(&mut t, 1_000, 300, 200);
        // Within the turn, the next request carries what the model wrote, reasoning too.
        let a = anchor(1_000, 300, 200);
        assert_eq!(t.usage().added_on(&a).get(Class::Reasoning), 200);
        assert_eq!(t.usage().added_on(&a).get(Class::Written), 100);
        t.request_started(Some(a));
        report(&mut t, 1_300, 150, 100);
        // A user message: the next request drops the turn's reasoning, the 200 its prompt
        // carried and the 100 just written.
        t.user_turn();
        let b = anchor(1_300, 150, 100);
        assert_eq!(t.usage().added_on(&b).get(Class::Reasoning), -200);
        assert_eq!(t.usage().added_on(&b).get(Class::Written), 50);
        // A message and its first step-start are one request: the same prediction.
        t.request_started(Some(b));
        t.request_started(Some(b));
        report(&mut t, 1_150, 80, 60);
        let (_, sample) = t.sample().expect("a checked prediction");
        assert_eq!((sample.estimated, sample.actual), (1_150, 1_150));
        // The new turn counts its own reasoning only.
        let c = anchor(1_150, 80, 60);
        assert_eq!(t.usage().added_on(&c).get(Class::Reasoning), 60);
        t.user_turn();
        assert_eq!(t.usage().added_on(&c).get(Class::Reasoning), 0);
    }

    #[test]
    fn a_user_message_during_a_request_ends_the_turn_after_it() {
        let mut t = Totals::default();
        t.request_started(None);
        report(&mut t, 1_000, 300, 200);
        t.request_started(Some(anchor(1_000, 300, 200)));
        // The request already sent carries the turn's reasoning; the next one does not.
        t.user_turn();
        report(&mut t, 1_300, 100, 40);
        let d = anchor(1_300, 100, 40);
        assert_eq!(t.usage().added_on(&d).get(Class::Reasoning), -200);
        // Without reports of reasoning, a new turn drops nothing.
        let mut plain = Totals::default();
        report(&mut plain, 1_000, 300, 0);
        plain.user_turn();
        assert_eq!(
            plain
                .usage()
                .added_on(&anchor(1_000, 300, 0))
                .get(Class::Reasoning),
            0
        );
    }

    #[test]
    fn reductions_count_toward_pruned_and_saturate() {
        let mut t = Totals::default();
        t.part_changed(None, Some(figures(100, 100, false)), true);
        t.rendering_changed(Class::ToolOutput, (100, 8), (false, true), true, true);
        assert_eq!((t.tokens(), t.compacted(), t.usage().pruned()), (8, 1, 92));
        // Figures that do not add up saturate instead of wrapping.
        t.rendering_changed(Class::ToolOutput, (u64::MAX, 0), (true, false), false, true);
        assert_eq!((t.tokens(), t.compacted()), (0, 0));
    }
}
