//! The byte ledger behind `memory_budget`: what sessions hold, plus what is in flight
//! for them — decoded updates waiting in mailboxes, events waiting for a slow client,
//! compaction prompts, imports being parsed.
//!
//! Sessions may grow until sessions plus in-flight bytes reach the budget. In-flight
//! bytes are reserved before they are held and have their own ceiling, an
//! [`IN_FLIGHT_SHARE`]th of the budget, so a burst of reads and writes can never take
//! more than that on top of full sessions (what is counted stays within 1.125 × the
//! budget), and full sessions never starve reads.
//! A [`Reservation`] gives its bytes back when it is dropped, however its holder ends.
//!
//! A durable session's changes acknowledged and not yet on disk are held twice: applied
//! to the session, and encoded in its journal (waiting for the next batch, or in the
//! batch being committed). Those encoded bytes count too ([`Ledger::journaled`]): under
//! `interval`, or a disk slower than the updates, they would otherwise grow beside full
//! sessions, up to 32 MiB per session, however small the budget. A session's snapshot
//! (written whole) does not: it lives while one batch commits, and going cold writes one
//! to free the session's memory. But under `interval` a disk that stays full has every
//! failing session's next try be the session whole, and those tries are admitted
//! ([`Ledger::rewrite`]) only while their bytes stay within the in-flight share (each
//! weighed by its session's held size until its snapshot's is known), or one alone: otherwise sessions that failed in one batch would all encode and queue a
//! snapshot at once, as much again as they hold.
//!
//! Part of what sessions hold is their rendered context, kept between GetContext calls
//! (`engine::ContextCache`). It is counted with the sessions, and also on its own: all
//! of it together may take at most a [`CACHE_SHARE`]th of the budget, past which an actor
//! drops its session's (a cache is a speed-up, never a reason to refuse an update).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use super::StoreError;

/// In-flight bytes may reach this fraction of `memory_budget` (1/`IN_FLIGHT_SHARE`).
pub const IN_FLIGHT_SHARE: u64 = 8;

/// Rendered contexts may take this fraction of `memory_budget` (1/`CACHE_SHARE`).
pub const CACHE_SHARE: u64 = 8;

/// Bytes held and in flight, shared by the store, its actors and the server.
#[derive(Debug, Default)]
pub struct Ledger {
    /// Bytes all session actors hold (each adds its own changes after every job).
    held: AtomicU64,
    /// Bytes reserved for requests, events and prompts in flight.
    in_flight: AtomicU64,
    /// Of `held`, the bytes of the sessions' rendered contexts.
    cached: AtomicU64,
    /// Bytes of durable sessions' encoded changes not yet on disk ([`JournalBytes`]).
    journaled: AtomicU64,
    /// Bytes of snapshots sent again after a failed write ([`Rewrite`]).
    rewriting: AtomicU64,
    /// `memory_budget` (0: no budget, reservations always succeed).
    budget: u64,
}

impl Ledger {
    /// A ledger for `memory_budget` bytes (0: no limit).
    pub fn new(budget: u64) -> Ledger {
        Ledger {
            budget,
            ..Ledger::default()
        }
    }

    /// Bytes all sessions hold.
    pub fn held(&self) -> u64 {
        self.held.load(Ordering::Relaxed)
    }

