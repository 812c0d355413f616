//! In-memory session store: one actor task per session.
//!
//! Each session is owned by exactly one task that runs jobs from a bounded mailbox in
//! arrival order, so updates to one session apply in order without locks, and different
//! sessions run in parallel on all cores. A slow session only fills its own mailbox.
//!
//! The map from id to handle sits behind a std `RwLock`: it is held only to look up,
//! insert or remove a handle (never across an `.await`), so a blocking lock is cheaper
//! than an async one here.
//!
//! The store knows nothing of gRPC; it hands out [`SessionHandle`]s and runs closures over
//! the engine's [`Session`] value. The actor and its handle are in `actor.rs`, with the
//! idle eviction each actor performs on itself.

mod actor;
mod ledger;

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use thiserror::Error;
use tokio::sync::mpsc;

use crate::config::EngineConfig;
use crate::domain::SessionInfo;
use crate::engine::{ByteLimit, Session};
use crate::tokens::TokenCounter;

/// Default mailbox depth per session: enough to pipeline a burst, small enough that a
/// stuck session pushes back on its own clients only.
pub const DEFAULT_MAILBOX: usize = 256;

/// Default `max_session_bytes`: far above any real session (the largest trace we hold
/// is under 4 MiB of JSON), low enough that one runaway host cannot take the process.
pub const DEFAULT_MAX_SESSION_BYTES: u64 = 256 << 20;
/// Default `memory_budget`: what a sidecar container of 3 GiB can give its sessions.
pub const DEFAULT_MEMORY_BUDGET: u64 = 2 << 30;

/// Why the store could not serve a request.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum StoreError {
    /// No session with this id. The host should open (or import) it first.
    #[error("session {0} does not exist; open it first")]
    NotFound(String),
    /// A session with this id exists and the caller asked not to replace it.
    #[error("session {0} already exists")]
    AlreadyExists(String),
    /// The session was deleted while the request was queued. Retrying reopens nothing.
    #[error("session {0} was deleted")]
    Closed(String),
    /// Creating the session would exceed `max_sessions`.
    #[error("max_sessions ({0}) reached: delete sessions or raise --max-sessions")]
    Full(usize),
    /// The imported session alone holds more than `max_session_bytes`.
    #[error(
        "max_session_bytes ({limit} bytes) reached: the session would hold {bytes} bytes; import fewer messages or raise --max-session-bytes"
    )]
    SessionTooLarge {
        /// Bytes the session would hold.
        bytes: u64,
        /// The limit.
        limit: u64,
    },
    /// All sessions together would hold more than `memory_budget`.
    #[error(
        "memory_budget ({budget} bytes) reached: sessions hold {held} bytes and this one needs {bytes}; delete sessions or raise --memory-budget"
    )]
    OverBudget {
        /// Bytes the new session needs.
        bytes: u64,
        /// Bytes all sessions hold now.
        held: u64,
        /// The budget.
        budget: u64,
    },
    /// Bytes in flight (decoded updates, events, prompts) would pass their share of the
    /// budget.
    #[error(
        "memory_budget ({budget} bytes) reached for {what}: {in_flight} bytes are in flight (at most {limit}, 1/8 of the budget) and this needs {bytes}; read your events, wait for acks, or raise --memory-budget"
    )]
    InFlightOverBudget {
        /// What needed the bytes (`events`, `updates`, `compaction prompt`, `import`).
        what: &'static str,
        /// Bytes asked for.
        bytes: u64,
        /// Bytes in flight now.
        in_flight: u64,
        /// The in-flight ceiling.
        limit: u64,
        /// The budget.
        budget: u64,
    },
}

/// What the store holds at most; 0 means no limit.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Limits {
    /// Sessions held.
    pub max_sessions: usize,
    /// Bytes one session holds (messages, parts and their indexes).
    pub max_session_bytes: u64,
    /// Bytes all sessions hold together.
    pub memory_budget: u64,
}

