//! Graceful drain of the open streams: when the hub closes them, a stream yields one
//! `UNAVAILABLE` status (so the client knows to reconnect elsewhere) and ends. A `Stream`
//! first stops reading updates and answers every one it read ([`after_closed`]), so what
//! was applied was acknowledged; a `Subscribe` ends at once ([`until_closed`]).

use std::pin::Pin;

use futures::Stream;
use tokio_stream::StreamExt;
use tokio_util::sync::CancellationToken;
use tonic::Status;

/// What a stream closed by the drain reads.
pub const SHUTTING_DOWN: &str = "compactd is shutting down: every update acknowledged before \
     this status was applied, and none after it was read; reconnect and send those again \
     (sessions are kept on disk, except under --durability memory)";

/// `inner` until `closing` fires, then one `UNAVAILABLE` and the end.
pub fn until_closed<T: Send + 'static>(
    inner: Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>,
    closing: CancellationToken,
) -> Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>> {
    let state = (inner, Box::pin(closing.cancelled_owned()), false);
    Box::pin(futures::stream::unfold(
        state,
        |(mut inner, mut closed, done)| async move {
            if done {
                return None;
            }
            tokio::select! {
                biased;
                _ = &mut closed => Some((Err(Status::unavailable(SHUTTING_DOWN)), (inner, closed, true))),
                item = inner.next() => item.map(|i| (i, (inner, closed, false))),
            }
        },
    ))
}

/// `inner` to its end, then, once `closing` has fired, one `UNAVAILABLE`: `inner` ends by
/// itself when the drain closes it (a `Stream` stops reading at `closing` and ends once
/// it has answered what it read). An `inner` that ends with a status keeps it.
pub fn after_closed<T: Send + 'static>(
    inner: Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>,
    closing: CancellationToken,
) -> Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>> {
    let state = (inner, closing, false);
    Box::pin(futures::stream::unfold(
        state,
        |(mut inner, closing, done)| async move {
            if done {
                return None;
            }
            match inner.next().await {
                Some(Err(status)) => Some((Err(status), (inner, closing, true))),
                Some(item) => Some((item, (inner, closing, false))),
                None if closing.is_cancelled() => Some((
                    Err(Status::unavailable(SHUTTING_DOWN)),
                    (inner, closing, true),
                )),
                None => None,
            }
        },
    ))
}

/// The refusal of a new stream, compaction or subscription while draining, counted with
/// the other refusals (`compactd_rejected_requests_total{code="UNAVAILABLE"}`).
pub fn refused() -> Status {
    crate::telemetry::rejected(tonic::Code::Unavailable);
    Status::unavailable("compactd is draining and accepts no new streams or compactions")
}
