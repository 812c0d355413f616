//! A scripted, in-process fake of an OpenAI-compatible chat-completions endpoint.
//!
//! `FakeLlm::start(script)` binds 127.0.0.1:0 and serves `POST /v1/chat/completions`
//! (and `POST /chat/completions`) over real HTTP/1.1, streaming server-sent events frame
//! by frame exactly like OpenAI does. Each request takes the next [`Reply`] of the script
//! (the last one repeats), every request is recorded, and counters let a test wait for
//! requests, in-flight responses and client-side cancellations without sleeping.
//!
//! Stream frames, in order (each one `data: <json>\n\n`, flushed on its own):
//! 1. `{"id":"chatcmpl-fake","object":"chat.completion.chunk","created":T,"model":M,
//!    "choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}`
//! 2. one chunk per content delta: `"delta":{"content":"..."}`
//! 3. if the reply has a finish reason: `"delta":{}`, `"finish_reason":"stop"`
//! 4. if the request set `stream_options.include_usage: true` and the reply has usage:
//!    `"choices":[]`, `"usage":{"prompt_tokens":P,"completion_tokens":C,"total_tokens":P+C}`
//!    (when include_usage is set, the earlier chunks carry `"usage":null`, like OpenAI)
//! 5. `data: [DONE]`
//!
//! A request with `"stream": false` (compactd's probe after an empty stream) gets the
//! same reply as one JSON `chat.completion` instead of a stream.
//!
//! For window discovery it also serves `GET /props` (llama.cpp's server) and
//! `GET /v1/models` when a test sets their bodies ([`FakeLlm::serve_props`],
//! [`FakeLlm::serve_models`]), and 404 otherwise; those requests are recorded apart
//! ([`FakeLlm::discovery_requests`]).
//!
//! A [`Reply::Flood`] sends a body that does not end (an endless stream of deltas, one
//! endless SSE line, an endless error body) and counts the bytes it hands to the
//! connection ([`Counters::flood_bytes`]), so a test sees how much a client read before it
//! hung up.
//!
//! Note: async-openai 0.43 retries 429 and 5xx responses itself (3 retries, honouring
//! `Retry-After` in seconds, else 100/200/400 ms backoff), so a scripted error reply is
//! requested up to 4 times unless a later reply in the script succeeds.

#![allow(dead_code)]

