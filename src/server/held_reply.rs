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
//!
//! A streaming call's events (`Stream`, `Subscribe`) go the same way ([`hold_events`]):
//! tonic encodes each event into one data frame however large, and hyper reads the next
//! frame before it waits for the client's window, so an unread stream would otherwise
//! keep one event whole in HTTP/2's send buffer and a second in hyper, past the events'
//! own buffer (`outbound.rs`) and so counted nowhere. A frame larger than a piece is
//! counted in flight ([`crate::store::Ledger::count`]: its event's reservation was just
//! given back) whole until its last piece is handed on (the frame is one allocation); a
//! smaller one goes on as it is. An idle stream has nothing left to hand on and is never
//! given up on; one whose frame
//! moved no piece for the grace is ended with the status the call's handler chose (a
//! trailer, after the part of the event HTTP/2 holds: tonic's clients read the status),
//! its frame and its events still buffered dropped.

use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::Duration;

use http_body::{Body, Frame, SizeHint};
use tokio::sync::oneshot;
use tonic::Status;
use tonic::codegen::{Bytes, http};

use crate::store::{Ledger, Reservation};

/// Bytes of a held reply handed to HTTP/2 at a time: at most about two of them (one sent
/// or buffered, one waiting for the window) are outside the reservation.
pub const CHUNK: usize = 64 << 10;

/// What a response's body holds, on its way from the handler to the layer (extensions
/// need `Clone`).
#[derive(Debug, Clone)]
enum Held {
    /// A unary reply's reservation, given back to the ledger when the last copy drops.
    Reply(Arc<Reservation>),
    /// A streaming call's events: frames counted in `ledger` until handed on; the call
    /// ends with `ending(grace, head)` when given up on.
    Events { ledger: Arc<Ledger>, ending: Ending },
}

/// Keeps `held` counted until `response`'s body is done with (sent, the stream reset, or
/// the client not reading for the grace).
pub fn hold<T>(response: &mut tonic::Response<T>, held: Reservation) {
    response
        .extensions_mut()
        .insert(Held::Reply(Arc::new(held)));
}

/// How a streaming call given up on ends: its status, from the grace and the first
/// [`HEAD`] bytes of the data frame cut short (gRPC-framed, from a message's start).
pub type Ending = fn(Duration, &[u8]) -> Status;

/// Bytes of a frame's start kept for its [`Ending`]: a message's 5-byte gRPC prefix, its
/// first field's key and a varint.
pub const HEAD: usize = 16;

/// Counts what `response`'s events (a streaming call's) hold past a piece in `ledger`
/// until handed on, and ends the call with `ending` once a client left some unsent for
/// the grace.
pub fn hold_events<T>(response: &mut tonic::Response<T>, ledger: Arc<Ledger>, ending: Ending) {
    response
        .extensions_mut()
        .insert(Held::Events { ledger, ending });
}

