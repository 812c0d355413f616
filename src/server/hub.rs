//! What every handler shares: the store, the event bus `Subscribe` watchers read, the
//! summarizer, and the compactions in flight (one per session).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

use super::pb;
use crate::engine::TailOptions;
use crate::store::Store;
use crate::summarize::{PromptConfig, Summarizer};

/// Events buffered for watchers; a watcher further behind than this is dropped.
pub const BUS_CAPACITY: usize = 4096;

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
}

impl Default for CompactionConfig {
    fn default() -> Self {
        CompactionConfig {
            summarizer: None,
            prompts: PromptConfig::default(),
            tail_turns: 2,
            tail_tokens: None,
        }
    }
}

impl CompactionConfig {
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

/// Shared server state.
#[derive(Debug)]
pub struct Hub {
    /// Sessions.
    pub store: Arc<Store>,
    /// Every session event, for `Subscribe`.
    pub bus: broadcast::Sender<Arc<pb::SessionEvent>>,
    /// Compaction settings.
    pub compaction: CompactionConfig,
    /// Session id → its running compaction. A std mutex: held for one map operation,
    /// never across an await.
    running: Mutex<HashMap<String, Running>>,
    next_id: AtomicU64,
}

impl Hub {
    /// A hub over `store`.
    pub fn new(store: Arc<Store>, compaction: CompactionConfig) -> Hub {
        let (bus, _) = broadcast::channel(BUS_CAPACITY);
        Hub {
            store,
            bus,
            compaction,
            running: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
        }
    }

    /// Sends an event to the watchers (none listening is fine).
    pub fn publish(&self, session_id: &str, event: pb::session_event::Event) {
        let _ = self.bus.send(Arc::new(pb::SessionEvent {
            session_id: session_id.to_string(),
            event: Some(event),
        }));
    }

    /// Claims the session's compaction slot, or names the compaction holding it.
    pub fn claim(&self, session_id: &str) -> Result<Running, Running> {
        let mut map = self.running.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(r) = map.get(session_id) {
            return Err(r.clone());
        }
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        let r = Running {
            id: format!("cmp_{}_{n}", super::ops::now_ms()),
            cancel: CancellationToken::new(),
        };
        map.insert(session_id.to_string(), r.clone());
        Ok(r)
    }

    /// Cancels the session's running compaction; returns its id.
    pub fn cancel(&self, session_id: &str) -> Option<String> {
        let map = self.running.lock().unwrap_or_else(|e| e.into_inner());
        map.get(session_id).map(|r| {
            r.cancel.cancel();
            r.id.clone()
        })
    }

    /// Frees the session's compaction slot if `id` holds it.
    pub fn release(&self, session_id: &str, id: &str) {
        let mut map = self.running.lock().unwrap_or_else(|e| e.into_inner());
        if map.get(session_id).is_some_and(|r| r.id == id) {
            map.remove(session_id);
        }
    }
}