use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State as AxumState;
use axum::http::{HeaderMap, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures::Stream;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::fake_window::{Overflow, Verdict, WindowSpec};

/// The `id` of every streamed chunk.
pub const FAKE_COMPLETION_ID: &str = "chatcmpl-fake";

/// The model echoed in chunks when the request names none.
pub const DEFAULT_MODEL: &str = "fake-model";

/// The error message of the 400 a `Reply::ContextTooLong` answers a long prompt with.
pub const CONTEXT_TOO_LONG_MESSAGE: &str = "This model's maximum context length is exceeded";

/// One scripted answer to one chat-completions request.
#[derive(Clone, Debug)]
pub enum Reply {
    /// A complete SSE stream: role chunk, one chunk per content delta, finish chunk, usage, `[DONE]`.
    Stream {
        /// The content deltas, one chunk each.
        chunks: Vec<String>,
        /// `(prompt_tokens, completion_tokens)`; sent only when the request asked for usage.
        usage: Option<(u64, u64)>,
        /// Pause before each content chunk (the role chunk goes out at once).
        delay_per_chunk: Duration,
        /// The finish reason of the final chunk; `None` sends no finish chunk at all.
        finish_reason: Option<String>,
    },
    /// A plain HTTP error with a JSON body (and optional `Retry-After` seconds).
    Status {
        /// The HTTP status code.
        code: u16,
        /// The response body, sent as `application/json`.
        body: String,
        /// Value of the `Retry-After` header in seconds, if any.
        retry_after: Option<u64>,
    },
    /// Role chunk and these content chunks, then the connection is cut (no finish, no `[DONE]`).
    DisconnectAfter {
        /// The content deltas sent before the cut.
        chunks: Vec<String>,
    },
    /// Role chunk, then the frame `data: {not json`, then the body ends cleanly.
    Malformed,
    /// A reasoning model that thinks its whole `max_tokens` away: role chunk, these
    /// `reasoning_content` deltas (no content), the finish reason (`length`; `None`: no
    /// finish chunk, a stream ended while the model was thinking), usage `(prompt,
    /// completion)`, `[DONE]`.
    Reasoning {
        /// The reasoning deltas.
        reasoning: Vec<String>,
        /// `(prompt_tokens, completion_tokens)`.
        usage: (u64, u64),
        /// The final chunk's finish reason, if any.
        finish_reason: Option<&'static str>,
    },
    /// Role chunk and these content chunks, then a chunk holding only an OpenAI error
    /// object (what OpenAI, vLLM and SGLang send when a stream fails), then `[DONE]`.
    ErrorChunk {
        /// The content deltas sent before the error.
        chunks: Vec<String>,
        /// The error's message.
        message: String,
    },
    /// 400 `context_length_exceeded` when the prompt is longer than `max_prompt_chars`,
    /// else a stream of `"summary #N"` (N = 1-based request number). Never consumed.
    ContextTooLong {
        /// The longest accepted prompt, as the sum of the messages' content lengths in chars.
        max_prompt_chars: usize,
    },
    /// Accepts the request and never answers until the client goes away or the fake shuts down.
    Hang,
    /// HTTP 200 `text/event-stream` with an empty body: what llama-cpp-python answers a
    /// streamed prompt longer than its context with.
    Empty,
    /// A server with a window of its own (`fake_window`): `"summary #N"` for requests that
    /// fit, a refusal with numbers or an empty stream for those that do not. Never consumed.
    Window(WindowSpec),
    /// A body that does not end: what `kind` says, in frames of [`FLOOD_FRAME_BYTES`], until
    /// the client goes away or `limit` bytes went out (then a stream is cut, an error body
    /// ends, so a client that reads it whole sees all of it).
    Flood {
        /// What the body repeats.
        kind: Flood,
        /// Bytes after which the fake stops on its own, so a client that never stops
        /// reading fails its test instead of filling the machine's memory.
        limit: usize,
    },
}

/// What a [`Reply::Flood`] sends.
#[derive(Clone, Debug)]
pub enum Flood {
    /// HTTP 200, an SSE stream of content chunks carrying this delta, never finished.
    Deltas(String),
    /// HTTP 200, an SSE stream whose first data line never ends.
    Line,
    /// This error status with an OpenAI error object whose message never ends.
    Status(u16),
}

/// The size of the repeated part of a [`Reply::Flood`]'s body (one frame each).
pub const FLOOD_FRAME_BYTES: usize = 16 * 1024;

impl Reply {
    /// A fast stream of `chunks`, usage `(10, chunks.len())`, finish reason `"stop"`.
    pub fn text<I, S>(chunks: I) -> Reply
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let chunks: Vec<String> = chunks.into_iter().map(Into::into).collect();
        let completion = chunks.len() as u64;
        Reply::Stream {
            chunks,
            usage: Some((10, completion)),
            delay_per_chunk: Duration::ZERO,
            finish_reason: Some("stop".to_string()),
        }
    }

    /// A stream of `chunks` with `delay` before each content chunk (for slow-token tests).
    pub fn slow<I, S>(chunks: I, delay: Duration) -> Reply
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Reply::text(chunks).with_delay(delay)
    }

    /// An error reply `code` with a generic OpenAI error body.
    pub fn status(code: u16) -> Reply {
        let (message, kind) = match code {
            400 => ("Invalid request", "invalid_request_error"),
            401 => ("Incorrect API key provided", "invalid_request_error"),
            404 => ("The model does not exist", "invalid_request_error"),
            429 => ("Rate limit reached", "rate_limit_error"),
            500..=599 => (
                "The server had an error while processing your request",
                "server_error",
            ),
            _ => ("Fake error", "fake_error"),
        };
        Reply::Status {
            code,
            body: error_body(message, kind, None, None),
            retry_after: None,
        }
    }

    /// 429 with `Retry-After: retry_after_secs` and a `rate_limit_error` body.
    pub fn rate_limited(retry_after_secs: u64) -> Reply {
        Reply::Status {
            code: 429,
            body: error_body(
                "Rate limit reached for requests",
                "rate_limit_error",
                None,
                None,
            ),
            retry_after: Some(retry_after_secs),
        }
    }

    /// 429 `insufficient_quota`: the one 429 async-openai does not retry.
    pub fn insufficient_quota() -> Reply {
        Reply::Status {
            code: 429,
            body: error_body(
                "You exceeded your current quota",
                "insufficient_quota",
                None,
                Some("insufficient_quota"),
            ),
            retry_after: None,
        }
    }

    /// Role chunk and `chunks`, then the connection is cut mid-stream.
    pub fn disconnect_after<I, S>(chunks: I) -> Reply
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Reply::DisconnectAfter {
            chunks: chunks.into_iter().map(Into::into).collect(),
        }
    }

    /// 400 for prompts longer than `max_prompt_chars`, else `"summary #N"`; never consumed.
    pub fn context_too_long(max_prompt_chars: usize) -> Reply {
        Reply::ContextTooLong { max_prompt_chars }
    }

    /// The same stream with `delay` before each content chunk; panics on other variants.
    pub fn with_delay(mut self, delay: Duration) -> Reply {
        match &mut self {
            Reply::Stream {
                delay_per_chunk, ..
            } => *delay_per_chunk = delay,
            other => panic!("with_delay on a non-stream reply {other:?}"),
        }
        self
    }

    /// The same stream with usage `(prompt, completion)` (or none); panics on other variants.
    pub fn with_usage(mut self, new: Option<(u64, u64)>) -> Reply {
        match &mut self {
            Reply::Stream { usage, .. } => *usage = new,
            other => panic!("with_usage on a non-stream reply {other:?}"),
        }
        self
    }

    /// The same stream with another finish reason (or none); panics on other variants.
    pub fn with_finish_reason(mut self, reason: Option<&str>) -> Reply {
        match &mut self {
            Reply::Stream { finish_reason, .. } => *finish_reason = reason.map(str::to_string),
            other => panic!("with_finish_reason on a non-stream reply {other:?}"),
        }
        self
    }

    /// The same error reply with a `Retry-After` header; panics on other variants.
    pub fn with_retry_after(mut self, secs: u64) -> Reply {
        match &mut self {
            Reply::Status { retry_after, .. } => *retry_after = Some(secs),
            other => panic!("with_retry_after on a non-status reply {other:?}"),
        }
        self
    }
}

