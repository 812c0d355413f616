//! Automatic compaction on the main stream: an overflow that prune cannot fix starts one,
//! with the session's own continue text and prompts; three failures pause it; a compaction
//! that leaves the context over waits two finished messages; and the context's order
//! after one with messages arriving while the summary is written.

use std::time::Duration;

use compactd::server::pb;
use compactd::server::pb::compaction_event::Event as Ce;

use crate::common::compaction::*;
use crate::common::fake_llm::{FakeLlm, Reply};
use crate::common::*;

/// The default auto-continue text.
const CONTINUE: &str = "Continue if you have next steps";

/// Finishes assistant message `id` (answering u3) reporting `input` tokens: the update a
/// host sends when a model step ends. Returns the seq of the finishing update.
async fn finish_reporting(s: &mut EventStream, sid: &str, id: &str, input: u64) -> u64 {
    finish(s, sid, id, input, false).await
}

/// [`finish_reporting`], with a text part (`answer <id>`) first so the message shows in
/// the context.
async fn finish_answering(s: &mut EventStream, sid: &str, id: &str, input: u64) -> u64 {
    finish(s, sid, id, input, true).await
}

async fn finish(s: &mut EventStream, sid: &str, id: &str, input: u64, answer: bool) -> u64 {
    s.expect_ack(sid, upsert_message(assistant_msg(id, "u3")))
        .await;
    if answer {
        s.expect_ack(
            sid,
            upsert_part(text_part(id, &format!("{id}-t"), &format!("answer {id}"))),
        )
        .await;
    }
    let mut done = finished(assistant_msg(id, "u3"));
    done.tokens = Some(usage(input));
    s.send(sid, upsert_message(done)).await
}

/// [`seed_session_with_cleared_output`] with a 20k window and 4k output (usable 16,000,
/// threshold 14,720), and a main stream.
async fn overflowing_session(server: &TestServer, sid: &str) -> EventStream {
    let mut client = server.client().await;
    seed_session_with_cleared_output(&mut client, sid).await;
    // 20k window, 4k output: usable 16,000, threshold 14,720.
    open_session(&mut client, session_with_limits(sid, 20_000, 4_000)).await;
    server.stream().await
}

#[tokio::test]
async fn overflow_that_prune_cannot_fix_compacts_automatically_on_the_stream() {
    let fake = FakeLlm::start(vec![Reply::text(["auto ", "summary"])]).await;
    let server = server_with_llm(&fake).await;
    let mut s = overflowing_session(&server, SID).await;

    // Below the threshold: nothing happens.
    let seq = finish_reporting(&mut s, SID, "b1", 14_000).await;
    assert_eq!(kinds(&s.reply(seq).await), ["ack"]);
    assert_eq!(fake.request_count(), 0);

    // Over it: the overflow event and the ack, then the compaction follows with that seq.
    let seq = finish_reporting(&mut s, SID, "b2", 19_000).await;
    assert_eq!(kinds(&s.reply(seq).await), ["overflow", "ack"]);
    let events = follow(&mut s, seq).await;
    assert_eq!(names(&events), ["started", "delta", "delta", "compacted"]);
    let Some(Ce::Started(started)) = &events[0].event else {
        unreachable!()
    };
    assert!(started.auto);
    let Some(Ce::Compacted(done)) = &events[3].event else {
        unreachable!()
    };
    assert!(done.auto);

    // The context ends with the synthetic auto-continue message.
    let mut client = server.client().await;
    let ctx = get_context(&mut client, SID).await;
    let last = ctx.messages.last().expect("messages");
    assert_eq!(text_of(last), CONTINUE);
    assert_eq!(ctx.messages[1].info.as_ref().map(|i| i.summary), Some(true));
}

