//! The `Subscribe` RPC's events: a task per watcher takes the session events the bus
//! publishes (all of them, or one session's) and buffers them for the client.
//!
//! What a watcher costs is bounded like a `Stream`'s outbound buffer (`outbound.rs`):
//! every event buffered holds a reservation in the store's ledger until the response body
//! takes it, so it counts against `memory_budget`; a watcher whose buffer is full is
//! dropped at once (it never makes the bus wait); and one that leaves events untaken for
//! the slow-reader grace has them dropped, its call ended `RESOURCE_EXHAUSTED`.
//!
//! The bus counts each event from its publication (`hub::Published`). A watcher that
//! takes an event no one else holds any more (it was the last to read it) takes it over
//! with its count: no copy, nothing more to reserve. One that must copy it (another
//! watcher has yet to read it) reserves the copy, and an event that finds no room in
//! flight waits for it as long as the grace (ended the same way after); meanwhile the
//! bus keeps what is published after it, counted.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use prost::Message as _;
use tokio::sync::{broadcast, mpsc, oneshot};
use tokio_stream::{Stream, StreamExt};
use tonic::Status;

use super::hub::{BUS_CAPACITY, Hub, Published};
use super::outbound::{self, Buffer};
use super::pb;
use crate::store::Reservation;

/// Events of `Subscribe`.
pub type WatchStream = Pin<Box<dyn Stream<Item = Result<pb::SessionEvent, Status>> + Send>>;

/// Events buffered per watcher before it counts as not reading.
const WATCH_BUFFER: usize = 256;

/// An event waiting for the watcher, with its bytes' reservation.
type Buffered = (pb::SessionEvent, Reservation);

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
    let ledger = hub.store.ledger().clone();
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
            let item = match Arc::try_unwrap(published) {
                // The last copy: taken over, counted as the bus counted it.
                Ok(Published {
                    session_event,
                    counted,
                }) => (session_event, counted),
                Err(shared) => {
                    let event = &shared.session_event;
                    let bytes = u64::try_from(event.encoded_len()).unwrap_or(u64::MAX);
                    let room = tokio::select! {
                        biased;
                        () = tx.closed() => return, // the watcher hung up while waiting
                        room = reserve_within(&ledger, bytes, grace) => room,
                    };
                    match room {
                        Ok(held) => (event.clone(), held),
                        Err(e) => {
                            crate::telemetry::rejected(tonic::Code::ResourceExhausted);
                            let _ = end_tx.send(Status::resource_exhausted(format!(
                                "{e}; watcher dropped, subscribe again"
                            )));
                            return;
                        }
                    }
                }
            };
            // A full buffer means the watcher is not reading: drop it, never wait.
            match tx.try_send(item) {
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
    let events = futures::stream::poll_fn(move |cx| buffer.poll_next(cx))
        .map(|item| item.map(|(event, _held)| event));
    Box::pin(events.chain(end.map(Err)))
}

/// How long a watcher waits between tries for room in flight.
const ROOM_RETRY: Duration = Duration::from_millis(10);

/// Reserves an event's bytes in flight, waiting up to `grace` for room: the share may be
/// full for a moment (a large reply another client has yet to read), which is no reason
/// to end this watcher. The bus keeps its events meanwhile (a watcher that falls too far
/// behind ends as lagging).
async fn reserve_within(
    ledger: &Arc<crate::store::Ledger>,
    bytes: u64,
    grace: Duration,
) -> Result<Reservation, crate::store::StoreError> {
    let deadline = tokio::time::Instant::now() + grace;
    loop {
        match ledger.reserve(bytes, "events") {
            Ok(held) => return Ok(held),
            // Larger than the whole share: no wait makes room for it.
            Err(e) if bytes > ledger.in_flight_limit() => return Err(e),
            Err(e) if tokio::time::Instant::now() >= deadline => return Err(e),
            Err(_) => tokio::time::sleep(ROOM_RETRY).await,
        }
    }
}

