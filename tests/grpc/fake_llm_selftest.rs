//! The fake LLM speaks the OpenAI streaming protocol as a real client understands it:
//! every test drives `async-openai` itself (not compactd's code) against `FakeLlm`, or
//! reads the raw HTTP bytes when async-openai hides what is being checked.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use async_openai::Client;
use async_openai::config::OpenAIConfig;
use async_openai::error::{OpenAIError, StreamError};
use async_openai::types::chat::{
    ChatCompletionRequestMessage, ChatCompletionResponseStream, ChatCompletionStreamOptions,
    CompletionUsage, CreateChatCompletionRequest, CreateChatCompletionRequestArgs,
    CreateChatCompletionStreamResponse, FinishReason, Role,
};
use futures::StreamExt;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::common::fake_llm::{CONTEXT_TOO_LONG_MESSAGE, FakeLlm, Reply};

/// Upper bound for any single wait, so a broken fake fails instead of hanging.
const PATIENCE: Duration = Duration::from_secs(5);

/// An async-openai client of `fake` with API key `sk-test`.
fn client(fake: &FakeLlm) -> Client<OpenAIConfig> {
    Client::with_config(
        OpenAIConfig::new()
            .with_api_base(fake.base_url())
            .with_api_key("sk-test"),
    )
}

/// A streaming request with a system and a user message.
fn request(user: &str, include_usage: Option<bool>) -> CreateChatCompletionRequest {
    let mut args = CreateChatCompletionRequestArgs::default();
    args.model("gpt-fake").stream(true).messages(vec![
        ChatCompletionRequestMessage::System("Summarize the session.".into()),
        ChatCompletionRequestMessage::User(user.into()),
    ]);
    if let Some(include_usage) = include_usage {
        args.stream_options(ChatCompletionStreamOptions {
            include_usage: Some(include_usage),
            include_obfuscation: None,
        });
    }
    args.build().expect("valid request")
}

/// Everything one stream yielded.
#[derive(Debug, Default)]
struct Collected {
    chunks: Vec<CreateChatCompletionStreamResponse>,
    deltas: Vec<String>,
    finish_reasons: Vec<FinishReason>,
    usage: Option<CompletionUsage>,
    errors: Vec<OpenAIError>,
}

impl Collected {
    fn text(&self) -> String {
        self.deltas.concat()
    }
}

/// Reads `stream` to its end.
async fn collect(mut stream: ChatCompletionResponseStream) -> Collected {
    let mut out = Collected::default();
    while let Some(item) = tokio::time::timeout(PATIENCE, stream.next())
        .await
        .expect("the stream yields or ends in time")
    {
        match item {
            Ok(chunk) => {
                for choice in &chunk.choices {
                    if let Some(c) = choice.delta.content.as_ref().filter(|c| !c.is_empty()) {
                        out.deltas.push(c.clone());
                    }
                    if let Some(f) = choice.finish_reason {
                        out.finish_reasons.push(f);
                    }
                }
                if let Some(u) = &chunk.usage {
                    assert!(out.usage.is_none(), "two usage chunks");
                    out.usage = Some(u.clone());
                }
                out.chunks.push(chunk);
            }
            Err(e) => out.errors.push(e),
        }
    }
    out
}

/// Sends `req` and reads the whole stream.
async fn run(fake: &FakeLlm, req: CreateChatCompletionRequest) -> Collected {
    let stream = client(fake)
        .chat()
        .create_stream(req)
        .await
        .expect("the stream starts");
    collect(stream).await
}

/// Sends `req` and returns the error that must end `create_stream`.
async fn run_err(fake: &FakeLlm, req: CreateChatCompletionRequest) -> OpenAIError {
    match client(fake).chat().create_stream(req).await {
        Ok(_) => panic!("expected create_stream to fail"),
        Err(e) => e,
    }
}

/// The HTTP status and API error of an `ApiError`, or panic.
fn api_error(e: &OpenAIError) -> (u16, &async_openai::error::ApiError) {
    match e {
        OpenAIError::ApiError(r) => (r.status_code.as_u16(), &r.api_error),
        other => panic!("expected an ApiError, got {other:?}"),
    }
}

