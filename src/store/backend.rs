//! The store's boundary with durable storage: the one trait a backend implements, and
//! the values that cross it.
//!
//! A backend keeps, per session, one snapshot (the encoded `Session` after change `seq`)
//! and the log of encoded changes after it. It knows nothing of what the bytes mean:
//! encoding and replay are the engine's (`engine::snapshot`, `engine::Change`). Every
//! session row carries an *incarnation*: a session deleted and created again under the
//! same id is a new incarnation, so a write from the old one (an actor finishing its
//! queue after the delete) lands nowhere.
//!
//! SQLite (`sqlite.rs`) is the embedded default. A shared networked backend (PostgreSQL,
//! for hosts that move sessions between pods) implements the same trait; see
//! ARCHITECTURE.md, "API boundaries", "Store ↔ backend".

use std::fmt;
use std::time::Duration;

use thiserror::Error;
use tokio::sync::oneshot;

/// When an update is acknowledged relative to when it is on disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// Acknowledged once durable; concurrent writes from all sessions share one fsync.
    Sync,
    /// Acknowledged at once; on disk within this interval (the loss window on a crash).
    Interval(Duration),
    /// Nothing on disk: a restart loses every session.
    Memory,
}

impl Durability {
    /// Parses `sync`, `memory` or `interval=<ms>` (the `--durability` flag).
    pub fn parse(s: &str) -> Result<Durability, String> {
        match s.trim() {
            "sync" => Ok(Durability::Sync),
            "memory" => Ok(Durability::Memory),
            other => {
                let Some(ms) = other.strip_prefix("interval=") else {
                    return Err(format!(
                        "unknown durability {other:?}: expected sync, interval=<ms> or memory"
                    ));
                };
                let ms: u64 = ms.trim_end_matches("ms").parse().map_err(|_| {
                    format!("durability interval {ms:?} is not a whole number of milliseconds")
                })?;
                if !(1..=60_000).contains(&ms) {
                    return Err(format!(
                        "durability interval {ms} ms is out of range: 1 to 60000"
                    ));
                }
                Ok(Durability::Interval(Duration::from_millis(ms)))
            }
        }
    }

    /// True when updates wait for the disk before they are acknowledged.
    pub fn waits(self) -> bool {
        self == Durability::Sync
    }
}

impl fmt::Display for Durability {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Durability::Sync => f.write_str("sync"),
            Durability::Interval(d) => write!(f, "interval={}", d.as_millis()),
            Durability::Memory => f.write_str("memory"),
        }
    }
}

/// Why the backend could not read or write.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum BackendError {
    /// The disk is full (or the database hit its size limit): free space and retry.
    #[error("the session store's disk is full: {0}")]
    Full(String),
    /// Any other I/O or database failure.
    #[error("the session store failed: {0}")]
    Io(String),
    /// A stored session could not be read back (its row is kept; the session is skipped).
    #[error("stored session {id} is unreadable: {reason}")]
    Corrupt {
        /// The session.
        id: String,
        /// What failed.
        reason: String,
    },
    /// The backend has stopped (the server is shutting down).
    #[error("the session store is closed")]
    Closed,
}

/// One write, applied in the order received.
#[derive(Debug, Clone)]
pub enum Write {
    /// A new session (or a new incarnation replacing one): its first snapshot, at seq 0;
    /// any older log of the id is dropped.
    Create {
        /// Session id.
        id: String,
        /// Its incarnation.
        incarnation: u64,
        /// The encoded session.
        snapshot: Vec<u8>,
    },
    /// One change after `seq - 1`.
    Append {
        /// Session id.
        id: String,
        /// Incarnation the change belongs to (ignored if it is no longer stored).
        incarnation: u64,
        /// Position in the session's log, from 1.
        seq: u64,
        /// The encoded change.
        change: Vec<u8>,
    },
    /// The session as of `seq`; the log up to `seq` is dropped.
    Snapshot {
        /// Session id.
        id: String,
        /// Incarnation.
        incarnation: u64,
        /// The last change the snapshot includes.
        seq: u64,
        /// The encoded session.
        snapshot: Vec<u8>,
    },
    /// The session and its log are removed. Writes are applied in the order received, so
    /// a later `Create` of the id stands, and a late write of the deleted incarnation
    /// finds no row and lands nowhere.
    Delete {
        /// Session id.
        id: String,
    },
}

impl Write {
    /// Bytes the write carries (for batch sizing).
    pub fn bytes(&self) -> usize {
        match self {
            Write::Create { snapshot, .. } | Write::Snapshot { snapshot, .. } => snapshot.len(),
            Write::Append { change, .. } => change.len(),
            Write::Delete { .. } => 0,
        }
    }
}

