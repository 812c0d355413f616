//! Graceful drain of the open streams: when the hub closes them, a stream yields one
//! `UNAVAILABLE` status (so the client knows to reconnect elsewhere) and ends.

use std::pin::Pin;

use futures::Stream;
use tokio_stream::StreamExt;
use tokio_util::sync::CancellationToken;
use tonic::Status;

/// What a stream closed by the drain reads.
pub const SHUTTING_DOWN: &str =
    "compactd is shutting down; reconnect (sessions live in this process and are not carried over)";

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

/// The refusal of a new stream, compaction or subscription while draining, counted with
/// the other refusals (`compactd_rejected_requests_total{code="UNAVAILABLE"}`).
pub fn refused() -> Status {
    crate::telemetry::rejected(tonic::Code::Unavailable);
    Status::unavailable("compactd is draining and accepts no new streams or compactions")
}
