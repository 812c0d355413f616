//! What the listener lets in: at most [`MAX_CONNECTIONS`] open connections, a connection
//! that has not sent its first [`FIRST_BYTES`] bytes (HTTP/2's preface, or a TLS hello)
//! within [`FIRST_BYTES_DEADLINE`] closed, and an accept that fails for want of a
//! resource (no file descriptor left) waited out rather than retried at once.
//!
//! Without these, connections that send nothing stayed open for good (HTTP/2's keepalive
//! starts after the preface; the bearer token is checked per call, after the connection
//! is accepted), each holding a descriptor and memory outside `--memory-budget`. At the
//! descriptor limit every accept failed at once and was retried at once: the accept loop
//! spun a core and logged each failure (4 million lines in 35 s at the debug level the
//! transport logs at), and no new client, health probes included, got in.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_stream::Stream;
use tonic::transport::server::Connected;

use super::lingering_close::forward_writes;

/// Connections open at once; the next waits in the listener's backlog until one closes.
/// A host holds one or two; this leaves many hosts room on one compactd while keeping
/// descriptors for the store and the metrics endpoint under a default limit of 1,024.
pub const MAX_CONNECTIONS: usize = 768;

/// How long a new connection may take to send its first [`FIRST_BYTES`] bytes.
pub const FIRST_BYTES_DEADLINE: Duration = Duration::from_secs(10);

/// The length of HTTP/2's connection preface; a TLS hello is longer.
pub const FIRST_BYTES: usize = 24;

/// The first wait after an accept failed for want of a resource, doubled after each
/// failure in a row up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(10);
const MAX_BACKOFF: Duration = Duration::from_secs(1);
/// Failed accepts are logged at most this often (with how many were not).
const WARN_EVERY: Duration = Duration::from_secs(10);

type Acquire = Pin<Box<dyn Future<Output = Option<OwnedSemaphorePermit>> + Send>>;

/// The listener's stream of connections, admitted as the module says. It never yields
/// an error: failed accepts are logged here and waited out or skipped.
pub struct Admission<S> {
    inner: S,
    permits: Arc<Semaphore>,
    /// A slot taken for the next connection, before the listener is polled.
    permit: Option<OwnedSemaphorePermit>,
    acquiring: Option<Acquire>,
    backoff: Option<Pin<Box<tokio::time::Sleep>>>,
    delay: Duration,
    warned: Option<tokio::time::Instant>,
    unlogged: u64,
}

impl<S> Admission<S> {
    /// Admits at most `max` connections of `inner` at once.
    pub fn new(inner: S, max: usize) -> Self {
        Admission {
            inner,
            permits: Arc::new(Semaphore::new(max.max(1))),
            permit: None,
            acquiring: None,
            backoff: None,
            delay: FIRST_BACKOFF,
            warned: None,
            unlogged: 0,
        }
    }

    /// Logs a failed accept, at most once per [`WARN_EVERY`].
    fn failed(&mut self, e: &(dyn std::error::Error + 'static), waits: bool) {
        let now = tokio::time::Instant::now();
        if self
            .warned
            .is_some_and(|at| now.duration_since(at) < WARN_EVERY)
        {
            self.unlogged = self.unlogged.saturating_add(1);
            return;
        }
        tracing::warn!(
            error = %e,
            not_logged = self.unlogged,
            wait_ms = if waits { self.delay.as_millis() } else { 0 },
            "accepting a connection failed"
        );
        self.warned = Some(now);
        self.unlogged = 0;
    }
}

/// A failure of one connection (the next accept may succeed at once), as opposed to one
/// of the listener or the process (no descriptor left), which the next accept would
/// meet again.
fn passing(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(
        e.kind(),
        ConnectionAborted | ConnectionReset | BrokenPipe | Interrupted | WouldBlock | TimedOut
    )
}

impl<S, IO, IE> Stream for Admission<S>
where
    S: Stream<Item = Result<IO, IE>> + Unpin,
    IE: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    type Item = Result<Admitted<IO>, std::convert::Infallible>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        loop {
            if let Some(backoff) = this.backoff.as_mut() {
                ready!(backoff.as_mut().poll(cx));
                this.backoff = None;
            }
            if this.permit.is_none() {
                let permits = this.permits.clone();
                let acquiring = this.acquiring.get_or_insert_with(|| {
                    Box::pin(async move { permits.acquire_owned().await.ok() })
                });
                let permit = ready!(acquiring.as_mut().poll(cx));
                this.acquiring = None;
                match permit {
                    Some(p) => this.permit = Some(p),
                    // Never closed; nothing more would be admitted.
                    None => return Poll::Ready(None),
                }
            }
            match ready!(Pin::new(&mut this.inner).poll_next(cx)) {
                None => return Poll::Ready(None),
                Some(Ok(io)) => {
                    this.delay = FIRST_BACKOFF;
                    let Some(permit) = this.permit.take() else {
                        continue;
                    };
                    return Poll::Ready(Some(Ok(Admitted::new(io, permit))));
                }
                Some(Err(e)) => {
                    let e: Box<dyn std::error::Error + Send + Sync> = e.into();
                    let waits = !e.downcast_ref::<std::io::Error>().is_some_and(passing);
                    this.failed(&*e, waits);
                    if waits {
                        this.backoff = Some(Box::pin(tokio::time::sleep(this.delay)));
                        this.delay = this.delay.saturating_mul(2).min(MAX_BACKOFF);
                    }
                }
            }
        }
    }
}

