//! One session's actor and its address: the task that runs jobs on the [`Session`] from
//! its mailbox in order, and the [`SessionHandle`] that queues them (or, for an
//! in-memory session whose actor is idle, runs one inline: [`SessionHandle::try_run`]).
//!
//! Idle eviction is the actor's own: when the session has run no job for the idle TTL
//! (on tokio's monotonic clock, so a wall-clock step cannot evict every session at once),
//! it takes the store's map lock, then its gate, and leaves only if no job slipped in. A
//! handle queues a job, or starts one inline, only under the same gate after checking the
//! actor has not left, so an update racing the eviction is either run (the session stays)
//! or refused with `NOT_FOUND`: never applied to a session no one can reach. With a
//! durable store the session is written to disk first and stays reachable there (it is
//! *cold*).
//!
//! With a durable store, the changes a job made (`Tx`) are queued for the backend; under
//! `Durability::Sync` the job's result is delivered only once they are durable. While one
//! batch is being committed, the next jobs run and their changes gather for the next
//! batch, so a session pipelines as many updates per fsync as arrive meanwhile. If a
//! commit fails under `Sync`, the session is reloaded from disk (the state before the
//! batch) and every result waiting on it is an error: nothing unacknowledged stays
//! applied. Under `Interval` those results were already answered: the session stays as it
//! is and its next batch carries a whole snapshot.
//!
//! A new (or imported) session's first write, its `Create`, is the actor's first batch in
//! flight. If it fails under `Sync`, the session never existed: the actor leaves the map,
//! puts back what the map held before (a replaced session) and fails every result waiting;
//! under `Interval` it writes the session whole again.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use tokio::sync::mpsc::error::TryRecvError;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tracing::Instrument;

use super::backend::{Backend, BackendError, Committed, StoreEvent, Write};
use super::ledger::JournalBytes;
use super::locked::{Counted, Locked, Published};
use super::tx::Tx;
use super::{Evicted, Ledger, Limits, Shared, StoreError, restore};
use crate::config::EngineConfig;
use crate::engine::encode_session;
use crate::engine::{ContextCache, Session};
use crate::tokens::Counting;

/// A job's result, delivered once the changes it made are durable (or failed).
pub(super) type Deliver = Box<dyn FnOnce(Result<(), StoreError>) + Send>;
/// Jobs a session actor runs, in order, with exclusive access to the session.
pub(super) type Job = Box<dyn FnOnce(&mut Tx<'_>, &EngineConfig) -> Deliver + Send>;

/// What a mailbox carries.
pub(super) enum Msg {
    /// Run a job.
    Job(Job),
    /// Run a job that only reads: it is no use of the session (its idle TTL and its
    /// place in the evictor's order stay as they were).
    Look(Job),
    /// Leave memory for disk now (memory pressure); answers true when it left.
    Evict(oneshot::Sender<bool>),
    /// Write everything pending; answers once it is durable.
    Flush(oneshot::Sender<Result<(), StoreError>>),
}

/// How long a job waits for an evictor pass under memory pressure before it runs anyway
/// (and may be refused for the budget).
const ROOM_WAIT: std::time::Duration = std::time::Duration::from_secs(2);
/// Jobs run back to back before the actor looks at its batch again.
const JOBS_PER_TURN: usize = 64;
/// Unsent change bytes past which the actor waits for its batch before running more
/// jobs (bounds what a slow disk makes us hold).
const MAX_UNSENT_BYTES: u64 = 32 << 20;
/// The log since the last snapshot may reach this many bytes before a snapshot is due,
/// however small the session (see [`snapshot_due`]).
pub(super) const SNAPSHOT_MIN_LOG_BYTES: u64 = 4 << 20;
/// ... or this many times the last snapshot's size, whichever is larger.
pub(super) const SNAPSHOT_LOG_PER_SNAPSHOT: u64 = 1;

/// Whether the next batch carries a snapshot. Every logged byte is written once to the
/// log, and a snapshot rewrites the whole session; taking one after `k` snapshots' worth
/// of log adds `1/k` of a byte per logged byte. `k` stays 1: a load holds the snapshot
/// and its whole log in memory before replaying, so a larger `k` would raise what
/// loading a large session takes. The floor keeps sessions under 4 MiB from paying for
/// a snapshot at all while they are written: replay runs at about 600 MB/s and a
/// snapshot decodes at about 1 GB/s, so a cold load replays 4 MiB of log in about 7 ms.
/// A session going cold writes a snapshot first, so it loads with no log.
fn snapshot_due(log_bytes: u64, snapshot_bytes: u64) -> bool {
    log_bytes >= snapshot_threshold(snapshot_bytes)
}

/// The log size at which [`snapshot_due`] says yes.
fn snapshot_threshold(snapshot_bytes: u64) -> u64 {
    SNAPSHOT_MIN_LOG_BYTES.max(snapshot_bytes.saturating_mul(SNAPSHOT_LOG_PER_SNAPSHOT))
}

/// A cheap, cloneable address of one session's actor: its mailbox and one shared
/// [`State`] (one reference count to move per clone, not one per field).
#[derive(Clone, Debug)]
pub struct SessionHandle {
    tx: mpsc::Sender<Msg>,
    state: Arc<State>,
}

/// What a session's handles and its actor share: the actor writes it, handles read it.
#[derive(Debug)]
struct State {
    id: Box<str>,
    /// The session's size and tokenizer, as of its last job.
    published: Published,
    /// When the session last ran a job (ms on the store's clock): eviction picks the
    /// least recently used, and an idle actor leaves only this long after it.
    used: AtomicU64,
    /// The store's clock (`used` counts from it).
    clock: Instant,
    /// True once the actor evicted itself; jobs are sent (or run inline) only under this
    /// lock.
    gate: Mutex<bool>,
    /// True while the actor waits for the evictor (which then leaves it alone).
    waiting: AtomicBool,
    /// True until the result of the session's `Create` is known.
    creating: AtomicBool,
    /// Jobs sent to the mailbox and not yet run (or dropped): a handle runs a job inline
    /// only when none is, so the session's order holds. Lowered under `cell`'s lock.
    queued: AtomicU64,
    /// The session, taken by the actor for each job, and by a handle for a job it runs
    /// inline. None once the actor has stopped, or once a job panicked on a session in
    /// memory (a durable one is rebuilt instead).
    cell: Mutex<Option<Locked>>,
    /// Handles may run jobs inline: an in-memory session (a durable one's results wait on
    /// its journal, which only the actor keeps).
    inline: bool,
    /// Weak: a dropped store ends its actors (their senders go with its map).
    store: Weak<Shared>,
    /// The store's closing flag: once raised, no job is queued (checked under `gate`).
    closing: Arc<AtomicBool>,
}

impl std::fmt::Debug for Msg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Msg::Job(_) => "Job",
            Msg::Look(_) => "Look",
            Msg::Evict(_) => "Evict",
            Msg::Flush(_) => "Flush",
        })
    }
}

impl SessionHandle {
    /// Session id.
    pub fn id(&self) -> &str {
        &self.state.id
    }

    /// Bytes the session holds, as of its last finished job.
    pub fn held_bytes(&self) -> u64 {
        self.state.published.bytes.load(Ordering::Relaxed)
    }