impl Limits {
    /// The byte limit of a session holding `own` bytes while all sessions hold `total`:
    /// whichever of `max_session_bytes` and the rest of the budget binds first.
    pub fn byte_limit(&self, own: u64, total: u64) -> ByteLimit {
        let mut limit = ByteLimit::NONE;
        if self.max_session_bytes > 0 {
            limit = ByteLimit {
                bytes: self.max_session_bytes,
                name: "max_session_bytes",
                value: self.max_session_bytes,
            };
        }
        if self.memory_budget > 0 {
            let room = own.saturating_add(self.memory_budget.saturating_sub(total));
            if room < limit.bytes {
                limit = ByteLimit {
                    bytes: room,
                    name: "memory_budget",
                    value: self.memory_budget,
                };
            }
        }
        limit
    }
}

pub use actor::SessionHandle;
pub use ledger::{IN_FLIGHT_SHARE, Ledger, Reservation};

/// A session that evicted itself after the idle TTL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Evicted {
    /// Its id.
    pub session_id: String,
    /// How long it had received no job.
    pub idle: Duration,
}

/// What the store's actors share with it: the map of handles and the idle policy.
#[derive(Debug, Default)]
struct Shared {
    sessions: RwLock<HashMap<String, SessionHandle>>,
    /// Idle TTL and where evictions are announced (None: sessions are never evicted).
    idle: RwLock<Option<Idle>>,
}

#[derive(Debug)]
struct Idle {
    ttl: Duration,
    announce: mpsc::UnboundedSender<Evicted>,
}

impl Shared {
    /// The idle TTL, while someone listens for evictions.
    fn idle_ttl(&self) -> Option<Duration> {
        let idle = self.idle.read().unwrap_or_else(|e| e.into_inner());
        idle.as_ref()
            .filter(|i| !i.announce.is_closed())
            .map(|i| i.ttl)
    }

    /// Where evictions are announced, when idle eviction is on.
    fn evictions(&self) -> Option<mpsc::UnboundedSender<Evicted>> {
        let idle = self.idle.read().unwrap_or_else(|e| e.into_inner());
        idle.as_ref().map(|i| i.announce.clone())
    }

    // A poisoned lock means a panic while holding it; the map itself is still consistent
    // (every mutation is a single insert/remove), so keep serving.
    fn read(&self) -> std::sync::RwLockReadGuard<'_, HashMap<String, SessionHandle>> {
        self.sessions.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, HashMap<String, SessionHandle>> {
        self.sessions.write().unwrap_or_else(|e| e.into_inner())
    }
}

/// All sessions held by this process.
#[derive(Debug)]
pub struct Store {
    shared: Arc<Shared>,
    config: Arc<EngineConfig>,
    counter: Arc<dyn TokenCounter>,
    mailbox: usize,
    limits: Limits,
    /// Bytes held by sessions and reserved in flight.
    ledger: Arc<Ledger>,
}

impl Store {
    /// An empty store whose sessions use `config` and `counter`.
    pub fn new(config: EngineConfig, counter: Arc<dyn TokenCounter>) -> Store {
        Store {
            shared: Arc::default(),
            config: Arc::new(config),
            counter,
            mailbox: DEFAULT_MAILBOX,
            limits: Limits::default(),
            ledger: Arc::new(Ledger::new(0)),
        }
    }

    /// This store holding at most `max` sessions (0: no limit).
    pub fn with_max_sessions(mut self, max: usize) -> Store {
        self.limits.max_sessions = max;
        self
    }

    /// This store with all of `limits`.
    pub fn with_limits(mut self, limits: Limits) -> Store {
        self.limits = limits;
        self.ledger = Arc::new(Ledger::new(limits.memory_budget));
        self
    }

    /// The limits this store enforces.
    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// Bytes all sessions hold (including sessions just deleted whose queued jobs still
    /// run: their memory is still in use).
    pub fn held_bytes(&self) -> u64 {
        self.ledger.held()
    }

    /// The byte ledger: where the server reserves what it holds in flight.
    pub fn ledger(&self) -> &Arc<Ledger> {
        &self.ledger
    }

