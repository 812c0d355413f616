//! Rebuilding a stored session: its snapshot, then each logged change through the same
//! pure engine that made it (`Session::perform`), so the result is the state it had.

use super::backend::{BackendError, Stored};
use crate::config::EngineConfig;
use crate::engine::{Performed, Session};
use crate::engine::{decode_change, decode_session};

/// A session read back from its backend, with where its log stands.
#[derive(Debug)]
pub(crate) struct Restored {
    /// The session.
    pub session: Session,
    /// Its incarnation.
    pub incarnation: u64,
    /// The last change applied (the next one logged is `seq + 1`).
    pub seq: u64,
    /// Bytes of log replayed after the snapshot.
    pub log_bytes: u64,
    /// Bytes of the snapshot.
    pub snapshot_bytes: u64,
}

/// Decodes `stored` and replays its log. A snapshot or change that does not decode, or a
/// gap in the log, makes the session unreadable (`Corrupt`): it is reported and skipped,
/// its rows kept, never half restored. Changes replay past admission limits lowered since
/// they were logged; one that still does not apply is left out and logged.
pub(crate) fn restore(
    id: &str,
    stored: Stored,
    config: &EngineConfig,
) -> Result<Restored, BackendError> {
    let corrupt = |reason: String| BackendError::Corrupt {
        id: id.to_string(),
        reason,
    };
    let mut session = decode_session(&stored.snapshot)
        .map_err(|e| corrupt(format!("snapshot at seq {}: {e}", stored.snapshot_seq)))?;
    if session.info().id != id {
        return Err(corrupt(format!(
            "the snapshot is of session {:?}",
            session.info().id
        )));
    }
    let mut seq = stored.snapshot_seq;
    let mut log_bytes = 0u64;
    for (n, bytes) in &stored.log {
        if *n != seq.saturating_add(1) {
            return Err(corrupt(format!("the log jumps from seq {seq} to {n}")));
        }
        let change = decode_change(bytes).map_err(|e| corrupt(format!("log entry {n}: {e}")))?;
        // Only changes that applied were logged. Replayed, they pass the admission limits
        // the server's flags may have lowered since (`Session::replay`), but a refusal
        // that remains (another engine version reading the history otherwise) leaves the
        // change out, logged, rather than the whole session unreadable.
        let refused = match session.replay(change, config) {
            Performed::Step(Err(e)) => Some(e.to_string()),
            Performed::CommitCompaction(Err(e)) => Some(e.to_string()),
            _ => None,
        };
        if let Some(reason) = refused {
            tracing::warn!(session_id = id, seq = n, %reason, "a logged change no longer applies; restored without it");
        }
        seq = *n;
        log_bytes = log_bytes.saturating_add(bytes.len() as u64);
    }
    Ok(Restored {
        session,
        incarnation: stored.incarnation,
        seq,
        log_bytes,
        snapshot_bytes: stored.snapshot.len() as u64,
    })
}
