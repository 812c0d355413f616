//! OpenCode's prune through the API: automatic after a finished assistant message,
//! on request (`Prune`, with `dry_run`), and what the context and the stored session
//! look like afterwards.

use std::collections::BTreeMap;

use compactd::server::pb;
use compactd::server::pb::client_update::Update;
use compactd::server::pb::server_event::Event;

use crate::common::*;

/// 100_000 chars = 25_000 tokens under chars/4.
const BIG: usize = 100_000;
const BIG_TOKENS: u64 = 25_000;

/// Tool outputs of the prunable session, by part id: (message, tool, output).
fn layout() -> Vec<(&'static str, &'static str, &'static str, String)> {
    vec![
        // Turn 1: old outputs. `skill` is a protected tool and is never pruned.
        ("a1", "t0", "skill", output_of("t0", BIG)),
        ("a1", "t1", "read", output_of("t1", BIG)),
        ("a1", "t2", "read", output_of("t2", BIG)),
        ("a1", "t3", "bash", output_of("t3", BIG)),
        ("a1", "t4", "grep", output_of("t4", BIG)),
        // Turns 2 and 3 are the last two user turns: never touched.
        ("a2", "t5", "read", output_of("t5", 4_000)),
        ("a3", "t6", "read", output_of("t6", BIG)),
    ]
}

/// The parts prune must clear: turn 1's outputs beyond the newest 40000 tokens
/// (t4 is protected by PRUNE_PROTECT, t0 by being a `skill` output), oldest first.
const EXPECTED_PRUNED: [&str; 3] = ["t1", "t2", "t3"];

/// Builds three user turns with big tool outputs in the first. The last assistant
/// message (`a3`) is left unfinished, so nothing has been pruned yet.
async fn build_prunable(c: &mut Client, info: pb::SessionInfo) {
    let sid = info.id.clone();
    open_session(c, info).await;
    let layout = layout();
    for (user, assistant) in [("u1", "a1"), ("u2", "a2"), ("u3", "a3")] {
        put_message(c, &sid, user_msg(user)).await;
        put_part(c, &sid, text_part(user, &format!("{user}-text"), "do it")).await;
        let mut a = assistant_msg(assistant, user);
        if assistant != "a3" {
            a.finish = "tool-calls".into();
        }
        let ev = put_message(c, &sid, a).await;
        assert!(pruned(&ev).is_empty(), "nothing to prune yet: {ev:?}");
        put_part(
            c,
            &sid,
            text_part(assistant, &format!("{assistant}-text"), "ok"),
        )
        .await;
        for (m, id, tool, out) in layout.iter().filter(|(m, ..)| *m == assistant) {
            let ev = put_part(c, &sid, tool_part(m, id, tool, out)).await;
            assert_eq!(kinds(&ev), ["ack"]);
        }
    }
}

fn part_ids(r: &pb::PruneReport) -> Vec<&str> {
    r.parts.iter().map(|p| p.part_id.as_str()).collect()
}

fn assert_expected_report(r: &pb::PruneReport) {
    assert_eq!(part_ids(r), EXPECTED_PRUNED, "{r:?}");
    assert!(r.parts.iter().all(|p| p.message_id == "a1"), "{r:?}");
    for p in &r.parts {
        assert_eq!(p.call_id, format!("call_{}", p.part_id));
        assert_eq!(p.tokens, BIG_TOKENS);
    }
    let tools: Vec<_> = r.parts.iter().map(|p| p.tool.as_str()).collect();
    assert_eq!(tools, ["read", "read", "bash"]);
    assert_eq!(r.tokens_saved, 3 * BIG_TOKENS);
    assert!(r.tokens_saved > 20_000);
    // Scanned: the pruned outputs plus the protected window (t4).
    assert_eq!(r.tokens_scanned, 4 * BIG_TOKENS);
    assert_eq!((r.prune_protect, r.prune_minimum), (40_000, 20_000));
}