    /// Refuses a new session of `bytes` when the budget is spent; `freed` is what a
    /// replaced session gives back.
    fn admit(&self, bytes: u64, freed: u64) -> Result<(), StoreError> {
        let l = self.limits;
        if l.max_session_bytes > 0 && bytes > l.max_session_bytes {
            return Err(StoreError::SessionTooLarge {
                bytes,
                limit: l.max_session_bytes,
            });
        }
        let held = self.ledger.counted().saturating_sub(freed);
        if l.memory_budget > 0 && held.saturating_add(bytes) > l.memory_budget {
            return Err(StoreError::OverBudget {
                bytes,
                held,
                budget: l.memory_budget,
            });
        }
        Ok(())
    }

    /// From now on, a session whose actor receives no job for `ttl` evicts itself, and
    /// each eviction is announced on the returned receiver. Dropping the receiver stops
    /// the evictions (the server drops it when it closes). Sessions already idle start
    /// their clock at their next job. Replaces an earlier call's TTL and receiver.
    pub fn evict_idle_after(&self, ttl: Duration) -> mpsc::UnboundedReceiver<Evicted> {
        // Unbounded: one message per evicted session, and sessions are bounded.
        let (announce, evictions) = mpsc::unbounded_channel();
        *self.shared.idle.write().unwrap_or_else(|e| e.into_inner()) = Some(Idle { ttl, announce });
        evictions
    }

    /// The server-wide engine config.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// The token counter sessions use.
    pub fn counter(&self) -> Arc<dyn TokenCounter> {
        self.counter.clone()
    }

    /// The session's handle, if it exists.
    pub fn get(&self, id: &str) -> Result<SessionHandle, StoreError> {
        self.read()
            .get(id)
            .cloned()
            .ok_or_else(|| StoreError::NotFound(id.to_string()))
    }

    /// Returns the existing session's handle, or creates the session from `info`.
    /// The flag is true when it was created (the caller then has nothing to configure).
    pub fn open(&self, info: SessionInfo) -> Result<(SessionHandle, bool), StoreError> {
        if let Some(h) = self.read().get(&info.id) {
            return Ok((h.clone(), false));
        }
        let mut map = self.write();
        if let Some(h) = map.get(&info.id) {
            return Ok((h.clone(), false));
        }
        if self.limits.max_sessions > 0 && map.len() >= self.limits.max_sessions {
            return Err(StoreError::Full(self.limits.max_sessions));
        }
        let id = info.id.clone();
        let session = Session::new(info, &self.config, self.counter.clone());
        self.admit(session.held_bytes(), 0)?;
        let handle = self.spawn(session);
        map.insert(id, handle.clone());
        Ok((handle, true))
    }

    /// Adds a fully built session (from an import). Fails when the id is taken unless
    /// `replace` is set.
    pub fn insert(&self, session: Session, replace: bool) -> Result<SessionHandle, StoreError> {
        let id = session.info().id.clone();
        let mut map = self.write();
        if map.contains_key(&id) && !replace {
            return Err(StoreError::AlreadyExists(id));
        }
        let max = self.limits.max_sessions;
        if !map.contains_key(&id) && max > 0 && map.len() >= max {
            return Err(StoreError::Full(max));
        }
        let freed = map.get(&id).map_or(0, SessionHandle::held_bytes);
        self.admit(session.held_bytes(), freed)?;
        let handle = self.spawn(session);
        map.insert(id, handle.clone());
        Ok(handle)
    }

    /// Forgets a session. Jobs already queued still run; its actor then stops.
    pub fn remove(&self, id: &str) -> bool {
        self.write().remove(id).is_some()
    }

    /// Handles of every session, in no particular order.
    pub fn list(&self) -> Vec<SessionHandle> {
        self.read().values().cloned().collect()
    }

    /// Number of sessions held.
    pub fn len(&self) -> usize {
        self.read().len()
    }

    /// True when no session is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn spawn(&self, session: Session) -> SessionHandle {
        actor::spawn(
            session,
            &self.shared,
            self.config.clone(),
            self.mailbox,
            self.limits,
            self.ledger.clone(),
        )
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, HashMap<String, SessionHandle>> {
        self.shared.read()
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, HashMap<String, SessionHandle>> {
        self.shared.write()
    }
}

#[cfg(test)]
mod tests;
