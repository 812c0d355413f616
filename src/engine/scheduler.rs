//! The cache-aware scheduler: every decision that rewrites the prompt's past (a prune, a
//! supersede, a masked or truncated output) turns everything after the earliest changed
//! part into fresh, full-price tokens on the next request. So after a finished assistant
//! message the decisions on parts the provider has already cached are held, and applied
//! together only when
//! - (a) the expected saving over the coming requests exceeds the cost of re-writing the
//!   cache after the earliest changed part, under the session's cache model:
//!   `H·S·read > (tail − S)·(write − read)`, with `S` the tokens saved on cached parts,
//!   `tail` the cached tokens from the earliest changed part to the end of what the last
//!   request sent, and `H` the requests expected to reuse the
//!   changed prefix before the cache goes cold (when held decisions apply for free): as
//!   many as have run since the cache was last found cold (a Lindy estimate), but no more
//!   than fit before the threshold at the session's average growth per request; or
//! - (b) the cache is cold anyway: a new user message arrives more than the TTL after the
//!   last request (host timestamps), or a compaction reordered the context (applied in
//!   `Session::commit_compaction`, before the request that continues); or
//! - (c) an overflow is near: the next request is predicted at the threshold
//!   ([`FLUSH_AT`]), where a compaction is the alternative. When it stays there even
//!   without every part no request has sent yet, nothing is weighed (no trial run).
//!
//! Decisions on parts no request has sent yet (a new oversized output) cost nothing to
//! apply and always apply. With a flat cache model (`none`, or the OpenCode preset)
//! everything applies at once, as without the scheduler.

use super::overflow::{OverflowCheck, Trigger};
use super::prune::PruneReport;
pub use super::request_log::Scope;
use super::session::{SentChanges, Session};

/// Share of the threshold at which held decisions apply whatever the cache costs: when
/// the next request would cross it, a compaction (which rewrites the whole prompt) is the
/// alternative, and applying them first may avoid it.
pub const FLUSH_AT: f64 = 1.0;

/// Most decisions held at once. Weighing them is a trial run over all of them after
/// every finished message, so their number must not grow with the session: past this
/// bound they apply (a resource limit, like `max_parts_per_message`; real sessions flush
/// far earlier, by the cost rule or a cold cache).
pub const MAX_HELD: usize = 512;

/// What the scheduler decided and the figures it weighed (for reports and tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision {
    /// What may change now.
    pub scope: Scope,
    /// Why.
    pub why: Why,
    /// Context tokens applying everything would save (0 when not weighed).
    pub saved: u64,
    /// Tokens from the earliest changed message the provider cached (0 when not weighed).
    pub tail: u64,
    /// Requests expected to reuse the changed prefix (0 when not weighed).
    pub horizon: u64,
    /// The earliest cached part a change would touch (message, part), when weighed.
    pub first: Option<(usize, usize)>,
}

impl Decision {
    fn at_once(why: Why) -> Decision {
        Decision {
            scope: Scope::All,
            why,
            saved: 0,
            tail: 0,
            horizon: 0,
            first: None,
        }
    }
}

/// Why the scheduler chose its scope (for reports and tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Why {
    /// The cache model is flat: nothing to protect.
    Flat,
    /// The next request is near the threshold.
    NearOverflow,
    /// No pending decision touches a part the provider has cached.
    NothingCached,
    /// The saving pays for the rewrite.
    Pays,
    /// The rewrite costs more than the saving brings: held.
    Held,
    /// The cache expired since the last request.
    Cold,
    /// More than [`MAX_HELD`] decisions were waiting.
    TooMany,
}

/// True when a next request of `next` tokens is at the flush point of `threshold` (rule
/// (c); never without a known window).
fn near_overflow(next: u64, threshold: u64) -> bool {
    threshold > 0 && next as f64 >= FLUSH_AT * threshold as f64
}

/// True when applying `saved` tokens of changes, the earliest `tail` tokens from the end,
/// pays over `horizon` requests under `read`/`write` prices (rule (a)).
pub fn pays(saved: u64, tail: u64, horizon: u64, read: f64, write: f64) -> bool {
    let gain = horizon as f64 * saved as f64 * read;
    let cost = tail.saturating_sub(saved) as f64 * (write - read).max(0.0);
    gain > cost
}

