//! Endpoint answers compactd must read right or bound: a refusal for length sent as a
//! server error (llama.cpp's 500) takes the "too long" path, never a retry of the same
//! request; an error body of any size is read only so far and its message cut before it
//! reaches events; a summary that does not end, or an SSE line that does not, is read
//! only so far and fails its request.

use std::time::Duration;

use compactd::server::pb;
use compactd::server::pb::compaction_event::Event as Ce;

use crate::common::compaction::*;
use crate::common::fake_llm::{FakeLlm, Flood, Reply};
use crate::common::*;

/// The most a failure or retry reason may carry: compactd's 4 KiB of the endpoint's text
/// plus its own words around it.
const MAX_REASON_BYTES: usize = 4 * 1024 + 256;

/// Waits until `n` flood bodies ended (the client hung up, or the flood ran to its limit);
/// a guard, not a speed assertion, so a client that never hangs up fails the test.
async fn flood_ended(fake: &FakeLlm, n: usize) -> crate::common::fake_llm::Counters {
    tokio::time::timeout(
        Duration::from_secs(20),
        fake.wait_until(|c| c.cancelled + c.completed >= n),
    )
    .await
    .expect("the flood bodies ended within 20 s")
}

/// Runs `Compact` to its end, keeping each event but the deltas' text, whose bytes are
/// counted instead: a flood of deltas would otherwise be held whole.
async fn compact_counting(client: &mut Client, sid: &str) -> (Vec<pb::CompactionEvent>, usize) {
    let request = pb::CompactRequest {
        session_id: sid.into(),
        options: Some(pb::CompactOptions::default()),
    };
    let mut stream = client
        .compact(request)
        .await
        .expect("Compact runs")
        .into_inner();
    let (mut events, mut delta_bytes) = (Vec::new(), 0);
    while let Some(mut e) = stream.message().await.expect("the event stream runs") {
        if let Some(Ce::Delta(d)) = &mut e.event {
            delta_bytes += d.text.len();
            d.text.clear();
        }
        events.push(e);
    }
    (events, delta_bytes)
}

/// llama.cpp's answer to a prompt longer than its context in some builds
/// (ggml-org/llama.cpp#19774).
const LLAMA_CPP_CONTEXT_500: &str =
    r#"{"error":{"code":500,"message":"Context size has been exceeded.","type":"server_error"}}"#;

/// Compacts a long session whose first request is refused with `code` and `body`: the
/// refusal must be read as "too long", so the head is cut smaller at once (never the same
/// request retried) and compacts in chunks.
async fn cut_smaller_at_once(code: u16, body: &str) {
    let fake = FakeLlm::start(vec![
        Reply::Status {
            code,
            body: body.to_string(),
            retry_after: None,
        },
        Reply::text(["first part"]),
        Reply::text(["second part"]),
    ])
    .await;
    let server = server_with_llm(&fake).await;
    let mut client = server.client().await;
    seed_long_session(&mut client, SID).await;
    let events = compact(&mut client, SID).await;

    let done = compacted(&events);
    assert!(
        !events
            .iter()
            .any(|e| matches!(e.event, Some(Ce::Retrying(_)))),
        "{code}: a refusal for length is not retried as it was: {events:?}"
    );
    let requests = fake.requests();
    let whole = requests[0].prompt_chars();
    assert!(
        requests[1].prompt_chars() < whole * 2 / 3,
        "{code}: cut smaller at once: {} of {whole}",
        requests[1].prompt_chars()
    );
    assert!(done.chunks >= 2, "{code}: {done:?}");
}

#[tokio::test]
async fn a_server_error_saying_the_context_was_exceeded_cuts_the_head_smaller_at_once() {
    cut_smaller_at_once(500, LLAMA_CPP_CONTEXT_500).await;
}

#[tokio::test]
async fn a_huge_error_body_is_read_only_so_far_and_its_message_cut() {
    // A proxy's 502 whose body goes on for 32 MiB.
    const LIMIT: usize = 32 * 1024 * 1024;
    let fake = FakeLlm::start(vec![Reply::Flood {
        kind: Flood::Status(502),
        limit: LIMIT,
    }])
    .await;
    let server = server_with(&fake, |c| c.max_retries = 1).await;
    let mut client = server.client().await;
    seed_session(&mut client, SID).await;
    let before = get_session(&mut client, SID).await;
    let events = compact(&mut client, SID).await;

    assert_eq!(names(&events), ["started", "retrying", "failed"]);
    let Some(Ce::Retrying(r)) = &events[1].event else {
        unreachable!()
    };
    let f = failure(&events);
    for reason in [&r.reason, &f.reason] {
        assert!(reason.len() <= MAX_REASON_BYTES, "{} bytes", reason.len());
        assert!(
            reason.contains("502: [the error body is over 65536 bytes"),
            "{reason}"
        );
        assert!(reason.contains("upstream failed: xxx"), "{reason}");
    }
    assert_eq!((f.kind.as_str(), f.retryable), ("request", true), "{f:?}");
    assert_unchanged(&before, &get_session(&mut client, SID).await, "502");

    // Both bodies were abandoned long before their end: the rest was never read.
    let counters = flood_ended(&fake, 2).await;
    assert_eq!(counters.cancelled, 2, "{counters:?}");
    assert!(counters.flood_bytes < LIMIT, "{counters:?}");
}

