//! What the summarizer makes of an endpoint's refusals and cut answers, over a real
//! loopback connection: which are "too long" (cut smaller at once), which are retried, and
//! what each teaches of the window.

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::summarize::fake_endpoint::{
    Endpoint, config, json_response, request, sse, summary_body,
};
use crate::summarize::output_cap::OutputCap;
use crate::summarize::window::{SHRUNK_ANSWERS, WindowSource};
use crate::summarize::{OpenAiSummarizer, SummarizeError, Summarizer, SummaryRequest};

/// What `summarizer` makes of `request`.
async fn summarize(
    summarizer: &OpenAiSummarizer,
    request: SummaryRequest,
) -> Result<String, SummarizeError> {
    let (tx, _rx) = mpsc::channel(1024);
    summarizer
        .summarize(request, tx, CancellationToken::new())
        .await
        .map(|outcome| outcome.text)
}

/// OpenAI's 429 for a request larger than the tokens a minute allow.
const TPM_TOO_LARGE: &str = r#"{"error":{"message":"Request too large for gpt-4o in organization org-x on tokens per min (TPM): Limit 30000, Requested 36278. The input or output tokens must be reduced in order to run successfully. Visit https://platform.openai.com/account/rate-limits to learn more.","type":"tokens","param":null,"code":"rate_limit_exceeded"}}"#;

/// A request past the tokens a minute allow is refused the same way however often it is
/// sent: "too long" at once (the chunker cuts it smaller), with a guess at most the limit
/// that never stands over the operator's window. Before, it was retried as it was, and
/// failed as a rate limit once the retries ran out.
#[tokio::test]
async fn a_request_past_the_tokens_a_minute_allow_is_cut_smaller_at_once() {
    let endpoint = Endpoint::start(|_, _| json_response(429, TPM_TOO_LARGE)).await;
    let summarizer = OpenAiSummarizer::new(config(&endpoint, 3));
    let answered = summarize(&summarizer, request(32_000, Some(4_000))).await;
    assert!(
        matches!(&answered, Err(SummarizeError::TooLong(why)) if why.contains("Limit 30000, Requested 36278")),
        "{answered:?}"
    );
    assert_eq!(endpoint.received().len(), 1, "not sent again as it was");
    let learned = summarizer.windows.get(&endpoint.base_url(), "m");
    assert_eq!(
        learned.map(|w| (w.tokens, w.source)),
        Some((30_000, WindowSource::Shrunk)),
        "a guess, at most the limit"
    );

    let mut configured = config(&endpoint, 3);
    configured.context_tokens = Some(128_000);
    let summarizer = OpenAiSummarizer::new(configured);
    let answered = summarize(&summarizer, request(32_000, Some(4_000))).await;
    assert!(matches!(answered, Err(SummarizeError::TooLong(_))));
    let kept = summarizer.windows.get(&endpoint.base_url(), "m");
    assert_eq!(
        kept.map(|w| (w.tokens, w.source)),
        Some((128_000, WindowSource::Configured))
    );
}

/// A plain rate limit (per minute, of tokens or requests) lets the same request pass after
/// a wait: it stays a retry.
#[tokio::test]
async fn a_plain_rate_limit_is_still_retried() {
    for message in [
        "Rate limit reached for gpt-4o in organization org-x on tokens per min (TPM): Limit 30000, Used 29000, Requested 2000. Please try again in 2s.",
        "Rate limit reached for gpt-4o in organization org-x on requests per min (RPM): Limit 3, Used 3, Requested 1. Please try again in 20s.",
    ] {
        let body = serde_json::json!({"error": {"message": message, "type": "requests",
                                                "code": "rate_limit_exceeded"}})
        .to_string();
        let endpoint = Endpoint::start(move |n, _| match n {
            0 => json_response(429, &body),
            _ => sse(&summary_body("the summary", "stop", (10, 3))),
        })
        .await;
        let summarizer = OpenAiSummarizer::new(config(&endpoint, 3));
        let answered = summarize(&summarizer, request(32_000, Some(4_000))).await;
        assert_eq!(answered, Ok("the summary".to_string()), "{message}");
        assert_eq!(endpoint.received().len(), 2);
    }
}

