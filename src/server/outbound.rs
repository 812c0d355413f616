//! A `Stream`'s outbound buffer, as the response body takes from it: the events the
//! writer queued for the client, each holding its share of the stream's byte bound and
//! its ledger reservation until taken. A client that keeps the call open and takes
//! nothing would keep them (up to 1,024 events or 32 MiB per stream) counted against
//! `--memory-budget` for as long as it liked, whether or not the writer still waits on
//! it. A watchdog per stream empties the buffer once events have waited for the
//! slow-reader grace with none taken: their bytes are given back at once, and the body
//! ends with the status it is given (after which hyper resets the stream).
//!
//! The body's poll takes an uncontended lock and bumps a counter per event; the
//! watchdog reads the counter every half grace, with no clock read per event.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::sync::mpsc;
use tonic::Status;

/// Checks in a row, half a grace apart, that find events waiting and none taken before
/// the buffer is given up on: events waited at least a grace.
const IDLE_CHECKS: u32 = 3;

/// The receiving side of a stream's outbound buffer.
pub struct Buffer<T> {
    rx: Mutex<mpsc::Receiver<T>>,
    /// Events the body has taken (the watchdog's sign of a reading client).
    taken: AtomicU64,
    /// The status the body ends with once the buffer was given up on (taken once).
    ended: Mutex<Option<Status>>,
}

impl<T> Buffer<T> {
    /// The buffer behind `rx`.
    pub fn new(rx: mpsc::Receiver<T>) -> Arc<Buffer<T>> {
        Arc::new(Buffer {
            rx: Mutex::new(rx),
            taken: AtomicU64::new(0),
            ended: Mutex::new(None),
        })
    }

    fn receiver(&self) -> MutexGuard<'_, mpsc::Receiver<T>> {
        // Every change under the lock is one call on the receiver: a poisoned lock holds
        // a consistent receiver.
        self.rx.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn ended(&self) -> MutexGuard<'_, Option<Status>> {
        self.ended.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The body's next item: an event, then (once given up on) the status, then the end.
    /// The status is read under the receiver's lock (taken first, as [`Self::abandon`]
    /// does), so a buffer found closed and empty has its status set if it was given up.
    pub fn poll_next(&self, cx: &mut Context<'_>) -> Poll<Option<Result<T, Status>>> {
        let mut rx = self.receiver();
        match rx.poll_recv(cx) {
            Poll::Ready(Some(item)) => {
                self.taken.fetch_add(1, Ordering::Relaxed);
                Poll::Ready(Some(Ok(item)))
            }
            Poll::Ready(None) => Poll::Ready(self.ended().take().map(Err)),
            Poll::Pending => Poll::Pending,
        }
    }

    /// Gives the buffer up: closes it (the writer's next send fails), drops every event
    /// in it (their bytes given back), and makes `status(first)` the body's end, `first`
    /// being the smallest `seq_of` an event dropped (None: there was none).
    ///
    /// The status is set before the receiver's lock is let go (the poll takes the same
    /// two locks in the same order): a poll that finds the buffer closed and empty finds
    /// the status too, and never ends the call OK with its events dropped.
    pub fn abandon(&self, seq_of: impl Fn(&T) -> u64, status: impl FnOnce(Option<u64>) -> Status) {
        let mut rx = self.receiver();
        rx.close();
        let mut first: Option<u64> = None;
        while let Ok(item) = rx.try_recv() {
            let seq = seq_of(&item);
            first = Some(first.map_or(seq, |f| f.min(seq)));
        }
        *self.ended() = Some(status(first));
        drop(rx);
    }
}

