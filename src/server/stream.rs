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
use std::ops::ControlFlow;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Status, Streaming};
use tracing::Instrument;

use super::compaction::{self, Sink};
use super::hub::Hub;
use super::ops::{self, Pending};
use super::pb;
use super::pb::server_event::Event as Ev;
use super::reply::{self, Reply};
use super::request::{self, Op};

/// Events buffered per stream before the writer waits for the client.
const EVENT_BUFFER: usize = 1024;
/// Updates a stream may have in flight (queued on actors, not yet acked).
const IN_FLIGHT: usize = 256;

/// Outbound event stream of `Stream`.
pub type EventStream = Pin<Box<dyn Stream<Item = Result<pb::ServerEvent, Status>> + Send>>;

/// What the reader hands the writer, in arrival order.
enum Slot {
    /// An update in flight.
    Update(Queued),
    /// The inbound stream broke (e.g. a message over the transport limit): end the
    /// response with this status once everything before it is answered.
    Failed(Status),
}

/// An update the reader queued, waiting for its reply.
struct Queued {
    seq: u64,
    session_id: String,
    kind: &'static str,
    pending: Pending<Reply>,
    /// Releases a manual compaction's events once its start is acked.
    go: Option<oneshot::Sender<()>>,
}

/// Starts the reader and writer tasks for one stream and returns its events.
pub fn run(
    hub: Arc<Hub>,
    inbound: Streaming<pb::ClientUpdate>,
    max_update_bytes: usize,
    peer: String,
) -> EventStream {
    let (out_tx, out_rx) = mpsc::channel::<pb::ServerEvent>(EVENT_BUFFER);
    let (end_tx, end_rx) = oneshot::channel::<Status>();
    // Events of compactions started from this stream, after their start was acked.
    let (cmp_tx, cmp_rx) = mpsc::channel::<pb::CompactionEvent>(EVENT_BUFFER);
    let (slot_tx, slot_rx) = mpsc::channel::<Slot>(IN_FLIGHT);
    let span = tracing::info_span!("stream", %peer);
    let reader = Reader {
        hub: hub.clone(),
        max_update_bytes,
        slots: slot_tx,
        compactions: cmp_tx.clone(),
    };
    tokio::spawn(reader.run(inbound).instrument(span.clone()));
    let writer = Writer {
        grace: hub.slow_reader_grace,
        hub,
        out: out_tx,
        end: Some(end_tx),
        auto: Some(cmp_tx),
        started_by: HashMap::new(),
    };
    tokio::spawn(writer.run(slot_rx, cmp_rx).instrument(span));
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

/// Decodes updates and queues each on its session's actor, in arrival order.
struct Reader {
    hub: Arc<Hub>,
    max_update_bytes: usize,
    slots: mpsc::Sender<Slot>,
    /// Where manual compactions started here send their events.
    compactions: mpsc::Sender<pb::CompactionEvent>,
}

impl Reader {
    async fn run(self, mut inbound: Streaming<pb::ClientUpdate>) {
        loop {
            let slot = match inbound.message().await {
                Ok(Some(update)) => Slot::Update(self.queue(update).await),
                Ok(None) => break,
                Err(status) => {
                    tracing::debug!(%status, "stream read failed");
                    let _ = self.slots.send(Slot::Failed(status)).await;
                    break;
                }
            };
            if self.slots.send(slot).await.is_err() {
                break; // the writer stopped: the client went away
            }
        }
    }

    /// Decodes one update and queues it (a manual compaction starts here, its events held
    /// back until its start is acked).
    async fn queue(&self, update: pb::ClientUpdate) -> Queued {
        let (seq, session_id) = (update.seq, update.session_id.clone());
        let (kind, pending, go) = match request::decode_update(update, self.max_update_bytes) {
            Ok(Op::Compact(options)) => {
                let (go_tx, go_rx) = oneshot::channel();
                let sink = Sink::listening(self.compactions.clone());
                let started =
                    compaction::start(&self.hub, &session_id, options, Some(sink), Some(go_rx))
                        .await;
                let pending = Pending::answered(started.map(Reply::CompactionStarted));
                ("compact", pending, Some(go_tx))
            }
            Ok(op) => {
                let kind = op.kind();
                let span = tracing::debug_span!("update", seq, session_id = %session_id, kind);
                let pending = ops::submit(&self.hub, &session_id, op)
                    .instrument(span)
                    .await;
                (kind, pending, None)
            }
            Err(r) => ("invalid", Pending::answered(Err(r)), None),
        };
        Queued {
            seq,
            session_id,
            kind,
            pending,
            go,
        }
    }
}

/// Sends the replies in submission order, then the events of the compactions this stream
/// started; stops when the client goes away or stops reading.
struct Writer {
    hub: Arc<Hub>,
    out: mpsc::Sender<pb::ServerEvent>,
    /// The closing status, sent after the buffered events (taken once).
    end: Option<oneshot::Sender<Status>>,
    grace: Duration,
    /// Sink for automatic compactions; dropped when no more updates come, so the channel
    /// closes once the last compaction ends.
    auto: Option<mpsc::Sender<pb::CompactionEvent>>,
    /// Compaction id → seq of the update that started it.
    started_by: HashMap<String, u64>,
}

/// What the writer waits for.
enum Input {
    /// The next update in arrival order (None: the reader is done).
    Slot(Option<Slot>),
    /// A compaction event (None: every compaction and the reader are done).
    Compaction(Option<pb::CompactionEvent>),
}

impl Writer {
    async fn run(
        mut self,
        mut slots: mpsc::Receiver<Slot>,
        mut compactions: mpsc::Receiver<pb::CompactionEvent>,
    ) {
        let (mut slots_open, mut compactions_open) = (true, true);
        while slots_open || compactions_open {
            let input = tokio::select! {
                biased;
                slot = slots.recv(), if slots_open => Input::Slot(slot),
                ev = compactions.recv(), if compactions_open => Input::Compaction(ev),
            };
            let flow = match input {
                Input::Slot(Some(Slot::Update(queued))) => self.answer(queued).await,
                Input::Slot(Some(Slot::Failed(status))) => {
                    let _ = self.end.take().map(|e| e.send(status));
                    ControlFlow::Break(())
                }
                Input::Slot(None) => {
                    slots_open = false;
                    self.auto = None;
                    ControlFlow::Continue(())
                }
                Input::Compaction(Some(ev)) => self.forward(ev).await,
                Input::Compaction(None) => {
                    compactions_open = false;
                    ControlFlow::Continue(())
                }
            };
            if flow.is_break() {
                return; // the client went away or stopped reading
            }
        }
    }

    /// Waits for one update's reply and sends its events and ack; then, when the update
    /// left the session overflowing, starts the automatic compaction.
    async fn answer(&mut self, queued: Queued) -> ControlFlow<()> {
        let Queued {
            seq,
            session_id,
            kind,
            pending,
            go,
        } = queued;
        let outcome = pending.outcome(&session_id).await;
        let mut auto = false;
        match &outcome {
            Err(r) => {
                tracing::debug!(seq, %session_id, code = ?r.code, field = %r.field, message = %r.message, "update rejected")
            }
            Ok(Reply::CompactionStarted(c)) => {
                self.started_by.insert(c.compaction_id.clone(), seq);
            }
            Ok(Reply::Stepped(report)) => auto = reply::needs_compaction(report),
            Ok(_) => {}
        }
        for event in reply::to_server_events(seq, &session_id, kind, outcome) {
            self.deliver(event).await?;
        }
        if let Some(go) = go {
            let _ = go.send(());
        }
        if auto {
            self.compact(seq, session_id).await?;
        }
        ControlFlow::Continue(())
    }

    /// Starts the automatic compaction update `seq` asked for; this stream follows its
    /// events, which carry that seq.
    async fn compact(&mut self, seq: u64, session_id: String) -> ControlFlow<()> {
        let Some(tx) = &self.auto else {
            return ControlFlow::Continue(());
        };
        let sink = Sink::listening(tx.clone());
        let Some(started) = compaction::start_automatic(&self.hub, &session_id, Some(sink)).await
        else {
            return ControlFlow::Continue(());
        };
        self.started_by.insert(started.compaction_id.clone(), seq);
        self.deliver(pb::ServerEvent {
            seq,
            session_id,
            event: Some(Ev::Compaction(started)),
        })
        .await
    }

    /// Sends a compaction event under the seq of the update that started the compaction.
    async fn forward(&mut self, ev: pb::CompactionEvent) -> ControlFlow<()> {
        let done = matches!(
            ev.event,
            Some(
                pb::compaction_event::Event::Compacted(_) | pb::compaction_event::Event::Failed(_)
            )
        );
        let seq = if done {
            self.started_by.remove(&ev.compaction_id)
        } else {
            self.started_by.get(&ev.compaction_id).copied()
        };
        self.deliver(pb::ServerEvent {
            seq: seq.unwrap_or(0),
            session_id: ev.session_id.clone(),
            event: Some(Ev::Compaction(ev)),
        })
        .await
    }

    async fn deliver(&mut self, event: pb::ServerEvent) -> ControlFlow<()> {
        if deliver(&self.out, &mut self.end, event, self.grace).await {
            ControlFlow::Continue(())
        } else {
            ControlFlow::Break(())
        }
    }
}

/// Sends one event, waiting at most `grace` for room in the buffer. A client that leaves
/// the buffer full that long is not reading: the stream ends with `RESOURCE_EXHAUSTED`
/// (after the buffered events) and its sessions are left exactly as the acks said.
async fn deliver(
    out: &mpsc::Sender<pb::ServerEvent>,
    end: &mut Option<oneshot::Sender<Status>>,
    event: pb::ServerEvent,
    grace: Duration,
) -> bool {
    let seq = event.seq;
    match tokio::time::timeout(grace, out.send(event)).await {
        Ok(Ok(())) => true,
        Ok(Err(_)) => false, // the client went away
        Err(_) => {
            tracing::warn!(
                buffered = EVENT_BUFFER,
                grace_ms = u64::try_from(grace.as_millis()).unwrap_or(u64::MAX),
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
