//! The session store: one actor task per session, optionally backed by durable storage.
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
//! the engine's [`Session`] value through a [`Tx`], which logs every change. The actor and
//! its handle are in `actor.rs`, with the idle eviction each actor performs on itself.
//!
//! With a [`Backend`] (`backend.rs`; SQLite in `sqlite.rs`), sessions are durable: each
//! actor writes its changes (and now and then a snapshot), and a session evicted for
//! idleness or memory pressure stays on disk, *cold*, and is loaded back
//! (`restore.rs`) on its next use. The memory budget then bounds the hot set, not the
//! number of sessions.

mod actor;
mod backend;
mod deleting;
mod ledger;
mod locked;
mod reading;
mod restore;
mod sqlite;
mod tx;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use thiserror::Error;
use tokio::sync::{Notify, mpsc, oneshot};
use tokio::time::Instant;

use crate::config::EngineConfig;
use crate::domain::{FastMap, FastSet, SessionInfo};
use crate::engine::Resume;
use crate::engine::calibration::{Factors, ModelPriors};
use crate::engine::encode_session;
use crate::engine::{ByteLimit, Session};

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
    /// The session's actor closed while the request was queued: the session was deleted,
    /// or (durable store) dropped from memory after a failed write, when it stays on disk
    /// and a retry loads it back. The request was not applied.
    #[error(
        "session {0} closed before the request ran (deleted, or dropped from memory after a failed write); nothing was applied"
    )]
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
    /// A stored session's snapshot alone is so far past what the session may hold once
    /// loaded (a limit lowered since it was written, or a damaged row) that it is not
    /// read at all.
    #[error(
        "{name} ({limit} bytes) reached: the stored session's snapshot alone is {bytes} bytes on disk; raise --{flag} to load it",
        flag = name.replace('_', "-")
    )]
    TooLargeToLoad {
        /// Bytes of the stored snapshot.
        bytes: u64,
        /// The limit that binds (`max_session_bytes` or `memory_budget`).
        name: &'static str,
        /// Its value.
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
    /// The durable store could not read or write (disk full, I/O error, unreadable row).
    #[error("{0}")]
    Storage(BackendError),
    /// Reading a stored session back panicked: a bug in compactd, not the disk or the
    /// rows known damaged (kept as they are, for a build that reads them).
    #[error(
        "session {0} could not be read back: compactd failed while decoding it (a bug; the stored session is kept as it is)"
    )]
    LoadPanicked(String),
    /// The store is closing (the server is shutting down) and takes no more changes: what
    /// it acknowledged is being written, and a change taken now might not be.
    #[error(
        "the session store is closing (the server is shutting down); nothing was applied: send it again"
    )]
    Closing,
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

/// How many times larger than the held bytes a stored snapshot can be: JSON escaping
/// writes a control character in six bytes (the ten shared traces' snapshots are 0.56 to
/// 0.98 of the bytes their sessions hold). A snapshot past this many times the limit is
/// refused before it is read. Only the snapshot is weighed: the log after it (at most
/// the snapshot's size or 4 MiB) may repeat a part many times and says little about
/// what the session holds.
pub const LOAD_EXPANSION: u64 = 6;

/// Cold sessions read and decoded from disk at once. A load holds the snapshot's text and
/// the session decoded from it outside the budget until the budget admits the session
/// (and sends others cold to make room): every session's host reconnecting after a
/// restart loaded them all side by side (ten 50 MB sessions: about 1 GB at once, past a
/// pod's limit). The admission itself (evicting others, perhaps waiting on their writes)
/// runs after the turn is given back.
pub const MAX_CONCURRENT_LOADS: usize = 2;

/// Why a stored session was not read back.
enum LoadError {
    /// Its snapshot alone is past [`LOAD_EXPANSION`] times the binding limit.
    TooLarge {
        bytes: u64,
        name: &'static str,
        limit: u64,
    },
    Backend(BackendError),
    /// Reading or decoding it panicked (a bug: its rows are kept as they are).
    Panicked,
}

impl From<BackendError> for LoadError {
    fn from(e: BackendError) -> Self {
        LoadError::Backend(e)
    }
}

impl Limits {
    /// The largest document one import may send, and the limit that says so: half the
    /// in-flight share of `memory_budget` (while it is parsed a document is held twice,
    /// its text and what it becomes, so one import never takes more than the share), and
    /// [`LOAD_EXPANSION`] times `max_session_bytes` (a larger one cannot become a session
    /// within it); none without either.
    pub fn import_limit(&self) -> ByteLimit {
        let mut limit = ByteLimit::NONE;
        if self.max_session_bytes > 0 {
            limit = ByteLimit {
                bytes: self.max_session_bytes.saturating_mul(LOAD_EXPANSION),
                name: "max_session_bytes",
                value: self.max_session_bytes,
            };
        }
        if self.memory_budget > 0 {
            let half_share = self.memory_budget / IN_FLIGHT_SHARE / 2;
            if half_share < limit.bytes {
                limit = ByteLimit {
                    bytes: half_share,
                    name: "memory_budget",
                    value: self.memory_budget,
                };
            }
        }
        limit
    }

