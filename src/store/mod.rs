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
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, RwLock};

use thiserror::Error;
use tokio::sync::{mpsc, oneshot};
use tracing::Instrument;

use crate::config::EngineConfig;
use crate::engine::Session;
use crate::session::SessionInfo;
use crate::tokens::TokenCounter;

/// Jobs a session actor runs, in order, with exclusive access to the session.
type Job = Box<dyn FnOnce(&mut Session, &EngineConfig) + Send>;

/// Default mailbox depth per session: enough to pipeline a burst, small enough that a
/// stuck session pushes back on its own clients only.
pub const DEFAULT_MAILBOX: usize = 256;

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
}

/// A cheap, cloneable address of one session's actor.
#[derive(Clone, Debug)]
pub struct SessionHandle {
    id: Arc<str>,
    tx: mpsc::Sender<Job>,
    /// When a job was last queued (epoch ms), for the idle TTL.
    last_used: Arc<AtomicI64>,
}

impl SessionHandle {
    /// Session id.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Queues `f` behind every job already queued and returns where its result will land.
    /// Awaiting only the queueing (not the result) lets a stream pipeline updates to
    /// several sessions while keeping each session's order.
    pub async fn submit<R, F>(&self, f: F) -> Result<oneshot::Receiver<R>, StoreError>
    where
        R: Send + 'static,
        F: FnOnce(&mut Session, &EngineConfig) -> R + Send + 'static,
    {
        self.last_used.store(now_ms(), Ordering::Relaxed);
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
    /// Sessions held at most (0: no limit).
    max_sessions: usize,
}

impl Store {
    /// An empty store whose sessions use `config` and `counter`.
    pub fn new(config: EngineConfig, counter: Arc<dyn TokenCounter>) -> Store {
        Store {
            sessions: RwLock::new(HashMap::new()),
            config: Arc::new(config),
            counter,
            mailbox: DEFAULT_MAILBOX,
            max_sessions: 0,
        }
    }

    /// This store holding at most `max` sessions (0: no limit).
    pub fn with_max_sessions(mut self, max: usize) -> Store {
        self.max_sessions = max;
        self
    }

    /// Removes the sessions no job touched for `ttl`; returns their ids and idle times.
    pub fn evict_idle(&self, ttl: std::time::Duration) -> Vec<(String, u64)> {
        let now = now_ms();
        let ttl = i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX);
        let mut map = self.write();
        let idle: Vec<(String, u64)> = map
            .iter()
            .filter_map(|(id, h)| {
                let idle = now.saturating_sub(h.last_used.load(Ordering::Relaxed));
                (idle >= ttl).then(|| (id.clone(), u64::try_from(idle).unwrap_or(0)))
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
        if self.max_sessions > 0 && map.len() >= self.max_sessions {
            return Err(StoreError::Full(self.max_sessions));
        }
        let id = info.id.clone();
        let session = Session::new(info, &self.config, self.counter.clone());
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
        if !map.contains_key(&id) && self.max_sessions > 0 && map.len() >= self.max_sessions {
            return Err(StoreError::Full(self.max_sessions));
        }
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
        tokio::spawn(
            async move {
                tracing::debug!("session actor started");
                while let Some(job) = rx.recv().await {
                    job(&mut session, &config);
                }
                tracing::debug!("session actor stopped");
            }
            .instrument(span),
        );
        SessionHandle {
            id,
            tx,
            last_used: Arc::new(AtomicI64::new(now_ms())),
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

/// Wall clock in epoch ms (the store's only clock: idle times).
fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}
