//! The stream driver: sends a sequence of updates over one bidirectional stream with a
//! bounded number in flight, and times each from its send to its answer. The same loop
//! drives compactd's `Stream` and the echo service's, through [`Wire`], so the client's
//! work is identical on both sides and only the server differs.
//!
//! Every failure is counted (a refused update, a stream that breaks or ends early, a
//! server that stops answering), never unwrapped.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::time::{Duration, Instant};

use futures::{Stream, StreamExt};
use prost::Message as _;
use prost::bytes::Bytes;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;

use super::echo::pb as echo_pb;
use super::workload;
use crate::server::pb;
use crate::server::pb::server_event::Event;
use crate::server::pb::sessions_client::SessionsClient;

/// How long the driver waits for the next answer before it gives the stream up.
pub const STALL: Duration = Duration::from_secs(30);

/// What the server said about one update.
#[derive(Debug)]
pub enum Answer {
    /// Applied (compactd's ack, the echo's reply).
    Ack(u64),
    /// Refused, with the server's reason.
    Refused(u64, String),
    /// Any other event (compactd's prune reports, overflow checks, ...).
    Other,
}

/// The answers of one open stream.
pub type Answers = Pin<Box<dyn Stream<Item = Result<Answer, tonic::Status>> + Send>>;

/// A server as the driver sees it: how an update travels, and its answers.
pub trait Wire: Send + 'static {
    /// What one update becomes on this wire.
    type Msg: Send + 'static;
    /// True when the sessions the updates name are real (compactd's) and must be deleted
    /// after the case.
    const HOLDS_SESSIONS: bool;
    /// Builds the message for `update` (timed: it is part of the round trip).
    fn message(&mut self, update: pb::ClientUpdate) -> Self::Msg;
    /// Opens a stream that sends what `rx` yields.
    fn open(
        &mut self,
        rx: mpsc::Receiver<Self::Msg>,
    ) -> impl Future<Output = Result<Answers, tonic::Status>> + Send;
}

/// compactd's `Stream` RPC.
#[derive(Debug, Clone)]
pub struct Compactd {
    client: SessionsClient<Channel>,
}

impl Compactd {
    /// The `Stream` RPC of the server behind `channel`.
    pub fn new(channel: Channel) -> Self {
        Compactd {
            client: client(channel),
        }
    }
}

/// A compactd client allowed to receive large contexts.
pub fn client(channel: Channel) -> SessionsClient<Channel> {
    SessionsClient::new(channel)
        .max_decoding_message_size(1 << 30)
        .max_encoding_message_size(1 << 30)
}

impl Wire for Compactd {
    type Msg = pb::ClientUpdate;
    const HOLDS_SESSIONS: bool = true;

    fn message(&mut self, update: pb::ClientUpdate) -> pb::ClientUpdate {
        update
    }

    async fn open(
        &mut self,
        rx: mpsc::Receiver<pb::ClientUpdate>,
    ) -> Result<Answers, tonic::Status> {
        let events = self
            .client
            .stream(ReceiverStream::new(rx))
            .await?
            .into_inner();
        Ok(Box::pin(events.map(|ev| {
            ev.map(|ev| match ev.event {
                Some(Event::Ack(_)) => Answer::Ack(ev.seq),
                Some(Event::Error(e)) => {
                    Answer::Refused(ev.seq, format!("{}: {} ({})", e.code, e.message, e.field))
                }
                _ => Answer::Other,
            })
        })))
    }
}

/// The echo service's `Stream` RPC: each update travels encoded, as the payload (the
/// client encodes it as it would for compactd, so both clients do the same work), and is
/// answered by as many bytes as compactd's ack.
#[derive(Debug, Clone)]
pub struct Echo {
    client: echo_pb::echo_client::EchoClient<Channel>,
    /// Counts each update's texts with this BPE before sending it (the "echo + count"
    /// reference of the ping-pong latency).
    count_with: Option<&'static crate::tokens::bpe::Bpe>,
}

impl Echo {
    /// The echo stream of the service behind `channel`.
    pub fn new(channel: Channel) -> Self {
        Echo {
            client: echo_client(channel),
            count_with: None,
        }
    }

    /// Also counts each update's texts with `bpe` (uncached) before sending it.
    pub fn counting(mut self, bpe: &'static crate::tokens::bpe::Bpe) -> Self {
        self.count_with = Some(bpe);
        self
    }
}

/// An echo client allowed to receive large replies.
pub fn echo_client(channel: Channel) -> echo_pb::echo_client::EchoClient<Channel> {
    echo_pb::echo_client::EchoClient::new(channel)
        .max_decoding_message_size(1 << 30)
        .max_encoding_message_size(1 << 30)
}

impl Wire for Echo {
    type Msg = echo_pb::EchoRequest;
    const HOLDS_SESSIONS: bool = false;