    /// The smaller of `max_session_bytes` and `memory_budget` (0: none), which a session
    /// loaded from disk must fit, with its name; `None` without either.
    fn load_ceiling(&self) -> Option<(&'static str, u64)> {
        [
            ("max_session_bytes", self.max_session_bytes),
            ("memory_budget", self.memory_budget),
        ]
        .into_iter()
        .filter(|&(_, v)| v > 0)
        .min_by_key(|&(_, v)| v)
    }

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
pub use backend::{
    Backend, BackendError, BackendState, Durability, Observer, StoreEvent, Stored, Write,
};
pub use ledger::{IN_FLIGHT_SHARE, Ledger, Reservation};
pub use sqlite::{DB_FILE, Sqlite};
pub use tx::Tx;

/// A session that left memory: evicted after the idle TTL, or for memory pressure.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Evicted {
    /// Its id.
    pub session_id: String,
    /// How long it had received no job.
    pub idle: Duration,
    /// `idle` or `memory`.
    pub reason: &'static str,
    /// True when it stays on disk and is loaded back on its next use.
    pub cold: bool,
}

/// Sessions by id: in memory (with their actor), or only on disk.
#[derive(Debug, Default)]
struct Map {
    hot: FastMap<String, SessionHandle>,
    cold: FastSet<String>,
    /// Of the cold sessions this process sent cold, the incarnation each was stored under
    /// and what makes it the same value when loaded back as that incarnation
    /// ([`Resume`]: its [`Generation`](crate::engine::Generation), so a
    /// compaction planned before the eviction still commits; and, bounded, the host's
    /// edits, so one the host changed a summarized message of meanwhile does not).
    resume: FastMap<String, (u64, Resume)>,
    /// Ids deleted under `interval` whose delete is not known written, each with the
    /// ticket of the task that writes it (`deleting.rs`).
    deleting: FastMap<String, u64>,
    /// Ids being read from disk, each true once the id was deleted or created again
    /// since the read began: the copy read is stale (`reading.rs`).
    reading: FastMap<String, bool>,
}

impl Map {
    /// The id was deleted or created again: a read of it in flight is stale.
    fn overtake_reading(&mut self, id: &str) {
        if let Some(stale) = self.reading.get_mut(id) {
            *stale = true;
        }
    }

    /// Whether the read of `id` in flight was overtaken (or is not registered).
    fn read_is_stale(&self, id: &str) -> bool {
        self.reading.get(id).copied().unwrap_or(true)
    }

    /// What a stale read of `id` answers instead: the session the id names now (read
    /// again when it is cold, as after a re-creation sent cold), or none.
    fn instead_of_stale(&self, id: &str) -> Result<Admitted, StoreError> {
        match self.hot.get(id) {
            Some(h) => Ok(Admitted::Handle(h.clone())),
            None if self.cold.contains(id) => Ok(Admitted::ReadAgain),
            None => Err(StoreError::NotFound(id.to_string())),
        }
    }
}

/// What a load's admission found.
enum Admitted {
    /// The session the id names, hot.
    Handle(SessionHandle),
    /// The copy read was stale and the id is cold again: read it again.
    ReadAgain,
}

/// Reads of one id a load makes before it gives up, each overtaken by the id's deletion
/// or re-creation (and its eviction) while it ran.
const MAX_READS: usize = 4;

/// What the store's actors share with it: the map of handles and the idle policy.
#[derive(Default)]
struct Shared {
    sessions: RwLock<Map>,
    /// Idle TTL and where evictions are announced (None: sessions are never evicted).
    idle: RwLock<Option<Idle>>,
    /// Who hears the store's events (metrics).
    observer: RwLock<Option<Observer>>,
    /// Raised by an actor when the budget is nearly spent; the evictor listens.
    pressure: Arc<Notify>,
    /// Notified at the end of each pass of the evictor (actors waiting for room).
    passes: Arc<Notify>,
    evictor: AtomicBool,
    /// What sessions of each model learned about their token estimates: a new session
    /// of the model starts from it.
    priors: Mutex<ModelPriors>,
    /// Raised (under the map lock) when [`Store::close`] begins: from then on no job is
    /// queued and no session is created, loaded or deleted, so nothing is acknowledged
    /// that the close's final writes do not carry. Each actor holds it too.
    closing: Arc<AtomicBool>,
    /// Reads of sessions from disk under way at once: loads, and an actor's reload after
    /// a commit failed under `sync`.
    loads: LoadTurns,
}

/// Turns for reading sessions from disk, at most [`MAX_CONCURRENT_LOADS`] at once: each
/// read holds its snapshot's text and the session decoded from it before anything
/// counts them. Reloads after failed commits take them too: a full disk fails every
/// session with a batch in flight at once, and each reload holds a second copy of its
/// session beside the one it replaces.
struct LoadTurns(Arc<tokio::sync::Semaphore>);

