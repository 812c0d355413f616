//! The aggressive strategies through the API: on by default, reported by strategy in the
//! `pruned` event and the `Prune` reply, visible as marks in `GetSession` and as
//! rewrites in `GetContext`, switchable per session by either spelling of their names.

use compactd::server::pb;

use crate::common::*;

const SID: &str = "strat";

/// A tool call with a real input.
fn call(message: &str, id: &str, tool: &str, input: serde_json::Value, output: &str) -> pb::Part {
    let mut p = tool_part(message, id, tool, output);
    if let Some(pb::part::Kind::Tool(t)) = &mut p.kind {
        t.state.as_mut().expect("state").input = Some(json_to_struct(&input));
    }
    p
}

/// One turn: read `src/lib.rs`, run `git status`; a second turn edits the file and runs
/// `git status` again; the assistant message of turn 2 is left unfinished.
async fn build(c: &mut Client, config: Option<pb::SessionConfig>) {
    let mut info = session_with_limits(SID, 200_000, 20_000);
    info.config = config;
    open_session(c, info).await;
    put_message(c, SID, user_msg("u1")).await;
    put_part(c, SID, text_part("u1", "u1-t", "look at lib.rs")).await;
    put_message(c, SID, assistant_msg("a1", "u1")).await;
    let read = serde_json::json!({"filePath": "src/lib.rs"});
    put_part(
        c,
        SID,
        call("a1", "r1", "read", read, &output_of("r1", 8_000)),
    )
    .await;
    let status = serde_json::json!({"command": "git status"});
    put_part(
        c,
        SID,
        call("a1", "g1", "bash", status.clone(), &output_of("g1", 2_000)),
    )
    .await;
    put_message(c, SID, finished(assistant_msg("a1", "u1"))).await;
    put_message(c, SID, user_msg("u2")).await;
    put_part(c, SID, text_part("u2", "u2-t", "fix it")).await;
    put_message(c, SID, assistant_msg("a2", "u2")).await;
    let edit = serde_json::json!({"filePath": "./src/lib.rs", "oldString": "a".repeat(2_000), "newString": "b"});
    put_part(c, SID, call("a2", "e1", "edit", edit, "Edit applied.")).await;
    put_part(
        c,
        SID,
        call("a2", "g2", "bash", status, &output_of("g2", 2_000)),
    )
    .await;
}

fn savings(r: &pb::PruneReport) -> Vec<(&str, u32)> {
    r.strategies
        .iter()
        .map(|s| (s.strategy.as_str(), s.parts))
        .collect()
}

#[tokio::test]
async fn a_finished_message_supersedes_stale_calls_and_reports_each_strategy() {
    let server = start_acp_server().await;
    let mut c = server.client().await;
    build(&mut c, None).await;
    let before = get_context(&mut c, SID).await.estimated_tokens;

    let events = put_message(&mut c, SID, finished(assistant_msg("a2", "u2"))).await;
    let reports = pruned(&events);
    assert_eq!(reports.len(), 1, "{events:?}");
    let r = reports[0];
    assert!(!r.committed, "OpenCode's prune had nothing to clear: {r:?}");
    assert_eq!(
        savings(r),
        [("stateQuerySupersede", 1), ("aggressiveFilePrune", 1)],
        "{r:?}"
    );
    let marked: Vec<(&str, &str, &str)> = r
        .marked
        .iter()
        .map(|m| {
            (
                m.part_id.as_str(),
                m.strategy.as_str(),
                m.superseded_by.as_str(),
            )
        })
        .collect();
    assert_eq!(
        marked,
        [
            ("r1", "aggressiveFilePrune", "call_e1"),
            ("g1", "stateQuerySupersede", "call_g2")
        ]
    );
    let after = get_context(&mut c, SID).await.estimated_tokens;
    assert_eq!(
        before - after,
        r.strategy_tokens_saved,
        "the report is the context delta"
    );
    assert_eq!(
        r.strategy_tokens_saved,
        r.strategies.iter().map(|s| s.tokens).sum::<u64>()
    );

    // The context reads the supersede note; the session keeps the original and the mark.
    let ctx = get_context(&mut c, SID).await;
    let r1 = tool_state(find_part(&ctx.messages, "r1"));
    assert_eq!(r1.output, "[Superseded by a newer call: call_e1]");
    let session = get_session(&mut c, SID).await;
    let stored = find_part(&session.messages, "r1");
    assert_eq!(tool_state(stored).output, output_of("r1", 8_000));
    let mark = stored.mark.as_ref().expect("marked");
    assert_eq!(
        (mark.strategy.as_str(), mark.superseded_by.as_str()),
        ("aggressiveFilePrune", "call_e1")
    );
    // The newest calls are untouched.
    assert!(find_part(&session.messages, "e1").mark.is_none());
    assert!(find_part(&session.messages, "g2").mark.is_none());

    // Nothing left to do: a second run marks nothing.
    let again = prune(&mut c, SID, false).await;
    assert!(again.marked.is_empty(), "{again:?}");
}

