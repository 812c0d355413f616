//! Request messages still arriving, counted in the memory ledger's in-flight share.
//!
//! tonic collects each request message whole before any of compactd's code sees it,
//! reserving the length the message's 5-byte gRPC header announces as soon as the header
//! is in (up to the transport's limit, about `max_update_bytes`). A client that announces
//! large messages and never finishes them (256 streams a connection, 768 connections)
//! made compactd hold memory no limit counted. [`ArrivingBody`] reads the gRPC framing of
//! the request body as it passes to tonic and holds, for the message being collected, its
//! announced length in the ledger until its last byte has passed: a message announced
//! over [`SMALL`] is refused with `RESOURCE_EXHAUSTED` when the in-flight share cannot
//! take it and something else is in flight (alone, one larger than the share still
//! arrives, as an import larger than the share is still parsed alone; a unary call
//! fails, a `Stream` ends, as the codec's own refusals do); a small
//! one is counted without refusal (an ordinary update never fails here, and a small
//! message's stream cannot hold more than 256 of them a connection).

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use http_body::{Body, Frame, SizeHint};
use tonic::Status;
use tonic::codegen::Bytes;

use super::status::Rejection;
use crate::store::{Ledger, Reservation};

/// Messages announced at most this long are counted but never refused here.
pub const SMALL: u64 = 64 << 10;

/// Bytes of a gRPC message's header: a compression flag and a big-endian length.
const HEADER: usize = 5;

/// A request body whose message being collected is held in `ledger` (see the module).
pub struct ArrivingBody<B> {
    inner: B,
    ledger: Arc<Ledger>,
    /// How it holds a message (see [`Holding`]).
    holding: Holding,
    /// The header being read, and how much of it is in.
    header: [u8; HEADER],
    header_in: usize,
    /// Bytes of the current message's payload still to come (0: reading a header).
    left: u64,
    /// The current message's announced length, while it arrives.
    held: Reservation,
}

/// How a body holds its messages in the ledger.
#[derive(Debug, Clone, Copy)]
pub struct Holding {
    /// The largest message the transport takes: one announced longer is refused by tonic
    /// at its header and held here at this, never at what it announced.
    pub max: u64,
    /// Whether a large message is refused past the share. A `Stream`'s is only counted:
    /// refused here it would end the stream and every session on it, where the update's
    /// own reservation refuses that one update with an error event.
    pub refuse: bool,
}

impl Holding {
    /// How a request to `path` (its URI path) with the transport's largest message `max`
    /// holds its messages.
    pub fn of(path: &str, max: u64) -> Holding {
        Holding {
            max,
            refuse: path
                .strip_prefix('/')
                .and_then(|p| p.strip_prefix(super::pb::sessions_server::SERVICE_NAME))
                != Some("/Stream"),
        }
    }
}

impl<B> ArrivingBody<B> {
    /// Wraps `inner`, counting what arrives of it in `ledger`.
    pub fn new(inner: B, ledger: Arc<Ledger>, holding: Holding) -> ArrivingBody<B> {
        ArrivingBody {
            inner,
            ledger,
            holding,
            header: [0; HEADER],
            header_in: 0,
            left: 0,
            held: Reservation::default(),
        }
    }

    /// Follows the framing across `data`; refuses a message the share cannot take.
    fn arrived(&mut self, data: &[u8]) -> Result<(), Status> {
        let mut rest = data;
        while !rest.is_empty() {
            if self.left > 0 {
                let take = rest
                    .len()
                    .min(usize::try_from(self.left).unwrap_or(usize::MAX));
                rest = rest.get(take..).unwrap_or_default();
                self.left = self.left.saturating_sub(take as u64);
                if self.left == 0 {
                    // Whole: tonic decodes it now, and the call's own reservation follows.
                    self.held = Reservation::default();
                }
                continue;
            }
            let take = rest.len().min(HEADER.saturating_sub(self.header_in));
            if let (Some(to), Some(from)) = (
                self.header
                    .get_mut(self.header_in..self.header_in.saturating_add(take)),
                rest.get(..take),
            ) {
                to.copy_from_slice(from);
            }
            rest = rest.get(take..).unwrap_or_default();
            self.header_in = self.header_in.saturating_add(take);
            if self.header_in == HEADER {
                self.header_in = 0;
                let [_, a, b, c, d] = self.header;
                self.left = u64::from(u32::from_be_bytes([a, b, c, d]));
                self.hold()?;
            }
        }
        Ok(())
    }

    /// Holds the message just announced (its payload and header).
    fn hold(&mut self) -> Result<(), Status> {
        if self.left == 0 {
            return Ok(());
        }
        let bytes = self
            .left
            .min(self.holding.max)
            .saturating_add(HEADER as u64);
        self.held = if self.left <= SMALL || !self.holding.refuse {
            self.ledger.count(bytes, "request messages arriving")
        } else {
            self.ledger
                .reserve_or_alone(bytes, "request messages arriving")
                .map_err(|e| Status::from(Rejection::from(e)))?
        };
        Ok(())
    }
}

