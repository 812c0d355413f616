//! The `Subscribe` RPC's events: a task per watcher takes the session events the bus
//! publishes (all of them, or one session's) and buffers them for the client.
//!
//! What a watcher costs is bounded like a `Stream`'s outbound buffer (`outbound.rs`):
//! every event buffered holds a reservation in the store's ledger until the response body
//! takes it, so it counts against `memory_budget`; a watcher whose buffer is full is
//! dropped at once (it never makes the bus wait); and one that leaves events untaken for
//! the slow-reader grace has them dropped, its call ended `RESOURCE_EXHAUSTED`.
//!
//! The bus counts each event from its publication (`hub::Published`) for as long as it
//! lives, and watchers buffer the event itself, shared: however many watchers hold it,
//! one copy is counted once. A watcher never waits for room in flight (the change the
//! event reports is made), and its copy is made only as the response body takes it, to
//! encode it at once, when other watchers still hold it.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{broadcast, mpsc, oneshot};
use tokio_stream::{Stream, StreamExt};
use tonic::Status;

use super::hub::{BUS_CAPACITY, Hub, Published};
use super::outbound::{self, Buffer};
use super::pb;

/// Events of `Subscribe`.
pub type WatchStream = Pin<Box<dyn Stream<Item = Result<pb::SessionEvent, Status>> + Send>>;

/// Events buffered per watcher before it counts as not reading.
const WATCH_BUFFER: usize = 256;

/// An event waiting for the watcher: the bus's, shared and counted ([`Published`]).
type Buffered = Arc<Published>;

/// Starts following the bus for one watcher (`only`: one session's events; empty: all).
pub fn run(hub: &Arc<Hub>, only: String) -> WatchStream {
    let mut bus = hub.bus.subscribe();
    let (tx, rx) = mpsc::channel::<Buffered>(WATCH_BUFFER);
    // The closing status travels apart from the events: a watcher that stopped reading
    // has a full buffer, and dropping it must not wait for room there.
    let (end_tx, end_rx) = oneshot::channel::<Status>();
    let buffer = Buffer::new(rx);
    let grace = hub.slow_reader_grace;
    tokio::spawn(outbound::watch(
        Arc::downgrade(&buffer),
        grace,
        move |b: &Buffer<Buffered>| b.abandon(|_| 0, |_| not_taking(grace)),
    ));
    let watching = crate::telemetry::Watching::start();
    tokio::spawn(async move {
        let _watching = watching;
        loop {
            // A watcher that hung up (or was given up on) ends now, not at the next event
            // it would be sent (with a session filter, that event may never come).
            let received = tokio::select! {
                biased;
                () = tx.closed() => return,
                received = bus.recv() => received,
            };
            let published = match received {
                Ok(e) => e,
                Err(broadcast::error::RecvError::Closed) => return,
                Err(broadcast::error::RecvError::Lagged(n)) => {
                    let status = Status::resource_exhausted(format!(
                        "watcher fell {n} events behind (the bus keeps {BUS_CAPACITY}); subscribe again"
                    ));
                    let _ = end_tx.send(status);
                    return;
                }
            };
            let event = &published.session_event;
            if event.event.is_none() {
                // The session was deleted (`Hub::gone`): its own watchers end, after what
                // they were sent before; a watcher of every session reads on.
                if !only.is_empty() && event.session_id == only {
                    let _ = end_tx.send(Status::not_found(format!(
                        "session {only} was deleted; subscribe again once it is opened again"
                    )));
                    return;
                }
                continue;
            }
            if !only.is_empty() && event.session_id != only {
                continue;
            }
            // A full buffer means the watcher is not reading: drop it, never wait.
            match tx.try_send(published) {
                Ok(()) => {}
                Err(mpsc::error::TrySendError::Full(_)) => {
                    let status =
                        Status::resource_exhausted("watcher is not reading its events; dropped");
                    let _ = end_tx.send(status);
                    return;
                }
                Err(mpsc::error::TrySendError::Closed(_)) => return,
            }
        }
    });
    // Events already buffered are delivered first; then the closing status, if any.
    let end = futures::stream::once(async move { end_rx.await.ok() }).filter_map(|s| s);
    let events =
        futures::stream::poll_fn(move |cx| buffer.poll_next(cx)).map(|item| item.map(owned));
    Box::pin(events.chain(end.map(Err)))
}

/// The event `p` carries, to encode: taken when this watcher holds it last (its count
/// given back as it goes), else copied (the others still hold the counted one).
fn owned(p: Arc<Published>) -> pb::SessionEvent {
    match Arc::try_unwrap(p) {
        Ok(p) => p.session_event,
        Err(shared) => shared.session_event.clone(),
    }
}