/// An OpenAI error body: `{"error":{"message":..,"type":..,"param":..,"code":..}}`.
pub fn error_body(message: &str, kind: &str, param: Option<&str>, code: Option<&str>) -> String {
    json!({
        "error": {
            "message": message,
            "type": kind,
            "param": param,
            "code": code,
        }
    })
    .to_string()
}

/// One request the fake received.
#[derive(Clone, Debug)]
pub struct RecordedRequest {
    /// The request path, e.g. `/v1/chat/completions`.
    pub path: String,
    /// The request headers, names lowercase, in arrival order.
    pub headers: Vec<(String, String)>,
    /// The JSON body (a JSON string holding the raw text when the body is not JSON).
    pub body: Value,
}

impl RecordedRequest {
    /// The first value of header `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The `messages` array of the body (empty when absent).
    pub fn messages(&self) -> Vec<Value> {
        self.body["messages"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    }

    /// The text of every message (string content, or the concatenated text parts).
    pub fn message_texts(&self) -> Vec<String> {
        self.messages().iter().map(message_text).collect()
    }

    /// Sum of the messages' content lengths in chars (what `ContextTooLong` measures).
    pub fn prompt_chars(&self) -> usize {
        prompt_chars(&self.body)
    }

    /// True when the body asked for a stream.
    pub fn is_stream(&self) -> bool {
        self.body["stream"] == Value::Bool(true)
    }

    /// True when the body set `stream_options.include_usage: true`.
    pub fn include_usage(&self) -> bool {
        include_usage(&self.body)
    }
}

/// A snapshot of the fake's counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// Chat-completions requests received.
    pub requests: usize,
    /// Responses still being produced (streams being sent, hung requests).
    pub active: usize,
    /// In-flight responses dropped because the client went away before they ended.
    pub cancelled: usize,
    /// Responses that ran to their scripted end (including deliberate cuts).
    pub completed: usize,
    /// Bytes of [`Reply::Flood`] bodies handed to the connection.
    pub flood_bytes: usize,
}

/// Script, records and counters shared by the handler and the handle.
struct Shared {
    inner: Mutex<Inner>,
    counters: watch::Sender<Counters>,
    shutdown: watch::Sender<bool>,
}

/// The mutable part of `Shared`.
struct Inner {
    script: Vec<Reply>,
    next: usize,
    requests: Vec<RecordedRequest>,
    /// `GET /props` and `GET /v1/models` requests.
    discovery: Vec<RecordedRequest>,
    /// Bodies of `GET /props` and `GET /v1/models` (None: 404).
    props: Option<Value>,
    models: Option<Value>,
}

