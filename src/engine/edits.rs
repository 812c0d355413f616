//! What a session knows of the host's edits of its messages beyond each message's own
//! stamp ([`super::stored::Message::edit`]), so a compaction's commit can tell a
//! summarized message the host changed meanwhile, across a reload too.
//!
//! Stamps are not stored: a session loaded from disk holds 0 for every message. The
//! store carries [`Edits`] (bounded, `Copy`) beside a session it sends cold, with its
//! generation, and gives them back when it loads the session as the same value
//! (`Session::resume`): the latest edits by position and stamp, and for every other
//! message a stamp its last change was no later than. A commit compares a message whose
//! stamp was not carried by that bound against the plan's edit clock: it counts as
//! unchanged when nothing forgotten came after the plan, as changed otherwise.
//! O([`RECENT_EDITS`]) per edit, nothing per message.

/// How many of the latest edited messages [`Edits`] holds by position: more than that
/// edited between a compaction's plan and a reload make its commit stale.
pub const RECENT_EDITS: usize = 8;

/// The session's edit clock, its latest edited messages and bounds on the stamps of the
/// others (see the module).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Edits {
    /// The stamp of the latest edit (stamps grow: every later edit's is larger).
    clock: u64,
    /// The latest edited messages, newest first: position and stamp.
    recent: [(usize, u64); RECENT_EDITS],
    /// How many of `recent` are set.
    len: usize,
    /// A message whose stamp is 0 last changed no later than this (0 in a session built
    /// anew: no plan of this process predates it).
    unknown_upto: u64,
    /// The largest stamp that left `recent` (stamps of messages not in it are at most
    /// this).
    dropped_upto: u64,
}

impl Edits {
    /// Records that the host changed message `msg`, now stamped `stamp`.
    pub(crate) fn record(&mut self, msg: usize, stamp: u64) {
        self.clock = self.clock.max(stamp);
        // Most edits are to the message edited last (a streaming part): no shift.
        let at = self.recent[..self.len]
            .iter()
            .position(|&(m, _)| m == msg)
            .unwrap_or_else(|| {
                if self.len < RECENT_EDITS {
                    self.len += 1;
                } else {
                    let (_, dropped) = self.recent[RECENT_EDITS - 1];
                    self.dropped_upto = self.dropped_upto.max(dropped);
                }
                self.len - 1
            });
        self.recent.copy_within(0..at, 1);
        self.recent[0] = (msg, stamp);
    }

    /// The stamp of the latest edit.
    pub(crate) fn clock(&self) -> u64 {
        self.clock
    }

    /// A message whose stamp is 0 last changed no later than this.
    pub(crate) fn unknown_upto(&self) -> u64 {
        self.unknown_upto
    }

    /// The latest edited messages, newest first.
    pub(crate) fn recent(&self) -> &[(usize, u64)] {
        &self.recent[..self.len]
    }

    /// What a session loaded from disk knows of these edits, before it is given back
    /// the stamps of [`Edits::recent`]: every other stamp is forgotten (0), and bounded.
    pub(crate) fn carried(&self) -> Edits {
        Edits {
            unknown_upto: self.unknown_upto.max(self.dropped_upto),
            dropped_upto: 0,
            ..*self
        }
    }

    /// These edits (carried), then the newer ones of `since` on top: a session loaded
    /// and given back what it was.
    pub(crate) fn then(mut self, since: &Edits) -> Edits {
        for &(msg, stamp) in since.recent().iter().rev() {
            self.record(msg, stamp);
        }
        self.clock = self.clock.max(since.clock);
        self.dropped_upto = self.dropped_upto.max(since.dropped_upto);
        self
    }

    /// The same edits with only the messages `keep` holds in [`Edits::recent`] (the
    /// others are gone, or stamped anew).
    pub(crate) fn retain(mut self, keep: impl Fn(usize) -> bool) -> Edits {
        let mut kept = 0;
        for k in 0..self.len {
            if keep(self.recent[k].0) {
                self.recent[kept] = self.recent[k];
                kept += 1;
            }
        }
        self.len = kept;
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_latest_edits_are_kept_by_position_and_the_rest_bounded() {
        let mut e = Edits::default();
        for stamp in 1..=RECENT_EDITS as u64 + 2 {
            e.record(stamp as usize, stamp * 10);
        }
        // Edited again: moves to the front, no slot taken.
        e.record(9, 200);
        assert_eq!(e.clock(), 200);
        let positions: Vec<usize> = e.recent().iter().map(|&(m, _)| m).collect();
        assert_eq!(positions, [9, 10, 8, 7, 6, 5, 4, 3]);
        // Messages 1 and 2 left: stamps 10 and 20 are bounded by 20.
        let carried = e.carried();
        assert_eq!(carried.unknown_upto(), 20);
        assert_eq!(carried.recent(), e.recent());
        assert_eq!(carried.retain(|m| m < 8).recent().len(), 5);
    }
}
