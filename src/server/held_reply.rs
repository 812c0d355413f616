//! A unary reply's bytes stay counted in the store's ledger until the reply has gone to
//! the client, not only until its handler returns, and no longer than the client keeps
//! reading it. hyper hands a body's data to HTTP/2 as soon as it has it, and HTTP/2 keeps
//! what the client's flow-control window does not take in its send buffer: a client
//! asking for large replies on many streams and connections and reading none would hold
//! memory the budget never sees. The handler puts its reservation in the response's
//! extensions ([`hold`]); the server's layer ([`into_body`]) gives the response a body
//! that owns it and hands the reply on in [`CHUNK`]-byte pieces, each a copy of its own:
//! hyper asks for the next piece only once the one before fits the client's window, so
//! the rest stays in this body, counted, until the client reads it.
//!
//! A client that stops reading would then pin its reply's share of the in-flight bytes,
//! and with enough unread replies refuse everyone's updates. hyper does not poll a body
//! while it waits for the client's window, so the body cannot notice the wait itself: a
//! watchdog task, one per held reply, ends a reply that handed on no piece for the
//! server's `slow_reader_grace` (as a `Stream` whose client leaves its events unread is
//! ended): the reply's bytes are dropped and its reservation given back, and the stream
//! is reset when hyper next asks for a piece. What HTTP/2 already buffered stays there
//! (at most about two pieces, which are copies, so they keep no more of the reply alive).

use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;

use http_body::{Body, Frame, SizeHint};
use tokio::sync::oneshot;
use tonic::Status;
use tonic::codegen::{Bytes, http};

use crate::store::Reservation;

/// Bytes of a held reply handed to HTTP/2 at a time: at most about two of them (one sent
/// or buffered, one waiting for the window) are outside the reservation.
pub const CHUNK: usize = 64 << 10;

/// One reply's reservation on its way from the handler to the body (extensions need
/// `Clone`).
#[derive(Debug, Clone)]
struct HeldReply {
    /// Given back to the ledger when the last copy drops.
    _held: Arc<Reservation>,
}

/// Keeps `held` counted until `response`'s body is done with (sent, the stream reset, or
/// the client not reading for the grace).
pub fn hold<T>(response: &mut tonic::Response<T>, held: Reservation) {
    response.extensions_mut().insert(HeldReply {
        _held: Arc::new(held),
    });
}

/// The server's response layer: a response carrying a reservation ([`hold`]) gets a body
/// that owns it and hands the reply on piece by piece, given up if the client reads no
/// piece for `grace`; any other response is unchanged.
pub fn into_body(
    mut response: http::Response<tonic::body::Body>,
    grace: Duration,
) -> http::Response<tonic::body::Body> {
    let Some(held) = response.extensions_mut().remove::<HeldReply>() else {
        return response;
    };
    response.map(|inner| {
        let shared = Arc::new(Mutex::new(Reply {
            inner: Some(inner),
            rest: Bytes::new(),
            held: Some(held),
            pieces: 0,
            abandoned: false,
        }));
        let (done, dropped) = oneshot::channel();
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(watch(Arc::clone(&shared), dropped, grace));
        }
        tonic::body::Body::new(HeldBody {
            shared,
            _done: done,
        })
    })
}

/// What a held reply's body and its watchdog share.
struct Reply {
    /// The handler's encoded reply (its trailers still to come); `None` once abandoned.
    inner: Option<tonic::body::Body>,
    /// Of the data frame read last, what is not handed on yet.
    rest: Bytes,
    /// The reply's reservation; `None` once abandoned.
    held: Option<HeldReply>,
    /// Pieces handed on so far: the watchdog's mark of progress.
    pieces: u64,
    /// The client read nothing for the grace: the reply is dropped.
    abandoned: bool,
}

