//! The `Stream` RPC: a reader task decodes updates and queues each on its session's actor
//! (reading up to [`COUNT_AHEAD`] updates ahead, so their long texts count on the counting
//! threads meanwhile); a writer task waits for the outcomes in submission order and sends
//! their events, then the ack or error. Updates to different sessions are in flight together; each session's
//! own order is its actor's mailbox order, and acks leave in the order updates arrived.
//!
//! Backpressure: the outbound buffer (bounded in events and in bytes, [`EVENT_BYTES`]) and
//! the in-flight queue are bounded, so a client that stops reading its events stops being
//! read from (HTTP/2 flow control does the rest); if the buffer stays full for the hub's
//! `slow_reader_grace`, the stream ends with `RESOURCE_EXHAUSTED` and nothing else waits
//! on that client.
//!
//! Memory: every update read and not yet answered, and every event buffered for the
//! client, holds a reservation in the store's ledger (`store::Ledger`), so they count
//! against `memory_budget`. An update the ledger cannot take is refused with
//! `RESOURCE_EXHAUSTED`; an event it cannot take ends the stream with `RESOURCE_EXHAUSTED`
//! naming the first seq whose events were lost.

use std::collections::{HashMap, VecDeque};
use std::ops::ControlFlow;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use prost::Message as _;
use tokio::sync::mpsc::error::TrySendError;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, TryAcquireError, mpsc, oneshot};
use tokio_stream::Stream;
use tonic::{Status, Streaming};
use tracing::Instrument;

use super::compaction::{self, Handed, Sink};
use super::counting;
use super::hub::Hub;
use super::ops::{self, Pending};
use super::outbound::{self, Buffer};
use super::pb;
use super::pb::server_event::Event as Ev;
use super::reply::{self, Reply};
use super::request::{self, Op};
use super::status::Rejection;
use crate::store::Reservation;

/// Events buffered per stream before the writer waits for the client.
const EVENT_BUFFER: usize = 1024;
/// Bytes of events buffered per stream before the writer waits for the client. One event
/// larger than this (a whole large context) still goes out, alone.
pub const EVENT_BYTES: usize = 32 << 20;
/// The unit the byte bound counts in (a semaphore's permits are `u32`).
const EVENT_UNIT: usize = 1024;
/// Updates a stream may have in flight (queued on actors, not yet acked).
const IN_FLIGHT: usize = 256;
/// Updates a stream holds read and not yet queued (the one it queues next included),
/// their long texts counting meanwhile (real BPE, ~150 µs for 4 KB): enough to keep every
/// core counting for one stream; each holds its ledger reservation, like an update in
/// flight.
const COUNT_AHEAD: usize = 32;

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
    /// The update's bytes, counted until it is answered.
    _held: Reservation,
}

/// An event waiting for the client, with what it holds of the stream's byte bound and
/// of the ledger (both given back when tonic takes it).
type Buffered = (pb::ServerEvent, OwnedSemaphorePermit, Reservation);

/// The writer's side of the outbound buffer.
struct Outbound {
    tx: mpsc::Sender<Buffered>,
    bytes: Arc<Semaphore>,
}

/// Starts the reader and writer tasks for one stream and returns its events.
pub fn run(
    hub: Arc<Hub>,
    inbound: Streaming<pb::ClientUpdate>,
    max_update_bytes: usize,
    peer: String,
) -> EventStream {
    let (out_tx, out_rx) = mpsc::channel::<Buffered>(EVENT_BUFFER);
    let (end_tx, end_rx) = oneshot::channel::<Status>();
    // Events of compactions started from this stream, after their start was acked.
    let (cmp_tx, cmp_rx) = mpsc::channel::<Handed>(EVENT_BUFFER);
    let (slot_tx, slot_rx) = mpsc::channel::<Slot>(IN_FLIGHT);
    let span = tracing::info_span!("stream", %peer);
    let reader = Reader {
        hub: hub.clone(),
        max_update_bytes,
        slots: slot_tx,
        compactions: cmp_tx.clone(),
    };
    tokio::spawn(reader.run(inbound).instrument(span.clone()));
    let grace = hub.slow_reader_grace;
    let writer = Writer {
        grace,
        hub,
        out: Outbound {
            tx: out_tx,
            bytes: Arc::new(Semaphore::new(EVENT_BYTES / EVENT_UNIT)),
        },
        end: Some(end_tx),
        auto: Some(cmp_tx),
        started_by: HashMap::new(),
    };
    let buffer = Buffer::new(out_rx);
    tokio::spawn(
        outbound::watch(
            Arc::downgrade(&buffer),
            grace,
            move |b: &Buffer<Buffered>| {
                b.abandon(|(event, _, _)| event.seq, |first| not_taking(first, grace));
            },
        )
        .instrument(span.clone()),
    );
    tokio::spawn(writer.run(slot_rx, cmp_rx).instrument(span));
    // Events already buffered first; then the closing status, if the stream ended with one.
    let end = futures::StreamExt::filter_map(
        futures::stream::once(async move { end_rx.await.ok() }),
        |s| async move { s.map(Err) },
    );
    let events = futures::stream::poll_fn(move |cx| buffer.poll_next(cx));
    Box::pin(futures::StreamExt::chain(
        futures::StreamExt::map(events, |item| item.map(|(event, _, _)| event)),
        end,
    ))
}

