//! Shared setup for the gRPC integration tests: a real server on 127.0.0.1:0, clients,
//! a stream driver that collects the events of one update, and builders for messages,
//! parts and sessions.
//!
//! The listener is bound before `serve` is spawned, so a client can connect right away:
//! no test sleeps or polls.

#![allow(dead_code)]

pub mod binary;
pub mod compaction;
pub mod fake_llm;
pub mod fake_window;
pub mod metrics;
pub mod raw_h2;
pub mod recording_proxy;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use compactd::config::EngineConfig;
use compactd::server::pb;
use compactd::server::pb::client_update::Update;
use compactd::server::pb::server_event::Event;
use compactd::server::pb::sessions_client::SessionsClient;
use compactd::server::{ServerOptions, serve};
use compactd::store::Store;
use compactd::tokens::Tokenizer;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tonic::Streaming;
use tonic::transport::Channel;

/// Message size limit for test clients: GetSession of a big trace exceeds tonic's 4 MiB.
pub const CLIENT_MAX_MESSAGE: usize = 64 * 1024 * 1024;

/// The OpenCode placeholder a cleared tool output reads as.
pub const PLACEHOLDER: &str = "[Old tool result content cleared]";

/// A typed client of `compactd.v1.Sessions`.
pub type Client = SessionsClient<Channel>;

/// A running server. Dropping it shuts the server down.
pub struct TestServer {
    pub addr: SocketAddr,
    shutdown: Option<oneshot::Sender<()>>,
}

impl TestServer {
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// A new connection to the server.
    pub async fn channel(&self) -> Channel {
        Channel::from_shared(self.url())
            .expect("valid url")
            .connect()
            .await
            .expect("connect to the test server")
    }

    /// A Sessions client on its own connection, with 64 MiB message limits.
    pub async fn client(&self) -> Client {
        SessionsClient::new(self.channel().await)
            .max_decoding_message_size(CLIENT_MAX_MESSAGE)
            .max_encoding_message_size(CLIENT_MAX_MESSAGE)
    }

    /// A Health client on its own connection.
    pub async fn health(&self) -> tonic_health::pb::health_client::HealthClient<Channel> {
        tonic_health::pb::health_client::HealthClient::new(self.channel().await)
    }

    /// A main stream on a new connection.
    pub async fn stream(&self) -> EventStream {
        EventStream::open(&mut self.client().await).await
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }
}

/// The engine defaults as they were before compactd's own strategies and the cache-aware
/// scheduler: ACP's strategies, every decision applied at once. Tests of prune, of ACP's
/// strategies and of compaction use it, so what they check stays about those layers.
pub fn acp_config() -> EngineConfig {
    EngineConfig {
        strategies: compactd::config::StrategySet::acp(),
        cache_model: compactd::config::CacheModel::NONE,
        ..EngineConfig::default()
    }
}

/// A server with [`acp_config`].
pub async fn start_acp_server() -> TestServer {
    start_server_with(ServerOptions::default(), acp_config()).await
}

/// A server with the default options and engine config.
pub async fn start_server() -> TestServer {
    start_server_with(ServerOptions::default(), EngineConfig::default()).await
}

/// A server with custom options (e.g. a small `max_update_bytes`).
pub async fn start_server_with_options(options: ServerOptions) -> TestServer {
    start_server_with(options, EngineConfig::default()).await
}

/// A server whose sessions start from `config` (e.g. `auto_compact: false`).
pub async fn start_server_with_config(config: EngineConfig) -> TestServer {
    start_server_with(ServerOptions::default(), config).await
}

/// A server with custom options and engine config. Counts chars ÷ 4 (the figures these
/// tests reason in) unless the config names a real tokenizer.
pub async fn start_server_with(options: ServerOptions, config: EngineConfig) -> TestServer {
    start_server_on(Store::new(chars4_unless_named(config)), options).await
}

/// `config`, counting chars ÷ 4 where it leaves the tokenizer to `auto`.
pub fn chars4_unless_named(config: EngineConfig) -> EngineConfig {
    let tokenizer = match config.tokenizer {
        Tokenizer::Auto => Tokenizer::Chars4,
        named => named,
    };
    EngineConfig {
        tokenizer,
        ..config
    }
}

