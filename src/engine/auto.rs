//! Loop protection of automatic compaction: a cooldown after a compaction that did not
//! bring the context under the threshold, and a circuit breaker after repeated failures.
//! The counters are private: they change only through the three events below.

use serde::{Deserialize, Serialize};

/// The cooldown and breaker counters of one session.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AutoState {
    /// Finished assistant messages to wait before compacting automatically again.
    cooldown_left: u32,
    /// Consecutive failed automatic compactions.
    failures: u32,
}

impl AutoState {
    /// Finished assistant messages still to wait before compacting automatically again.
    pub fn cooldown_left(&self) -> u32 {
        self.cooldown_left
    }

    /// Consecutive failed automatic compactions.
    pub fn failures(&self) -> u32 {
        self.failures
    }

    /// True once `limit` automatic compactions failed in a row (0: never).
    pub fn paused(&self, limit: u32) -> bool {
        limit > 0 && self.failures >= limit
    }

    /// A finished (non-summary) assistant message: counts the cooldown down, and says
    /// whether the cooldown allows an automatic compaction now.
    pub(crate) fn finished_message(&mut self) -> bool {
        if self.cooldown_left > 0 {
            self.cooldown_left -= 1;
            return false;
        }
        true
    }

    /// A compaction succeeded: the breaker closes; `cooldown` finished messages to wait
    /// (0 when the context came back under the threshold).
    pub(crate) fn succeeded(&mut self, cooldown: u32) {
        self.failures = 0;
        self.cooldown_left = cooldown;
    }

    /// An automatic compaction failed.
    pub(crate) fn failed(&mut self) {
        self.failures = self.failures.saturating_add(1);
    }
}
