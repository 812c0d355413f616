//! What the provider has been sent: how many requests, when the last one went (host
//! time), and which parts it held. The cache-aware scheduler (`scheduler.rs`) reads it to
//! tell a free change (a part no request has sent) from one that rewrites the cache.

use serde::{Deserialize, Serialize};

/// What an automatic commit may change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// Every pending decision.
    All,
    /// Only parts no request has sent yet; the rest stays pending.
    Fresh,
}

/// The requests seen so far: how many, when the last one was sent (host time), and which
/// parts it had sent (everything before `sent`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct RequestLog {
    sent: (usize, usize),
    last_at: Option<i64>,
    count: u64,
    /// Requests since the last one that found the cache expired.
    warm: u64,
    /// Steps the newest assistant message has started (its first step is the request
    /// that created it).
    steps: u32,
    /// A compaction reordered the context since the last request ([B, S, tail…]): the
    /// next request shares no cached prefix past the system prompt, so nothing counts as
    /// sent and the cache counts as cold until a request starts. (Written only when set:
    /// snapshots of format 3 stay as they were.)
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    reordered: bool,
}

impl RequestLog {
    /// A request started with every message before `msg` and the first `parts` parts of
    /// `msg`; `at` is its host timestamp when known.
    pub(crate) fn started(&mut self, msg: usize, parts: usize, at: Option<i64>, ttl_ms: i64) {
        self.steps = 0;
        self.reordered = false;
        self.sent = (msg, parts);
        self.count = self.count.saturating_add(1);
        let cold = match (self.last_at, at) {
            (Some(last), Some(at)) => at.saturating_sub(last) > ttl_ms,
            (None, _) => true,
            (Some(_), None) => false,
        };
        self.warm = if cold { 1 } else { self.warm.saturating_add(1) };
        if at.is_some() {
            self.last_at = at;
        }
    }

    /// A `step-start` at part `part` of message `msg`: the message's first step is the
    /// request that created it; each later one is a new request that sent every part
    /// before it.
    pub(crate) fn step_started(&mut self, msg: usize, part: usize, ttl_ms: i64) {
        if msg != self.sent.0 {
            // A step of a message no request was recorded for: a request of its own.
            self.started(msg, part, None, ttl_ms);
            self.steps = 1;
            return;
        }
        self.steps = self.steps.saturating_add(1);
        if self.steps > 1 {
            self.reordered = false;
            self.count = self.count.saturating_add(1);
            self.warm = self.warm.saturating_add(1);
            self.sent = (msg, part);
        }
    }

    /// The message the newest request was recorded on (0 before any): a report stored on
    /// an older message describes a request the session is past.
    pub(crate) fn newest_message(&self) -> usize {
        self.sent.0
    }

    /// Requests since the cache was last found expired (this one included).
    pub(crate) fn warm_streak(&self) -> u64 {
        self.warm
    }

    /// The newest request finished at `at` (the cache was last used no earlier).
    pub(crate) fn finished(&mut self, at: i64) {
        self.last_at = Some(self.last_at.map_or(at, |t| t.max(at)));
    }

    /// True when the part at (`msg`, `pi`) was part of a request already, in the order
    /// the context has now (none after a compaction reordered it).
    pub(crate) fn is_sent(&self, msg: usize, pi: usize) -> bool {
        !self.reordered && (msg < self.sent.0 || (msg == self.sent.0 && pi < self.sent.1))
    }

    /// True when a request at `at` would find the cache expired, or find nothing of the
    /// context's new order in it (a compaction since the last request).
    pub(crate) fn cold_at(&self, at: i64, ttl_ms: i64) -> bool {
        self.reordered
            || self
                .last_at
                .is_some_and(|last| at.saturating_sub(last) > ttl_ms)
    }

    /// True from a compaction until the next request starts.
    pub(crate) fn is_reordered(&self) -> bool {
        self.reordered
    }

    /// A compaction moved the context's start: until the next request, nothing of it is
    /// cached.
    pub(crate) fn context_reordered(&mut self) {
        self.reordered = true;
    }

    /// Where what the last request sent ends: every message before `.0`, and the first
    /// `.1` parts of message `.0`.
    pub(crate) fn sent(&self) -> (usize, usize) {
        self.sent
    }

    /// Part `pi` of message `msg` was deleted: the parts after it move down one, and so
    /// does the newest request's mark when the part was before it.
    pub(crate) fn part_removed(&mut self, msg: usize, pi: usize) {
        if msg == self.sent.0 && pi < self.sent.1 {
            self.sent.1 -= 1;
        }
    }

    /// Requests so far.
    pub(crate) fn count(&self) -> u64 {
        self.count
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_request_log_knows_what_was_sent_and_when() {
        let mut log = RequestLog::default();
        log.started(3, 0, Some(1000), 300_000);
        assert!(log.is_sent(2, 9) && !log.is_sent(3, 0));
        log.step_started(3, 0, 300_000);
        assert_eq!(
            log.count(),
            1,
            "the first step is the request that made the message"
        );
        log.step_started(3, 2, 300_000);
        assert!(log.is_sent(3, 1) && !log.is_sent(3, 2));
        log.finished(5000);
        assert!(!log.cold_at(305_000, 300_000));
        assert!(log.cold_at(305_001, 300_000));
        assert_eq!(log.count(), 2);
    }
}
