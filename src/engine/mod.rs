//! The pure core: everything compactd decides, as functions over a [`Session`] value.
//!
//! Architecture invariant: nothing in `engine/` does I/O, reads the clock or the
//! environment, or knows about tokio, tonic or HTTP. Time comes in as an argument
//! (`now_ms`), configuration as a value. That makes every decision reproducible in a
//! unit test and in `compactd replay`.
//!
//! Reading order: `session.rs` (the value and `apply`), `overflow.rs`, `prune.rs`,
//! `context.rs`, then [`step`] below, which strings them together as the server does
//! after every update.

mod anchors;
mod auto;
pub mod calibration;
pub(crate) mod carry;
mod change;
mod compaction;
mod context;
mod context_cache;
mod edits;
mod error;
mod estimate;
mod footprint;
mod json_array;
mod json_len;
mod json_str;
mod memory;
mod openai;
mod overflow;
mod part_index;
mod pinning;
mod pins;
mod prune;
mod prune_index;
mod recall;
mod render;
mod request_log;
pub mod scheduler;
mod session;
mod snapshot;
mod sorted;
mod stored;
pub mod strategies;
mod token_index;
mod totals;
mod update;

pub use auto::AutoState;
pub use carry::{ExportMessage, Trail};
pub use change::{Change, Performed};
pub use compaction::{
    AUTO_CONTINUE, COMPACTION_AGENT, CommitIds, Committed, CompactionError, CompactionPlan,
    CompactionRequest, SummaryOutcome, TailOptions, default_tail_tokens,
};
pub use context::{ContextView, NativeContext, OpenAiContext};
pub use context_cache::ContextCache;
pub use edits::RECENT_EDITS;
pub use error::{ApplyError, ErrorKind};
pub use estimate::{PartEstimate, counted_texts, estimate};
pub use footprint::ByteLimit;
pub use json_array::JsonArray;
#[cfg(test)]
pub(crate) use openai::json_len_hint;
pub use overflow::{Crossed, OverflowCheck, Trigger, check, used_tokens};
pub use prune::{NotCommitted, PruneMode, PruneReport, PrunedPart};
pub use prune_index::{Candidate, PruneIndex, PrunePlan, eligible_end, reference_scan};
pub use recall::{
    RECALL_TOOL, RecallKey, Recalled, RecalledCall, RecalledContent, Reduction, recall_tool,
    recall_tool_json,
};
pub(crate) use render::Reading;
pub use session::{Generation, Resume, Session};
pub use snapshot::{
    Document, SNAPSHOT_FORMAT, SnapshotError, decode_change, decode_session, encode_change,
    encode_session,
};
pub use stored::{Message, StoredPart};
pub use update::{Applied, Update};

use crate::config::EngineConfig;

/// Something the engine noticed while applying an update, for the host to hear about.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// The session is over (or predicted over) its threshold.
    Overflow(OverflowCheck),
    /// Automatic prune cleared old outputs.
    Pruned(PruneReport),
    /// Still over the threshold after prune, auto-compaction on and not held back by the
    /// cooldown or the circuit breaker: the shell should start an automatic compaction.
    CompactionNeeded(OverflowCheck),
}

/// The result of one update: what it did and what the engine noticed.
#[derive(Debug, Clone, PartialEq)]
pub struct StepReport {
    /// What the update changed.
    pub applied: Applied,
    /// Events in the order they happened.
    pub events: Vec<Event>,
}

/// Applies an update and runs the automatic checks, as the server does for every update:
/// after a usage report or a finished assistant message, check overflow; after a finished
/// assistant message, prune (unless automatic prune is off). The PRUNE_MINIMUM guard keeps
/// the automatic prune from churning.
pub fn step(
    session: &mut Session,
    update: Update,
    config: &EngineConfig,
    now_ms: i64,
) -> Result<StepReport, ApplyError> {
    let applied = session.apply(update, config)?;
    let mut events = Vec::new();
    if applied.finished || applied.usage_reported {
        let trigger = if applied.finished {
            Trigger::Finished
        } else {
            Trigger::Usage
        };
        let check = session.check_overflow(trigger);
        if check.overflow {
            events.push(Event::Overflow(check));
        }
    }
    if let Some(at) = applied.user_at
        && session.settings().prune
        && let Some(report) = session.commit_if_cold(at, now_ms)
    {
        events.push(Event::Pruned(report));
    }
    if applied.finished && session.settings().prune {
        let (report, _) = session.auto_commit(now_ms);
        if report.changed() {
            events.push(Event::Pruned(report));
        }
    }
    if applied.finished && !applied.summary && session.settings().auto_compact {
        let check = session.check_overflow(Trigger::Finished);
        if session.auto_compaction_allowed(check.overflow) {
            events.push(Event::CompactionNeeded(check));
        }
    }
    Ok(StepReport { applied, events })
}

#[cfg(test)]
mod tests;