impl Inner {
    /// The reply for the current request; advances unless it is `ContextTooLong` or `Window`.
    fn next_reply(&mut self) -> Reply {
        let idx = self.next.min(self.script.len() - 1);
        let reply = self.script[idx].clone();
        let standing = matches!(reply, Reply::ContextTooLong { .. } | Reply::Window(_));
        if !standing && self.next < self.script.len() {
            self.next += 1;
        }
        reply
    }
}

/// A running fake LLM server. Dropping it shuts the server down.
pub struct FakeLlm {
    addr: SocketAddr,
    shared: Arc<Shared>,
    server: Option<JoinHandle<()>>,
}

impl FakeLlm {
    /// Binds 127.0.0.1:0 and serves `script` (must not be empty; the last reply repeats).
    pub async fn start(script: Vec<Reply>) -> FakeLlm {
        assert!(!script.is_empty(), "the fake LLM needs at least one reply");
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind 127.0.0.1:0");
        let addr = listener.local_addr().expect("local addr");
        let shared = Arc::new(Shared {
            inner: Mutex::new(Inner {
                script,
                next: 0,
                requests: Vec::new(),
                discovery: Vec::new(),
                props: None,
                models: None,
            }),
            counters: watch::Sender::new(Counters::default()),
            shutdown: watch::Sender::new(false),
        });
        let app = Router::new()
            .route("/v1/chat/completions", post(chat_completions))
            .route("/chat/completions", post(chat_completions))
            .route("/props", get(props))
            .route("/v1/models", get(models))
            .route("/models", get(models))
            .fallback(not_found)
            .with_state(shared.clone());
        let mut stop = shared.shutdown.subscribe();
        let server = tokio::spawn(async move {
            axum::serve(listener, app)
                .with_graceful_shutdown(async move {
                    let _ = stop.wait_for(|s| *s).await;
                })
                .await
                .expect("fake LLM server failed");
        });
        FakeLlm {
            addr,
            shared,
            server: Some(server),
        }
    }

    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://127.0.0.1:PORT/v1`, what `OpenAIConfig::with_api_base` expects.
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// Appends `reply` to the script (served after the replies not yet used).
    pub fn push(&self, reply: Reply) {
        self.shared.inner.lock().unwrap().script.push(reply);
    }

    /// Answers `GET /props` with `body` (llama.cpp's server).
    pub fn serve_props(&self, body: Value) {
        self.shared.inner.lock().unwrap().props = Some(body);
    }

    /// Answers `GET /v1/models` with `body`.
    pub fn serve_models(&self, body: Value) {
        self.shared.inner.lock().unwrap().models = Some(body);
    }

    /// Every `GET /props` and `GET /v1/models` request, in arrival order.
    pub fn discovery_requests(&self) -> Vec<RecordedRequest> {
        self.shared.inner.lock().unwrap().discovery.clone()
    }

    /// Every chat-completions request received so far, in arrival order.
    pub fn requests(&self) -> Vec<RecordedRequest> {
        self.shared.inner.lock().unwrap().requests.clone()
    }

    /// The last request received; panics when there was none.
    pub fn last_request(&self) -> RecordedRequest {
        self.requests()
            .pop()
            .expect("the fake LLM received no request")
    }

    /// How many chat-completions requests arrived.
    pub fn request_count(&self) -> usize {
        self.counters().requests
    }

    /// Responses still being produced (streams being sent and hung requests).
    pub fn active_connections(&self) -> usize {
        self.counters().active
    }

    /// In-flight responses the client abandoned (connection closed before the end).
    pub fn cancelled_count(&self) -> usize {
        self.counters().cancelled
    }

    /// Responses that ran to their scripted end.
    pub fn completed_count(&self) -> usize {
        self.counters().completed
    }

    /// A snapshot of all counters.
    pub fn counters(&self) -> Counters {
        *self.shared.counters.borrow()
    }

    /// Waits (without polling) until `done` holds for the counters; returns them.
    pub async fn wait_until(&self, mut done: impl FnMut(&Counters) -> bool) -> Counters {
        let mut rx = self.shared.counters.subscribe();
        rx.wait_for(|c| done(c))
            .await
            .map(|c| *c)
            .expect("the counters live as long as the fake")
    }

    /// Waits until at least `n` requests arrived.
    pub async fn wait_for_requests(&self, n: usize) {
        self.wait_until(|c| c.requests >= n).await;
    }

