//! Histories bigger than one summary request: the previous summary folded into the next
//! compaction, and heads longer than the compaction model's window folded in chunks.

use compactd::server::pb;
use compactd::server::pb::compaction_event::Event as Ce;

use crate::common::compaction::*;
use crate::common::fake_llm::{FakeLlm, Reply};
use crate::common::fake_window::{Overflow, Verdict, WindowSpec};
use crate::common::*;

#[tokio::test]
async fn a_second_compaction_folds_the_previous_summary_in() {
    const FIRST: &str = "FIRST-SUMMARY: the parser drops trailing commas in src/parse.rs";
    let fake = FakeLlm::start(vec![
        Reply::text([FIRST]),
        Reply::text(["SECOND-SUMMARY ", "combined"]),
    ])
    .await;
    let server = server_with_llm(&fake).await;
    let mut client = server.client().await;
    seed_session(&mut client, SID).await;

    let first = compact(&mut client, SID).await;
    let first_done = compacted(&first).clone();
    // Nothing new arrived: the second compaction summarizes the old tail (tail_turns 0).
    let second = compact_with(
        &mut client,
        SID,
        pb::CompactOptions {
            tail_turns: Some(0),
            ..Default::default()
        },
    )
    .await
    .expect("second Compact");
    let done = compacted(&second);
    assert_eq!(fake.request_count(), 2);

    let req = fake.last_request();
    let texts = req.message_texts();
    assert!(
        texts[1].starts_with(&format!(
            "=== Summary of the earlier conversation ===\n{FIRST}"
        )),
        "the first summary opens the transcript: {}",
        texts[1]
    );
    assert!(
        texts[1].contains("=== Newer conversation ==="),
        "{}",
        texts[1]
    );
    assert!(texts[1].contains("user turn 2") && texts[1].contains("user turn 3"));
    assert!(
        !texts[1].contains("user turn 1"),
        "nothing before the previous summary is sent again"
    );
    assert_eq!(
        texts[1].matches(FIRST).count(),
        1,
        "the previous summary is folded in once, not also summarized as a message"
    );
    let ask = texts.last().expect("prompt");
    assert!(
        ask.contains("newer conversation") && ask.contains("combines it"),
        "the fold instruction: {ask}"
    );
    // The first request had nothing to fold.
    let first_req = &fake.requests()[0];
    assert!(!first_req.message_texts()[1].contains("=== Summary of the earlier"));
    assert!(!first_req.message_texts()[2].contains("newer conversation"));

    // Afterwards the context is the second compaction and its summary, nothing else.
    let ctx = get_context(&mut client, SID).await;
    assert_eq!(
        context_ids(&ctx),
        [
            done.user_message_id.clone(),
            done.summary_message_id.clone()
        ]
    );
    assert_eq!(text_of(&ctx.messages[1]), "SECOND-SUMMARY combined");
    assert_eq!(ctx.boundary_message_id, done.user_message_id);
    assert!(
        !context_ids(&ctx).contains(&first_done.summary_message_id),
        "the first summary left the context"
    );
    assert!(
        !format!("{ctx:?}").contains("FIRST-SUMMARY"),
        "no trace of the first summary in the context"
    );
}

#[tokio::test]
async fn a_head_longer_than_the_model_window_is_folded_in_chunks() {
    // The endpoint refuses what does not fit its 4,000 tokens; compactd knows that window.
    let fake = FakeLlm::start(vec![Reply::Window(WindowSpec {
        n_ctx: 4_000,
        percent: 100,
        overflow: Overflow::Refuse,
    })])
    .await;
    let server = server_with(&fake, |c| c.context_tokens = Some(4_000)).await;
    let mut client = server.client().await;
    seed_long_session(&mut client, SID).await;
    let events = compact(&mut client, SID).await;
    let Some(Ce::Compacted(done)) = &events.last().and_then(|e| e.event.clone()) else {
        panic!("{events:?}")
    };
    let requests = fake.requests();
    assert!(requests.len() >= 2, "chunked: {} requests", requests.len());
    assert_eq!(done.chunks as usize, requests.len());
    assert_eq!(done.dropped_chars, 0);
    for r in &requests {
        assert_eq!(r.body["max_tokens"], 1_000, "a quarter of the window");
    }
    // Later chunks fold the rolling summary; only the final summary streams.
    assert!(
        requests[1].message_texts()[1]
            .starts_with("=== Summary of the earlier conversation ===\nsummary #1")
    );
    let last = format!("summary #{}", requests.len());
    assert_eq!(deltas(&events), last);
    let session = get_session(&mut client, SID).await;
    let stored = stored_message(&session, &done.summary_message_id);
    assert_eq!(text_of(stored), last);
}