/// The status a stream ends with when its client took none of its buffered events for
/// `grace`: they were dropped, from seq `first` on.
fn not_taking(first: Option<u64>, grace: Duration) -> Status {
    tracing::warn!(
        grace_ms = u64::try_from(grace.as_millis()).unwrap_or(u64::MAX),
        dropped_from_seq = first,
        "client took none of its buffered events; dropping them and closing the stream"
    );
    crate::telemetry::rejected(tonic::Code::ResourceExhausted);
    let from = first.map_or_else(String::new, |seq| {
        format!(" Events of seq {seq} and later were not all sent: the updates compactd had read were applied as usual (GetSession shows each session's state before you resend).")
    });
    Status::resource_exhausted(format!(
        "client is not reading its events (took none for {} ms); stream closed and its buffered events dropped.{from}",
        grace.as_millis()
    ))
}

/// Decodes updates and queues each on its session's actor, in arrival order.
struct Reader {
    hub: Arc<Hub>,
    max_update_bytes: usize,
    slots: mpsc::Sender<Slot>,
    /// Where manual compactions started here send their events.
    compactions: mpsc::Sender<Handed>,
}

/// What the reader read and has not queued yet, in arrival order.
enum Read {
    /// An update decoded (or refused), its long texts perhaps being counted (boxed: the
    /// queue moves it, and a decoded part is several hundred bytes).
    Update(Box<Decoded>),
    /// The inbound stream broke (see [`Slot::Failed`]).
    Failed(Status),
}

/// An update decoded, waiting for its turn on its session.
struct Decoded {
    seq: u64,
    session_id: String,
    op: Result<Op, Rejection>,
    /// The count of its long texts, queued on the counting threads ([`ops::count_ahead`]);
    /// kept once done, so its turn knows not to count them again.
    counting: Option<counting::Queued>,
    _held: Reservation,
}

impl Read {
    /// True once it may be queued: nothing of it is still being counted.
    fn is_ready(&mut self) -> bool {
        match self {
            Read::Update(d) => d.counting.as_mut().is_none_or(counting::Queued::is_done),
            Read::Failed(_) => true,
        }
    }
}

impl Reader {
    /// Reads ahead of the update being queued by at most [`COUNT_AHEAD`] updates, whose
    /// long texts count meanwhile on other cores; queues each in arrival order once its
    /// count is done. An update with nothing to count behind none that has is queued at
    /// once.
    async fn run(self, mut inbound: Streaming<pb::ClientUpdate>) {
        let mut ahead: VecDeque<Read> = VecDeque::new();
        let mut reading = true;
        // The drain: no update is read past it; those read are queued and answered.
        let closing = self.hub.closing();
        loop {
            while ahead.front_mut().is_some_and(Read::is_ready) {
                let Some(read) = ahead.pop_front() else { break };
                let slot = match read {
                    Read::Update(d) => Slot::Update(self.queue(*d).await),
                    Read::Failed(status) => Slot::Failed(status),
                };
                if self.slots.send(slot).await.is_err() {
                    return; // the writer stopped: the client went away
                }
            }
            reading &= !closing.is_cancelled();
            if !reading && ahead.is_empty() {
                return;
            }
            let (waiting, more) = (!ahead.is_empty(), reading && ahead.len() < COUNT_AHEAD);
            // The front is still counting (it would have been queued otherwise).
            let front = ahead.front_mut().and_then(|r| match r {
                Read::Update(d) => d.counting.as_mut(),
                Read::Failed(_) => None,
            });
            tokio::select! {
                // A failed count only means the actor counts the texts itself.
                // Once done, the front reads as ready on the next turn.
                _ = async { if let Some(c) = front { c.done().await; } }, if waiting => {}
                () = closing.cancelled(), if reading => reading = false,
                message = inbound.message(), if more => {
                    match message {
                        Ok(Some(update)) => {
                            ahead.push_back(Read::Update(Box::new(self.decode(update))));
                        }
                        Ok(None) => reading = false,
                        Err(status) => {
                            let status =
                                super::too_large::status(status, self.max_update_bytes, true);
                            tracing::debug!(%status, "stream read failed");
                            ahead.push_back(Read::Failed(status));
                            reading = false;
                        }
                    }
                }
            }
        }
    }

