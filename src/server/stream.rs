//! The `Stream` RPC: a reader task decodes updates and queues each on its session's actor;
//! a writer task waits for the outcomes in submission order and sends their events, then
//! the ack or error. Updates to different sessions are in flight together; each session's
//! own order is its actor's mailbox order, and acks leave in the order updates arrived.
//!
//! Backpressure: the outbound buffer and the in-flight queue are bounded, so a client that
//! stops reading its events stops being read from (HTTP/2 flow control does the rest).

use std::pin::Pin;
use std::sync::Arc;

use tokio::sync::mpsc;
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Status, Streaming};
use tracing::Instrument;

use super::ops::{self, Pending};
use super::pb;
use crate::store::Store;

/// Events buffered per stream before the writer waits for the client.
const EVENT_BUFFER: usize = 1024;
/// Updates a stream may have in flight (queued on actors, not yet acked).
const IN_FLIGHT: usize = 256;

/// Outbound event stream of `Stream`.
pub type EventStream = Pin<Box<dyn Stream<Item = Result<pb::ServerEvent, Status>> + Send>>;

/// What the reader hands the writer, in arrival order.
enum Slot {
    /// An update in flight.
    Update {
        seq: u64,
        session_id: String,
        kind: &'static str,
        pending: Pending,
    },
    /// The inbound stream broke (e.g. a message over the transport limit): end the
    /// response with this status once everything before it is answered.
    Failed(Status),
}

/// Starts the reader and writer tasks for one stream and returns its events.
pub fn run(
    store: Arc<Store>,
    mut inbound: Streaming<pb::ClientUpdate>,
    max_update_bytes: usize,
    peer: String,
) -> EventStream {
    let (out_tx, out_rx) = mpsc::channel(EVENT_BUFFER);
    let (slot_tx, mut slot_rx) = mpsc::channel::<Slot>(IN_FLIGHT);
    let span = tracing::info_span!("stream", %peer);

    tokio::spawn(
        async move {
            loop {
                let update = match inbound.message().await {
                    Ok(Some(u)) => u,
                    Ok(None) => break,
                    Err(status) => {
                        tracing::debug!(%status, "stream read failed");
                        let _ = slot_tx.send(Slot::Failed(status)).await;
                        break;
                    }
                };
                let (seq, session_id) = (update.seq, update.session_id.clone());
                let (kind, pending) = match ops::decode_update(update, max_update_bytes) {
                    Ok(op) => {
                        let kind = op.kind();
                        tracing::trace!(seq, %session_id, kind, "update");
                        (
                            kind,
                            ops::submit(&store, &session_id, op, ops::Scope::Stream).await,
                        )
                    }
                    Err(r) => ("invalid", Pending::Ready(Err(r))),
                };
                let slot = Slot::Update {
                    seq,
                    session_id,
                    kind,
                    pending,
                };
                if slot_tx.send(slot).await.is_err() {
                    break; // the writer stopped: the client went away
                }
            }
        }
        .instrument(span.clone()),
    );

    tokio::spawn(
        async move {
            while let Some(slot) = slot_rx.recv().await {
                let (seq, session_id, kind, pending) = match slot {
                    Slot::Update { seq, session_id, kind, pending } => (seq, session_id, kind, pending),
                    Slot::Failed(status) => {
                        let _ = out_tx.send(Err(status)).await;
                        return;
                    }
                };
                let outcome = pending.outcome(&session_id).await;
                if let Err(r) = &outcome {
                    tracing::debug!(seq, %session_id, code = ?r.code, field = %r.field, message = %r.message, "update rejected");
                }
                for event in ops::to_server_events(seq, &session_id, kind, outcome) {
                    if out_tx.send(Ok(event)).await.is_err() {
                        return; // the client went away
                    }
                }
            }
        }
        .instrument(span),
    );
    Box::pin(ReceiverStream::new(out_rx))
}
