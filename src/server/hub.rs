//! What every handler shares: the store, the event bus `Subscribe` watchers read, the
//! summarizer, and the compactions in flight (one per session).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tokio_util::task::task_tracker::TaskTrackerToken;

use super::counting::CountPool;
use super::pb;
use super::status::Rejection;
use crate::engine::{Generation, TailOptions};
use crate::store::{Reservation, Store};
use crate::summarize::{PromptConfig, Summarizer};

/// Events buffered for watchers; a watcher further behind than this is dropped.
pub const BUS_CAPACITY: usize = 4096;

/// An event on the bus, its encoded bytes counted in flight for as long as it lives: the
/// bus keeps an event until the last watcher took it, and a watcher waiting for room
/// keeps every event published after its own (a `pruned` event lists every part it
/// cleared), so the bus alone could hold [`BUS_CAPACITY`] large events.
#[derive(Debug)]
pub struct Published {
    /// The event as watchers send it (`event: None`: the session was deleted).
    pub session_event: pb::SessionEvent,
    /// Its encoded bytes in the ledger, given back when the last holder (the bus, a
    /// watcher's buffer) drops it; never refused (the session's change is made).
    pub(crate) _counted: Reservation,
}

/// Compaction settings of the server.
#[derive(Debug, Clone)]
pub struct CompactionConfig {
    /// The summarizer, when an endpoint is configured.
    pub summarizer: Option<Arc<dyn Summarizer>>,
    /// Prompts (overridable per request).
    pub prompts: PromptConfig,
    /// User turns kept verbatim after a summary.
    pub tail_turns: u32,
    /// Token budget of the verbatim tail; `None`: 25% of usable input, clamped 2k–15k.
    pub tail_tokens: Option<u64>,
    /// Models sessions and requests may pick (empty: any). The operator pays for them.
    pub allowed_models: Vec<String>,
}

impl Default for CompactionConfig {
    fn default() -> Self {
        CompactionConfig {
            summarizer: None,
            prompts: PromptConfig::default(),
            tail_turns: 2,
            tail_tokens: None,
            allowed_models: Vec::new(),
        }
    }
}

impl CompactionConfig {
    /// Refuses a client-chosen compaction model that is too long or outside
    /// `allowed_models` (field names it).
    pub fn check_model(&self, field: &str, model: &str) -> Result<(), Rejection> {
        if let Err(e) = crate::config::model_name("model", model) {
            return Err(Rejection::invalid(field, e.message));
        }
        if self.allowed_models.is_empty() || self.allowed_models.iter().any(|m| m == model) {
            return Ok(());
        }
        Err(Rejection {
            code: tonic::Code::PermissionDenied,
            field: field.to_string(),
            message: format!(
                "model {model:?} is not in --compaction-allowed-models ({})",
                self.allowed_models.join(", ")
            ),
        })
    }

    /// Tail options for a session with the given usable input.
    pub fn tail(&self, turns: Option<u32>, usable_input: u64) -> TailOptions {
        TailOptions {
            turns: turns.unwrap_or(self.tail_turns),
            max_tokens: self
                .tail_tokens
                .unwrap_or_else(|| crate::engine::default_tail_tokens(usable_input)),
        }
    }
}

/// A compaction in flight.
#[derive(Debug, Clone)]
pub struct Running {
    /// Its id.
    pub id: String,
    /// Fires to stop it (and its HTTP request).
    pub cancel: CancellationToken,
}

/// A claimed compaction slot: the compaction, the session value it summarizes, and its
/// place in the drain's count (given back when the slot is released).
#[derive(Debug)]
struct Slot {
    running: Running,
    target: Target,
    _tracked: TaskTrackerToken,
}

/// Which session value a compaction summarizes, as far as its slot knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Target {
    /// Still planning (the slot is claimed before the plan is made): the value is not
    /// known yet. `replaced` is set when the session was deleted or replaced meanwhile:
    /// the value its id holds now (`None`: none), so the plan, once made, is cancelled
    /// unless it was made on that value.
    Planning {
        replaced: Option<Option<Generation>>,
    },
    /// Planned on this value.
    Planned(Generation),
}

/// A claimed compaction slot, freed when dropped. Whoever drives the compaction holds
/// it (the starting call, then the compaction's task), so a start dropped mid-way (tonic
/// drops a `Compact` whose client went away or whose deadline passed) frees the slot too.
pub struct Claim {
    hub: Arc<Hub>,
    session_id: String,
    running: Running,
}