/// Locks `shared`, a poisoned lock included (a panic elsewhere must not wedge a reply).
fn lock(shared: &Mutex<Reply>) -> MutexGuard<'_, Reply> {
    shared
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Abandons the reply in `shared` when no piece went out for `grace`; ends when the body
/// is dropped (`dropped` fires).
async fn watch(shared: Arc<Mutex<Reply>>, mut dropped: oneshot::Receiver<()>, grace: Duration) {
    let mut seen = lock(&shared).pieces;
    loop {
        tokio::select! {
            _ = &mut dropped => return,
            () = tokio::time::sleep(grace) => {}
        }
        let mut reply = lock(&shared);
        if reply.held.is_none() {
            return; // The body was dropped meanwhile.
        }
        if reply.pieces != seen {
            seen = reply.pieces;
            continue;
        }
        let left = reply.rest.len();
        // Dropped after the lock is released.
        let gone = (
            reply.inner.take(),
            std::mem::take(&mut reply.rest),
            reply.held.take(),
        );
        reply.abandoned = true;
        drop(reply);
        // Counted before the bytes are given back, so whoever sees them back sees it too.
        crate::telemetry::reply_abandoned();
        drop(gone);
        tracing::warn!(
            grace_ms = u64::try_from(grace.as_millis()).unwrap_or(u64::MAX),
            bytes_left = left,
            "a client left its reply unread for the grace; the reply is dropped and its stream reset"
        );
        return;
    }
}

/// A reply's body: its data handed on in [`CHUNK`]s, holding its reservation.
struct HeldBody {
    shared: Arc<Mutex<Reply>>,
    /// Dropped with the body: the watchdog ends.
    _done: oneshot::Sender<()>,
}

impl Drop for HeldBody {
    /// Gives the reply and its reservation back now, not when the watchdog next wakes.
    fn drop(&mut self) {
        let mut reply = lock(&self.shared);
        let gone = (
            reply.inner.take(),
            std::mem::take(&mut reply.rest),
            reply.held.take(),
        );
        drop(reply);
        drop(gone);
    }
}

