//! Endpoint answers compactd must read right or bound: a refusal for length sent as a
//! server error (llama.cpp's 500) takes the "too long" path, never a retry of the same
//! request.

use compactd::server::pb::compaction_event::Event as Ce;

use crate::common::compaction::*;
use crate::common::fake_llm::{FakeLlm, Reply};

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
