//! What the summarizer makes of an endpoint's refusals and cut answers, over a real
//! loopback connection: which are "too long" (cut smaller at once), which are retried, and
//! what each teaches of the window.

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::summarize::fake_endpoint::{
    Endpoint, config, json_response, request, sse, summary_body,
};
use crate::summarize::window::WindowSource;
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