/// A server over a store the test built (limits).
/// A server with default settings whose store enforces `limits`.
pub async fn start_server_with_limits(limits: compactd::store::Limits) -> TestServer {
    start_server_on(
        Store::new(chars4_unless_named(EngineConfig::default())).with_limits(limits),
        ServerOptions::default(),
    )
    .await
}

/// An import of the repository's example export (`examples/session.json`) as `session_id`.
pub fn example_import(session_id: &str) -> pb::ImportSessionRequest {
    pb::ImportSessionRequest {
        export_json: std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/examples/session.json"
        ))
        .expect("example"),
        session_id: session_id.into(),
        ..Default::default()
    }
}

pub async fn start_server_on(store: Store, options: ServerOptions) -> TestServer {
    let listener = TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind 127.0.0.1:0");
    let addr = listener.local_addr().expect("local addr");
    let store = Arc::new(store);
    let (tx, rx) = oneshot::channel::<()>();
    tokio::spawn(async move {
        serve(listener, store, options, async {
            let _ = rx.await;
        })
        .await
        .expect("server stopped with an error");
    });
    TestServer {
        addr,
        shutdown: Some(tx),
    }
}

// ---- the main stream ----

/// A client side of `Stream`: sends updates with increasing `seq` and collects the
/// events each one caused.
pub struct EventStream {
    tx: Option<mpsc::Sender<pb::ClientUpdate>>,
    events: Streaming<pb::ServerEvent>,
    next_seq: u64,
}

impl EventStream {
    pub async fn open(client: &mut Client) -> EventStream {
        let (tx, rx) = mpsc::channel(1024);
        let events = client
            .stream(ReceiverStream::new(rx))
            .await
            .expect("open the main stream")
            .into_inner();
        EventStream {
            tx: Some(tx),
            events,
            // Not 0 or 1, so an echoed seq cannot match by accident.
            next_seq: 1000,
        }
    }

    /// Sends a raw update as is (its seq too).
    pub async fn send_raw(&mut self, update: pb::ClientUpdate) {
        self.tx
            .as_ref()
            .expect("stream still open")
            .send(update)
            .await
            .expect("the stream accepts updates");
    }

    /// Sends an update for `session_id` with the next seq and returns that seq.
    pub async fn send(&mut self, session_id: &str, update: Update) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 7;
        self.send_raw(pb::ClientUpdate {
            seq,
            session_id: session_id.to_string(),
            update: Some(update),
        })
        .await;
        seq
    }

    /// The next event; panics when the stream ended or failed.
    pub async fn next_event(&mut self) -> pb::ServerEvent {
        self.events
            .message()
            .await
            .expect("stream event, not a status")
            .expect("stream still open")
    }

    /// Reads the events of update `seq`: everything up to and including its ack or
    /// error. Every event read must carry `seq` (acks come in the order sent).
    pub async fn reply(&mut self, seq: u64) -> Vec<pb::ServerEvent> {
        let mut out = Vec::new();
        loop {
            let e = self.next_event().await;
            assert_eq!(
                e.seq, seq,
                "event {e:?} does not carry the seq of the update being answered"
            );
            let done = is_terminal(&e);
            out.push(e);
            if done {
                return out;
            }
        }
    }

    /// Sends an update and returns its events (ending with the ack or error).
    pub async fn request(&mut self, session_id: &str, update: Update) -> Vec<pb::ServerEvent> {
        let seq = self.send(session_id, update).await;
        self.reply(seq).await
    }

    /// Sends an update that must be acked without other events; returns the ack.
    pub async fn expect_ack(&mut self, session_id: &str, update: Update) -> pb::Ack {
        let events = self.request(session_id, update).await;
        assert_eq!(events.len(), 1, "expected only an ack, got {events:?}");
        ack(&events).clone()
    }

    /// Reads (and drops) events until the stream ends with an error status; returns it.
    pub async fn failure(&mut self) -> tonic::Status {
        loop {
            match self.events.message().await {
                Ok(Some(_)) => {}
                Ok(None) => panic!("the stream ended cleanly"),
                Err(status) => return status,
            }
        }
    }

    /// Closes the sending side; returns what the server still sends before it ends
    /// the stream.
    pub async fn close(mut self) -> Vec<pb::ServerEvent> {
        self.tx = None;
        let mut rest = Vec::new();
        while let Some(e) = self.events.message().await.expect("clean end of stream") {
            rest.push(e);
        }
        rest
    }
}

