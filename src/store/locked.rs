//! What a job runs on: a session, its rendered context and its share of the store's byte
//! total, behind one lock that its actor and its handles share. The actor takes it for
//! each job from its mailbox; a handle of an in-memory session takes it to run a job
//! inline, on the caller's task, when nothing is queued (`SessionHandle::try_run`), which
//! saves the mailbox's hop: the send, the actor's wake and the reply's channel.
//!
//! Either way a job runs through [`Locked::run`], so both paths set the same byte limit,
//! account the same bytes and share the same calibration.

use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use super::tx::Tx;
use super::{Ledger, Limits, Shared, over_high_water};
use crate::config::EngineConfig;
use crate::engine::{Change, ContextCache, Session};
use crate::tokens::Counting;

/// The session and everything a job changes beside it.
pub(super) struct Locked {
    pub session: Session,
    /// The context's messages as last rendered (its bytes count with the session's).
    pub cache: ContextCache,
    pub config: Arc<EngineConfig>,
    pub limits: Limits,
    pub counted: Counted,
    /// The calibration's observations when it was last shared with the model's priors.
    pub shared_at: u32,
    /// The session's calibration resets when it was last given its key's prior.
    pub calibrated_as: u32,
}

impl std::fmt::Debug for Locked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Locked")
            .field("session", &self.session.info().id)
            .finish_non_exhaustive()
    }
}

/// What the session's handles read of it without its lock, as of its last job.
#[derive(Debug)]
pub(super) struct Published {
    /// Bytes the session holds (with its rendered context).
    pub bytes: AtomicU64,
    /// What the session counts with, as a [`counting_code`].
    pub counting: AtomicU8,
}

impl Published {
    /// What `session` holds and counts with, before its first job.
    pub fn of(session: &Session) -> Published {
        Published {
            bytes: AtomicU64::new(session.held_bytes()),
            counting: AtomicU8::new(counting_code(session.counting())),
        }
    }

    /// What the session counts with.
    pub fn counting(&self) -> Counting {
        counting_from(self.counting.load(Ordering::Relaxed))
    }
}

/// One session's share of the store's byte total, returned when it is dropped.
pub(super) struct Counted {
    pub ledger: Arc<Ledger>,
    /// The session and its rendered context.
    pub last: u64,
    /// Of `last`, the rendered context.
    pub cached: u64,
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.ledger.sub_held(self.last);
        self.ledger.sub_cached(self.cached);
    }
}

impl Locked {
    /// Runs `job` on the session: sets its byte limit from the budget, runs it (its
    /// changes encoded into `log` when the store is durable), then moves the store's byte
    /// total and tells the handles and the model's priors what changed.
    pub fn run<R>(
        &mut self,
        published: &Published,
        store: &Weak<Shared>,
        log: Option<&mut Vec<Vec<u8>>>,
        job: impl FnOnce(&mut Tx<'_>, &EngineConfig) -> R,
    ) -> R {
        let ledger = &self.counted.ledger;
        // Sessions plus what is in flight: reserved bytes leave less room to grow.
        let total = ledger.counted();
        if !self.cache.is_empty() && over_high_water(ledger) {
            // Renderings are the first thing to give back: the next context renders
            // everything again.
            self.cache.clear();
        }
        // The session may grow into what it holds itself, not into its cache's bytes.
        let own = self.session.held_bytes();
        self.session
            .set_byte_limit(self.limits.byte_limit(own, total));
        let r = {
            let mut tx = Tx::new(&mut self.session, &mut self.cache, &self.config, log);
            let r = job(&mut tx, &self.config);
            // In the job's transaction: the prior is logged in the same batch as the
            // `Configure` that called for it.
            give_prior(&mut tx, &mut self.calibrated_as, &mut self.shared_at, store);
            r
        };
        self.account(published);
        self.share_calibration(store);
        let code = counting_code(self.session.counting());
        published.counting.store(code, Ordering::Relaxed);
        r
    }

    /// Moves the store's byte total to the session's size after a change. A rendered
    /// context that would take the sessions' contexts past their share of the budget is
    /// dropped instead (the next context is rendered whole, as without a cache).
    pub fn account(&mut self, published: &Published) {
        let counted = &mut self.counted;
        let mut cached = self.cache.held_bytes();
        let others = counted.ledger.cached().saturating_sub(counted.cached);
        if cached > 0 && others.saturating_add(cached) > counted.ledger.cache_limit() {
            self.cache.clear();
            cached = self.cache.held_bytes();
        }
        if cached != counted.cached {
            counted
                .ledger
                .add_cached(cached.wrapping_sub(counted.cached));
            counted.cached = cached;
        }
        let now = self.session.held_bytes().saturating_add(cached);
        if now != counted.last {
            // Two atomic adds, never a scan: the store's total follows each job.
            counted.ledger.add_held(now.wrapping_sub(counted.last));
            published.bytes.store(now, Ordering::Relaxed);
            counted.last = now;
        }
    }

    /// Puts `rebuilt`, the session as the disk has it, in place of the one in memory
    /// (after a panicking job or a refused commit): the same value, so a compaction
    /// planned on it still commits, and with its messages' edits (one the host changed
    /// meanwhile makes that commit stale). Its calibration resets are counted from its
    /// own build, so a `Configure` replayed is not taken for a new one.
    pub fn rebuilt(&mut self, mut rebuilt: Session, published: &Published) {
        rebuilt.resume_from(&self.session);
        self.calibrated_as = rebuilt.calibration_resets();
        self.session = rebuilt;
        self.cache.clear();
        self.account(published);
    }

    /// Gives the model's priors what a usage report just taught (a check per job; the
    /// lock only when the calibration learned something).
    fn share_calibration(&mut self, store: &Weak<Shared>) {
        let seen = self.session.calibration().observations();
        if seen == self.shared_at {
            return;
        }
        self.shared_at = seen;
        if let (Some(key), Some(store)) = (self.session.prior_key(), store.upgrade()) {
            store.learned(&key, self.session.calibration());
        }
    }
}

/// Gives a session whose model or tokenizer the job changed (its calibration back at
/// NEUTRAL) what sessions of the new key taught the store, as a logged change: a session
/// rebuilt from the disk replays it after the `Configure`, and starts from the same prior.
fn give_prior(tx: &mut Tx<'_>, calibrated_as: &mut u32, shared_at: &mut u32, store: &Weak<Shared>) {
    let resets = tx.calibration_resets();
    if resets == *calibrated_as {
        return;
    }
    // It shares what it learns under its new key from now on.
    *calibrated_as = resets;
    *shared_at = 0;
    if let Some(factors) = store.upgrade().and_then(|s| s.prior_for(tx)) {
        tx.perform(Change::CalibrationPrior { factors });
    }
}

/// A [`Counting`] as a byte (handles share it through an atomic).
fn counting_code(c: Counting) -> u8 {
    match c {
        Counting::Chars4 => 0,
        Counting::O200k => 1,
        Counting::Cl100k => 2,
    }
}

/// The [`Counting`] a byte from [`counting_code`] stands for.
fn counting_from(code: u8) -> Counting {
    match code {
        1 => Counting::O200k,
        2 => Counting::Cl100k,
        _ => Counting::Chars4,
    }
}