/// Floods `kind` at a compaction of a fresh session on a server tuned by `tune`; returns
/// the events (deltas counted, not kept), the bytes of summary text streamed, and the
/// fake's counters once the flood ended. The session is checked unchanged.
async fn flooded(
    kind: Flood,
    limit: usize,
    tune: impl FnOnce(&mut compactd::summarize::LlmConfig),
) -> (
    FakeLlm,
    Vec<pb::CompactionEvent>,
    usize,
    crate::common::fake_llm::Counters,
) {
    let fake = FakeLlm::start(vec![Reply::Flood { kind, limit }]).await;
    let server = server_with(&fake, tune).await;
    let mut client = server.client().await;
    seed_session(&mut client, SID).await;
    let before = get_session(&mut client, SID).await;
    let (events, delta_bytes) = compact_counting(&mut client, SID).await;
    assert_unchanged(&before, &get_session(&mut client, SID).await, "flood");
    let counters = flood_ended(&fake, 1).await;
    (fake, events, delta_bytes, counters)
}

#[tokio::test]
async fn a_summary_past_what_max_tokens_can_hold_is_not_read_further() {
    // A window is known, so the request asks for at most a quarter of it.
    const LIMIT: usize = 64 * 1024 * 1024;
    let (fake, events, delta_bytes, counters) =
        flooded(Flood::Deltas("word ".repeat(200)), LIMIT, |c| {
            c.context_tokens = Some(8_192)
        })
        .await;

    let max_tokens = fake.last_request().body["max_tokens"]
        .as_u64()
        .expect("sized for the window");
    // 32 bytes per token asked for, never under 64 KiB.
    let cap = (max_tokens as usize * 32).max(64 * 1024);
    let f = failure(&events);
    assert_eq!((f.kind.as_str(), f.retryable), ("request", false), "{f:?}");
    assert!(
        f.reason.contains(&format!(
            "the summary exceeded {cap} bytes, more than the {max_tokens} tokens asked for can hold"
        )),
        "{}",
        f.reason
    );
    assert!(delta_bytes <= cap, "{delta_bytes} bytes streamed");
    assert_eq!(fake.request_count(), 1, "not retried");
    assert_eq!(counters.cancelled, 1, "compactd hung up: {counters:?}");
    assert!(counters.flood_bytes < LIMIT, "{counters:?}");
}

#[tokio::test]
async fn a_summary_without_max_tokens_stops_at_the_ceiling() {
    // No window known (the fake tells none): the request asks for no limit.
    const LIMIT: usize = 64 * 1024 * 1024;
    const CEILING: usize = 4 * 1024 * 1024;
    let (fake, events, delta_bytes, counters) =
        flooded(Flood::Deltas("x".repeat(16 * 1024)), LIMIT, |_| {}).await;

    assert!(fake.last_request().body.get("max_tokens").is_none());
    let f = failure(&events);
    assert_eq!((f.kind.as_str(), f.retryable), ("request", false), "{f:?}");
    assert!(
        f.reason.contains(&format!(
            "the summary exceeded {CEILING} bytes, the most compactd reads of one summary"
        )),
        "{}",
        f.reason
    );
    assert!(delta_bytes <= CEILING, "{delta_bytes} bytes streamed");
    assert_eq!(counters.cancelled, 1, "compactd hung up: {counters:?}");
    assert!(counters.flood_bytes < LIMIT, "{counters:?}");
}

#[tokio::test]
async fn an_sse_line_that_never_ends_is_not_read_further() {
    // async-openai's parser would keep the line (and scan it again on every read).
    const LIMIT: usize = 16 * 1024 * 1024;
    let (fake, events, _, counters) = flooded(Flood::Line, LIMIT, |_| {}).await;

    let f = failure(&events);
    assert_eq!((f.kind.as_str(), f.retryable), ("request", false), "{f:?}");
    assert!(
        f.reason.contains(
            "a line of the endpoint's answer exceeded 1048576 bytes; compactd stopped reading it"
        ),
        "{}",
        f.reason
    );
    assert!(
        !events
            .iter()
            .any(|e| matches!(e.event, Some(Ce::Retrying(_)))),
        "the same request would bring the same line: {events:?}"
    );
    assert_eq!(fake.request_count(), 1);
    assert_eq!(counters.cancelled, 1, "compactd hung up: {counters:?}");
    assert!(counters.flood_bytes < LIMIT, "{counters:?}");
}