impl Default for LoadTurns {
    fn default() -> Self {
        LoadTurns(Arc::new(tokio::sync::Semaphore::new(MAX_CONCURRENT_LOADS)))
    }
}

impl LoadTurns {
    /// Waits for a turn (None only if the semaphore were closed, which it never is).
    async fn take(&self) -> Option<tokio::sync::OwnedSemaphorePermit> {
        self.0.clone().acquire_owned().await.ok()
    }
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("sessions", &self.sessions)
            .field("idle", &self.idle)
            .finish_non_exhaustive()
    }
}

#[derive(Debug)]
struct Idle {
    ttl: Duration,
    announce: mpsc::UnboundedSender<Evicted>,
}

impl Shared {
    /// The per-model calibration priors (a poisoned lock still holds valid factors).
    fn priors(&self) -> std::sync::MutexGuard<'_, ModelPriors> {
        self.priors.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The prior `session` is to start from, when it is not the one it has: what
    /// sessions of its model (and tokenizer) taught the store. The one place that decides
    /// it, for a new or imported session (set before its first snapshot) and for one a
    /// `Configure` gave another model (logged, `Locked::run`).
    pub(super) fn prior_for(&self, session: &Session) -> Option<Factors> {
        let key = session.prior_key()?;
        let prior = self.priors().prior(&key);
        (prior != session.calibration().prior()).then_some(prior)
    }

    /// Starts a session not yet written from its model's prior ([`Self::prior_for`]):
    /// its first snapshot, the `Create`, then holds it.
    fn start_from_prior(&self, session: &mut Session) {
        if let Some(prior) = self.prior_for(session) {
            session.set_calibration_prior(prior);
        }
    }

    /// Takes what a session learned about its model's token estimates.
    pub(super) fn learned(&self, key: &str, c: &crate::engine::calibration::Calibration) {
        self.priors().learned(key, c);
    }

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

    /// Tells the observer, if any.
    fn observe(&self, event: &StoreEvent) {
        let observer = self.observer.read().unwrap_or_else(|e| e.into_inner());
        if let Some(o) = observer.as_ref() {
            o(event);
        }
    }

    // A poisoned lock means a panic while holding it; the map itself is still consistent
    // (every mutation is a single insert/remove), so keep serving.
    fn read(&self) -> std::sync::RwLockReadGuard<'_, Map> {
        self.sessions.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Map> {
        self.sessions.write().unwrap_or_else(|e| e.into_inner())
    }
}

/// All sessions held by this process.
#[derive(Debug)]
pub struct Store {
    shared: Arc<Shared>,
    config: Arc<EngineConfig>,
    mailbox: usize,
    limits: Limits,
    /// Bytes held by sessions and reserved in flight.
    ledger: Arc<Ledger>,
    /// Where sessions persist (None: memory only).
    backend: Option<Arc<dyn Backend>>,
    /// The last incarnation handed out (each created session gets the next).
    incarnations: AtomicU64,
    /// One lock per session being loaded from disk, so it is loaded once.
    loading: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    /// The store's clock for "least recently used".
    clock: Instant,
}

/// Past this share of the budget an actor asks the evictor for room (per mille).
const HIGH_WATER: u64 = 900;
/// The evictor makes room down to this share of the budget (per mille).
const LOW_WATER: u64 = 750;

