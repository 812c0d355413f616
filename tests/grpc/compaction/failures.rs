//! Failures of the summary request: server errors and rate limits retried, retries
//! exhausted, a stream cut after tokens, timeouts before and during the stream, broken,
//! malformed, oversized or empty summaries; none of them changes the session.

use std::time::Duration;

use compactd::server::pb;
use compactd::server::pb::compaction_event::Event as Ce;

use crate::common::compaction::*;
use crate::common::fake_llm::{FakeLlm, Reply};
use crate::common::*;

#[tokio::test]
async fn a_server_error_before_the_first_token_is_retried() {
    let retries = retried_then_compacted(vec![Reply::status(500)]).await;
    assert_eq!(retries[0].attempt, 2);
    assert!(retries[0].reason.contains("500"), "{}", retries[0].reason);
}

#[tokio::test]
async fn a_rate_limit_waits_as_long_as_retry_after_asks() {
    // The test server retries after 5 ms on its own; the 429 asks for a full second.
    let retries = retried_then_compacted(vec![Reply::rate_limited(1)]).await;
    assert_eq!(retries[0].delay_ms, 1000, "Retry-After: 1 is honoured");
    assert!(retries[0].reason.contains("429"), "{}", retries[0].reason);
}
#[tokio::test]
async fn a_server_error_that_keeps_coming_exhausts_the_retries_and_changes_nothing() {
    const MAX_RETRIES: u32 = 2;
    let fake = FakeLlm::start(vec![Reply::status(500)]).await;
    let server = server_with(&fake, |c| c.max_retries = MAX_RETRIES).await;
    let mut client = server.client().await;
    seed_session(&mut client, SID).await;
    let before = get_session(&mut client, SID).await;

    let events = compact(&mut client, SID).await;
    assert_eq!(
        names(&events),
        ["started", "retrying", "retrying", "failed"]
    );
    let attempts: Vec<u32> = events
        .iter()
        .filter_map(|e| match &e.event {
            Some(Ce::Retrying(r)) => Some(r.attempt),
            _ => None,
        })
        .collect();
    assert_eq!(attempts, [2, 3]);
    let f = failure(&events);
    assert_eq!((f.kind.as_str(), f.retryable), ("request", true), "{f:?}");
    assert!(f.reason.contains("500"), "{}", f.reason);
    assert!(!f.auto_compaction_paused, "a manual failure pauses nothing");
    assert_eq!(fake.request_count(), 1 + MAX_RETRIES as usize);
    assert_unchanged(&before, &get_session(&mut client, SID).await, "500s");
}

#[tokio::test]
async fn a_stream_cut_after_tokens_is_not_retried_and_changes_nothing() {
    // Were it retried, the second reply would succeed and commit.
    let fake = FakeLlm::start(vec![
        Reply::disconnect_after(["partial ", "summary"]),
        Reply::text(["a retry must not happen"]),
    ])
    .await;
    let server = server_with_llm(&fake).await;
    let mut client = server.client().await;
    seed_session(&mut client, SID).await;
    let before = get_session(&mut client, SID).await;

    let events = compact(&mut client, SID).await;
    assert_eq!(names(&events), ["started", "delta", "delta", "failed"]);
    assert_eq!(deltas(&events), "partial summary");
    let f = failure(&events);
    assert_eq!(f.kind, "broken_stream", "{f:?}");
    assert_eq!(fake.request_count(), 1, "no retry once tokens arrived");
    assert_unchanged(&before, &get_session(&mut client, SID).await, "cut");
}

#[tokio::test]
async fn a_timeout_while_tokens_are_streaming_fails_and_changes_nothing() {
    // A token every second, twenty of them; the whole summary may take 5 s: the first
    // token comes 4 s before the deadline and the last would come 15 s after it, so a
    // loaded machine sees both some tokens and the cut (with 250 ms and 600 ms, a slow
    // start could leave no token before the deadline).
    let chunks: Vec<String> = (0..20).map(|i| format!("t{i} ")).collect();
    let fake = FakeLlm::start(vec![Reply::slow(chunks, Duration::from_secs(1))]).await;
    let server = server_with(&fake, |c| c.timeout = Duration::from_secs(5)).await;
    let mut client = server.client().await;
    seed_session(&mut client, SID).await;
    let before = get_session(&mut client, SID).await;

    let events = compact(&mut client, SID).await;
    let n = names(&events);
    assert_eq!(n.first(), Some(&"started"));
    assert!(
        n.contains(&"delta"),
        "some tokens streamed before the deadline: {n:?}"
    );
    assert!(n.len() < 20, "the deadline cut the stream short: {n:?}");
    let f = failure(&events);
    assert_eq!((f.kind.as_str(), f.retryable), ("timeout", true), "{f:?}");
    assert_eq!(fake.request_count(), 1, "a timeout is not retried");
    assert_unchanged(&before, &get_session(&mut client, SID).await, "timeout");
    fake.wait_for_cancelled(1).await; // the HTTP request was dropped, not left running
}