/// A session as stored: where to start and what to replay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stored {
    /// Its incarnation.
    pub incarnation: u64,
    /// The last change the snapshot includes.
    pub snapshot_seq: u64,
    /// The encoded session.
    pub snapshot: Vec<u8>,
    /// Changes after the snapshot, in order: (seq, encoded change).
    pub log: Vec<(u64, Vec<u8>)>,
}

/// Where a write's outcome lands: resolved when the batch holding it is durable (or
/// failed).
pub type Committed = oneshot::Receiver<Result<(), BackendError>>;

/// What the health check and metrics read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BackendState {
    /// The last commit succeeded.
    Ok,
    /// The last group commit failed with this error. Nothing is refused for it: under
    /// `sync` the updates that commit carried were; under `interval` updates are still
    /// acknowledged (held in memory) and written again. Any session's later commit clears it.
    Failing(String),
}

/// What the store reports as it works; the server turns these into metrics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreEvent {
    /// The backend committed (or failed to commit) one batch of queued requests.
    Commit {
        /// Requests in the batch (each an actor's or the store's writes).
        requests: usize,
        /// Bytes written.
        bytes: u64,
        /// Time the transaction took, fsync included.
        took: Duration,
        /// False when the commit failed.
        ok: bool,
    },
    /// A cold session was loaded from disk.
    Loaded {
        /// Time from the request to the session being ready.
        took: Duration,
        /// False when it could not be read.
        ok: bool,
    },
    /// A session left memory for disk.
    Evicted {
        /// `idle` or `memory`.
        reason: &'static str,
    },
}

/// Who hears [`StoreEvent`]s.
pub type Observer = std::sync::Arc<dyn Fn(&StoreEvent) + Send + Sync>;

/// Durable storage of sessions. Reads block (the store calls them off the async
/// runtime); writes are queued and applied in order by the backend's own writer.
pub trait Backend: Send + Sync + fmt::Debug + 'static {
    /// Ids of every stored session, read once at start.
    fn sessions(&self) -> Result<Vec<String>, BackendError>;
    /// The highest incarnation stored (new ones count up from it).
    fn last_incarnation(&self) -> Result<u64, BackendError>;
    /// One session's snapshot and log tail; `None` when it is not stored.
    fn load(&self, id: &str) -> Result<Option<Stored>, BackendError>;
    /// The bytes of one session's stored snapshot, read without reading the snapshot
    /// (so a row far past the limits is refused before it is read); `None` when not known.
    fn snapshot_bytes(&self, _id: &str) -> Option<u64> {
        None
    }
    /// Queues `writes` (applied in order, all or none); the receiver resolves when they
    /// are durable (under `Durability::Interval` too: acknowledging them is the caller's).
    fn write(&self, writes: Vec<Write>) -> Committed;
    /// [`Self::write`] of changes the oldest of which was acknowledged at `since`: under
    /// `Durability::Interval` they are on disk within the interval of that moment, not of
    /// this call (a session's batch waits for the one before it to land).
    fn write_since(&self, writes: Vec<Write>, _since: std::time::Instant) -> Committed {
        self.write(writes)
    }
    /// The backend's state, for health and metrics.
    fn state(&self) -> BackendState;
    /// When writes are acknowledged.
    fn durability(&self) -> Durability;
    /// Bytes the backend's files take on disk (for metrics and the closing report).
    fn disk_bytes(&self) -> u64;
    /// From now on, commits what is queued at once instead of gathering for the interval
    /// (the store is closing: its final writes must land within the shutdown's grace, not
    /// up to an interval later).
    fn hurry(&self) {}
    /// Commits what is queued now rather than at the end of the interval, once: someone
    /// waits for it (a session going cold to free memory, an explicit flush).
    fn expedite(&self) {}
    /// Writes everything queued and stops the writer; later writes fail with `Closed`.
    fn close(&self);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durability_parses_the_three_modes_and_names_bad_values() {
        assert_eq!(Durability::parse("sync"), Ok(Durability::Sync));
        assert_eq!(Durability::parse("memory"), Ok(Durability::Memory));
        assert_eq!(
            Durability::parse("interval=250"),
            Ok(Durability::Interval(Duration::from_millis(250)))
        );
        assert_eq!(
            Durability::parse("interval=250").map(|d| d.to_string()),
            Ok("interval=250".into())
        );
        for bad in [
            "",
            "fast",
            "interval=",
            "interval=-1",
            "interval=0",
            "interval=60001",
        ] {
            let e = Durability::parse(bad).expect_err(bad);
            assert!(
                e.contains("interval") || e.contains("durability"),
                "{bad}: {e}"
            );
        }
    }
}
