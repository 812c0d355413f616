//! The binary's Prometheus endpoint, read over a plain TCP socket (no HTTP client
//! needed): the whole text and one sample's value.

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// `GET /metrics` of the binary's metrics listener.
pub async fn scrape(addr: &str) -> String {
    let mut tcp = tokio::net::TcpStream::connect(addr)
        .await
        .expect("metrics port");
    tcp.write_all(b"GET /metrics HTTP/1.1\r\nHost: compactd\r\nConnection: close\r\n\r\n")
        .await
        .expect("request");
    let mut body = String::new();
    tcp.read_to_string(&mut body).await.expect("response");
    assert!(body.starts_with("HTTP/1.1 200"), "{body}");
    body
}

/// Like [`scrape`], None when the server does not answer.
pub async fn try_scrape(addr: &str) -> Option<String> {
    let mut tcp = tokio::net::TcpStream::connect(addr).await.ok()?;
    tcp.write_all(b"GET /metrics HTTP/1.1\r\nHost: compactd\r\nConnection: close\r\n\r\n")
        .await
        .ok()?;
    let mut body = String::new();
    tcp.read_to_string(&mut body).await.ok()?;
    body.starts_with("HTTP/1.1 200").then_some(body)
}

/// The value of the sample `name{labels}` (labels in the exporter's order), or 0.
pub fn metric(text: &str, sample: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(sample) && l[sample.len()..].starts_with(' '))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0)
}