/// True for the event that ends the answer to one update.
pub fn is_terminal(e: &pb::ServerEvent) -> bool {
    matches!(e.event, Some(Event::Ack(_)) | Some(Event::Error(_)))
}

/// Name of an event's kind, for compact assertions.
pub fn kind(e: &pb::ServerEvent) -> &'static str {
    match &e.event {
        Some(Event::Ack(_)) => "ack",
        Some(Event::Error(_)) => "error",
        Some(Event::Overflow(_)) => "overflow",
        Some(Event::Pruned(_)) => "pruned",
        Some(Event::Context(_)) => "context",
        Some(Event::PruneReport(_)) => "prune_report",
        Some(Event::OverflowCheck(_)) => "overflow_check",
        Some(Event::Compaction(_)) => "compaction",
        None => "none",
    }
}

/// Kinds of a list of events.
pub fn kinds(events: &[pb::ServerEvent]) -> Vec<&'static str> {
    events.iter().map(kind).collect()
}

/// The ack ending `events`; panics when they end otherwise.
pub fn ack(events: &[pb::ServerEvent]) -> &pb::Ack {
    match events.last().and_then(|e| e.event.as_ref()) {
        Some(Event::Ack(a)) => a,
        _ => panic!("expected the last event to be an ack: {events:?}"),
    }
}

/// The error ending `events`; panics when they end otherwise.
pub fn error(events: &[pb::ServerEvent]) -> &pb::Error {
    match events.last().and_then(|e| e.event.as_ref()) {
        Some(Event::Error(e)) => e,
        _ => panic!("expected the last event to be an error: {events:?}"),
    }
}

/// The overflow events among `events`.
pub fn overflows(events: &[pb::ServerEvent]) -> Vec<&pb::OverflowCheck> {
    events
        .iter()
        .filter_map(|e| match &e.event {
            Some(Event::Overflow(c)) => Some(c),
            _ => None,
        })
        .collect()
}

/// The pruned events among `events`.
pub fn pruned(events: &[pb::ServerEvent]) -> Vec<&pb::PruneReport> {
    events
        .iter()
        .filter_map(|e| match &e.event {
            Some(Event::Pruned(r)) => Some(r),
            _ => None,
        })
        .collect()
}

// ---- builders ----

pub fn limits(context: u64, output: u64) -> pb::ModelLimits {
    pb::ModelLimits {
        context,
        input: 0,
        output,
    }
}

/// Session info with an id and title, no limits (overflow never reported).
pub fn session(id: &str) -> pb::SessionInfo {
    pb::SessionInfo {
        id: id.to_string(),
        title: format!("title of {id}"),
        ..Default::default()
    }
}

/// Session info with model limits `context`/`output`.
pub fn session_with_limits(id: &str, context: u64, output: u64) -> pb::SessionInfo {
    pb::SessionInfo {
        limits: Some(limits(context, output)),
        ..session(id)
    }
}

/// Session info with limits and per-session overrides.
pub fn session_with_config(
    id: &str,
    context: u64,
    output: u64,
    config: pb::SessionConfig,
) -> pb::SessionInfo {
    pb::SessionInfo {
        config: Some(config),
        ..session_with_limits(id, context, output)
    }
}

pub fn user_msg(id: &str) -> pb::MessageInfo {
    pb::MessageInfo {
        id: id.to_string(),
        role: "user".to_string(),
        time: Some(pb::MessageTime {
            created: 1_700_000_000_000,
            completed: None,
        }),
        agent: "build".to_string(),
        ..Default::default()
    }
}

/// An unfinished assistant message answering `parent`.
pub fn assistant_msg(id: &str, parent: &str) -> pb::MessageInfo {
    pb::MessageInfo {
        id: id.to_string(),
        role: "assistant".to_string(),
        parent_id: parent.to_string(),
        time: Some(pb::MessageTime {
            created: 1_700_000_000_001,
            completed: None,
        }),
        agent: "build".to_string(),
        mode: "build".to_string(),
        ..Default::default()
    }
}

/// The same message, finished with reason "stop".
pub fn finished(mut m: pb::MessageInfo) -> pb::MessageInfo {
    m.finish = "stop".to_string();
    m
}