impl<B> Body for ArrivingBody<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<tonic::codegen::StdError>,
{
    type Data = Bytes;
    type Error = tonic::codegen::StdError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = &mut *self;
        let frame = match ready!(Pin::new(&mut this.inner).poll_frame(cx)) {
            Some(Ok(frame)) => frame,
            Some(Err(e)) => return Poll::Ready(Some(Err(e.into()))),
            None => return Poll::Ready(None),
        };
        if let Some(data) = frame.data_ref()
            && let Err(status) = this.arrived(data)
        {
            return Poll::Ready(Some(Err(Box::new(status))));
        }
        Poll::Ready(Some(Ok(frame)))
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A unary call's holding under a 16 MiB transport cap.
    const UNARY: Holding = Holding {
        max: 16 << 20,
        refuse: true,
    };

    fn framed(len: u32, payload: usize) -> Vec<u8> {
        let mut out = vec![0u8];
        out.extend_from_slice(&len.to_be_bytes());
        out.extend(std::iter::repeat_n(b'x', payload));
        out
    }

    /// A large message is held from its header to its last byte, across any split of
    /// the frames; a small one is held too; two messages in one frame are followed.
    #[test]
    fn the_message_being_collected_is_held_until_its_last_byte() {
        let ledger = Arc::new(Ledger::new(64 << 20));
        let mut body = ArrivingBody::new((), ledger.clone(), UNARY);
        let big = framed(1 << 20, 1 << 20);
        // The header in two pieces: nothing held until it is whole.
        body.arrived(&big[..3]).expect("room");
        assert_eq!(ledger.in_flight(), 0);
        body.arrived(&big[3..1000]).expect("room");
        assert_eq!(ledger.in_flight(), (1 << 20) + 5);
        body.arrived(&big[1000..]).expect("room");
        assert_eq!(ledger.in_flight(), 0);
        // A whole small message and the start of the next in one frame.
        let mut two = framed(10, 10);
        two.extend_from_slice(&framed(100, 40));
        body.arrived(&two).expect("room");
        assert_eq!(ledger.in_flight(), 105);
        body.arrived(&[b'x'; 60]).expect("room");
        assert_eq!(ledger.in_flight(), 0);
        // An empty message holds nothing.
        body.arrived(&framed(0, 0)).expect("room");
        assert_eq!(ledger.in_flight(), 0);
    }

    /// Past the in-flight share (an eighth of the budget) a large message is refused at
    /// its header; a small one is still counted.
    #[test]
    fn a_large_message_past_the_share_is_refused_at_its_header() {
        let ledger = Arc::new(Ledger::new(8 << 20)); // share: 1 MiB
        let mut first = ArrivingBody::new((), ledger.clone(), UNARY);
        first.arrived(&framed(900 << 10, 10)).expect("room");
        let mut second = ArrivingBody::new((), ledger.clone(), UNARY);
        let refused = second
            .arrived(&framed(200 << 10, 10))
            .expect_err("past the share");
        assert_eq!(refused.code(), tonic::Code::ResourceExhausted);
        assert!(refused.message().contains("memory_budget"), "{refused:?}");
        let mut small = ArrivingBody::new((), ledger.clone(), UNARY);
        small.arrived(&framed(200, 10)).expect("counted");
        assert_eq!(ledger.in_flight(), (900 << 10) + 5 + 205);
        drop((first, small));
        assert_eq!(ledger.in_flight(), 0);
    }

    /// A header announcing more than the transport takes holds the transport's largest
    /// (tonic refuses it), never what it announced; a `Stream`'s large message is counted,
    /// not refused.
    #[test]
    fn what_is_held_is_bounded_by_the_transport_and_a_stream_is_not_refused() {
        let ledger = Arc::new(Ledger::new(8 << 20)); // share: 1 MiB
        // Alone, past the share, but held at the transport's largest, not at 4 GiB.
        let mut huge = ArrivingBody::new((), ledger.clone(), UNARY);
        huge.arrived(&framed(u32::MAX, 0)).expect("alone");
        assert_eq!(ledger.in_flight(), (16 << 20) + 5);
        drop(huge);
        let stream = Holding::of("/compactd.v1.Sessions/Stream", 4 << 20);
        assert!(!stream.refuse);
        let mut first = ArrivingBody::new((), ledger.clone(), stream);
        first.arrived(&framed(u32::MAX, 10)).expect("counted");
        assert_eq!(ledger.in_flight(), (4 << 20) + 5);
        let mut second = ArrivingBody::new((), ledger.clone(), stream);
        second.arrived(&framed(200 << 10, 10)).expect("counted");
        assert_eq!(ledger.in_flight(), (4 << 20) + 5 + (200 << 10) + 5);
        assert!(Holding::of("/compactd.v1.Sessions/UpsertPart", 1).refuse);
    }
}
