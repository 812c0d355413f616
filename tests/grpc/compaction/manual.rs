//! Manual compaction, by `Compact` and by the main stream's compact update: the streamed
//! deltas, `session.compacted`, what is committed, the context afterwards and what the
//! model was sent; the todo list carried after the summary, and the summary's cost.

use compactd::server::pb;
use compactd::server::pb::compaction_event::Event as Ce;
use compactd::server::pb::session_event::Event as Se;
use tokio_stream::StreamExt;

use crate::common::compaction::*;
use crate::common::fake_llm::{FakeLlm, Reply};
use crate::common::*;

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
    seed_session_with_cleared_output(&mut client, SID).await;
    let mut watch = subscribe(&mut client, SID).await;

    let options = pb::CompactOptions {
        instructions: "focus on the failing test".into(),
        ..Default::default()
    };
    let events = compact_with(&mut client, SID, options)
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
    let stored = stored_message(&session, &done.summary_message_id);
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
    assert_eq!(
        context_ids(&ctx),
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
        let done = matches!(&e.event, Some(Se::Compaction(c)) if matches!(c.event, Some(Ce::Compacted(_))));
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
async fn compaction_from_the_main_stream_follows_its_ack() {
    let fake = FakeLlm::start(vec![Reply::text(["stream ", "summary"])]).await;
    let server = server_with_llm(&fake).await;
    let mut client = server.client().await;
    seed_session_with_cleared_output(&mut client, SID).await;
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

#[tokio::test]
async fn the_todo_list_is_appended_verbatim_after_the_streamed_summary() {
    let todos = vec![
        pb::Todo {
            id: "t1".into(),
            content: "Fix `parse_args` in src/cli.rs: \"--flag=\" panics (exit 101)".into(),
            status: "in_progress".into(),
            priority: "high".into(),
        },
        pb::Todo {
            id: "t2".into(),
            content: "Run `cargo test --test all` — then ünïcödé check".into(),
            status: "pending".into(),
            priority: String::new(),
        },
    ];
    let fake = FakeLlm::start(vec![Reply::text(["Summary ", "of the ", "work."])]).await;
    let server = server_with_llm(&fake).await;
    let mut client = server.client().await;
    open_session(
        &mut client,
        pb::SessionInfo {
            todos: todos.clone(),
            ..session_with_limits(SID, 100_000, 20_000)
        },
    )
    .await;
    seed_turns(&mut client, SID).await;

    let events = compact(&mut client, SID).await;
    let done = compacted(&events);
    let streamed = deltas(&events);
    assert_eq!(streamed, "Summary of the work.");
    assert!(
        !streamed.contains("parse_args"),
        "the todos are compactd's, not streamed by the model"
    );

    let session = get_session(&mut client, SID).await;
    let text = text_of(stored_message(&session, &done.summary_message_id));
    let (model_text, anchors) = text
        .split_once("\n\n")
        .expect("the summary, a blank line, then the anchors");
    assert_eq!(
        model_text, streamed,
        "the model's text comes first, unchanged"
    );
    let mut lines = anchors.lines();
    assert_eq!(
        lines.next(),
        Some("## Todo list (carried verbatim by compactd)")
    );
    for t in &todos {
        let line = lines.next().expect("one line per todo, in order");
        assert!(
            line.contains(&t.content),
            "todo {} verbatim in {line:?}",
            t.id
        );
        assert!(line.contains(&t.status), "{line:?}");
    }
    assert_eq!(lines.next(), None, "nothing else was appended");
    // The context carries the same text: the todos survive into the next request.
    let ctx = get_context(&mut client, SID).await;
    assert_eq!(text_of(&ctx.messages[1]), text);
}

#[tokio::test]
async fn the_cost_is_the_reported_usage_at_the_configured_prices() {
    const PRICE: (f64, f64) = (2.5, 10.0);
    let fake = FakeLlm::start(vec![
        Reply::text(["priced ", "summary"]).with_usage(Some((12_345, 678))),
    ])
    .await;
    let server = server_with(&fake, |c| c.price_per_mtok = PRICE).await;
    let mut client = server.client().await;
    seed_session(&mut client, SID).await;
    let mut watch = subscribe(&mut client, SID).await;

    let events = compact(&mut client, SID).await;
    let done = compacted(&events);
    let u = done.usage.as_ref().expect("usage from the stream");
    assert_eq!((u.input, u.output), (12_345, 678));
    let expected = (12_345.0 * PRICE.0 + 678.0 * PRICE.1) / 1e6;
    assert!(
        (done.cost - expected).abs() < 1e-12,
        "cost {} != {expected}",
        done.cost
    );
    assert!(done.cost > 0.0);

    // The summary message records the same cost and usage.
    let session = get_session(&mut client, SID).await;
    let info = stored_message(&session, &done.summary_message_id)
        .info
        .clone()
        .expect("info");
    assert_eq!(info.cost, done.cost);
    let tokens = info.tokens.expect("tokens on the summary");
    assert_eq!((tokens.input, tokens.output), (12_345, 678));

    // And so does the watcher's session.compacted.
    let watched = loop {
        let e = next_watched(&mut watch).await.expect("event");
        if let Some(Se::Compaction(pb::CompactionEvent {
            event: Some(Ce::Compacted(c)),
            ..
        })) = e.event
        {
            break c;
        }
    };
    assert_eq!(watched.cost, done.cost);
}

/// One finished assistant step `msg` answering `user`, with `read` outputs of the given
/// sizes; returns the finishing update's events.
async fn read_step(
    s: &mut EventStream,
    sid: &str,
    user: &str,
    msg: &str,
    outputs: &[(&str, usize)],
) -> Vec<pb::ServerEvent> {
    s.expect_ack(sid, upsert_message(assistant_msg(msg, user)))
        .await;
    for (id, chars) in outputs {
        let part = tool_part(msg, id, "read", &output_of(id, *chars));
        s.expect_ack(sid, upsert_part(part)).await;
    }
    s.request(sid, upsert_message(finished(assistant_msg(msg, user))))
        .await
}

/// What a compaction's commit applies of the decisions the cache-aware scheduler held
/// (masking `t1`, whose saving did not pay for the cache rewrite) reaches the Stream
/// that ran the compaction, as a `pruned` event right after `compacted`, under its seq,
/// as it reaches a watcher. Before, only `Subscribe` heard of it: the host's view of
/// which outputs are cleared drifted.
#[tokio::test]
async fn the_prune_a_commit_applies_reaches_the_stream_that_compacted() {
    let fake = FakeLlm::start(vec![Reply::text(["the first turn, summarized"])]).await;
    // compactd's own strategies and cache model (the defaults), not ACP's.
    let server = start_server_with(
        compactd::server::ServerOptions {
            compaction: compaction_config(llm_config(&fake)),
            ..Default::default()
        },
        compactd::config::EngineConfig::default(),
    )
    .await;
    let mut s = server.stream().await;
    let sid = "held-at-commit";
    let config = pb::SessionConfig {
        mask_keep: Some(2),
        cache_model: "anthropic".into(),
        ..Default::default()
    };
    s.expect_ack(sid, open(session_with_config(sid, 200_000, 20_000, config)))
        .await;
    // A first turn, to summarize; then one whose newest outputs push t1 out of the
    // newest two while the ~10,000 tokens after it are cached: masking it is held (the
    // turn stays within the 15,000 tokens a compaction keeps).
    for (user, text) in [("u0", "look around"), ("u1", "read both files")] {
        s.expect_ack(sid, upsert_message(user_msg(user))).await;
        s.expect_ack(
            sid,
            upsert_part(text_part(user, &format!("{user}-t"), text)),
        )
        .await;
        if user == "u0" {
            read_step(&mut s, sid, "u0", "a0", &[("t0", 4_000)]).await;
        }
    }
    read_step(&mut s, sid, "u1", "a1", &[("t1", 2_000)]).await;
    read_step(&mut s, sid, "u1", "a2", &[("t2", 40_000)]).await;
    let a3 = read_step(&mut s, sid, "u1", "a3", &[("t3", 200)]).await;
    assert_eq!(kinds(&a3), ["ack"], "masking t1 is held: {a3:?}");

    let seq = s
        .send(
            sid,
            pb::client_update::Update::Compact(pb::CompactOptions {
                tail_turns: Some(1),
                ..Default::default()
            }),
        )
        .await;
    assert_eq!(kinds(&s.reply(seq).await), ["compaction", "ack"]);
    let events = follow(&mut s, seq).await;
    assert_eq!(names(&events).last(), Some(&"compacted"), "{events:?}");
    // A guard (not a speed assertion): a missing event fails instead of hanging.
    let next = tokio::time::timeout(std::time::Duration::from_secs(20), s.next_event())
        .await
        .unwrap_or_else(|_| panic!("no event followed {events:?}"));
    assert_eq!(next.seq, seq, "{next:?}");
    let Some(pb::server_event::Event::Pruned(report)) = &next.event else {
        panic!("expected the commit's prune, got {next:?}")
    };
    let marked: Vec<&str> = report.marked.iter().map(|m| m.part_id.as_str()).collect();
    assert!(marked.contains(&"t1"), "{report:?}");
}