    /// When it last ran a job, on the store's clock.
    pub(super) fn last_used(&self) -> u64 {
        self.state.used.load(Ordering::Relaxed)
    }

    /// True while the actor waits for room (the evictor skips it).
    pub(super) fn is_waiting(&self) -> bool {
        self.state.waiting.load(Ordering::Relaxed)
    }

    /// What the session counts with, as of its last job.
    pub fn counting(&self) -> Counting {
        self.state.published.counting()
    }

    /// True until the result of the session's first write (its `Create`) is known (and
    /// acted on), while its actor runs.
    pub(super) fn is_creating(&self) -> bool {
        self.state.creating.load(Ordering::Acquire) && !self.tx.is_closed()
    }

    /// True when the actor has stopped (its session left memory): a handle no job reaches.
    pub(super) fn has_ended(&self) -> bool {
        self.tx.is_closed()
    }

    /// True while the store's map holds this actor: false once its session was deleted
    /// or replaced (or left memory). Asked from within a job that must not land on a
    /// session its id no longer names (a compaction's commit): a delete or a
    /// replacement made after the answer is ordered after the job. Takes the map's read
    /// lock; no one holding the map's lock waits for a session's (only tries it).
    pub fn in_store(&self) -> bool {
        self.state.store.upgrade().is_some_and(|store| {
            store
                .read()
                .hot
                .get(&*self.state.id)
                .is_some_and(|h| Arc::ptr_eq(&h.state, &self.state))
        })
    }

    /// True when this handle and `other` address the same actor.
    #[cfg(test)]
    pub(super) fn same(&self, other: &SessionHandle) -> bool {
        Arc::ptr_eq(&self.state, &other.state)
    }

