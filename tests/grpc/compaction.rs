//! Compaction over gRPC against a real OpenAI-compatible HTTP server (the fake in
//! `common::fake_llm`): streamed deltas, `session.compacted`, the context afterwards,
//! failures that change nothing, concurrency and cancellation.

use std::sync::Arc;
use std::time::Duration;

use compactd::server::pb;
use compactd::server::pb::compaction_event::Event as Ce;
use compactd::server::{CompactionConfig, ServerOptions};
use compactd::summarize::{ApiKey, LlmConfig, OpenAiSummarizer};
use tokio_stream::StreamExt;

use crate::common::fake_llm::{FakeLlm, Reply};
use crate::common::*;

const SECRET: &str = "sk-test-SECRET-0123456789";
const SID: &str = "cmp";

async fn server_with_llm(fake: &FakeLlm) -> TestServer {
    server_with(fake, |llm| {
        llm.api_key = Some(ApiKey::new(SECRET));
        llm.timeout = Duration::from_secs(20);
    })
    .await
}

/// A server whose summarizer talks to `fake`, with fast retries and `tune` applied.
async fn server_with(fake: &FakeLlm, tune: impl FnOnce(&mut LlmConfig)) -> TestServer {
    let mut llm = LlmConfig::new(fake.base_url(), "fake-model");
    llm.retry_base = Duration::from_millis(5);
    tune(&mut llm);
    let compaction = CompactionConfig {
        summarizer: Some(Arc::new(OpenAiSummarizer::new(llm))),
        ..Default::default()
    };
    start_server_with_options(ServerOptions {
        compaction,
        ..Default::default()
    })
    .await
}

/// Three user turns; a1's first output is already cleared by prune (host-set stamp).
async fn seed_session(client: &mut Client, sid: &str) {
    open_session(client, session_with_limits(sid, 100_000, 20_000)).await;
    for (u, a, n) in [("u1", "a1", 1), ("u2", "a2", 2), ("u3", "a3", 3)] {
        put_message(client, sid, user_msg(u)).await;
        put_part(
            client,
            sid,
            text_part(u, &format!("{u}-t"), &format!("user turn {n}")),
        )
        .await;
        put_message(client, sid, assistant_msg(a, u)).await;
        put_part(
            client,
            sid,
            tool_part(
                a,
                &format!("{a}-read"),
                "read",
                &output_of(&format!("{a}-read"), 4_000),
            ),
        )
        .await;
        put_message(client, sid, finished(assistant_msg(a, u))).await;
    }
    let mut cleared = tool_part("a1", "a1-old", "bash", &output_of("ORIGINAL-a1-old", 2_000));
    if let Some(pb::part::Kind::Tool(t)) = &mut cleared.kind {
        t.state.as_mut().expect("state").time = Some(pb::ToolTime {
            start: 1,
            end: Some(2),
            compacted: Some(3),
        });
    }
    put_part(client, sid, cleared).await;
}

async fn compact(
    client: &mut Client,
    sid: &str,
    instructions: &str,
) -> Result<Vec<pb::CompactionEvent>, tonic::Status> {
    let request = pb::CompactRequest {
        session_id: sid.into(),
        options: Some(pb::CompactOptions {
            instructions: instructions.into(),
            ..Default::default()
        }),
    };
    let mut stream = client.compact(request).await?.into_inner();
    let mut events = Vec::new();
    while let Some(e) = stream.next().await {
        events.push(e?);
    }
    Ok(events)
}

fn failure(events: &[pb::CompactionEvent]) -> &pb::CompactionFailed {
    match events.last().and_then(|e| e.event.as_ref()) {
        Some(Ce::Failed(f)) => f,
        other => panic!("expected a failure last, got {other:?}"),
    }
}

fn text_of(m: &pb::Message) -> String {
    m.parts
        .iter()
        .filter_map(|p| match &p.kind {
            Some(pb::part::Kind::Text(t)) => Some(t.text.as_str()),
            _ => None,
        })
        .collect()
}

