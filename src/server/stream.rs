//! The `Stream` RPC: a reader task decodes updates and queues each on its session's actor;
//! a writer task waits for the outcomes in submission order and sends their events, then
//! the ack or error. Updates to different sessions are in flight together; each session's
//! own order is its actor's mailbox order, and acks leave in the order updates arrived.
//!
//! Backpressure: the outbound buffer and the in-flight queue are bounded, so a client that
//! stops reading its events stops being read from (HTTP/2 flow control does the rest); if
//! the buffer stays full for the hub's `slow_reader_grace`, the stream ends with
//! `RESOURCE_EXHAUSTED` and nothing else waits on that client.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;

use tokio::sync::{mpsc, oneshot};
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Status, Streaming};
use tracing::Instrument;

use super::compaction::{self, Sink};
use super::hub::Hub;
use super::ops::{self, Done, Op, Pending};
use super::pb;
use super::pb::server_event::Event as Ev;

/// Events buffered per stream before the writer waits for the client.
const EVENT_BUFFER: usize = 1024;
/// Updates a stream may have in flight (queued on actors, not yet acked).
const IN_FLIGHT: usize = 256;

/// Outbound event stream of `Stream`.
pub type EventStream = Pin<Box<dyn Stream<Item = Result<pb::ServerEvent, Status>> + Send>>;

/// What the reader hands the writer, in arrival order.
enum Slot {
    /// An update in flight; `go` releases a compaction's events once the ack is out.
    Update {
        seq: u64,
        session_id: String,
        kind: &'static str,
        pending: Pending,
        go: Option<oneshot::Sender<()>>,
    },
    /// The inbound stream broke (e.g. a message over the transport limit): end the
    /// response with this status once everything before it is answered.
    Failed(Status),
}