    /// Bytes reserved in flight.
    pub fn in_flight(&self) -> u64 {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Of the held bytes, those of rendered contexts.
    pub fn cached(&self) -> u64 {
        self.cached.load(Ordering::Relaxed)
    }

    /// The ceiling of the rendered contexts' bytes (`u64::MAX` without a budget).
    pub fn cache_limit(&self) -> u64 {
        match self.budget {
            0 => u64::MAX,
            b => b / CACHE_SHARE,
        }
    }

    /// The memory budget (0: none).
    pub fn budget(&self) -> u64 {
        self.budget
    }

    /// Bytes of durable sessions' changes waiting to be written (encoded, beside the
    /// sessions that hold them applied).
    pub fn journaled(&self) -> u64 {
        self.journaled.load(Ordering::Relaxed)
    }

    /// Bytes of sessions being written whole again after a failed write.
    pub fn rewriting(&self) -> u64 {
        self.rewriting.load(Ordering::Relaxed)
    }

    /// Admits a try at writing a session of about `bytes` whole again after its writes
    /// failed, while such tries stay within the in-flight share, or when none is in
    /// flight (a session larger than the share still gets its turn). None: wait.
    pub(super) fn rewrite(self: &Arc<Self>, bytes: u64) -> Option<Rewrite> {
        let limit = self.in_flight_limit();
        let mut now = self.rewriting.load(Ordering::Relaxed);
        loop {
            let after = now.saturating_add(bytes);
            if after > limit && now > 0 {
                return None;
            }
            match self.rewriting.compare_exchange_weak(
                now,
                after,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => {
                    return Some(Rewrite {
                        ledger: self.clone(),
                        bytes,
                    });
                }
                Err(seen) => now = seen,
            }
        }
    }

    /// What counts against the budget: sessions, their changes waiting to be written,
    /// and in-flight bytes.
    pub fn counted(&self) -> u64 {
        self.held()
            .saturating_add(self.journaled())
            .saturating_add(self.in_flight())
    }

    /// The ceiling of in-flight bytes (`u64::MAX` without a budget).
    pub fn in_flight_limit(&self) -> u64 {
        match self.budget {
            0 => u64::MAX,
            b => b / IN_FLIGHT_SHARE,
        }
    }

    /// Adds `delta` to the held bytes; a shrink is passed as the wrapping difference
    /// (`now.wrapping_sub(last)`), which the atomic add wraps back.
    pub(super) fn add_held(&self, delta: u64) {
        self.held.fetch_add(delta, Ordering::Relaxed);
    }

    pub(super) fn sub_held(&self, delta: u64) {
        self.held.fetch_sub(delta, Ordering::Relaxed);
    }

    /// Adds `delta` to the rendered contexts' bytes, wrapping as [`Self::add_held`].
    pub(super) fn add_cached(&self, delta: u64) {
        self.cached.fetch_add(delta, Ordering::Relaxed);
    }

    pub(super) fn sub_cached(&self, delta: u64) {
        self.cached.fetch_sub(delta, Ordering::Relaxed);
    }

    /// Reserves `bytes` for `what` (named in the refusal), or refuses when the in-flight
    /// ceiling would be passed.
    pub fn reserve(
        self: &Arc<Self>,
        bytes: u64,
        what: &'static str,
    ) -> Result<Reservation, StoreError> {
        self.reserve_within(bytes, what, None)
    }

    /// Counts `bytes` in flight without a ceiling: what is small and already arriving
    /// (a request message being collected) is counted, so the limits see it, but never
    /// refused.
    pub fn count(self: &Arc<Self>, bytes: u64, what: &'static str) -> Reservation {
        self.reserve_within(bytes, what, Some(u64::MAX))
            .unwrap_or_default()
    }

    /// [`Self::reserve`], but past the ceiling too when nothing else is in flight: one
    /// reply larger than the in-flight share (a whole session read back) can still be
    /// sent, alone, while any number of them cannot pile up.
    pub fn reserve_or_alone(
        self: &Arc<Self>,
        bytes: u64,
        what: &'static str,
    ) -> Result<Reservation, StoreError> {
        self.reserve_within(bytes, what, Some(0))
    }

    /// [`Self::reserve_or_alone`] for a request that holds `own` bytes in flight itself
    /// (a Stream update being answered): alone means nothing in flight but those.
    pub fn reserve_or_alone_beside(
        self: &Arc<Self>,
        bytes: u64,
        what: &'static str,
        own: u64,
    ) -> Result<Reservation, StoreError> {
        self.reserve_within(bytes, what, Some(own))
    }

    /// Reserves `bytes`, past the ceiling too while no more than `alone` bytes are in
    /// flight (the caller's own, when it grows a reservation of that size).
    fn reserve_within(
        self: &Arc<Self>,
        bytes: u64,
        what: &'static str,
        alone: Option<u64>,
    ) -> Result<Reservation, StoreError> {
        let limit = self.in_flight_limit();
        let mut now = self.in_flight.load(Ordering::Relaxed);
        loop {
            let after = now.saturating_add(bytes);
            if after > limit && alone.is_none_or(|own| now > own) {
                return Err(StoreError::InFlightOverBudget {
                    what,
                    bytes,
                    in_flight: now,
                    limit,
                    budget: self.budget,
                });
            }
            match self.in_flight.compare_exchange_weak(
                now,
                after,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => {
                    return Ok(Reservation {
                        ledger: Some(self.clone()),
                        bytes,
                    });
                }
                Err(seen) => now = seen,
            }
        }
    }
}

/// One durable session's journal bytes in a [`Ledger`], moved to what the journal holds
/// after each change to it and given back on drop. Never refused: the changes were
/// acknowledged already (the budget refuses the next update instead).
#[derive(Debug)]
pub(super) struct JournalBytes {
    ledger: Arc<Ledger>,
    bytes: u64,
}

impl JournalBytes {
    /// Nothing counted yet in `ledger`.
    pub fn new(ledger: Arc<Ledger>) -> JournalBytes {
        JournalBytes { ledger, bytes: 0 }
    }

