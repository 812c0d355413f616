//! The compaction model's window without hand-tuning: told by llama.cpp's `/props` or a
//! `/v1/models` list before the first request, taught by a refusal's numbers or by an
//! empty stream, overridden by `--llm-context-tokens`. A "too long" answer cuts the head
//! smaller at once and never leads to the same request again.

use compactd::server::pb;
use serde_json::{Value, json};

use crate::common::compaction::*;
use crate::common::fake_llm::{FakeLlm, RecordedRequest, Reply};
use crate::common::fake_window::{Overflow, Verdict, WindowSpec};
use crate::common::*;

/// The fake endpoint's window.
const N_CTX: u64 = 4_096;

fn spec(percent: u64, overflow: Overflow) -> WindowSpec {
    WindowSpec {
        n_ctx: N_CTX,
        percent,
        overflow,
    }
}

/// No request is followed by one with the same body.
fn assert_no_repeat(requests: &[RecordedRequest]) {
    for (i, pair) in requests.windows(2).enumerate() {
        assert_ne!(
            pair[0].body,
            pair[1].body,
            "request {} was sent again as it was",
            i + 1
        );
    }
}

fn paths(requests: &[RecordedRequest]) -> Vec<String> {
    requests.iter().map(|r| r.path.clone()).collect()
}