/// The status a watcher's call ends with when it took none of its buffered events (or
/// no piece of the one being sent) for `grace`: they were dropped.
pub(super) fn not_taking(grace: Duration) -> Status {
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

    /// A second reader of the bus that reads nothing: a watcher must copy every event.
    type Other = broadcast::Receiver<Arc<Published>>;

    /// A hub over an 8 MiB budget with a slow-reader grace of `grace`, one watcher of it
    /// and another reader of its bus (so the watcher copies the event), and a reservation
    /// (another reply) holding the whole in-flight share while an event is published.
    fn watcher_without_room(grace: Duration) -> (Arc<Hub>, WatchStream, Reservation, Other) {
        let limits = Limits {
            memory_budget: 8 << 20,
            ..Limits::default()
        };
        let store = Arc::new(Store::new(EngineConfig::default()).with_limits(limits));
        let mut hub = Hub::new(store.clone(), CompactionConfig::default());
        hub.slow_reader_grace = grace;
        let hub = Arc::new(hub);
        let events = run(&hub, String::new());
        let other = hub.bus.subscribe();
        let share = store.ledger().in_flight_limit();
        let held = store.ledger().reserve(share, "replies").expect("the share");
        hub.publish(
            "s",
            pb::session_event::Event::Overflow(pb::OverflowCheck::default()),
        );
        (hub, events, held, other)
    }

    /// A watcher whose event finds the in-flight share full for a moment (a large reply
    /// another client has not read yet) waits for room, within the grace, and delivers
    /// it. Before, the watcher ended at once, RESOURCE_EXHAUSTED, whoever filled the share.
    #[tokio::test]
    async fn a_moment_without_room_in_flight_delays_the_event_not_the_watcher() {
        let grace = crate::server::hub::DEFAULT_SLOW_READER_GRACE;
        let (_hub, mut events, held, _other) = watcher_without_room(grace);
        tokio::time::sleep(Duration::from_millis(100)).await;
        drop(held);
        let event = tokio::time::timeout(Duration::from_secs(5), events.next())
            .await
            .expect("an event within the grace");
        let event = event
            .expect("the watcher is open")
            .expect("an event, not a status");
        assert_eq!(event.session_id, "s");
    }

    /// A `pruned` event of about 1 MB published while a watcher waits for room (another
    /// client's unread reply holds the in-flight share) is counted in flight from its
    /// publication: the bus keeps it, and every event published after it, until the
    /// watcher takes it. Then the watcher, its last reader, takes it over with its count
    /// (no copy), and it is given back once the client read it. Before, the bus's events
    /// were counted nowhere: in flight stayed at the share.
    #[tokio::test]
    async fn an_event_the_bus_keeps_is_counted_in_flight_until_read() {
        let (hub, mut events, held, other) = watcher_without_room(Duration::from_secs(60));
        let ledger = hub.store.ledger().clone();
        let share = held.bytes();
        let part = pb::PrunedPart {
            part_id: "p".repeat(1_000),
            ..Default::default()
        };
        let report = pb::PruneReport {
            parts: vec![part; 1_000],
            ..Default::default()
        };
        hub.publish("s", pb::session_event::Event::Pruned(report));
        let counted = ledger.in_flight();
        assert!(
            counted >= share + 1_000_000,
            "the event is counted at once: {counted} in flight beside a share of {share}"
        );
        // The other reader leaves, and the reply holding the share is read.
        drop((other, held));
        for kind in ["overflow", "pruned"] {
            let event = tokio::time::timeout(Duration::from_secs(5), events.next())
                .await
                .unwrap_or_else(|_| panic!("the {kind} event within 5 s"));
            assert!(matches!(event, Some(Ok(_))), "{kind}: {event:?}");
        }
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while ledger.in_flight() != 0 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "still {} bytes in flight 5 s after both events were read",
                ledger.in_flight()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// A watcher that hangs up while its event waits for room ends then, not at the end
    /// of the grace: its task stops counting in `compactd_watchers` at once.
    #[tokio::test]
    async fn a_watcher_that_hangs_up_while_waiting_for_room_ends_at_once() {
        let (hub, events, _held, _other) = watcher_without_room(Duration::from_secs(60));
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(hub.bus.receiver_count(), 2, "the watcher waits for room");
        drop(events);
        let ended = tokio::time::timeout(Duration::from_secs(5), async {
            while hub.bus.receiver_count() > 1 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
        assert!(
            ended.is_ok(),
            "the watcher's task ended within 5 s of a 60 s grace"
        );
    }
}