    /// Waits until at least `n` responses are in flight.
    pub async fn wait_for_active(&self, n: usize) {
        self.wait_until(|c| c.active >= n).await;
    }

    /// Waits until at least `n` in-flight responses were abandoned by the client.
    pub async fn wait_for_cancelled(&self, n: usize) {
        self.wait_until(|c| c.cancelled >= n).await;
    }

    /// Waits until no response is in flight.
    pub async fn wait_for_idle(&self) {
        self.wait_until(|c| c.active == 0).await;
    }

    /// Stops the server: in-flight responses are cut, and the port is closed on return.
    pub async fn shutdown(mut self) {
        self.shared.shutdown.send_replace(true);
        if let Some(server) = self.server.take() {
            server.await.expect("fake LLM server task");
        }
    }
}

impl Drop for FakeLlm {
    fn drop(&mut self) {
        self.shared.shutdown.send_replace(true);
    }
}

/// Counts one in-flight response; on drop, a response not marked done counts as cancelled.
struct Flight {
    shared: Arc<Shared>,
    done: bool,
}

impl Flight {
    /// Registers a new in-flight response.
    fn begin(shared: Arc<Shared>) -> Flight {
        shared.counters.send_modify(|c| c.active += 1);
        Flight {
            shared,
            done: false,
        }
    }

    /// Marks the response as ended by the fake itself (not cancelled).
    fn finish(&mut self) {
        self.done = true;
    }
}

impl Drop for Flight {
    fn drop(&mut self) {
        let done = self.done;
        self.shared.counters.send_modify(|c| {
            c.active -= 1;
            if done {
                c.completed += 1;
            } else {
                c.cancelled += 1;
            }
        });
    }
}

/// One step of a streamed body.
enum Step {
    /// Send these bytes as one flushed frame.
    Frame(String),
    /// Pause.
    Sleep(Duration),
    /// Fail the body so the connection is cut without the chunked terminator.
    Cut,
}