#[tokio::test]
async fn a_dry_run_lists_the_marks_and_changes_nothing() {
    let server = start_acp_server().await;
    let mut c = server.client().await;
    // Automatic prune off, so the marks wait for an explicit Prune.
    build(
        &mut c,
        Some(pb::SessionConfig {
            prune: Some(false),
            ..Default::default()
        }),
    )
    .await;
    put_message(&mut c, SID, finished(assistant_msg("a2", "u2"))).await;
    let before = get_session(&mut c, SID).await;
    let dry = prune(&mut c, SID, true).await;
    assert_eq!(dry.marked.len(), 2, "{dry:?}");
    assert_eq!(
        get_session(&mut c, SID).await,
        before,
        "a dry run changes nothing"
    );
    let real = prune(&mut c, SID, false).await;
    assert_eq!(dry.marked, real.marked);
    assert_eq!(dry.strategies, real.strategies);
}

#[tokio::test]
async fn strategies_switch_per_session_by_either_name_and_marks_are_lazy() {
    let server = start_acp_server().await;
    let mut c = server.client().await;
    let off = |names: &[&str]| pb::SessionConfig {
        strategies: names.iter().map(|n| (n.to_string(), false)).collect(),
        ..Default::default()
    };
    build(&mut c, Some(off(&["aggressive_file_prune"]))).await;
    let events = put_message(&mut c, SID, finished(assistant_msg("a2", "u2"))).await;
    let r = pruned(&events)[0];
    let strategies: Vec<&str> = r.marked.iter().map(|m| m.strategy.as_str()).collect();
    assert_eq!(strategies, ["stateQuerySupersede"], "{r:?}");

    // Switching the applied one off restores its content in the context at once.
    let with_mark = get_context(&mut c, SID).await.estimated_tokens;
    open_session(
        &mut c,
        pb::SessionInfo {
            config: Some(off(&["stateQuerySupersede"])),
            ..session(SID)
        },
    )
    .await;
    let ctx = get_context(&mut c, SID).await;
    assert_eq!(
        tool_state(find_part(&ctx.messages, "g1")).output,
        output_of("g1", 2_000)
    );
    assert!(ctx.estimated_tokens > with_mark);

    // The `verbose` preset turns every strategy off.
    open_session(
        &mut c,
        pb::SessionInfo {
            config: Some(pb::SessionConfig {
                strategy_preset: "verbose".into(),
                ..Default::default()
            }),
            ..session("quiet")
        },
    )
    .await;
    let shown = get_session(&mut c, "quiet").await.info.expect("info");
    assert_eq!(shown.config.expect("config").strategy_preset, "verbose");
}

#[tokio::test]
async fn unknown_strategy_names_presets_and_bad_globs_are_invalid_arguments() {
    let server = start_acp_server().await;
    let mut c = server.client().await;
    for (config, field) in [
        (
            pb::SessionConfig {
                strategies: [("pruneEverything".to_string(), true)].into(),
                ..Default::default()
            },
            "strategies",
        ),
        (
            pb::SessionConfig {
                strategy_preset: "tiny".into(),
                ..Default::default()
            },
            "strategy_preset",
        ),
        (
            pb::SessionConfig {
                protected_file_globs: Some(pb::StringList {
                    values: vec!["src/[".into()],
                }),
                ..Default::default()
            },
            "protected_file_globs",
        ),
    ] {
        let result = c
            .open_session(pb::OpenSessionRequest {
                session: Some(pb::SessionInfo {
                    config: Some(config),
                    ..session("bad")
                }),
            })
            .await;
        assert_status(result, tonic::Code::InvalidArgument, field);
    }
    // Nothing was created.
    let listed = c
        .list_sessions(pb::ListSessionsRequest::default())
        .await
        .expect("list")
        .into_inner();
    assert!(listed.sessions.iter().all(|s| s.id != "bad"));
}

#[tokio::test]
async fn protected_file_globs_keep_their_operations() {
    let server = start_acp_server().await;
    let mut c = server.client().await;
    build(
        &mut c,
        Some(pb::SessionConfig {
            protected_file_globs: Some(pb::StringList {
                values: vec!["src/**".into()],
            }),
            ..Default::default()
        }),
    )
    .await;
    let events = put_message(&mut c, SID, finished(assistant_msg("a2", "u2"))).await;
    let r = pruned(&events)[0];
    let ids: Vec<&str> = r.marked.iter().map(|m| m.part_id.as_str()).collect();
    assert_eq!(ids, ["g1"], "the read of src/lib.rs is protected: {r:?}");
}