#[tokio::test]
async fn a_session_sets_its_own_continue_text_and_compaction_prompts() {
    let fake = FakeLlm::start(vec![Reply::text(["auto summary"])]).await;
    let server = server_with_llm(&fake).await;
    let mut s = overflowing_session(&server, SID).await;
    let mut client = server.client().await;
    open_session(
        &mut client,
        session_with_config(
            SID,
            20_000,
            4_000,
            pb::SessionConfig {
                auto_continue: Some("Go on with the plan.".into()),
                compaction_system: Some("SESSION-SYSTEM".into()),
                compaction_template: Some("SESSION-TEMPLATE".into()),
                ..Default::default()
            },
        ),
    )
    .await;
    let seq = finish_reporting(&mut s, SID, "b1", 19_000).await;
    assert_eq!(kinds(&s.reply(seq).await), ["overflow", "ack"]);
    let events = follow(&mut s, seq).await;
    assert!(
        matches!(
            events.last().and_then(|e| e.event.as_ref()),
            Some(Ce::Compacted(_))
        ),
        "{events:?}"
    );
    // The summary was asked for with the session's prompts (the server's default prompt
    // is kept: the session did not set one).
    let texts = fake.last_request().message_texts();
    assert_eq!(texts[0], "SESSION-SYSTEM\n\nSESSION-TEMPLATE");
    // The context ends with the session's continue text.
    let ctx = get_context(&mut client, SID).await;
    let last = ctx.messages.last().expect("messages");
    assert_eq!(text_of(last), "Go on with the plan.");
    // And the settings read back as set.
    let info = get_session(&mut client, SID).await.info.expect("info");
    let config = info.config.expect("config");
    assert_eq!(
        config.auto_continue.as_deref(),
        Some("Go on with the plan.")
    );
    assert_eq!(config.compaction_system.as_deref(), Some("SESSION-SYSTEM"));
}

#[tokio::test]
async fn three_failed_automatic_compactions_pause_auto_compaction() {
    let fake = FakeLlm::start(vec![Reply::status(400)]).await;
    let server = server_with_llm(&fake).await;
    let mut s = overflowing_session(&server, SID).await;
    for (i, id) in ["b1", "b2", "b3"].into_iter().enumerate() {
        let seq = finish_reporting(&mut s, SID, id, 19_000).await;
        assert_eq!(kinds(&s.reply(seq).await), ["overflow", "ack"]);
        let events = follow(&mut s, seq).await;
        let f = failure(&events);
        assert_eq!(f.kind, "request", "{f:?}");
        assert!(!f.retryable, "a 400 is not worth retrying");
        assert_eq!(f.auto_compaction_paused, i == 2, "attempt {i}: {f:?}");
    }
    assert_eq!(fake.request_count(), 3, "a 400 is not retried");

    // Paused: still reported as overflowing, but no compaction starts.
    let seq = finish_reporting(&mut s, SID, "b4", 19_000).await;
    assert_eq!(kinds(&s.reply(seq).await), ["overflow", "ack"]);
    let seq = s.send(SID, upsert_message(user_msg("u5"))).await;
    assert_eq!(
        kinds(&s.reply(seq).await),
        ["ack"],
        "no compaction event came in between"
    );
    assert_eq!(fake.request_count(), 3);

    // A successful manual compaction closes the breaker.
    fake.push(Reply::text(["manual summary"]));
    let mut client = server.client().await;
    let events = compact(&mut client, SID).await;
    assert_eq!(names(&events).last(), Some(&"compacted"));
}

#[tokio::test]
async fn a_compaction_that_leaves_the_context_over_waits_two_finished_messages() {
    // Head: a1's 100,000-character output (25,000 tokens). The summary the fake writes is
    // 60,000 characters (15,000 tokens): smaller than the head, so it commits, but with
    // the tail the context stays above the threshold (14,720 of 16,000 usable).
    let big_summary = output_of("BIG-SUMMARY", 60_000);
    let fake = FakeLlm::start(vec![
        Reply::text([big_summary.as_str()]),
        Reply::text(["second summary"]),
    ])
    .await;
    let server = server_with_llm(&fake).await;
    let mut client = server.client().await;
    open_session(&mut client, session_with_limits(SID, 100_000, 20_000)).await;
    seed_turns(&mut client, SID).await;
    put_part(
        &mut client,
        SID,
        tool_part("a1", "a1-huge", "bash", &output_of("a1-huge", 100_000)),
    )
    .await;
    open_session(&mut client, session_with_limits(SID, 20_000, 4_000)).await;
    let mut s = server.stream().await;

    // The first automatic compaction runs and commits...
    let seq = finish_answering(&mut s, SID, "b1", 19_000).await;
    assert_eq!(kinds(&s.reply(seq).await), ["overflow", "ack"]);
    let events = follow(&mut s, seq).await;
    assert_eq!(names(&events).last(), Some(&"compacted"), "{events:?}");
    let done = compacted(&events);
    assert!(done.auto);
    // ...and leaves the context over the threshold.
    let check = check_overflow(&mut client, SID).await;
    assert!(
        check.overflow && done.tokens_after > check.threshold,
        "precondition: still over after the compaction: {check:?} {done:?}"
    );
    assert_eq!(fake.request_count(), 1);

    // The next two finished assistant messages overflow but start nothing.
    for id in ["b2", "b3"] {
        let seq = finish_answering(&mut s, SID, id, 19_000).await;
        assert_eq!(kinds(&s.reply(seq).await), ["overflow", "ack"], "{id}");
        // A compaction started by `id` would send its events (with `id`'s seq) before this
        // update's ack; `reply` fails on any event with another seq.
        let probe = s
            .send(
                SID,
                upsert_part(text_part("u3", &format!("{id}-probe"), "x")),
            )
            .await;
        assert_eq!(kinds(&s.reply(probe).await), ["ack"], "{id}");
        assert_eq!(
            fake.request_count(),
            1,
            "{id}: no compaction in the cooldown"
        );
    }

    // The third one compacts again.
    let seq = finish_answering(&mut s, SID, "b4", 19_000).await;
    assert_eq!(kinds(&s.reply(seq).await), ["overflow", "ack"]);
    let events = follow(&mut s, seq).await;
    let Some(Ce::Started(started)) = &events[0].event else {
        panic!("started first: {events:?}")
    };
    assert!(started.auto);
    assert_eq!(names(&events).last(), Some(&"compacted"), "{events:?}");
    assert_eq!(fake.request_count(), 2);
}

