//! The metrics endpoint's listener: at most so many connections at once, each closed
//! once it has made no progress for a few seconds, or a while after it was accepted. The endpoint is plain HTTP on a port of its own, often
//! open to the whole cluster; unbounded, idle or slow connections from any pod would
//! hold sockets and tasks outside the memory budget, and file descriptors the gRPC port
//! and the database need too. A scraper reconnects, as after any closed keep-alive.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Sleep;

/// A TCP listener that accepts a connection only while fewer than its maximum are open.
pub(super) struct Bounded {
    inner: TcpListener,
    open: Arc<Semaphore>,
    idle: Duration,
    lifetime: Duration,
    answer_within: Duration,
}

impl Bounded {
    /// `listener`, with at most `max` connections open at once (at least one, at most
    /// the semaphore's maximum), each closed after `idle` without a byte read or written,
    /// `lifetime` after it was accepted, or `answer_within` after the first byte of a
    /// request with nothing written back (a request head sent a byte at a time, which
    /// keeps the connection from being idle, holds its place no longer).
    pub(super) fn new(
        listener: TcpListener,
        max: usize,
        idle: Duration,
        lifetime: Duration,
        answer_within: Duration,
    ) -> Bounded {
        Bounded {
            inner: listener,
            open: Arc::new(Semaphore::new(max.clamp(1, Semaphore::MAX_PERMITS))),
            idle,
            lifetime,
            answer_within,
        }
    }
}

impl axum::serve::Listener for Bounded {
    type Io = Limited;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Limited, SocketAddr) {
        // The semaphore is never closed; were it, no connection would be taken again.
        let Ok(permit) = self.open.clone().acquire_owned().await else {
            return std::future::pending().await;
        };
        let (io, addr) = axum::serve::Listener::accept(&mut self.inner).await;
        let limited = Limited {
            io,
            _open: permit,
            idle: self.idle,
            stalls: Box::pin(tokio::time::sleep(self.idle)),
            ends: Box::pin(tokio::time::sleep(self.lifetime)),
            answer_within: self.answer_within,
            asking: false,
            unanswered: Box::pin(tokio::time::sleep(self.answer_within)),
        };
        (limited, addr)
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.inner.local_addr()
    }
}

/// One accepted connection: it holds its place among the open ones until dropped. Once
/// it has moved no byte for its idle time, every read, write and flush fails (hyper may
/// poll only writes and flushes of a client that sends and never reads); once its
/// lifetime is over, its next read does (hyper reads between requests, so a reply being
/// written to a client that takes it is finished first). hyper then drops it.
pub(super) struct Limited {
    io: TcpStream,
    _open: OwnedSemaphorePermit,
    idle: Duration,
    /// Reset on every byte moved.
    stalls: Pin<Box<Sleep>>,
    ends: Pin<Box<Sleep>>,
    answer_within: Duration,
    /// Bytes were read since the last write: a request is coming or waits for its answer.
    asking: bool,
    /// Set when `asking` starts.
    unanswered: Pin<Box<Sleep>>,
}

impl Limited {
    /// An error once the connection stalled, or (`reading`) outlived its lifetime
    /// (polling the timers registers the task to be woken when they fire).
    fn expired(&mut self, cx: &mut Context<'_>, reading: bool) -> Option<io::Error> {
        let why = if reading && self.ends.as_mut().poll(cx).is_ready() {
            "metrics connection open past its lifetime"
        } else if self.asking && self.unanswered.as_mut().poll(cx).is_ready() {
            "metrics request not answered in time (sent too slowly)"
        } else if self.stalls.as_mut().poll(cx).is_ready() {
            "metrics connection idle too long"
        } else {
            return None;
        };
        Some(io::Error::new(io::ErrorKind::TimedOut, why))
    }

    /// Bytes moved: the idle time starts again (an idle time too long to add to now
    /// never ends).
    fn moved(&mut self) {
        let again = after(self.idle);
        self.stalls.as_mut().reset(again);
    }

    /// Bytes read: the first since the last write starts the time the request has to
    /// arrive whole and be answered.
    fn read_some(&mut self) {
        self.moved();
        if !self.asking {
            self.asking = true;
            let by = after(self.answer_within);
            self.unanswered.as_mut().reset(by);
        }
    }

    /// Bytes written: the request is being answered.
    fn wrote_some(&mut self) {
        self.moved();
        self.asking = false;
    }
}

/// `d` from now (a time too far to add never comes).
fn after(d: Duration) -> tokio::time::Instant {
    let now = tokio::time::Instant::now();
    now.checked_add(d)
        .unwrap_or_else(|| now + Duration::from_secs(86_400 * 365 * 30))
}

impl AsyncRead for Limited {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if let Some(e) = self.expired(cx, true) {
            return Poll::Ready(Err(e));
        }
        let before = buf.filled().len();
        let read = Pin::new(&mut self.io).poll_read(cx, buf);
        if matches!(read, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.read_some();
        }
        read
    }
}

impl AsyncWrite for Limited {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if let Some(e) = self.expired(cx, false) {
            return Poll::Ready(Err(e));
        }
        let written = Pin::new(&mut self.io).poll_write(cx, buf);
        if matches!(written, Poll::Ready(Ok(n)) if n > 0) {
            self.wrote_some();
        }
        written
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if let Some(e) = self.expired(cx, false) {
            return Poll::Ready(Err(e));
        }
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        if let Some(e) = self.expired(cx, false) {
            return Poll::Ready(Err(e));
        }
        let written = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        if matches!(written, Poll::Ready(Ok(n)) if n > 0) {
            self.wrote_some();
        }
        written
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    use super::Bounded;

