//! Deletes under `Durability::Interval`, acknowledged before they are written. A delete
//! the disk refuses (full, failing) would leave the session's row behind, and the deleted
//! session would come back after a restart. Each is written again, after the same waits
//! as a failing session's writes, until it lands, the id is taken by a new session (whose
//! first write replaces the row), or the store closes; the close writes once more what is
//! still pending.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use super::actor::{retry_delay, spread};
use super::backend::{Backend, BackendError, Committed, Write};
use super::{Map, Shared};

/// Tells the tasks following deletes of the same id apart (an id deleted, created and
/// deleted again has two).
static TICKETS: AtomicU64 = AtomicU64::new(0);

/// Records `id` as deleted and not yet written; under the map lock, where the delete is
/// queued.
pub(super) fn ticket(map: &mut Map, id: &str) -> u64 {
    let ticket = TICKETS.fetch_add(1, Ordering::Relaxed);
    map.deleting.insert(id.to_string(), ticket);
    ticket
}

/// Follows the delete of `id` queued as `committed` until it lands, on a task of its own.
pub(super) fn follow(
    shared: &Arc<Shared>,
    backend: &Arc<dyn Backend>,
    id: &str,
    ticket: u64,
    committed: Committed,
) {
    let (shared, backend, id) = (shared.clone(), backend.clone(), id.to_string());
    tokio::spawn(async move {
        let mut committed = committed;
        let mut failures: u32 = 0;
        loop {
            match committed.await.unwrap_or(Err(BackendError::Closed)) {
                Ok(()) => break,
                // Shutting down: the close writes what is still pending.
                Err(BackendError::Closed) => return,
                Err(e) => {
                    failures = failures.saturating_add(1);
                    tracing::warn!(session_id = %id, error = %e, "a deleted session's delete was not written; trying again");
                }
            }
            tokio::time::sleep(spread(retry_delay(failures), &id, failures)).await;
            // Under the map lock, as a new session's first write is queued: a delete
            // queued here cannot overtake it.
            let mut map = shared.write();
            if map.deleting.get(&id) != Some(&ticket) {
                return; // a later delete follows the id
            }
            if map.hot.contains_key(&id) || map.cold.contains(&id) {
                // A new session holds the id: its first write replaces the row.
                map.deleting.remove(&id);
                return;
            }
            committed = backend.write(vec![Write::Delete { id: id.clone() }]);
        }
        let mut map = shared.write();
        if map.deleting.get(&id) == Some(&ticket) {
            map.deleting.remove(&id);
        }
    });
}

/// Writes, once each, the deletes still pending (the store is closing), and logs those
/// the disk still refuses: their sessions will be back after a restart.
pub(super) async fn write_pending(shared: &Arc<Shared>, backend: &Arc<dyn Backend>) {
    let queued: Vec<(String, Committed)> = {
        let mut map = shared.write();
        let ids: Vec<String> = map.deleting.keys().cloned().collect();
        let mut queued = Vec::with_capacity(ids.len());
        for id in ids {
            if map.hot.contains_key(&id) || map.cold.contains(&id) {
                map.deleting.remove(&id);
                continue;
            }
            queued.push((id.clone(), backend.write(vec![Write::Delete { id }])));
        }
        queued
    };
    for (id, committed) in queued {
        match committed.await.unwrap_or(Err(BackendError::Closed)) {
            Ok(()) => {
                shared.write().deleting.remove(&id);
            }
            Err(e) => {
                tracing::error!(session_id = %id, error = %e, "a deleted session's delete could not be written at shutdown; it will be back after a restart");
            }
        }
    }
}