/// Watches `buffer` every half `grace` until it is dropped: when [`IDLE_CHECKS`] checks in
/// a row find events waiting and none taken since the check before, calls `give_up` and
/// stops.
pub async fn watch<T>(buffer: Weak<Buffer<T>>, grace: Duration, give_up: impl FnOnce(&Buffer<T>)) {
    let period = (grace / 2).max(Duration::from_millis(5));
    let mut idle = 0;
    let mut last = None;
    loop {
        tokio::time::sleep(period).await;
        let Some(b) = buffer.upgrade() else { return };
        let taken = b.taken.load(Ordering::Relaxed);
        let waiting = !b.receiver().is_empty();
        idle = if waiting && last == Some(taken) {
            idle + 1
        } else {
            0
        };
        last = Some(taken);
        if idle >= IDLE_CHECKS - 1 {
            give_up(&b);
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn next(b: &Buffer<u64>) -> Poll<Option<Result<u64, Status>>> {
        b.poll_next(&mut Context::from_waker(std::task::Waker::noop()))
    }

    #[tokio::test(start_paused = true)]
    async fn events_left_untaken_for_the_grace_are_dropped_and_the_body_ends_with_the_status() {
        let (tx, rx) = mpsc::channel(8);
        let buffer = Buffer::new(rx);
        for seq in [7, 9] {
            tx.try_send(seq).expect("room");
        }
        let watching = tokio::spawn(watch(
            Arc::downgrade(&buffer),
            Duration::from_secs(10),
            |b: &Buffer<u64>| {
                b.abandon(
                    |s| *s,
                    |first| Status::resource_exhausted(format!("from {first:?}")),
                )
            },
        ));
        tokio::time::sleep(Duration::from_secs(9)).await;
        assert!(!watching.is_finished(), "within the grace");
        tokio::time::sleep(Duration::from_secs(7)).await;
        assert!(watching.is_finished(), "given up after the grace");
        assert!(tx.try_send(11).is_err(), "closed to the writer");
        match next(&buffer) {
            Poll::Ready(Some(Err(s))) => assert_eq!(s.message(), "from Some(7)"),
            other => panic!("expected the status, got {other:?}"),
        }
        assert!(matches!(next(&buffer), Poll::Ready(None)));
    }

    /// A body polled while its buffer is given up on sees its events or the status, never
    /// a closed, emptied buffer without it. Before, `abandon` set the status only after
    /// letting go of the receiver it had closed and emptied: a poll in between (the body
    /// on another worker) took that for the writer's end, and the call ended with
    /// grpc-status OK though its events were dropped. The poll here is made at that
    /// point, from the status callback, on another thread as the body's would be.
    #[test]
    fn a_body_polled_while_its_buffer_is_given_up_on_never_ends_without_the_status() {
        let (tx, rx) = mpsc::channel(8);
        let buffer = Buffer::new(rx);
        tx.try_send(7).expect("room");
        let (polled, was_polled) = std::sync::mpsc::channel();
        let body = buffer.clone();
        let mut poller = None;
        buffer.abandon(
            |s| *s,
            |first| {
                poller = Some(std::thread::spawn(move || {
                    let seen = next(&body);
                    let _ = polled.send(());
                    seen
                }));
                // The poll's chance to run before the status is set: it either waits for
                // `abandon` to finish, or sees the buffer as it is now.
                let _ = was_polled.recv_timeout(Duration::from_millis(500));
                Status::resource_exhausted(format!("from {first:?}"))
            },
        );
        let seen = poller.expect("the status was asked for").join();
        match seen.expect("the poll ran") {
            Poll::Ready(Some(Err(s))) => assert_eq!(s.message(), "from Some(7)"),
            other => panic!("expected the status, got {other:?}"),
        }
        assert!(matches!(next(&buffer), Poll::Ready(None)));
    }

    #[tokio::test(start_paused = true)]
    async fn a_client_that_takes_events_or_an_empty_buffer_is_never_given_up_on() {
        let (tx, rx) = mpsc::channel(8);
        let buffer = Buffer::new(rx);
        let watching = tokio::spawn(watch(
            Arc::downgrade(&buffer),
            Duration::from_secs(10),
            |b: &Buffer<u64>| b.abandon(|s| *s, |_| Status::resource_exhausted("gave up")),
        ));
        // Idle with nothing to send, for a long time.
        tokio::time::sleep(Duration::from_secs(60)).await;
        // Then events, taken one per 4 s: slow, but reading.
        for seq in 0..10 {
            tx.try_send(seq).expect("room");
            tx.try_send(seq + 100).expect("room");
            tokio::time::sleep(Duration::from_secs(4)).await;
            assert!(matches!(next(&buffer), Poll::Ready(Some(Ok(_)))));
            assert!(matches!(next(&buffer), Poll::Ready(Some(Ok(_)))));
        }
        assert!(!watching.is_finished());
        drop(buffer);
        tokio::time::sleep(Duration::from_secs(10)).await;
        assert!(watching.is_finished(), "the watchdog ends with its stream");
    }
}