impl Store {
    /// An empty store whose sessions use `config`.
    pub fn new(config: EngineConfig) -> Store {
        Store {
            shared: Arc::default(),
            config: Arc::new(config),
            mailbox: DEFAULT_MAILBOX,
            limits: Limits::default(),
            ledger: Arc::new(Ledger::new(0)),
            backend: None,
            incarnations: AtomicU64::new(0),
            loading: Mutex::default(),
            clock: Instant::now(),
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

    /// This store persisting to `backend`: every session it holds is known (cold) and
    /// loaded on first use. Reads the list of ids, so it blocks briefly.
    pub fn with_backend(mut self, backend: Arc<dyn Backend>) -> Result<Store, BackendError> {
        let ids = backend.sessions()?;
        self.incarnations = AtomicU64::new(backend.last_incarnation()?);
        self.shared.write().cold = ids.into_iter().collect();
        self.backend = Some(backend);
        Ok(self)
    }

    /// Who hears the store's events (commits, loads, evictions).
    pub fn observe_with(&self, observer: Observer) {
        *self
            .shared
            .observer
            .write()
            .unwrap_or_else(|e| e.into_inner()) = Some(observer);
    }

    /// The durable backend, if any.
    pub fn backend(&self) -> Option<&Arc<dyn Backend>> {
        self.backend.as_ref()
    }

    /// When updates are acknowledged relative to the disk.
    pub fn durability(&self) -> Durability {
        self.backend
            .as_ref()
            .map_or(Durability::Memory, |b| b.durability())
    }

    /// True once [`Store::close`] has begun (a durable store only): changes are refused.
    fn is_closing(&self) -> bool {
        self.shared.closing.load(Ordering::Acquire)
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

    /// [`Store::admit`], first sending cold the least recently used sessions when a
    /// durable store is over budget.
    /// `ahead`: bytes of the session counted as held already ([`ledger::HeldAhead`]).
    async fn admit_evicting(&self, bytes: u64, freed: u64, ahead: u64) -> Result<(), StoreError> {
        let freed_or_ahead = freed.saturating_add(ahead);
        match self.admit(bytes, freed_or_ahead) {
            Err(StoreError::OverBudget { .. }) if self.backend.is_some() => {
                // Down to where admitting `bytes` stays under the low-water mark, the
                // bytes counted ahead among them. Not what a replaced session frees: the
                // evictor may send that very session cold.
                let target = watermark(self.limits.memory_budget, LOW_WATER)
                    .saturating_add(ahead)
                    .saturating_sub(bytes);
                make_room(&self.shared, &self.ledger, target, false).await;
                self.admit(bytes, freed_or_ahead)
            }
            other => other,
        }
    }

    /// From now on, a session whose actor receives no job for `ttl` evicts itself, and
    /// each eviction is announced on the returned receiver. Dropping the receiver stops
    /// idle evictions (the server drops it when it closes); memory pressure still sends
    /// durable sessions cold.
    /// Sessions already idle start their clock at their next job. Replaces an earlier
    /// call's TTL and receiver.
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

    /// The session's handle, loading it from disk when it is cold.
    pub async fn get(&self, id: &str) -> Result<SessionHandle, StoreError> {
        if let Some(h) = self.read().hot.get(id) {
            return Ok(h.clone());
        }
        if self.backend.is_none() || !self.read().cold.contains(id) {
            return Err(StoreError::NotFound(id.to_string()));
        }
        self.load(id).await
    }

    /// The session's handle when it is in memory; never loads a cold one. For work that
    /// only helps (a stream counting an update's texts ahead of its turn).
    pub fn hot(&self, id: &str) -> Option<SessionHandle> {
        self.read().hot.get(id).cloned()
    }

    /// True when the store holds `id`, in memory or on disk; never loads it. For a caller
    /// that only needs to know the session exists (a `Subscribe` naming it).
    pub fn holds(&self, id: &str) -> bool {
        let map = self.read();
        map.hot.contains_key(id) || map.cold.contains(id)
    }

    /// Loads a cold session (once, however many callers ask at the same time).
    async fn load(&self, id: &str) -> Result<SessionHandle, StoreError> {
        let gate = {
            let mut loading = self.loading.lock().unwrap_or_else(|e| e.into_inner());
            loading.entry(id.to_string()).or_default().clone()
        };
        let _one = gate.lock().await;
        let result = self.load_locked(id).await;
        // The lock stays while another caller holds it (one waiting on this load): a
        // caller coming now must wait behind that one, not load beside it. Clones are
        // made under `loading` only, so the count read under it is exact.
        let mut loading = self.loading.lock().unwrap_or_else(|e| e.into_inner());
        let ours = loading.get(id).is_some_and(|g| Arc::ptr_eq(g, &gate));
        if ours && Arc::strong_count(&gate) <= 2 {
            loading.remove(id);
        }
        result
    }

    async fn load_locked(&self, id: &str) -> Result<SessionHandle, StoreError> {
        for _ in 0..MAX_READS {
            match self.read_once(id).await? {
                Admitted::Handle(h) => return Ok(h),
                Admitted::ReadAgain => continue,
            }
        }
        Err(StoreError::Storage(BackendError::Io(format!(
            "session {id} was deleted or created again during each of {MAX_READS} reads \
             from disk; try again"
        ))))
    }

    /// One read of a cold session from disk, and its admission.
    async fn read_once(&self, id: &str) -> Result<Admitted, StoreError> {
        if let Some(h) = self.read().hot.get(id) {
            return Ok(Admitted::Handle(h.clone()));
        }
        if self.is_closing() {
            return Err(StoreError::Closing);
        }
        let Some(backend) = self.backend.clone() else {
            return Err(StoreError::NotFound(id.to_string()));
        };
        if !self.read().cold.contains(id) {
            return Err(StoreError::NotFound(id.to_string()));
        }
        // Held by the read and decode themselves (never closed): a caller that gives up
        // while they run (a client's deadline) does not free the turn for another load
        // beside the one still decoding.
        let turn = self.shared.loads.take().await;
        let _reading = reading::Reading::start(&self.shared, id);
        let began = Instant::now();
        let (config, key) = (self.config.clone(), id.to_string());
        let ceiling = self.limits.load_ceiling();
        let loaded = tokio::task::spawn_blocking(move || {
            let _turn = turn;
            if let Some((name, limit)) = ceiling
                && let Some(bytes) = backend.snapshot_bytes(&key)
                && bytes / LOAD_EXPANSION > limit
            {
                return Err(LoadError::TooLarge { bytes, name, limit });
            }
            let stored = backend.load(&key)?;
            Ok(stored
                .map(|s| restore::restore(&key, s, &config))
                .transpose()?)
        })
        .await
        .map_err(|e| match e.is_panic() {
            // Not the disk unavailable (a retry would panic again), nor the rows known
            // damaged (a host might replace a session a fixed build reads): a bug.
            true => LoadError::Panicked,
            false => BackendError::Io(format!("loading session {id}: {e}")).into(),
        })
        .and_then(|r| r);
        let outcome = match loaded {
            Ok(Some(r)) => self.admit_loaded(id, r).await,
            Err(LoadError::TooLarge { bytes, name, limit }) => {
                tracing::error!(
                    session_id = id,
                    bytes,
                    limit_name = name,
                    limit,
                    "the stored session is far too large to load; not read"
                );
                Err(StoreError::TooLargeToLoad { bytes, name, limit })
            }
            Ok(None) => {
                let mut map = self.write();
                if map.read_is_stale(id) {
                    // Deleted while it was read, and maybe created again since (and sent
                    // cold): that session is not gone.
                    map.instead_of_stale(id)
                } else {
                    map.cold.remove(id);
                    map.resume.remove(id);
                    Err(StoreError::NotFound(id.to_string()))
                }
            }
            Err(LoadError::Backend(e)) => {
                tracing::error!(session_id = id, error = %e, "cannot load the session from disk");
                Err(StoreError::Storage(e))
            }
            Err(LoadError::Panicked) => {
                tracing::error!(
                    session_id = id,
                    "loading the session from disk panicked; its rows are kept"
                );
                Err(StoreError::LoadPanicked(id.to_string()))
            }
        };
        self.shared.observe(&StoreEvent::Loaded {
            took: began.elapsed(),
            ok: outcome.is_ok(),
        });
        outcome
    }

    async fn admit_loaded(&self, id: &str, r: restore::Restored) -> Result<Admitted, StoreError> {
        // Counted from now (the read gave its turn back): loads waiting here for room
        // see each other's sessions, rather than each passing against the same figure
        // and all landing past the budget.
        let ahead = ledger::HeldAhead::new(&self.ledger, r.session.held_bytes());
        self.admit_evicting(ahead.bytes(), 0, ahead.bytes()).await?;
        let durable = self.durable(r.incarnation, r.seq, r.log_bytes, r.snapshot_bytes);
        let mut map = self.write();
        if self.is_closing() {
            // The close has listed the sessions it writes: this one would not be among them.
            return Err(StoreError::Closing);
        }
        if map.read_is_stale(id) {
            // Deleted or created again while it was read: the copy read is not the
            // session the id names now (which may be cold again: read that one).
            return map.instead_of_stale(id);
        }
        let resume = map.resume.remove(id);
        if !map.cold.remove(id) {
            // Deleted (or replaced) while it was being read.
            return match map.hot.get(id) {
                Some(h) => Ok(Admitted::Handle(h.clone())),
                None => Err(StoreError::NotFound(id.to_string())),
            };
        }
        let mut session = r.session;
        if let Some((incarnation, resume)) = resume
            && incarnation == r.incarnation
        {
            session.resume(resume);
        }
        // The session counts its own bytes from its spawn.
        drop(ahead);
        let handle = self.spawn(session, durable);
        map.hot.insert(id.to_string(), handle.clone());
        Ok(Admitted::Handle(handle))
    }

    fn durable(
        &self,
        incarnation: u64,
        seq: u64,
        log_bytes: u64,
        snapshot_bytes: u64,
    ) -> Option<actor::Durable> {
        self.backend.as_ref().map(|b| actor::Durable {
            backend: b.clone(),
            incarnation,
            seq,
            log_bytes,
            snapshot_bytes,
            created: None,
        })
    }

    /// Returns the existing session's handle (loading it when cold), or creates the
    /// session from `info`. The flag is true when it was created (the caller then has
    /// nothing to configure). A created session is durable before this returns under
    /// `Durability::Sync`.
    pub async fn open(&self, info: SessionInfo) -> Result<(SessionHandle, bool), StoreError> {
        match self.get(&info.id).await {
            Ok(h) => return Ok((h, false)),
            Err(StoreError::NotFound(_)) => {}
            Err(e) => return Err(e),
        }
        let mut session = Session::new(info, &self.config);
        self.shared.start_from_prior(&mut session);
        self.admit_evicting(session.held_bytes(), 0, 0).await?;
        let id = session.info().id.clone();
        let created = {
            let mut map = self.write();
            if let Some(h) = map.hot.get(&id) {
                return Ok((h.clone(), false));
            }
            if map.cold.contains(&id) {
                // Sent cold since the lookup above: load it like any other.
                None
            } else {
                let max = self.limits.max_sessions;
                if max > 0 && map.hot.len().saturating_add(map.cold.len()) >= max {
                    return Err(StoreError::Full(max));
                }
                let snapshot = self.backend.is_some().then(|| encode_session(&session));
                Some(self.place(&mut map, session, snapshot)?)
            }
        };
        let Some((handle, written)) = created else {
            return Box::pin(self.get(&id)).await.map(|h| (h, false));
        };
        written_or_not(written).await?;
        Ok((handle, true))
    }

    /// Puts a new session (or a new incarnation of an id) in the map, hot, and queues its
    /// first snapshot (`snapshot`, encoded by the caller; None without a backend) as its
    /// actor's first batch in flight: any job queued on it waits for that write's result.
    /// Called under the map lock, so the `Create` is queued before any write of its actor.
    /// Under `Durability::Sync`, returns where the write's result lands: the caller
    /// answers with it, and if it failed the actor has put back what the map held before
    /// (nothing was acknowledged). Under `Interval` the session is acknowledged at once:
    /// if the write fails, its actor writes the session whole again. Refused once the
    /// store is closing (checked under the map lock, where [`Store::close`] raises it).
    fn place(
        &self,
        map: &mut Map,
        session: Session,
        snapshot: Option<Vec<u8>>,
    ) -> Result<(SessionHandle, Option<Written>), StoreError> {
        if self.is_closing() {
            return Err(StoreError::Closing);
        }
        let id = session.info().id.clone();
        let incarnation = self.next_incarnation()?;
        let mut written = None;
        // The `Create` is a whole snapshot: the log may grow to its size before the next
        // one is due, as after any snapshot.
        let snapshot_bytes = snapshot.as_ref().map_or(0, |s| s.len() as u64);
        let created = match (&self.backend, snapshot) {
            (Some(b), Some(snapshot)) => {
                let committed = b.write(vec![Write::Create {
                    id: id.clone(),
                    incarnation,
                    snapshot,
                }]);
                let (mut creator, mut replaced) = (None, None);
                if self.durability().waits() {
                    let (tx, rx) = oneshot::channel();
                    written = Some(rx);
                    let tell: actor::Deliver = Box::new(move |r| {
                        let _ = tx.send(r);
                    });
                    creator = Some(tell);
                    replaced = match map.hot.get(&id) {
                        Some(h) => Some(actor::Previous::Hot(h.clone())),
                        None => map.cold.contains(&id).then_some(actor::Previous::Cold),
                    };
                }
                Some(actor::Created {
                    committed,
                    creator,
                    replaced,
                })
            }
            _ => None,
        };
        let durable = self
            .durable(incarnation, 0, 0, snapshot_bytes)
            .map(|d| actor::Durable { created, ..d });
        let handle = self.spawn(session, durable);
        map.cold.remove(&id);
        map.resume.remove(&id);
        map.overtake_reading(&id);
        map.hot.insert(id, handle.clone());
        Ok((handle, written))
    }

    /// The incarnation of the next session created (each gets one above the last).
    fn next_incarnation(&self) -> Result<u64, StoreError> {
        self.incarnations
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |last| {
                last.checked_add(1).filter(|&next| next <= MAX_INCARNATION)
            })
            .map(|last| last.saturating_add(1))
            .map_err(|last| {
                StoreError::Storage(BackendError::Io(format!(
                    "no incarnation left: the store's last is {last} (at most {MAX_INCARNATION})"
                )))
            })
    }

    /// Adds a fully built session (from an import), started from its model's prior as
    /// an opened one is. Fails when the id is taken (in memory or on disk) unless
    /// `replace` is set.
    pub async fn insert(
        &self,
        mut session: Session,
        replace: bool,
    ) -> Result<SessionHandle, StoreError> {
        self.shared.start_from_prior(&mut session);
        let id = session.info().id.clone();
        let freed = {
            let map = self.read();
            let taken = map.hot.contains_key(&id) || map.cold.contains(&id);
            if taken && !replace {
                return Err(StoreError::AlreadyExists(id));
            }
            map.hot.get(&id).map_or(0, SessionHandle::held_bytes)
        };
        self.admit_evicting(session.held_bytes(), freed, 0).await?;
        // The snapshot of a large import is real work: off the async workers.
        let (session, snapshot) = match &self.backend {
            Some(_) => tokio::task::spawn_blocking(move || {
                let snapshot = encode_session(&session);
                (session, Some(snapshot))
            })
            .await
            .map_err(|e| StoreError::Storage(BackendError::Io(format!("encoding {id}: {e}"))))?,
            None => (session, None),
        };
        let (handle, written) = loop {
            let pending = {
                let mut map = self.write();
                let taken = map.hot.contains_key(&id) || map.cold.contains(&id);
                if taken && !replace {
                    return Err(StoreError::AlreadyExists(id));
                }
                let max = self.limits.max_sessions;
                if !taken && max > 0 && map.hot.len().saturating_add(map.cold.len()) >= max {
                    return Err(StoreError::Full(max));
                }
                match map.hot.get(&id) {
                    // Under `Sync` a replacement waits until what it replaces is written
                    // (or taken back out), so a failed one puts back what the disk holds.
                    Some(h) if self.durability().waits() && h.is_creating() => h.clone(),
                    _ => break self.place(&mut map, session, snapshot)?,
                }
            };
            // Its result is not ours: only that it is known.
            let _ = pending.flush().await;
        };
        written_or_not(written).await?;
        Ok(handle)
    }

    /// Forgets a session, in memory and on disk (durable before this returns under
    /// `Durability::Sync`). Jobs already queued still run; its actor then stops. False
    /// when there was no such session. Under `Sync` a delete the disk refused puts the
    /// session back as it was (unless its id was taken meanwhile) and is an error: the
    /// session still exists, in memory and after a restart alike. Refused once the store
    /// is closing.
    pub async fn remove(&self, id: &str) -> Result<bool, StoreError> {
        let (removed, committed, ticket) = {
            let mut map = self.write();
            if self.is_closing() {
                // Under `interval` it would be acknowledged and never written.
                return Err(StoreError::Closing);
            }
            let removed = Removed {
                hot: map.hot.remove(id),
                cold: map.cold.remove(id),
                resume: map.resume.remove(id),
            };
            if removed.hot.is_none() && !removed.cold {
                return Ok(false);
            }
            map.overtake_reading(id);
            let committed = self
                .backend
                .as_ref()
                .map(|b| b.write(vec![Write::Delete { id: id.to_string() }]));
            // Under `interval` it is acknowledged before it is written.
            let ticket = (committed.is_some() && !self.durability().waits())
                .then(|| deleting::ticket(&mut map, id));
            (removed, committed, ticket)
        };
        match (committed, &self.backend) {
            (Some(rx), _) if self.durability().waits() => {
                // The removed handle is held until then: its actor lives on, to be put back.
                // On a task of its own, so a caller that goes away (a deadline, a dropped
                // connection) does not leave the session out of the map and on disk.
                let (shared, owned) = (self.shared.clone(), id.to_string());
                let settled = tokio::spawn(async move {
                    let result = rx.await.unwrap_or(Err(BackendError::Closed));
                    if result.is_err() {
                        // A session created under the id meanwhile, its first write still
                        // in flight, may be refused too: then the id is free again, and
                        // what the delete took out must come back (else the session on
                        // disk is out of reach, and the next open overwrites it).
                        while let Some(creating) = creating(&shared, &owned) {
                            let _ = creating.flush().await;
                        }
                        put_back(&shared, &owned, removed);
                    }
                    result
                });
                let result = settled.await.unwrap_or(Err(BackendError::Closed));
                result.map_err(StoreError::Storage)?;
            }
            // Acknowledged now: written again until it lands (or the id is taken again).
            (Some(rx), Some(backend)) => {
                if let Some(ticket) = ticket {
                    deleting::follow(&self.shared, backend, id, ticket, rx);
                }
            }
            _ => {}
        }
        Ok(true)
    }

    /// Handles of every session in memory, in no particular order.
    pub fn list(&self) -> Vec<SessionHandle> {
        self.read().hot.values().cloned().collect()
    }

    /// The sessions in memory and the ids of those only on disk, read at one moment: a
    /// session sent cold or loaded meanwhile is in exactly one of them (a listing).
    pub fn listing(&self) -> (Vec<SessionHandle>, Vec<String>) {
        let map = self.read();
        (
            map.hot.values().cloned().collect(),
            map.cold.iter().cloned().collect(),
        )
    }

    /// Ids of the sessions only on disk, in no particular order.
    pub fn cold_ids(&self) -> Vec<String> {
        self.read().cold.iter().cloned().collect()
    }

    /// Number of sessions, in memory and on disk.
    pub fn len(&self) -> usize {
        let map = self.read();
        map.hot.len().saturating_add(map.cold.len())
    }

    /// Number of sessions in memory.
    pub fn hot_len(&self) -> usize {
        self.read().hot.len()
    }

    /// True when no session is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Waits until every change of every session in memory is durable (shutdown under
    /// `Durability::Interval`), then stops the backend's writer. From its start the store
    /// refuses (with [`StoreError::Closing`]) every job and every new, loaded or deleted
    /// session: connections still open may still send, and what it acknowledged then
    /// would never be written.
    pub async fn close(&self) {
        let Some(backend) = &self.backend else {
            return;
        };
        {
            // Under the map lock, as sessions are created, loaded and deleted: each is
            // either in the list below (or in `deleting`) or refused.
            let _map = self.write();
            self.shared.closing.store(true, Ordering::Release);
        }
        // The final writes land now, not up to an interval from now (past the grace
        // Kubernetes gives a stopping pod: 30 s by default, against intervals up to 60 s).
        backend.hurry();
        for h in self.list() {
            if let Err(e) = h.flush().await {
                tracing::error!(session_id = h.id(), error = %e, "session not written at shutdown");
            }
        }
        deleting::write_pending(&self.shared, backend).await;
        let backend = backend.clone();
        let _ = tokio::task::spawn_blocking(move || backend.close()).await;
    }

    fn spawn(&self, session: Session, durable: Option<actor::Durable>) -> SessionHandle {
        actor::spawn(
            actor::Start {
                session,
                config: self.config.clone(),
                mailbox: self.mailbox,
                limits: self.limits,
                ledger: self.ledger.clone(),
                durable,
                clock: self.clock,
            },
            &self.shared,
        )
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Map> {
        self.shared.read()
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Map> {
        self.shared.write()
    }
}

/// Where a new session's first write's result lands under `Durability::Sync`.
type Written = oneshot::Receiver<Result<(), StoreError>>;

/// The largest incarnation a session may get (backends store it as a signed 64-bit
/// integer).
const MAX_INCARNATION: u64 = i64::MAX as u64;

/// Waits for a new session's first write under `Durability::Sync` (None: nothing to
/// wait for).
async fn written_or_not(written: Option<Written>) -> Result<(), StoreError> {
    match written {
        Some(rx) => rx
            .await
            .unwrap_or(Err(StoreError::Storage(BackendError::Closed))),
        None => Ok(()),
    }
}

/// `per_mille` of `budget`.
fn watermark(budget: u64, per_mille: u64) -> u64 {
    budget / 1000 * per_mille
}

/// Sends the least recently used sessions cold until the store counts at most `target`
/// bytes (or nothing more can go). With `spare_newest`, the most recently used session
/// stays: after its own job, sending it cold frees room for no one, and its next update
/// would load it whole again.
async fn make_room(shared: &Shared, ledger: &Ledger, target: u64, spare_newest: bool) {
    if ledger.counted() <= target {
        return;
    }
    let mut handles: Vec<SessionHandle> = shared.read().hot.values().cloned().collect();
    handles.sort_by_key(SessionHandle::last_used);
    if spare_newest {
        handles.pop();
    }
    handles.retain(|h| !h.is_waiting());
    for h in handles {
        if ledger.counted() <= target {
            break;
        }
        h.evict().await;
    }
}

/// True when the budget is past its high-water mark.
fn over_high_water(ledger: &Ledger) -> bool {
    let budget = ledger.budget();
    budget > 0 && ledger.counted() > watermark(budget, HIGH_WATER)
}

/// Called by an actor after a job: past the high-water mark of a durable store's budget,
/// wakes the evictor (started on first need), which sends sessions cold down to the
/// low-water mark.
fn pressure(shared: &Arc<Shared>, ledger: &Arc<Ledger>) {
    if !over_high_water(ledger) {
        return;
    }
    let budget = ledger.budget();
    if !shared.evictor.swap(true, Ordering::AcqRel) {
        let (weak, ledger) = (Arc::downgrade(shared), ledger.clone());
        let (notify, passes) = (shared.pressure.clone(), shared.passes.clone());
        tokio::spawn(async move {
            loop {
                let woken = notify.notified();
                {
                    let Some(shared) = weak.upgrade() else { return };
                    make_room(&shared, &ledger, watermark(budget, LOW_WATER), true).await;
                }
                passes.notify_waiters();
                woken.await;
            }
        });
    }
    shared.pressure.notify_one();
}

/// What [`Store::remove`] took out of the map, kept until the delete is durable.
struct Removed {
    hot: Option<SessionHandle>,
    cold: bool,
    resume: Option<(u64, Resume)>,
}

/// The session placed under `id` whose first write (its `Create`) is still in flight.
fn creating(shared: &Shared, id: &str) -> Option<SessionHandle> {
    shared
        .read()
        .hot
        .get(id)
        .filter(|h| h.is_creating())
        .cloned()
}

/// Puts back what [`Store::remove`] took out of the map, unless the id was taken
/// meanwhile (a session created under it and written: the refused delete no longer
/// concerns it; the caller waits for such a session's first write first). A
/// session whose actor ended meanwhile (its own first write failed too) is put back as
/// the disk's copy, as its actor would have left it: loaded on next use, or not found.
fn put_back(shared: &Shared, id: &str, removed: Removed) {
    let mut map = shared.write();
    if map.hot.contains_key(id) || map.cold.contains(id) {
        return;
    }
    match removed.hot {
        Some(h) if !h.has_ended() => {
            map.hot.insert(id.to_string(), h);
        }
        Some(_) => {
            map.cold.insert(id.to_string());
        }
        None if removed.cold => {
            map.cold.insert(id.to_string());
        }
        None => {}
    }
    if let Some(resume) = removed.resume {
        map.resume.insert(id.to_string(), resume);
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
#[path = "durable_tests.rs"]
pub(crate) mod durable_tests;

#[cfg(test)]
#[path = "reload_tests.rs"]
mod reload_tests;

#[cfg(test)]
#[path = "sync_tests.rs"]
mod sync_tests;

#[cfg(test)]
#[path = "delete_tests.rs"]
mod delete_tests;

#[cfg(test)]
#[path = "load_tests.rs"]
mod load_tests;

#[cfg(test)]
#[path = "inline_tests.rs"]
mod inline_tests;

#[cfg(test)]
#[path = "panic_tests.rs"]
mod panic_tests;

#[cfg(test)]
#[path = "interval_tests.rs"]
mod interval_tests;