    fn message(&mut self, update: pb::ClientUpdate) -> echo_pb::EchoRequest {
        if let Some(bpe) = self.count_with {
            for t in workload::counted_texts(&update) {
                std::hint::black_box(bpe.count_uncached(t));
            }
        }
        let ack = pb::ServerEvent {
            seq: update.seq,
            session_id: update.session_id.clone(),
            event: Some(Event::Ack(pb::Ack {
                kind: workload::kind(&update).into(),
                created: true,
            })),
        };
        echo_pb::EchoRequest {
            seq: update.seq,
            payload: Bytes::from(update.encode_to_vec()),
            reply_bytes: ack.encoded_len() as u64,
        }
    }

    async fn open(
        &mut self,
        rx: mpsc::Receiver<echo_pb::EchoRequest>,
    ) -> Result<Answers, tonic::Status> {
        let replies = self
            .client
            .stream(ReceiverStream::new(rx))
            .await?
            .into_inner();
        Ok(Box::pin(replies.map(|r| r.map(|r| Answer::Ack(r.seq)))))
    }
}

/// What one driven stream did.
#[derive(Debug, Default)]
pub struct Driven {
    /// Updates answered with an ack.
    pub acked: u64,
    /// Updates refused or left unanswered, and streams that failed.
    pub errors: u64,
    /// The first failure, for the report.
    pub first_error: Option<String>,
    /// Protobuf bytes of the updates sent.
    pub bytes: u64,
    /// Send-to-ack time of each acked update.
    pub latencies: Vec<Duration>,
    /// The same, of the acked updates that carried a tool output (the part size under
    /// test).
    pub tool_latencies: Vec<Duration>,
}

impl Driven {
    fn fail(&mut self, n: u64, why: impl FnOnce() -> String) {
        self.errors += n;
        if self.first_error.is_none() {
            self.first_error = Some(why());
        }
    }
}

/// Sends `updates` over one stream of `wire`, at most `window` unanswered at a time, until
/// `limit` updates are sent or `deadline` passes; then waits for what is in flight.
pub async fn drive<W: Wire>(
    mut wire: W,
    updates: &mut impl Iterator<Item = pb::ClientUpdate>,
    limit: usize,
    window: usize,
    deadline: Instant,
) -> Driven {
    let window = window.max(1);
    let mut out = Driven::default();
    let (tx, rx) = mpsc::channel(window);
    let mut answers = match wire.open(rx).await {
        Ok(a) => a,
        Err(status) => {
            out.fail(1, || format!("stream did not open: {status}"));
            return out;
        }
    };
    // Each update in flight: its seq, when it was sent, and whether it carries a tool output.
    let mut sent: VecDeque<(u64, Instant, bool)> = VecDeque::with_capacity(window);
    let mut remaining = limit;
    loop {
        while sent.len() < window && remaining > 0 && Instant::now() < deadline {
            let Some(update) = updates.next() else {
                remaining = 0;
                break;
            };
            remaining -= 1;
            let seq = update.seq;
            let tool = workload::is_tool_output(&update);
            out.bytes += update.encoded_len() as u64;
            let at = Instant::now();
            let msg = wire.message(update);
            if tx.send(msg).await.is_err() {
                out.fail(1, || "the stream closed while sending".into());
                remaining = 0;
                break;
            }
            sent.push_back((seq, at, tool));
        }
        if sent.is_empty() {
            break;
        }
        let in_flight = sent.len() as u64;
        match tokio::time::timeout(STALL, answers.next()).await {
            Err(_) => {
                out.fail(in_flight, || format!("no answer for {} s", STALL.as_secs()));
                break;
            }
            Ok(None) => {
                out.fail(in_flight, || {
                    format!("the stream ended with {in_flight} updates unanswered")
                });
                break;
            }
            Ok(Some(Err(status))) => {
                out.fail(in_flight, || format!("the stream failed: {status}"));
                break;
            }
            Ok(Some(Ok(Answer::Other))) => {}
            Ok(Some(Ok(answer))) => {
                let (seq, refused) = match answer {
                    Answer::Ack(seq) => (seq, None),
                    Answer::Refused(seq, why) => (seq, Some(why)),
                    Answer::Other => continue,
                };
                let Some((expected, at, tool)) = sent.pop_front() else {
                    continue;
                };
                if seq != expected {
                    out.fail(1, || {
                        format!("answer for seq {seq} where {expected} was due")
                    });
                } else if let Some(why) = refused {
                    out.fail(1, || format!("update {seq} refused: {why}"));
                } else {
                    let took = at.elapsed();
                    out.acked += 1;
                    out.latencies.push(took);
                    if tool {
                        out.tool_latencies.push(took);
                    }
                }
            }
        }
    }
    drop(tx);
    out
}
