//! A connection whose graceful close waits for the client to close its side.
//!
//! When hyper ends a connection (after a drain's GOAWAY once its streams are done, or
//! after a protocol error) it shuts the socket's write side and drops it. Whatever the
//! client sent meanwhile (window updates, the rest of a request body) is then unread in
//! the kernel, and closing a socket with unread bytes, or receiving bytes after closing,
//! makes the kernel answer with a TCP reset. A reset makes the client's kernel discard
//! what it had received and not yet read: the last answers of a stream and its status.
//! The client saw `h2 protocol error: connection reset` instead of the `UNAVAILABLE`
//! that says which updates were applied. (The same defect in hyper:
//! <https://github.com/hyperium/hyper/issues/3078>.)
//!
//! [`LingeringClose`] therefore shuts the write side (the client reads every frame, then
//! end of file) and reads and discards until the client closes its side, for at most
//! [`CLOSE_LINGER`], before the socket is dropped.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tonic::transport::server::Connected;

/// The longest a closed connection waits for its client to close: a client that read
/// everything closes at once on end of file; one that does not (a dead peer) must not
/// hold a socket and a task for long.
pub const CLOSE_LINGER: Duration = Duration::from_secs(5);

/// An accepted connection (TCP, Unix or under TLS) that lingers on close; see the
/// module's documentation.
pub struct LingeringClose<IO> {
    io: IO,
    /// Set once the write side is shut: when to stop waiting for the client.
    until: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl<IO> LingeringClose<IO> {
    /// Wraps a freshly accepted connection.
    pub fn new(io: IO) -> Self {
        LingeringClose { io, until: None }
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for LingeringClose<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

/// The writes of a connection wrapper that holds its connection in `io`, passed on as
/// they are (every `AsyncWrite` method but `poll_shutdown`, which each wrapper writes).
macro_rules! forward_writes {
    () => {
        fn poll_write(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
            buf: &[u8],
        ) -> std::task::Poll<std::io::Result<usize>> {
            std::pin::Pin::new(&mut self.io).poll_write(cx, buf)
        }

        fn poll_write_vectored(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
            bufs: &[std::io::IoSlice<'_>],
        ) -> std::task::Poll<std::io::Result<usize>> {
            std::pin::Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
        }

        fn is_write_vectored(&self) -> bool {
            self.io.is_write_vectored()
        }

        fn poll_flush(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
        ) -> std::task::Poll<std::io::Result<()>> {
            std::pin::Pin::new(&mut self.io).poll_flush(cx)
        }
    };
}
pub(super) use forward_writes;

impl<IO: AsyncRead + AsyncWrite + Unpin> AsyncWrite for LingeringClose<IO> {
    forward_writes!();

    /// Shuts the write side, then reads and discards until the client closes, fails, or
    /// [`CLOSE_LINGER`] passes. Never fails once the write side is shut: the connection
    /// is over either way.
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let this = &mut *self;
        if this.until.is_none() {
            ready!(Pin::new(&mut this.io).poll_shutdown(cx))?;
            this.until = Some(Box::pin(tokio::time::sleep(CLOSE_LINGER)));
        }
        let mut scratch = [0u8; 8 * 1024];
        loop {
            if let Some(until) = this.until.as_mut()
                && until.as_mut().poll(cx).is_ready()
            {
                return Poll::Ready(Ok(()));
            }
            let mut buf = ReadBuf::new(&mut scratch);
            match Pin::new(&mut this.io).poll_read(cx, &mut buf) {
                Poll::Ready(Ok(())) if buf.filled().is_empty() => return Poll::Ready(Ok(())),
                Poll::Ready(Ok(())) => continue,
                Poll::Ready(Err(_)) => return Poll::Ready(Ok(())),
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

impl<IO: Connected> Connected for LingeringClose<IO> {
    type ConnectInfo = IO::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// The close waits for the client: bytes the client sends after the server's
    /// shutdown are read (no reset), and the shutdown ends when the client closes.
    #[tokio::test]
    async fn shutdown_reads_until_the_client_closes() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let mut client = tokio::net::TcpStream::connect(addr).await.expect("connect");
        let (server, _) = listener.accept().await.expect("accept");
        let mut server = LingeringClose::new(server);
        server.write_all(b"last answer").await.expect("write");
        // Unread by the server: what used to make its close a reset.
        client.write_all(&[7u8; 4096]).await.expect("client writes");
        // As hyper does: shut down, then drop.
        let shutdown = tokio::spawn(async move {
            server.shutdown().await.expect("shutdown");
        });
        let mut got = Vec::new();
        client.read_to_end(&mut got).await.expect("no reset");
        assert_eq!(got, b"last answer");
        // Still sending after the server's end of file: read and discarded.
        client
            .write_all(&[8u8; 4096])
            .await
            .expect("client writes on");
        assert!(!shutdown.is_finished(), "the close waits for the client");
        drop(client);
        tokio::time::timeout(Duration::from_secs(10), shutdown)
            .await
            .expect("ends when the client closes")
            .expect("task");
    }

    /// A client that never closes holds the close for [`CLOSE_LINGER`] only.
    #[tokio::test(start_paused = true)]
    async fn shutdown_gives_up_after_the_linger() {
        let (server, _client) = tokio::io::duplex(64);
        let mut server = LingeringClose::new(server);
        let began = tokio::time::Instant::now();
        server.shutdown().await.expect("shutdown");
        assert_eq!(began.elapsed(), CLOSE_LINGER);
    }
}
