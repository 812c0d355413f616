//! A scripted OpenAI-compatible endpoint on loopback for the summarizer's own tests: raw
//! HTTP/1.1 over a real socket, so a test decides every byte of an answer (an SSE body no
//! real server sends, an error body in llama.cpp's shape) and what the client makes of it
//! goes through the same transport, layers and parsers as in production. Each connection
//! carries one request and is closed after its answer (`connection: close`).

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// The longest request head read: a test's requests have a few short headers.
const MAX_HEAD_BYTES: usize = 64 * 1024;

/// One request the endpoint received.
#[derive(Debug, Clone)]
pub struct Received {
    /// The request target (`/v1/chat/completions`).
    pub path: String,
    /// The body as JSON (`Null` when there was none, or it was no JSON).
    pub body: Value,
}

/// What the endpoint answers the `n`th request (0-based): the whole raw response.
type Script = dyn Fn(usize, &Received) -> Vec<u8> + Send + Sync;

/// A running endpoint; stops when dropped.
pub struct Endpoint {
    addr: SocketAddr,
    received: Arc<Mutex<Vec<Received>>>,
    task: JoinHandle<()>,
}

impl Endpoint {
    /// Serves `script` on 127.0.0.1 at a free port.
    pub async fn start(
        script: impl Fn(usize, &Received) -> Vec<u8> + Send + Sync + 'static,
    ) -> Endpoint {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("local address");
        let received = Arc::new(Mutex::new(Vec::new()));
        let script: Arc<Script> = Arc::new(script);
        let log = received.clone();
        let task = tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                tokio::spawn(serve(socket, script.clone(), log.clone()));
            }
        });
        Endpoint {
            addr,
            received,
            task,
        }
    }

    /// The base URL to configure (`http://127.0.0.1:port/v1`).
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// The requests received so far, in order.
    pub fn received(&self) -> Vec<Received> {
        self.received.lock().map(|r| r.clone()).unwrap_or_default()
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Reads one request from `socket`, records it and writes what `script` answers.
async fn serve(mut socket: TcpStream, script: Arc<Script>, log: Arc<Mutex<Vec<Received>>>) {
    let mut buf = Vec::new();
    let head_end = loop {
        if let Some(at) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break at + 4;
        }
        let mut chunk = [0u8; 4096];
        match socket.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
        if buf.len() > MAX_HEAD_BYTES {
            return;
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_string();
    let path = head
        .split_whitespace()
        .nth(1)
        .unwrap_or_default()
        .to_string();
    let length = head
        .lines()
        .filter_map(|l| l.split_once(':'))
        .find(|(name, _)| name.trim().eq_ignore_ascii_case("content-length"))
        .and_then(|(_, v)| v.trim().parse::<usize>().ok())
        .unwrap_or(0);
    let mut body = buf[head_end..].to_vec();
    while body.len() < length {
        let mut chunk = vec![0u8; 64 * 1024];
        match socket.read(&mut chunk).await {
            Ok(0) | Err(_) => return,
            Ok(n) => body.extend_from_slice(&chunk[..n]),
        }
    }
    let received = Received {
        path,
        body: serde_json::from_slice(&body).unwrap_or(Value::Null),
    };
    let n = {
        let mut log = log.lock().unwrap_or_else(|p| p.into_inner());
        log.push(received.clone());
        log.len() - 1
    };
    let answer = script(n, &received);
    // The client may hang up before reading it all (that is what some tests check).
    let _ = socket.write_all(&answer).await;
    let _ = socket.shutdown().await;
}

/// A raw response: `status`, `content_type`, `body`, and `connection: close`.
pub fn response(status: u16, content_type: &str, body: &[u8]) -> Vec<u8> {
    let mut out = format!(
        "HTTP/1.1 {status} X\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    out.extend_from_slice(body);
    out
}

/// A JSON response.
pub fn json_response(status: u16, body: &str) -> Vec<u8> {
    response(status, "application/json", body.as_bytes())
}

/// An SSE response (HTTP 200) whose body is `body`, as it is.
pub fn sse(body: &[u8]) -> Vec<u8> {
    response(200, "text/event-stream", body)
}

/// The SSE body of a whole summary: `text` in one delta, then `finish_reason` with usage
/// `(prompt, completion)`, then `[DONE]`.
pub fn summary_body(text: &str, finish_reason: &str, usage: (u64, u64)) -> Vec<u8> {
    let chunk = |choices: Value, usage: Value| {
        format!(
            "data: {}\n\n",
            json!({"id": "c", "object": "chat.completion.chunk", "model": "m",
                   "choices": choices, "usage": usage})
        )
    };
    let mut out = chunk(
        json!([{"index": 0, "delta": {"role": "assistant", "content": text}, "finish_reason": null}]),
        Value::Null,
    );
    out.push_str(&chunk(
        json!([{"index": 0, "delta": {}, "finish_reason": finish_reason}]),
        Value::Null,
    ));
    out.push_str(&chunk(
        json!([]),
        json!({"prompt_tokens": usage.0, "completion_tokens": usage.1,
               "total_tokens": usage.0 + usage.1}),
    ));
    out.push_str("data: [DONE]\n\n");
    out.into_bytes()
}

/// A config for `endpoint` that retries at once (`max_retries` times) and waits at most
/// 30 s for a summary.
pub fn config(endpoint: &Endpoint, max_retries: u32) -> super::LlmConfig {
    let mut config = super::LlmConfig::new(endpoint.base_url(), "m");
    config.max_retries = max_retries;
    config.retry_base = std::time::Duration::from_millis(1);
    config.timeout = std::time::Duration::from_secs(30);
    config
}

/// A request of one short message, as the chunker sends it: `counted_tokens` compactd
/// counted, `max_tokens` asked.
pub fn request(counted_tokens: u64, max_tokens: Option<u64>) -> super::SummaryRequest {
    super::SummaryRequest {
        messages: vec![json!({"role": "user", "content": "summarize this"})],
        model: None,
        max_tokens,
        counted_tokens: Some(counted_tokens),
    }
}