    /// Runs `f` on the session now, on the caller's task, when that keeps the session's
    /// order and nothing needs the actor: an in-memory session with no job queued or
    /// running, whose actor has not left. This saves the mailbox's hop (its send, the
    /// actor's wake and the reply's channel). Hands `f` back otherwise, for
    /// [`Self::try_submit`]. A job that panics takes its session down (as a panic on the
    /// actor does) and answers `Closed`, not the caller's task: a stream goes on.
    pub fn try_run<R, F>(&self, f: F) -> Result<Result<R, StoreError>, F>
    where
        F: FnOnce(&mut Tx<'_>, &EngineConfig) -> R,
    {
        let state = &*self.state;
        if !state.inline {
            return Err(f);
        }
        // Under the gate, as a job is queued: the actor leaves only under it, after
        // taking the cell (so after a job run here has finished), and stays when one
        // started since it last looked (`used`).
        let gate = lock(&state.gate);
        if *gate {
            return Err(f);
        }
        let Ok(mut cell) = state.cell.try_lock() else {
            // Busy (a job is running) or poisoned (the actor clears it): the queue.
            return Err(f);
        };
        // Lowered only under the cell's lock once a job has run: zero means every job
        // queued before this one has run.
        if state.queued.load(Ordering::Acquire) != 0 {
            return Err(f);
        }
        let Some(locked) = cell.as_mut() else {
            return Err(f);
        };
        state
            .used
            .store(millis_since(state.clock), Ordering::Relaxed);
        drop(gate);
        let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            // In memory: durable as soon as it has run.
            locked.run(&state.published, &state.store, None, |tx, config| {
                let r = f(tx, config);
                run_when_durable(tx.take_when_durable());
                (r, tx.take_announce())
            })
        }));
        // The idle TTL counts from the job's end, as for the actor's jobs.
        state
            .used
            .store(millis_since(state.clock), Ordering::Relaxed);
        match ran {
            Ok((r, then)) => {
                // Still under the cell: the session's jobs announce in their order. (The
                // map's lock may be taken under a cell's: no one holding the map's lock
                // waits for a cell, they only try it.)
                announce(&self.state, then);
                drop(cell);
                Ok(Ok(r))
            }
            Err(_) => {
                // Half changed: dropped with its bytes, here, and out of the map at once
                // (a reopen creates the session anew, and the id no longer counts against
                // `max_sessions`); the actor closes its mailbox when it next looks.
                *cell = None;
                drop(cell);
                tracing::error!(session_id = %state.id, "a job panicked; the session is dropped");
                self.leave_map();
                Ok(Err(StoreError::Closed(state.id.to_string())))
            }
        }
    }

    /// Takes this session out of the store's map (only while the map holds it) and shuts
    /// its gate, so no job is queued or run on it any more. Takes the map lock, then the
    /// gate, as the actor's own leaving does; the caller holds neither, nor the cell.
    fn leave_map(&self) {
        let Some(store) = self.state.store.upgrade() else {
            return;
        };
        let mut map = store.write();
        *lock(&self.state.gate) = true;
        let id: &str = &self.state.id;
        if map
            .hot
            .get(id)
            .is_some_and(|h| Arc::ptr_eq(&h.state, &self.state))
        {
            map.hot.remove(id);
        }
    }

    /// Queues `f` behind every job already queued and returns where its result will land.
    /// Awaiting only the queueing (not the result) lets a stream pipeline updates to
    /// several sessions while keeping each session's order. The result is an error when
    /// the changes `f` made could not be made durable (they are then undone).
    pub async fn submit<R, F>(
        &self,
        f: F,
    ) -> Result<oneshot::Receiver<Result<R, StoreError>>, StoreError>
    where
        R: Send + 'static,
        F: FnOnce(&mut Tx<'_>, &EngineConfig) -> R + Send + 'static,
    {
        self.try_submit(f).await.map_err(|(e, _)| e)
    }

    /// [`Self::submit`] for a job that only reads (a listing's summary): it does not
    /// count as use, so a session looked at more often than its idle TTL still leaves
    /// one TTL after its last use.
    pub async fn look<R, F>(
        &self,
        f: F,
    ) -> Result<oneshot::Receiver<Result<R, StoreError>>, StoreError>
    where
        R: Send + 'static,
        F: FnOnce(&mut Tx<'_>, &EngineConfig) -> R + Send + 'static,
    {
        self.queue(f, Msg::Look, true).await.map_err(|(e, _)| e)
    }

    /// [`Self::submit`], handing `f` back when it was not queued. `NotFound` then means the
    /// actor left memory for disk after the caller got this handle: the session is cold,
    /// and the caller can load it back (`Store::get`) and queue `f` there.
    pub async fn try_submit<R, F>(
        &self,
        f: F,
    ) -> Result<oneshot::Receiver<Result<R, StoreError>>, (StoreError, F)>
    where
        R: Send + 'static,
        F: FnOnce(&mut Tx<'_>, &EngineConfig) -> R + Send + 'static,
    {
        self.queue(f, Msg::Job, false).await
    }

    /// Queues `f` as the message `kind` makes of it; `reads` when it changes nothing (a
    /// closing store still answers it: it acknowledges nothing the close must write).
    async fn queue<R, F>(
        &self,
        f: F,
        kind: fn(Job) -> Msg,
        reads: bool,
    ) -> Result<oneshot::Receiver<Result<R, StoreError>>, (StoreError, F)>
    where
        R: Send + 'static,
        F: FnOnce(&mut Tx<'_>, &EngineConfig) -> R + Send + 'static,
    {
        let permit = match self.tx.reserve().await {
            Ok(permit) => permit,
            Err(_) => return Err((self.gone(), f)),
        };
        // Under the gate: either the actor has not decided yet (and will find this job
        // when it looks under the same lock) or it has left.
        let evicted = lock(&self.state.gate);
        if *evicted {
            return Err((StoreError::NotFound(self.state.id.to_string()), f));
        }
        // Under the gate too: the close takes the gate after raising the flag and before
        // its flush, so a job let through here is in the mailbox ahead of that flush.
        // (Only a durable store closes; its sessions never run a job inline.)
        if !reads && self.state.closing.load(Ordering::Acquire) {
            return Err((StoreError::Closing, f));
        }
        let (tx, rx) = oneshot::channel();
        let state = self.state.clone();
        let job: Job = Box::new(move |s, config| {
            let r = f(s, config);
            let then = s.take_when_durable();
            let told = s.take_announce();
            Box::new(move |durable: Result<(), StoreError>| {
                if durable.is_ok() {
                    run_when_durable(then);
                    announce(&state, told);
                }
                // The caller may have gone away; the job's effect on the session stands.
                let _ = tx.send(durable.map(|()| r));
            })
        });
        // Before the send: a handle running a job inline sees it queued.
        self.state.queued.fetch_add(1, Ordering::AcqRel);
        permit.send(kind(job));
        Ok(rx)
    }

    /// Runs `f` on the session and waits for its result.
    pub async fn call<R, F>(&self, f: F) -> Result<R, StoreError>
    where
        R: Send + 'static,
        F: FnOnce(&mut Tx<'_>, &EngineConfig) -> R + Send + 'static,
    {
        let rx = self.submit(f).await?;
        rx.await
            .map_err(|_| StoreError::Closed(self.state.id.to_string()))?
    }

    /// Asks the actor to leave memory for disk; true when it left.
    pub(super) async fn evict(&self) -> bool {
        let (tx, rx) = oneshot::channel();
        if self.tx.send(Msg::Evict(tx)).await.is_err() {
            return true;
        }
        rx.await.unwrap_or(true)
    }

    /// Waits until every change made so far is durable, including those of a job being
    /// queued now (its queueing holds the gate until it is in the mailbox).
    pub(super) async fn flush(&self) -> Result<(), StoreError> {
        drop(lock(&self.state.gate));
        let (tx, rx) = oneshot::channel();
        if self.tx.send(Msg::Flush(tx)).await.is_err() {
            return Ok(());
        }
        rx.await.unwrap_or(Ok(()))
    }

    /// Why the mailbox is shut: the actor evicted itself, or it ended otherwise.
    fn gone(&self) -> StoreError {
        if *lock(&self.state.gate) {
            StoreError::NotFound(self.state.id.to_string())
        } else {
            StoreError::Closed(self.state.id.to_string())
        }
    }
}

/// Where a durable session stands with its backend.
pub(super) struct Durable {
    pub backend: Arc<dyn Backend>,
    pub incarnation: u64,
    /// The last change handed out a log position.
    pub seq: u64,
    /// Bytes logged since the last snapshot, and that snapshot's size.
    pub log_bytes: u64,
    pub snapshot_bytes: u64,
    /// The session's `Create`, for a session just created or imported: the actor's first
    /// batch in flight, so it learns the result (and does not leave memory before it)
    /// and any job queued behind it waits for it.
    pub created: Option<Created>,
}

/// A new session's (or a new incarnation's) first write, handed to its actor.
pub(super) struct Created {
    /// The `Create`'s result.
    pub committed: Committed,
    /// Under `Sync`: told the result (the creator answers its caller with it).
    pub creator: Option<Deliver>,
    /// Under `Sync`: what the map held under this id before, put back if the `Create`
    /// fails (a failed replacement changes nothing).
    pub replaced: Option<Previous>,
}

/// What the map held under an id before a session replaced it.
pub(super) enum Previous {
    /// A session in memory, with its actor (kept alive by this handle).
    Hot(SessionHandle),
    /// A session only on disk.
    Cold,
}

/// The actor's side of a durable session: what is written, in flight, and waiting.
struct Journal {
    d: Durable,
    waits: bool,
    /// Changes not yet sent to the backend.
    unsent: Vec<Write>,
    unsent_bytes: u64,
    /// Results waiting for `unsent` to be durable.
    waiting: Vec<Deliver>,
    /// When the oldest change not yet sent was acknowledged (under `interval`, the next
    /// batch is on disk within the interval of it, not of its sending).
    unsent_since: Option<std::time::Instant>,
    /// The batch being committed and the results waiting for it.
    outstanding: Option<(Committed, Vec<Deliver>)>,
    /// The bytes of that batch's changes (see [`Journal::send`]).
    outstanding_bytes: u64,
    /// `unsent_bytes` and `outstanding_bytes`, counted against the memory budget.
    counted: JournalBytes,
    /// A commit failed under `Interval`: the next batch carries a full snapshot.
    resync: bool,
    /// The batch in flight is the session written whole as a new row (its `Create`).
    creating: bool,
    /// Under `Sync`, while the first `Create` is in flight: what it replaced.
    replaced: Option<Previous>,
    /// The session's `Create` failed after it was acknowledged: every later write would
    /// find no row and land nowhere, so the next batch writes the session whole as a new
    /// row, until one lands or the session is deleted or replaced.
    recreate: bool,
    /// Failed commits in a row (under `interval`), and when the next may be tried: the
    /// next one writes the session whole, so a disk that stays full is not sent a whole
    /// session (encoded again) every interval by every session. The wait doubles, spread
    /// by the session's id, and the try waits its turn among the store's rewrites.
    failures: u32,
    retry_at: Option<tokio::time::Instant>,
    /// Failed tries to go cold in a row, and when the next may be tried (both
    /// durabilities): under memory pressure on a failing disk, each try writes the
    /// session whole and, under `sync`, reloads it when that fails; asked after every
    /// job, the same session was tried again and again.
    leave_failures: u32,
    leave_retry_at: Option<tokio::time::Instant>,
    /// The batch in flight writes the session whole again after failed commits: its
    /// bytes, counted among the store's rewrites until it lands or fails.
    rewrite: Option<super::ledger::Rewrite>,
}

/// The wait after the first failed commit under `interval`, doubled after each next one
/// up to [`RETRY_MAX`].
const RETRY_FIRST: std::time::Duration = std::time::Duration::from_millis(250);
/// The longest wait between two tries of a failing session's write.
const RETRY_MAX: std::time::Duration = std::time::Duration::from_secs(30);

/// The wait before the next try after `failures` failed commits in a row.
pub(super) fn retry_delay(failures: u32) -> std::time::Duration {
    let doublings = failures.saturating_sub(1).min(16);
    RETRY_FIRST.saturating_mul(1u32 << doublings).min(RETRY_MAX)
}

/// `delay` made longer by up to a half, by a fraction drawn from the session's id and
/// its count of failures: sessions whose writes failed in one batch try again spread over
/// the wait, not all at the same moment.
pub(super) fn spread(delay: std::time::Duration, id: &str, failures: u32) -> std::time::Duration {
    use std::hash::BuildHasher;
    let drawn = foldhash::fast::FixedState::with_seed(u64::from(failures)).hash_one(id) % 1024;
    delay.saturating_add(delay.mul_f64(drawn as f64 / 2048.0))
}

impl Journal {
    fn idle(&self) -> bool {
        self.unsent.is_empty() && self.outstanding.is_none()
    }

    /// Moves the budget's count of the journal to what it holds now (after each change
    /// to `unsent` or `outstanding`).
    fn account(&mut self) {
        if self.outstanding.is_none() {
            self.outstanding_bytes = 0;
        }
        let now = self.unsent_bytes.saturating_add(self.outstanding_bytes);
        self.counted.set(now);
    }

    /// A rewrite admitted among the store's (`Ledger::rewrite`) is committed now, not at
    /// the end of the writer's interval: it holds room others wait for, and under a long
    /// interval the sessions of a disk that had filled would reach it one per interval.
    fn hasten_rewrite(&self) {
        if self.rewrite.is_some() {
            self.d.backend.expedite();
        }
    }

    /// Sends `writes` as the batch being committed, with the results waiting for it.
    /// Its changes stay counted until it is durable. A snapshot in it (the session
    /// written whole) is not: it lives only while the batch commits, and going cold
    /// writes one to free the session's memory, which counting it would refuse updates
    /// for (the evictor sends one session cold at a time).
    fn send(&mut self, writes: Vec<Write>, waiting: Vec<Deliver>) {
        self.outstanding_bytes = writes
            .iter()
            .filter(|w| matches!(w, Write::Append { .. }))
            .map(|w| w.bytes() as u64)
            .sum();
        let rx = match self.unsent_since.take() {
            Some(since) => self.d.backend.write_since(writes, since),
            None => self.d.backend.write(writes),
        };
        self.outstanding = Some((rx, waiting));
        self.account();
    }
}

/// What a new actor starts with.
pub(super) struct Start {
    pub session: Session,
    pub config: Arc<EngineConfig>,
    pub mailbox: usize,
    pub limits: Limits,
    pub ledger: Arc<Ledger>,
    pub durable: Option<Durable>,
    pub clock: Instant,
}

/// Starts the actor owning `session` and returns its handle.
pub(super) fn spawn(start: Start, shared: &Arc<Shared>) -> SessionHandle {
    let Start {
        session,
        config,
        mailbox,
        limits,
        ledger,
        durable,
        clock,
    } = start;
    let (tx, rx) = mpsc::channel::<Msg>(mailbox);
    let id: Box<str> = Box::from(session.info().id.as_str());
    let last = session.held_bytes();
    let session_resets = session.calibration_resets();
    ledger.add_held(last);
    let journal = durable.map(|mut d| {
        let (outstanding, replaced) = match d.created.take() {
            Some(c) => (
                Some((c.committed, c.creator.into_iter().collect())),
                c.replaced,
            ),
            None => (None, None),
        };
        Journal {
            waits: d.backend.durability().waits(),
            d,
            unsent: Vec::new(),
            unsent_bytes: 0,
            waiting: Vec::new(),
            unsent_since: None,
            creating: outstanding.is_some(),
            outstanding,
            outstanding_bytes: 0,
            counted: JournalBytes::new(ledger.clone()),
            replaced,
            resync: false,
            recreate: false,
            failures: 0,
            retry_at: None,
            leave_failures: 0,
            leave_retry_at: None,
            rewrite: None,
        }
    });
    let state = Arc::new(State {
        id,
        published: Published::of(&session),
        used: AtomicU64::new(millis_since(clock)),
        clock,
        gate: Mutex::new(false),
        waiting: AtomicBool::new(false),
        creating: AtomicBool::new(journal.as_ref().is_some_and(|j| j.creating)),
        queued: AtomicU64::new(0),
        inline: journal.is_none(),
        store: Arc::downgrade(shared),
        closing: shared.closing.clone(),
        cell: Mutex::new(Some(Locked {
            session,
            cache: ContextCache::default(),
            config: config.clone(),
            limits,
            // Gives the session's bytes back however it ends (a panicking job
            // included), so the budget never counts a session that is gone.
            counted: Counted {
                ledger: ledger.clone(),
                last,
                cached: 0,
            },
            shared_at: 0,
            calibrated_as: session_resets,
        })),
    });
    let handle = SessionHandle {
        tx,
        state: state.clone(),
    };
    let actor = Actor {
        rx,
        config,
        ledger,
        me: state,
        journal,
        next: None,
        failed: false,
        recovering: false,
    };
    // No parent: the request that happened to open the session is not the context of
    // everything it logs afterwards.
    let span = tracing::info_span!(parent: None, "session", session_id = %handle.state.id);
    tokio::spawn(actor.run().instrument(span));
    handle
}

fn millis_since(clock: Instant) -> u64 {
    u64::try_from(clock.elapsed().as_millis()).unwrap_or(u64::MAX)
}

/// A session's actor.
struct Actor {
    rx: mpsc::Receiver<Msg>,
    config: Arc<EngineConfig>,
    ledger: Arc<Ledger>,
    /// What it shares with its handles, the session included (not a sender, which would
    /// keep its own mailbox open).
    me: Arc<State>,
    /// None without a durable store.
    journal: Option<Journal>,
    /// A message taken from the mailbox while trying to leave, handled next.
    next: Option<Msg>,
    /// A commit failed and the session could not be reloaded: it has left the map, and
    /// the jobs still queued are dropped unrun.
    failed: bool,
    /// A job panicked on a durable session: what memory holds may be half changed, and
    /// is rebuilt ([`Actor::recover`]) before the next job runs.
    recovering: bool,
}

impl Drop for Actor {
    /// Drops the session (its bytes leave the budget) however the actor ends, a
    /// panicking job included: its handles may outlive it.
    fn drop(&mut self) {
        *lock_cell(&self.me) = None;
    }
}

/// What an idle actor found when it tried to leave.
enum Leave {
    /// It left the map; nothing can reach it any more (but the disk, when durable).
    Evicted,
    /// A message arrived just before: handle it and stay.
    Stay(Msg),
    /// No one listens for evictions and nothing is on disk (the server is closing): stay.
    Unheard,
    /// The map holds another session under this id, or none (deleted or replaced): this
    /// actor finishes what its remaining handles queue, and looks again after the next
    /// idle TTL (a failed replacement puts it back).
    Orphan,
    /// Every handle is gone.
    Ended,
    /// Its changes could not be written: it stays in memory.
    Unsaved,
    /// A job ran inline within the idle TTL: it stays.
    Used,
}

/// What woke the actor.
enum Wake {
    Msg(Option<Msg>),
    Committed(Result<(), BackendError>),
    Idle,
    /// A failed write's wait is over: try it again.
    Retry,
}

impl Actor {
    async fn run(mut self) {
        tracing::debug!("session actor started");
        // The rest of the idle TTL after a job ran inline while the actor waited.
        let mut defer = None;
        loop {
            self.send_batch(false);
            let ttl = self.me.store.upgrade().and_then(|s| s.idle_ttl());
            let wake = match self.next.take() {
                Some(msg) => Wake::Msg(Some(msg)),
                None => self.wait(defer.take().or(ttl)).await,
            };
            let msg = match wake {
                Wake::Committed(r) => {
                    self.committed(r).await;
                    continue;
                }
                Wake::Retry => continue,
                Wake::Msg(msg) => msg,
                Wake::Idle => {
                    if let Some(rest) = ttl.and_then(|ttl| ttl.checked_sub(self.idle_for()))
                        && !rest.is_zero()
                    {
                        defer = Some(rest);
                        continue;
                    }
                    match self.leave(ttl, "idle").await {
                        Leave::Evicted | Leave::Ended => break,
                        Leave::Stay(msg) => Some(msg),
                        Leave::Unheard | Leave::Unsaved | Leave::Orphan | Leave::Used => {
                            continue;
                        }
                    }
                }
            };
            let Some(msg) = msg else {
                // Every handle is gone: write what is pending, then stop.
                let _ = self.flush().await;
                break;
            };
            match msg {
                Msg::Job(job) => {
                    self.make_room().await;
                    // Used from now: a job that takes the store past the high-water mark
                    // wakes the evictor, which spares the session used last (this one).
                    self.me
                        .used
                        .store(millis_since(self.me.clock), Ordering::Relaxed);
                    self.run_job(job);
                    // Run what else is queued before looking at the batch again.
                    for _ in 1..JOBS_PER_TURN {
                        if self.blocked() || self.recovering {
                            break;
                        }
                        match self.rx.try_recv() {
                            Ok(Msg::Job(job)) => self.run_job(job),
                            Ok(other) => {
                                if self.control(other).await {
                                    return self.stopped();
                                }
                                break;
                            }
                            Err(_) => break,
                        }
                    }
                    if self.recovering {
                        self.recover().await;
                    }
                    self.me
                        .used
                        .store(millis_since(self.me.clock), Ordering::Relaxed);
                }
                other => {
                    let looked = matches!(other, Msg::Look(_));
                    if self.control(other).await {
                        return self.stopped();
                    }
                    if self.recovering {
                        self.recover().await;
                    }
                    if looked {
                        // No use: the idle clock runs on from the last job.
                        defer = ttl.map(|ttl| ttl.saturating_sub(self.idle_for()));
                    }
                }
            }
        }
        self.stopped();
    }

    fn stopped(&self) {
        tracing::debug!("session actor stopped");
    }

    /// How long since the session last ran a job (here or inline).
    fn idle_for(&self) -> std::time::Duration {
        let used = self.me.used.load(Ordering::Relaxed);
        std::time::Duration::from_millis(millis_since(self.me.clock).saturating_sub(used))
    }

    /// Handles an `Evict` or `Flush`; true when the actor left.
    async fn control(&mut self, msg: Msg) -> bool {
        match msg {
            Msg::Job(job) | Msg::Look(job) => {
                self.run_job(job);
                false
            }
            Msg::Flush(done) => {
                let _ = done.send(self.flush().await);
                false
            }
            Msg::Evict(done) => {
                let left = match self.leave(None, "memory").await {
                    Leave::Evicted | Leave::Ended => true,
                    // A message slipped in: it is handled next, and the session stays.
                    Leave::Stay(next) => {
                        self.next = Some(next);
                        false
                    }
                    Leave::Unheard | Leave::Orphan | Leave::Unsaved | Leave::Used => false,
                };
                let _ = done.send(left);
                left
            }
        }
    }

    /// True when the actor must wait for its batch before running more jobs.
    fn blocked(&self) -> bool {
        self.journal
            .as_ref()
            .is_some_and(|j| j.outstanding.is_some() && j.unsent_bytes > MAX_UNSENT_BYTES)
    }

    async fn wait(&mut self, ttl: Option<std::time::Duration>) -> Wake {
        let blocked = self.blocked();
        let busy = self.journal.as_ref().is_some_and(|j| !j.idle());
        // Only with something `send_batch` would write: a wait over with nothing to send
        // (the session deleted or replaced meanwhile, or the actor failed) would wake the
        // actor on every pass.
        let retry_at = self
            .journal
            .as_ref()
            .filter(|j| {
                !self.failed
                    && j.outstanding.is_none()
                    && (j.resync || j.recreate || !j.unsent.is_empty())
            })
            .and_then(|j| j.retry_at);
        let retry = async {
            match retry_at {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        let outstanding = self.journal.as_mut().and_then(|j| j.outstanding.as_mut());
        let commit = async {
            match outstanding {
                Some((rx, _)) => rx.await.unwrap_or(Err(BackendError::Closed)),
                None => std::future::pending().await,
            }
        };
        let idle = async {
            match ttl {
                Some(ttl) if !busy => tokio::time::sleep(ttl).await,
                _ => std::future::pending().await,
            }
        };
        tokio::select! {
            biased;
            r = commit => Wake::Committed(r),
            m = self.rx.recv(), if !blocked => Wake::Msg(m),
            () = retry => Wake::Retry,
            () = idle => Wake::Idle,
        }
    }

    /// Under memory pressure in a durable store, waits for one pass of the evictor (at
    /// most [`ROOM_WAIT`]) before running the next job, so the job is slowed down while
    /// other sessions go cold rather than refused. The session is marked used and
    /// waiting first, so the evictor picks others.
    async fn make_room(&mut self) {
        if self.journal.is_none() || !super::over_high_water(&self.ledger) {
            return;
        }
        let Some(store) = self.me.store.upgrade() else {
            return;
        };
        self.me
            .used
            .store(millis_since(self.me.clock), Ordering::Relaxed);
        self.me.waiting.store(true, Ordering::Relaxed);
        let passes = store.passes.clone();
        let pass = passes.notified();
        tokio::pin!(pass);
        pass.as_mut().enable();
        super::pressure(&store, &self.ledger);
        drop(store);
        let _ = tokio::time::timeout(ROOM_WAIT, pass).await;
        self.me.waiting.store(false, Ordering::Relaxed);
    }

    fn run_job(&mut self, job: Job) {
        let mut changes = Vec::new();
        let logging = self.journal.is_some();
        let deliver = {
            let mut cell = lock_cell(&self.me);
            let deliver = match cell.as_mut() {
                // The session could not be put back as the disk has it (`failed`):
                // running the job on what memory holds could log changes on a state the
                // disk never had. Dropping it answers its caller that the session is
                // gone; so does a session a panicking job took down (no cell).
                Some(locked) if !self.failed && !self.recovering => {
                    let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        locked.run(
                            &self.me.published,
                            &self.me.store,
                            logging.then_some(&mut changes),
                            job,
                        )
                    }));
                    match ran {
                        Ok(deliver) => Some(deliver),
                        Err(_) => {
                            // Its caller is answered by its dropped reply. A durable
                            // session is rebuilt from the disk and the changes since;
                            // one in memory, whose only copy this was, is dropped.
                            tracing::error!("a job panicked on the session");
                            changes.clear();
                            if logging {
                                self.recovering = true;
                            } else {
                                *cell = None;
                            }
                            None
                        }
                    }
                }
                _ => None,
            };
            // Under the cell's lock: a handle that finds no job queued knows this one
            // has run.
            self.me.queued.fetch_sub(1, Ordering::AcqRel);
            let gone = cell.is_none();
            drop(cell);
            if gone && !self.failed {
                // A job run inline panicked: the session is gone. It leaves the map (a
                // durable one's disk copy stays) and its mailbox closes (the jobs still
                // queued are dropped unrun), rather than staying there, dead.
                let instead = self.journal.as_ref().map(|_| Previous::Cold);
                self.drop_from_map(instead);
            }
            deliver
        };
        let Some(deliver) = deliver else {
            return;
        };
        if self.journal.is_some()
            && let Some(store) = self.me.store.upgrade()
        {
            super::pressure(&store, &self.ledger);
        }
        match self.journal.as_mut() {
            None => deliver(Ok(())),
            Some(j) => {
                // The next write is the session whole (a failed batch under `interval`):
                // it covers these changes, which are not kept to be sent before it (a
                // disk that stays full would have them pile up for the whole wait).
                let whole_next = !j.waits && (j.resync || j.recreate);
                if !changes.is_empty() && j.unsent_since.is_none() {
                    j.unsent_since = Some(std::time::Instant::now());
                }
                for change in changes {
                    j.d.seq = j.d.seq.saturating_add(1);
                    if whole_next {
                        continue;
                    }
                    let len = change.len() as u64;
                    j.d.log_bytes = j.d.log_bytes.saturating_add(len);
                    j.unsent_bytes = j.unsent_bytes.saturating_add(len);
                    j.unsent.push(Write::Append {
                        id: self.me.id.to_string(),
                        incarnation: j.d.incarnation,
                        seq: j.d.seq,
                        change,
                    });
                }
                j.account();
                if j.waits && !(j.idle() && j.waiting.is_empty()) {
                    j.waiting.push(deliver);
                } else {
                    deliver(Ok(()));
                }
            }
        }
    }

    /// Sends what is unsent when no batch is being committed (one batch at a time keeps
    /// the session's writes in order and bounded). After a failed commit, not before its
    /// wait is over (`retry_at`) unless `now` (a flush: closing, going cold).
    fn send_batch(&mut self, now: bool) {
        if self.failed {
            return;
        }
        let Some(j) = self.journal.as_mut() else {
            return;
        };
        if j.outstanding.is_some() {
            return;
        }
        if !now
            && j.retry_at
                .is_some_and(|at| tokio::time::Instant::now() < at)
        {
            return;
        }
        // A try after failed commits writes the session whole (`recreate`, `resync`); a
        // disk that stays full fails every session's at once, and their next tries wait
        // their turn among the store's rewrites rather than all encode a snapshot. A
        // flush (closing, going cold) does not wait.
        let mut rewrite = None;
        if !now && j.failures > 0 && (j.recreate || j.resync) {
            let estimate = self.me.published.bytes.load(Ordering::Relaxed);
            match self.ledger.rewrite(estimate) {
                Some(r) => rewrite = Some(r),
                None => {
                    let wait = spread(RETRY_FIRST, &self.me.id, j.failures);
                    j.retry_at = Some(tokio::time::Instant::now() + wait);
                    return;
                }
            }
        }
        if j.recreate {
            j.recreate = false;
            let Some(snapshot) = encoded(&self.me) else {
                return;
            };
            let Some(store) = self.me.store.upgrade() else {
                return;
            };
            // Under the map lock, as a `Create` is queued and a delete or a replacement
            // is made: only while the map still holds this actor (a session deleted or
            // replaced meanwhile keeps what the map did).
            let map = store.write();
            if !map
                .hot
                .get(&*self.me.id)
                .is_some_and(|h| Arc::ptr_eq(&h.state, &self.me))
            {
                return;
            }
            // The new row holds every change so far: the log starts again after it.
            j.d.seq = 0;
            j.d.log_bytes = 0;
            j.d.snapshot_bytes = snapshot.len() as u64;
            j.resync = false;
            j.unsent.clear();
            j.unsent_bytes = 0;
            j.creating = true;
            let waiting = std::mem::take(&mut j.waiting);
            if let Some(r) = rewrite.as_mut() {
                r.set(snapshot.len() as u64);
            }
            j.rewrite = rewrite;
            let create = vec![Write::Create {
                id: self.me.id.to_string(),
                incarnation: j.d.incarnation,
                snapshot,
            }];
            j.send(create, waiting);
            j.hasten_rewrite();
            drop(map);
            return;
        }
        if j.unsent.is_empty() && !j.resync {
            return;
        }
        j.creating = false;
        if j.resync || snapshot_due(j.d.log_bytes, j.d.snapshot_bytes) {
            let Some(snapshot) = encoded(&self.me) else {
                return;
            };
            j.d.snapshot_bytes = snapshot.len() as u64;
            j.d.log_bytes = 0;
            j.resync = false;
            if let Some(r) = rewrite.as_mut() {
                r.set(snapshot.len() as u64);
            }
            j.rewrite = rewrite;
            j.unsent.push(Write::Snapshot {
                id: self.me.id.to_string(),
                incarnation: j.d.incarnation,
                seq: j.d.seq,
                snapshot,
            });
        }
        let writes = std::mem::take(&mut j.unsent);
        j.unsent_bytes = 0;
        let waiting = std::mem::take(&mut j.waiting);
        j.send(writes, waiting);
        j.hasten_rewrite();
    }

    /// The batch in flight is durable, or failed.
    async fn committed(&mut self, result: Result<(), BackendError>) {
        let Some(j) = self.journal.as_mut() else {
            return;
        };
        let Some((_, delivers)) = j.outstanding.take() else {
            return;
        };
        j.rewrite = None;
        j.account();
        let replaced = j.replaced.take();
        let created = j.creating;
        if result.is_ok() {
            j.failures = 0;
            j.retry_at = None;
            j.leave_failures = 0;
            j.leave_retry_at = None;
        } else if !j.waits {
            // Acknowledged already (interval): written again, after a wait that grows.
            j.failures = j.failures.saturating_add(1);
            let wait = spread(retry_delay(j.failures), &self.me.id, j.failures);
            j.retry_at = Some(tokio::time::Instant::now() + wait);
        }
        match result {
            Ok(()) => {
                for d in delivers {
                    d(Ok(()));
                }
                // Results that waited only because a batch was in flight.
                if j.unsent.is_empty() {
                    for d in std::mem::take(&mut j.waiting) {
                        d(Ok(()));
                    }
                }
            }
            Err(e) if j.waits && j.creating => {
                // Nothing was acknowledged: the session never existed. What the map held
                // before takes its place again.
                tracing::warn!(error = %e, "the new session was not written; taking it back out");
                let err = StoreError::Storage(e);
                let mut failed = delivers;
                failed.append(&mut j.waiting);
                j.unsent.clear();
                j.unsent_bytes = 0;
                self.drop_from_map(replaced);
                for d in failed {
                    d(Err(err.clone()));
                }
            }
            Err(e) if j.waits => {
                tracing::warn!(error = %e, "changes not written; reloading the session from disk");
                let err = StoreError::Storage(e);
                let mut failed = delivers;
                failed.append(&mut j.waiting);
                j.unsent.clear();
                j.unsent_bytes = 0;
                self.reload().await;
                for d in failed {
                    d(Err(err.clone()));
                }
            }
            Err(BackendError::Closed) => {
                // The backend is closed (the store is closing): nothing can be written any
                // more, and trying again at once would only spin.
                tracing::warn!("changes not written: the session store is closed");
                for d in delivers {
                    d(Ok(()));
                }
            }
            Err(e) if j.creating => {
                // The session's new row was not written: try again with the next batch.
                tracing::warn!(error = %e, failures = j.failures, "the session was not written whole; writing it again");
                j.recreate = true;
                for d in delivers {
                    d(Ok(()));
                }
            }
            Err(e) => {
                // Already acknowledged (interval): write the whole session next time.
                tracing::warn!(error = %e, failures = j.failures, "changes not written; the next write is a snapshot");
                j.resync = true;
                for d in delivers {
                    d(Ok(()));
                }
            }
        }
        if let Some(j) = self.journal.as_mut() {
            j.account();
        }
        if created {
            // Only now: a failed one has put back what the map held (a replacement waits
            // for this before it replaces the session).
            self.me.creating.store(false, Ordering::Release);
        }
    }

    /// After a job panicked on a durable session, whose copy in memory may be half
    /// changed: rebuilds it from what the disk holds and the changes logged since (each
    /// from a job that ran whole), replayed as a load replays its log, so it is exactly
    /// as before the job and its unsent changes are written as they were. Where that
    /// cannot be done exactly (the next write was to be the session whole, or the disk
    /// does not read back), the session leaves memory and loads from the disk on its next
    /// use, losing what a crash would lose.
    async fn recover(&mut self) {
        self.recovering = false;
        if let Some((rx, _)) = self.journal.as_mut().and_then(|j| j.outstanding.as_mut()) {
            // The batch in flight lands first: then the disk holds every change sent.
            let r = rx.await.unwrap_or(Err(BackendError::Closed));
            self.committed(r).await;
        }
        if self.failed {
            return;
        }
        let Some(j) = self.journal.as_mut() else {
            return;
        };
        if j.resync || j.recreate {
            tracing::error!("the session cannot be rebuilt after a panic; dropping it from memory");
            self.drop_from_map(Some(Previous::Cold));
            return;
        }
        let pending: Vec<Vec<u8>> = j
            .unsent
            .iter()
            .filter_map(|w| match w {
                Write::Append { change, .. } => Some(change.clone()),
                _ => None,
            })
            .collect();
        let expected = j.d.seq;
        let incarnation = j.d.incarnation;
        let backend = j.d.backend.clone();
        let id = self.me.id.to_string();
        let config = self.config.clone();
        // A turn among the store's loads, as a reload's: a bug that panics one kind of
        // job on every session would otherwise read them all back at once, each beside
        // its copy in memory.
        let turn = match self.me.store.upgrade() {
            Some(store) => store.loads.take().await,
            None => None,
        };
        let rebuilt = tokio::task::spawn_blocking(move || -> Result<restore::Restored, String> {
            let _turn = turn;
            let stored = backend
                .load(&id)
                .map_err(|e| e.to_string())?
                .ok_or("the session is no longer stored")?;
            let mut r = restore::restore(&id, stored, &config).map_err(|e| e.to_string())?;
            for bytes in pending {
                let change = crate::engine::decode_change(&bytes).map_err(|e| e.to_string())?;
                match r.session.replay(change, &config) {
                    crate::engine::Performed::Step(Err(e)) => return Err(e.to_string()),
                    crate::engine::Performed::CommitCompaction(Err(e)) => {
                        return Err(e.to_string());
                    }
                    _ => {}
                }
                r.seq = r.seq.saturating_add(1);
            }
            Ok(r)
        })
        .await;
        match rebuilt {
            Ok(Ok(r)) if r.incarnation == incarnation && r.seq == expected => {
                if let Some(locked) = lock_cell(&self.me).as_mut() {
                    // The same value as before the job: a compaction planned on it commits.
                    locked.rebuilt(r.session, &self.me.published);
                }
                tracing::warn!("the session was rebuilt from the disk after a panic");
            }
            other => {
                let why = match other {
                    Ok(Err(e)) => e,
                    Err(e) => e.to_string(),
                    Ok(Ok(r)) => format!(
                        "the disk holds incarnation {} up to change {}, not {incarnation} up to {expected}",
                        r.incarnation, r.seq
                    ),
                };
                tracing::error!(error = %why, "cannot rebuild the session after a panic; dropping it from memory");
                self.drop_from_map(Some(Previous::Cold));
            }
        }
    }

    /// Puts back the session as the disk has it (after a failed commit). If even that
    /// fails, the session is dropped from memory: it is loaded again on its next use.
    async fn reload(&mut self) {
        let Some(j) = self.journal.as_mut() else {
            return;
        };
        let backend = j.d.backend.clone();
        let id = self.me.id.to_string();
        let config = self.config.clone();
        // A turn among the store's loads: every session with a batch in flight reloads
        // when the disk fills, each beside its copy in memory.
        let turn = match self.me.store.upgrade() {
            Some(store) => store.loads.take().await,
            None => None,
        };
        let loaded = tokio::task::spawn_blocking(move || {
            let _turn = turn;
            let stored = backend.load(&id)?;
            stored
                .map(|s| restore::restore(&id, s, &config))
                .transpose()
        })
        .await;
        match loaded {
            Ok(Ok(Some(r))) if r.incarnation == j.d.incarnation => {
                j.d.seq = r.seq;
                j.d.log_bytes = r.log_bytes;
                j.d.snapshot_bytes = r.snapshot_bytes;
                if let Some(locked) = lock_cell(&self.me).as_mut() {
                    // The same session, short of the refused change: a compaction running
                    // on it still commits.
                    locked.rebuilt(r.session, &self.me.published);
                }
            }
            other => {
                let why = match other {
                    Ok(Err(e)) => e.to_string(),
                    Err(e) => e.to_string(),
                    _ => "the session is no longer stored".to_string(),
                };
                tracing::error!(error = %why, "cannot reload the session after a failed commit; dropping it from memory");
                self.drop_from_map(Some(Previous::Cold));
            }
        }
    }

    /// Takes the session out of memory for good (the jobs still queued are dropped
    /// unrun): under the map lock, and only while the map holds this actor, `instead`
    /// takes its place (None: nothing; a session in memory whose actor has ended: the
    /// disk's copy).
    fn drop_from_map(&mut self, instead: Option<Previous>) {
        self.failed = true;
        if let Some(store) = self.me.store.upgrade() {
            let mut map = store.write();
            *lock(&self.me.gate) = true;
            if self.in_map(&map) {
                let id: &str = &self.me.id;
                map.hot.remove(id);
                match instead {
                    Some(Previous::Hot(h)) if !h.tx.is_closed() => {
                        map.hot.insert(id.to_string(), h);
                    }
                    Some(_) => {
                        map.cold.insert(id.to_string());
                    }
                    None => {}
                }
            }
        }
        self.rx.close();
    }

    /// Sends what is pending (with a snapshot when the log has grown) and waits until it
    /// is durable.
    async fn flush(&mut self) -> Result<(), StoreError> {
        let mut retried = false;
        loop {
            if self.failed {
                return Ok(());
            }
            let Some(j) = self.journal.as_mut() else {
                return Ok(());
            };
            if let Some((rx, _)) = j.outstanding.as_mut() {
                // Waited for: written now, not at the end of the interval (a session going
                // cold under memory pressure would otherwise hold its memory that long).
                j.d.backend.expedite();
                let r = rx.await.unwrap_or(Err(BackendError::Closed));
                let failed = r.clone().err();
                let waits = j.waits;
                self.committed(r).await;
                if let Some(e) = failed {
                    // Under `interval` the failed batch was acknowledged already and the
                    // next one writes it again (the session whole): it gets one try
                    // before the flush gives up, or a close would lose what a retry
                    // would have written.
                    if waits || retried || matches!(e, BackendError::Closed) {
                        return Err(StoreError::Storage(e));
                    }
                    retried = true;
                }
                continue;
            }
            if j.unsent.is_empty() && !j.resync && !j.recreate {
                return Ok(());
            }
            self.send_batch(true);
        }
    }

    /// True when the map holds this actor under its id.
    fn in_map(&self, map: &super::Map) -> bool {
        map.hot
            .get(&*self.me.id)
            .is_some_and(|h| Arc::ptr_eq(&h.state, &self.me))
    }

    /// Leaves the store (idle TTL or memory pressure), unless a message slipped in (see
    /// the module doc). A durable session is written out first (a final snapshot, so its
    /// next load reads no log) and stays on disk, cold.
    /// `ttl`: leaving for being idle this long, it stays when a job ran inline since.
    async fn leave(&mut self, ttl: Option<std::time::Duration>, reason: &'static str) -> Leave {
        let Some(store) = self.me.store.upgrade() else {
            return Leave::Orphan;
        };
        let announce = store.evictions();
        if self.journal.is_none() && announce.as_ref().is_none_or(|a| a.is_closed()) {
            return Leave::Unheard;
        }
        if !self.in_map(&store.read()) {
            // Before writing anything out: an orphan has nothing to go cold as.
            return Leave::Orphan;
        }
        // Under `interval`, a disk that refused this session's last write is not tried
        // again before its wait is over (memory pressure asks after every job). A close
        // flushes through `Msg::Flush` whatever the wait.
        // Nor, under either durability, is a session whose last try to go cold failed
        // tried again before its own wait is over.
        let now = tokio::time::Instant::now();
        if self.journal.as_ref().is_some_and(|j| {
            j.retry_at.is_some_and(|at| at > now) || j.leave_retry_at.is_some_and(|at| at > now)
        }) {
            return Leave::Unsaved;
        }
        if let Some(j) = self.journal.as_mut()
            && j.d.log_bytes > 0
        {
            j.d.log_bytes = j.d.log_bytes.max(snapshot_threshold(j.d.snapshot_bytes));
            if j.unsent.is_empty() {
                j.resync = true;
            }
        }
        if self.flush().await.is_err() {
            if let Some(j) = self.journal.as_mut() {
                j.leave_failures = j.leave_failures.saturating_add(1);
                let wait = spread(retry_delay(j.leave_failures), &self.me.id, j.leave_failures);
                j.leave_retry_at = Some(tokio::time::Instant::now() + wait);
            }
            return Leave::Unsaved;
        }
        {
            let mut map = store.write();
            let mut evicted = lock(&self.me.gate);
            match self.rx.try_recv() {
                Ok(msg) => return Leave::Stay(msg),
                Err(TryRecvError::Disconnected) => return Leave::Ended,
                Err(TryRecvError::Empty) => {}
            }
            if !self.in_map(&map) {
                return Leave::Orphan;
            }
            // A job run inline starts under the gate: one started since the actor looked
            // has marked the session used, and one still running holds the cell.
            if ttl.is_some_and(|ttl| self.idle_for() < ttl) {
                return Leave::Used;
            }
            let Some(cell) = try_lock_cell(&self.me) else {
                return Leave::Used;
            };
            let id: &str = &self.me.id;
            *evicted = true;
            map.hot.remove(id);
            if let Some(j) = &self.journal {
                map.cold.insert(id.to_string());
                if let Some(locked) = cell.as_ref() {
                    let resume = locked.session.to_resume();
                    map.resume.insert(id.to_string(), (j.d.incarnation, resume));
                }
            }
            drop(cell);
            self.rx.close();
        }
        store.observe(&StoreEvent::Evicted { reason });
        if let Some(announce) = announce {
            let _ = announce.send(Evicted {
                session_id: self.me.id.to_string(),
                idle: self.idle_for(),
                reason,
                cold: self.journal.is_some(),
            });
        }
        Leave::Evicted
    }
}

/// The gate's lock. Poisoned only by a panic while held (a flag store or a channel
/// send), after which the flag is still accurate.
fn lock(gate: &Mutex<bool>) -> std::sync::MutexGuard<'_, bool> {
    gate.lock().unwrap_or_else(|e| e.into_inner())
}

/// Runs what a job asked to announce once durable (`Tx::announce_when_durable`), only
/// while the store's map holds `state` under its id, and under the map's lock: a delete
/// (or a replacement) takes the session out under the same lock before the server
/// publishes its `gone`, so nothing the old session announces follows that. A delete the
/// disk then refuses puts the session back without what it announced meanwhile.
fn announce(state: &Arc<State>, then: Vec<Box<dyn FnOnce() + Send>>) {
    if then.is_empty() {
        return;
    }
    let Some(store) = state.store.upgrade() else {
        return;
    };
    let map = store.read();
    if map
        .hot
        .get(&*state.id)
        .is_some_and(|h| Arc::ptr_eq(&h.state, state))
    {
        run_when_durable(then);
    }
}

/// Runs what a job asked to run once durable (`Tx::when_durable`); one that panics is
/// logged and the rest run, as the actor must go on (a panic here would end it).
fn run_when_durable(then: Vec<Box<dyn FnOnce() + Send>>) {
    for f in then {
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).is_err() {
            tracing::error!("what waited for a change to be durable panicked");
        }
    }
}

/// The session's lock. Jobs run under `catch_unwind`, so a poisoned lock means something
/// else panicked while holding it, leaving the session maybe half changed: it is dropped.
fn lock_cell(state: &State) -> std::sync::MutexGuard<'_, Option<Locked>> {
    state.cell.lock().unwrap_or_else(|e| {
        let mut cell = e.into_inner();
        *cell = None;
        state.cell.clear_poison();
        cell
    })
}

