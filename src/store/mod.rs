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
//! the engine's [`Session`] value.

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use thiserror::Error;
use tokio::sync::{mpsc, oneshot};
use tracing::Instrument;

use crate::config::EngineConfig;
use crate::domain::SessionInfo;
use crate::engine::{ByteLimit, Session};
use crate::tokens::TokenCounter;

/// Jobs a session actor runs, in order, with exclusive access to the session.
type Job = Box<dyn FnOnce(&mut Session, &EngineConfig) + Send>;

/// One actor's share of the store's byte total, returned when the actor ends.
struct Counted {
    held: Arc<AtomicU64>,
    last: u64,
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.held.fetch_sub(self.last, Ordering::Relaxed);
    }
}

/// A session the idle reaper has not evicted.
const KEPT: u8 = 0;
/// The idle reaper is deciding (between its two looks at the last use).
const DECIDING: u8 = 1;
/// The idle reaper removed the session.
const EVICTED: u8 = 2;

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

/// A cheap, cloneable address of one session's actor.
#[derive(Clone, Debug)]
pub struct SessionHandle {
    id: Arc<str>,
    tx: mpsc::Sender<Job>,
    /// When a job was last queued (ms on the store's monotonic clock), for the idle TTL.
    last_used: Arc<AtomicI64>,
    /// Bytes the session holds, as of its last job.
    bytes: Arc<AtomicU64>,
    /// The idle reaper's verdict: [`KEPT`], [`DECIDING`] or [`EVICTED`] (see `evict_idle`).
    eviction: Arc<AtomicU8>,
}

impl SessionHandle {
    /// Session id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Bytes the session holds, as of its last finished job.
    pub fn held_bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }

    /// Queues `f` behind every job already queued and returns where its result will land.
    /// Awaiting only the queueing (not the result) lets a stream pipeline updates to
    /// several sessions while keeping each session's order.
    pub async fn submit<R, F>(&self, f: F) -> Result<oneshot::Receiver<R>, StoreError>
    where
        R: Send + 'static,
        F: FnOnce(&mut Session, &EngineConfig) -> R + Send + 'static,
    {
        // Paired with `evict_idle`: either the reaper sees this use and keeps the
        // session, or this sees the eviction and refuses (never a job on an evicted
        // session, never a refusal for a kept one).
        self.last_used.store(now_ms(), Ordering::SeqCst);
        loop {
            match self.eviction.load(Ordering::SeqCst) {
                KEPT => break,
                EVICTED => return Err(StoreError::NotFound(self.id.to_string())),
                // The reaper is between its two looks (a few loads under its lock).
                _ => tokio::task::yield_now().await,
            }
        }
        let (tx, rx) = oneshot::channel();
        let job: Job = Box::new(move |s, c| {
            // The caller may have gone away; the job's effect on the session stands.
            let _ = tx.send(f(s, c));
        });
        self.tx
            .send(job)
            .await
            .map_err(|_| StoreError::Closed(self.id.to_string()))?;
        Ok(rx)
    }

    /// Runs `f` on the session and waits for its result.
    pub async fn call<R, F>(&self, f: F) -> Result<R, StoreError>
    where
        R: Send + 'static,
        F: FnOnce(&mut Session, &EngineConfig) -> R + Send + 'static,
    {
        let rx = self.submit(f).await?;
        rx.await
            .map_err(|_| StoreError::Closed(self.id.to_string()))
    }
}

/// All sessions held by this process.
#[derive(Debug)]
pub struct Store {
    sessions: RwLock<HashMap<String, SessionHandle>>,
    config: Arc<EngineConfig>,
    counter: Arc<dyn TokenCounter>,
    mailbox: usize,
    limits: Limits,
    /// Bytes all session actors hold (each adds its own changes after every job).
    held: Arc<AtomicU64>,
}