impl Session {
    /// Context tokens the provider cached from the part at `first` on: up to what the last
    /// request sent (parts after it are written at full price whether or not anything
    /// changes, so they are no part of a rewrite's cost).
    fn cached_after(&self, first: (usize, usize)) -> u64 {
        let (sent_msg, sent_parts) = self.request_log().sent();
        let parts = |m: usize, from: usize, to: usize| -> u64 {
            self.messages().get(m).map_or(0, |msg| {
                let to = to.min(msg.parts.len());
                msg.parts
                    .get(from.min(to)..to)
                    .unwrap_or(&[])
                    .iter()
                    .map(|p| p.context_tokens())
                    .fold(0u64, u64::saturating_add)
            })
        };
        if first.0 == sent_msg {
            return parts(sent_msg, first.1, sent_parts);
        }
        parts(first.0, first.1, usize::MAX)
            .saturating_add(self.tokens_between(first.0 + 1, sent_msg))
            .saturating_add(parts(sent_msg, 0, sent_parts))
    }

    /// Our estimate of the context (at least 1), and the next request: by the provider's
    /// count and by that estimate, whichever is larger.
    fn next_request(&self, check: &OverflowCheck) -> (u64, u64) {
        let len = self.messages().len();
        let prompt = self.tokens_between(self.context_from(), len).max(1);
        (prompt, check.predicted.max(prompt))
    }

    /// Context tokens in the parts no request has sent yet: the most that changes free
    /// of cache cost can remove.
    fn unsent_tokens(&self) -> u64 {
        let (sent_msg, sent_parts) = self.request_log().sent();
        let len = self.messages().len();
        let rest = self.messages().get(sent_msg).map_or(0, |m| {
            m.parts
                .get(sent_parts.min(m.parts.len())..)
                .unwrap_or(&[])
                .iter()
                .map(|p| p.context_tokens())
                .fold(0u64, u64::saturating_add)
        });
        rest.saturating_add(self.tokens_between(sent_msg.saturating_add(1).min(len), len))
    }

    /// The automatic commit after a finished assistant message: decides the scope with the
    /// cache model and runs prune and the strategies within it.
    ///
    /// The weighing is a trial run of everything; when the decision is to apply
    /// everything, that run is the commit's (the same run on the same session), so it is
    /// kept rather than undone and made again. When the overflow is certain, there is no
    /// trial.
    pub(crate) fn auto_commit(&mut self, now_ms: i64) -> (PruneReport, Decision) {
        match self.weigh(now_ms, true) {
            (decision, Some(report)) => {
                self.strategies_committed();
                if report.committed {
                    self.prune_plan_committed();
                }
                (report, decision)
            }
            (decision, None) => (self.prune_scoped(now_ms, decision.scope), decision),
        }
    }

    /// A new user message at `at` (host time): when the cache has expired since the last
    /// request, the held decisions apply now, before the next request writes it afresh.
    pub(crate) fn commit_if_cold(&mut self, at: i64, now_ms: i64) -> Option<PruneReport> {
        let model = self.settings().cache_model;
        if model.is_flat() || !self.request_log().cold_at(at, model.ttl_ms) {
            return None;
        }
        let report = self.prune_scoped(now_ms, Scope::All);
        report.changed().then_some(report)
    }

    /// What the automatic commit may change now, and why. Changes nothing (the weighing
    /// is a trial run, rolled back).
    pub fn schedule(&mut self, now_ms: i64) -> Decision {
        self.weigh(now_ms, false).0
    }

    /// [`Self::schedule`]; with `keep`, a trial run deciding to apply everything is kept,
    /// and its report returned (the commit then only takes the queue and moves the prune
    /// window on).
    fn weigh(&mut self, now_ms: i64, keep: bool) -> (Decision, Option<PruneReport>) {
        let model = self.settings().cache_model;
        if model.is_flat() {
            return (Decision::at_once(Why::Flat), None);
        }
        if self.held_decisions() > MAX_HELD {
            return (Decision::at_once(Why::TooMany), None);
        }
        let check = self.check_overflow(Trigger::Finished);
        if self.overflow_certain(&check) {
            return (Decision::at_once(Why::NearOverflow), None);
        }
        self.weigh_by_trial(check, now_ms, keep)
    }

