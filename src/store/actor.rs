//! One session's actor and its address: the task that owns the [`Session`] and runs jobs
//! from its mailbox in order, and the [`SessionHandle`] that queues them.
//!
//! Idle eviction is the actor's own: when its mailbox stays empty for the idle TTL (on
//! tokio's monotonic clock, so a wall-clock step cannot evict every session at once), it
//! takes the store's map lock, then its gate, and leaves only if no job slipped in. A
//! handle queues a job only under the same gate after checking the actor has not left, so
//! an update racing the eviction is either run (the session stays) or refused with
//! `NOT_FOUND`: never applied to a session no one can reach.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use tokio::sync::mpsc::error::TryRecvError;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tracing::Instrument;

use super::{Evicted, Ledger, Limits, Shared, StoreError};
use crate::config::EngineConfig;
use crate::engine::Session;

/// Jobs a session actor runs, in order, with exclusive access to the session.
type Job = Box<dyn FnOnce(&mut Session, &EngineConfig) + Send>;

/// A cheap, cloneable address of one session's actor.
#[derive(Clone, Debug)]
pub struct SessionHandle {
    id: Arc<str>,
    tx: mpsc::Sender<Job>,
    /// Bytes the session holds, as of its last job.
    bytes: Arc<AtomicU64>,
    /// True once the actor evicted itself; jobs are sent only under this lock.
    gate: Arc<Mutex<bool>>,
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
        let permit = self.tx.reserve().await.map_err(|_| self.gone())?;
        let (tx, rx) = oneshot::channel();
        let job: Job = Box::new(move |s, c| {
            // The caller may have gone away; the job's effect on the session stands.
            let _ = tx.send(f(s, c));
        });
        // Under the gate: either the actor has not decided yet (and will find this job
        // when it looks under the same lock) or it has left.
        let evicted = lock(&self.gate);
        if *evicted {
            return Err(StoreError::NotFound(self.id.to_string()));
        }
        permit.send(job);
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

    /// Why the mailbox is shut: the actor evicted itself, or it ended otherwise.
    fn gone(&self) -> StoreError {
        if *lock(&self.gate) {
            StoreError::NotFound(self.id.to_string())
        } else {
            StoreError::Closed(self.id.to_string())
        }
    }
}

/// One actor's share of the store's byte total, returned when the actor ends.
struct Counted {
    ledger: Arc<Ledger>,
    last: u64,
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.ledger.sub_held(self.last);
    }
}

/// Starts the actor owning `session` and returns its handle.
pub(super) fn spawn(
    session: Session,
    shared: &Arc<Shared>,
    config: Arc<EngineConfig>,
    mailbox: usize,
    limits: Limits,
    ledger: Arc<Ledger>,
) -> SessionHandle {
    let (tx, rx) = mpsc::channel::<Job>(mailbox);
    let id: Arc<str> = Arc::from(session.info().id.as_str());
    let last = session.held_bytes();
    ledger.add_held(last);
    let handle = SessionHandle {
        id,
        tx,
        bytes: Arc::new(AtomicU64::new(last)),
        gate: Arc::new(Mutex::new(false)),
    };
    let actor = Actor {
        session,
        rx,
        config,
        limits,
        // Gives the session's bytes back however the actor ends (a panicking job
        // included), so the budget never counts a session that is gone.
        counted: Counted { ledger, last },
        me: Me {
            id: handle.id.clone(),
            bytes: handle.bytes.clone(),
            gate: handle.gate.clone(),
        },
        store: Arc::downgrade(shared),
    };
    let span = tracing::info_span!("session", session_id = %handle.id);
    tokio::spawn(actor.run().instrument(span));
    handle
}

/// What the actor knows of its handle: everything but a sender, which would keep its own
/// mailbox open.
struct Me {
    id: Arc<str>,
    bytes: Arc<AtomicU64>,
    gate: Arc<Mutex<bool>>,
}

/// A session's actor.
struct Actor {
    session: Session,
    rx: mpsc::Receiver<Job>,
    config: Arc<EngineConfig>,
    limits: Limits,
    counted: Counted,
    me: Me,
    /// Weak: a dropped store ends its actors (their senders go with its map).
    store: Weak<Shared>,
}

/// What an idle actor found when it tried to leave.
enum Leave {
    /// It left the map; nothing can reach it any more.
    Evicted,
    /// A job arrived just before: run it and stay.
    Stay(Job),
    /// No one listens for evictions (the server is closing): stay.
    Unheard,
    /// The map holds another session under this id, or none (deleted or replaced): this
    /// actor only finishes what its remaining handles queue.
    Orphan,
    /// Every handle is gone.
    Ended,
}

impl Actor {
    async fn run(mut self) {
        tracing::debug!("session actor started");
        let mut last_job = Instant::now();
        let mut orphan = false;
        loop {
            let ttl = if orphan {
                None
            } else {
                self.store.upgrade().and_then(|s| s.idle_ttl())
            };
            let job = match ttl {
                None => self.rx.recv().await,
                Some(ttl) => match tokio::time::timeout(ttl, self.rx.recv()).await {
                    Ok(job) => job,
                    Err(_) => match self.leave(last_job) {
                        Leave::Evicted | Leave::Ended => break,
                        Leave::Stay(job) => Some(job),
                        Leave::Unheard => continue,
                        Leave::Orphan => {
                            orphan = true;
                            continue;
                        }
                    },
                },
            };
            let Some(job) = job else { break };
            self.run_job(job);
            last_job = Instant::now();
        }
        tracing::debug!("session actor stopped");
    }

    fn run_job(&mut self, job: Job) {
        let counted = &mut self.counted;
        // Sessions plus what is in flight: reserved bytes leave less room to grow.
        let total = counted.ledger.counted();
        self.session
            .set_byte_limit(self.limits.byte_limit(counted.last, total));
        job(&mut self.session, &self.config);
        let now = self.session.held_bytes();
        if now != counted.last {
            // Two atomic adds, never a scan: the store's total follows each job.
            counted.ledger.add_held(now.wrapping_sub(counted.last));
            self.me.bytes.store(now, Ordering::Relaxed);
            counted.last = now;
        }
    }

    /// Leaves the store after an idle TTL, unless a job slipped in (see the module doc).
    fn leave(&mut self, last_job: Instant) -> Leave {
        let Some(store) = self.store.upgrade() else {
            return Leave::Orphan;
        };
        let Some(announce) = store.evictions() else {
            return Leave::Unheard;
        };
        if announce.is_closed() {
            return Leave::Unheard;
        }
        {
            let mut map = store.write();
            let mut evicted = lock(&self.me.gate);
            match self.rx.try_recv() {
                Ok(job) => return Leave::Stay(job),
                Err(TryRecvError::Disconnected) => return Leave::Ended,
                Err(TryRecvError::Empty) => {}
            }
            let id: &str = &self.me.id;
            if !map
                .get(id)
                .is_some_and(|h| Arc::ptr_eq(&h.gate, &self.me.gate))
            {
                return Leave::Orphan;
            }
            *evicted = true;
            map.remove(id);
            self.rx.close();
        }
        let _ = announce.send(Evicted {
            session_id: self.me.id.to_string(),
            idle: last_job.elapsed(),
        });
        Leave::Evicted
    }
}

/// The gate's lock. Poisoned only by a panic while held (a flag store or a channel
/// send), after which the flag is still accurate.
fn lock(gate: &Mutex<bool>) -> std::sync::MutexGuard<'_, bool> {
    gate.lock().unwrap_or_else(|e| e.into_inner())
}