/// `POST /v1/chat/completions`: records the request and plays the next scripted reply.
async fn chat_completions(
    AxumState(shared): AxumState<Arc<Shared>>,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let body: Value = serde_json::from_slice(&body)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&body).into_owned()));
    let recorded = record(&uri, &headers, body.clone());
    let (number, reply) = {
        let mut inner = shared.inner.lock().unwrap();
        inner.requests.push(recorded);
        (inner.requests.len(), inner.next_reply())
    };
    shared.counters.send_modify(|c| c.requests += 1);

    let model = body["model"].as_str().unwrap_or(DEFAULT_MODEL).to_string();
    let usage_wanted = include_usage(&body);
    let chunk = ChunkWriter::new(model, usage_wanted);
    let streamed = body["stream"] == Value::Bool(true);
    let reply = match reply {
        Reply::Window(spec) => match spec.judge(&body) {
            // llama-cpp-python ignores `include_usage`.
            Verdict::Fits(prompt) => Reply::text([format!("summary #{number}")])
                .with_usage((spec.overflow != Overflow::EmptyStream).then_some((prompt, 3))),
            Verdict::Refuse(body) => Reply::Status {
                code: 400,
                body,
                retry_after: None,
            },
            Verdict::Empty => Reply::Empty,
            Verdict::Truncated(kept) => {
                Reply::text([format!("summary #{number} of what was kept")])
                    .with_usage(Some((kept, 3)))
            }
            Verdict::RanOut(prompt, written) => {
                Reply::text([format!("summary #{number}, cut where the window")])
                    .with_usage(Some((prompt, written)))
                    .with_finish_reason(Some("length"))
            }
        },
        other => other,
    };
    if !streamed && let Reply::Stream { chunks, usage, .. } = &reply {
        return completion(&chunk.model, &chunks.concat(), *usage);
    }

    match reply {
        Reply::Stream {
            chunks,
            usage,
            delay_per_chunk,
            finish_reason,
        } => {
            let steps = chunk.full_stream(&chunks, usage, delay_per_chunk, finish_reason);
            sse_response(shared, steps)
        }
        Reply::Status {
            code,
            body,
            retry_after,
        } => {
            let mut response = (
                StatusCode::from_u16(code).expect("valid status code"),
                [(header::CONTENT_TYPE, "application/json")],
                body,
            )
                .into_response();
            if let Some(secs) = retry_after {
                response
                    .headers_mut()
                    .insert(header::RETRY_AFTER, secs.to_string().parse().unwrap());
            }
            response
        }
        Reply::DisconnectAfter { chunks } => {
            let mut steps = vec![Step::Frame(chunk.role())];
            steps.extend(chunks.iter().map(|c| Step::Frame(chunk.content(c))));
            steps.push(Step::Cut);
            sse_response(shared, steps)
        }
        Reply::Reasoning {
            reasoning,
            usage,
            finish_reason,
        } => {
            let mut steps = vec![Step::Frame(chunk.role())];
            steps.extend(reasoning.iter().map(|r| Step::Frame(chunk.reasoning(r))));
            if let Some(reason) = finish_reason {
                steps.push(Step::Frame(chunk.finish(reason)));
            }
            if chunk.usage_wanted {
                steps.push(Step::Frame(chunk.usage(usage.0, usage.1)));
            }
            steps.push(Step::Frame("data: [DONE]\n\n".to_string()));
            sse_response(shared, steps)
        }
        Reply::ErrorChunk { chunks, message } => {
            let mut steps = vec![Step::Frame(chunk.role())];
            steps.extend(chunks.iter().map(|c| Step::Frame(chunk.content(c))));
            let error = json!({"error": {"message": message, "type": "server_error", "param": null, "code": null}});
            steps.push(Step::Frame(format!("data: {error}\n\n")));
            steps.push(Step::Frame("data: [DONE]\n\n".to_string()));
            sse_response(shared, steps)
        }
        Reply::Malformed => {
            let steps = vec![
                Step::Frame(chunk.role()),
                Step::Frame("data: {not json\n\n".to_string()),
            ];
            sse_response(shared, steps)
        }
        Reply::ContextTooLong { max_prompt_chars } => {
            let chars = prompt_chars(&body);
            if chars > max_prompt_chars {
                (
                    StatusCode::BAD_REQUEST,
                    [(header::CONTENT_TYPE, "application/json")],
                    error_body(
                        CONTEXT_TOO_LONG_MESSAGE,
                        "invalid_request_error",
                        Some("messages"),
                        Some("context_length_exceeded"),
                    ),
                )
                    .into_response()
            } else {
                let text = format!("summary #{number}");
                let usage = Some(((chars as u64 / 4).max(1), 3));
                let steps =
                    chunk.full_stream(&[text], usage, Duration::ZERO, Some("stop".to_string()));
                sse_response(shared, steps)
            }
        }
        Reply::Empty => sse_response(shared, Vec::new()),
        Reply::Flood { kind, limit } => flood_response(shared, &chunk, kind, limit),
        Reply::Window(_) => unreachable!("judged above"),
        Reply::Hang => {
            let mut flight = Flight::begin(shared.clone());
            let mut stop = shared.shutdown.subscribe();
            // Dropped here (counted as cancelled) when hyper sees the client go away.
            let _ = stop.wait_for(|s| *s).await;
            flight.finish();
            drop(flight);
            let cut = futures::stream::once(async {
                Err::<Bytes, io::Error>(io::Error::other("fake LLM shut down"))
            });
            Response::builder()
                .status(StatusCode::OK)
                .header(header::CONTENT_TYPE, "text/event-stream")
                .body(Body::from_stream(cut))
                .unwrap()
        }
    }
}

/// `GET /props`: the body a test set, else 404; recorded.
async fn props(
    AxumState(shared): AxumState<Arc<Shared>>,
    uri: Uri,
    headers: HeaderMap,
) -> Response {
    let body = {
        let mut inner = shared.inner.lock().unwrap();
        inner.discovery.push(record(&uri, &headers, Value::Null));
        inner.props.clone()
    };
    discovery_answer(body, &uri)
}

/// `GET /v1/models`: the body a test set, else 404; recorded.
async fn models(
    AxumState(shared): AxumState<Arc<Shared>>,
    uri: Uri,
    headers: HeaderMap,
) -> Response {
    let body = {
        let mut inner = shared.inner.lock().unwrap();
        inner.discovery.push(record(&uri, &headers, Value::Null));
        inner.models.clone()
    };
    discovery_answer(body, &uri)
}

fn discovery_answer(body: Option<Value>, uri: &Uri) -> Response {
    match body {
        Some(body) => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, "application/json")],
            body.to_string(),
        )
            .into_response(),
        None => (
            StatusCode::NOT_FOUND,
            [(header::CONTENT_TYPE, "application/json")],
            error_body(
                &format!("Invalid URL (GET {})", uri.path()),
                "invalid_request_error",
                None,
                None,
            ),
        )
            .into_response(),
    }
}