/// A raw HTTP response: status code, lowercase headers, de-chunked body.
struct RawResponse {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
}

impl RawResponse {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// The SSE frames of the body (`data: ...` without the blank-line terminator).
    fn frames(&self) -> Vec<&str> {
        assert!(
            self.body.ends_with("\n\n"),
            "body ends with a frame terminator"
        );
        self.body.trim_end_matches("\n\n").split("\n\n").collect()
    }
}

/// POSTs `body` to `path` over a bare TCP connection and reads the full response.
async fn raw_post(addr: SocketAddr, path: &str, body: &Value) -> RawResponse {
    let body = body.to_string();
    let mut tcp = TcpStream::connect(addr).await.expect("connect to the fake");
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Authorization: Bearer sk-raw\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    tcp.write_all(head.as_bytes()).await.unwrap();
    tcp.write_all(body.as_bytes()).await.unwrap();
    let mut raw = Vec::new();
    tokio::time::timeout(PATIENCE, tcp.read_to_end(&mut raw))
        .await
        .expect("the fake closes the connection in time")
        .unwrap();
    let raw = String::from_utf8(raw).expect("utf-8 response");
    let (head, rest) = raw.split_once("\r\n\r\n").expect("a header block");
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let headers: Vec<(String, String)> = lines
        .map(|l| {
            let (n, v) = l.split_once(':').unwrap();
            (n.trim().to_ascii_lowercase(), v.trim().to_string())
        })
        .collect();
    let chunked = headers
        .iter()
        .any(|(n, v)| n == "transfer-encoding" && v == "chunked");
    let body = if chunked {
        dechunk(rest)
    } else {
        rest.to_string()
    };
    RawResponse {
        status,
        headers,
        body,
    }
}

/// Decodes an HTTP/1.1 chunked body; panics when the terminating chunk is missing.
fn dechunk(mut rest: &str) -> String {
    let mut out = String::new();
    loop {
        let (size, after) = rest.split_once("\r\n").expect("a chunk size line");
        let size = usize::from_str_radix(size.trim(), 16).expect("hex chunk size");
        if size == 0 {
            return out;
        }
        out.push_str(&after[..size]);
        rest = after[size..]
            .strip_prefix("\r\n")
            .expect("CRLF after a chunk");
    }
}

/// The chunk JSON of one `data: {...}` frame.
fn frame_json(frame: &str) -> Value {
    let data = frame.strip_prefix("data: ").expect("a data frame");
    serde_json::from_str(data).expect("chunk JSON")
}

#[tokio::test]
async fn a_stream_reaches_async_openai_with_text_finish_reason_and_usage() {
    let fake = FakeLlm::start(vec![Reply::text(["Hello", " world"])]).await;
    let got = run(&fake, request("what happened?", Some(true))).await;

    assert!(got.errors.is_empty(), "{:?}", got.errors);
    assert_eq!(got.deltas, ["Hello", " world"]);
    assert_eq!(got.text(), "Hello world");
    assert_eq!(got.finish_reasons, [FinishReason::Stop]);
    let usage = got.usage.as_ref().expect("the usage chunk");
    assert_eq!(
        (
            usage.prompt_tokens,
            usage.completion_tokens,
            usage.total_tokens
        ),
        (10, 2, 12)
    );
    // role chunk, 2 deltas, finish chunk, usage chunk
    assert_eq!(got.chunks.len(), 5);
    let first = &got.chunks[0];
    assert_eq!(first.choices[0].delta.role, Some(Role::Assistant));
    assert!(got.chunks.iter().all(|c| c.id == "chatcmpl-fake"
        && c.object == "chat.completion.chunk"
        && c.model == "gpt-fake"
        && c.created == first.created));
    assert!(got.chunks.last().unwrap().choices.is_empty());

    assert_eq!(fake.request_count(), 1);
    let req = fake.last_request();
    assert_eq!(req.path, "/v1/chat/completions");
    assert_eq!(req.header("authorization"), Some("Bearer sk-test"));
    assert_eq!(req.body["stream"], json!(true));
    assert_eq!(req.body["model"], json!("gpt-fake"));
    assert_eq!(req.body["stream_options"]["include_usage"], json!(true));
    assert_eq!(
        req.body["messages"],
        json!([
            {"role": "system", "content": "Summarize the session."},
            {"role": "user", "content": "what happened?"},
        ])
    );
    assert_eq!(
        req.message_texts(),
        ["Summarize the session.", "what happened?"]
    );
    assert_eq!(fake.completed_count(), 1);
    assert_eq!(fake.cancelled_count(), 0);
}