/// An admitted connection: holds its slot until it is dropped, and fails its reads once
/// [`FIRST_BYTES_DEADLINE`] passes before its first [`FIRST_BYTES`] bytes came.
pub struct Admitted<IO> {
    io: IO,
    _permit: OwnedSemaphorePermit,
    /// Until the first bytes came: their count so far, and the deadline.
    first: Option<(usize, Pin<Box<tokio::time::Sleep>>)>,
}

impl<IO> Admitted<IO> {
    fn new(io: IO, permit: OwnedSemaphorePermit) -> Self {
        Admitted {
            io,
            _permit: permit,
            first: Some((0, Box::pin(tokio::time::sleep(FIRST_BYTES_DEADLINE)))),
        }
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for Admitted<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = &mut *self;
        let Some((seen, deadline)) = this.first.as_mut() else {
            return Pin::new(&mut this.io).poll_read(cx, buf);
        };
        let before = buf.filled().len();
        // A read with no room returns no bytes without the connection having ended.
        let room = buf.remaining() > 0;
        match Pin::new(&mut this.io).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                *seen = seen.saturating_add(buf.filled().len().saturating_sub(before));
                if *seen >= FIRST_BYTES || (room && buf.filled().len() == before) {
                    // Started, or closed by the client (end of file): no deadline.
                    this.first = None;
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => {
                ready!(deadline.as_mut().poll(cx));
                this.first = None;
                Poll::Ready(Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "the connection sent too little within the first bytes' deadline",
                )))
            }
        }
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Admitted<IO> {
    forward_writes!();

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

impl<IO: Connected> Connected for Admitted<IO> {
    type ConnectInfo = IO::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};
    use tokio_stream::StreamExt;

    fn admitted(io: DuplexStream) -> Admitted<DuplexStream> {
        Admitted::new(
            io,
            Arc::new(Semaphore::new(1))
                .try_acquire_owned()
                .expect("a slot"),
        )
    }

    /// A connection that sends nothing is failed at the deadline; one that sent its
    /// first bytes is not, however long it then stays quiet.
    #[tokio::test(start_paused = true)]
    async fn a_silent_connection_fails_at_the_deadline_and_a_started_one_does_not() {
        let (server, _client) = tokio::io::duplex(64);
        let mut silent = admitted(server);
        let began = tokio::time::Instant::now();
        let mut buf = [0u8; 64];
        let e = silent.read(&mut buf).await.expect_err("timed out");
        assert_eq!(e.kind(), std::io::ErrorKind::TimedOut);
        assert_eq!(began.elapsed(), FIRST_BYTES_DEADLINE);

        let (server, mut client) = tokio::io::duplex(64);
        let mut started = admitted(server);
        // The preface in two pieces: the deadline holds until all of it came.
        client.write_all(&[b'P'; 10]).await.expect("write");
        assert_eq!(started.read(&mut buf).await.expect("read"), 10);
        client.write_all(&[b'R'; 14]).await.expect("write");
        assert_eq!(started.read(&mut buf).await.expect("read"), 14);
        let quiet = tokio::time::timeout(FIRST_BYTES_DEADLINE * 6, started.read(&mut buf)).await;
        assert!(
            quiet.is_err(),
            "a started connection is not timed out: {quiet:?}"
        );
    }

    /// A read into a full buffer returns no bytes without the connection having ended:
    /// the deadline must still hold for the first bytes after it.
    #[tokio::test(start_paused = true)]
    async fn a_read_into_a_full_buffer_keeps_the_deadline() {
        let (server, _client) = tokio::io::duplex(64);
        let mut silent = admitted(server);
        let began = tokio::time::Instant::now();
        let mut full: [u8; 0] = [];
        assert_eq!(silent.read(&mut full).await.expect("empty read"), 0);
        let mut buf = [0u8; 64];
        let read = tokio::time::timeout(FIRST_BYTES_DEADLINE * 2, silent.read(&mut buf)).await;
        let e = read
            .expect("the deadline still holds")
            .expect_err("timed out");
        assert_eq!(e.kind(), std::io::ErrorKind::TimedOut);
        assert_eq!(began.elapsed(), FIRST_BYTES_DEADLINE);
    }

    /// At most `max` connections are admitted; the next one once one of them is gone.
    #[tokio::test]
    async fn connections_past_the_cap_wait_for_a_slot() {
        let (tx, rx) =
            tokio::sync::mpsc::unbounded_channel::<Result<DuplexStream, std::io::Error>>();
        let mut admission =
            Admission::new(tokio_stream::wrappers::UnboundedReceiverStream::new(rx), 2);
        let mut peers = Vec::new();
        for _ in 0..3 {
            let (server, client) = tokio::io::duplex(64);
            peers.push(client);
            tx.send(Ok(server)).expect("queued");
        }
        let first = admission.next().await.expect("first").expect("ok");
        let _second = admission.next().await.expect("second").expect("ok");
        let third = tokio::time::timeout(Duration::from_millis(200), admission.next()).await;
        assert!(
            third.is_err(),
            "a third connection was admitted past the cap of 2"
        );
        drop(first);
        let third = tokio::time::timeout(Duration::from_secs(5), admission.next()).await;
        assert!(
            matches!(third, Ok(Some(Ok(_)))),
            "admitted once a slot freed"
        );
    }

    /// An accept that fails for want of a resource is tried again after a wait that
    /// grows, not at once: over 5 s, a few dozen tries rather than a spinning loop.
    #[tokio::test(start_paused = true)]
    async fn a_listener_out_of_descriptors_is_waited_out() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let tries = Arc::new(AtomicUsize::new(0));
        let counted = tries.clone();
        let failing = tokio_stream::iter(std::iter::repeat_with(move || {
            counted.fetch_add(1, Ordering::Relaxed);
            Err::<DuplexStream, _>(std::io::Error::from_raw_os_error(24))
        }));
        let mut admission = Admission::new(failing, 4);
        let waited = tokio::time::timeout(Duration::from_secs(5), admission.next()).await;
        assert!(waited.is_err(), "nothing admitted");
        let n = tries.load(Ordering::Relaxed);
        assert!((3..=16).contains(&n), "{n} accepts tried in 5 s");
    }

    /// A failure of one connection (reset before it was accepted) is skipped at once.
    #[tokio::test(start_paused = true)]
    async fn a_connection_reset_before_its_accept_is_skipped() {
        let (server, _client) = tokio::io::duplex(64);
        let items = vec![
            Err(std::io::Error::from(std::io::ErrorKind::ConnectionAborted)),
            Ok(server),
        ];
        let mut admission = Admission::new(tokio_stream::iter(items), 4);
        let began = tokio::time::Instant::now();
        let mut next = admission.next().await.expect("one").expect("ok");
        assert_eq!(began.elapsed(), Duration::ZERO, "no wait");
        let mut buf = [0u8; 1];
        drop(_client);
        assert_eq!(next.read(&mut buf).await.expect("end of file"), 0);
    }
}
