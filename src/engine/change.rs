//! The changes a session goes through, as values: what the durable store logs between two
//! snapshots and replays, through [`Session::perform`], to rebuild a session exactly.
//!
//! These five are every mutation the server makes ([`crate::engine::step`] for each
//! update, a committed prune, the outcome of a compaction, its commit, the calibration
//! prior the store gives a session of a model), and `perform` is the one place they are
//! dispatched, so the live path and the replay cannot drift apart.
//! Everything a change depends on comes in with it (the host time `now_ms`, the
//! summary, the ids): replaying the same changes in order on the same state gives the
//! same session, provided the same [`EngineConfig`] (a `Configure` update resolves the
//! session's settings from it).
//!
//! The other `&mut self` methods of [`Session`] change only caches: `prune_pending` and
//! `schedule` bring the prune window and the strategies' queue up to date (a pure function
//! of the messages), and a dry-run prune is a trial, rolled back. They are not changes and
//! are not logged. `auto_compaction_allowed` does count the cooldown down, but only `step`
//! calls it, inside a logged change. `set_byte_limit` is the store's, set before each job.

use serde::{Deserialize, Serialize};

use super::calibration::Factors;
use super::compaction::{CommitIds, Committed, CompactionError, CompactionPlan, SummaryOutcome};
use super::error::ApplyError;
use super::prune::{PruneMode, PruneReport};
use super::session::Session;
use super::update::Update;
use super::{StepReport, step};
use crate::config::EngineConfig;

/// A change to a session as the store logs it: the same changes replayed in order on the
/// same state give the same session.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
// A change is built, encoded and performed one at a time, never held in bulk: the size
// of its largest variant (a compaction's plan) costs nothing worth a box.
#[allow(clippy::large_enum_variant)]
pub enum Change {
    /// An update and the automatic checks after it: [`step`]`(session, update, config,
    /// now_ms)`.
    Step {
        /// The update.
        update: Update,
        /// Host time of the step (the prune stamps and strategy marks it sets).
        now_ms: i64,
    },
    /// A committed prune a host asked for: `session.prune(PruneMode::Commit, now_ms)` (a
    /// dry run changes nothing and is not a change).
    Prune {
        /// Host time of the prune.
        now_ms: i64,
    },
    /// How a compaction ended: `session.record_compaction(auto, ok)`.
    RecordCompaction {
        /// It was started automatically.
        auto: bool,
        /// It succeeded.
        ok: bool,
    },
    /// A compaction's summary recorded: `session.commit_compaction(&plan, &outcome, &ids,
    /// now_ms, config)`.
    CommitCompaction {
        /// What the compaction summarized and kept, planned when it began.
        plan: CompactionPlan,
        /// The model's summary.
        outcome: SummaryOutcome,
        /// Ids of the messages the commit creates.
        ids: CommitIds,
        /// Host time of the commit.
        now_ms: i64,
    },
    /// Where the calibration starts from, what sessions of the session's model taught
    /// the store (which the log does not hold): `session.set_calibration_prior(factors)`.
    /// Logged when a new model or tokenizer took the session's calibration back to
    /// NEUTRAL, so a rebuild predicts with the prior the live session had.
    CalibrationPrior {
        /// The prior's factors.
        factors: Factors,
    },
}

impl Change {
    /// Short name for logs and metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Change::Step { .. } => "step",
            Change::Prune { .. } => "prune",
            Change::RecordCompaction { .. } => "record_compaction",
            Change::CommitCompaction { .. } => "commit_compaction",
            Change::CalibrationPrior { .. } => "calibration_prior",
        }
    }
}

/// What performing a change returned: each variant is the result of the function the
/// change names, so callers read the same value the direct call gave.
#[derive(Debug, Clone, PartialEq)]
pub enum Performed {
    /// [`step`]'s report, or why the update was refused.
    Step(Result<StepReport, ApplyError>),
    /// The prune's report.
    Prune(PruneReport),
    /// True when this failure paused automatic compaction.
    RecordCompaction(bool),
    /// What the commit recorded, or why it was refused.
    CommitCompaction(Result<Committed, CompactionError>),
    /// The prior is set.
    CalibrationPrior,
}

impl Performed {
    /// False when the session is exactly as before (a refused step, a refused commit):
    /// such changes need not be logged. True whenever the session may have changed (a
    /// prune also drops decisions it no longer applies, a recorded outcome moves the
    /// breaker), so logging every change this calls true is always exact.
    pub fn changed(&self) -> bool {
        match self {
            Performed::Step(r) => r.is_ok(),
            Performed::Prune(_) | Performed::RecordCompaction(_) | Performed::CalibrationPrior => {
                true
            }
            Performed::CommitCompaction(r) => r.is_ok(),
        }
    }
}

impl Session {
    /// [`Session::perform`] for a change read back from a store's log: it was admitted
    /// when it was logged, so an admission limit the configuration lowered since (a
    /// lower `--max-parts-per-message`, another tokenizer counting a summary larger) does
    /// not refuse it again, and the session holds every change its clients were acked.
    pub fn replay(&mut self, change: Change, config: &EngineConfig) -> Performed {
        self.replaying = true;
        let performed = self.perform(change, config);
        self.replaying = false;
        performed
    }

    /// Performs `change`: the one place the five mutations are dispatched, live and on
    /// replay alike. A store encodes the change before performing it (the change is
    /// consumed) and logs it when [`Performed::changed`].
    pub fn perform(&mut self, change: Change, config: &EngineConfig) -> Performed {
        match change {
            Change::Step { update, now_ms } => Performed::Step(step(self, update, config, now_ms)),
            Change::Prune { now_ms } => Performed::Prune(self.prune(PruneMode::Commit, now_ms)),
            Change::RecordCompaction { auto, ok } => {
                Performed::RecordCompaction(self.record_compaction(auto, ok))
            }
            Change::CommitCompaction {
                plan,
                outcome,
                ids,
                now_ms,
            } => Performed::CommitCompaction(
                self.commit_compaction(&plan, &outcome, &ids, now_ms, config),
            ),
            Change::CalibrationPrior { factors } => {
                self.set_calibration_prior(factors);
                Performed::CalibrationPrior
            }
        }
    }
}