#[tokio::test]
async fn no_usage_chunk_unless_include_usage_is_set() {
    let fake = FakeLlm::start(vec![Reply::text(["a", "b", "c"])]).await;
    for include in [None, Some(false)] {
        let got = run(&fake, request("hi", include)).await;
        assert!(got.errors.is_empty(), "{:?}", got.errors);
        assert_eq!(got.text(), "abc");
        assert_eq!(got.finish_reasons, [FinishReason::Stop]);
        assert!(got.usage.is_none(), "usage sent without include_usage");
        assert!(got.chunks.iter().all(|c| !c.choices.is_empty()));
        assert!(!fake.last_request().include_usage());
    }
    // Asked for, but the reply has none: still no usage chunk.
    fake.push(Reply::text(["x"]).with_usage(None));
    let got = run(&fake, request("hi", Some(true))).await;
    assert_eq!(got.text(), "x");
    assert!(got.usage.is_none());
}

#[tokio::test]
async fn the_wire_format_is_openais_frame_by_frame() {
    let fake = FakeLlm::start(vec![Reply::text(["Hel", "lo"]).with_usage(Some((7, 2)))]).await;
    let body = json!({
        "model": "m-raw",
        "stream": true,
        "stream_options": {"include_usage": true},
        "messages": [{"role": "user", "content": "hi"}],
    });
    // The path without /v1 is accepted too.
    let r = raw_post(fake.addr(), "/chat/completions", &body).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    assert_eq!(r.header("transfer-encoding"), Some("chunked"));

    let frames = r.frames();
    assert_eq!(frames.len(), 6, "{frames:#?}");
    assert_eq!(*frames.last().unwrap(), "data: [DONE]");
    let chunks: Vec<Value> = frames[..5].iter().map(|f| frame_json(f)).collect();
    let created = chunks[0]["created"].clone();
    assert!(created.as_u64().unwrap() > 1_700_000_000);
    let chunk = |choices: Value, usage: Value| {
        json!({"id": "chatcmpl-fake", "object": "chat.completion.chunk",
               "created": created, "model": "m-raw", "choices": choices, "usage": usage})
    };
    assert_eq!(
        chunks,
        [
            chunk(
                json!([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": null}]),
                Value::Null
            ),
            chunk(
                json!([{"index": 0, "delta": {"content": "Hel"}, "finish_reason": null}]),
                Value::Null
            ),
            chunk(
                json!([{"index": 0, "delta": {"content": "lo"}, "finish_reason": null}]),
                Value::Null
            ),
            chunk(
                json!([{"index": 0, "delta": {}, "finish_reason": "stop"}]),
                Value::Null
            ),
            chunk(
                json!([]),
                json!({"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9})
            ),
        ]
    );
    // Without include_usage there is no usage key at all, and no usage chunk.
    let body = json!({"model": "m-raw", "stream": true, "messages": []});
    let r = raw_post(fake.addr(), "/v1/chat/completions", &body).await;
    let frames = r.frames();
    assert_eq!(frames.len(), 5, "{frames:#?}");
    assert!(
        frames[..4]
            .iter()
            .all(|f| frame_json(f).get("usage").is_none())
    );

    let paths: Vec<String> = fake.requests().into_iter().map(|r| r.path).collect();
    assert_eq!(paths, ["/chat/completions", "/v1/chat/completions"]);
    assert_eq!(
        fake.requests()[0].header("authorization"),
        Some("Bearer sk-raw")
    );
}

#[tokio::test]
async fn slow_deltas_arrive_one_by_one_over_time() {
    // Not the gaps between arrivals: the client and the fake share a runtime, so a pause
    // of the machine can deliver two deltas together. What a pause cannot do is make the
    // stream end sooner than its delays allow, or merge two chunks into one.
    let delay = Duration::from_millis(40);
    let scripted = ["a", "b", "c"];
    let fake = FakeLlm::start(vec![Reply::slow(scripted, delay)]).await;
    let asked = Instant::now();
    let mut stream = client(&fake)
        .chat()
        .create_stream(request("hi", None))
        .await
        .unwrap();
    let mut arrivals = Vec::new();
    while let Some(item) = stream.next().await {
        let chunk = item.expect("a chunk");
        let contents: Vec<String> = chunk
            .choices
            .iter()
            .filter_map(|c| c.delta.content.clone())
            .filter(|c| !c.is_empty())
            .collect();
        assert!(
            contents.len() <= 1,
            "one delta per chunk, not several: {contents:?}"
        );
        if let Some(c) = contents.into_iter().next() {
            arrivals.push((c, Instant::now()));
        }
    }
    let texts: Vec<&str> = arrivals.iter().map(|(c, _)| c.as_str()).collect();
    assert_eq!(texts, scripted, "each scripted delta in a chunk of its own");
    // The fake sleeps `delay` before each delta: the last cannot come before them all.
    let last = arrivals.last().expect("deltas").1 - asked;
    let floor = delay * u32::try_from(scripted.len() - 1).expect("few");
    assert!(
        last >= floor,
        "the deltas were not paced: the last came {last:?} after the request"
    );
}

#[tokio::test]
async fn a_500_is_an_api_error_with_status_500_after_async_openais_own_retries() {
    // Retry-After 0 keeps async-openai's retries (3, else 100/200/400 ms) instant.
    let fake = FakeLlm::start(vec![Reply::status(500).with_retry_after(0)]).await;
    let e = run_err(&fake, request("hi", None)).await;
    let (status, err) = api_error(&e);
    assert_eq!(status, 500);
    // For 5xx async-openai keeps the raw body as the message.
    assert!(err.message.contains("server_error"), "{err:?}");
    assert_eq!(
        fake.request_count(),
        4,
        "async-openai retries a 500 three times"
    );
}

#[tokio::test]
async fn a_429_carries_retry_after_and_async_openai_retries_it() {
    // Raw: the header and the OpenAI error body are really sent.
    let fake = FakeLlm::start(vec![Reply::rate_limited(7)]).await;
    let r = raw_post(
        fake.addr(),
        "/v1/chat/completions",
        &json!({"messages": []}),
    )
    .await;
    assert_eq!(r.status, 429);
    assert_eq!(r.header("retry-after"), Some("7"));
    assert_eq!(r.header("content-type"), Some("application/json"));
    let body: Value = serde_json::from_str(&r.body).unwrap();
    assert_eq!(body["error"]["type"], json!("rate_limit_error"));
    assert_eq!(body["error"]["param"], Value::Null);
    assert_eq!(body["error"]["code"], Value::Null);
    assert!(body["error"]["message"].is_string());

    // async-openai honours Retry-After and retries by itself: one 429, then success.
    let fake = FakeLlm::start(vec![Reply::rate_limited(0), Reply::text(["ok"])]).await;
    let got = run(&fake, request("hi", None)).await;
    assert_eq!(got.text(), "ok");
    assert_eq!(fake.request_count(), 2);

    // Always 429: the caller gets status 429 after 1 + 3 attempts.
    let fake = FakeLlm::start(vec![Reply::rate_limited(0)]).await;
    let e = run_err(&fake, request("hi", None)).await;
    let (status, err) = api_error(&e);
    assert_eq!(status, 429);
    assert_eq!(err.r#type.as_deref(), Some("rate_limit_error"));
    assert_eq!(fake.request_count(), 4);
}

#[tokio::test]
async fn an_insufficient_quota_429_is_not_retried() {
    let fake = FakeLlm::start(vec![Reply::insufficient_quota()]).await;
    let e = run_err(&fake, request("hi", None)).await;
    let (status, err) = api_error(&e);
    assert_eq!(status, 429);
    assert_eq!(err.r#type.as_deref(), Some("insufficient_quota"));
    assert_eq!(fake.request_count(), 1);
}

#[tokio::test]
async fn a_mid_stream_disconnect_yields_the_partial_deltas_then_an_error() {
    let fake = FakeLlm::start(vec![Reply::disconnect_after(["par", "tial"])]).await;
    let got = run(&fake, request("hi", Some(true))).await;
    assert_eq!(got.deltas, ["par", "tial"]);
    assert!(got.finish_reasons.is_empty());
    assert!(got.usage.is_none());
    assert_eq!(got.errors.len(), 1, "{:?}", got.errors);
    assert!(
        matches!(&got.errors[0], OpenAIError::StreamError(e) if matches!(**e, StreamError::EventStream(_))),
        "{:?}",
        got.errors[0]
    );
    // A deliberate cut is not a client cancellation.
    assert_eq!(fake.cancelled_count(), 0);

    // Raw: no terminating chunk, no [DONE].
    let r = tokio::spawn({
        let addr = fake.addr();
        async move {
            let mut tcp = TcpStream::connect(addr).await.unwrap();
            let body = json!({"stream": true, "messages": []}).to_string();
            let head = format!(
                "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n",
                body.len()
            );
            tcp.write_all(head.as_bytes()).await.unwrap();
            tcp.write_all(body.as_bytes()).await.unwrap();
            let mut raw = Vec::new();
            tcp.read_to_end(&mut raw).await.unwrap();
            String::from_utf8(raw).unwrap()
        }
    });
    let raw = tokio::time::timeout(PATIENCE, r).await.unwrap().unwrap();
    assert!(raw.contains("\"tial\""));
    assert!(!raw.contains("[DONE]"));
    assert!(!raw.ends_with("0\r\n\r\n"), "the body must not end cleanly");
}

#[tokio::test]
async fn a_malformed_frame_yields_an_error_item() {
    let fake = FakeLlm::start(vec![Reply::Malformed]).await;
    let got = run(&fake, request("hi", None)).await;
    assert_eq!(got.chunks.len(), 1, "only the role chunk parses");
    assert_eq!(got.errors.len(), 1, "{:?}", got.errors);
    match &got.errors[0] {
        OpenAIError::JSONDeserialize(_, content) => assert_eq!(content, "{not json"),
        other => panic!("expected JSONDeserialize, got {other:?}"),
    }
}

#[tokio::test]
async fn context_too_long_rejects_long_prompts_and_answers_short_ones() {
    let fake = FakeLlm::start(vec![Reply::context_too_long(100)]).await;
    // "Summarize the session." is 22 chars; the user text brings it over 100.
    let e = run_err(&fake, request(&"x".repeat(100), None)).await;
    let (status, err) = api_error(&e);
    assert_eq!(status, 400);
    assert_eq!(err.message, CONTEXT_TOO_LONG_MESSAGE);
    assert_eq!(err.r#type.as_deref(), Some("invalid_request_error"));
    assert_eq!(err.param.as_deref(), Some("messages"));
    assert_eq!(err.code.as_deref(), Some("context_length_exceeded"));
    assert_eq!(fake.request_count(), 1, "a 400 is not retried");
    assert_eq!(fake.last_request().prompt_chars(), 122);

    let got = run(&fake, request(&"x".repeat(78), Some(true))).await;
    assert_eq!(got.text(), "summary #2");
    assert_eq!(got.finish_reasons, [FinishReason::Stop]);
    assert!(got.usage.is_some());

    // Not consumed: still the reply for every request.
    let e = run_err(&fake, request(&"x".repeat(79), None)).await;
    assert_eq!(api_error(&e).0, 400);
    let got = run(&fake, request("short", None)).await;
    assert_eq!(got.text(), "summary #4");
}

#[tokio::test]
async fn replies_are_used_in_order_and_the_last_one_repeats() {
    let fake = FakeLlm::start(vec![Reply::text(["one"]), Reply::text(["two"])]).await;
    let mut texts = Vec::new();
    for _ in 0..3 {
        texts.push(run(&fake, request("hi", None)).await.text());
    }
    fake.push(Reply::text(["three"]).with_finish_reason(Some("length")));
    let got = run(&fake, request("hi", None)).await;
    texts.push(got.text());
    assert_eq!(texts, ["one", "two", "two", "three"]);
    assert_eq!(got.finish_reasons, [FinishReason::Length]);
    fake.wait_for_requests(4).await;
    assert_eq!(fake.requests().len(), 4);
}

#[tokio::test]
async fn dropping_the_client_stream_is_seen_as_a_cancelled_request() {
    let chunks: Vec<String> = (0..50).map(|i| format!("t{i} ")).collect();
    let fake = FakeLlm::start(vec![Reply::slow(chunks, Duration::from_millis(20))]).await;
    let mut stream = client(&fake)
        .chat()
        .create_stream(request("hi", None))
        .await
        .unwrap();
    let mut deltas = Vec::new();
    while deltas.len() < 2 {
        let chunk = stream.next().await.expect("more chunks").expect("a chunk");
        if let Some(c) = chunk.choices[0]
            .delta
            .content
            .clone()
            .filter(|c| !c.is_empty())
        {
            deltas.push(c);
        }
    }
    assert_eq!(deltas, ["t0 ", "t1 "]);
    assert_eq!(fake.active_connections(), 1);
    drop(stream);

    tokio::time::timeout(PATIENCE, fake.wait_for_cancelled(1))
        .await
        .expect("the fake sees the client go away");
    let c = fake.counters();
    assert_eq!(
        (c.requests, c.active, c.cancelled, c.completed),
        (1, 0, 1, 0)
    );
}

#[tokio::test]
async fn a_hung_request_is_recorded_and_cancelled_when_the_client_gives_up() {
    let fake = FakeLlm::start(vec![Reply::Hang]).await;
    let client = client(&fake);
    let chat = client.chat();
    let call = chat.create_stream(request("hi", None));
    tokio::select! {
        r = call => panic!("a hung request must not answer: {:?}", r.map(|_| ())),
        _ = fake.wait_for_active(1) => {}
    }
    // The select dropped the pending call: the client gave up.
    assert_eq!(fake.request_count(), 1);
    assert_eq!(fake.last_request().body["stream"], json!(true));
    tokio::time::timeout(PATIENCE, fake.wait_for_cancelled(1))
        .await
        .expect("the fake sees the client go away");
    assert_eq!(fake.active_connections(), 0);
}

#[tokio::test]
async fn shutdown_cuts_streams_in_flight_and_closes_the_port() {
    let fake = FakeLlm::start(vec![Reply::slow(
        (0..100).map(|i| i.to_string()),
        Duration::from_millis(20),
    )])
    .await;
    let addr = fake.addr();
    let stream = client(&fake)
        .chat()
        .create_stream(request("hi", None))
        .await
        .unwrap();
    fake.wait_for_active(1).await;
    tokio::time::timeout(PATIENCE, fake.shutdown())
        .await
        .expect("shutdown ends in time");
    let got = collect(stream).await;
    assert!(got.finish_reasons.is_empty());
    assert_eq!(got.errors.len(), 1, "{:?}", got.errors);
    assert!(TcpStream::connect(addr).await.is_err(), "port still open");
}

#[test]
fn async_openai_parses_chunks_strictly() {
    let ok = json!({"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m",
                    "choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": null}],
                    "some_future_field": {"a": 1}});
    let parse = |v: &Value| serde_json::from_value::<CreateChatCompletionStreamResponse>(v.clone());
    parse(&ok).expect("unknown fields are ignored");
    for field in ["id", "object", "created", "model", "choices"] {
        let mut v = ok.clone();
        v.as_object_mut().unwrap().remove(field);
        assert!(
            parse(&v).is_err(),
            "a chunk without {field:?} must not parse"
        );
    }
    let mut v = ok.clone();
    v["choices"][0]["finish_reason"] = json!("eos");
    assert!(parse(&v).is_err(), "unknown finish reasons are rejected");
    let mut v = ok.clone();
    v["choices"][0].as_object_mut().unwrap().remove("index");
    assert!(parse(&v).is_err(), "a choice without index must not parse");
}
