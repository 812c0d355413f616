//! The gRPC shell: `compactd.v1.Sessions`, `grpc.health.v1.Health` and server reflection
//! (v1 and v1alpha), served on a listener the caller owns until the caller's shutdown
//! future resolves.
//!
//! Architecture invariant: `compactd.v1`'s protobuf types are served and converted here
//! and nowhere else (`compactd bench` uses them only as a client). `convert.rs` is the
//! only file that maps them to domain types (calling the domain's and the config's own
//! `validate()`, the one home of every rule); `status.rs` is the only place the errors of
//! a request's content or its session become gRPC codes (the transport's own refusals,
//! auth, the pre-decode guard, slow readers and draining, build theirs where they happen).
//!
//! # Reading order
//! Follow one update from the wire to the engine and back:
//! 1. `mod.rs` (this file): serving, the drain, and what runs beside the services.
//! 2. `service.rs`: the RPC handlers. Unary handlers decode, call one `ops` function,
//!    and encode the typed reply it returns.
//! 3. `stream.rs`: the `Stream` RPC. A reader queues each update; a writer answers them
//!    in arrival order and follows the compactions the stream started.
//! 4. `request.rs`: a client request decoded into an `Op` (with `convert.rs`), and a
//!    `ListSessions` page's fields checked and its sessions picked.
//! 5. `ops.rs`: an op queued on its session's actor (`store`), answering the engine's
//!    typed reply (step report, context view, prune report, overflow check).
//! 6. `reply.rs`: a reply turned into the stream's events and ack.
//! 7. `compaction.rs`: a compaction claimed, planned, summarized (`summarize::chunk`)
//!    and committed; `start_automatic` is where every automatic compaction begins.
//! 8. `hub.rs`: the shared state: store, `Subscribe` bus, compaction slots, drain.
//!
//! Then the edges: `convert.rs` (protobuf ↔ domain), `status.rs` (errors → codes),
//! `drain.rs` (closing streams), `evict.rs` (idle evictions announced), `held_reply.rs`
//! (a unary reply's bytes counted in flight until it is sent), `counting.rs`
//! (the threads that count long texts off the runtime), `import.rs` (ImportSession and
//! its chunked twin for documents past `max_update_bytes`), `clock.rs` (the wall clock),
//! `auth.rs`, `transport.rs` (HTTP/2 settings), `accept.rs` (what the listener lets in:
//! a cap on connections, a deadline for their first bytes, failed accepts waited out),
//! `lingering_close.rs` (a closed
//! connection reads until its client closes, so its last answers are not lost to a
//! TCP reset), `codec.rs` (the guard that
//! refuses amplifying requests before decoding, and the encoder that sizes each reply),
//! `outbound.rs` (a stream's event buffer, given up on when its client takes nothing),
//! `too_large.rs` (tonic's refusal of an update past the transport cap, said as compactd says it),
//! `wire_value/` (GetContext's protobuf OpenAI shape written straight to wire bytes),
//! `list_value.rs` (the `ListValue` that carries them), `context_message.rs` (the
//! `Context` that carries the other shapes' cached chunks) and `pb.rs` (generated).

#[cfg(test)]
mod abandoned_tests;
mod accept;
mod arriving;
pub mod auth;
mod clock;
pub mod codec;
mod compaction;
pub mod context_message;
mod convert;
mod counting;
mod drain;
mod evict;
#[cfg(test)]
mod fuzz_tests;
mod held_reply;
pub mod hub;
mod import;
mod lingering_close;
pub mod list_value;
mod ops;
mod outbound;
pub mod pb;
mod reply;
mod request;
mod service;
mod status;
mod stream;
#[cfg(test)]
mod test_traces;
mod too_large;
pub mod transport;
mod watch;
mod wire_value;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tonic::transport::server::TcpIncoming;

pub use auth::{AuthConfig, BearerToken};
pub use counting::THREAD_PREFIX as COUNT_THREAD_PREFIX;
pub use hub::{CompactionConfig, Hub};
pub use request::DEFAULT_MAX_UPDATE_BYTES;
pub use service::SessionsService;

use crate::store::Store;
use lingering_close::LingeringClose;

/// Transport-level cap beyond `max_update_bytes`: an update a little over the limit gets
/// compactd's own `RESOURCE_EXHAUSTED` naming it; the transport never buffers more than
/// this above the limit for one message.
const TRANSPORT_SLACK: usize = 64 << 10;

/// How the server is run.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// Largest update accepted (`RESOURCE_EXHAUSTED` beyond it).
    pub max_update_bytes: usize,
    /// Summarizer and compaction settings.
    pub compaction: CompactionConfig,
    /// How long a drain lets running compactions finish before cancelling them.
    pub drain_timeout: Duration,
    /// Bearer-token authentication (off unless a token is set).
    pub auth: AuthConfig,
    /// Sessions untouched this long are evicted (None: never).
    pub idle_ttl: Option<Duration>,
    /// How long a `Stream` client may leave its event buffer full before the stream is
    /// closed with `RESOURCE_EXHAUSTED`, and a unary reply unread before it is dropped
    /// (at most a day is used, [`hub::bounded_wait`]).
    pub slow_reader_grace: Duration,
    /// TLS (and, with a client CA, mutual TLS); plaintext when None.
    pub tls: Option<tonic::transport::ServerTlsConfig>,
}

