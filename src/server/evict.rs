//! Idle evictions, announced: sessions evict themselves (see `store`); the server tells
//! `Subscribe` watchers (`evicted`), counts them and logs them, until the drain closes it.

use std::sync::Arc;

use tokio::sync::mpsc;

use super::hub::Hub;
use super::pb;
use crate::store::Evicted;

/// Announces each eviction until the drain closes the server; then drops the receiver,
/// which stops the evictions (sessions stay as they are while the process exits).
pub async fn announce(hub: Arc<Hub>, mut evictions: mpsc::UnboundedReceiver<Evicted>) {
    let closing = hub.closing();
    loop {
        let evicted = tokio::select! {
            _ = closing.cancelled() => return,
            e = evictions.recv() => match e {
                Some(e) => e,
                None => return,
            },
        };
        let idle_ms = u64::try_from(evicted.idle.as_millis()).unwrap_or(u64::MAX);
        tracing::info!(session_id = %evicted.session_id, idle_ms, reason = evicted.reason, cold = evicted.cold, "session evicted");
        hub.publish(
            &evicted.session_id,
            pb::session_event::Event::Evicted(pb::SessionEvicted {
                reason: evicted.reason.into(),
                idle_ms,
            }),
        );
    }
}