    /// Reads until the peer closes or `within` passes; what was read.
    async fn read_within(s: &mut TcpStream, within: Duration) -> (Vec<u8>, bool) {
        let mut got = Vec::new();
        let mut buf = [0u8; 1024];
        let deadline = Instant::now() + within;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, s.read(&mut buf)).await {
                Ok(Ok(0)) | Ok(Err(_)) => return (got, true),
                Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
                Err(_) => return (got, false),
            }
        }
    }

    /// An endpoint answering "ok" at `/` behind two places with these times (requests
    /// answered within 10 s).
    async fn serve(
        idle: Duration,
        lifetime: Duration,
    ) -> (
        std::net::SocketAddr,
        tokio::task::JoinHandle<std::io::Result<()>>,
    ) {
        serve_within(idle, lifetime, Duration::from_secs(10)).await
    }

    /// [`serve`], requests answered within `answer_within`.
    async fn serve_within(
        idle: Duration,
        lifetime: Duration,
        answer_within: Duration,
    ) -> (
        std::net::SocketAddr,
        tokio::task::JoinHandle<std::io::Result<()>>,
    ) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("a port");
        let addr = listener.local_addr().expect("its address");
        let app = axum::Router::new().route("/", axum::routing::get(|| async { "ok" }));
        let bounded = Bounded::new(listener, 2, idle, lifetime, answer_within);
        (
            addr,
            tokio::spawn(async move { axum::serve(bounded, app).await }),
        )
    }

    /// Idle connections take every place: the next one waits, and is served once their
    /// lifetime closes them. Unbounded, it was served at once and they stayed forever.
    /// Real time (real sockets): the idle time is long enough that the steps before the
    /// end of the window in which the third must wait fit in it on a loaded machine.
    #[tokio::test]
    async fn connections_past_the_maximum_wait_and_idle_ones_are_closed() {
        const IDLE: Duration = Duration::from_secs(2);
        let (addr, served) = serve(IDLE, Duration::from_secs(3600)).await;
        let mut idle = Vec::new();
        for _ in 0..2 {
            idle.push(TcpStream::connect(addr).await.expect("connects"));
        }
        // Let the server accept both before the third comes.
        tokio::time::sleep(Duration::from_millis(50)).await;
        let mut third = TcpStream::connect(addr)
            .await
            .expect("queued by the kernel");
        third
            .write_all(b"GET / HTTP/1.1\r\nHost: metrics\r\nConnection: close\r\n\r\n")
            .await
            .expect("written");
        let (early, _) = read_within(&mut third, IDLE / 4).await;
        assert!(early.is_empty(), "served past the maximum: {early:?}");
        for s in &mut idle {
            let (_, closed) = read_within(s, 5 * IDLE).await;
            assert!(closed, "an idle connection stayed open past its lifetime");
        }
        let (reply, _) = read_within(&mut third, 5 * IDLE).await;
        let reply = String::from_utf8_lossy(&reply);
        assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
        served.abort();
    }

    /// A connection that keeps asking is not idle, but still ends with its lifetime.
    #[tokio::test]
    async fn a_busy_connection_ends_with_its_lifetime() {
        let (addr, served) =
            serve(Duration::from_millis(1_000), Duration::from_millis(2_000)).await;
        let mut c = TcpStream::connect(addr).await.expect("connects");
        let began = Instant::now();
        let mut answered = 0;
        loop {
            if c.write_all(b"GET / HTTP/1.1\r\nHost: metrics\r\n\r\n")
                .await
                .is_err()
            {
                break;
            }
            let (reply, closed) = read_within(&mut c, Duration::from_millis(100)).await;
            if reply.starts_with(b"HTTP/1.1 200") {
                answered += 1;
            }
            if closed {
                break;
            }
            assert!(
                began.elapsed() < Duration::from_secs(5),
                "still open after 5 s"
            );
        }
        assert!(answered >= 5, "served while alive: {answered}");
        assert!(
            began.elapsed() >= Duration::from_millis(1_900),
            "closed as idle, not at its lifetime"
        );
        served.abort();
    }

    /// Clients sending a request head a byte at a time (never idle) take every place:
    /// each is closed when its request is not whole and answered in time, and a scrape
    /// waiting behind them is served. Before, they held their places for the lifetime
    /// (a scrape waited 57 s in the review, Prometheus gives up after 10).
    #[tokio::test]
    async fn requests_sent_a_byte_at_a_time_do_not_hold_the_places() {
        let (addr, served) = serve_within(
            Duration::from_millis(1_000),
            Duration::from_secs(3600),
            Duration::from_millis(500),
        )
        .await;
        let drip = |mut s: TcpStream| async move {
            let _ = s.write_all(b"GET / HTTP/1.1\r\n").await;
            for _ in 0..100 {
                tokio::time::sleep(Duration::from_millis(200)).await;
                if s.write_all(b"X").await.is_err() {
                    break;
                }
            }
        };
        let mut drips = Vec::new();
        for _ in 0..2 {
            let s = TcpStream::connect(addr).await.expect("connects");
            drips.push(tokio::spawn(drip(s)));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        let mut scrape = TcpStream::connect(addr).await.expect("queued");
        scrape
            .write_all(b"GET / HTTP/1.1\r\nHost: metrics\r\nConnection: close\r\n\r\n")
            .await
            .expect("written");
        let (reply, _) = read_within(&mut scrape, Duration::from_secs(3)).await;
        let reply = String::from_utf8_lossy(&reply);
        assert!(reply.starts_with("HTTP/1.1 200"), "not served: {reply:?}");
        for d in drips {
            d.abort();
        }
        served.abort();
    }
}