/// Default of [`ServerOptions::drain_timeout`] (under Kubernetes' default 30 s grace).
pub const DEFAULT_DRAIN_TIMEOUT: Duration = Duration::from_secs(20);

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            max_update_bytes: DEFAULT_MAX_UPDATE_BYTES,
            compaction: CompactionConfig::default(),
            drain_timeout: DEFAULT_DRAIN_TIMEOUT,
            auth: AuthConfig::default(),
            idle_ttl: None,
            slow_reader_grace: hub::DEFAULT_SLOW_READER_GRACE,
            tls: None,
        }
    }
}

/// Serves on a TCP listener; see [`serve_incoming`].
pub async fn serve(
    listener: TcpListener,
    store: Arc<Store>,
    options: ServerOptions,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let addr: Option<SocketAddr> = listener.local_addr().ok();
    tracing::info!(addr = ?addr, max_update_bytes = options.max_update_bytes, "compactd serving");
    // Small request/response exchanges must not wait on Nagle's algorithm (23 ms per
    // unary call on loopback without this).
    let incoming = TcpIncoming::from(listener)
        .with_nodelay(Some(true))
        .with_keepalive(Some(transport::TCP_KEEPALIVE));
    serve_incoming(incoming, store, options, shutdown).await
}

/// Serves on a Unix domain socket (its file mode is the caller's business).
#[cfg(unix)]
pub async fn serve_unix(
    listener: tokio::net::UnixListener,
    store: Arc<Store>,
    options: ServerOptions,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    tracing::info!(
        max_update_bytes = options.max_update_bytes,
        "compactd serving on a unix socket"
    );
    let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
    serve_incoming(incoming, store, options, shutdown).await
}