/// Starts the reader and writer tasks for one stream and returns its events.
pub fn run(
    hub: Arc<Hub>,
    mut inbound: Streaming<pb::ClientUpdate>,
    max_update_bytes: usize,
    peer: String,
) -> EventStream {
    let (out_tx, out_rx) = mpsc::channel::<pb::ServerEvent>(EVENT_BUFFER);
    let (end_tx, end_rx) = oneshot::channel::<Status>();
    let mut end_tx = Some(end_tx);
    let grace = hub.slow_reader_grace;
    // Events of compactions started from this stream, after their start was acked.
    let (cmp_tx, mut cmp_rx) = mpsc::channel::<pb::CompactionEvent>(EVENT_BUFFER);
    let (slot_tx, mut slot_rx) = mpsc::channel::<Slot>(IN_FLIGHT);
    let (hub_w, cmp_tx_w) = (hub.clone(), cmp_tx.clone());
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
                let (kind, pending, go) = match ops::decode_update(update, max_update_bytes) {
                    Ok(Op::Compact(options)) => {
                        // Its events follow on this stream once the start is acked.
                        let (go_tx, go_rx) = oneshot::channel();
                        let sink = Sink::listening(cmp_tx.clone());
                        let started =
                            compaction::start(&hub, &session_id, options, Some(sink), Some(go_rx))
                                .await;
                        let pending =
                            Pending::Ready(started.map(|e| Done::events(vec![Ev::Compaction(e)])));
                        ("compact", pending, Some(go_tx))
                    }
                    Ok(op) => {
                        let kind = op.kind();
                        let span =
                            tracing::debug_span!("update", seq, session_id = %session_id, kind);
                        let pending = ops::submit(&hub, &session_id, op, ops::Scope::Stream)
                            .instrument(span)
                            .await;
                        (kind, pending, None)
                    }
                    Err(r) => ("invalid", Pending::Ready(Err(r)), None),
                };
                let slot = Slot::Update {
                    seq,
                    session_id,
                    kind,
                    pending,
                    go,
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
            let mut auto_tx = Some(cmp_tx_w);
            // Compaction id → seq of the update that started it.
            let mut started_by: HashMap<String, u64> = HashMap::new();
            let (mut slots_open, mut compactions_open) = (true, true);
            while slots_open || compactions_open {
                tokio::select! {
                    biased;
                    slot = slot_rx.recv(), if slots_open => {
                        let Some(slot) = slot else {
                            slots_open = false;
                            auto_tx = None; // no more updates: let the channel close when compactions end
                            continue;
                        };
                        let (seq, session_id, kind, pending, go) = match slot {
                            Slot::Update { seq, session_id, kind, pending, go } => (seq, session_id, kind, pending, go),
                            Slot::Failed(status) => {
                                let _ = end_tx.take().map(|e| e.send(status));
                                return;
                            }
                        };
                        let outcome = pending.outcome(&session_id).await;
                        let mut auto = false;
                        match &outcome {
                            Err(r) => tracing::debug!(seq, %session_id, code = ?r.code, field = %r.field, message = %r.message, "update rejected"),
                            Ok(done) => {
                                auto = done.compact;
                                for e in &done.events {
                                    if let Ev::Compaction(c) = e {
                                        started_by.insert(c.compaction_id.clone(), seq);
                                    }
                                }
                            }
                        }
                        for event in ops::to_server_events(seq, &session_id, kind, outcome) {
                            if !deliver(&out_tx, &mut end_tx, event, grace).await {
                                return; // the client went away or stopped reading
                            }
                        }
                        if let Some(go) = go {
                            let _ = go.send(());
                        }
                        // The update left the session overflowing: compact it, and let this
                        // stream follow (its events carry the update's seq).
                        if let (true, Some(tx)) = (auto, &auto_tx) {
                            let sink = Sink::listening(tx.clone());
                            match compaction::start(&hub_w, &session_id, compaction::Options::automatic(), Some(sink), None).await {
                                Ok(started) => {
                                    started_by.insert(started.compaction_id.clone(), seq);
                                    let event = pb::ServerEvent { seq, session_id: session_id.clone(), event: Some(Ev::Compaction(started)) };
                                    if !deliver(&out_tx, &mut end_tx, event, grace).await {
                                        return;
                                    }
                                }
                                Err(r) => tracing::debug!(%session_id, reason = %r.message, "automatic compaction not started"),
                            }
                        }
                    }
                    ev = cmp_rx.recv(), if compactions_open => {
                        let Some(ev) = ev else { compactions_open = false; continue };
                        let done = matches!(ev.event, Some(pb::compaction_event::Event::Compacted(_) | pb::compaction_event::Event::Failed(_)));
                        let seq = if done { started_by.remove(&ev.compaction_id) } else { started_by.get(&ev.compaction_id).copied() };
                        let event = pb::ServerEvent {
                            seq: seq.unwrap_or(0),
                            session_id: ev.session_id.clone(),
                            event: Some(Ev::Compaction(ev)),
                        };
                        if !deliver(&out_tx, &mut end_tx, event, grace).await {
                            return;
                        }
                    }
                }
            }
        }
        .instrument(span),
    );
    // Events already buffered first; then the closing status, if the stream ended with one.
    let end = futures::StreamExt::filter_map(
        futures::stream::once(async move { end_rx.await.ok() }),
        |s| async move { s.map(Err) },
    );
    Box::pin(futures::StreamExt::chain(
        futures::StreamExt::map(ReceiverStream::new(out_rx), Ok),
        end,
    ))
}

/// Sends one event, waiting at most `grace` for room in the buffer. A client that leaves
/// the buffer full that long is not reading: the stream ends with `RESOURCE_EXHAUSTED`
/// (after the buffered events) and its sessions are left exactly as the acks said.
async fn deliver(
    out: &mpsc::Sender<pb::ServerEvent>,
    end: &mut Option<oneshot::Sender<Status>>,
    event: pb::ServerEvent,
    grace: std::time::Duration,
) -> bool {
    let seq = event.seq;
    match tokio::time::timeout(grace, out.send(event)).await {
        Ok(Ok(())) => true,
        Ok(Err(_)) => false, // the client went away
        Err(_) => {
            tracing::warn!(
                buffered = EVENT_BUFFER,
                grace_ms = grace.as_millis() as u64,
                unsent_from_seq = seq,
                "client is not reading its events; closing the stream"
            );
            crate::telemetry::rejected(tonic::Code::ResourceExhausted);
            if let Some(e) = end.take() {
                // The buffered events reach the client before this status; what follows
                // them was processed but never reported, so say where that starts.
                let _ = e.send(Status::resource_exhausted(format!(
                    "client is not reading its events ({EVENT_BUFFER} buffered for {} ms); stream closed. \
                     Events of seq {seq} and later were not all sent: the updates compactd had read were applied \
                     as usual (GetSession shows each session's state before you resend)",
                    grace.as_millis()
                )));
            }
            false
        }
    }
}