/// [`lock_cell`] unless a job holds it (None).
fn try_lock_cell(state: &State) -> Option<std::sync::MutexGuard<'_, Option<Locked>>> {
    match state.cell.try_lock() {
        Ok(cell) => Some(cell),
        Err(std::sync::TryLockError::WouldBlock) => None,
        Err(std::sync::TryLockError::Poisoned(e)) => {
            // Held already (the error carries the guard): emptied as `lock_cell` does.
            let mut cell = e.into_inner();
            *cell = None;
            state.cell.clear_poison();
            Some(cell)
        }
    }
}

/// The session encoded whole (None once it is gone).
fn encoded(state: &State) -> Option<Vec<u8>> {
    lock_cell(state)
        .as_ref()
        .map(|l| encode_session(&l.session))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sessions_failing_together_wait_spread_over_half_the_wait_again() {
        let delay = retry_delay(3);
        let waits: std::collections::BTreeSet<_> = (0..64)
            .map(|i| spread(delay, &format!("session-{i}"), 3))
            .collect();
        assert!(waits.iter().all(|w| *w >= delay && *w < delay * 3 / 2));
        assert!(waits.len() > 48, "{} distinct waits of 64", waits.len());
        let (first, last) = (waits.first().copied(), waits.last().copied());
        assert!(
            first.zip(last).is_some_and(|(a, b)| b - a > delay / 4),
            "{first:?}..{last:?}"
        );
    }
}
