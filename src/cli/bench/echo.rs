//! The raw tonic echo service `compactd bench` measures compactd against
//! (`proto/bench/echo.proto`): a bidirectional stream answering each request in order and
//! a unary call, each reply carrying as many payload bytes as the client asks for. It runs
//! as a child process of the same binary (`compactd bench --serve-echo`), on 127.0.0.1:0
//! with compactd's own HTTP/2 settings, so the only difference the bench sees is the work
//! compactd does behind its transport.
//!
//! It prints `{"listen":"127.0.0.1:PORT"}` on stdout once bound and exits when its stdin
//! closes (the bench holds it open), so it never outlives the bench.

use std::io::Write as _;
use std::pin::Pin;
use std::sync::{Arc, RwLock};

use prost::bytes::Bytes;
use tokio::sync::mpsc;
use tokio_stream::Stream;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::TcpIncoming;
use tonic::{Request, Response, Status, Streaming};

use super::BenchError;

/// Generated types and stubs of `compactd.bench.v1` (not compactd's API).
#[allow(missing_docs, clippy::all)]
pub mod pb {
    tonic::include_proto!("compactd.bench.v1");
}

/// Largest reply a request may ask for.
const MAX_REPLY: u64 = 1 << 30;
/// Replies buffered per stream before the server waits for the client (compactd's bound).
const BUFFER: usize = 1024;

/// The echo service: its only state is a buffer of zeros replies are sliced from.
#[derive(Debug, Clone, Default)]
pub struct EchoService {
    zeros: Arc<RwLock<Bytes>>,
}

impl EchoService {
    /// `n` bytes of zeros, shared: a reply costs its encoding, not an allocation.
    fn payload(&self, n: u64) -> Result<Bytes, Status> {
        if n > MAX_REPLY {
            return Err(Status::invalid_argument(format!(
                "reply_bytes: {n} is over {MAX_REPLY}"
            )));
        }
        let n = usize::try_from(n).map_err(|_| Status::invalid_argument("reply_bytes"))?;
        {
            let zeros = self.zeros.read().unwrap_or_else(|e| e.into_inner());
            if zeros.len() >= n {
                return Ok(zeros.slice(..n));
            }
        }
        let mut zeros = self.zeros.write().unwrap_or_else(|e| e.into_inner());
        if zeros.len() < n {
            *zeros = Bytes::from(vec![0u8; n.next_power_of_two()]);
        }
        Ok(zeros.slice(..n))
    }
}

/// The echo stream's outbound half.
type ReplyStream = Pin<Box<dyn Stream<Item = Result<pb::EchoReply, Status>> + Send>>;

#[tonic::async_trait]
impl pb::echo_server::Echo for EchoService {
    type StreamStream = ReplyStream;

    async fn stream(
        &self,
        request: Request<Streaming<pb::EchoRequest>>,
    ) -> Result<Response<ReplyStream>, Status> {
        let mut inbound = request.into_inner();
        let (tx, rx) = mpsc::channel(BUFFER);
        let service = self.clone();
        tokio::spawn(async move {
            while let Ok(Some(r)) = inbound.message().await {
                let reply = service.payload(r.reply_bytes).map(|payload| pb::EchoReply {
                    seq: r.seq,
                    payload,
                });
                if tx.send(reply).await.is_err() {
                    break; // the client went away
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn unary(
        &self,
        request: Request<pb::EchoRequest>,
    ) -> Result<Response<pb::EchoReply>, Status> {
        let r = request.into_inner();
        Ok(Response::new(pb::EchoReply {
            seq: r.seq,
            payload: self.payload(r.reply_bytes)?,
        }))
    }
}

/// `compactd bench --serve-echo`: serves the echo on 127.0.0.1:0 until stdin closes.
pub fn serve() -> Result<(), BenchError> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| BenchError::Io(format!("starting the async runtime: {e}")))?;
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .map_err(|e| BenchError::Io(format!("binding 127.0.0.1:0: {e}")))?;
        let addr = listener
            .local_addr()
            .map_err(|e| BenchError::Io(e.to_string()))?;
        let mut stdout = std::io::stdout().lock();
        writeln!(
            stdout,
            "{}",
            serde_json::json!({ "listen": addr.to_string() })
        )
        .and_then(|()| stdout.flush())
        .map_err(|e| BenchError::Io(format!("writing the address: {e}")))?;
        drop(stdout);
        // As compactd's `serve`: no Nagle delay on small answers.
        let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
        let service = pb::echo_server::EchoServer::new(EchoService::default())
            .max_decoding_message_size(1 << 30)
            .max_encoding_message_size(usize::MAX);
        crate::server::transport::configure(tonic::transport::Server::builder())
            .add_service(service)
            .serve_with_incoming_shutdown(incoming, stdin_closed())
            .await
            .map_err(|e| BenchError::Io(format!("echo server: {e}")))
    })
}

/// Resolves when stdin reaches its end (the bench exited or closed it).
async fn stdin_closed() {
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    // A plain thread, not the runtime's blocking pool: the runtime must not wait for it.
    std::thread::spawn(move || {
        let _ = std::io::copy(&mut std::io::stdin().lock(), &mut std::io::sink());
        let _ = tx.send(());
    });
    let _ = rx.await;
}