    /// Reserves and decodes one update, and starts counting its long texts.
    fn decode(&self, update: pb::ClientUpdate) -> Decoded {
        let (seq, session_id) = (update.seq, update.session_id.clone());
        let len = update.encoded_len();
        let bytes = u64::try_from(len).unwrap_or(u64::MAX);
        let ledger = self.hub.store.ledger();
        let (op, held) = match ledger.reserve(bytes, "updates") {
            Ok(mut held) => {
                let op =
                    request::decode_update(update, len, self.max_update_bytes).and_then(|op| {
                        let decoded = request::decoded_bytes(&op);
                        request::hold_decoded(&mut held, ledger, decoded).map(|()| op)
                    });
                (op, held)
            }
            Err(e) => (Err(Rejection::from(e)), Reservation::default()),
        };
        let counting = op
            .as_ref()
            .ok()
            .and_then(|op| ops::count_ahead(&self.hub, &session_id, op));
        Decoded {
            seq,
            session_id,
            op,
            counting,
            _held: held,
        }
    }

    /// Queues one decoded update (a manual compaction starts here, its events held back
    /// until its start is acked).
    async fn queue(&self, decoded: Decoded) -> Queued {
        let Decoded {
            seq,
            session_id,
            op,
            counting,
            _held,
        } = decoded;
        let counted_ahead = counting.is_some();
        let (kind, pending, go) = match op {
            Ok(Op::Compact(options)) => {
                let (go_tx, go_rx) = oneshot::channel();
                let sink = Sink::listening(self.compactions.clone());
                let started =
                    compaction::start(&self.hub, &session_id, options, Some(sink), Some(go_rx))
                        .await
                        .map_err(|r| r.within_payload("compact"));
                let pending = Pending::answered(started.map(Reply::CompactionStarted));
                ("compact", pending, Some(go_tx))
            }
            Ok(op) => {
                let kind = op.kind();
                let span = tracing::debug_span!("update", seq, session_id = %session_id, kind);
                let pending = ops::submit(&self.hub, &session_id, op, counted_ahead, _held.bytes())
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
            _held,
        }
    }
}

/// Sends the replies in submission order, then the events of the compactions this stream
/// started; stops when the client goes away or stops reading.
struct Writer {
    hub: Arc<Hub>,
    out: Outbound,
    /// The closing status, sent after the buffered events (taken once).
    end: Option<oneshot::Sender<Status>>,
    grace: Duration,
    /// Sink for automatic compactions; dropped when no more updates come, so the channel
    /// closes once the last compaction ends.
    auto: Option<mpsc::Sender<Handed>>,
    /// Compaction id → seq of the update that started it.
    started_by: HashMap<String, u64>,
}

/// What the writer waits for.
enum Input {
    /// The next update in arrival order (None: the reader is done).
    Slot(Option<Slot>),
    /// A compaction event (None: every compaction and the reader are done).
    Compaction(Option<Handed>),
}

impl Writer {
    async fn run(
        mut self,
        mut slots: mpsc::Receiver<Slot>,
        mut compactions: mpsc::Receiver<Handed>,
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
            _held: held,
        } = queued;
        let mut outcome = pending.outcome(&session_id).await;
        // Applied (or refused): what the update held is the session's now, or gone. Not
        // counted again while its reply waits for a slow reader (a JSON tree is counted
        // at its decoded size: many times its wire bytes).
        drop(held);
        // A context's bytes were reserved when it was built; its event takes the
        // reservation over, so the actor building the next contexts cannot starve it.
        let mut carried = match &mut outcome {
            Ok(Reply::Context(c)) => Some(std::mem::take(&mut c.held)),
            _ => None,
        };
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
            self.deliver_with(event, carried.take()).await?;
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

    /// Sends a compaction event under the seq of the update that started the compaction,
    /// then the prune its commit applied, under the same seq.
    async fn forward(&mut self, handed: Handed) -> ControlFlow<()> {
        let Handed { event: ev, pruned } = handed;
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
        let session_id = ev.session_id.clone();
        self.deliver(pb::ServerEvent {
            seq: seq.unwrap_or(0),
            session_id: session_id.clone(),
            event: Some(Ev::Compaction(ev)),
        })
        .await?;
        match pruned {
            Some(report) => {
                self.deliver(pb::ServerEvent {
                    seq: seq.unwrap_or(0),
                    session_id,
                    event: Some(Ev::Pruned(*report)),
                })
                .await
            }
            None => ControlFlow::Continue(()),
        }
    }

