//! A unary reply's bytes stay counted in the store's ledger until the reply has gone to
//! the client, not only until its handler returns. hyper hands a body's data to HTTP/2
//! as soon as it has it, and HTTP/2 keeps what the client's flow-control window does not
//! take in its send buffer: a client asking for large replies on many streams and
//! connections and reading none would hold memory the budget never sees. The handler
//! puts its reservation in the response's extensions ([`hold`]); the server's layer
//! ([`into_body`]) gives the response a body that owns it and hands the reply on in
//! [`CHUNK`]-byte pieces: hyper asks for the next piece only once the one before fits
//! the client's window, so the rest stays in this body, counted, until the client reads
//! it (or the stream is reset and the body dropped).

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use http_body::{Body, Frame, SizeHint};
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

/// Keeps `held` counted until `response`'s body is done with (sent, or the stream reset).
pub fn hold<T>(response: &mut tonic::Response<T>, held: Reservation) {
    response.extensions_mut().insert(HeldReply {
        _held: Arc::new(held),
    });
}

/// The server's response layer: a response carrying a reservation ([`hold`]) gets a body
/// that owns it and hands the reply on piece by piece; any other response is unchanged.
pub fn into_body(
    mut response: http::Response<tonic::body::Body>,
) -> http::Response<tonic::body::Body> {
    let Some(held) = response.extensions_mut().remove::<HeldReply>() else {
        return response;
    };
    response.map(|inner| {
        tonic::body::Body::new(HeldBody {
            inner,
            rest: Bytes::new(),
            _held: held,
        })
    })
}

/// A reply's body, its data handed on in [`CHUNK`]s, holding its reservation.
struct HeldBody {
    inner: tonic::body::Body,
    /// Of the data frame read last, what is not handed on yet.
    rest: Bytes,
    _held: HeldReply,
}

impl Body for HeldBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let this = &mut *self;
        if this.rest.is_empty() {
            match ready!(Pin::new(&mut this.inner).poll_frame(cx)) {
                Some(Ok(frame)) => match frame.into_data() {
                    Ok(data) => this.rest = data,
                    Err(other) => return Poll::Ready(Some(Ok(other))),
                },
                end => return Poll::Ready(end),
            }
        }
        let piece = this.rest.split_to(this.rest.len().min(CHUNK));
        Poll::Ready(Some(Ok(Frame::data(piece))))
    }

    fn is_end_stream(&self) -> bool {
        self.rest.is_empty() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        let inner = self.inner.size_hint();
        let rest = self.rest.len() as u64;
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

    /// A reply of 2.5 chunks comes out as three pieces in order, then the inner body's
    /// end; the reservation is given back only when the body drops.
    #[tokio::test]
    async fn a_held_reply_is_handed_on_in_chunks_and_holds_its_bytes_until_dropped() {
        let ledger = Arc::new(crate::store::Ledger::new(1 << 30));
        let data: Vec<u8> = (0..CHUNK * 5 / 2).map(|i| (i % 251) as u8).collect();
        // What `hold` puts in a tonic response's extensions, as tonic hands it to the layer.
        let mut http = http::Response::new(tonic::body::Body::new(http_body_full(data.clone())));
        http.extensions_mut().insert(HeldReply {
            _held: Arc::new(ledger.reserve(data.len() as u64, "test").expect("room")),
        });
        let mut body = into_body(http).into_body();
        assert_eq!(ledger.in_flight(), data.len() as u64);
        let mut pieces = Vec::new();
        while let Some(frame) = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await
        {
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
