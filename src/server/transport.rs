//! HTTP/2 and TCP settings of the gRPC listener, set explicitly rather than inherited
//! from hyper's defaults, so what a misbehaving client can make compactd hold or do is
//! written down in one place.
//!
//! What each bounds:
//! - receive windows: how much a client can push before compactd has read it (a large
//!   update still arrives, in window-sized steps, up to the message size cap);
//! - frame size: the largest frame a client sends (and h2 holds before parsing it);
//! - concurrent streams: how many RPCs one connection can have open;
//! - header list size: the metadata one request may carry (an auth header is tiny);
//! - reset-stream caps: the "rapid reset" pattern (open and cancel streams in a loop);
//! - keepalive: a peer that vanished without a FIN is noticed within 40 s (HTTP/2 PING)
//!   and TCP keepalive catches what PINGs cannot reach.
//!
//! A client that stops reading its own responses is bounded separately: its streams'
//! send windows stop the transport, and the event buffer plus `--slow-reader-grace-secs`
//! close the stream (`hub.rs`).

use std::time::Duration;

use tonic::transport::Server;

/// Receive window of one stream. Small enough that a stream compactd has stopped reading
/// (its client does not read its acks) stalls its client by flow control long before the
/// unread frames exhaust h2's flood budget (half the connection window, charged up to
/// 256 bytes per small DATA frame): 256 KiB of 40-byte updates charge about 1.4 MiB of
/// the 4 MiB budget, so the connection is never torn down with GOAWAY and compactd's own
/// `RESOURCE_EXHAUSTED` reaches the stream.
pub const STREAM_WINDOW: u32 = 256 << 10;
/// Receive window of one connection (all its streams together); h2's flood budget for
/// small DATA frames is half of it.
pub const CONNECTION_WINDOW: u32 = 8 << 20;
/// Largest HTTP/2 frame a client may send (h2's default is 16 KiB, the protocol's least).
/// A 20 KB tool output then arrives in one DATA frame instead of two. Each frame the
/// stream's reader has not taken yet keeps h2's read buffer shared, so the connection's
/// next read allocates a fresh buffer and copies into it: 11% of the server's CPU at
/// 20 KB on one stream with 16 KiB frames, 6% with 64 KiB (`perf`). `compactd bench`,
/// 20 KB outputs, three alternating runs: CPU per update 43 → 38 µs on 64 streams,
/// 42.5 → 39.7 µs on one. h2 holds at most one frame of a connection unparsed, so what
/// a client can make it buffer that way grows from 16 to 64 KiB.
pub const MAX_FRAME_SIZE: u32 = 64 << 10;
/// RPCs one connection may have open at once (tonic's default is no limit). A host needs
/// one `Stream`, a `Subscribe` and a few unary calls or `Compact`s in flight.
pub const MAX_CONCURRENT_STREAMS: u32 = 256;
/// Bytes of request metadata (headers) accepted.
pub const MAX_HEADER_LIST_SIZE: u32 = 16 << 10;
/// Streams a client may open and reset before compactd has accepted them.
pub const MAX_PENDING_ACCEPT_RESETS: usize = 20;
/// Streams compactd resets for a client's protocol errors before closing the connection.
pub const MAX_LOCAL_ERROR_RESETS: usize = 256;
/// HTTP/2 PING interval on an idle connection, and how long to wait for the answer.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(30);
/// How long a keepalive PING may go unanswered before the connection is closed.
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);
/// TCP keepalive probe delay on accepted sockets.
pub const TCP_KEEPALIVE: Duration = Duration::from_secs(60);

/// Applies every setting above to a server builder.
pub fn configure(builder: Server) -> Server {
    builder
        .initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        // A fixed window: the adaptive one grows with the client's bandwidth-delay
        // estimate, which a client controls.
        .http2_adaptive_window(Some(false))
        .max_concurrent_streams(MAX_CONCURRENT_STREAMS)
        .max_frame_size(Some(MAX_FRAME_SIZE))
        .http2_max_header_list_size(MAX_HEADER_LIST_SIZE)
        .http2_max_pending_accept_reset_streams(Some(MAX_PENDING_ACCEPT_RESETS))
        .http2_max_local_error_reset_streams(Some(MAX_LOCAL_ERROR_RESETS))
        .http2_keepalive_interval(Some(KEEPALIVE_INTERVAL))
        .http2_keepalive_timeout(Some(KEEPALIVE_TIMEOUT))
}