/// A request as recorded: path, headers, body.
fn record(uri: &Uri, headers: &HeaderMap, body: Value) -> RecordedRequest {
    RecordedRequest {
        path: uri.path().to_string(),
        headers: headers
            .iter()
            .map(|(n, v)| {
                (
                    n.as_str().to_string(),
                    String::from_utf8_lossy(v.as_bytes()).into_owned(),
                )
            })
            .collect(),
        body,
    }
}

/// A non-streamed answer: one `chat.completion` with `text` (and usage, when scripted).
fn completion(model: &str, text: &str, usage: Option<(u64, u64)>) -> Response {
    let mut answer = json!({
        "id": FAKE_COMPLETION_ID,
        "object": "chat.completion",
        "created": 0,
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
    });
    if let Some((p, c)) = usage {
        answer["usage"] =
            json!({"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c});
    }
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/json")],
        answer.to_string(),
    )
        .into_response()
}

/// Any other route: an OpenAI-style 404 (not recorded, script untouched).
async fn not_found(uri: Uri) -> Response {
    (
        StatusCode::NOT_FOUND,
        [(header::CONTENT_TYPE, "application/json")],
        error_body(
            &format!("Invalid URL (POST {})", uri.path()),
            "invalid_request_error",
            None,
            None,
        ),
    )
        .into_response()
}

/// A 200 `text/event-stream` response that plays `steps`, one flushed frame at a time.
fn sse_response(shared: Arc<Shared>, steps: Vec<Step>) -> Response {
    let flight = Flight::begin(shared.clone());
    let stop = shared.shutdown.subscribe();
    let body = Body::from_stream(step_stream(steps, flight, stop));
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(body)
        .unwrap()
}

/// A [`Reply::Flood`]: a head, then the same frame again and again, each counted in
/// `flood_bytes`, until the client goes away or `limit` bytes went out.
fn flood_response(shared: Arc<Shared>, chunk: &ChunkWriter, kind: Flood, limit: usize) -> Response {
    let filler = "x".repeat(FLOOD_FRAME_BYTES);
    // A stream that reaches the limit is cut; an error body ends, so a client that reads
    // it whole sees all of it.
    let cut = !matches!(kind, Flood::Status(_));
    let (status, content_type, head, frame) = match kind {
        Flood::Deltas(delta) => (
            200,
            "text/event-stream",
            chunk.role(),
            chunk.content(&delta),
        ),
        Flood::Line => (
            200,
            "text/event-stream",
            format!(
                "{}data: {{\"id\":\"{FAKE_COMPLETION_ID}\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"",
                chunk.role()
            ),
            filler,
        ),
        Flood::Status(code) => (
            code,
            "application/json",
            r#"{"error":{"type":"server_error","message":"upstream failed: "#.to_string(),
            filler,
        ),
    };
    let flight = Flight::begin(shared.clone());
    let frames = std::iter::once(Bytes::from(head)).chain(std::iter::repeat(Bytes::from(frame)));
    let body = futures::stream::unfold(
        (frames, 0usize, Some(flight), shared),
        move |(mut frames, sent, flight, shared)| async move {
            let mut flight = flight?;
            if sent >= limit {
                flight.finish();
                if !cut {
                    return None;
                }
                // The client kept reading: cut the stream (no finish, no `[DONE]`).
                tokio::task::yield_now().await;
                let err = io::Error::other("fake LLM flood reached its limit");
                return Some((Err(err), (frames, sent, None, shared)));
            }
            let frame = frames.next()?;
            let n = frame.len();
            shared.counters.send_modify(|c| c.flood_bytes += n);
            Some((Ok(frame), (frames, sent + n, Some(flight), shared)))
        },
    );
    Response::builder()
        .status(StatusCode::from_u16(status).expect("valid status code"))
        .header(header::CONTENT_TYPE, content_type)
        .body(Body::from_stream(body))
        .unwrap()
}

/// The body stream: frames, pauses and cuts; its `Flight` sees whether it was dropped early.
fn step_stream(
    steps: Vec<Step>,
    flight: Flight,
    stop: watch::Receiver<bool>,
) -> impl Stream<Item = Result<Bytes, io::Error>> + Send + 'static {
    futures::stream::unfold(
        (steps.into_iter(), flight, stop),
        |(mut steps, mut flight, mut stop)| async move {
            loop {
                match steps.next() {
                    None => {
                        flight.finish();
                        return None;
                    }
                    Some(Step::Frame(frame)) => {
                        return Some((Ok(Bytes::from(frame)), (steps, flight, stop)));
                    }
                    Some(Step::Sleep(d)) => {
                        let stopped = tokio::select! {
                            _ = tokio::time::sleep(d) => false,
                            _ = stop.wait_for(|s| *s) => true,
                        };
                        if stopped {
                            flight.finish();
                            let err = io::Error::other("fake LLM shut down");
                            return Some((Err(err), (Vec::new().into_iter(), flight, stop)));
                        }
                    }
                    Some(Step::Cut) => {
                        // Return Pending once so hyper flushes the frames already written;
                        // an error straight after them would discard them unsent.
                        tokio::task::yield_now().await;
                        flight.finish();
                        let err = io::Error::other("fake LLM cut the connection");
                        return Some((Err(err), (Vec::new().into_iter(), flight, stop)));
                    }
                }
            }
        },
    )
}