/// llama.cpp's server sends its error's `code` as a number, which async-openai cannot read.
/// Before, every such error became "malformed LLM stream: invalid type: integer", losing
/// the status and the message: a 429 was not retried, a refusal of `max_tokens` not read.
/// Now each behaves as the same error with a text `code` does.
#[tokio::test]
async fn an_error_with_a_numeric_code_keeps_its_status_and_message() {
    let llama = |code: u16, message: &str, kind: &str| {
        serde_json::json!({"error": {"code": code, "message": message, "type": kind}}).to_string()
    };

    let unauthorized = llama(401, "Invalid API Key", "authentication_error");
    let endpoint = Endpoint::start(move |_, _| json_response(401, &unauthorized)).await;
    let summarizer = OpenAiSummarizer::new(config(&endpoint, 3));
    assert_eq!(
        summarize(&summarizer, request(2_000, Some(1_000))).await,
        Err(SummarizeError::Request {
            status: Some(401),
            message: "401: Invalid API Key".into(),
            retryable: false,
        })
    );

    let busy = llama(429, "too many requests", "rate_limit_error");
    let endpoint = Endpoint::start(move |n, _| match n {
        0 => json_response(429, &busy),
        _ => sse(&summary_body("the summary", "stop", (10, 3))),
    })
    .await;
    let summarizer = OpenAiSummarizer::new(config(&endpoint, 3));
    assert_eq!(
        summarize(&summarizer, request(2_000, Some(1_000))).await,
        Ok("the summary".into())
    );

    let capped = llama(
        400,
        "max_tokens must be at most 8192",
        "invalid_request_error",
    );
    let endpoint = Endpoint::start(move |n, _| match n {
        0 => json_response(400, &capped),
        _ => sse(&summary_body("the summary", "stop", (10, 3))),
    })
    .await;
    let summarizer = OpenAiSummarizer::new(config(&endpoint, 0));
    assert_eq!(
        summarize(&summarizer, request(2_000, Some(32_000))).await,
        Ok("the summary".into())
    );
    let sent: Vec<_> = endpoint
        .received()
        .iter()
        .map(|r| r.body["max_tokens"].as_u64())
        .collect();
    assert_eq!(
        sent,
        [Some(32_000), Some(8_192)],
        "sent again within the cap"
    );

    // A refusal for length in that shape still teaches the window it names.
    let refusal = r#"{"error":{"code":400,"message":"the request exceeds the available context size, try increasing it","type":"exceed_context_size_error","n_prompt_tokens":9100,"n_ctx":8192}}"#;
    let endpoint = Endpoint::start(move |_, _| json_response(400, refusal)).await;
    let summarizer = OpenAiSummarizer::new(config(&endpoint, 3));
    let answered = summarize(&summarizer, request(8_000, Some(1_000))).await;
    assert!(
        matches!(answered, Err(SummarizeError::TooLong(_))),
        "{answered:?}"
    );
    let learned = summarizer.windows.get(&endpoint.base_url(), "m");
    assert_eq!(
        learned.map(|w| (w.tokens, w.source)),
        Some((8_192, WindowSource::Refusal))
    );
    assert_eq!(endpoint.received().len(), 1);
}

/// An answer the endpoint stopped for length short of its `max_tokens`, with prompt and
/// answer far below the window the endpoint told (its `/props`), met an output cap of the
/// endpoint's own (llama-server run with `-n 1024`, a gateway's limit), not the window: it
/// stays the summary, and later requests ask within that cap. Before, it was dropped as
/// "too long" and `input + output` learned as the model's window, named, for good. Under
/// a configured window only (the whole server's, maybe, shared by `--parallel` slots),
/// the same stop is the window running out: the cut summary is not committed.
#[tokio::test]
async fn an_answer_capped_well_within_the_window_is_an_output_cap() {
    let endpoint =
        Endpoint::start(|_, _| sse(&summary_body("capped", "length", (5_000, 1_024)))).await;
    let mut configured = config(&endpoint, 0);
    configured.context_tokens = Some(32_768);
    let guessing = OpenAiSummarizer::new(configured);
    assert!(
        matches!(
            summarize(&guessing, request(5_000, Some(8_192))).await,
            Err(SummarizeError::TooLong(_))
        ),
        "a configured window does not say the stop was a cap"
    );
    let base = endpoint.base_url();
    let summarizer = OpenAiSummarizer::new(config(&endpoint, 0));
    summarizer
        .windows
        .told(&base, "m", Some((32_768, WindowSource::Props)));
    let first = endpoint.received().len();
    assert_eq!(
        summarize(&summarizer, request(5_000, Some(8_192))).await,
        Ok("capped".into())
    );
    let kept = summarizer.windows.get(&base, "m");
    assert_eq!(
        kept.map(|w| (w.tokens, w.source)),
        Some((32_768, WindowSource::Props))
    );
    assert_eq!(
        summarizer.windows.output_cap(&base, "m"),
        Some(OutputCap::At(1_024))
    );
    assert_eq!(
        summarize(&summarizer, request(5_000, Some(8_192))).await,
        Ok("capped".into())
    );
    let asked: Vec<_> = endpoint.received()[first..]
        .iter()
        .map(|r| r.body["max_tokens"].as_u64())
        .collect();
    assert_eq!(asked, [Some(8_192), Some(1_024)]);
}