#[tokio::test]
async fn manual_compaction_streams_commits_and_reshapes_the_context() {
    let fake = FakeLlm::start(vec![Reply::text([
        "The user ",
        "wants the parser fixed. ",
        "Next: run tests.",
    ])])
    .await;
    let server = server_with_llm(&fake).await;
    let mut client = server.client().await;
    seed_session(&mut client, SID).await;
    let mut watch = client
        .subscribe(pb::SubscribeRequest {
            session_id: SID.into(),
        })
        .await
        .expect("subscribe")
        .into_inner();

    let events = compact(&mut client, SID, "focus on the failing test")
        .await
        .expect("compact");
    assert_eq!(
        names(&events),
        ["started", "delta", "delta", "delta", "compacted"]
    );
    let indexes: Vec<u32> = events
        .iter()
        .filter_map(|e| match &e.event {
            Some(Ce::Delta(d)) => Some(d.index),
            _ => None,
        })
        .collect();
    assert_eq!(indexes, [0, 1, 2]);
    let summary = deltas(&events);
    assert_eq!(summary, "The user wants the parser fixed. Next: run tests.");
    let Some(Ce::Compacted(done)) = &events[4].event else {
        unreachable!()
    };
    assert!(done.tokens_after < done.tokens_before, "{done:?}");
    assert_eq!(
        done.usage.as_ref().map(|u| u.input),
        Some(10),
        "usage from the stream"
    );
    assert!(!done.auto);

    // The committed summary is exactly the streamed text (no anchors in this session).
    let session = get_session(&mut client, SID).await;
    let stored = session
        .messages
        .iter()
        .find(|m| {
            m.info
                .as_ref()
                .is_some_and(|i| i.id == done.summary_message_id)
        })
        .expect("summary stored");
    let info = stored.info.as_ref().expect("info");
    assert!(info.summary);
    assert_eq!(
        (
            info.mode.as_str(),
            info.agent.as_str(),
            info.finish.as_str()
        ),
        ("compaction", "compaction", "stop")
    );
    assert_eq!(info.parent_id, done.user_message_id);
    assert_eq!(text_of(stored), summary);

    // Context: the compaction message, the summary, then the verbatim tail (u2 on).
    let ctx = get_context(&mut client, SID).await;
    let ids: Vec<&str> = ctx
        .messages
        .iter()
        .map(|m| m.info.as_ref().expect("info").id.as_str())
        .collect();
    assert_eq!(
        ids,
        [
            done.user_message_id.as_str(),
            done.summary_message_id.as_str(),
            "u2",
            "a2",
            "u3",
            "a3"
        ]
    );
    assert_eq!(ctx.boundary_message_id, done.user_message_id);
    match &ctx.messages[0].parts[0].kind {
        Some(pb::part::Kind::Compaction(c)) => {
            assert_eq!((c.auto, c.tail_start_id.as_str()), (false, "u2"))
        }
        other => panic!("compaction part expected, got {other:?}"),
    }

    // What the model was sent: the prompt, the head with cleared outputs as placeholders,
    // the extra instructions; the key only in the Authorization header.
    let req = fake.last_request();
    assert_eq!(
        req.header("authorization"),
        Some(format!("Bearer {SECRET}").as_str())
    );
    assert_eq!(req.body["model"], "fake-model");
    assert_eq!(req.body["stream_options"]["include_usage"], true);
    let texts = req.message_texts();
    assert!(
        texts[0].contains("Provide a detailed but concise summary"),
        "{}",
        texts[0]
    );
    assert!(texts[1].contains("user turn 1"), "head holds turn 1");
    assert!(
        texts[1].contains("[Old tool result content cleared]"),
        "cleared output as placeholder"
    );
    assert!(
        !texts[1].contains("ORIGINAL-a1-old"),
        "cleared output not sent"
    );
    assert!(
        !texts[1].contains("user turn 2"),
        "the tail is not summarized"
    );
    assert!(
        texts
            .last()
            .expect("prompt")
            .ends_with("Additional instructions: focus on the failing test")
    );

    // The watcher saw the same compaction end with session.compacted.
    let mut seen = Vec::new();
    while let Some(e) = watch.next().await {
        let e = e.expect("watch event");
        let done = matches!(&e.event, Some(pb::session_event::Event::Compaction(c)) if matches!(c.event, Some(Ce::Compacted(_))));
        seen.push(e);
        if done {
            break;
        }
    }
    assert!(seen.iter().all(|e| e.session_id == SID));
    assert!(
        !format!("{events:?}{seen:?}").contains("SECRET"),
        "the key never reaches events"
    );
}

#[tokio::test]
async fn without_an_endpoint_compaction_is_a_failed_precondition_and_nothing_else_breaks() {
    let server = start_server().await;
    let mut client = server.client().await;
    seed_session(&mut client, SID).await;
    let err = compact(&mut client, SID, "")
        .await
        .expect_err("no endpoint");
    assert_eq!(err.code(), tonic::Code::FailedPrecondition);
    assert!(
        err.message().contains("--llm-base-url"),
        "{}",
        err.message()
    );
    assert_eq!(get_context(&mut client, SID).await.context_messages, 6);
}

