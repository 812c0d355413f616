//! [`Tx`]: what a job sees of its session. Reads go straight to the [`Session`]
//! (`Deref`); every change goes through [`Session::perform`] as an [`engine::Change`],
//! which is encoded for the session's log when the store is durable. A job therefore
//! cannot change a session in a way the log would not replay.

use std::ops::Deref;

use crate::config::EngineConfig;
use crate::engine::encode_change;
use crate::engine::{
    ApplyError, Change, CommitIds, Committed, CompactionError, CompactionPlan, ContextCache,
    Performed, PruneMode, PruneReport, Session, StepReport, SummaryOutcome, Update,
};

/// A job's access to its session: reads freely, changes only through logged changes.
pub struct Tx<'a> {
    session: &'a mut Session,
    /// The session's rendered context messages, kept by its actor between jobs.
    cache: &'a mut ContextCache,
    config: &'a EngineConfig,
    /// Encoded changes, when the store is durable.
    log: Option<&'a mut Vec<Vec<u8>>>,
    /// What runs once the job's changes are durable ([`Tx::when_durable`]).
    durable: Vec<Box<dyn FnOnce() + Send>>,
    /// What runs then only while the session is still held ([`Tx::announce_when_durable`]).
    announce: Vec<Box<dyn FnOnce() + Send>>,
}

impl Deref for Tx<'_> {
    type Target = Session;

    fn deref(&self) -> &Session {
        self.session
    }
}

impl<'a> Tx<'a> {
    /// A transaction over `session`; `log` collects the encoded changes (None: memory
    /// only, nothing is encoded).
    pub(super) fn new(
        session: &'a mut Session,
        cache: &'a mut ContextCache,
        config: &'a EngineConfig,
        log: Option<&'a mut Vec<Vec<u8>>>,
    ) -> Tx<'a> {
        Tx {
            session,
            cache,
            config,
            log,
            durable: Vec::new(),
            announce: Vec::new(),
        }
    }

    /// Runs `f` once this job's changes are durable (at once when nothing is on disk, or
    /// under `interval`), never when the disk refuses them and they are undone: what a
    /// watcher is told, or a metric counts, must not be taken back.
    pub fn when_durable(&mut self, f: impl FnOnce() + Send + 'static) {
        self.durable.push(Box::new(f));
    }

    /// What the job asked to run once durable ([`Tx::when_durable`]).
    pub(super) fn take_when_durable(&mut self) -> Vec<Box<dyn FnOnce() + Send>> {
        std::mem::take(&mut self.durable)
    }

    /// Runs `f` as [`Tx::when_durable`] does, but only while the store still holds this
    /// session under its id, checked under the store's map lock: what watchers of the id
    /// are told. A job queued before a delete still runs after it, and its events would
    /// otherwise reach the bus after the session's `gone` (a watcher of a session created
    /// again under the id would hear the old one's). `f` must not take the store's locks.
    pub fn announce_when_durable(&mut self, f: impl FnOnce() + Send + 'static) {
        self.announce.push(Box::new(f));
    }

    /// What the job asked to announce once durable ([`Tx::announce_when_durable`]).
    pub(super) fn take_announce(&mut self) -> Vec<Box<dyn FnOnce() + Send>> {
        std::mem::take(&mut self.announce)
    }

    /// The session with its context cache, to build a context that renders only the
    /// messages changed since the last one (`engine::ContextCache`).
    pub fn with_cache(&mut self) -> (&Session, &mut ContextCache) {
        (self.session, self.cache)
    }

    /// Performs `change`, logging it when it changed the session.
    pub fn perform(&mut self, change: Change) -> Performed {
        let encoded = self.log.is_some().then(|| encode_change(&change));
        let done = self.session.perform(change, self.config);
        if done.changed()
            && let (Some(log), Some(bytes)) = (self.log.as_deref_mut(), encoded)
        {
            log.push(bytes);
        }
        done
    }

    /// An update and the automatic checks after it (`engine::step`).
    pub fn step(&mut self, update: Update, now_ms: i64) -> Result<StepReport, ApplyError> {
        match self.perform(Change::Step { update, now_ms }) {
            Performed::Step(r) => r,
            other => Err(mismatch(&other)),
        }
    }

    /// Prune: a dry run reports without changing anything; a commit is logged.
    pub fn prune(&mut self, mode: PruneMode, now_ms: i64) -> PruneReport {
        if mode == PruneMode::DryRun {
            // A trial, rolled back: nothing to log.
            return self.session.prune(mode, now_ms);
        }
        match self.perform(Change::Prune { now_ms }) {
            Performed::Prune(r) => r,
            _ => PruneReport::default(),
        }
    }

    /// Feeds a compaction's outcome to the loop protection; true when it paused
    /// automatic compaction.
    pub fn record_compaction(&mut self, auto: bool, ok: bool) -> bool {
        match self.perform(Change::RecordCompaction { auto, ok }) {
            Performed::RecordCompaction(paused) => paused,
            _ => false,
        }
    }

    /// Commits a compaction: its summary and compaction part land in one change (one
    /// log entry, so one transaction).
    pub fn commit_compaction(
        &mut self,
        plan: CompactionPlan,
        outcome: SummaryOutcome,
        ids: CommitIds,
        now_ms: i64,
    ) -> Result<Committed, CompactionError> {
        match self.perform(Change::CommitCompaction {
            plan,
            outcome,
            ids,
            now_ms,
        }) {
            Performed::CommitCompaction(r) => r,
            _ => Err(CompactionError::NothingToCompact),
        }
    }
}

/// `perform` answers each change with its own variant; this names the impossible case
/// rather than panicking inside an actor.
fn mismatch(other: &Performed) -> ApplyError {
    ApplyError::precondition("", format!("the engine answered a step with {other:?}"))
}