/// Serves every service on `incoming` until `shutdown` resolves, then drains: health
/// turns NOT_SERVING, new streams and compactions are refused with `UNAVAILABLE`, running
/// compactions get `drain_timeout` to finish, open streams end with `UNAVAILABLE`, and
/// the call returns once the connections are closed.
pub async fn serve_incoming<I, IO, IE>(
    incoming: I,
    store: Arc<Store>,
    options: ServerOptions,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError>
where
    I: tokio_stream::Stream<Item = Result<IO, IE>> + Send + 'static,
    IO: tokio::io::AsyncRead
        + tokio::io::AsyncWrite
        + tonic::transport::server::Connected
        + Unpin
        + Send
        + 'static,
    IE: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let transport_max = options.max_update_bytes.saturating_add(TRANSPORT_SLACK);
    codec::set_max_update_bytes(options.max_update_bytes);
    let mut hub = Hub::new(store, options.compaction.clone());
    let slow_reader_grace = hub::bounded_wait(options.slow_reader_grace);
    hub.slow_reader_grace = slow_reader_grace;
    let hub = Arc::new(hub);
    let drain_hub = hub.clone();
    if let Some(ttl) = options.idle_ttl {
        let evictions = hub.store.evict_idle_after(ttl);
        tokio::spawn(evict::announce(hub.clone(), evictions));
    }
    let sessions = pb::sessions_server::SessionsServer::new(SessionsService::new(
        hub.clone(),
        options.max_update_bytes,
    ))
    .max_decoding_message_size(transport_max)
    .max_encoding_message_size(usize::MAX);

    let (health_reporter, health) = tonic_health::server::health_reporter();
    health_reporter
        .set_serving::<pb::sessions_server::SessionsServer<SessionsService>>()
        .await;
    health_reporter
        .set_service_status("", tonic_health::ServingStatus::Serving)
        .await;

    if let Some(backend) = hub.store.backend().cloned() {
        tokio::spawn(report_store_health(
            backend,
            health_reporter.clone(),
            hub.closing(),
        ));
    }

    let reporter = health_reporter.clone();
    let deadline = options.drain_timeout;
    // Once drained: how long connections may stay open before the server returns anyway.
    let (drained_tx, drained) = tokio::sync::oneshot::channel::<Duration>();
    let shutdown = async move {
        shutdown.await;
        let began = tokio::time::Instant::now();
        tracing::info!(deadline_secs = deadline.as_secs(), "draining");
        reporter
            .set_not_serving::<pb::sessions_server::SessionsServer<SessionsService>>()
            .await;
        reporter
            .set_service_status("", tonic_health::ServingStatus::NotServing)
            .await;
        let cancelled = drain_hub.drain(deadline).await;
        let linger = linger_after(deadline, began.elapsed());
        tracing::info!(
            cancelled_compactions = cancelled,
            linger_ms = u64::try_from(linger.as_millis()).unwrap_or(u64::MAX),
            "drained; closing connections"
        );
        let _ = drained_tx.send(linger);
    };

    let reflection_v1 = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
        .map_err(|e| ServeError::Reflection(e.to_string()))?;
    let reflection_v1alpha = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1alpha()
        .map_err(|e| ServeError::Reflection(e.to_string()))?;

    let token = options.auth.token.clone();
    let max_update_bytes = options.max_update_bytes;
    // Each request message still arriving is counted in flight (`arriving.rs`).
    let arriving_ledger = hub.store.ledger().clone();
    let arriving_max = u64::try_from(transport_max).unwrap_or(u64::MAX);
    let guard = |on: bool| auth::interceptor(token.clone().filter(|_| on));
    let health = tonic::service::interceptor::InterceptedService::new(
        health,
        guard(options.auth.protect_health),
    );
    let reflection_v1 = tonic::service::interceptor::InterceptedService::new(
        reflection_v1,
        guard(!options.auth.open_reflection),
    );
    let reflection_v1alpha = tonic::service::interceptor::InterceptedService::new(
        reflection_v1alpha,
        guard(!options.auth.open_reflection),
    );
    let sessions = tonic::service::interceptor::InterceptedService::new(sessions, guard(true));
    let mut builder = transport::configure(tonic::transport::Server::builder());
    if let Some(tls) = options.tls.clone() {
        // A handshake that does not finish is dropped (its connection's slot freed).
        let tls = tls.timeout(accept::FIRST_BYTES_DEADLINE);
        builder = builder.tls_config(tls).map_err(ServeError::Transport)?;
    }
    let server = builder
        .trace_fn(|req| tracing::info_span!("rpc", rpc = %req.uri().path()))
        .layer(tower::util::MapRequestLayer::new(
            move |r: http::Request<tonic::body::Body>| {
                let ledger = arriving_ledger.clone();
                let holding = arriving::Holding::of(r.uri().path(), arriving_max);
                r.map(|b| tonic::body::Body::new(arriving::ArrivingBody::new(b, ledger, holding)))
            },
        ))
        .layer(tower::util::MapResponseLayer::new(
            move |mut r: http::Response<_>| {
                too_large::headers(r.headers_mut(), max_update_bytes);
                held_reply::into_body(r, slow_reader_grace)
            },
        ))
        .add_service(health)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(sessions)
        .serve_with_incoming_shutdown(
            tokio_stream::StreamExt::map(
                accept::Admission::new(Box::pin(incoming), accept::MAX_CONNECTIONS),
                |io| io.map(LingeringClose::new),
            ),
            shutdown,
        );
    // After the drain, connections get the rest of the drain's time to close (streams
    // deliver the answers they owe); a client that never answers the GOAWAY must not
    // hold the exit past Kubernetes' grace period.
    let linger = async {
        match drained.await {
            Ok(linger) => tokio::time::sleep(linger).await,
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        r = server => r.map_err(ServeError::Transport),
        _ = linger => {
            tracing::warn!("connections still open after the drain's time; exiting anyway");
            Ok(())
        }
    }
}

/// The least time connections get to close after a drain (what a drain whose
/// compactions took all of `--drain-timeout-secs` leaves them).
const CONNECTION_LINGER: Duration = Duration::from_secs(3);

/// How long connections may stay open once a drain that began `elapsed` ago is done:
/// what is left of the drain's `deadline` (a stream still delivering the answers it owes
/// a slow client gets it), and at least [`CONNECTION_LINGER`]. Before, it was always
/// 3 s: a client reading a few megabytes of answers slowly lost their end, the status
/// among them, to the exit.
fn linger_after(deadline: Duration, elapsed: Duration) -> Duration {
    hub::bounded_wait(deadline)
        .saturating_sub(elapsed)
        .max(CONNECTION_LINGER)
}

/// Why the server stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The compiled-in descriptor sets were rejected (a build defect).
    #[error("reflection descriptors are invalid: {0}")]
    Reflection(String),
    /// The transport failed (listener error).
    #[error("transport: {0}")]
    Transport(#[from] tonic::transport::Error),
}

/// The health service name that reports the durable store: `SERVING` while its commits
/// succeed, `NOT_SERVING` after a group commit failed, until one succeeds (a signal for
/// operators; updates are refused only as the commit that carried them was).
pub const STORE_HEALTH_SERVICE: &str = "compactd.store";

/// Follows the backend's state into the health service until the server closes.
async fn report_store_health(
    backend: Arc<dyn crate::store::Backend>,
    reporter: tonic_health::server::HealthReporter,
    closing: tokio_util::sync::CancellationToken,
) {
    use crate::store::BackendState;
    let mut last = None;
    loop {
        let state = backend.state();
        if last.as_ref() != Some(&state) {
            let status = match &state {
                BackendState::Ok => tonic_health::ServingStatus::Serving,
                BackendState::Failing(e) => {
                    tracing::warn!(error = %e, "session store failing: health {STORE_HEALTH_SERVICE} is NOT_SERVING");
                    tonic_health::ServingStatus::NotServing
                }
            };
            reporter
                .set_service_status(STORE_HEALTH_SERVICE, status)
                .await;
            last = Some(state);
        }
        tokio::select! {
            () = closing.cancelled() => return,
            () = tokio::time::sleep(std::time::Duration::from_millis(500)) => {}
        }
    }
}