/// The status a watcher's call ends with when it took none of its buffered events for
/// `grace`: they were dropped.
fn not_taking(grace: Duration) -> Status {
    tracing::warn!(
        grace_ms = u64::try_from(grace.as_millis()).unwrap_or(u64::MAX),
        "watcher took none of its buffered events; dropping them and closing the call"
    );
    crate::telemetry::rejected(tonic::Code::ResourceExhausted);
    Status::resource_exhausted(format!(
        "watcher is not reading its events (took none for {} ms); dropped, subscribe again",
        grace.as_millis()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::EngineConfig;
    use crate::server::hub::CompactionConfig;
    use crate::store::{Limits, Store};

    /// A hub over an 8 MiB budget (a 1 MiB share in flight) with a slow-reader grace of
    /// 60 s.
    fn hub() -> Arc<Hub> {
        let limits = Limits {
            memory_budget: 8 << 20,
            ..Limits::default()
        };
        let store = Arc::new(Store::new(EngineConfig::default()).with_limits(limits));
        let mut hub = Hub::new(store, CompactionConfig::default());
        hub.slow_reader_grace = Duration::from_secs(60);
        Arc::new(hub)
    }

    /// A `pruned` event of about `bytes` for session "s".
    fn pruned(bytes: usize) -> pb::session_event::Event {
        let part = pb::PrunedPart {
            part_id: "p".repeat(1_000),
            ..Default::default()
        };
        pb::session_event::Event::Pruned(pb::PruneReport {
            parts: vec![part; bytes / 1_000],
            ..Default::default()
        })
    }

    /// The next event of `events` within 5 s.
    async fn next(events: &mut WatchStream) -> pb::SessionEvent {
        tokio::time::timeout(Duration::from_secs(5), events.next())
            .await
            .expect("an event within 5 s")
            .expect("the watcher is open")
            .expect("an event, not a status")
    }

    /// Waits (5 s at most) until nothing is in flight.
    async fn nothing_in_flight(hub: &Hub) {
        let ledger = hub.store.ledger();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while ledger.in_flight() != 0 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "still {} bytes in flight after every event was read",
                ledger.in_flight()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// An event published while the in-flight share is full (a large reply another
    /// client has not read yet) is delivered at once: counted when published, it waits
    /// for no room. Before the bus counted, a watcher ended at once whoever filled the
    /// share; then it waited for room.
    #[tokio::test]
    async fn an_event_published_while_the_share_is_full_is_delivered() {
        let hub = hub();
        let mut events = run(&hub, String::new());
        let ledger = hub.store.ledger();
        let _held = ledger
            .reserve(ledger.in_flight_limit(), "replies")
            .expect("the share");
        hub.publish(
            "s",
            pb::session_event::Event::Overflow(pb::OverflowCheck::default()),
        );
        assert_eq!(next(&mut events).await.session_id, "s");
    }

    /// A `pruned` event of about 1 MB is counted in flight from its publication while the
    /// bus keeps it (a reader has yet to take it), and given back once every holder let
    /// it go. Before, the bus's events were counted nowhere.
    #[tokio::test]
    async fn an_event_the_bus_keeps_is_counted_in_flight_until_read() {
        let hub = hub();
        let mut events = run(&hub, String::new());
        let other = hub.bus.subscribe();
        let ledger = hub.store.ledger().clone();
        hub.publish("s", pruned(1_000_000));
        let counted = ledger.in_flight();
        assert!(counted >= 1_000_000, "counted at once: {counted}");
        assert!(next(&mut events).await.event.is_some());
        assert!(ledger.in_flight() >= 1_000_000, "the other reader holds it");
        drop(other);
        nothing_in_flight(&hub).await;
    }

    /// Two watchers of a large event share one counted copy, and both get it at once.
    /// Before (found in review), each waited for room for a copy of its own while holding
    /// the bus's, so with the event near the share neither could ever take it over and
    /// both were dropped at the end of the grace.
    #[tokio::test]
    async fn two_watchers_of_a_large_event_share_one_counted_copy() {
        let hub = hub();
        let mut first = run(&hub, "s".into());
        let mut second = run(&hub, "s".into());
        let ledger = hub.store.ledger().clone();
        hub.publish("s", pruned(600_000));
        tokio::time::sleep(Duration::from_millis(50)).await;
        let counted = ledger.in_flight();
        assert!(
            (600_000..1_200_000).contains(&counted),
            "counted once, not per watcher: {counted}"
        );
        for events in [&mut first, &mut second] {
            assert!(next(events).await.event.is_some());
        }
        nothing_in_flight(&hub).await;
    }
}