/// An answer stopped for length where prompt and answer filled the window known ran out of
/// it: "too long", and what they filled is learned as a guess that is forgotten after
/// `SHRUNK_ANSWERS` answers, and never stands over the operator's window (the stop may
/// have been an output cap after all). Before, it was learned as a window named by the
/// endpoint, kept for good and over `--llm-context-tokens`.
#[tokio::test]
async fn an_answer_that_filled_the_window_teaches_a_guess_that_expires() {
    let endpoint =
        Endpoint::start(|_, _| sse(&summary_body("cut", "length", (6_900, 1_000)))).await;
    let base = endpoint.base_url();
    let summarizer = OpenAiSummarizer::new(config(&endpoint, 0));
    summarizer
        .windows
        .told(&base, "m", Some((8_192, WindowSource::Props)));
    let answered = summarize(&summarizer, request(6_000, Some(2_048))).await;
    assert!(
        matches!(&answered, Err(SummarizeError::TooLong(why)) if why.contains("ran out at 7900 tokens")),
        "{answered:?}"
    );
    let guessed = summarizer.windows.get(&base, "m");
    assert_eq!(
        guessed.map(|w| (w.tokens, w.source)),
        Some((7_900, WindowSource::Shrunk))
    );
    for _ in 0..SHRUNK_ANSWERS {
        summarizer.windows.answered(&base, "m");
    }
    let later = summarizer.windows.get(&base, "m");
    assert_eq!(
        later.map(|w| (w.tokens, w.source)),
        Some((8_192, WindowSource::Props))
    );

    let mut configured = config(&endpoint, 0);
    configured.context_tokens = Some(8_192);
    let summarizer = OpenAiSummarizer::new(configured);
    let answered = summarize(&summarizer, request(6_000, Some(2_048))).await;
    assert!(
        matches!(answered, Err(SummarizeError::TooLong(_))),
        "{answered:?}"
    );
    let kept = summarizer.windows.get(&base, "m");
    assert_eq!(
        kept.map(|w| (w.tokens, w.source)),
        Some((8_192, WindowSource::Configured))
    );
    assert_eq!(summarizer.windows.output_cap(&base, "m"), None);
}

/// An answer stopped for length when no `max_tokens` was sent (no window known, as with
/// a hosted endpoint or llama-cpp-python until its first refusal) is a summary cut
/// mid-way by the window: "too long", so the chunker cuts the head smaller, and what
/// prompt and answer filled is learned as a guess. Before, with nothing asked to compare
/// the answer with, the cut summary was committed in place of the head (review).
#[tokio::test]
async fn an_answer_cut_for_length_with_no_max_tokens_sent_is_too_long() {
    let endpoint =
        Endpoint::start(|_, _| sse(&summary_body("cut mid-", "length", (6_900, 1_000)))).await;
    let base = endpoint.base_url();
    let summarizer = OpenAiSummarizer::new(config(&endpoint, 0));
    let answered = summarize(&summarizer, request(6_000, None)).await;
    assert!(
        matches!(&answered, Err(SummarizeError::TooLong(why))
            if why.contains("with no max_tokens sent") && why.contains("ran out at 7900 tokens")),
        "{answered:?}"
    );
    assert_eq!(
        endpoint.received()[0].body.get("max_tokens"),
        None,
        "none was sent"
    );
    let guessed = summarizer.windows.get(&base, "m");
    assert!(
        guessed.is_some_and(|w| w.source == WindowSource::Shrunk && w.tokens <= 7_900),
        "a guess no larger than what was filled: {guessed:?}"
    );
    // A window the endpoint told, far above: its own output cap, and the summary stands.
    let summarizer = OpenAiSummarizer::new(config(&endpoint, 0));
    summarizer
        .windows
        .told(&base, "m", Some((32_768, WindowSource::Props)));
    assert_eq!(
        summarize(&summarizer, request(6_000, None)).await,
        Ok("cut mid-".into())
    );
}