#[tokio::test]
async fn after_an_automatic_compaction_the_context_has_the_documented_order() {
    // ~6 s of summary: the four updates of another stream are acked while it streams, on
    // a loaded machine too (2 x 300 ms was not always enough).
    let fake = FakeLlm::start(vec![Reply::slow(
        ["auto ", "summary"],
        Duration::from_secs(3),
    )])
    .await;
    let server = server_with_llm(&fake).await;
    let mut client = server.client().await;
    seed_session(&mut client, SID).await;
    // 20k window, 4k output: usable 16,000, threshold 14,720.
    open_session(&mut client, session_with_limits(SID, 20_000, 4_000)).await;
    let mut s = server.stream().await;

    let seq = finish_answering(&mut s, SID, "b1", 19_000).await;
    assert_eq!(kinds(&s.reply(seq).await), ["overflow", "ack"]);
    let first = s.next_event().await;
    assert!(
        matches!(&first.event, Some(pb::server_event::Event::Compaction(c)) if matches!(c.event, Some(Ce::Started(_)))),
        "{first:?}"
    );
    fake.wait_for_requests(1).await;

    // Messages arriving while the summary is written, on another stream.
    let mut other = server.stream().await;
    other.expect_ack(SID, upsert_message(user_msg("u4"))).await;
    other
        .expect_ack(SID, upsert_part(text_part("u4", "u4-t", "IN-FLIGHT-U4")))
        .await;
    other
        .expect_ack(SID, upsert_message(assistant_msg("a4", "u4")))
        .await;
    other
        .expect_ack(SID, upsert_part(text_part("a4", "a4-t", "IN-FLIGHT-A4")))
        .await;
    assert!(
        fake.active_connections() > 0,
        "still summarizing while those were acked"
    );

    let events = follow(&mut s, seq).await;
    let Some(Ce::Compacted(done)) = &events.last().and_then(|e| e.event.clone()) else {
        panic!("{events:?}")
    };
    assert!(done.auto);
    // And one message after the compaction.
    other.expect_ack(SID, upsert_message(user_msg("u5"))).await;
    other
        .expect_ack(SID, upsert_part(text_part("u5", "u5-t", "after")))
        .await;

    let ctx = get_context(&mut client, SID).await;
    let cont = ctx
        .messages
        .iter()
        .find(|m| text_of(m) == CONTINUE)
        .and_then(|m| m.info.as_ref())
        .expect("the auto-continue message")
        .id
        .clone();
    // README "After a compaction GetContext returns": compaction message, summary, the
    // verbatim tail, messages that arrived meanwhile, auto-continue, everything after.
    assert_eq!(
        context_ids(&ctx),
        [
            done.user_message_id.as_str(),
            done.summary_message_id.as_str(),
            "u2",
            "a2",
            "u3",
            "a3",
            "b1",
            "u4",
            "a4",
            cont.as_str(),
            "u5"
        ]
    );
    assert_eq!(text_of(&ctx.messages[1]), "auto summary");
    match &ctx.messages[0].parts[0].kind {
        Some(pb::part::Kind::Compaction(c)) => {
            assert_eq!((c.auto, c.tail_start_id.as_str()), (true, "u2"))
        }
        other => panic!("compaction part expected, got {other:?}"),
    }
    // The in-flight messages were not summarized.
    let sent = fake.last_request().message_texts().join("\n");
    assert!(!sent.contains("IN-FLIGHT"), "{sent}");
}