#[tokio::test]
async fn a_refusal_for_length_splits_the_head_and_tries_again() {
    // No window configured: the first (whole-head) request is refused, then chunks fit.
    let fake = FakeLlm::start(vec![Reply::context_too_long(7_000)]).await;
    let server = server_with_llm(&fake).await;
    let mut client = server.client().await;
    seed_long_session(&mut client, SID).await;
    let events = compact(&mut client, SID).await;
    let Some(Ce::Compacted(done)) = &events.last().and_then(|e| e.event.clone()) else {
        panic!("{events:?}")
    };
    assert!(done.chunks >= 2, "{done:?}");
    let refused = fake
        .requests()
        .iter()
        .filter(|r| r.prompt_chars() > 7_000)
        .count();
    assert!(refused >= 1, "the whole head was tried first");
}

#[tokio::test]
async fn a_chunked_compaction_that_fails_part_way_reports_what_it_spent() {
    // The first chunk is answered (3,500 prompt and 50 completion tokens), the second is
    // refused for good: nothing commits, but the tokens of the first were paid for.
    let fake = FakeLlm::start(vec![
        Reply::Stream {
            chunks: vec!["summary of the first chunk".into()],
            usage: Some((3_500, 50)),
            delay_per_chunk: std::time::Duration::ZERO,
            finish_reason: Some("stop".into()),
        },
        Reply::status(400),
    ])
    .await;
    let server = server_with(&fake, |c| c.context_tokens = Some(4_000)).await;
    let mut client = server.client().await;
    seed_long_session(&mut client, SID).await;
    let events = compact(&mut client, SID).await;
    let Some(Ce::Failed(failed)) = &events.last().and_then(|e| e.event.clone()) else {
        panic!("{events:?}")
    };
    assert!(
        fake.requests().len() >= 2,
        "chunked: {}",
        fake.requests().len()
    );
    let usage = failed
        .usage
        .as_ref()
        .unwrap_or_else(|| panic!("no usage: {failed:?}"));
    assert_eq!(
        (usage.input, usage.output, usage.total),
        (3_500, 50, Some(3_550)),
        "{failed:?}"
    );
}

#[tokio::test]
async fn a_previous_summary_longer_than_the_next_models_window_is_summarized_again() {
    // The first summary was written by a model with a 128k window (a per-request model);
    // the next compaction runs on the 8k default model, whose window that summary leaves
    // no room (about 7,000 tokens of it, beside the prompt and a 2,048-token answer).
    // Before, every later compaction failed "leaves no room" without sending anything.
    const LAST_LINE: &str = "FIRST-SUMMARY-ENDS-HERE";
    let first_summary = format!("FIRST-SUMMARY\n{}\n{LAST_LINE}", log_of("earlier", 28_000));
    let window = WindowSpec {
        n_ctx: 8_192,
        percent: 100,
        overflow: Overflow::Refuse,
    };
    let fake = FakeLlm::start(vec![
        Reply::text([first_summary.clone()]),
        Reply::Window(window),
    ])
    .await;
    fake.serve_models(serde_json::json!({"object": "list", "data": [
        {"id": "big-model", "max_model_len": 131_072},
        {"id": "fake-model", "max_model_len": 8_192},
    ]}));
    let server = server_with_llm(&fake).await;
    let mut client = server.client().await;
    // A head of about 10,000 tokens: ten turns with 4 kB outputs.
    seed_turns_of(&mut client, SID, 4_000).await;
    let first = compact_with(
        &mut client,
        SID,
        pb::CompactOptions {
            model: "big-model".into(),
            ..Default::default()
        },
    )
    .await
    .expect("first Compact");
    compacted(&first);

    let second = compact_with(
        &mut client,
        SID,
        pb::CompactOptions {
            tail_turns: Some(0),
            ..Default::default()
        },
    )
    .await
    .expect("second Compact");
    let done = compacted(&second);
    assert_eq!(done.dropped_chars, 0, "{done:?}");
    let requests = &fake.requests()[1..];
    assert!(requests.len() >= 2, "folded in chunks: {}", requests.len());
    assert_eq!(done.chunks as usize, requests.len(), "none was refused");
    for r in requests {
        assert_eq!(r.body["model"], "fake-model");
        assert!(matches!(window.judge(&r.body), Verdict::Fits(_)));
    }
    // The previous summary is the transcript's oldest text, each part of it sent once.
    let first_chunk = &requests[0].message_texts()[1];
    assert!(
        first_chunk.starts_with("--- summary ---\nFIRST-SUMMARY\n"),
        "{}",
        &first_chunk[..80]
    );
    let sent: String = requests
        .iter()
        .map(|r| r.message_texts()[1].clone())
        .collect();
    assert_eq!(sent.matches("FIRST-SUMMARY\n").count(), 1);
    assert_eq!(sent.matches(LAST_LINE).count(), 1);
    assert!(sent.contains("turn 9"));
    let ctx = get_context(&mut client, SID).await;
    // The fake numbers its answers from the first compaction's on.
    assert_eq!(
        text_of(&ctx.messages[1]),
        format!("summary #{}", fake.request_count())
    );
}