/// A gateway that answers HTTP 200 with an error object (an outage, a spent balance), to
/// the stream and to the one-token probe alike, said why: the compaction fails with its
/// words, and nothing of a window is learned. Before, the probe's answer counted as a
/// completion: a made-up window was learned (kept for `SHRUNK_ANSWERS` answers) and the
/// head cut smaller four times before failing as "too long" (review).
#[tokio::test]
async fn a_200_with_an_error_and_no_completion_is_the_endpoint_s_failure() {
    let endpoint = Endpoint::start(|_, _| {
        json_response(
            200,
            r#"{"error":{"message":"insufficient balance on this key"}}"#,
        )
    })
    .await;
    let base = endpoint.base_url();
    let summarizer = OpenAiSummarizer::new(config(&endpoint, 0));
    let answered = summarize(&summarizer, request(6_000, Some(2_048))).await;
    match &answered {
        Err(SummarizeError::Request { message, .. }) => {
            assert!(
                message.contains("insufficient balance on this key"),
                "{message}"
            );
        }
        other => panic!("expected the endpoint's failure, got {other:?}"),
    }
    assert_eq!(
        summarizer.windows.get(&base, "m"),
        None,
        "no window learned"
    );
    assert_eq!(
        endpoint.received().len(),
        2,
        "the stream and its probe, once each"
    );
}

/// A rate limit whose `Retry-After` would outlast the compaction's deadline fails at
/// once with the endpoint's reason, where the wait used to run into the deadline and the
/// compaction end as a timeout ("took longer than …"), the rate limit seen only in the
/// `retrying` events (review).
#[tokio::test]
async fn a_retry_wait_past_the_deadline_fails_now_with_the_endpoint_s_reason() {
    let endpoint = Endpoint::start(|_, _| {
        let body = r#"{"error":{"message":"rate limited, slow down","type":"requests"}}"#;
        format!(
            "HTTP/1.1 429 X\r\ncontent-type: application/json\r\nretry-after: 30\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        )
        .into_bytes()
    })
    .await;
    let mut configured = config(&endpoint, 3);
    configured.timeout = std::time::Duration::from_secs(10);
    let summarizer = OpenAiSummarizer::new(configured);
    let answered = summarize(&summarizer, request(1_000, Some(512))).await;
    match &answered {
        Err(SummarizeError::Request {
            status, message, ..
        }) => {
            assert_eq!(*status, Some(429));
            assert!(message.contains("rate limited, slow down"), "{message}");
            assert!(
                message.contains("30.0 s, is past the request's deadline"),
                "{message}"
            );
        }
        other => panic!("expected the rate limit, got {other:?}"),
    }
    assert_eq!(endpoint.received().len(), 1, "not sent again");
}

/// With no window known, an endpoint whose own output cap stops every answer at the same
/// length: the first cut reads as the window running out ("too long"), the second, after
/// a smaller prompt, stops at the same length, which a window would not do: an output
/// cap, learned, and that answer is the summary. Before, every compaction on such an
/// endpoint was cut smaller four times and failed. A window that runs out (the answer
/// growing as the prompt shrinks) stays "too long" (review of 8e5057b).
#[tokio::test]
async fn an_answer_stopped_twice_at_one_length_after_prompts_of_two_sizes_is_an_output_cap() {
    let capped = Endpoint::start(|n, _| {
        let prompt = 6_000 - 1_000 * n as u64;
        sse(&summary_body("capped", "length", (prompt, 1_024)))
    })
    .await;
    let base = capped.base_url();
    let summarizer = OpenAiSummarizer::new(config(&capped, 0));
    assert!(matches!(
        summarize(&summarizer, request(5_500, None)).await,
        Err(SummarizeError::TooLong(_))
    ));
    assert_eq!(
        summarize(&summarizer, request(4_600, None)).await,
        Ok("capped".into())
    );
    assert_eq!(
        summarizer.windows.output_cap(&base, "m"),
        Some(OutputCap::At(1_024))
    );

    let window = Endpoint::start(|n, _| {
        let prompt = 6_000 - 1_000 * n as u64;
        sse(&summary_body("cut", "length", (prompt, 8_192 - prompt)))
    })
    .await;
    let summarizer = OpenAiSummarizer::new(config(&window, 0));
    for counted in [5_500, 4_600] {
        let answered = summarize(&summarizer, request(counted, None)).await;
        assert!(
            matches!(answered, Err(SummarizeError::TooLong(_))),
            "{answered:?}"
        );
    }
    assert_eq!(summarizer.windows.output_cap(&window.base_url(), "m"), None);
}
