//! Endpoint answers compactd must read right or bound: a refusal for length sent as a
//! server error (llama.cpp's 500) takes the "too long" path, never a retry of the same
//! request; an error body of any size is read only so far and its message cut before it
//! reaches events.

use std::time::Duration;

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

/// llama.cpp's answer to a prompt longer than its context in some builds
/// (ggml-org/llama.cpp#19774).
const LLAMA_CPP_CONTEXT_500: &str =
    r#"{"error":{"code":500,"message":"Context size has been exceeded.","type":"server_error"}}"#;

#[tokio::test]
async fn a_server_error_saying_the_context_was_exceeded_cuts_the_head_smaller_at_once() {
    let fake = FakeLlm::start(vec![
        Reply::Status {
            code: 500,
            body: LLAMA_CPP_CONTEXT_500.to_string(),
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
        "a refusal for length is not retried as it was: {events:?}"
    );
    let requests = fake.requests();
    let whole = requests[0].prompt_chars();
    assert!(
        requests[1].prompt_chars() < whole * 2 / 3,
        "cut smaller at once: {} of {whole}",
        requests[1].prompt_chars()
    );
    assert!(done.chunks >= 2, "{done:?}");
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
