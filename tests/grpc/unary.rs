//! The unary twins: each does what its stream update does, and each rejection is a
//! status with the right code and a message naming the field.

use compactd::server::ServerOptions;
use compactd::server::pb;
use tonic::Code;

use crate::common::*;

#[tokio::test]
async fn open_session_creates_then_reconfigures() {
    let server = start_server().await;
    let mut c = server.client().await;

    let s = open_session(&mut c, session_with_limits("u-open", 100_000, 20_000)).await;
    assert!(s.created);
    assert_eq!(s.id, "u-open");
    assert_eq!(s.title, "title of u-open");
    assert_eq!(s.limits, Some(limits(100_000, 20_000)));
    assert_eq!((s.messages, s.parts), (0, 0));
    let o = s.overflow.expect("summary carries the overflow figures");
    assert_eq!((o.usable, o.threshold), (80_000, 73_600));

    // Reopening reconfigures: new title and limits, unset fields kept.
    let s = open_session(
        &mut c,
        pb::SessionInfo {
            id: "u-open".into(),
            title: "renamed".into(),
            limits: Some(limits(200_000, 0)),
            ..Default::default()
        },
    )
    .await;
    assert!(!s.created);
    assert_eq!(s.title, "renamed");
    assert_eq!(s.limits, Some(limits(200_000, 0)));
    let o = s.overflow.unwrap();
    // usable = 200000 - min(0 → 32000, 32000)
    assert_eq!(o.usable, 168_000);

    // An open without title or limits changes neither.
    let s = open_session(
        &mut c,
        pb::SessionInfo {
            id: "u-open".into(),
            ..Default::default()
        },
    )
    .await;
    assert_eq!(s.title, "renamed");
    assert_eq!(s.limits, Some(limits(200_000, 0)));

    let got = get_session(&mut c, "u-open").await;
    assert_eq!(got.info.unwrap().title, "renamed");
}

