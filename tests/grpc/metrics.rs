//! `/metrics` of the real binary (its own process, so every counter starts at zero):
//! scraped over HTTP before and after updates, a strategy run, an overflow, a rejected
//! request and a compaction.

use compactd::server::pb;
use tokio_stream::StreamExt;

use crate::common::binary::Binary;
use crate::common::fake_llm::{FakeLlm, Reply};
use crate::common::metrics::{metric, scrape};
use crate::common::*;

const SID: &str = "m";

fn call(message: &str, id: &str, tool: &str, input: serde_json::Value) -> pb::Part {
    let mut p = tool_part(message, id, tool, &output_of(id, 8_000));
    if let Some(pb::part::Kind::Tool(t)) = &mut p.kind {
        t.state.as_mut().expect("state").input = Some(json_to_struct(&input));
    }
    p
}

#[tokio::test]
async fn counters_move_as_updates_prunes_overflows_rejections_and_compactions_happen() {
    let fake = FakeLlm::start(vec![Reply::text(["short summary"])]).await;
    let mut bin = Binary::start(
        &[
            "--metrics-listen",
            "127.0.0.1:0",
            "--cache-model",
            "none",
            "--strategy-preset",
            "compact",
            // The figures below are reasoned in chars ÷ 4.
            "--tokenizer",
            "chars4",
        ],
        &[
            ("COMPACTD_LLM_BASE_URL", &fake.base_url()),
            ("COMPACTD_LLM_MODEL", "fake-model"),
        ],
    );
    let (grpc, metrics) = (
        bin.addr.clone(),
        bin.metrics.clone().expect("metrics address"),
    );
    let before = scrape(&metrics).await;
    assert_eq!(metric(&before, "compactd_sessions"), 0.0);
    assert_eq!(metric(&before, "compactd_bytes_held"), 0.0, "{before}");

    let mut c = pb::sessions_client::SessionsClient::connect(format!("http://{grpc}"))
        .await
        .expect("connect");
    open_session(&mut c, session_with_limits(SID, 100_000, 20_000)).await;
    let file = serde_json::json!({"filePath": "src/lib.rs"});
    for (u, a) in [("u1", "a1"), ("u2", "a2"), ("u3", "a3")] {
        put_message(&mut c, SID, user_msg(u)).await;
        put_part(&mut c, SID, text_part(u, &format!("{u}-t"), "again")).await;
        put_message(&mut c, SID, assistant_msg(a, u)).await;
        put_part(
            &mut c,
            SID,
            call(a, &format!("{a}-r"), "read", file.clone()),
        )
        .await;
        put_message(&mut c, SID, finished(assistant_msg(a, u))).await;
    }
    // Usage over the threshold (0.92 × 80,000): one overflow detection.
    let mut last = finished(assistant_msg("a3", "u3"));
    last.tokens = Some(usage(75_000));
    put_message(&mut c, SID, last).await;
    // An update the engine refuses: a part of a message the session never got.
    let orphan = c
        .upsert_part(pb::UpsertPartRequest {
            session_id: SID.into(),
            part: Some(text_part("ghost", "ghost-t", "no message")),
        })
        .await
        .expect_err("a part of an unknown message");
    assert_eq!(orphan.code(), tonic::Code::FailedPrecondition, "{orphan:?}");
    // A rejected request.
    let missing = c
        .get_context(pb::GetContextRequest {
            session_id: "nope".into(),
            ..Default::default()
        })
        .await
        .expect_err("no such session");
    assert_eq!(missing.code(), tonic::Code::NotFound);
    // A manual compaction.
    let mut stream = c
        .compact(pb::CompactRequest {
            session_id: SID.into(),
            options: None,
        })
        .await
        .expect("compact")
        .into_inner();
    while stream.next().await.is_some() {}
    // The context, which the session then keeps rendered.
    c.get_context(pb::GetContextRequest {
        session_id: SID.into(),
        format: pb::ContextFormat::OpenaiJson.into(),
    })
    .await
    .expect("context");

    let after = scrape(&metrics).await;
    assert_eq!(metric(&after, "compactd_sessions"), 1.0, "{after}");
    // Three 8 kB outputs and the rest of the session are held; the budget is the
    // default 2 GiB.
    let held = metric(&after, "compactd_bytes_held");
    assert!((24_000.0..1_000_000.0).contains(&held), "{after}");
    assert_eq!(
        metric(&after, "compactd_memory_budget_bytes"),
        2_147_483_648.0,
        "{after}"
    );
    // Of what is held, the rendered context: about the context's text.
    let cached = metric(&after, "compactd_bytes_cached");
    assert!(cached > 8_000.0 && cached < held, "{after}");
    // Every update was answered: nothing is left in flight.
    assert_eq!(metric(&after, "compactd_bytes_in_flight"), 0.0, "{after}");
    assert_eq!(
        metric(
            &after,
            "compactd_updates_total{kind=\"upsert_message\",result=\"ok\"}"
        ),
        10.0,
        "{after}"
    );
    // Refused updates are counted apart (the refused part is timed too).
    assert_eq!(
        metric(
            &after,
            "compactd_updates_total{kind=\"upsert_part\",result=\"rejected\"}"
        ),
        1.0,
        "{after}"
    );
    assert_eq!(
        metric(
            &after,
            "compactd_update_duration_seconds_count{kind=\"upsert_part\"}"
        ),
        7.0,
        "{after}"
    );
    assert_eq!(
        metric(
            &after,
            "compactd_overflow_detections_total{crossed=\"used\"}"
        ),
        1.0,
        "{after}"
    );
    // The reads of one file: each newer read supersedes the older.
    assert_eq!(
        metric(&after, "compactd_prune_runs_total{trigger=\"auto\"}"),
        2.0,
        "{after}"
    );
    assert!(
        metric(
            &after,
            "compactd_tokens_saved_total{layer=\"aggressiveFilePrune\"}"
        ) > 3_000.0,
        "{after}"
    );
    assert_eq!(
        metric(
            &after,
            "compactd_rejected_requests_total{code=\"NOT_FOUND\"}"
        ),
        1.0,
        "{after}"
    );
    assert_eq!(
        metric(
            &after,
            "compactd_compactions_total{outcome=\"compacted\",auto=\"false\"}"
        ),
        1.0,
        "{after}"
    );
    assert_eq!(
        metric(
            &after,
            "compactd_compaction_duration_seconds_count{outcome=\"compacted\"}"
        ),
        1.0,
        "{after}"
    );
    assert!(
        metric(
            &after,
            "compactd_compaction_llm_tokens_total{direction=\"input\"}"
        ) > 0.0,
        "{after}"
    );
    assert!(after.contains("# HELP compactd_updates_total"));

    bin.sigterm();
    assert!(bin.wait_exit().await.success());
}