impl Claim {
    /// The compaction holding the slot.
    pub fn running(&self) -> &Running {
        &self.running
    }

    /// Records the session value the compaction was planned on. If the session was
    /// deleted or replaced while it was planning ([`Hub::cancel_replaced`]) and the plan
    /// was not made on the value its id holds now, the compaction is cancelled: true then.
    pub fn planned_on(&self, generation: Generation) -> bool {
        let mut slots = self.hub.slots();
        let Some(slot) = slots
            .get_mut(&self.session_id)
            .filter(|s| s.running.id == self.running.id)
        else {
            return false;
        };
        let replaced = match slot.target {
            Target::Planning {
                replaced: Some(now),
            } => now != Some(generation),
            Target::Planning { replaced: None } | Target::Planned(_) => false,
        };
        slot.target = Target::Planned(generation);
        if replaced {
            slot.running.cancel.cancel();
        }
        replaced
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        self.hub.release(&self.session_id, &self.running.id);
    }
}

impl std::fmt::Debug for Claim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Claim")
            .field("session_id", &self.session_id)
            .field("running", &self.running)
            .finish_non_exhaustive()
    }
}

/// How long cancelled compactions get to report before the drain closes the streams.
const CANCEL_GRACE: Duration = Duration::from_secs(2);

/// Default of [`Hub::slow_reader_grace`].
pub const DEFAULT_SLOW_READER_GRACE: Duration = Duration::from_secs(10);

/// The wait the server uses for a configured one (the slow-reader grace, the drain's
/// deadline): at most a day (a huge value means "wait as long as it takes"; a day is as
/// good, and a deadline of `now + wait` must not overflow the clock). The command line's
/// floor of a second for the grace is `main.rs`'s.
pub fn bounded_wait(configured: Duration) -> Duration {
    configured.min(Duration::from_secs(86_400))
}

/// Shared server state.
#[derive(Debug)]
pub struct Hub {
    /// Sessions.
    pub store: Arc<Store>,
    /// Every session event, for `Subscribe`.
    pub bus: broadcast::Sender<Arc<Published>>,
    /// Compaction settings.
    pub compaction: CompactionConfig,
    /// How long a `Stream` may leave its event buffer full before it is closed.
    pub slow_reader_grace: Duration,
    /// The threads that count new parts' long texts off the runtime.
    pub(crate) count_pool: CountPool,
    /// Session id → its running compaction. A std mutex: held for one map operation,
    /// never across an await.
    running: Mutex<HashMap<String, Slot>>,
    /// Counts the claimed slots, so the drain waits for the last one without polling.
    compactions: TaskTracker,
    next_id: AtomicU64,
    /// Fires when the drain begins: no new streams or compactions.
    draining: CancellationToken,
    /// Fires when the drain closes the open streams (with `UNAVAILABLE`).
    closing: CancellationToken,
}

impl Hub {
    /// A hub over `store`.
    pub fn new(store: Arc<Store>, compaction: CompactionConfig) -> Hub {
        let (bus, _) = broadcast::channel(BUS_CAPACITY);
        Hub {
            store,
            bus,
            compaction,
            slow_reader_grace: DEFAULT_SLOW_READER_GRACE,
            count_pool: CountPool::per_core(),
            running: Mutex::new(HashMap::new()),
            compactions: TaskTracker::new(),
            next_id: AtomicU64::new(1),
            draining: CancellationToken::new(),
            closing: CancellationToken::new(),
        }
    }

    /// True once the drain began (new streams and compactions are refused).
    pub fn is_draining(&self) -> bool {
        self.draining.is_cancelled()
    }

    /// Fires when open streams must end.
    pub fn closing(&self) -> CancellationToken {
        self.closing.clone()
    }

    /// Drains: refuses new streams and compactions, lets running compactions finish for
    /// up to `deadline` (then cancels them: a cancelled compaction changes nothing), and
    /// closes the open streams. Returns how many compactions had to be cancelled.
    pub async fn drain(&self, deadline: Duration) -> usize {
        {
            // Under the slot lock: a `claim` either ran before (and is waited for below)
            // or sees the drain and refuses.
            let _slots = self.slots();
            self.draining.cancel();
        }
        self.compactions.close();
        let running = self.compactions.len();
        if running > 0 {
            tracing::info!(
                running,
                deadline_secs = deadline.as_secs(),
                "draining: waiting for running compactions"
            );
        }
        let deadline = bounded_wait(deadline);
        let mut cancelled = 0;
        if tokio::time::timeout(deadline, self.compactions.wait())
            .await
            .is_err()
        {
            {
                let slots = self.slots();
                for slot in slots.values() {
                    slot.running.cancel.cancel();
                }
                cancelled = slots.len();
            }
            tracing::warn!(cancelled, "drain deadline reached; cancelling compactions");
            // Give the cancelled jobs a moment to report before the streams close.
            let _ = tokio::time::timeout(CANCEL_GRACE, self.compactions.wait()).await;
        }
        self.closing.cancel();
        cancelled
    }