#[tokio::test]
async fn upserts_deletes_and_reads_work_through_the_unary_twins() {
    let server = start_server().await;
    let mut c = server.client().await;
    let sid = "u-crud";
    open_session(&mut c, session(sid)).await;

    let ev = put_message(&mut c, sid, user_msg("u1")).await;
    assert_eq!(kinds(&ev), ["ack"]);
    assert_eq!(ack(&ev).kind, "upsert_message");
    assert!(ack(&ev).created);
    put_part(&mut c, sid, text_part("u1", "p1", "read main.rs")).await;
    put_message(&mut c, sid, assistant_msg("a1", "u1")).await;
    let ev = put_part(&mut c, sid, tool_part("a1", "t1", "read", "fn main() {}")).await;
    assert_eq!(ack(&ev).kind, "upsert_part");
    assert!(ack(&ev).created);
    put_part(&mut c, sid, text_part("a1", "p2", "done")).await;

    // Updating in place keeps positions.
    let mut u1 = user_msg("u1");
    u1.agent = "plan".into();
    let ev = put_message(&mut c, sid, u1).await;
    assert!(!ack(&ev).created);
    let ev = put_part(
        &mut c,
        sid,
        tool_part("a1", "t1", "read", "fn main() { 1 }"),
    )
    .await;
    assert!(!ack(&ev).created);

    let got = get_session(&mut c, sid).await;
    let ids: Vec<_> = got
        .messages
        .iter()
        .map(|m| m.info.as_ref().unwrap().id.as_str())
        .collect();
    assert_eq!(ids, ["u1", "a1"]);
    assert_eq!(got.messages[0].info.as_ref().unwrap().agent, "plan");
    let part_ids: Vec<_> = got.messages[1]
        .parts
        .iter()
        .map(|p| p.id.as_str())
        .collect();
    assert_eq!(part_ids, ["t1", "p2"]);
    assert_eq!(
        tool_state(&got.messages[1].parts[0]).output,
        "fn main() { 1 }"
    );
    let summary = got.summary.unwrap();
    assert_eq!((summary.messages, summary.parts), (2, 3));

    // Context in both shapes, and each shape alone.
    let ctx = get_context(&mut c, sid).await;
    assert_eq!((ctx.session_messages, ctx.context_messages), (2, 2));
    assert!(ctx.estimated_tokens > 0);
    assert_eq!(ctx.estimated_tokens, summary.context_tokens);
    let openai = list_to_json(&ctx.openai_messages.as_ref().unwrap().values);
    assert_eq!(openai[0]["role"], "user");
    assert_eq!(openai[0]["content"], "read main.rs");
    assert_eq!(openai[1]["role"], "assistant");
    assert_eq!(openai[1]["tool_calls"][0]["id"], "call_t1");
    assert_eq!(openai[1]["tool_calls"][0]["function"]["name"], "read");
    assert_eq!(openai[2]["role"], "tool");
    assert_eq!(openai[2]["tool_call_id"], "call_t1");
    assert_eq!(openai[2]["content"], "fn main() { 1 }");

    let native = get_context_as(&mut c, sid, pb::ContextFormat::Native).await;
    assert_eq!(native.messages.len(), 2);
    assert!(native.openai_messages.is_none());
    let only_openai = get_context_as(&mut c, sid, pb::ContextFormat::Openai).await;
    assert!(only_openai.messages.is_empty());
    assert_eq!(only_openai.openai_messages, ctx.openai_messages);
    assert_eq!(
        (only_openai.estimated_tokens, only_openai.session_messages),
        (ctx.estimated_tokens, ctx.session_messages)
    );
    assert_eq!(only_openai.context_messages, ctx.context_messages);
    assert!(ctx.openai_messages_json.is_empty());
    // The same messages as one JSON text, and nothing else.
    let json = get_context_as(&mut c, sid, pb::ContextFormat::OpenaiJson).await;
    assert!(json.messages.is_empty());
    assert!(json.openai_messages.is_none());
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&json.openai_messages_json).unwrap(),
        openai
    );
    assert_eq!(json.estimated_tokens, ctx.estimated_tokens);

    // Delete a part.
    let ev = c
        .delete_part(pb::DeletePartRequest {
            session_id: sid.into(),
            message_id: "a1".into(),
            part_id: "t1".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .events;
    assert_eq!(ack(&ev).kind, "delete_part");
    let got = get_session(&mut c, sid).await;
    assert_eq!(got.messages[1].parts.len(), 1);
    assert_eq!(got.summary.unwrap().parts, 2);

    // Usage report, stored on the assistant message when named.
    let ev = c
        .report_usage(pb::ReportUsageRequest {
            session_id: sid.into(),
            usage: Some(pb::UsageReport {
                message_id: "a1".into(),
                tokens: Some(pb::TokenUsage {
                    input: 100,
                    output: 20,
                    cache: Some(pb::CacheTokens { read: 5, write: 0 }),
                    ..Default::default()
                }),
            }),
        })
        .await
        .unwrap()
        .into_inner()
        .events;
    assert_eq!(ack(&ev).kind, "report_usage");
    let got = get_session(&mut c, sid).await;
    assert_eq!(
        got.messages[1]
            .info
            .as_ref()
            .unwrap()
            .tokens
            .as_ref()
            .unwrap()
            .input,
        100
    );
    let check = check_overflow(&mut c, sid).await;
    assert_eq!(check.used, 125);
    assert_eq!(check.counting, "input+cache.read+output");
    assert_eq!(check.trigger, "request");
    assert!(!check.overflow);
    assert_eq!(check.reason, "unlimited context (limit.context = 0)");

    // Prune on a small session: a report saying why nothing happened.
    let r = prune(&mut c, sid, false).await;
    assert!(!r.committed && !r.dry_run);
    assert!(r.parts.is_empty());
    assert!(!r.reason.is_empty());
    assert_eq!((r.prune_protect, r.prune_minimum), (40_000, 20_000));
}

#[tokio::test]
async fn list_and_delete_sessions() {
    let server = start_server().await;
    let mut c = server.client().await;
    let empty = c
        .list_sessions(pb::ListSessionsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(empty.sessions.is_empty());

    for id in ["l-b", "l-a", "l-c"] {
        open_session(&mut c, session(id)).await;
    }
    put_message(&mut c, "l-b", user_msg("m1")).await;
    let list = c
        .list_sessions(pb::ListSessionsRequest::default())
        .await
        .unwrap()
        .into_inner();
    let ids: Vec<_> = list.sessions.iter().map(|s| s.id.as_str()).collect();
    assert_eq!(ids, ["l-a", "l-b", "l-c"]);
    assert_eq!(list.sessions[1].messages, 1);
    assert!(list.sessions.iter().all(|s| !s.created));

    let d = c
        .delete_session(pb::DeleteSessionRequest {
            session_id: "l-b".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(d.deleted);
    assert_status(
        c.get_session(pb::GetSessionRequest {
            session_id: "l-b".into(),
        })
        .await,
        Code::NotFound,
        "session_id",
    );
    assert_status(
        c.delete_session(pb::DeleteSessionRequest {
            session_id: "l-b".into(),
        })
        .await,
        Code::NotFound,
        "session_id",
    );
    let list = c
        .list_sessions(pb::ListSessionsRequest::default())
        .await
        .unwrap()
        .into_inner();
    let ids: Vec<_> = list.sessions.iter().map(|s| s.id.as_str()).collect();
    assert_eq!(ids, ["l-a", "l-c"]);

    // A deleted id can be opened afresh.
    let s = open_session(&mut c, session("l-b")).await;
    assert!(s.created);
    assert_eq!(s.messages, 0);
}

/// One `ListSessions` page: its ids and the token of the next.
async fn page(c: &mut Client, page_size: i32, page_token: &str) -> (Vec<String>, String) {
    let r = c
        .list_sessions(pb::ListSessionsRequest {
            page_size,
            page_token: page_token.into(),
        })
        .await
        .expect("ListSessions")
        .into_inner();
    (
        r.sessions.into_iter().map(|s| s.id).collect(),
        r.next_page_token,
    )
}

#[tokio::test]
async fn list_sessions_pages_in_id_order() {
    let server = start_server().await;
    let mut c = server.client().await;
    for id in ["p-e", "p-b", "p-d", "p-a", "p-c"] {
        open_session(&mut c, session(id)).await;
    }
    let (ids, next) = page(&mut c, 2, "").await;
    assert_eq!(
        (ids, next.as_str()),
        (vec!["p-a".into(), "p-b".into()], "p-b")
    );
    // Between pages: one session before the token and one after it are created, one
    // after it deleted; the listing goes on after the token, listing none twice.
    open_session(&mut c, session("p-0")).await;
    open_session(&mut c, session("p-cc")).await;
    c.delete_session(pb::DeleteSessionRequest {
        session_id: "p-d".into(),
    })
    .await
    .expect("DeleteSession");
    let (ids, next) = page(&mut c, 2, &next).await;
    assert_eq!(
        (ids, next.as_str()),
        (vec!["p-c".into(), "p-cc".into()], "p-cc")
    );
    let (ids, next) = page(&mut c, 2, &next).await;
    assert_eq!(ids, ["p-e"]);
    assert_eq!(next, "", "the last page has no next");
    // A page exactly as long as what is left is the last.
    let (ids, next) = page(&mut c, 1, "p-cc").await;
    assert_eq!((ids, next.as_str()), (vec!["p-e".to_string()], ""));
    // 0 lists every session, after a token too; past the last id, none.
    let (ids, next) = page(&mut c, 0, "").await;
    assert_eq!(ids, ["p-0", "p-a", "p-b", "p-c", "p-cc", "p-e"]);
    assert_eq!(next, "");
    assert_eq!(page(&mut c, 0, "p-c").await.0, ["p-cc", "p-e"]);
    assert_eq!(page(&mut c, 3, "p-z").await, (vec![], String::new()));

    assert_status(
        c.list_sessions(pb::ListSessionsRequest {
            page_size: -1,
            page_token: String::new(),
        })
        .await,
        Code::InvalidArgument,
        "page_size",
    );
    // A token is only compared with ids, whatever its length.
    assert_eq!(
        page(&mut c, 2, &"p-d".repeat(100)).await,
        (vec!["p-e".to_string()], String::new())
    );
}

#[tokio::test]
async fn invalid_arguments_are_rejected_naming_the_field() {
    let server = start_server().await;
    let mut c = server.client().await;
    let sid = "u-invalid";
    open_session(&mut c, session(sid)).await;
    put_message(&mut c, sid, user_msg("u1")).await;
    put_message(&mut c, sid, assistant_msg("a1", "u1")).await;
    let before = get_session(&mut c, sid).await;

    // OpenSession
    assert_status(
        c.open_session(pb::OpenSessionRequest { session: None })
            .await,
        Code::InvalidArgument,
        "session",
    );
    assert_status(
        c.open_session(pb::OpenSessionRequest {
            session: Some(session("")),
        })
        .await,
        Code::InvalidArgument,
        "session.id",
    );
    for t in [0.0, -0.1, 1.0001, 2.0, f64::NAN] {
        assert_status(
            c.open_session(pb::OpenSessionRequest {
                session: Some(session_with_config(
                    sid,
                    100_000,
                    20_000,
                    pb::SessionConfig {
                        threshold: Some(t),
                        ..Default::default()
                    },
                )),
            })
            .await,
            Code::InvalidArgument,
            "session.config.threshold",
        );
    }
    // The bounds themselves: (0, 1] includes 1.
    let ok = c
        .open_session(pb::OpenSessionRequest {
            session: Some(session_with_config(
                "u-threshold-1",
                100_000,
                20_000,
                pb::SessionConfig {
                    threshold: Some(1.0),
                    ..Default::default()
                },
            )),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(ok.overflow.unwrap().threshold, 80_000);

    // UpsertMessage
    let mut no_id = user_msg("x");
    no_id.id.clear();
    assert_status(
        c.upsert_message(pb::UpsertMessageRequest {
            session_id: sid.into(),
            message: Some(no_id),
        })
        .await,
        Code::InvalidArgument,
        "message.id",
    );
    let mut system = user_msg("u2");
    system.role = "system".into();
    assert_status(
        c.upsert_message(pb::UpsertMessageRequest {
            session_id: sid.into(),
            message: Some(system),
        })
        .await,
        Code::InvalidArgument,
        "message.role",
    );
    assert_status(
        c.upsert_message(pb::UpsertMessageRequest {
            session_id: sid.into(),
            message: None,
        })
        .await,
        Code::InvalidArgument,
        "message",
    );
    assert_status(
        c.upsert_message(pb::UpsertMessageRequest {
            session_id: String::new(),
            message: Some(user_msg("u2")),
        })
        .await,
        Code::InvalidArgument,
        "session_id",
    );
    let long = "m".repeat(257);
    assert_status(
        c.upsert_message(pb::UpsertMessageRequest {
            session_id: sid.into(),
            message: Some(user_msg(&long)),
        })
        .await,
        Code::InvalidArgument,
        "message.id",
    );

    // UpsertPart
    assert_status(
        c.upsert_part(pb::UpsertPartRequest {
            session_id: sid.into(),
            part: Some(tool_part_with_status("a1", "t1", "read", "finished", "o")),
        })
        .await,
        Code::InvalidArgument,
        "part.tool.state.status",
    );
    // A call id is copied onto the parts a newer call supersedes: bounded like ids.
    let mut long_call = tool_part("a1", "t1", "read", "o");
    if let Some(pb::part::Kind::Tool(t)) = &mut long_call.kind {
        t.call_id = "c".repeat(257);
    }
    assert_status(
        c.upsert_part(pb::UpsertPartRequest {
            session_id: sid.into(),
            part: Some(long_call),
        })
        .await,
        Code::InvalidArgument,
        "part.tool.call_id",
    );
    let mut part_no_id = text_part("u1", "p", "t");
    part_no_id.id.clear();
    assert_status(
        c.upsert_part(pb::UpsertPartRequest {
            session_id: sid.into(),
            part: Some(part_no_id),
        })
        .await,
        Code::InvalidArgument,
        "part.id",
    );
    assert_status(
        c.upsert_part(pb::UpsertPartRequest {
            session_id: sid.into(),
            part: None,
        })
        .await,
        Code::InvalidArgument,
        "part",
    );

    // DeletePart, ReportUsage, GetContext
    assert_status(
        c.delete_part(pb::DeletePartRequest {
            session_id: sid.into(),
            message_id: "a1".into(),
            part_id: String::new(),
        })
        .await,
        Code::InvalidArgument,
        "part_id",
    );
    assert_status(
        c.report_usage(pb::ReportUsageRequest {
            session_id: sid.into(),
            usage: None,
        })
        .await,
        Code::InvalidArgument,
        "usage",
    );
    assert_status(
        c.report_usage(pb::ReportUsageRequest {
            session_id: sid.into(),
            usage: Some(pb::UsageReport::default()),
        })
        .await,
        Code::InvalidArgument,
        "usage.tokens",
    );
    assert_status(
        c.get_context(pb::GetContextRequest {
            session_id: sid.into(),
            format: 42,
        })
        .await,
        Code::InvalidArgument,
        "format",
    );

    // Every RPC that takes a session id requires one.
    assert_status(
        c.get_context(pb::GetContextRequest::default()).await,
        Code::InvalidArgument,
        "session_id",
    );
    assert_status(
        c.prune(pb::PruneRequest::default()).await,
        Code::InvalidArgument,
        "session_id",
    );
    assert_status(
        c.check_overflow(pb::CheckOverflowRequest::default()).await,
        Code::InvalidArgument,
        "session_id",
    );
    assert_status(
        c.get_session(pb::GetSessionRequest::default()).await,
        Code::InvalidArgument,
        "session_id",
    );
    assert_status(
        c.delete_session(pb::DeleteSessionRequest::default()).await,
        Code::InvalidArgument,
        "session_id",
    );

    assert_eq!(get_session(&mut c, sid).await, before, "session unchanged");
}

#[tokio::test]
async fn unknown_sessions_and_parts_are_not_found() {
    let server = start_server().await;
    let mut c = server.client().await;
    let sid = "u-nf";
    open_session(&mut c, session(sid)).await;
    put_message(&mut c, sid, user_msg("u1")).await;
    put_message(&mut c, sid, assistant_msg("a1", "u1")).await;
    put_part(&mut c, sid, tool_part("a1", "t1", "read", "out")).await;
    let before = get_session(&mut c, sid).await;

    let ghost = "no-such-session";
    assert_status(
        c.upsert_message(pb::UpsertMessageRequest {
            session_id: ghost.into(),
            message: Some(user_msg("u1")),
        })
        .await,
        Code::NotFound,
        "session_id",
    );
    assert_status(
        c.upsert_part(pb::UpsertPartRequest {
            session_id: ghost.into(),
            part: Some(text_part("u1", "p1", "x")),
        })
        .await,
        Code::NotFound,
        "session_id",
    );
    assert_status(
        c.delete_part(pb::DeletePartRequest {
            session_id: ghost.into(),
            message_id: "a1".into(),
            part_id: "t1".into(),
        })
        .await,
        Code::NotFound,
        "session_id",
    );
    assert_status(
        c.report_usage(pb::ReportUsageRequest {
            session_id: ghost.into(),
            usage: Some(pb::UsageReport {
                message_id: String::new(),
                tokens: Some(usage(1)),
            }),
        })
        .await,
        Code::NotFound,
        "session_id",
    );
    assert_status(
        c.get_context(pb::GetContextRequest {
            session_id: ghost.into(),
            format: 0,
        })
        .await,
        Code::NotFound,
        "session_id",
    );
    assert_status(
        c.prune(pb::PruneRequest {
            session_id: ghost.into(),
            dry_run: true,
        })
        .await,
        Code::NotFound,
        "session_id",
    );
    assert_status(
        c.check_overflow(pb::CheckOverflowRequest {
            session_id: ghost.into(),
        })
        .await,
        Code::NotFound,
        "session_id",
    );
    assert_status(
        c.get_session(pb::GetSessionRequest {
            session_id: ghost.into(),
        })
        .await,
        Code::NotFound,
        "session_id",
    );

    // Unknown part / message on delete; unknown message for usage.
    assert_status(
        c.delete_part(pb::DeletePartRequest {
            session_id: sid.into(),
            message_id: "a1".into(),
            part_id: "nope".into(),
        })
        .await,
        Code::NotFound,
        "part_id",
    );
    assert_status(
        c.delete_part(pb::DeletePartRequest {
            session_id: sid.into(),
            message_id: "ghost".into(),
            part_id: "t1".into(),
        })
        .await,
        Code::NotFound,
        "message_id",
    );
    assert_status(
        c.report_usage(pb::ReportUsageRequest {
            session_id: sid.into(),
            usage: Some(pb::UsageReport {
                message_id: "ghost".into(),
                tokens: Some(usage(1)),
            }),
        })
        .await,
        Code::NotFound,
        "usage.message_id",
    );

    assert_eq!(get_session(&mut c, sid).await, before);
    let list = c
        .list_sessions(pb::ListSessionsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(list.sessions.len(), 1, "no session was created by a miss");
}

#[tokio::test]
async fn updates_that_do_not_fit_the_session_are_failed_preconditions() {
    let server = start_server().await;
    let mut c = server.client().await;
    let sid = "u-fp";
    open_session(&mut c, session(sid)).await;
    put_message(&mut c, sid, user_msg("u1")).await;
    put_message(&mut c, sid, assistant_msg("a1", "u1")).await;
    let before = get_session(&mut c, sid).await;

    assert_status(
        c.upsert_part(pb::UpsertPartRequest {
            session_id: sid.into(),
            part: Some(text_part("ghost", "p1", "x")),
        })
        .await,
        Code::FailedPrecondition,
        "part.message_id",
    );
    assert_status(
        c.upsert_message(pb::UpsertMessageRequest {
            session_id: sid.into(),
            message: Some(user_msg("a1")),
        })
        .await,
        Code::FailedPrecondition,
        "message.role",
    );
    assert_status(
        c.upsert_message(pb::UpsertMessageRequest {
            session_id: sid.into(),
            message: Some(assistant_msg("u1", "")),
        })
        .await,
        Code::FailedPrecondition,
        "message.role",
    );
    assert_status(
        c.report_usage(pb::ReportUsageRequest {
            session_id: sid.into(),
            usage: Some(pb::UsageReport {
                message_id: "u1".into(),
                tokens: Some(usage(1)),
            }),
        })
        .await,
        Code::FailedPrecondition,
        "usage.message_id",
    );
    assert_eq!(get_session(&mut c, sid).await, before);
}

#[tokio::test]
async fn requests_over_max_update_bytes_are_resource_exhausted() {
    let server = start_server_with_options(ServerOptions {
        max_update_bytes: 1024,
        ..Default::default()
    })
    .await;
    let mut c = server.client().await;
    let sid = "u-big";
    open_session(&mut c, session(sid)).await;
    put_message(&mut c, sid, user_msg("u1")).await;
    put_message(&mut c, sid, assistant_msg("a1", "u1")).await;
    let before = get_session(&mut c, sid).await;

    let big = "z".repeat(2000);
    let s = assert_status(
        c.upsert_part(pb::UpsertPartRequest {
            session_id: sid.into(),
            part: Some(tool_part("a1", "t1", "read", &big)),
        })
        .await,
        Code::ResourceExhausted,
        "max_update_bytes",
    );
    assert!(s.message().contains("1024"), "{s:?}");
    let mut m = user_msg("u2");
    m.agent = big.clone();
    assert_status(
        c.upsert_message(pb::UpsertMessageRequest {
            session_id: sid.into(),
            message: Some(m),
        })
        .await,
        Code::ResourceExhausted,
        "max_update_bytes",
    );
    assert_status(
        c.open_session(pb::OpenSessionRequest {
            session: Some(pb::SessionInfo {
                title: big.clone(),
                ..session("u-big-2")
            }),
        })
        .await,
        Code::ResourceExhausted,
        "max_update_bytes",
    );
    assert_eq!(get_session(&mut c, sid).await, before);

    // Small requests still work on the same server.
    let ev = put_part(&mut c, sid, tool_part("a1", "t1", "read", "small")).await;
    assert!(ack(&ev).created);
}

/// A watcher of one session ends with NOT_FOUND when the session is deleted, after the
/// events sent before; a watcher of every session reads on. Found in review: it stayed
/// open for good (counted in `compactd_watchers`), and a session opened again under the
/// id streamed its unrelated events into it.
#[tokio::test]
async fn a_watcher_of_a_deleted_session_is_told() {
    let server = start_server().await;
    let mut c = server.client().await;
    open_session(&mut c, session("w-del")).await;
    open_session(&mut c, session("w-other")).await;
    let mut one = subscribe(&mut c, "w-del").await;
    let mut all = subscribe(&mut c, "").await;
    c.delete_session(pb::DeleteSessionRequest {
        session_id: "w-del".into(),
    })
    .await
    .expect("DeleteSession");
    let end = tokio::time::timeout(std::time::Duration::from_secs(5), one.message())
        .await
        .expect("the watcher is told within 5 s");
    let status = end.expect_err("ends with a status");
    assert_eq!(status.code(), Code::NotFound, "{status:?}");
    assert!(status.message().contains("w-del"), "{status:?}");
    // The watcher of every session saw nothing of the marker and is still open.
    let quiet = tokio::time::timeout(std::time::Duration::from_millis(300), all.message()).await;
    assert!(quiet.is_err(), "no event for the delete: {quiet:?}");
}