/// The same message, finished by its completion time only (no finish reason).
pub fn completed(mut m: pb::MessageInfo) -> pb::MessageInfo {
    let created = m.time.map_or(0, |t| t.created);
    m.time = Some(pb::MessageTime {
        created,
        completed: Some(created + 1),
    });
    m
}

/// A completed tool call of `tool` with `output`; call id `call_<id>`.
pub fn tool_part(message_id: &str, id: &str, tool: &str, output: &str) -> pb::Part {
    tool_part_with_status(message_id, id, tool, "completed", output)
}

/// A tool call in any status string (including invalid ones, for rejection tests).
pub fn tool_part_with_status(
    message_id: &str,
    id: &str,
    tool: &str,
    status: &str,
    output: &str,
) -> pb::Part {
    pb::Part {
        id: id.to_string(),
        message_id: message_id.to_string(),
        kind: Some(pb::part::Kind::Tool(pb::ToolPart {
            call_id: format!("call_{id}"),
            tool: tool.to_string(),
            state: Some(pb::ToolState {
                status: status.to_string(),
                output: output.to_string(),
                // A distinct input per call: identical calls would be deduplicated by
                // `supersedeDuplicates` (tested on its own in tests/grpc/strategies.rs).
                input: Some(prost_types::Struct {
                    fields: [(
                        "id".to_string(),
                        prost_types::Value {
                            kind: Some(prost_types::value::Kind::StringValue(id.to_string())),
                        },
                    )]
                    .into(),
                }),
                title: format!("{tool} {id}"),
                time: Some(pb::ToolTime {
                    start: 1_700_000_000_002,
                    end: Some(1_700_000_000_003),
                    compacted: None,
                }),
                ..Default::default()
            }),
            metadata: None,
        })),
        extra: None,
        mark: None,
    }
}

pub fn text_part(message_id: &str, id: &str, text: &str) -> pb::Part {
    pb::Part {
        id: id.to_string(),
        message_id: message_id.to_string(),
        kind: Some(pb::part::Kind::Text(pb::TextPart {
            text: text.to_string(),
            ..Default::default()
        })),
        extra: None,
        mark: None,
    }
}

/// Usage with only `input` set (no cache, no output, no total).
pub fn usage(input: u64) -> pb::TokenUsage {
    pb::TokenUsage {
        input,
        ..Default::default()
    }
}

/// A tool output of exactly `chars` ASCII characters that starts with `tag`, so each
/// output is distinct and its token count is round(chars / 4).
pub fn output_of(tag: &str, chars: usize) -> String {
    assert!(tag.len() < chars);
    let mut s = String::with_capacity(chars);
    s.push_str(tag);
    s.push(':');
    while s.len() < chars {
        s.push('x');
    }
    s.truncate(chars);
    s
}

/// Tokens of `text` under the chars/4 heuristic (ASCII only).
pub fn tokens_of(text: &str) -> u64 {
    (text.len() as u64 + 2) / 4
}

// ---- stream update shorthands ----

pub fn open(info: pb::SessionInfo) -> Update {
    Update::Open(info)
}

pub fn upsert_message(m: pb::MessageInfo) -> Update {
    Update::UpsertMessage(m)
}

pub fn upsert_part(p: pb::Part) -> Update {
    Update::UpsertPart(p)
}

pub fn delete_part(message_id: &str, part_id: &str) -> Update {
    Update::DeletePart(pb::PartRef {
        message_id: message_id.to_string(),
        part_id: part_id.to_string(),
    })
}

pub fn report_usage(tokens: pb::TokenUsage) -> Update {
    Update::ReportUsage(pb::UsageReport {
        message_id: String::new(),
        tokens: Some(tokens),
    })
}

// ---- unary shorthands ----

pub async fn open_session(client: &mut Client, info: pb::SessionInfo) -> pb::SessionSummary {
    client
        .open_session(pb::OpenSessionRequest {
            session: Some(info),
        })
        .await
        .expect("OpenSession")
        .into_inner()
}

pub async fn put_message(
    client: &mut Client,
    session_id: &str,
    m: pb::MessageInfo,
) -> Vec<pb::ServerEvent> {
    client
        .upsert_message(pb::UpsertMessageRequest {
            session_id: session_id.to_string(),
            message: Some(m),
        })
        .await
        .expect("UpsertMessage")
        .into_inner()
        .events
}