/// A gateway's rate limit whose body is not an OpenAI error object (Azure APIM's JSON,
/// AWS API Gateway's, an nginx or Cloudflare page) is a rate limit: retried, after its
/// `Retry-After`. Before, the body's shape hid the status: "malformed", not retried.
#[tokio::test]
async fn a_rate_limit_in_a_gateways_words_is_retried() {
    let retries = retried_then_compacted(vec![
        Reply::Status {
            code: 429,
            body: "<html><body><h1>429 Too Many Requests</h1></body></html>".into(),
            retry_after: Some(1),
        },
        Reply::Status {
            code: 429,
            body:
                r#"{"statusCode":429,"message":"Rate limit is exceeded. Try again in 1 seconds."}"#
                    .into(),
            retry_after: None,
        },
    ])
    .await;
    assert_eq!(retries[0].delay_ms, 1000, "Retry-After: 1 is honoured");
    let first = &retries[0].reason;
    assert!(
        first.contains("429") && first.contains("Too Many Requests"),
        "{first}"
    );
    assert!(
        retries[1].reason.contains("Rate limit is exceeded"),
        "{}",
        retries[1].reason
    );
}

/// A proxy's 413 (nginx's default body limit is 1 MB) says the request is too large:
/// the head is cut smaller at once, whatever the body's words.
#[tokio::test]
async fn a_proxys_413_cuts_the_head_smaller_at_once() {
    cut_smaller_at_once(
        413,
        "<html><head><title>413 Request Entity Too Large</title></head></html>",
    )
    .await;
}

/// OpenAI's `insufficient_quota` 429 is a billing failure: not retried, and not
/// retryable (before: retried to the limit, and reported worth another try).
#[tokio::test]
async fn an_exhausted_quota_is_not_retried() {
    let fake = FakeLlm::start(vec![Reply::insufficient_quota(), Reply::text(["never"])]).await;
    let server = server_with_llm(&fake).await;
    let mut client = server.client().await;
    seed_session(&mut client, SID).await;
    let events = compact(&mut client, SID).await;
    let f = failure(&events);
    assert!(!f.retryable, "{f:?}");
    assert!(f.reason.contains("quota"), "{}", f.reason);
    assert_eq!(fake.request_count(), 1);
}

/// A caller slow to take progress does not stop the answer being read: the request reads
/// on, joining the deltas the caller has no room for, and hands them on in order once
/// there is room. Before, each delta waited for the caller, so the request read nothing
/// more while async-openai's reader went on queueing what came, parsed and unbounded: the
/// caller got one delta per piece whenever it read.
#[tokio::test]
async fn an_answer_is_read_on_while_the_caller_takes_no_progress() {
    use compactd::summarize::{OpenAiSummarizer, Progress, Summarizer, SummaryRequest};
    let pieces: Vec<String> = (0..2_000).map(|i| format!("piece {i}; ")).collect();
    let fake = FakeLlm::start(vec![Reply::text(pieces.clone())]).await;
    let summarizer = std::sync::Arc::new(OpenAiSummarizer::new(llm_config(&fake)));
    let (tx, mut rx) = tokio::sync::mpsc::channel(4);
    let request = SummaryRequest {
        messages: vec![serde_json::json!({"role": "user", "content": "summarize this"})],
        model: None,
        max_tokens: Some(100_000),
        counted_tokens: Some(10),
    };
    let asked = summarizer.clone();
    let task = tokio::spawn(async move {
        let cancel = tokio_util::sync::CancellationToken::new();
        asked.summarize(request, tx, cancel).await
    });
    // The caller takes nothing until its queue is full, and a while after.
    tokio::time::timeout(Duration::from_secs(20), async {
        while rx.len() < rx.max_capacity() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the first deltas came");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut deltas = Vec::new();
    while let Some(p) = rx.recv().await {
        if let Progress::Delta(d) = p {
            deltas.push(d);
        }
    }
    let outcome = task
        .await
        .expect("the task ran")
        .expect("the summary completed");
    assert_eq!(outcome.text, pieces.concat());
    assert_eq!(
        deltas.concat(),
        outcome.text,
        "every delta handed on, in order"
    );
    assert!(
        deltas.len() < pieces.len(),
        "what came while the caller took nothing was joined: {} deltas",
        deltas.len()
    );
}