    fn slots(&self) -> std::sync::MutexGuard<'_, HashMap<String, Slot>> {
        // Poisoned only by a panic while held; every change is one insert or remove.
        self.running.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sends an event to the watchers (none listening is fine).
    pub fn publish(&self, session_id: &str, event: pb::session_event::Event) {
        self.send(session_id, Some(event));
    }

    /// Tells the watchers of `session_id` that it was deleted: they end with `NOT_FOUND`.
    /// It travels on the bus as an event with no content, after the session's earlier
    /// events, and is never sent to a client (`watch.rs`).
    pub fn gone(&self, session_id: &str) {
        self.send(session_id, None);
    }

    /// Puts an event on the bus, counted in flight ([`Published`]); with no watcher it is
    /// neither built nor counted (the bus would refuse it).
    fn send(&self, session_id: &str, event: Option<pb::session_event::Event>) {
        if self.bus.receiver_count() == 0 {
            return;
        }
        let session_event = pb::SessionEvent {
            session_id: session_id.to_string(),
            event,
        };
        let bytes = u64::try_from(prost::Message::encoded_len(&session_event)).unwrap_or(u64::MAX);
        let counted = self.store.ledger().count(bytes, "events");
        let _ = self.bus.send(Arc::new(Published {
            session_event,
            _counted: counted,
        }));
    }

    /// Claims the session's compaction slot, held until the returned [`Claim`] drops;
    /// refused while draining or when another compaction holds it (named in the error).
    pub fn claim(self: &Arc<Self>, session_id: &str) -> Result<Claim, Refused> {
        let mut slots = self.slots();
        if self.draining.is_cancelled() {
            return Err(Refused::Draining);
        }
        if let Some(slot) = slots.get(session_id) {
            return Err(Refused::Busy(slot.running.clone()));
        }
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        let running = Running {
            id: format!("cmp_{}_{n}", super::clock::now_ms()),
            cancel: CancellationToken::new(),
        };
        slots.insert(
            session_id.to_string(),
            Slot {
                running: running.clone(),
                target: Target::Planning { replaced: None },
                _tracked: self.compactions.token(),
            },
        );
        Ok(Claim {
            hub: self.clone(),
            session_id: session_id.to_string(),
            running,
        })
    }

    /// Cancels the session's running compaction; returns its id.
    pub fn cancel(&self, session_id: &str) -> Option<String> {
        self.slots().get(session_id).map(|slot| {
            slot.running.cancel.cancel();
            slot.running.id.clone()
        })
    }

    /// Cancels the session's running compaction if it summarizes a session value the id
    /// no longer holds: the session was deleted or replaced, and `now` is the value it
    /// holds now (`None`: none). A compaction planned on `now` (started on the new
    /// session while the replacement was being written) goes on. One still planning is
    /// decided when its plan is made ([`Claim::planned_on`]). Returns the id of the
    /// compaction cancelled.
    pub fn cancel_replaced(&self, session_id: &str, now: Option<Generation>) -> Option<String> {
        let mut slots = self.slots();
        let slot = slots.get_mut(session_id)?;
        match slot.target {
            Target::Planned(g) if Some(g) == now => None,
            Target::Planned(_) => {
                slot.running.cancel.cancel();
                Some(slot.running.id.clone())
            }
            Target::Planning { .. } => {
                slot.target = Target::Planning {
                    replaced: Some(now),
                };
                None
            }
        }
    }

    /// Frees the session's compaction slot if `id` holds it (a drain waiting for it
    /// wakes when the last slot is freed). Only a [`Claim`] dropping calls it.
    fn release(&self, session_id: &str, id: &str) {
        let mut slots = self.slots();
        if slots.get(session_id).is_some_and(|s| s.running.id == id) {
            slots.remove(session_id);
        }
    }
}

/// Why a compaction slot was not claimed.
#[derive(Debug, Clone)]
pub enum Refused {
    /// The server is draining and starts no new compactions.
    Draining,
    /// This compaction is already running for the session.
    Busy(Running),
}
