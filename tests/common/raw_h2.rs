//! A gRPC client one layer below tonic (the `h2` crate), for tests that need what tonic
//! never sends: a message header without its bytes, a reply left unread in a small window.

use tonic::codegen::Bytes;

/// Opens an HTTP/2 connection to `addr` with `builder`'s settings, drives it on a task and
/// returns the sender once it is ready for a request.
pub async fn connect(addr: &str, builder: &h2::client::Builder) -> h2::client::SendRequest<Bytes> {
    let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (client, conn) = builder
        .handshake::<_, Bytes>(tcp)
        .await
        .expect("h2 handshake");
    tokio::spawn(conn);
    client.ready().await.expect("ready")
}

/// The head of a gRPC call to `path` (`/package.Service/Method`) on `addr`.
pub fn grpc_head(addr: &str, path: &str) -> http::Request<()> {
    http::Request::post(format!("http://{addr}{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .expect("request")
}

/// `messages` in gRPC's framing: each an uncompressed flag, its length and its bytes.
pub fn framed(messages: &[Vec<u8>]) -> Vec<u8> {
    let mut framed = Vec::new();
    for message in messages {
        framed.push(0u8);
        framed.extend_from_slice(&u32::try_from(message.len()).expect("small").to_be_bytes());
        framed.extend_from_slice(message);
    }
    framed
}