impl Body for HeldBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let mut reply = lock(&self.shared);
        let reply = &mut *reply;
        if reply.abandoned {
            return Poll::Ready(Some(Err(Status::resource_exhausted(
                "the reply was not read within the server's slow-reader grace",
            ))));
        }
        if reply.rest.is_empty() {
            let Some(inner) = reply.inner.as_mut() else {
                return Poll::Ready(None);
            };
            match Pin::new(inner).poll_frame(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Some(Ok(frame))) => match frame.into_data() {
                    Ok(data) => reply.rest = data,
                    Err(other) => return Poll::Ready(Some(Ok(other))),
                },
                Poll::Ready(end) => return Poll::Ready(end),
            }
        }
        // A copy, so a piece HTTP/2 keeps buffered does not keep the whole reply alive.
        let n = reply.rest.len().min(CHUNK);
        let piece = Bytes::copy_from_slice(&reply.rest[..n]);
        let _ = reply.rest.split_to(n);
        reply.pieces = reply.pieces.wrapping_add(1);
        Poll::Ready(Some(Ok(Frame::data(piece))))
    }

    fn is_end_stream(&self) -> bool {
        let reply = lock(&self.shared);
        !reply.abandoned
            && reply.rest.is_empty()
            && reply.inner.as_ref().is_none_or(|i| i.is_end_stream())
    }

    fn size_hint(&self) -> SizeHint {
        let reply = lock(&self.shared);
        let Some(inner) = reply.inner.as_ref() else {
            return SizeHint::default();
        };
        let inner = inner.size_hint();
        let rest = reply.rest.len() as u64;
        let mut hint = SizeHint::new();
        hint.set_lower(inner.lower().saturating_add(rest));
        if let Some(upper) = inner.upper() {
            hint.set_upper(upper.saturating_add(rest));
        }
        hint
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A response carrying `data` and its reservation in `ledger`, through the layer.
    fn held(ledger: &Arc<crate::store::Ledger>, data: &[u8], grace: Duration) -> tonic::body::Body {
        // What `hold` puts in a tonic response's extensions, as tonic hands it to the layer.
        let mut http = http::Response::new(tonic::body::Body::new(http_body_full(data.to_vec())));
        http.extensions_mut().insert(HeldReply {
            _held: Arc::new(ledger.reserve(data.len() as u64, "test").expect("room")),
        });
        into_body(http, grace).into_body()
    }

    async fn next(body: &mut tonic::body::Body) -> Option<Result<Frame<Bytes>, Status>> {
        std::future::poll_fn(|cx| Pin::new(&mut *body).poll_frame(cx)).await
    }

    fn data(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i % 251) as u8).collect()
    }

    /// A reply of 2.5 chunks comes out as three pieces in order, then the inner body's
    /// end; the reservation is given back only when the body drops.
    #[tokio::test]
    async fn a_held_reply_is_handed_on_in_chunks_and_holds_its_bytes_until_dropped() {
        let ledger = Arc::new(crate::store::Ledger::new(1 << 30));
        let data = data(CHUNK * 5 / 2);
        let mut body = held(&ledger, &data, Duration::from_secs(60));
        assert_eq!(ledger.in_flight(), data.len() as u64);
        let mut pieces = Vec::new();
        while let Some(frame) = next(&mut body).await {
            pieces.push(frame.expect("data").into_data().expect("a data frame"));
        }
        assert_eq!(
            pieces.iter().map(Bytes::len).collect::<Vec<_>>(),
            [CHUNK, CHUNK, CHUNK / 2]
        );
        assert_eq!(pieces.concat(), data);
        assert_eq!(ledger.in_flight(), data.len() as u64, "held until dropped");
        drop(body);
        assert_eq!(ledger.in_flight(), 0);
    }

    /// A reply whose client stops taking pieces is dropped after the grace, while hyper
    /// still holds its body: the reservation is given back, and the next piece asked
    /// for is an error (hyper resets the stream), not the rest of a reply cut short.
    #[tokio::test]
    async fn a_reply_left_unread_for_the_grace_gives_its_bytes_back_and_then_fails() {
        let ledger = Arc::new(crate::store::Ledger::new(1 << 30));
        let data = data(CHUNK * 4);
        let mut body = held(&ledger, &data, Duration::from_millis(100));
        let first = next(&mut body).await.expect("a piece").expect("data");
        assert_eq!(first.into_data().map(|d| d.len()).ok(), Some(CHUNK));
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while ledger.in_flight() != 0 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "an unread reply still holds {} bytes after 10 s",
                ledger.in_flight()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let after = next(&mut body).await.expect("an error, not the end");
        let status = after.expect_err("the rest of the reply is gone");
        assert_eq!(status.code(), tonic::Code::ResourceExhausted);
        assert!(!body.is_end_stream());
    }

    /// A client reading slowly but steadily (a piece every tenth of the grace) gets the
    /// whole reply, however much longer than the grace it takes in all. On tokio's paused
    /// clock (the watchdog's grace is a `tokio::time::sleep`): in real time, one read
    /// late by 900 ms on a loaded machine let the watchdog drop the reply.
    #[tokio::test(start_paused = true)]
    async fn a_reply_read_slowly_but_steadily_is_never_dropped() {
        let ledger = Arc::new(crate::store::Ledger::new(1 << 30));
        let grace = Duration::from_millis(1000);
        let data = data(CHUNK * 30);
        let mut body = held(&ledger, &data, grace);
        let mut got = Vec::new();
        while let Some(frame) = next(&mut body).await {
            got.push(frame.expect("no error").into_data().expect("data"));
            tokio::time::sleep(grace / 10).await;
        }
        assert_eq!(got.concat(), data, "3 graces long, whole");
        drop(body);
        assert_eq!(ledger.in_flight(), 0);
    }

    /// One data frame holding `data`, then the end.
    fn http_body_full(data: Vec<u8>) -> impl Body<Data = Bytes, Error = Status> + Send + 'static {
        struct Full(Option<Bytes>);
        impl Body for Full {
            type Data = Bytes;
            type Error = Status;
            fn poll_frame(
                mut self: Pin<&mut Self>,
                _: &mut Context<'_>,
            ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
                Poll::Ready(self.0.take().map(|d| Ok(Frame::data(d))))
            }
        }
        Full(Some(Bytes::from(data)))
    }
}