pub async fn put_part(client: &mut Client, session_id: &str, p: pb::Part) -> Vec<pb::ServerEvent> {
    client
        .upsert_part(pb::UpsertPartRequest {
            session_id: session_id.to_string(),
            part: Some(p),
        })
        .await
        .expect("UpsertPart")
        .into_inner()
        .events
}

pub async fn put_usage(
    client: &mut Client,
    session_id: &str,
    tokens: pb::TokenUsage,
) -> Vec<pb::ServerEvent> {
    client
        .report_usage(pb::ReportUsageRequest {
            session_id: session_id.to_string(),
            usage: Some(pb::UsageReport {
                message_id: String::new(),
                tokens: Some(tokens),
            }),
        })
        .await
        .expect("ReportUsage")
        .into_inner()
        .events
}

pub async fn get_session(client: &mut Client, session_id: &str) -> pb::GetSessionResponse {
    client
        .get_session(pb::GetSessionRequest {
            session_id: session_id.to_string(),
        })
        .await
        .expect("GetSession")
        .into_inner()
}

pub async fn get_context(client: &mut Client, session_id: &str) -> pb::Context {
    get_context_as(client, session_id, pb::ContextFormat::Unspecified).await
}

/// The context in `format` only.
pub async fn get_context_as(
    client: &mut Client,
    session_id: &str,
    format: pb::ContextFormat,
) -> pb::Context {
    client
        .get_context(pb::GetContextRequest {
            session_id: session_id.to_string(),
            format: format as i32,
        })
        .await
        .expect("GetContext")
        .into_inner()
}

pub async fn check_overflow(client: &mut Client, session_id: &str) -> pb::OverflowCheck {
    client
        .check_overflow(pb::CheckOverflowRequest {
            session_id: session_id.to_string(),
        })
        .await
        .expect("CheckOverflow")
        .into_inner()
}

pub async fn prune(client: &mut Client, session_id: &str, dry_run: bool) -> pb::PruneReport {
    client
        .prune(pb::PruneRequest {
            session_id: session_id.to_string(),
            dry_run,
        })
        .await
        .expect("Prune")
        .into_inner()
}

/// `Subscribe` to the events of `session_id` (empty: of every session).
/// A client on its own connection to `url` with a 64 KiB HTTP/2 window: one that does
/// not read its events soon leaves the server unable to send more.
pub async fn small_window_client(url: String) -> Client {
    let channel = tonic::transport::Endpoint::from_shared(url)
        .expect("url")
        .initial_stream_window_size(Some(65_535))
        .initial_connection_window_size(Some(65_535))
        .connect()
        .await
        .expect("connect");
    pb::sessions_client::SessionsClient::new(channel)
}

pub async fn subscribe(client: &mut Client, session_id: &str) -> Streaming<pb::SessionEvent> {
    client
        .subscribe(pb::SubscribeRequest {
            session_id: session_id.to_string(),
        })
        .await
        .expect("Subscribe")
        .into_inner()
}

/// Asserts a unary call failed with `code` and a message naming `needle`.
pub fn assert_status<T: std::fmt::Debug>(
    result: Result<T, tonic::Status>,
    code: tonic::Code,
    needle: &str,
) -> tonic::Status {
    let status = result.expect_err("the call must fail");
    assert_eq!(status.code(), code, "wrong code: {status:?}");
    assert!(
        status.message().contains(needle),
        "status message {:?} does not name {needle:?}",
        status.message()
    );
    status
}

// ---- reading results ----

/// A tool part's state, or panic.
pub fn tool_state(p: &pb::Part) -> &pb::ToolState {
    match &p.kind {
        Some(pb::part::Kind::Tool(t)) => t.state.as_ref().expect("tool state"),
        other => panic!("part {} is not a tool part: {other:?}", p.id),
    }
}

/// The part with `id` among `messages`, or panic.
pub fn find_part<'a>(messages: &'a [pb::Message], id: &str) -> &'a pb::Part {
    messages
        .iter()
        .flat_map(|m| &m.parts)
        .find(|p| p.id == id)
        .unwrap_or_else(|| panic!("part {id} not found"))
}