/// Builds the SSE frames of one streamed completion.
struct ChunkWriter {
    model: String,
    created: u64,
    usage_wanted: bool,
}

impl ChunkWriter {
    /// A writer for `model`; `usage_wanted` adds `"usage":null` to every chunk, like OpenAI.
    fn new(model: String, usage_wanted: bool) -> ChunkWriter {
        let created = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs();
        ChunkWriter {
            model,
            created,
            usage_wanted,
        }
    }

    /// One `data: {chunk}\n\n` frame with these choices (and usage, when asked for).
    fn frame(&self, choices: Value, usage: Option<Value>) -> String {
        let mut chunk = json!({
            "id": FAKE_COMPLETION_ID,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        });
        if self.usage_wanted {
            chunk["usage"] = usage.unwrap_or(Value::Null);
        }
        format!("data: {chunk}\n\n")
    }

    /// The first frame: role `assistant`, empty content.
    fn role(&self) -> String {
        self.frame(
            json!([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": null}]),
            None,
        )
    }

    /// A content delta frame.
    fn content(&self, text: &str) -> String {
        self.frame(
            json!([{"index": 0, "delta": {"content": text}, "finish_reason": null}]),
            None,
        )
    }

    /// A reasoning delta frame (`reasoning_content`, as llama.cpp, vLLM and DeepSeek send).
    fn reasoning(&self, text: &str) -> String {
        self.frame(
            json!([{"index": 0, "delta": {"reasoning_content": text}, "finish_reason": null}]),
            None,
        )
    }

    /// The frame with an empty delta and the finish reason.
    fn finish(&self, reason: &str) -> String {
        self.frame(
            json!([{"index": 0, "delta": {}, "finish_reason": reason}]),
            None,
        )
    }

    /// The usage frame: no choices, token counts.
    fn usage(&self, prompt: u64, completion: u64) -> String {
        let usage = json!({
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        });
        self.frame(json!([]), Some(usage))
    }

    /// Every step of a complete stream, ending with `[DONE]`.
    fn full_stream(
        &self,
        chunks: &[String],
        usage: Option<(u64, u64)>,
        delay: Duration,
        finish_reason: Option<String>,
    ) -> Vec<Step> {
        let mut steps = vec![Step::Frame(self.role())];
        for c in chunks {
            if !delay.is_zero() {
                steps.push(Step::Sleep(delay));
            }
            steps.push(Step::Frame(self.content(c)));
        }
        if let Some(reason) = finish_reason {
            steps.push(Step::Frame(self.finish(&reason)));
        }
        if let (true, Some((p, c))) = (self.usage_wanted, usage) {
            steps.push(Step::Frame(self.usage(p, c)));
        }
        steps.push(Step::Frame("data: [DONE]\n\n".to_string()));
        steps
    }
}

/// True when `body` set `stream_options.include_usage: true`.
fn include_usage(body: &Value) -> bool {
    body["stream_options"]["include_usage"] == Value::Bool(true)
}

/// The text of one message: its string content, or its text parts concatenated.
fn message_text(message: &Value) -> String {
    match &message["content"] {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| p["text"].as_str())
            .collect::<Vec<_>>()
            .concat(),
        _ => String::new(),
    }
}

/// Sum of the messages' content lengths in chars.
fn prompt_chars(body: &Value) -> usize {
    body["messages"]
        .as_array()
        .map(|ms| ms.iter().map(|m| message_text(m).chars().count()).sum())
        .unwrap_or(0)
}