#[tokio::test]
async fn a_server_error_before_the_first_token_is_retried() {
    let fake = FakeLlm::start(vec![Reply::status(500), Reply::text(["short summary"])]).await;
    let server = server_with_llm(&fake).await;
    let mut client = server.client().await;
    seed_session(&mut client, SID).await;
    let events = compact(&mut client, SID, "").await.expect("compact");
    assert_eq!(
        names(&events),
        ["started", "retrying", "delta", "compacted"]
    );
    let Some(Ce::Retrying(r)) = &events[1].event else {
        unreachable!()
    };
    assert_eq!(r.attempt, 2);
    assert!(r.reason.contains("500"), "{}", r.reason);
    assert_eq!(fake.request_count(), 2);
}

#[tokio::test]
async fn a_rate_limit_waits_as_long_as_retry_after_asks() {
    // The test server retries after 5 ms on its own; the 429 asks for a full second.
    let fake = FakeLlm::start(vec![Reply::rate_limited(1), Reply::text(["short summary"])]).await;
    let server = server_with_llm(&fake).await;
    let mut client = server.client().await;
    seed_session(&mut client, SID).await;
    let events = compact(&mut client, SID, "").await.expect("compact");
    assert_eq!(
        names(&events),
        ["started", "retrying", "delta", "compacted"]
    );
    let Some(Ce::Retrying(r)) = &events[1].event else {
        unreachable!()
    };
    assert_eq!(r.delay_ms, 1000, "Retry-After: 1 is honoured");
    assert!(r.reason.contains("429"), "{}", r.reason);
    assert_eq!(fake.request_count(), 2);
}

#[tokio::test]
async fn the_compaction_model_and_prompts_can_be_chosen_per_session_and_per_request() {
    let fake = FakeLlm::start(vec![Reply::text(["first"]), Reply::text(["second"])]).await;
    let server = server_with_llm(&fake).await;
    let mut client = server.client().await;
    seed_session(&mut client, SID).await;
    open_session(
        &mut client,
        session_with_config(
            SID,
            100_000,
            20_000,
            pb::SessionConfig {
                compaction_model: Some("session-model".into()),
                ..Default::default()
            },
        ),
    )
    .await;

    // The session's compaction model replaces the server's; prompts stay the defaults.
    let events = compact(&mut client, SID, "").await.expect("compact");
    let Some(Ce::Started(started)) = &events[0].event else {
        panic!("started first: {events:?}")
    };
    assert_eq!(started.model, "session-model");
    let req = fake.last_request();
    assert_eq!(req.body["model"], "session-model");
    assert!(
        req.message_texts()[0].contains("Objective"),
        "default template"
    );

    // A request's own model and prompts win over both.
    let request = pb::CompactRequest {
        session_id: SID.into(),
        options: Some(pb::CompactOptions {
            model: "request-model".into(),
            system: "SYSTEM-OVERRIDE".into(),
            template: "TEMPLATE-OVERRIDE".into(),
            prompt: "PROMPT-OVERRIDE".into(),
            tail_turns: Some(0),
            ..Default::default()
        }),
    };
    let mut stream = client.compact(request).await.expect("compact").into_inner();
    let mut last = None;
    while let Some(e) = stream.next().await {
        last = Some(e.expect("event"));
    }
    assert!(
        matches!(last.and_then(|e| e.event), Some(Ce::Compacted(_))),
        "second compaction commits"
    );
    let req = fake.last_request();
    assert_eq!(req.body["model"], "request-model");
    let texts = req.message_texts();
    assert_eq!(texts[0], "SYSTEM-OVERRIDE\n\nTEMPLATE-OVERRIDE");
    assert!(
        texts.last().expect("prompt").starts_with("PROMPT-OVERRIDE"),
        "{texts:?}"
    );

    // The committed summary says which model wrote it.
    let session = get_session(&mut client, SID).await;
    let summary = session
        .messages
        .iter()
        .rev()
        .find(|m| m.info.as_ref().is_some_and(|i| i.summary))
        .expect("a summary message");
    let model = summary.info.as_ref().and_then(|i| i.model.clone());
    assert_eq!(model.map(|m| m.model_id).as_deref(), Some("request-model"));
}