/// The text parts of a message, concatenated.
pub fn text_of(m: &pb::Message) -> String {
    m.parts
        .iter()
        .filter_map(|p| match &p.kind {
            Some(pb::part::Kind::Text(t)) => Some(t.text.as_str()),
            _ => None,
        })
        .collect()
}

/// The ids of the context's messages, in order.
pub fn context_ids(ctx: &pb::Context) -> Vec<String> {
    ctx.messages
        .iter()
        .map(|m| m.info.as_ref().expect("message info").id.clone())
        .collect()
}

/// The stored message with `id`, or panic.
pub fn stored_message<'a>(session: &'a pb::GetSessionResponse, id: &str) -> &'a pb::Message {
    session
        .messages
        .iter()
        .find(|m| m.info.as_ref().is_some_and(|i| i.id == id))
        .unwrap_or_else(|| panic!("message {id} is stored"))
}

/// A protobuf `ListValue` as JSON (its decoded values: prost's type, or the one compactd's
/// stubs hold).
pub fn list_to_json(values: &[prost_types::Value]) -> serde_json::Value {
    serde_json::Value::Array(values.iter().map(value_to_json).collect())
}

/// A protobuf `Value` as JSON.
pub fn value_to_json(v: &prost_types::Value) -> serde_json::Value {
    use prost_types::value::Kind;
    match &v.kind {
        None | Some(Kind::NullValue(_)) => serde_json::Value::Null,
        Some(Kind::BoolValue(b)) => serde_json::Value::Bool(*b),
        Some(Kind::NumberValue(n)) => serde_json::json!(n),
        Some(Kind::StringValue(s)) => serde_json::Value::String(s.clone()),
        Some(Kind::ListValue(l)) => list_to_json(&l.values),
        Some(Kind::StructValue(s)) => serde_json::Value::Object(
            s.fields
                .iter()
                .map(|(k, v)| (k.clone(), value_to_json(v)))
                .collect(),
        ),
    }
}

/// A JSON object as a protobuf `Struct` (numbers become doubles).
pub fn json_to_struct(v: &serde_json::Value) -> prost_types::Struct {
    let serde_json::Value::Object(o) = v else {
        panic!("not a JSON object: {v}");
    };
    prost_types::Struct {
        fields: o
            .iter()
            .map(|(k, v)| (k.clone(), json_to_value(v)))
            .collect(),
    }
}

/// JSON as a protobuf `Value`.
pub fn json_to_value(v: &serde_json::Value) -> prost_types::Value {
    use prost_types::value::Kind;
    let kind = match v {
        serde_json::Value::Null => Kind::NullValue(0),
        serde_json::Value::Bool(b) => Kind::BoolValue(*b),
        serde_json::Value::Number(n) => Kind::NumberValue(n.as_f64().unwrap_or(0.0)),
        serde_json::Value::String(s) => Kind::StringValue(s.clone()),
        serde_json::Value::Array(a) => Kind::ListValue(prost_types::ListValue {
            values: a.iter().map(json_to_value).collect(),
        }),
        serde_json::Value::Object(_) => Kind::StructValue(json_to_struct(v)),
    };
    prost_types::Value { kind: Some(kind) }
}

/// The shared `opencode export` traces, sorted by name.
pub fn trace_files() -> Vec<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/traces");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{} is readable: {e}", dir.display()))
        .map(|e| e.expect("dir entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    files.sort();
    files
}

// ---- compaction events ----

/// The kind of each compaction event, in order.
pub fn names(events: &[pb::CompactionEvent]) -> Vec<&'static str> {
    use pb::compaction_event::Event as Ce;
    events
        .iter()
        .map(|e| match &e.event {
            Some(Ce::Started(_)) => "started",
            Some(Ce::Delta(_)) => "delta",
            Some(Ce::Compacted(_)) => "compacted",
            Some(Ce::Failed(_)) => "failed",
            Some(Ce::Retrying(_)) => "retrying",
            None => "none",
        })
        .collect()
}

/// The summary deltas, concatenated.
pub fn deltas(events: &[pb::CompactionEvent]) -> String {
    use pb::compaction_event::Event as Ce;
    events
        .iter()
        .filter_map(|e| match &e.event {
            Some(Ce::Delta(d)) => Some(d.text.as_str()),
            _ => None,
        })
        .collect()
}