/// After a first answer dropped as "too long" (its text holds `marker`): every later
/// request fits, none repeats the one before, the dropped answer is no chunk and is folded
/// into nothing, and the deltas after the last `retrying` (which voids its own) are the
/// summary committed.
fn assert_first_answer_dropped(
    window: &WindowSpec,
    requests: &[RecordedRequest],
    events: &[pb::CompactionEvent],
    marker: &str,
) {
    for r in &requests[1..] {
        assert!(
            matches!(window.judge(&r.body), Verdict::Fits(_)),
            "after the first answer every request fits: {:?}",
            window.judge(&r.body)
        );
    }
    assert_eq!(
        compacted(events).chunks as usize,
        requests.len() - 1,
        "the dropped answer is not a chunk"
    );
    assert_no_repeat(requests);
    assert!(
        !requests.iter().any(|r| r.body.to_string().contains(marker)),
        "the dropped answer is folded into no later request"
    );
    use compactd::server::pb::compaction_event::Event as Ce;
    let last_retry = events
        .iter()
        .rposition(|e| matches!(e.event, Some(Ce::Retrying(_))))
        .expect("a retrying event voids the dropped answer's deltas");
    let deltas: Vec<_> = events[last_retry..]
        .iter()
        .filter_map(|e| match &e.event {
            Some(Ce::Delta(d)) => Some(d.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(deltas.first().map(|d| d.index), Some(0), "{events:?}");
    let streamed: String = deltas.iter().map(|d| d.text.as_str()).collect();
    assert_eq!(streamed, format!("summary #{}", requests.len()));
}

/// Compacts a long session `sid` and returns its `session.compacted` chunk count.
async fn compact_long(client: &mut Client, sid: &str) -> u32 {
    seed_long_session(client, sid).await;
    let events = compact(client, sid).await;
    compacted(&events).chunks
}

#[tokio::test]
async fn the_window_is_learned_from_llama_cpp_props_before_the_first_request() {
    let window = spec(100, Overflow::Refuse);
    let fake = FakeLlm::start(vec![Reply::Window(window)]).await;
    fake.serve_props(json!({"default_generation_settings": {"n_ctx": N_CTX, "params": {}}}));
    let server = server_with_llm(&fake).await;
    let mut client = server.client().await;
    let chunks = compact_long(&mut client, SID).await;

    let requests = fake.requests();
    assert!(chunks >= 2, "the head is longer than the window: {chunks}");
    assert_eq!(chunks as usize, requests.len(), "no request was refused");
    for r in &requests {
        assert_eq!(r.body["max_tokens"], N_CTX / 4);
        assert!(matches!(window.judge(&r.body), Verdict::Fits(_)));
    }
    assert_eq!(paths(&fake.discovery_requests()), ["/props"]);

    // Kept for the process's life: the next compaction asks nothing.
    compact_long(&mut client, "cmp-2").await;
    assert_eq!(fake.discovery_requests().len(), 1);
}

#[tokio::test]
async fn the_window_is_learned_from_a_vllm_model_list() {
    let window = spec(100, Overflow::Refuse);
    let fake = FakeLlm::start(vec![Reply::Window(window)]).await;
    fake.serve_models(json!({"object": "list", "data": [
        {"id": "other-model", "max_model_len": 131_072},
        {"id": "fake-model", "object": "model", "max_model_len": N_CTX},
    ]}));
    let server = server_with_llm(&fake).await;
    let mut client = server.client().await;
    let chunks = compact_long(&mut client, SID).await;

    let requests = fake.requests();
    assert!(chunks >= 2);
    assert_eq!(chunks as usize, requests.len(), "no request was refused");
    assert!(requests.iter().all(|r| r.body["max_tokens"] == N_CTX / 4));
    // llama.cpp's /props first (absent here), then the list.
    let asked = fake.discovery_requests();
    assert_eq!(paths(&asked), ["/props", "/v1/models"]);
    assert!(
        asked
            .iter()
            .all(|r| r.header("authorization") == Some(&format!("Bearer {SECRET}"))),
        "the endpoint's key goes with the discovery requests"
    );
}

/// llama-server while it loads its model, in front of `fake`: `/props` and `/v1/models`
/// answer 503 "Loading model" until the first chat request, which finds the model loaded
/// (it is forwarded to `fake`, as every chat request); from then on `/props` tells
/// `n_ctx`.
struct LoadingServer {
    addr: std::net::SocketAddr,
    state: std::sync::Arc<Loading>,
    task: tokio::task::JoinHandle<()>,
}

struct Loading {
    upstream: String,
    n_ctx: u64,
    loaded: std::sync::atomic::AtomicBool,
    props_asked: std::sync::atomic::AtomicUsize,
    http: reqwest::Client,
}

impl LoadingServer {
    async fn start(fake: &FakeLlm, n_ctx: u64) -> LoadingServer {
        use axum::routing::{get, post};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind 127.0.0.1:0");
        let addr = listener.local_addr().expect("local addr");
        let state = std::sync::Arc::new(Loading {
            upstream: fake.base_url(),
            n_ctx,
            loaded: Default::default(),
            props_asked: Default::default(),
            http: reqwest::Client::new(),
        });
        let app = axum::Router::new()
            .route("/props", get(loading_props))
            .route("/v1/models", get(loading_models))
            .route("/v1/chat/completions", post(loading_chat))
            .with_state(state.clone());
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        LoadingServer { addr, state, task }
    }

    fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    fn props_asked(&self) -> usize {
        self.state
            .props_asked
            .load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl Drop for LoadingServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

type LoadingState = axum::extract::State<std::sync::Arc<Loading>>;

/// llama-server's answer on any route while its model loads.
fn still_loading() -> axum::response::Response {
    use axum::response::IntoResponse;
    (
        axum::http::StatusCode::SERVICE_UNAVAILABLE,
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        json!({"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}})
            .to_string(),
    )
        .into_response()
}

async fn loading_props(axum::extract::State(s): LoadingState) -> axum::response::Response {
    use axum::response::IntoResponse;
    use std::sync::atomic::Ordering;
    s.props_asked.fetch_add(1, Ordering::SeqCst);
    if !s.loaded.load(Ordering::SeqCst) {
        return still_loading();
    }
    axum::Json(json!({"default_generation_settings": {"n_ctx": s.n_ctx}})).into_response()
}

async fn loading_models(axum::extract::State(s): LoadingState) -> axum::response::Response {
    use axum::response::IntoResponse;
    if !s.loaded.load(std::sync::atomic::Ordering::SeqCst) {
        return still_loading();
    }
    axum::http::StatusCode::NOT_FOUND.into_response()
}

async fn loading_chat(
    axum::extract::State(s): LoadingState,
    headers: axum::http::HeaderMap,
    body: axum::body::Bytes,
) -> axum::response::Response {
    s.loaded.store(true, std::sync::atomic::Ordering::SeqCst);
    let mut request = s
        .http
        .post(format!("{}/chat/completions", s.upstream))
        .header("content-type", "application/json")
        .body(body);
    if let Some(auth) = headers.get("authorization") {
        request = request.header("authorization", auth.as_bytes());
    }
    let answer = request.send().await.expect("the fake answers");
    let mut response = axum::response::Response::builder().status(answer.status().as_u16());
    if let Some(kind) = answer.headers().get("content-type") {
        response = response.header("content-type", kind.as_bytes());
    }
    response
        .body(axum::body::Body::from_stream(answer.bytes_stream()))
        .expect("a response")
}

/// A server still loading its model answers the discovery requests 503 (llama-server's
/// "Loading model"): that is no answer, and the next compaction asks again. Before, a
/// 5xx or 429 counted as an answer without a window and the endpoint was never asked
/// again: every compaction of the process sent requests with no `max_tokens` and learned
/// the window only from refusals.
#[tokio::test]
async fn a_server_still_loading_is_asked_for_its_window_again() {
    let fake = FakeLlm::start(vec![Reply::text(["a summary"])]).await;
    let loading = LoadingServer::start(&fake, PROPS_N_CTX).await;
    let server = server_with(&fake, |c| c.base_url = loading.base_url()).await;
    let mut client = server.client().await;
    seed_session(&mut client, SID).await;
    compacted(&compact(&mut client, SID).await);
    assert_eq!(loading.props_asked(), 1);
    let first = fake.requests();
    assert_eq!(first.len(), 1, "{first:?}");
    assert!(first[0].body.get("max_tokens").is_none(), "no window yet");

    assert_eq!(
        next_compaction_max_tokens(&fake, &mut client).await,
        PROPS_N_CTX / 4,
        "sized for the window /props told once loaded"
    );
    assert_eq!(loading.props_asked(), 2, "asked again");
    seed_session(&mut client, "cmp-3").await;
    compacted(&compact(&mut client, "cmp-3").await);
    assert_eq!(loading.props_asked(), 2, "told: not asked again");
}

#[tokio::test]
async fn a_refusal_with_numbers_sets_the_window_and_the_rest_fits() {
    // A tokenizer 30% finer than o200k; the endpoint tells nothing before it refuses.
    let window = spec(130, Overflow::Refuse);
    let fake = FakeLlm::start(vec![Reply::Window(window)]).await;
    let server = server_with_llm(&fake).await;
    let mut client = server.client().await;
    let chunks = compact_long(&mut client, SID).await;

    let requests = fake.requests();
    assert!(
        matches!(window.judge(&requests[0].body), Verdict::Refuse(_)),
        "the whole head was tried first"
    );
    assert!(
        requests[0].body.get("max_tokens").is_none(),
        "no window yet"
    );
    for r in &requests[1..] {
        assert_eq!(
            r.body["max_tokens"],
            N_CTX / 4,
            "sized for the window learned"
        );
        assert!(
            matches!(window.judge(&r.body), Verdict::Fits(_)),
            "one refusal was enough: {}",
            window.prompt_tokens(&r.body)
        );
    }
    assert_eq!(chunks as usize, requests.len() - 1);
    assert_no_repeat(&requests);

    // Learned for the process: another session's compaction is refused nothing.
    let before = fake.request_count();
    let chunks = compact_long(&mut client, "cmp-2").await;
    assert_eq!(fake.request_count() - before, chunks as usize);
}

#[tokio::test]
async fn an_empty_stream_is_too_long_and_the_head_is_cut_smaller_never_resent() {
    // llama-cpp-python: a prompt over its window gets HTTP 200 and an empty stream.
    let window = spec(150, Overflow::EmptyStream);
    let fake = FakeLlm::start(vec![Reply::Window(window)]).await;
    let server = server_with_llm(&fake).await;
    let mut client = server.client().await;
    seed_long_session(&mut client, SID).await;
    let events = compact(&mut client, SID).await;
    let done = compacted(&events);
    assert!(
        !events.iter().any(|e| matches!(
            e.event,
            Some(compactd::server::pb::compaction_event::Event::Retrying(_))
        )),
        "an empty stream is not retried: {events:?}"
    );

    let requests = fake.requests();
    assert_no_repeat(&requests);
    assert_eq!(
        window.judge(&requests[0].body),
        Verdict::Empty,
        "the whole head first"
    );
    // Then the same messages once, not streamed and for one token: refused with numbers.
    let probe = &requests[1];
    assert_eq!(probe.body["stream"], false);
    assert_eq!(probe.body["max_tokens"], 1);
    assert_eq!(probe.messages(), requests[0].messages());
    assert!(matches!(window.judge(&probe.body), Verdict::Refuse(_)));
    // Every later request is streamed, sized for the window learned, and fits.
    for r in &requests[2..] {
        assert!(r.is_stream());
        assert_eq!(r.body["max_tokens"], N_CTX / 4);
        assert!(
            matches!(window.judge(&r.body), Verdict::Fits(_)),
            "{}",
            window.prompt_tokens(&r.body)
        );
    }
    assert_eq!(done.chunks as usize, requests.len() - 2);
}

#[tokio::test]
async fn a_prompt_the_endpoint_truncated_is_too_long_not_a_summary() {
    // Ollama: a prompt over its window loses the messages between the first and the last
    // (here the transcript) and is answered as usual; only the usage tells.
    let window = spec(100, Overflow::Truncate);
    let fake = FakeLlm::start(vec![Reply::Window(window)]).await;
    let server = server_with_llm(&fake).await;
    let mut client = server.client().await;
    seed_long_session(&mut client, SID).await;
    let events = compact(&mut client, SID).await;
    let done = compacted(&events);

    let requests = fake.requests();
    assert!(
        matches!(window.judge(&requests[0].body), Verdict::Truncated(_)),
        "the whole head first"
    );
    assert_first_answer_dropped(&window, &requests, &events, "of what was kept");
    // Its tokens were paid for all the same: the usage reported is every answer's.
    let input: u64 = requests
        .iter()
        .map(|r| match window.judge(&r.body) {
            Verdict::Fits(prompt) => prompt,
            Verdict::Truncated(kept) => kept,
            other => panic!("{other:?}"),
        })
        .sum();
    let usage = done.usage.expect("usage");
    assert_eq!(
        (usage.input, usage.output),
        (input, 3 * requests.len() as u64),
        "{usage:?}"
    );
}

#[tokio::test]
async fn an_answer_cut_where_the_window_ran_out_is_too_long_not_a_summary() {
    // llama.cpp's server: it tells its window, but its tokenizer counts the prompt finer
    // than compactd's, so prompt and `max_tokens` overrun it; it answers until the window
    // is full and stops for length, short of the `max_tokens` asked.
    let window = spec(160, Overflow::RunOut);
    let fake = FakeLlm::start(vec![Reply::Window(window)]).await;
    fake.serve_props(json!({"default_generation_settings": {"n_ctx": N_CTX, "params": {}}}));
    let server = server_with_llm(&fake).await;
    let mut client = server.client().await;
    seed_long_session(&mut client, SID).await;
    let events = compact(&mut client, SID).await;

    let requests = fake.requests();
    assert!(
        matches!(window.judge(&requests[0].body), Verdict::RanOut(..)),
        "the first request overruns the window: {:?}",
        window.judge(&requests[0].body)
    );
    assert_first_answer_dropped(&window, &requests, &events, "cut where the window");
}

/// OpenAI's refusal of 32,000 answer tokens from a model that writes at most 16,384
/// (gpt-4o-mini).
const OUTPUT_CAP_16K: &str = "max_tokens is too large: 32000. This model supports at most 16384 completion tokens, whereas you provided 32000.";

/// A 400 refusing the `max_tokens` asked, in `message`'s words.
fn max_tokens_refused(message: &str) -> Reply {
    Reply::Status {
        code: 400,
        body: crate::common::fake_llm::error_body(
            message,
            "invalid_request_error",
            Some("max_tokens"),
            None,
        ),
        retry_after: None,
    }
}

#[tokio::test]
async fn a_refused_max_tokens_is_asked_again_within_the_models_output_cap() {
    // gpt-4o-mini: a 128k window (configured here) but 16,384 output tokens; compactd
    // asks for a quarter of the window.
    let fake = FakeLlm::start(vec![
        max_tokens_refused(OUTPUT_CAP_16K),
        Reply::text(["the summary"]),
        Reply::text(["the second summary"]),
    ])
    .await;
    let server = server_with(&fake, |c| c.context_tokens = Some(128_000)).await;
    let mut client = server.client().await;
    seed_session(&mut client, SID).await;
    let done = compacted(&compact(&mut client, SID).await).clone();
    assert_eq!(done.chunks, 1);
    let requests = fake.requests();
    assert_eq!(requests[0].body["max_tokens"], 32_000);
    assert_eq!(
        requests[1].body["max_tokens"], 16_384,
        "asked again within the cap"
    );
    assert_eq!(requests[1].messages(), requests[0].messages());
    // Kept for the model: the next compaction asks within it at once.
    seed_session(&mut client, "cmp-2").await;
    compacted(&compact(&mut client, "cmp-2").await);
    let requests = fake.requests();
    assert_eq!(requests.len(), 3);
    assert_eq!(requests[2].body["max_tokens"], 16_384);
}

#[tokio::test]
async fn a_model_that_refuses_the_max_tokens_field_is_asked_without_it() {
    // OpenAI's reasoning models take `max_completion_tokens` only.
    let fake = FakeLlm::start(vec![
        max_tokens_refused(
            "Unsupported parameter: 'max_tokens' is not supported with this model. Use 'max_completion_tokens' instead.",
        ),
        Reply::text(["the summary"]),
    ])
    .await;
    let server = server_with(&fake, |c| c.context_tokens = Some(200_000)).await;
    let mut client = server.client().await;
    seed_session(&mut client, SID).await;
    compacted(&compact(&mut client, SID).await);
    let requests = fake.requests();
    assert_eq!(requests.len(), 2);
    assert!(requests[0].body.get("max_tokens").is_some());
    assert!(
        requests[1].body.get("max_tokens").is_none(),
        "{}",
        requests[1].body
    );
}

#[tokio::test]
async fn the_probe_of_a_silent_answer_asks_in_the_field_the_model_takes() {
    // A model that refuses `max_tokens` (learned), then answers with nothing: the
    // one-token probe asks with `max_completion_tokens`, not the refused field.
    let fake = FakeLlm::start(vec![
        max_tokens_refused(
            "Unsupported parameter: 'max_tokens' is not supported with this model. Use 'max_completion_tokens' instead.",
        ),
        Reply::Empty,
        Reply::text(["x"]),
        Reply::text(["first part"]),
        Reply::text(["second part"]),
        Reply::text(["third part"]),
        Reply::text(["fourth part"]),
    ])
    .await;
    fake.serve_props(json!({"default_generation_settings": {"n_ctx": 200_000, "params": {}}}));
    let server = server_with_llm(&fake).await;
    let mut client = server.client().await;
    seed_long_session(&mut client, SID).await;
    let _ = compact(&mut client, SID).await;
    let requests = fake.requests();
    let probe = &requests[2];
    assert_eq!(probe.body["stream"], false, "{}", probe.body);
    assert!(probe.body.get("max_tokens").is_none(), "{}", probe.body);
    assert_eq!(probe.body["max_completion_tokens"], 1);
}

/// A bare refusal for length, without numbers (OpenAI's `context_length_exceeded`).
fn refused_without_numbers() -> Reply {
    Reply::Status {
        code: 400,
        body: crate::common::fake_llm::error_body(
            crate::common::fake_llm::CONTEXT_TOO_LONG_MESSAGE,
            "invalid_request_error",
            Some("messages"),
            Some("context_length_exceeded"),
        ),
        retry_after: None,
    }
}

#[tokio::test]
async fn silent_answers_without_numbers_halve_the_chunk() {
    for (silent, probe_answer) in [
        // An empty stream, and a probe refused for length without numbers.
        (Reply::Empty, refused_without_numbers()),
        // A finish for length with nothing written, and a probe that fits.
        (
            Reply::text(Vec::<String>::new()).with_finish_reason(Some("length")),
            Reply::text(["x"]),
        ),
    ] {
        let fake = FakeLlm::start(vec![
            silent.clone(),
            probe_answer,
            Reply::text(["first part"]),
            Reply::text(["second part"]),
            Reply::text(["third part"]),
        ])
        .await;
        let server = server_with_llm(&fake).await;
        let mut client = server.client().await;
        seed_long_session(&mut client, SID).await;
        let events = compact(&mut client, SID).await;
        let done = compacted(&events);
        let requests = fake.requests();
        assert_no_repeat(&requests);
        let whole = requests[0].prompt_chars();
        assert_eq!(requests[1].body["stream"], false, "{silent:?}: the probe");
        assert!(
            requests[2].prompt_chars() < whole * 2 / 3,
            "{silent:?}: cut smaller: {} of {whole}",
            requests[2].prompt_chars()
        );
        assert!(done.chunks >= 2, "{silent:?}");
    }
}

/// A model with a 32,768-token window (told by `/props`) whose first answer is thinking
/// only (`output` tokens of a 13,000-token prompt, then `finish`), then `then`; a server
/// using it, and a client with the seeded session [`SID`].
async fn thinking_first(
    output: u64,
    finish: Option<&'static str>,
    then: Vec<Reply>,
) -> (FakeLlm, TestServer, Client) {
    let mut replies = vec![Reply::Reasoning {
        reasoning: vec!["Let me think. ".into(); 20],
        usage: (13_000, output),
        finish_reason: finish,
    }];
    replies.extend(then);
    let fake = FakeLlm::start(replies).await;
    fake.serve_props(json!({"default_generation_settings": {"n_ctx": 32_768}}));
    let server = server_with_llm(&fake).await;
    let mut client = server.client().await;
    seed_session(&mut client, SID).await;
    (fake, server, client)
}

/// A reasoning model that spends its whole `max_tokens` thinking wrote no summary, but
/// its prompt fit: that is not "too long". Before, compactd took it for one, learned a
/// window below prompt + max_tokens (kept for the process's life, only ever lowered) and
/// cut the head smaller, so every later request asked for less room to think, and the
/// compaction failed `too_long` after its splits.
#[tokio::test]
async fn a_model_that_reasons_its_max_tokens_away_teaches_no_window() {
    let (fake, _server, mut client) =
        thinking_first(8_192, Some("length"), vec![Reply::text(["a summary"])]).await;
    let events = compact(&mut client, SID).await;
    let f = failure(&events);
    assert_ne!(f.kind, "too_long", "{f:?}");
    assert!(f.reason.contains("reasoning"), "{}", f.reason);
    let requests = fake.requests();
    assert_eq!(
        requests.len(),
        1,
        "no probe, no smaller chunk: {requests:?}"
    );
    let first = requests[0].body["max_tokens"].clone();

    // The next compaction asks for as much room as the first.
    let events = compact(&mut client, SID).await;
    compacted(&events);
    let requests = fake.requests();
    assert_eq!(
        requests[1].body["max_tokens"], first,
        "{}",
        requests[1].body
    );
}

/// A stream that ends while the model is still thinking (a gateway's cut, no finish
/// reason) failed on the way, as any stream cut before the summary: retried, and no
/// "too long" to learn a window from. Before, it was taken for an empty answer: probed,
/// a window below prompt + max_tokens learned for the process's life, and the head cut
/// smaller.
#[tokio::test]
async fn a_stream_cut_while_the_model_reasons_is_retried_and_teaches_no_window() {
    let (fake, _server, mut client) =
        thinking_first(100, None, vec![Reply::text(["a summary"])]).await;
    let events = compact(&mut client, SID).await;
    compacted(&events);
    let requests = fake.requests();
    assert_eq!(requests.len(), 2, "one retry, no probe: {requests:?}");
    assert_eq!(requests[1].body["stream"], true, "{}", requests[1].body);
    assert_eq!(
        requests[1].body["max_tokens"], requests[0].body["max_tokens"],
        "no window learned"
    );

    // Cut where its usage says it thought its whole max_tokens away: the advice of a
    // `length` finish, not a retry of a request that would do the same.
    let (fake, _server, mut client) = thinking_first(8_192, None, vec![]).await;
    let f = failure(&compact(&mut client, SID).await).clone();
    assert!(f.reason.contains("wrote no summary"), "{}", f.reason);
    assert_eq!(fake.requests().len(), 1, "not retried");
}

/// The window `/props` tells in the tests of an empty stream's probe.
const PROPS_N_CTX: u64 = 32_768;

/// A model with a [`PROPS_N_CTX`] window (told by `/props`) whose first answer is an empty
/// stream, its one-token probe answered with `probe`, then `then`; a server using it, and
/// a client with the seeded session [`SID`].
async fn empty_first(probe: Reply, then: Vec<Reply>) -> (FakeLlm, TestServer, Client) {
    let mut replies = vec![Reply::Empty, probe];
    replies.extend(then);
    let fake = FakeLlm::start(replies).await;
    fake.serve_props(json!({"default_generation_settings": {"n_ctx": PROPS_N_CTX}}));
    let server = server_with_llm(&fake).await;
    let mut client = server.client().await;
    seed_session(&mut client, SID).await;
    (fake, server, client)
}

/// The `retrying` events of one compaction.
fn retries(
    events: &[compactd::server::pb::CompactionEvent],
) -> Vec<compactd::server::pb::CompactionRetrying> {
    use compactd::server::pb::compaction_event::Event as Ce;
    events
        .iter()
        .filter_map(|e| match &e.event {
            Some(Ce::Retrying(r)) => Some(r.clone()),
            _ => None,
        })
        .collect()
}

/// Compacts a second seeded session and returns the `max_tokens` of its first request.
async fn next_compaction_max_tokens(fake: &FakeLlm, client: &mut Client) -> Value {
    let before = fake.request_count();
    seed_session(client, "cmp-2").await;
    compacted(&compact(client, "cmp-2").await);
    fake.requests()[before].body["max_tokens"].clone()
}

/// An empty stream whose one-token probe is answered was no sign of length: the prompt
/// fits. It is retried as the stream broken on the way it is, and teaches no window.
/// Before, it taught one below prompt + max_tokens (the 32,768 tokens `/props` told became
/// 8,191), kept for the process's life: every later compaction on that endpoint asked for
/// a quarter of the room, and cut its head for a quarter of the window.
#[tokio::test]
async fn an_empty_stream_whose_probe_is_answered_is_retried_and_teaches_no_window() {
    let (fake, _server, mut client) = empty_first(
        Reply::text(["x"]),
        vec![Reply::text(["a summary"]), Reply::text(["another summary"])],
    )
    .await;
    let events = compact(&mut client, SID).await;
    assert_eq!(compacted(&events).chunks, 1, "{events:?}");
    assert_eq!(retries(&events).len(), 1, "{events:?}");
    let requests = fake.requests();
    assert_eq!(requests.len(), 3, "{requests:?}");
    assert_eq!(requests[0].body["max_tokens"], PROPS_N_CTX / 4);
    assert_eq!(requests[1].body["stream"], false, "the probe");
    assert_eq!(
        requests[2].body, requests[0].body,
        "the same request, again"
    );

    assert_eq!(
        next_compaction_max_tokens(&fake, &mut client).await,
        PROPS_N_CTX / 4,
        "sized for the window /props told"
    );
}

/// The retry an empty stream gets when its prompt fits the known window is one: a second
/// empty stream for the same request is "too long" after all (the known window may be
/// wrong: a configured 32k on an 8k server that answers prompt + `max_tokens` past its
/// window with an empty stream), and the head is cut smaller. Before, the identical
/// request was sent again at every retry.
#[tokio::test]
async fn a_second_empty_stream_for_the_same_request_is_too_long() {
    let (fake, _server, mut client) = empty_first(
        Reply::text(["x"]),
        vec![Reply::Empty, Reply::text(["x"]), Reply::text(["a summary"])],
    )
    .await;
    let events = compact(&mut client, SID).await;
    assert!(names(&events).last() == Some(&"compacted"), "{events:?}");
    let requests = fake.requests();
    assert!(requests.len() >= 5, "{requests:?}");
    assert_eq!(
        requests[2].body, requests[0].body,
        "retried once, as it was"
    );
    assert_ne!(requests[4].body, requests[0].body, "then cut smaller");
}

/// An empty stream whose probe fails for a reason worth a retry (a 429, a 5xx) says
/// nothing of length: that failure is the request's, retried after the wait its
/// `Retry-After` asks and within the retry budget, and no window is learned. Before, it
/// was "too long": the head was cut smaller, a window below what was sent kept for the
/// process's life, and the server's `Retry-After` ignored.
#[tokio::test]
async fn an_empty_stream_whose_probe_fails_retryably_is_retried_as_that_failure() {
    let (fake, _server, mut client) = empty_first(
        Reply::rate_limited(1),
        vec![Reply::text(["a summary"]), Reply::text(["another summary"])],
    )
    .await;
    let events = compact(&mut client, SID).await;
    assert_eq!(compacted(&events).chunks, 1, "{events:?}");
    let retried = retries(&events);
    assert_eq!(retried.len(), 1, "{events:?}");
    assert_eq!(
        retried[0].delay_ms, 1000,
        "the probe's Retry-After: 1 is honoured"
    );
    assert!(retried[0].reason.contains("429"), "{}", retried[0].reason);
    let requests = fake.requests();
    assert_eq!(requests.len(), 3, "{requests:?}");
    assert_eq!(
        requests[2].body, requests[0].body,
        "the same request, again"
    );
    assert_eq!(
        next_compaction_max_tokens(&fake, &mut client).await,
        PROPS_N_CTX / 4,
        "no window learned"
    );

    // Within the retry budget (3): then the compaction fails as the probe did.
    let mut replies = Vec::new();
    for _ in 0..4 {
        replies.extend([Reply::Empty, Reply::status(503)]);
    }
    let fake = FakeLlm::start(replies).await;
    let server = server_with_llm(&fake).await;
    let mut client = server.client().await;
    seed_session(&mut client, SID).await;
    let events = compact(&mut client, SID).await;
    let f = failure(&events);
    assert_eq!((f.kind.as_str(), f.retryable), ("request", true), "{f:?}");
    assert!(f.reason.contains("503"), "{}", f.reason);
    assert_eq!(retries(&events).len(), 3, "{events:?}");
    assert_eq!(fake.request_count(), 8, "four requests, each probed");
}

/// The probe of an empty stream is sent again, as it was, only when it got no response:
/// not when its answer's body broke on the way (here cut; or past the 64 MiB compactd
/// reads of an answer), since the endpoint read it and would answer the same way. The
/// empty stream stays unexplained: the head is cut smaller, and no window is learned.
/// Before, any error without a status sent the same probe again.
#[tokio::test]
async fn a_probe_whose_answer_broke_is_not_sent_again() {
    let fake = FakeLlm::start(vec![
        Reply::Empty,
        Reply::disconnect_after(Vec::<String>::new()),
        Reply::text(["first part"]),
        Reply::text(["second part"]),
        Reply::text(["third part"]),
    ])
    .await;
    let server = server_with_llm(&fake).await;
    let mut client = server.client().await;
    seed_session(&mut client, SID).await;
    let done = compacted(&compact(&mut client, SID).await).clone();
    let requests = fake.requests();
    assert_no_repeat(&requests);
    assert_eq!(requests[1].body["stream"], false, "the probe");
    assert!(requests[2].is_stream(), "{}", requests[2].body);
    assert!(
        requests[2].prompt_chars() < requests[0].prompt_chars(),
        "cut smaller"
    );
    assert!(done.chunks >= 2, "{done:?}");
}

/// A bare HTTP/1.1 endpoint on 127.0.0.1:0 that answers the requests it reads, in order
/// over all its connections, with `answers`: a response written as it is (the connection
/// kept for the next request), or `None`: the connection closed, once the request is
/// read, with no response. Returns its base URL and the bodies it read.
async fn scripted_http(
    answers: Vec<Option<String>>,
) -> (String, std::sync::Arc<std::sync::Mutex<Vec<Value>>>) {
    use std::sync::{Arc, Mutex};
    use tokio::io::AsyncWriteExt;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind 127.0.0.1:0");
    let addr = listener.local_addr().expect("local addr");
    let bodies = Arc::new(Mutex::new(Vec::new()));
    let answers = Arc::new(Mutex::new(answers.into_iter()));
    let seen = bodies.clone();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let (answers, seen) = (answers.clone(), seen.clone());
            tokio::spawn(async move {
                while let Some(body) = read_request(&mut socket).await {
                    seen.lock().expect("lock").push(body);
                    let next = answers.lock().expect("lock").next().flatten();
                    let Some(answer) = next else { return };
                    if socket.write_all(answer.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (format!("http://{addr}/v1"), bodies)
}

/// One HTTP/1.1 request's JSON body (`Null` when not JSON); `None` once the connection ends.
async fn read_request(socket: &mut tokio::net::TcpStream) -> Option<Value> {
    use tokio::io::AsyncReadExt;
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    let head_end = loop {
        if let Some(at) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break at + 4;
        }
        let n = socket.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
    let length: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    while buf.len() < head_end + length {
        let n = socket.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    Some(serde_json::from_slice(&buf[head_end..head_end + length]).unwrap_or(Value::Null))
}

/// An HTTP/1.1 200 response of `kind` with `body`.
fn http_ok(kind: &str, body: &str) -> String {
    format!(
        "HTTP/1.1 200 OK\r\ncontent-type: {kind}\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
}

/// The probe is still sent again when its connection closed before any response: the
/// connection an empty answer came on, closed by the server (llama-cpp-python) after
/// the client took it back for the next request.
#[tokio::test]
async fn a_probe_whose_connection_closed_before_an_answer_is_sent_again() {
    use compactd::summarize::{OpenAiSummarizer, Summarizer, SummaryRequest};
    let answered = json!({
        "id": "p", "object": "chat.completion", "created": 0, "model": "fake-model",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "x"}, "finish_reason": "stop"}],
    });
    let (base_url, bodies) = scripted_http(vec![
        Some(http_ok("text/event-stream", "")),
        None,
        Some(http_ok("application/json", &answered.to_string())),
    ])
    .await;
    let mut config = compactd::summarize::LlmConfig::new(base_url, "fake-model");
    config.retry_base = std::time::Duration::from_millis(5);
    config.timeout = std::time::Duration::from_secs(20);
    let summarizer = OpenAiSummarizer::new(config);
    let (tx, _rx) = tokio::sync::mpsc::channel(64);
    let request = SummaryRequest {
        messages: vec![json!({"role": "user", "content": "summarize this"})],
        model: None,
        max_tokens: Some(1_000),
        counted_tokens: Some(10),
    };
    // No window is known: the answered probe says the prompt fits without the answer's
    // room, so the request is "too long" (the chunker cuts it smaller).
    let outcome = summarizer
        .summarize(request, tx, tokio_util::sync::CancellationToken::new())
        .await;
    assert!(
        matches!(
            outcome,
            Err(compactd::summarize::SummarizeError::TooLong(_))
        ),
        "{outcome:?}"
    );
    let bodies = bodies.lock().expect("lock").clone();
    assert_eq!(bodies.len(), 3, "{bodies:?}");
    assert_eq!(bodies[1]["stream"], false, "the probe");
    assert_eq!(bodies[2], bodies[1], "sent again, as it was");
}

#[tokio::test]
async fn the_configured_window_wins_over_what_the_endpoint_says() {
    let window = spec(100, Overflow::Refuse);
    let fake = FakeLlm::start(vec![Reply::Window(window)]).await;
    fake.serve_props(json!({"default_generation_settings": {"n_ctx": 32_768}}));
    let server = server_with(&fake, |c| c.context_tokens = Some(N_CTX)).await;
    let mut client = server.client().await;
    let chunks = compact_long(&mut client, SID).await;

    let requests = fake.requests();
    assert!(chunks >= 2, "chunked for the configured window");
    assert_eq!(chunks as usize, requests.len(), "no request was refused");
    assert!(requests.iter().all(|r| r.body["max_tokens"] == N_CTX / 4));
    assert!(
        fake.discovery_requests().is_empty(),
        "nothing to ask when the operator said"
    );
}

/// Asks `summarizer` directly (no session) for a summary of one short message, with
/// `max_tokens` 32,000 and counted at `counted` tokens, which the fake refuses; returns the
/// chat requests the fake received.
async fn refused_request(
    summarizer: &compactd::summarize::OpenAiSummarizer,
    fake: &FakeLlm,
    model: Option<&str>,
    counted: u64,
) -> Vec<RecordedRequest> {
    use compactd::summarize::{Summarizer, SummaryRequest};
    let (tx, _rx) = tokio::sync::mpsc::channel(64);
    let request = SummaryRequest {
        messages: vec![json!({"role": "user", "content": "summarize this"})],
        model: model.map(str::to_string),
        max_tokens: Some(32_000),
        counted_tokens: Some(counted),
    };
    let result = summarizer
        .summarize(request, tx, tokio_util::sync::CancellationToken::new())
        .await;
    assert!(result.is_err(), "{result:?}");
    fake.requests()
        .into_iter()
        .filter(|r| r.path.ends_with("/chat/completions"))
        .collect()
}

/// Past the models `Windows` keeps (`MAX_KNOWN`), a refusal of `max_tokens` teaches
/// nothing that is kept: the request is not sent again as it was. Before, it was (the
/// same body, refused the same way).
#[tokio::test]
async fn a_refused_max_tokens_is_not_sent_again_when_nothing_could_be_kept() {
    use compactd::summarize::{OpenAiSummarizer, Summarizer, window};
    let fake = FakeLlm::start(vec![
        max_tokens_refused(OUTPUT_CAP_16K),
        Reply::text(["the summary"]),
    ])
    .await;
    let summarizer = OpenAiSummarizer::new(llm_config(&fake));
    // Every model the map keeps is taken (each told its window, or that there is none).
    for i in 0..window::MAX_KNOWN {
        summarizer.window(Some(&format!("m{i}"))).await;
    }
    let chats = refused_request(&summarizer, &fake, Some("one-more"), 10).await;
    assert_eq!(chats.len(), 1, "not sent again as it was");
}

/// Answers paid for and dropped count in what a compaction reports it cost: one stopped
/// by a content filter (its usage told), and the one-token probe of an empty stream (it
/// read the whole prompt). Before, only the answers whose summary was kept counted.
#[tokio::test]
async fn dropped_answers_and_the_probe_count_in_the_reported_usage() {
    let filtered = Reply::Stream {
        chunks: vec![],
        usage: Some((700, 2)),
        delay_per_chunk: std::time::Duration::ZERO,
        finish_reason: Some("content_filter".into()),
    };
    let fake = FakeLlm::start(vec![filtered]).await;
    let server = server_with_llm(&fake).await;
    let mut client = server.client().await;
    seed_session(&mut client, SID).await;
    let f = failure(&compact(&mut client, SID).await).clone();
    assert!(f.reason.contains("content filter"), "{f:?}");
    let usage = f.usage.expect("the filtered answer's usage");
    assert_eq!((usage.input, usage.output), (700, 2));

    // An empty stream, its probe answered (the prompt fits, 900 tokens read), then the
    // head cut smaller and summarized.
    let fake = FakeLlm::start(vec![
        Reply::Empty,
        Reply::text(["x"]).with_usage(Some((900, 1))),
        Reply::text(["a", "summary"]),
        Reply::text(["the", "whole", "summary"]),
    ])
    .await;
    let server = server_with_llm(&fake).await;
    let mut client = server.client().await;
    seed_session(&mut client, SID).await;
    let done = compacted(&compact(&mut client, SID).await).clone();
    let requests = fake.requests();
    assert_eq!(requests[1].body["stream"], false, "the probe");
    // The probe, then each chunk's answer: usage (10, its chunk count).
    let chunks = requests.len() - 2;
    assert_eq!(done.chunks as usize, chunks);
    let outputs: u64 = [2u64, 3].iter().take(chunks).sum();
    let usage = done.usage.expect("usage");
    assert_eq!(
        (usage.input, usage.output),
        (900 + 10 * chunks as u64, 1 + outputs),
        "{usage:?}"
    );
}

/// A refusal for length without numbers teaches a window below what was sent: the
/// prompt and the answer's room the body asked for, within the output cap a refusal of
/// `max_tokens` taught. Before, the room the chunker wanted (32,000, not the 16,384 sent)
/// was counted, so the window learned sat above anything sent and nothing was learned.
#[tokio::test]
async fn a_bare_refusal_learns_from_the_max_tokens_sent() {
    use compactd::summarize::{OpenAiSummarizer, Summarizer};
    let fake = FakeLlm::start(vec![
        max_tokens_refused(OUTPUT_CAP_16K),
        refused_without_numbers(),
    ])
    .await;
    let summarizer = OpenAiSummarizer::new(llm_config(&fake));
    let chats = refused_request(&summarizer, &fake, None, 5_000).await;
    assert_eq!(chats[1].body["max_tokens"], 16_384, "asked within the cap");
    let window = summarizer.window(None).await.expect("a window learned");
    assert_eq!(window.tokens, 5_000 + 16_384 - 1);
}