    /// Counts `bytes` from now on in place of what was counted before.
    pub fn set(&mut self, bytes: u64) {
        recount(&self.ledger.journaled, self.bytes, bytes);
        self.bytes = bytes;
    }
}

impl Drop for JournalBytes {
    fn drop(&mut self) {
        self.set(0);
    }
}

/// Moves `counter` from counting `was` bytes (of its holder's) to counting `now`.
fn recount(counter: &AtomicU64, was: u64, now: u64) {
    if now > was {
        counter.fetch_add(now - was, Ordering::Relaxed);
    } else {
        counter.fetch_sub(was - now, Ordering::Relaxed);
    }
}

/// A session's snapshot sent again after failed writes, counted in
/// [`Ledger::rewriting`] until its batch is committed or fails (dropped).
#[derive(Debug)]
pub(super) struct Rewrite {
    ledger: Arc<Ledger>,
    bytes: u64,
}

impl Rewrite {
    /// Counts the snapshot's real size in place of the estimate admitted: never refused,
    /// as it is encoded already.
    pub(super) fn set(&mut self, bytes: u64) {
        recount(&self.ledger.rewriting, self.bytes, bytes);
        self.bytes = bytes;
    }
}

impl Drop for Rewrite {
    fn drop(&mut self) {
        self.set(0);
    }
}

/// Bytes counted as held ahead of the session that will hold them (one read from disk,
/// waiting for admission): concurrent admissions see each other's, and the bytes are
/// given back on drop (the admitted session counts its own from then on).
#[derive(Debug)]
pub(super) struct HeldAhead {
    ledger: Arc<Ledger>,
    bytes: u64,
}

impl HeldAhead {
    /// Counts `bytes` as held until dropped.
    pub(super) fn new(ledger: &Arc<Ledger>, bytes: u64) -> HeldAhead {
        ledger.add_held(bytes);
        HeldAhead {
            ledger: ledger.clone(),
            bytes,
        }
    }

    /// The bytes counted.
    pub(super) fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl Drop for HeldAhead {
    fn drop(&mut self) {
        self.ledger.add_held(0u64.wrapping_sub(self.bytes));
    }
}

/// Bytes reserved in a [`Ledger`], given back on drop (the default reserves nothing).
#[derive(Debug, Default)]
pub struct Reservation {
    ledger: Option<Arc<Ledger>>,
    bytes: u64,
}

impl Reservation {
    /// Bytes reserved.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Makes this reservation `bytes` large: shrinking gives the difference back, growing
    /// reserves the difference (refused past the in-flight ceiling, the reservation then
    /// unchanged). A reservation of nothing grows from `ledger`.
    pub fn resize(
        &mut self,
        ledger: &Arc<Ledger>,
        bytes: u64,
        what: &'static str,
    ) -> Result<(), StoreError> {
        self.resize_within(ledger, bytes, what, false)
    }

    /// [`Self::resize`], but past the in-flight ceiling too while this reservation is all
    /// that is in flight (as [`Ledger::reserve_or_alone`]): one import larger than the
    /// share can still be parsed, alone, while several cannot pile up.
    pub fn resize_or_alone(
        &mut self,
        ledger: &Arc<Ledger>,
        bytes: u64,
        what: &'static str,
    ) -> Result<(), StoreError> {
        self.resize_within(ledger, bytes, what, true)
    }