/// Outputs of every tool part in a set of messages, by part id.
fn outputs(messages: &[pb::Message]) -> BTreeMap<String, (String, Option<i64>)> {
    messages
        .iter()
        .flat_map(|m| &m.parts)
        .filter(|p| matches!(p.kind, Some(pb::part::Kind::Tool(_))))
        .map(|p| {
            let st = tool_state(p);
            (
                p.id.clone(),
                (
                    st.output.clone(),
                    st.time.as_ref().and_then(|t| t.compacted),
                ),
            )
        })
        .collect()
}

#[tokio::test]
async fn finishing_an_assistant_message_prunes_old_tool_outputs() {
    let server = start_acp_server().await;
    let mut c = server.client().await;
    let sid = "p-auto";
    build_prunable(&mut c, session(sid)).await;
    let ctx_before = get_context(&mut c, sid).await;

    let mut s = server.stream().await;
    let seq = s
        .send(sid, upsert_message(finished(assistant_msg("a3", "u3"))))
        .await;
    let events = s.reply(seq).await;
    assert_eq!(kinds(&events), ["pruned", "ack"], "{events:?}");
    assert!(events.iter().all(|e| e.seq == seq && e.session_id == sid));
    let report = pruned(&events)[0];
    assert!(report.committed);
    assert!(!report.dry_run);
    assert_eq!(report.reason, "");
    assert_expected_report(report);
    // None of the pruned parts is in the last two user turns (u2 onwards).
    let session = get_session(&mut c, sid).await;
    let position = |id: &str| {
        session
            .messages
            .iter()
            .position(|m| m.info.as_ref().unwrap().id == id)
            .unwrap()
    };
    for p in &report.parts {
        assert!(position(&p.message_id) < position("u2"), "{p:?}");
    }

    // The stored session keeps every output; only the pruned ones carry `compacted`.
    let stored = outputs(&session.messages);
    for (_, id, _, out) in layout() {
        let (have, compacted) = &stored[id];
        assert_eq!(have, &out, "{id}: original output kept (lazy deletion)");
        assert_eq!(
            compacted.is_some(),
            EXPECTED_PRUNED.contains(&id),
            "{id}: compacted = {compacted:?}"
        );
    }
    assert_eq!(session.summary.as_ref().unwrap().compacted_parts, 3);

    // The context shows the placeholder instead of the pruned outputs, in both shapes.
    let ctx = get_context(&mut c, sid).await;
    let shown = outputs(&ctx.messages);
    for (_, id, _, out) in layout() {
        let want = if EXPECTED_PRUNED.contains(&id) {
            PLACEHOLDER.to_string()
        } else {
            out
        };
        assert_eq!(shown[id].0, want, "{id} in the native context");
    }
    let openai = list_to_json(&ctx.openai_messages.as_ref().unwrap().values);
    let results: BTreeMap<String, String> = openai
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["role"] == "tool")
        .map(|m| {
            (
                m["tool_call_id"].as_str().unwrap().to_string(),
                m["content"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert_eq!(results.len(), layout().len());
    for (_, id, _, out) in layout() {
        let want = if EXPECTED_PRUNED.contains(&id) {
            PLACEHOLDER.to_string()
        } else {
            out
        };
        assert_eq!(
            results[&format!("call_{id}")],
            want,
            "{id} in openai_messages"
        );
    }
    let placeholder = tokens_of(PLACEHOLDER);
    assert_eq!(
        ctx.estimated_tokens,
        ctx_before.estimated_tokens - 3 * BIG_TOKENS + 3 * placeholder
    );

    // The next finished turn finds nothing new to prune (no churn).
    s.expect_ack(sid, upsert_message(user_msg("u4"))).await;
    let events = s
        .request(sid, upsert_message(completed(assistant_msg("a4", "u4"))))
        .await;
    assert_eq!(kinds(&events), ["ack"], "{events:?}");
    assert_eq!(
        get_session(&mut c, sid)
            .await
            .summary
            .unwrap()
            .compacted_parts,
        3
    );
}

#[tokio::test]
async fn the_unary_twin_reports_the_automatic_prune_in_its_events() {
    let server = start_acp_server().await;
    let mut c = server.client().await;
    let sid = "p-unary";
    build_prunable(&mut c, session(sid)).await;
    let ev = put_message(&mut c, sid, completed(assistant_msg("a3", "u3"))).await;
    assert_eq!(kinds(&ev), ["pruned", "ack"], "{ev:?}");
    assert!(pruned(&ev)[0].committed);
    assert_expected_report(pruned(&ev)[0]);
}

#[tokio::test]
async fn a_dry_run_reports_the_same_parts_and_changes_nothing() {
    let server = start_acp_server().await;
    let mut c = server.client().await;

    // The automatic prune on one session...
    build_prunable(&mut c, session("p-auto-twin")).await;
    let ev = put_message(&mut c, "p-auto-twin", finished(assistant_msg("a3", "u3"))).await;
    let auto = pruned(&ev)[0].clone();

    // ...and a dry run on an equivalent one that was never pruned.
    let sid = "p-dry";
    build_prunable(&mut c, session(sid)).await;
    let before = get_session(&mut c, sid).await;
    let ctx_before = get_context(&mut c, sid).await;

    let dry = prune(&mut c, sid, true).await;
    assert!(dry.dry_run);
    assert!(!dry.committed);
    assert_eq!(dry.reason, "dry run");
    assert_eq!(dry.parts, auto.parts);
    assert_eq!(dry.tokens_saved, auto.tokens_saved);
    assert_expected_report(&dry);
    assert_eq!(
        get_session(&mut c, sid).await,
        before,
        "dry run changed the session"
    );
    assert_eq!(get_context(&mut c, sid).await, ctx_before);

    // Dry runs are repeatable; the commit then does exactly what they said.
    assert_eq!(prune(&mut c, sid, true).await, dry);
    let real = prune(&mut c, sid, false).await;
    assert!(real.committed && !real.dry_run);
    assert_eq!(real.parts, dry.parts);
    assert_eq!(real.tokens_saved, dry.tokens_saved);
    let after = get_session(&mut c, sid).await;
    assert_eq!(after.summary.unwrap().compacted_parts, 3);
    let stored = outputs(&after.messages);
    for id in EXPECTED_PRUNED {
        assert!(stored[id].1.is_some(), "{id} compacted");
    }

    // Pruning again finds nothing.
    let again = prune(&mut c, sid, false).await;
    assert!(!again.committed);
    assert!(again.parts.is_empty(), "{again:?}");
    assert_eq!(again.tokens_saved, 0);
}

#[tokio::test]
async fn the_stream_prune_update_answers_with_a_prune_report() {
    let server = start_acp_server().await;
    let mut c = server.client().await;
    let sid = "p-stream-manual";
    build_prunable(&mut c, session(sid)).await;
    let before = get_session(&mut c, sid).await;
    let mut s = server.stream().await;

    let events = s
        .request(sid, Update::Prune(pb::PruneOptions { dry_run: true }))
        .await;
    assert_eq!(kinds(&events), ["prune_report", "ack"]);
    let Some(Event::PruneReport(dry)) = &events[0].event else {
        unreachable!()
    };
    assert!(dry.dry_run && !dry.committed);
    assert_expected_report(dry);
    assert_eq!(get_session(&mut c, sid).await, before);

    let events = s
        .request(sid, Update::Prune(pb::PruneOptions { dry_run: false }))
        .await;
    assert_eq!(
        kinds(&events),
        ["prune_report", "ack"],
        "a manual prune is not a `pruned` event"
    );
    let Some(Event::PruneReport(real)) = &events[0].event else {
        unreachable!()
    };
    assert!(real.committed);
    assert_eq!(real.parts, dry.parts);
}

#[tokio::test]
async fn automatic_prune_can_be_turned_off_per_session() {
    let server = start_acp_server().await;
    let mut c = server.client().await;
    let sid = "p-off";
    build_prunable(
        &mut c,
        pb::SessionInfo {
            config: Some(pb::SessionConfig {
                prune: Some(false),
                ..Default::default()
            }),
            ..session(sid)
        },
    )
    .await;
    let ev = put_message(&mut c, sid, finished(assistant_msg("a3", "u3"))).await;
    assert_eq!(kinds(&ev), ["ack"], "{ev:?}");
    let got = get_session(&mut c, sid).await;
    assert_eq!(got.summary.unwrap().compacted_parts, 0);
    assert!(outputs(&got.messages).values().all(|(_, c)| c.is_none()));
}

#[tokio::test]
async fn a_session_chooses_its_own_placeholder_and_empty_texts_are_refused() {
    let server = start_acp_server().await;
    let mut c = server.client().await;
    let sid = "p-own";
    build_prunable(
        &mut c,
        pb::SessionInfo {
            config: Some(pb::SessionConfig {
                placeholder: Some("[gone: re-run the tool]".into()),
                ..Default::default()
            }),
            ..session(sid)
        },
    )
    .await;
    let ev = put_message(&mut c, sid, finished(assistant_msg("a3", "u3"))).await;
    assert_expected_report(pruned(&ev)[0]);
    let shown = outputs(&get_context(&mut c, sid).await.messages);
    for id in EXPECTED_PRUNED {
        assert_eq!(shown[id].0, "[gone: re-run the tool]", "{id}");
    }
    // An empty placeholder would erase outputs silently; an oversized one is refused too.
    // Either way the session keeps its settings.
    for (bad, why) in [
        (" ".to_string(), "must not be empty"),
        ("x".repeat(2_000), "at most 1024"),
    ] {
        let r = c
            .open_session(pb::OpenSessionRequest {
                session: Some(pb::SessionInfo {
                    config: Some(pb::SessionConfig {
                        placeholder: Some(bad),
                        ..Default::default()
                    }),
                    ..session(sid)
                }),
            })
            .await;
        let status = assert_status(r, tonic::Code::InvalidArgument, "placeholder");
        assert!(status.message().contains(why), "{status:?}");
    }
    let info = get_session(&mut c, sid).await.info.expect("info");
    assert_eq!(
        info.config.and_then(|c| c.placeholder).as_deref(),
        Some("[gone: re-run the tool]")
    );
}

#[tokio::test]
async fn nothing_is_committed_unless_the_saving_is_above_prune_minimum() {
    let server = start_acp_server().await;
    let mut c = server.client().await;
    // Newest old output: exactly PRUNE_PROTECT (40000 tokens); older one: `extra` tokens.
    for (sid, older_chars, commits) in [("p-min-eq", 80_000, false), ("p-min-gt", 80_004, true)] {
        open_session(&mut c, session(sid)).await;
        put_message(&mut c, sid, user_msg("u1")).await;
        put_message(&mut c, sid, assistant_msg("a1", "u1")).await;
        put_part(
            &mut c,
            sid,
            tool_part("a1", "old", "read", &output_of("old", older_chars)),
        )
        .await;
        put_part(
            &mut c,
            sid,
            tool_part("a1", "new", "read", &output_of("new", 160_000)),
        )
        .await;
        for (u, a) in [("u2", "a2"), ("u3", "a3")] {
            put_message(&mut c, sid, user_msg(u)).await;
            put_message(&mut c, sid, assistant_msg(a, u)).await;
        }
        let dry = prune(&mut c, sid, true).await;
        assert_eq!(part_ids(&dry), ["old"], "{sid}: {dry:?}");
        assert_eq!(dry.tokens_saved, tokens_of(&output_of("old", older_chars)));

        let ev = put_message(&mut c, sid, finished(assistant_msg("a3", "u3"))).await;
        if commits {
            assert_eq!(kinds(&ev), ["pruned", "ack"], "{sid}: {ev:?}");
            assert_eq!(pruned(&ev)[0].tokens_saved, 20_001);
        } else {
            assert_eq!(kinds(&ev), ["ack"], "{sid}: {ev:?}");
            let r = prune(&mut c, sid, false).await;
            assert!(!r.committed);
            assert_eq!(r.tokens_saved, 20_000);
            assert!(r.reason.contains("PRUNE_MINIMUM"), "{r:?}");
            assert_eq!(
                get_session(&mut c, sid)
                    .await
                    .summary
                    .unwrap()
                    .compacted_parts,
                0
            );
        }
    }
}

#[tokio::test]
async fn pruned_outputs_no_longer_count_towards_the_prediction() {
    let server = start_acp_server().await;
    let mut c = server.client().await;
    let sid = "p-predicted";
    // Generous limits: usable 368000, threshold 338560.
    build_prunable(&mut c, session_with_limits(sid, 400_000, 32_000)).await;
    let before = check_overflow(&mut c, sid).await;
    let summary = get_session(&mut c, sid).await.summary.unwrap();
    // No usage was ever reported: the prediction is everything added.
    assert_eq!(before.used, 0);
    assert_eq!(before.predicted, summary.estimated_tokens);

    let ev = put_message(&mut c, sid, finished(assistant_msg("a3", "u3"))).await;
    assert_eq!(kinds(&ev), ["pruned", "ack"], "{ev:?}");
    let after = check_overflow(&mut c, sid).await;
    assert_eq!(
        after.predicted,
        before.predicted - 3 * BIG_TOKENS + 3 * tokens_of(PLACEHOLDER)
    );
}

#[tokio::test]
async fn a_finished_turn_over_the_threshold_reports_overflow_then_pruned_then_ack() {
    let server = start_acp_server().await;
    let mut c = server.client().await;
    let sid = "p-both";
    // usable 80000, threshold 73600; the session holds about 176000 tokens.
    build_prunable(&mut c, session_with_limits(sid, 100_000, 20_000)).await;
    let mut s = server.stream().await;
    let seq = s
        .send(sid, upsert_message(finished(assistant_msg("a3", "u3"))))
        .await;
    let events = s.reply(seq).await;
    assert_eq!(kinds(&events), ["overflow", "pruned", "ack"], "{events:?}");
    let o = overflows(&events)[0];
    assert_eq!(
        (o.crossed.as_str(), o.trigger.as_str()),
        ("predicted", "finished")
    );
    assert_expected_report(pruned(&events)[0]);
}

/// A prune on request that changes the session, by the unary `Prune` or the Stream's
/// `prune` update, is published to Subscribe watchers as a `pruned` event, as an
/// automatic one is; a dry run, and a prune that finds nothing, publish nothing. Before,
/// only automatic prunes were published: a watcher never heard of a manual one. The bus
/// keeps the order of the calls, so each event seen first after a dry run or a prune
/// that found nothing shows that these published nothing.
#[tokio::test]
async fn a_prune_on_request_is_published_to_watchers_and_a_dry_run_is_not() {
    use crate::common::compaction::next_watched;
    use pb::session_event::Event as Se;
    let server = start_acp_server().await;
    let mut c = server.client().await;
    let (unary, streamed, last) = ("p-watch-unary", "p-watch-stream", "p-watch-last");
    for sid in [unary, streamed, last] {
        build_prunable(&mut c, session(sid)).await;
    }
    let mut watch = subscribe(&mut c, "").await;
    let mut next_pruned = async |sid: &str| {
        let e = next_watched(&mut watch).await.expect("an event");
        assert_eq!(e.session_id, sid, "{e:?}");
        let Some(Se::Pruned(r)) = e.event else {
            panic!("a pruned event: {e:?}")
        };
        r
    };

    // The unary Prune: its dry run publishes nothing, its commit the report it answers.
    let dry = prune(&mut c, unary, true).await;
    assert!(dry.dry_run && !dry.committed);
    let real = prune(&mut c, unary, false).await;
    assert!(real.committed);
    assert_eq!(next_pruned(unary).await, real);
    let again = prune(&mut c, unary, false).await;
    assert!(!again.committed && again.parts.is_empty(), "{again:?}");

    // The Stream's prune update, the same (its own events stay a prune_report).
    let mut s = server.stream().await;
    let mut reports = Vec::new();
    for dry_run in [true, false, false] {
        let events = s
            .request(streamed, Update::Prune(pb::PruneOptions { dry_run }))
            .await;
        assert_eq!(kinds(&events), ["prune_report", "ack"]);
        let Some(Event::PruneReport(r)) = &events[0].event else {
            unreachable!()
        };
        reports.push(r.clone());
    }
    assert!(reports[1].committed && !reports[2].committed, "{reports:?}");
    assert_eq!(next_pruned(streamed).await, reports[1]);

    // The prune that found nothing published nothing: the next event is another's.
    let other = prune(&mut c, last, false).await;
    assert!(other.committed);
    assert_eq!(next_pruned(last).await, other);
}
