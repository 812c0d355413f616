//! A recording HTTP proxy in front of a real endpoint: each request's method, path, JSON
//! body and answer status are kept, and the answer is streamed back untouched, so a test can
//! check what compactd sent a server none of us wrote (llama.cpp's, in `e2e_llm.rs`).

#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, Method, StatusCode, Uri, header};
use axum::response::Response;
use serde_json::Value;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// One request that went through.
#[derive(Clone, Debug)]
pub struct Seen {
    /// `GET`, `POST`, ...
    pub method: String,
    /// The path, e.g. `/v1/chat/completions`.
    pub path: String,
    /// The JSON body (`Null` when empty or not JSON).
    pub body: Value,
    /// The upstream's status (502 when it could not be reached).
    pub status: u16,
}

/// A running proxy; stops when dropped.
pub struct Proxy {
    addr: SocketAddr,
    seen: Arc<Mutex<Vec<Seen>>>,
    task: JoinHandle<()>,
}

struct Shared {
    upstream: String,
    client: reqwest::Client,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl Proxy {
    /// Proxies 127.0.0.1:0 to `upstream` (`http://host:port`, no path).
    pub async fn start(upstream: &str) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let seen = Arc::new(Mutex::new(Vec::new()));
        let shared = Arc::new(Shared {
            upstream: upstream.trim_end_matches('/').to_string(),
            // A new connection per request: llama-cpp-python closes the one an empty
            // stream came on, and a pooled one could be reused before that is seen.
            client: reqwest::Client::builder()
                .pool_max_idle_per_host(0)
                .build()
                .expect("HTTP client"),
            seen: seen.clone(),
        });
        let app = Router::new().fallback(forward).with_state(shared);
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Proxy { addr, seen, task }
    }

    /// `http://127.0.0.1:PORT/v1`.
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// Every request so far, in arrival order.
    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn forward(
    State(shared): State<Arc<Shared>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let path = uri
        .path_and_query()
        .map_or(uri.path(), |p| p.as_str())
        .to_string();
    let mut request = shared
        .client
        .request(method.clone(), format!("{}{path}", shared.upstream))
        .body(body.clone());
    for name in [header::CONTENT_TYPE, header::AUTHORIZATION, header::ACCEPT] {
        if let Some(v) = headers.get(&name) {
            request = request.header(name, v);
        }
    }
    let asked = std::time::Instant::now();
    let answer = request.send().await;
    let status = answer.as_ref().map_or(502, |r| r.status().as_u16());
    // Seen with --nocapture, and in a failed test's output: what went to the server when.
    eprintln!(
        "proxy: {method} {} -> {status} after {:.1} s ({} bytes){}",
        uri.path(),
        asked.elapsed().as_secs_f64(),
        body.len(),
        answer
            .as_ref()
            .err()
            .map_or(String::new(), |e| format!(": {e}"))
    );
    shared.seen.lock().unwrap().push(Seen {
        method: method.to_string(),
        path: uri.path().to_string(),
        body: serde_json::from_slice(&body).unwrap_or(Value::Null),
        status,
    });
    let Ok(answer) = answer else {
        return Response::builder()
            .status(StatusCode::BAD_GATEWAY)
            .body(Body::empty())
            .unwrap();
    };
    let mut response = Response::builder().status(status);
    if let Some(v) = answer.headers().get(header::CONTENT_TYPE) {
        response = response.header(header::CONTENT_TYPE, v);
    }
    response
        .body(Body::from_stream(answer.bytes_stream()))
        .unwrap()
}