#[tokio::test]
async fn a_summary_slower_than_the_timeout_fails_and_changes_nothing() {
    let fake = FakeLlm::start(vec![Reply::Hang]).await;
    let server = server_with(&fake, |c| c.timeout = Duration::from_millis(300)).await;
    let mut client = server.client().await;
    seed_session_with_cleared_output(&mut client, SID).await;
    let before = get_session(&mut client, SID).await;
    let events = compact(&mut client, SID).await;
    let f = failure(&events);
    assert_eq!((f.kind.as_str(), f.retryable), ("timeout", true), "{f:?}");
    assert_eq!(get_session(&mut client, SID).await, before);
}

#[tokio::test]
async fn broken_malformed_or_oversized_summaries_change_nothing() {
    let big = output_of("summary", 40_000);
    for (reply, kind) in [
        (
            Reply::disconnect_after(["partial ", "summary"]),
            "broken_stream",
        ),
        (Reply::Malformed, "malformed"),
        (Reply::text([big.as_str()]), "not_smaller"),
        (Reply::text(["   "]), "empty_summary"),
    ] {
        let fake = FakeLlm::start(vec![reply]).await;
        let server = server_with_llm(&fake).await;
        let mut client = server.client().await;
        seed_session_with_cleared_output(&mut client, SID).await;
        let before = get_session(&mut client, SID).await;
        let events = compact(&mut client, SID).await;
        let f = failure(&events);
        assert_eq!(f.kind, kind, "{f:?}");
        assert!(!f.reason.contains(SECRET));
        assert_eq!(
            get_session(&mut client, SID).await,
            before,
            "{kind}: the session is unchanged"
        );
    }
}

/// Runs one manual compaction whose first request is answered `first` (a second
/// answer, which would commit, is there to catch a retry): it must fail after that one
/// request and leave the session as it was. Returns the failure.
async fn fails_after_one_request(first: Reply, what: &str) -> pb::CompactionFailed {
    let fake = FakeLlm::start(vec![first, Reply::text(["a retry must not happen"])]).await;
    let server = server_with_llm(&fake).await;
    let mut client = server.client().await;
    seed_session(&mut client, SID).await;
    let before = get_session(&mut client, SID).await;
    let events = compact(&mut client, SID).await;
    let f = failure(&events).clone();
    assert_eq!(fake.request_count(), 1, "{what}: not asked again");
    assert_unchanged(&before, &get_session(&mut client, SID).await, what);
    f
}

/// A stream the endpoint stops for its own reason (OpenRouter's `error`, vLLM's `abort`)
/// after text arrived is a broken stream, not a summary: before, the cut text was
/// committed over the head.
#[tokio::test]
async fn a_stream_stopped_with_finish_reason_error_commits_nothing() {
    let cut = Reply::text(["## Objective\n", "half a sum"]).with_finish_reason(Some("error"));
    let f = fails_after_one_request(cut, "error").await;
    assert_eq!(f.kind, "broken_stream", "{f:?}");
    assert!(f.reason.contains("error"), "{}", f.reason);
}

/// A summary the endpoint's content filter stopped is cut short: it fails, and is not
/// asked for again (the same head would be filtered again).
#[tokio::test]
async fn a_summary_stopped_by_the_content_filter_commits_nothing() {
    let cut =
        Reply::text(["## Objective\n", "half a sum"]).with_finish_reason(Some("content_filter"));
    let f = fails_after_one_request(cut, "filter").await;
    assert!(!f.retryable, "{f:?}");
    assert!(f.reason.contains("content filter"), "{}", f.reason);
}

/// A stream that fails with an error chunk before any text is a failed request, retried,
/// with the endpoint's words: before, it read as a malformed stream and was not retried.
#[tokio::test]
async fn an_error_chunk_before_the_first_token_is_retried() {
    let retries = retried_then_compacted(vec![Reply::ErrorChunk {
        chunks: vec![],
        message: "engine overloaded".into(),
    }])
    .await;
    assert!(
        retries[0].reason.contains("engine overloaded"),
        "{}",
        retries[0].reason
    );
}

/// An error chunk after text arrived: a broken stream, with the endpoint's words.
#[tokio::test]
async fn an_error_chunk_after_tokens_is_a_broken_stream() {
    let cut = Reply::ErrorChunk {
        chunks: vec!["partial ".into()],
        message: "upstream provider failed".into(),
    };
    let f = fails_after_one_request(cut, "error chunk").await;
    assert_eq!(f.kind, "broken_stream", "{f:?}");
    assert!(
        f.reason.contains("upstream provider failed"),
        "{}",
        f.reason
    );
}
