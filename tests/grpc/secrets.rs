//! The API key never appears in logs, events, errors, `GetSession` or `--help`: the real
//! binary runs with the key in its environment and verbose logging, against an endpoint
//! that echoes the key back in its error (as some providers do).

use std::process::Command;

use compactd::server::pb;
use compactd::server::pb::compaction_event::Event as Ce;
use tokio_stream::StreamExt;

use crate::common::binary::Binary;
use crate::common::fake_llm::{FakeLlm, Reply, error_body};
use crate::common::*;

const KEY: &str = "sk-live-DO-NOT-LEAK-4f1c9a7e";

#[tokio::test]
async fn the_api_key_stays_out_of_logs_events_errors_and_help() {
    let echo = error_body(
        &format!("Incorrect API key provided: {KEY}"),
        "invalid_request_error",
        None,
        Some("invalid_api_key"),
    );
    let fake = FakeLlm::start(vec![Reply::Status {
        code: 401,
        body: echo,
        retry_after: None,
    }])
    .await;

    let bin = Binary::start(
        &[],
        &[
            ("COMPACTD_LOG", "debug"),
            ("COMPACTD_LLM_BASE_URL", &fake.base_url()),
            ("COMPACTD_LLM_MODEL", "fake-model"),
            ("COMPACTD_LLM_API_KEY", KEY),
        ],
    );
    let addr = bin.addr.clone();

    let mut client = pb::sessions_client::SessionsClient::connect(format!("http://{addr}"))
        .await
        .expect("connect");
    open_session(&mut client, session_with_limits("k", 100_000, 20_000)).await;
    for (u, a) in [("u1", "a1"), ("u2", "a2"), ("u3", "a3")] {
        put_message(&mut client, "k", user_msg(u)).await;
        put_part(
            &mut client,
            "k",
            text_part(u, &format!("{u}t"), "some work"),
        )
        .await;
        put_message(&mut client, "k", finished(assistant_msg(a, u))).await;
        put_part(
            &mut client,
            "k",
            tool_part(a, &format!("{a}r"), "read", &output_of(a, 3_000)),
        )
        .await;
    }
    let mut stream = client
        .compact(pb::CompactRequest {
            session_id: "k".into(),
            options: None,
        })
        .await
        .expect("compact")
        .into_inner();
    let mut events = Vec::new();
    while let Some(e) = stream.next().await {
        events.push(e.expect("event"));
    }
    let Some(Ce::Failed(f)) = &events.last().and_then(|e| e.event.clone()) else {
        panic!("{events:?}")
    };
    assert!(
        f.reason.contains("Incorrect API key provided: [redacted]"),
        "{}",
        f.reason
    );
    assert_eq!(
        fake.last_request().header("authorization"),
        Some(format!("Bearer {KEY}").as_str())
    );
    let session = get_session(&mut client, "k").await;

    let log = bin.finish();
    assert!(
        log.contains("compaction failed"),
        "the failure was logged: {log}"
    );
    for (what, text) in [
        ("logs", log),
        ("events", format!("{events:?}")),
        ("GetSession", format!("{session:?}")),
    ] {
        assert!(!text.contains(KEY), "the key leaked into {what}");
    }

    let help = Command::new(env!("CARGO_BIN_EXE_compactd"))
        .args(["serve", "--help"])
        .env("COMPACTD_LLM_API_KEY", KEY)
        .output()
        .expect("help");
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(help.contains("--llm-base-url"), "{help}");
    assert!(!help.contains(KEY), "the key leaked into --help");
}