    async fn deliver(&mut self, event: pb::ServerEvent) -> ControlFlow<()> {
        self.deliver_with(event, None).await
    }

    /// Sends one event, reusing `held` (an earlier reservation for its content) if given.
    async fn deliver_with(
        &mut self,
        event: pb::ServerEvent,
        held: Option<Reservation>,
    ) -> ControlFlow<()> {
        let ledger = self.hub.store.ledger();
        let held = held.unwrap_or_default();
        if deliver(&self.out, ledger, &mut self.end, event, held, self.grace).await {
            ControlFlow::Continue(())
        } else {
            ControlFlow::Break(())
        }
    }
}

/// Sends one event, waiting at most `grace` for room in the buffer (in events and in
/// bytes). A client that leaves the buffer full that long is not reading: the stream ends
/// with `RESOURCE_EXHAUSTED` (after the buffered events) and its sessions are left exactly
/// as the acks said. An event the ledger cannot take (the budget's in-flight share is
/// spent) ends the stream the same way.
async fn deliver(
    out: &Outbound,
    ledger: &Arc<crate::store::Ledger>,
    end: &mut Option<oneshot::Sender<Status>>,
    event: pb::ServerEvent,
    mut held: Reservation,
    grace: Duration,
) -> bool {
    let seq = event.seq;
    let bytes = event.encoded_len();
    let units = bytes
        .div_ceil(EVENT_UNIT)
        .clamp(1, EVENT_BYTES / EVENT_UNIT);
    let units = u32::try_from(units).unwrap_or(u32::MAX);
    // The buffer has room almost always: take it without setting up a timer (two timers
    // and a clock read per event were a quarter of the writer's CPU at high ingest). Only
    // a full buffer starts the grace, once, for both waits below.
    let mut deadline = None;
    let permit = match out.bytes.clone().try_acquire_many_owned(units) {
        Ok(p) => p,
        Err(TryAcquireError::Closed) => return false,
        Err(TryAcquireError::NoPermits) => {
            let at = *deadline.insert(tokio::time::Instant::now() + grace);
            let wait = out.bytes.clone().acquire_many_owned(units);
            match tokio::time::timeout_at(at, wait).await {
                Ok(Ok(p)) => p,
                Ok(Err(_)) => return false,
                Err(_) => return not_reading(end, seq, grace),
            }
        }
    };
    match held.resize(ledger, u64::try_from(bytes).unwrap_or(u64::MAX), "events") {
        Ok(()) => {}
        // Its content is counted already (a context, at the size of the view it was
        // built from); only its wire form's overhead could not be added.
        Err(_) if held.bytes() > 0 => {}
        Err(e) => {
            tracing::warn!(unsent_from_seq = seq, error = %e, "event buffer over the memory budget; closing the stream");
            crate::telemetry::rejected(tonic::Code::ResourceExhausted);
            if let Some(end) = end.take() {
                let _ = end.send(Status::resource_exhausted(format!(
                    "{e}. Stream closed; events of seq {seq} and later were not all sent: the updates compactd had read were applied \
                     as usual (GetSession shows each session's state before you resend)"
                )));
            }
            return false;
        }
    }
    let item = match out.tx.try_send((event, permit, held)) {
        Ok(()) => return true,
        Err(TrySendError::Closed(_)) => return false, // the client went away
        Err(TrySendError::Full(item)) => item,
    };
    let at = deadline.unwrap_or_else(|| tokio::time::Instant::now() + grace);
    match tokio::time::timeout_at(at, out.tx.send(item)).await {
        Ok(Ok(())) => true,
        Ok(Err(_)) => false, // the client went away
        Err(_) => not_reading(end, seq, grace),
    }
}

/// Ends a stream whose client left its buffer full for `grace`; always false (stop).
fn not_reading(end: &mut Option<oneshot::Sender<Status>>, seq: u64, grace: Duration) -> bool {
    tracing::warn!(
        buffered_events = EVENT_BUFFER,
        buffered_bytes = EVENT_BYTES,
        grace_ms = u64::try_from(grace.as_millis()).unwrap_or(u64::MAX),
        unsent_from_seq = seq,
        "client is not reading its events; closing the stream"
    );
    crate::telemetry::rejected(tonic::Code::ResourceExhausted);
    if let Some(e) = end.take() {
        // The buffered events reach the client before this status; what follows them
        // was processed but never reported, so say where that starts.
        let _ = e.send(Status::resource_exhausted(format!(
            "client is not reading its events (buffer full: {EVENT_BUFFER} events or {EVENT_BYTES} bytes, for {} ms); stream closed. \
             Events of seq {seq} and later were not all sent: the updates compactd had read were applied \
             as usual (GetSession shows each session's state before you resend)",
            grace.as_millis()
        )));
    }
    false
}