#[tokio::test]
async fn models_outside_the_operators_allow_list_are_refused() {
    let fake = FakeLlm::start(vec![Reply::text(["cheap summary"])]).await;
    let mut llm = LlmConfig::new(fake.base_url(), "fake-model");
    llm.retry_base = Duration::from_millis(5);
    let server = start_server_with_options(ServerOptions {
        compaction: CompactionConfig {
            summarizer: Some(Arc::new(OpenAiSummarizer::new(llm))),
            allowed_models: vec!["cheap".into()],
            ..Default::default()
        },
        ..Default::default()
    })
    .await;
    let mut client = server.client().await;
    seed_session(&mut client, SID).await;
    // A session cannot pick an expensive compaction model...
    let open = client
        .open_session(pb::OpenSessionRequest {
            session: Some(session_with_config(
                SID,
                100_000,
                20_000,
                pb::SessionConfig {
                    compaction_model: Some("expensive".into()),
                    ..Default::default()
                },
            )),
        })
        .await;
    let status = assert_status(
        open,
        tonic::Code::PermissionDenied,
        "session.config.compaction_model",
    );
    assert!(
        status
            .message()
            .contains("--compaction-allowed-models (cheap)"),
        "{status:?}"
    );
    // ...nor an imported one...
    let import = client
        .import_session(pb::ImportSessionRequest {
            config: Some(pb::SessionConfig {
                compaction_model: Some("expensive".into()),
                ..Default::default()
            }),
            ..example_import("imported")
        })
        .await;
    assert_status(
        import,
        tonic::Code::PermissionDenied,
        "config.compaction_model",
    );
    // ...nor can one request; the session is as it was and an allowed model works.
    let before = get_session(&mut client, SID).await;
    let request = |model: &str| pb::CompactRequest {
        session_id: SID.into(),
        options: Some(pb::CompactOptions {
            model: model.into(),
            ..Default::default()
        }),
    };
    let refused = client.compact(request("expensive")).await;
    assert_status(refused, tonic::Code::PermissionDenied, "options.model");
    assert_eq!(get_session(&mut client, SID).await, before);
    assert_eq!(fake.request_count(), 0);
    let mut stream = client
        .compact(request("cheap"))
        .await
        .expect("allowed")
        .into_inner();
    let mut last = None;
    while let Some(e) = stream.next().await {
        last = Some(e.expect("event"));
    }
    assert!(
        matches!(last.and_then(|e| e.event), Some(Ce::Compacted(_))),
        "the allowed model compacts"
    );
    assert_eq!(fake.last_request().body["model"], "cheap");
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
        seed_session(&mut client, SID).await;
        let before = get_session(&mut client, SID).await;
        let events = compact(&mut client, SID, "").await.expect("compact runs");
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

#[tokio::test]
async fn one_compaction_at_a_time_and_updates_keep_flowing() {
    let fake = FakeLlm::start(vec![Reply::slow(
        ["slow ", "summary ", "text"],
        Duration::from_millis(150),
    )])
    .await;
    let server = server_with_llm(&fake).await;
    let mut client = server.client().await;
    seed_session(&mut client, SID).await;
    let mut other = server.client().await;
    open_session(&mut other, session("other")).await;

    let mut running = client.clone();
    let first = tokio::spawn(async move { compact(&mut running, SID, "").await });
    fake.wait_for_requests(1).await;

    let err = compact(&mut client, SID, "")
        .await
        .expect_err("second compaction");
    assert_eq!(err.code(), tonic::Code::FailedPrecondition);
    assert!(
        err.message().contains("already running"),
        "{}",
        err.message()
    );

    // The session and another one keep applying updates while the summary streams.
    let mut s = server.stream().await;
    s.expect_ack(SID, upsert_message(user_msg("u4"))).await;
    s.expect_ack(
        SID,
        upsert_part(text_part("u4", "u4-t", "arrived during compaction")),
    )
    .await;
    s.expect_ack("other", upsert_message(user_msg("o1"))).await;
    assert!(
        fake.active_connections() > 0,
        "still summarizing while those were acked"
    );

    let events = first.await.expect("task").expect("compact");
    let Some(Ce::Compacted(done)) = &events.last().expect("events").event else {
        panic!("{events:?}")
    };
    let ctx = get_context(&mut client, SID).await;
    let ids: Vec<&str> = ctx
        .messages
        .iter()
        .map(|m| m.info.as_ref().expect("info").id.as_str())
        .collect();
    assert_eq!(
        ids,
        [
            done.user_message_id.as_str(),
            done.summary_message_id.as_str(),
            "u2",
            "a2",
            "u3",
            "a3",
            "u4"
        ]
    );
}

#[tokio::test]
async fn dropping_compact_cancels_the_llm_request_and_frees_the_session() {
    let fake = FakeLlm::start(vec![Reply::Hang]).await;
    let server = server_with_llm(&fake).await;
    let mut client = server.client().await;
    seed_session(&mut client, SID).await;
    let before = get_session(&mut client, SID).await;
    let request = pb::CompactRequest {
        session_id: SID.into(),
        options: None,
    };
    let mut stream = client.compact(request).await.expect("compact").into_inner();
    assert!(matches!(
        stream.next().await,
        Some(Ok(pb::CompactionEvent {
            event: Some(Ce::Started(_)),
            ..
        }))
    ));
    fake.wait_for_active(1).await;
    drop(stream);
    fake.wait_for_cancelled(1).await;

    // Nothing committed, and a new compaction may start once the old one is gone.
    assert_eq!(get_session(&mut client, SID).await, before);
    fake.push(Reply::text(["after cancel"]));
    let events = loop {
        match compact(&mut client, SID, "").await {
            Err(e) if e.message().contains("already running") => tokio::task::yield_now().await,
            other => break other.expect("compact"),
        }
    };
    assert_eq!(names(&events).last(), Some(&"compacted"));
}

#[tokio::test]
async fn compaction_from_the_main_stream_follows_its_ack() {
    let fake = FakeLlm::start(vec![Reply::text(["stream ", "summary"])]).await;
    let server = server_with_llm(&fake).await;
    let mut client = server.client().await;
    seed_session(&mut client, SID).await;
    let mut s = server.stream().await;
    let seq = s
        .send(
            SID,
            pb::client_update::Update::Compact(pb::CompactOptions::default()),
        )
        .await;
    assert_eq!(kinds(&s.reply(seq).await), ["compaction", "ack"]);
    let mut text = String::new();
    loop {
        let e = s.next_event().await;
        assert_eq!(
            e.seq, seq,
            "compaction events carry the seq that started them"
        );
        match e.event {
            Some(pb::server_event::Event::Compaction(c)) => match c.event {
                Some(Ce::Delta(d)) => text.push_str(&d.text),
                Some(Ce::Compacted(_)) => break,
                other => panic!("unexpected {other:?}"),
            },
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(text, "stream summary");
}

// ---- automatic compaction -------------------------------------------------------------

/// Finishes assistant message `id` (answering u3) reporting `input` tokens: the update a
/// host sends when a model step ends.
async fn finish_reporting(s: &mut EventStream, sid: &str, id: &str, input: u64) -> u64 {
    s.expect_ack(sid, upsert_message(assistant_msg(id, "u3")))
        .await;
    let mut done = finished(assistant_msg(id, "u3"));
    done.tokens = Some(usage(input));
    s.send(sid, upsert_message(done)).await
}

/// Collects compaction events (all carrying `seq`) until one ends the compaction.
async fn follow(s: &mut EventStream, seq: u64) -> Vec<pb::CompactionEvent> {
    let mut out = Vec::new();
    loop {
        let e = s.next_event().await;
        assert_eq!(e.seq, seq, "{e:?}");
        let Some(pb::server_event::Event::Compaction(c)) = e.event else {
            panic!("expected a compaction event, got {e:?}")
        };
        let end = matches!(c.event, Some(Ce::Compacted(_) | Ce::Failed(_)));
        out.push(c);
        if end {
            return out;
        }
    }
}

async fn overflowing_session(server: &TestServer, sid: &str) -> EventStream {
    let mut client = server.client().await;
    seed_session(&mut client, sid).await;
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
    assert_eq!(text_of(last), "Continue if you have next steps");
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
    let events = compact(&mut client, SID, "").await.expect("compact");
    assert_eq!(names(&events).last(), Some(&"compacted"));
}

// ---- histories longer than the compaction model's window -----------------------------

/// A head of ~20 kB: ten turns with 2 kB outputs, the last two turns kept verbatim.
async fn long_session(client: &mut Client, sid: &str) {
    open_session(client, session_with_limits(sid, 200_000, 20_000)).await;
    for i in 0..10 {
        let (u, a) = (format!("u{i}"), format!("a{i}"));
        put_message(client, sid, user_msg(&u)).await;
        put_part(
            client,
            sid,
            text_part(&u, &format!("{u}t"), &format!("turn {i}")),
        )
        .await;
        put_message(client, sid, finished(assistant_msg(&a, &u))).await;
        put_part(
            client,
            sid,
            tool_part(&a, &format!("{a}r"), "read", &output_of(&a, 2_000)),
        )
        .await;
    }
}

#[tokio::test]
async fn a_head_longer_than_the_model_window_is_folded_in_chunks() {
    // The endpoint refuses prompts over 9,000 characters; compactd knows its window.
    let fake = FakeLlm::start(vec![Reply::context_too_long(9_000)]).await;
    let server = server_with(&fake, |c| c.context_tokens = Some(4_000)).await;
    let mut client = server.client().await;
    long_session(&mut client, SID).await;
    let events = compact(&mut client, SID, "").await.expect("compact");
    let Some(Ce::Compacted(done)) = &events.last().and_then(|e| e.event.clone()) else {
        panic!("{events:?}")
    };
    let requests = fake.requests();
    assert!(requests.len() >= 2, "chunked: {} requests", requests.len());
    assert_eq!(done.chunks as usize, requests.len());
    assert_eq!(done.dropped_chars, 0);
    for r in &requests {
        assert!(
            r.prompt_chars() <= 9_000,
            "every request fits: {}",
            r.prompt_chars()
        );
    }
    // Later chunks fold the rolling summary; only the final summary streams.
    assert!(
        requests[1].message_texts()[1]
            .starts_with("=== Summary of the earlier conversation ===\nsummary #1")
    );
    let last = format!("summary #{}", requests.len());
    assert_eq!(deltas(&events), last);
    let session = get_session(&mut client, SID).await;
    let stored = session
        .messages
        .iter()
        .find(|m| {
            m.info
                .as_ref()
                .is_some_and(|i| i.id == done.summary_message_id)
        })
        .expect("summary");
    assert_eq!(text_of(stored), last);
}

#[tokio::test]
async fn a_refusal_for_length_splits_the_head_and_tries_again() {
    // No window configured: the first (whole-head) request is refused, then chunks fit.
    let fake = FakeLlm::start(vec![Reply::context_too_long(7_000)]).await;
    let server = server_with(&fake, |_| {}).await;
    let mut client = server.client().await;
    long_session(&mut client, SID).await;
    let events = compact(&mut client, SID, "").await.expect("compact");
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
async fn a_summary_slower_than_the_timeout_fails_and_changes_nothing() {
    let fake = FakeLlm::start(vec![Reply::Hang]).await;
    let server = server_with(&fake, |c| c.timeout = Duration::from_millis(300)).await;
    let mut client = server.client().await;
    seed_session(&mut client, SID).await;
    let before = get_session(&mut client, SID).await;
    let events = compact(&mut client, SID, "").await.expect("compact");
    let f = failure(&events);
    assert_eq!((f.kind.as_str(), f.retryable), ("timeout", true), "{f:?}");
    assert_eq!(get_session(&mut client, SID).await, before);
}

#[tokio::test]
async fn a_cancel_on_the_main_stream_stops_the_llm_request() {
    let fake = FakeLlm::start(vec![Reply::Hang]).await;
    let server = server_with_llm(&fake).await;
    let mut client = server.client().await;
    seed_session(&mut client, SID).await;
    let before = get_session(&mut client, SID).await;
    let mut s = server.stream().await;

    let cancel = || pb::client_update::Update::CancelCompaction(pb::CancelCompaction {});
    let seq = s.send(SID, cancel()).await;
    let none = s.reply(seq).await;
    assert_eq!(error(&none).code, "NOT_FOUND", "nothing to cancel yet");

    let started = s
        .send(
            SID,
            pb::client_update::Update::Compact(pb::CompactOptions::default()),
        )
        .await;
    assert_eq!(kinds(&s.reply(started).await), ["compaction", "ack"]);
    fake.wait_for_active(1).await;
    let seq = s.send(SID, cancel()).await;
    // The ack and the compaction's end may interleave; collect both.
    let mut acked = false;
    let mut failed = None;
    while !(acked && failed.is_some()) {
        let e = s.next_event().await;
        match e.event {
            Some(pb::server_event::Event::Ack(_)) if e.seq == seq => acked = true,
            Some(pb::server_event::Event::Compaction(c)) => {
                assert_eq!(e.seq, started);
                if let Some(Ce::Failed(f)) = c.event {
                    failed = Some(f);
                }
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(failed.map(|f| f.kind), Some("cancelled".to_string()));
    fake.wait_for_cancelled(1).await;
    assert_eq!(get_session(&mut client, SID).await, before);
}