    /// True when no trial could bring the next request under the flush point: not even
    /// removing every part no request has sent yet (the most that changes free of cache
    /// cost can remove). Weighing is then moot: everything applies, with no trial run to
    /// capture and undo.
    pub(crate) fn overflow_certain(&self, check: &OverflowCheck) -> bool {
        let (_, next) = self.next_request(check);
        near_overflow(next.saturating_sub(self.unsent_tokens()), check.threshold)
    }

    /// [`Self::weigh`] by a trial run of everything: the run a commit of everything would
    /// make (`prune_scoped` with `Scope::All`), decided on as it left the session, then
    /// rolled back unless `keep` and the decision is to apply everything (then its
    /// report is returned).
    pub(crate) fn weigh_by_trial(
        &mut self,
        check: OverflowCheck,
        now_ms: i64,
        keep: bool,
    ) -> (Decision, Option<PruneReport>) {
        let before = self.total_tokens();
        let next = self.next_request(&check);
        let (report, decision, kept) = self.trial_judged(
            |s| s.prune_run(now_ms, false, Scope::All, false),
            |s| {
                let decision = s.decide(&check, next, before, s.sent_changes());
                (decision, keep && decision.scope == Scope::All)
            },
        );
        (decision, kept.then_some(report))
    }

    /// The scope, from a trial's outcome, with the session as the trial left it: `next`
    /// is [`Self::next_request`] and `before` the total tokens, both from before the
    /// trial; `changes` its changes to cached parts.
    fn decide(
        &self,
        check: &OverflowCheck,
        (prompt, next): (u64, u64),
        before: u64,
        changes: Option<SentChanges>,
    ) -> Decision {
        let model = self.settings().cache_model;
        // What changes to unsent parts remove applies in any case: the next request is
        // near the threshold only if it stays so without them.
        let fresh = before
            .saturating_sub(self.total_tokens())
            .saturating_sub(changes.map_or(0, |c| c.saved));
        if near_overflow(next.saturating_sub(fresh), check.threshold) {
            return Decision::at_once(Why::NearOverflow);
        }
        let Some(SentChanges {
            first,
            saved,
            grown,
        }) = changes
        else {
            return Decision::at_once(Why::NothingCached);
        };
        // The cached tokens from `first` on as they were before the trial changed them.
        let tail = self
            .cached_after(first)
            .saturating_add(saved)
            .saturating_sub(grown);
        let requests = self.request_log().count().max(1);
        // Requests left before the threshold at the average growth per request so far.
        let growth = (prompt / requests).max(1);
        let room = if check.threshold == 0 {
            u64::MAX // no window known: nothing ends the session's run early
        } else {
            check.threshold.saturating_sub(prompt) / growth
        };
        let horizon = self.request_log().warm_streak().min(room).max(1);
        let (scope, why) = if pays(saved, tail, horizon, model.read, model.write) {
            (Scope::All, Why::Pays)
        } else {
            (Scope::Fresh, Why::Held)
        };
        Decision {
            scope,
            why,
            saved,
            tail,
            horizon,
            first: Some(first),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rule_weighs_saving_over_the_horizon_against_the_rewrite() {
        // Anthropic: read 0.1, write 1.25.
        // 1000 saved of a 10,000-token tail over 10 requests: 1000 < 9000 × 1.15.
        assert!(!pays(1000, 10_000, 10, 0.1, 1.25));
        // 8000 saved of 10,000 over 20 requests: 16,000 > 2000 × 1.15 = 2300.
        assert!(pays(8000, 10_000, 20, 0.1, 1.25));
        // Saving everything after the change always pays.
        assert!(pays(10_000, 10_000, 1, 0.1, 1.25));
        // Nothing saved never pays.
        assert!(!pays(0, 10_000, 100, 0.1, 1.25));
        // Flat prices: any saving pays.
        assert!(pays(1, 10_000, 1, 1.0, 1.0));
    }
}