    fn resize_within(
        &mut self,
        ledger: &Arc<Ledger>,
        bytes: u64,
        what: &'static str,
        alone: bool,
    ) -> Result<(), StoreError> {
        if bytes <= self.bytes {
            if let Some(l) = &self.ledger {
                l.in_flight.fetch_sub(self.bytes - bytes, Ordering::Relaxed);
            }
            self.bytes = bytes;
            return Ok(());
        }
        let own = alone.then_some(self.bytes);
        let mut extra = ledger.reserve_within(bytes - self.bytes, what, own)?;
        // The two become one: this reservation now holds both amounts.
        extra.ledger = None;
        self.ledger = Some(ledger.clone());
        self.bytes = bytes;
        Ok(())
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if let Some(l) = self.ledger.take() {
            l.in_flight.fetch_sub(self.bytes, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_are_bounded_by_the_share_and_given_back_on_drop() {
        let l = Arc::new(Ledger::new(800));
        let a = l.reserve(60, "test").expect("within the share");
        assert_eq!(l.in_flight(), 60);
        let refused = l.reserve(41, "events").expect_err("over the share of 100");
        assert!(refused.to_string().contains("memory_budget"), "{refused}");
        assert!(refused.to_string().contains("events"), "{refused}");
        let b = l.reserve(40, "test").expect("exactly the share");
        assert_eq!(l.counted(), 100);
        drop(a);
        drop(b);
        assert_eq!(l.in_flight(), 0);
    }

    #[test]
    fn a_reservation_resized_keeps_the_ledger_exact() {
        let l = Arc::new(Ledger::new(800));
        let mut r = l.reserve(60, "test").expect("within");
        r.resize(&l, 20, "test").expect("shrinks");
        assert_eq!(l.in_flight(), 20);
        r.resize(&l, 90, "test").expect("grows within the share");
        assert_eq!(l.in_flight(), 90);
        r.resize(&l, 101, "test").expect_err("past the share");
        assert_eq!(
            (l.in_flight(), r.bytes()),
            (90, 90),
            "unchanged when refused"
        );
        let mut empty = Reservation::default();
        empty.resize(&l, 10, "test").expect("grows from nothing");
        assert_eq!(l.in_flight(), 100);
        drop(r);
        drop(empty);
        assert_eq!(l.in_flight(), 0);
    }

    #[test]
    fn a_reservation_grows_past_the_share_only_alone() {
        let l = Arc::new(Ledger::new(800));
        let mut r = l.reserve(60, "test").expect("within");
        r.resize_or_alone(&l, 150, "test")
            .expect("alone: past the share");
        assert_eq!(l.in_flight(), 150);
        r.resize_or_alone(&l, 50, "test").expect("shrinks");
        let other = l.reserve(10, "test").expect("within");
        let refused = r.resize_or_alone(&l, 150, "test");
        assert!(refused.is_err(), "another reservation is in flight");
        assert_eq!(l.in_flight(), 60, "a refused growth leaves it as it was");
        drop((r, other));
        assert_eq!(l.in_flight(), 0);
    }

    #[test]
    fn one_item_past_the_share_goes_alone_and_no_second_one_with_it() {
        let l = Arc::new(Ledger::new(800));
        let big = l
            .reserve_or_alone(300, "sessions")
            .expect("alone, past the share");
        assert_eq!(l.in_flight(), 300);
        l.reserve_or_alone(300, "sessions")
            .expect_err("not a second one beside it");
        l.reserve_or_alone(1, "sessions")
            .expect_err("nor anything else while over the share");
        drop(big);
        let small = l.reserve(10, "updates").expect("within the share");
        l.reserve_or_alone(300, "sessions")
            .expect_err("not alone: 10 bytes are in flight");
        drop(small);
        assert_eq!(l.in_flight(), 0);
    }

    #[test]
    fn without_a_budget_reservations_always_succeed() {
        let l = Arc::new(Ledger::new(0));
        let r = l.reserve(u64::MAX / 2, "test").expect("no budget");
        assert_eq!(r.bytes(), u64::MAX / 2);
    }

    #[test]
    fn rewrites_take_turns_within_the_share_and_never_count_against_the_budget() {
        let l = Arc::new(Ledger::new(800));
        let mut big = l.rewrite(150).expect("alone, past the share of 100");
        assert!(l.rewrite(1).is_none(), "the share is spent");
        big.set(60);
        assert_eq!(l.rewriting(), 60, "the encoded size replaces the estimate");
        let small = l.rewrite(40).expect("exactly the share");
        assert!(l.rewrite(1).is_none());
        assert_eq!(
            l.counted(),
            0,
            "a snapshot in flight is not held by a session"
        );
        drop(big);
        drop(small);
        assert_eq!(l.rewriting(), 0);
        let l = Arc::new(Ledger::new(0));
        let _a = l.rewrite(u64::MAX / 2).expect("no budget");
        assert!(l.rewrite(u64::MAX / 2).is_some(), "no budget, no bound");
    }
}