/// The server's response layer: a response carrying a reservation ([`hold`]) gets a body
/// that owns it and hands the reply on piece by piece, given up if the client reads no
/// piece for `grace`; one whose events are held ([`hold_events`]) hands each large one on
/// the same way; any other response is unchanged.
pub fn into_body(
    mut response: http::Response<tonic::body::Body>,
    grace: Duration,
) -> http::Response<tonic::body::Body> {
    let Some(held) = response.extensions_mut().remove::<Held>() else {
        return response;
    };
    let (held, events) = match held {
        Held::Reply(held) => (Some(held), None),
        Held::Events { ledger, ending } => (
            None,
            Some(Events {
                ledger,
                ending,
                head: Bytes::new(),
                counted: Reservation::default(),
                status: None,
            }),
        ),
    };
    response.map(|inner| {
        let shared = Arc::new(Mutex::new(Reply {
            inner: Some(inner),
            rest: Bytes::new(),
            held,
            events,
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
    /// The handler's encoded reply (its trailers still to come); `None` once abandoned or
    /// dropped.
    inner: Option<tonic::body::Body>,
    /// Of the data frame read last, what is not handed on yet.
    rest: Bytes,
    /// A unary reply's reservation; `None` once abandoned, and for events.
    held: Option<Arc<Reservation>>,
    /// A streaming call's: how its frames are counted and how it ends.
    events: Option<Events>,
    /// Pieces handed on so far: the watchdog's mark of progress.
    pieces: u64,
    /// The client read nothing for the grace: the reply is dropped.
    abandoned: bool,
}

/// How a streaming call's body counts its frames, and ends when given up on.
struct Events {
    ledger: Arc<Ledger>,
    ending: Ending,
    /// The first [`HEAD`] bytes of the frame `rest` is left of (a copy).
    head: Bytes,
    /// `rest`'s bytes in `ledger`.
    counted: Reservation,
    /// The status the call ends with once given up on (taken when sent).
    status: Option<Status>,
}

impl Reply {
    /// True while the watchdog may give up on the body: a unary reply always (it is
    /// being sent), a stream only with part of a frame not handed on (an idle stream
    /// waits for its next event, however long).
    fn unsent(&self) -> bool {
        self.events.is_none() || !self.rest.is_empty()
    }

    /// Hands on the next piece of `rest`: a copy, so a piece HTTP/2 keeps buffered does
    /// not keep the whole frame alive.
    fn piece(&mut self) -> Bytes {
        let n = self.rest.len().min(CHUNK);
        let piece = Bytes::copy_from_slice(&self.rest[..n]);
        let _ = self.rest.split_to(n);
        // `rest` is a view of the whole frame tonic encoded: the frame stays allocated,
        // and counted, until its last piece is handed on.
        if let Some(events) = self.events.as_mut().filter(|_| self.rest.is_empty()) {
            events.counted.shrink(0);
        }
        self.pieces = self.pieces.wrapping_add(1);
        piece
    }
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
        if reply.inner.is_none() {
            return; // The body was dropped meanwhile.
        }
        if reply.pieces != seen || !reply.unsent() {
            seen = reply.pieces;
            continue;
        }
        let left = reply.rest.len();
        // Dropped after the lock is released.
        let gone = (
            reply.inner.take(),
            std::mem::take(&mut reply.rest),
            reply.held.take(),
            reply
                .events
                .as_mut()
                .map(|e| std::mem::take(&mut e.counted)),
        );
        reply.abandoned = true;
        if let Some(events) = &mut reply.events {
            // The call's own status says why (and counts the refusal).
            events.status = Some((events.ending)(grace, &events.head));
            drop(reply);
            drop(gone);
            return;
        }
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
            reply.events.take(),
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
            return Poll::Ready(match reply.events.as_mut() {
                None => Some(Err(Status::resource_exhausted(
                    "the reply was not read within the server's slow-reader grace",
                ))),
                Some(events) => events.status.take().map(|status| {
                    let mut trailers = http::HeaderMap::new();
                    status.add_header(&mut trailers)?;
                    Ok(Frame::trailers(trailers))
                }),
            });
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
            if let Some(events) = &mut reply.events {
                // An event (or a few) within a piece goes on as it is: no copy, no count.
                if reply.rest.len() <= CHUNK {
                    reply.pieces = reply.pieces.wrapping_add(1);
                    return Poll::Ready(Some(Ok(Frame::data(std::mem::take(&mut reply.rest)))));
                }
                let bytes = reply.rest.len() as u64;
                events.counted = events.ledger.count(bytes, "events");
                events.head = Bytes::copy_from_slice(&reply.rest[..HEAD.min(reply.rest.len())]);
            }
        }
        Poll::Ready(Some(Ok(Frame::data(reply.piece()))))
    }

    fn is_end_stream(&self) -> bool {
        let reply = lock(&self.shared);
        if reply.abandoned {
            // A unary reply given up on ends in an error; a stream once its status went.
            return reply.events.as_ref().is_some_and(|e| e.status.is_none());
        }
        reply.rest.is_empty() && reply.inner.as_ref().is_none_or(|i| i.is_end_stream())
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
    use tokio::sync::mpsc;

    /// A response carrying `data` and its reservation in `ledger`, through the layer.
    fn held(ledger: &Arc<crate::store::Ledger>, data: &[u8], grace: Duration) -> tonic::body::Body {
        // What `hold` puts in a tonic response's extensions, as tonic hands it to the layer.
        let mut http = http::Response::new(tonic::body::Body::new(http_body_full(data.to_vec())));
        http.extensions_mut().insert(Held::Reply(Arc::new(
            ledger.reserve(data.len() as u64, "test").expect("room"),
        )));
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

    /// A streaming call's body through the layer ([`hold_events`]), its frames sent on the
    /// channel returned.
    fn events(ledger: &Arc<Ledger>, grace: Duration) -> (mpsc::Sender<Bytes>, tonic::body::Body) {
        struct Frames(mpsc::Receiver<Bytes>);
        impl Body for Frames {
            type Data = Bytes;
            type Error = Status;
            fn poll_frame(
                mut self: Pin<&mut Self>,
                cx: &mut Context<'_>,
            ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
                self.0.poll_recv(cx).map(|d| d.map(|d| Ok(Frame::data(d))))
            }
        }
        let (tx, rx) = mpsc::channel(8);
        let mut http = http::Response::new(tonic::body::Body::new(Frames(rx)));
        http.extensions_mut().insert(Held::Events {
            ledger: ledger.clone(),
            ending: |_, head| Status::resource_exhausted(format!("not reading {head:?}")),
        });
        (tx, into_body(http, grace).into_body())
    }

    /// The body's next frame if it has one now (a stream with nothing to send: pending).
    fn now(body: &mut tonic::body::Body) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        Pin::new(body).poll_frame(&mut Context::from_waker(std::task::Waker::noop()))
    }

    /// A stream with nothing to send is never given up on, however long it waits, and an
    /// event within a piece goes on as it is (the same bytes), never counted.
    #[tokio::test(start_paused = true)]
    async fn an_idle_stream_is_never_given_up_on_and_a_small_event_goes_on_as_it_is() {
        let ledger = Arc::new(Ledger::new(1 << 30));
        let grace = Duration::from_secs(1);
        let (tx, mut body) = events(&ledger, grace);
        assert!(now(&mut body).is_pending());
        tokio::time::sleep(grace * 60).await;
        let event = Bytes::from(data(CHUNK));
        tx.send(event.clone()).await.expect("open");
        let sent = next(&mut body).await.expect("a frame").expect("data");
        let sent = sent.into_data().expect("data");
        assert_eq!(sent.as_ptr(), event.as_ptr(), "not copied");
        assert_eq!(ledger.in_flight(), 0, "not counted");
        tokio::time::sleep(grace * 60).await;
        assert!(now(&mut body).is_pending(), "still open, not given up on");
        drop(tx);
        assert!(next(&mut body).await.is_none(), "the call's own end");
    }

    /// An event larger than a piece is counted in flight whole until its last piece goes;
    /// left so for the grace, it is dropped (its count given back and the events behind
    /// it with the call's source of events), and the call ends with the status it chose,
    /// as a trailer after the pieces HTTP/2 took.
    #[tokio::test(start_paused = true)]
    async fn a_large_event_left_unread_is_counted_then_dropped_and_the_call_ends_with_its_status() {
        let ledger = Arc::new(Ledger::new(1 << 30));
        let grace = Duration::from_secs(10);
        let (tx, mut body) = events(&ledger, grace);
        tx.send(Bytes::from(data(CHUNK * 4))).await.expect("open");
        for _ in 0..3 {
            let piece = next(&mut body).await.expect("a piece").expect("data");
            assert_eq!(piece.into_data().map(|d| d.len()).ok(), Some(CHUNK));
            // The frame is one allocation: counted whole until its last piece goes.
            assert_eq!(ledger.in_flight(), (CHUNK * 4) as u64);
        }
        tokio::time::sleep(grace * 5 / 2).await;
        assert_eq!(ledger.in_flight(), 0, "given back after the grace");
        assert!(tx.is_closed(), "the call's events are dropped with it");
        let end = next(&mut body)
            .await
            .expect("the status")
            .expect("a trailer");
        let trailers = end.into_trailers().expect("trailers");
        let status = Status::from_header_map(&trailers).expect("a status");
        assert_eq!(status.code(), tonic::Code::ResourceExhausted);
        let head = format!("not reading {:?}", &data(HEAD)[..]);
        assert_eq!(status.message(), head, "made from the cut frame's head");
        assert!(body.is_end_stream());
        assert!(next(&mut body).await.is_none());
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