impl Store {
    /// An empty store whose sessions use `config` and `counter`.
    pub fn new(config: EngineConfig, counter: Arc<dyn TokenCounter>) -> Store {
        Store {
            sessions: RwLock::new(HashMap::new()),
            config: Arc::new(config),
            counter,
            mailbox: DEFAULT_MAILBOX,
            limits: Limits::default(),
            held: Arc::new(AtomicU64::new(0)),
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
        self
    }

    /// The limits this store enforces.
    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// Bytes all sessions hold (including sessions just deleted whose queued jobs still
    /// run: their memory is still in use).
    pub fn held_bytes(&self) -> u64 {
        self.held.load(Ordering::Relaxed)
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
        let held = self.held_bytes().saturating_sub(freed);
        if l.memory_budget > 0 && held.saturating_add(bytes) > l.memory_budget {
            return Err(StoreError::OverBudget {
                bytes,
                held,
                budget: l.memory_budget,
            });
        }
        Ok(())
    }

    /// Removes the sessions no job touched for `ttl`; returns their ids and idle times.
    pub fn evict_idle(&self, ttl: std::time::Duration) -> Vec<(String, u64)> {
        let now = now_ms();
        let ttl = i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX);
        let mut map = self.write();
        let idle: Vec<(String, u64)> = map
            .iter()
            .filter_map(|(id, h)| {
                let idle_since =
                    |h: &SessionHandle| now_ms().max(now) - h.last_used.load(Ordering::SeqCst);
                if idle_since(h) < ttl {
                    return None;
                }
                // Announce the decision, then look again: a `submit` that raced past the
                // first look is either seen here (the session stays) or waits for the
                // verdict and sees the eviction.
                h.eviction.store(DECIDING, Ordering::SeqCst);
                let idle = idle_since(h);
                if idle < ttl {
                    h.eviction.store(KEPT, Ordering::SeqCst);
                    return None;
                }
                h.eviction.store(EVICTED, Ordering::SeqCst);
                Some((id.clone(), u64::try_from(idle).unwrap_or(0)))
            })
            .collect();
        for (id, _) in &idle {
            map.remove(id);
        }
        idle
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

    fn spawn(&self, mut session: Session) -> SessionHandle {
        let (tx, mut rx) = mpsc::channel::<Job>(self.mailbox);
        let id: Arc<str> = Arc::from(session.info().id.as_str());
        let config = self.config.clone();
        let span = tracing::info_span!("session", session_id = %id);
        let limits = self.limits;
        let held = self.held.clone();
        let last = session.held_bytes();
        held.fetch_add(last, Ordering::Relaxed);
        let bytes = Arc::new(AtomicU64::new(last));
        let own = bytes.clone();
        tokio::spawn(
            async move {
                tracing::debug!("session actor started");
                // Gives the session's bytes back however the actor ends (a panicking job
                // included), so the budget never counts a session that is gone.
                let mut counted = Counted { held, last };
                while let Some(job) = rx.recv().await {
                    let total = counted.held.load(Ordering::Relaxed);
                    session.set_byte_limit(limits.byte_limit(counted.last, total));
                    job(&mut session, &config);
                    let now = session.held_bytes();
                    if now != counted.last {
                        // Two atomic adds, never a scan: the store's total follows each job.
                        counted
                            .held
                            .fetch_add(now.wrapping_sub(counted.last), Ordering::Relaxed);
                        own.store(now, Ordering::Relaxed);
                        counted.last = now;
                    }
                }
                tracing::debug!("session actor stopped");
            }
            .instrument(span),
        );
        SessionHandle {
            id,
            tx,
            last_used: Arc::new(AtomicI64::new(now_ms())),
            bytes,
            eviction: Arc::new(AtomicU8::new(KEPT)),
        }
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

/// Milliseconds on a monotonic clock (the store's only clock: idle times). Monotonic so a
/// wall-clock step (NTP, a suspended laptop's clock catching up) cannot evict every
/// session at once.
fn now_ms() -> i64 {
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    let start = START.get_or_init(std::time::Instant::now);
    i64::try_from(start.elapsed().as_millis()).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokens::CharsPerToken;

    fn info(id: &str) -> SessionInfo {
        SessionInfo {
            id: id.into(),
            ..SessionInfo::default()
        }
    }

    #[tokio::test]
    async fn a_handle_taken_before_an_eviction_cannot_reach_the_evicted_session() {
        let store = Store::new(EngineConfig::default(), Arc::new(CharsPerToken));
        let (handle, _) = store.open(info("s")).expect("open");
        handle.call(|_, _| ()).await.expect("in use");
        let evicted = store.evict_idle(std::time::Duration::ZERO);
        assert_eq!(evicted.len(), 1);
        assert!(matches!(store.get("s"), Err(StoreError::NotFound(_))));
        // The old handle's update is refused rather than applied to a session no one can
        // see any more.
        let late = handle.call(|_, _| ()).await;
        assert_eq!(late, Err(StoreError::NotFound("s".into())));
    }

    #[tokio::test]
    async fn sessions_used_within_the_ttl_are_kept() {
        let store = Store::new(EngineConfig::default(), Arc::new(CharsPerToken));
        let (handle, _) = store.open(info("s")).expect("open");
        handle.call(|_, _| ()).await.expect("in use");
        assert!(
            store
                .evict_idle(std::time::Duration::from_secs(60))
                .is_empty()
        );
        handle.call(|_, _| ()).await.expect("still served");
        assert_eq!(store.len(), 1);
    }

    #[tokio::test]
    async fn the_total_follows_every_session_and_returns_to_zero() {
        let store = Store::new(EngineConfig::default(), Arc::new(CharsPerToken));
        let (a, _) = store.open(info("a")).expect("open");
        let (b, _) = store.open(info("b")).expect("open");
        let held = a.held_bytes() + b.held_bytes();
        assert!(held > 0);
        assert_eq!(store.held_bytes(), held);
        store.remove("a");
        drop(a);
        for _ in 0..100 {
            if store.held_bytes() == b.held_bytes() {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        assert_eq!(store.held_bytes(), b.held_bytes());
    }
}