/// A `Subscribe` watcher whose client hangs up ends at once, even when no event of its
/// session ever comes: before, its task and its place on the event bus stayed until one
/// did, so a client subscribing to a quiet session and hanging up in a loop grew both
/// without bound.
#[tokio::test]
async fn a_watcher_that_hung_up_ends_without_waiting_for_an_event() {
    let bin = Binary::start(&["--metrics-listen", "127.0.0.1:0"], &[]);
    let metrics = bin.metrics.clone().expect("metrics address");
    let mut c = pb::sessions_client::SessionsClient::connect(format!("http://{}", bin.addr))
        .await
        .expect("connect");
    open_session(&mut c, session_with_limits("quiet", 100_000, 20_000)).await;
    open_session(&mut c, session_with_limits("busy", 100_000, 20_000)).await;
    let watchers = || async { metric(&scrape(&metrics).await, "compactd_watchers") };

    let watcher = subscribe(&mut c, "quiet").await;
    assert_eq!(
        watchers().await,
        1.0,
        "the watcher is counted while it lives"
    );
    drop(watcher);
    // Events of another session keep coming; the quiet session's never do.
    put_message(&mut c, "busy", user_msg("u1")).await;
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    while watchers().await != 0.0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the watcher of a hung-up client still runs after 10 s"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}
