//! `Sessions/Stream`: every update gets its events then exactly one ack or error, all
//! carrying its seq, in the order sent; a bad update gets an error and the stream stays
//! open with the session unchanged.

use compactd::server::ServerOptions;
use compactd::server::pb;
use compactd::server::pb::client_update::Update;
use compactd::server::pb::server_event::Event;

use crate::common::*;

#[tokio::test]
async fn every_kind_of_update_is_acked_with_its_seq_and_kind() {
    let server = start_server().await;
    let mut s = server.stream().await;
    let sid = "s-ack";

    let a = s.expect_ack(sid, open(session(sid))).await;
    assert_eq!((a.kind.as_str(), a.created), ("open", true));
    let a = s.expect_ack(sid, open(session(sid))).await;
    assert_eq!((a.kind.as_str(), a.created), ("open", false));

    let a = s.expect_ack(sid, upsert_message(user_msg("u1"))).await;
    assert_eq!((a.kind.as_str(), a.created), ("upsert_message", true));
    let a = s.expect_ack(sid, upsert_message(user_msg("u1"))).await;
    assert_eq!((a.kind.as_str(), a.created), ("upsert_message", false));

    let a = s
        .expect_ack(sid, upsert_part(text_part("u1", "p1", "hello")))
        .await;
    assert_eq!((a.kind.as_str(), a.created), ("upsert_part", true));
    let a = s
        .expect_ack(sid, upsert_part(text_part("u1", "p1", "hello again")))
        .await;
    assert_eq!((a.kind.as_str(), a.created), ("upsert_part", false));

    let a = s.expect_ack(sid, report_usage(usage(10))).await;
    assert_eq!(a.kind, "report_usage");

    // Queries answer with one event, then the ack, both with the update's seq.
    let events = s
        .request(sid, Update::GetContext(pb::ContextOptions::default()))
        .await;
    assert_eq!(kinds(&events), ["context", "ack"]);
    assert_eq!(ack(&events).kind, "get_context");
    let Some(Event::Context(ctx)) = &events[0].event else {
        unreachable!()
    };
    assert_eq!(ctx.session_messages, 1);
    assert_eq!(ctx.messages[0].parts.len(), 1);

    let events = s
        .request(sid, Update::Prune(pb::PruneOptions { dry_run: true }))
        .await;
    assert_eq!(kinds(&events), ["prune_report", "ack"]);
    assert_eq!(ack(&events).kind, "prune");
    let Some(Event::PruneReport(r)) = &events[0].event else {
        unreachable!()
    };
    assert!(r.dry_run && !r.committed && r.parts.is_empty());

    let events = s
        .request(sid, Update::CheckOverflow(pb::CheckOverflowOptions {}))
        .await;
    assert_eq!(kinds(&events), ["overflow_check", "ack"]);
    assert_eq!(ack(&events).kind, "check_overflow");
    let Some(Event::OverflowCheck(c)) = &events[0].event else {
        unreachable!()
    };
    assert_eq!((c.used, c.trigger.as_str()), (10, "request"));

    let a = s.expect_ack(sid, delete_part("u1", "p1")).await;
    assert_eq!((a.kind.as_str(), a.created), ("delete_part", false));

    // Every event names the session it is about.
    let events = s.request(sid, report_usage(usage(11))).await;
    assert!(events.iter().all(|e| e.session_id == sid));

    let got = get_session(&mut server.client().await, sid).await;
    assert_eq!(got.messages.len(), 1);
    assert!(got.messages[0].parts.is_empty());
}

#[tokio::test]
async fn pipelined_updates_to_many_sessions_are_answered_in_the_order_sent() {
    let server = start_server().await;
    let mut s = server.stream().await;
    const SESSIONS: usize = 8;
    const PER_SESSION: usize = 25;
    let ids: Vec<String> = (0..SESSIONS).map(|i| format!("pipe-{i}")).collect();

    // Send everything before reading anything.
    let mut sent = Vec::new();
    for id in &ids {
        sent.push((s.send(id, open(session(id))).await, "open"));
    }
    for n in 0..PER_SESSION {
        for id in &ids {
            let seq = s
                .send(id, upsert_message(user_msg(&format!("{id}-m{n}"))))
                .await;
            sent.push((seq, "upsert_message"));
        }
        // A query in the middle of the burst waits its turn too.
        let seq = s
            .send(
                &ids[n % SESSIONS],
                Update::GetContext(pb::ContextOptions::default()),
            )
            .await;
        sent.push((seq, "get_context"));
    }

    for (seq, kind) in sent {
        let events = s.reply(seq).await;
        assert_eq!(ack(&events).kind, kind, "seq {seq}: {events:?}");
    }

    let mut client = server.client().await;
    for id in &ids {
        let got = get_session(&mut client, id).await;
        let want: Vec<String> = (0..PER_SESSION).map(|n| format!("{id}-m{n}")).collect();
        let have: Vec<String> = got
            .messages
            .iter()
            .map(|m| m.info.as_ref().unwrap().id.clone())
            .collect();
        assert_eq!(have, want, "messages of {id} in the order sent");
    }
}

/// A rejected update: its expected code and (when `Some`) the exact field named.
struct Bad {
    what: &'static str,
    update: pb::ClientUpdate,
    code: &'static str,
    field: &'static str,
}

fn bad(
    what: &'static str,
    session_id: &str,
    update: Option<Update>,
    code: &'static str,
    field: &'static str,
) -> Bad {
    Bad {
        what,
        update: pb::ClientUpdate {
            seq: 0,
            session_id: session_id.to_string(),
            update,
        },
        code,
        field,
    }
}

#[tokio::test]
async fn malformed_updates_get_an_error_naming_the_field_and_the_stream_stays_open() {
    let server = start_server().await;
    let mut client = server.client().await;
    let mut s = server.stream().await;
    let sid = "s-bad";
    s.expect_ack(sid, open(session_with_limits(sid, 100_000, 20_000)))
        .await;
    s.expect_ack(sid, upsert_message(user_msg("u1"))).await;
    s.expect_ack(sid, upsert_message(assistant_msg("a1", "u1")))
        .await;
    s.expect_ack(sid, upsert_part(tool_part("a1", "t1", "read", "file")))
        .await;

    let mut no_id = user_msg("x");
    no_id.id.clear();
    let mut system = user_msg("u2");
    system.role = "system".into();
    let mut no_role = user_msg("u2");
    no_role.role.clear();
    let mut part_no_id = text_part("u1", "x", "t");
    part_no_id.id.clear();
    let mut part_no_msg = text_part("u1", "p9", "t");
    part_no_msg.message_id.clear();
    let mut no_kind = text_part("u1", "p9", "t");
    no_kind.kind = None;
    let mut no_state = tool_part("a1", "t9", "read", "o");
    if let Some(pb::part::Kind::Tool(t)) = &mut no_state.kind {
        t.state = None;
    }
    let over = |t: f64| {
        open(pb::SessionInfo {
            config: Some(pb::SessionConfig {
                threshold: Some(t),
                ..Default::default()
            }),
            ..session(sid)
        })
    };
    let cases = vec![
        bad(
            "unknown role",
            sid,
            Some(upsert_message(system)),
            "INVALID_ARGUMENT",
            "upsert_message.role",
        ),
        bad(
            "empty role",
            sid,
            Some(upsert_message(no_role)),
            "INVALID_ARGUMENT",
            "upsert_message.role",
        ),
        bad(
            "message without id",
            sid,
            Some(upsert_message(no_id)),
            "INVALID_ARGUMENT",
            "upsert_message.id",
        ),
        bad(
            "part without id",
            sid,
            Some(upsert_part(part_no_id)),
            "INVALID_ARGUMENT",
            "upsert_part.id",
        ),
        bad(
            "part without message id",
            sid,
            Some(upsert_part(part_no_msg)),
            "INVALID_ARGUMENT",
            "upsert_part.message_id",
        ),
        bad(
            "part without kind",
            sid,
            Some(upsert_part(no_kind)),
            "INVALID_ARGUMENT",
            "upsert_part.kind",
        ),
        bad(
            "unknown tool status",
            sid,
            Some(upsert_part(tool_part_with_status(
                "a1", "t1", "read", "done", "o",
            ))),
            "INVALID_ARGUMENT",
            "upsert_part.tool.state.status",
        ),
        bad(
            "tool without name",
            sid,
            Some(upsert_part(tool_part("a1", "t1", "", "o"))),
            "INVALID_ARGUMENT",
            "upsert_part.tool.tool",
        ),
        bad(
            "tool without state",
            sid,
            Some(upsert_part(no_state)),
            "INVALID_ARGUMENT",
            "upsert_part.tool.state",
        ),
        bad(
            "usage without tokens",
            sid,
            Some(Update::ReportUsage(pb::UsageReport::default())),
            "INVALID_ARGUMENT",
            "report_usage.tokens",
        ),
        bad(
            "delete without part id",
            sid,
            Some(delete_part("a1", "")),
            "INVALID_ARGUMENT",
            "delete_part.part_id",
        ),
        bad(
            "delete without message id",
            sid,
            Some(delete_part("", "t1")),
            "INVALID_ARGUMENT",
            "delete_part.message_id",
        ),
        bad(
            "threshold above 1",
            sid,
            Some(over(1.5)),
            "INVALID_ARGUMENT",
            "open.config.threshold",
        ),
        bad(
            "threshold 0",
            sid,
            Some(over(0.0)),
            "INVALID_ARGUMENT",
            "open.config.threshold",
        ),
        bad(
            "negative threshold",
            sid,
            Some(over(-0.5)),
            "INVALID_ARGUMENT",
            "open.config.threshold",
        ),
        bad(
            "open with another id",
            sid,
            Some(open(session("someone-else"))),
            "INVALID_ARGUMENT",
            "open.id",
        ),
        bad("no update", sid, None, "INVALID_ARGUMENT", "update"),
        bad(
            "no session id",
            "",
            Some(upsert_message(user_msg("u9"))),
            "INVALID_ARGUMENT",
            "session_id",
        ),
        bad(
            "unknown session",
            "nobody",
            Some(upsert_message(user_msg("u9"))),
            "NOT_FOUND",
            "session_id",
        ),
        bad(
            "query of an unknown session",
            "nobody",
            Some(Update::GetContext(pb::ContextOptions::default())),
            "NOT_FOUND",
            "session_id",
        ),
    ];

    let before = get_session(&mut client, sid).await;
    for (i, case) in cases.into_iter().enumerate() {
        let mut update = case.update;
        update.seq = 5000 + i as u64;
        let seq = update.seq;
        let session_id = update.session_id.clone();
        s.send_raw(update).await;
        let events = s.reply(seq).await;
        assert_eq!(events.len(), 1, "{}: only the error: {events:?}", case.what);
        assert_eq!(events[0].session_id, session_id, "{}", case.what);
        let e = error(&events);
        assert_eq!(e.code, case.code, "{}: {e:?}", case.what);
        assert_eq!(e.field, case.field, "{}: {e:?}", case.what);
        assert!(!e.message.is_empty(), "{}: a message for humans", case.what);

        // The stream is still open and the session untouched.
        let events = s
            .request(sid, Update::CheckOverflow(Default::default()))
            .await;
        assert_eq!(kinds(&events), ["overflow_check", "ack"], "{}", case.what);
        assert_eq!(
            get_session(&mut client, sid).await,
            before,
            "{}: session changed",
            case.what
        );
    }
    assert!(
        client
            .get_session(pb::GetSessionRequest {
                session_id: "nobody".into()
            })
            .await
            .is_err(),
        "a rejected update must not create its session"
    );
}

/// Rejections decided by the engine (the update is well formed but does not fit the
/// session), with the leaf of the field each must name.
fn state_rejections(sid: &str) -> Vec<Bad> {
    let mut a1_as_user = user_msg("a1");
    a1_as_user.time = None;
    vec![
        bad(
            "part for a missing message",
            sid,
            Some(upsert_part(text_part("ghost", "p1", "boo"))),
            "FAILED_PRECONDITION",
            "upsert_part.message_id",
        ),
        bad(
            "role change",
            sid,
            Some(upsert_message(a1_as_user)),
            "FAILED_PRECONDITION",
            "upsert_message.role",
        ),
        bad(
            "delete of an unknown part",
            sid,
            Some(delete_part("a1", "nope")),
            "NOT_FOUND",
            "delete_part.part_id",
        ),
        bad(
            "delete in an unknown message",
            sid,
            Some(delete_part("ghost", "t1")),
            "NOT_FOUND",
            "delete_part.message_id",
        ),
        bad(
            "usage for an unknown message",
            sid,
            Some(Update::ReportUsage(pb::UsageReport {
                message_id: "ghost".into(),
                tokens: Some(usage(5)),
            })),
            "NOT_FOUND",
            "report_usage.message_id",
        ),
        bad(
            "usage for a user message",
            sid,
            Some(Update::ReportUsage(pb::UsageReport {
                message_id: "u1".into(),
                tokens: Some(usage(5)),
            })),
            "FAILED_PRECONDITION",
            "report_usage.message_id",
        ),
        bad(
            "unknown context format",
            sid,
            Some(Update::GetContext(pb::ContextOptions { format: 42 })),
            "INVALID_ARGUMENT",
            "get_context.format",
        ),
    ]
}

async fn session_for_state_rejections(server: &TestServer, s: &mut EventStream, sid: &str) {
    let _ = server;
    s.expect_ack(sid, open(session_with_limits(sid, 100_000, 20_000)))
        .await;
    s.expect_ack(sid, upsert_message(user_msg("u1"))).await;
    s.expect_ack(sid, upsert_message(assistant_msg("a1", "u1")))
        .await;
    s.expect_ack(sid, upsert_part(tool_part("a1", "t1", "read", "file")))
        .await;
    s.expect_ack(sid, report_usage(usage(1234))).await;
}

#[tokio::test]
async fn state_rejections_get_the_right_code_and_leave_the_session_unchanged() {
    let server = start_server().await;
    let mut client = server.client().await;
    let mut s = server.stream().await;
    let sid = "s-state";
    session_for_state_rejections(&server, &mut s, sid).await;
    let before = get_session(&mut client, sid).await;
    let before_check = check_overflow(&mut client, sid).await;

    for case in state_rejections(sid) {
        let seq = s.send(sid, case.update.update.unwrap()).await;
        let events = s.reply(seq).await;
        assert_eq!(events.len(), 1, "{}: only the error: {events:?}", case.what);
        let e = error(&events);
        assert_eq!(e.code, case.code, "{}: {e:?}", case.what);
        // The leaf must be right here; the exact dotted path is pinned below.
        let leaf = case.field.rsplit('.').next().unwrap();
        assert!(
            e.field.ends_with(leaf),
            "{}: field {:?} does not name {leaf}",
            case.what,
            e.field
        );
        let a = s.expect_ack(sid, upsert_message(user_msg("u1"))).await;
        assert!(!a.created, "{}: the stream is still open", case.what);
        assert_eq!(get_session(&mut client, sid).await, before, "{}", case.what);
        // A rejected usage report is not a new baseline either.
        assert_eq!(
            check_overflow(&mut client, sid).await,
            before_check,
            "{}",
            case.what
        );
    }
}

/// The stream contract (proto `Error.field`, `ops::decode_update`): field names are
/// relative to the update, e.g. `upsert_part.tool.state.status`. Rejections from the
/// engine must follow it too, so a host can map an error back to the update it sent.
#[tokio::test]
async fn state_rejections_name_the_field_relative_to_the_update() {
    let server = start_server().await;
    let mut s = server.stream().await;
    let sid = "s-fields";
    session_for_state_rejections(&server, &mut s, sid).await;

    let mut wrong = Vec::new();
    for case in state_rejections(sid) {
        let seq = s.send(sid, case.update.update.unwrap()).await;
        let events = s.reply(seq).await;
        let e = error(&events);
        if e.field != case.field {
            wrong.push(format!(
                "{}: field {:?}, expected {:?}",
                case.what, e.field, case.field
            ));
        }
    }
    assert!(
        wrong.is_empty(),
        "fields not relative to the update:\n{}",
        wrong.join("\n")
    );
}

#[tokio::test]
async fn an_update_over_max_update_bytes_is_rejected_and_the_stream_stays_open() {
    let server = start_server_with_options(ServerOptions {
        max_update_bytes: 1024,
        ..Default::default()
    })
    .await;
    let mut client = server.client().await;
    let mut s = server.stream().await;
    let sid = "s-big";
    s.expect_ack(sid, open(session(sid))).await;
    s.expect_ack(sid, upsert_message(user_msg("u1"))).await;
    let before = get_session(&mut client, sid).await;

    // Over 1024 bytes but under the transport cap (max_update_bytes + 64 KiB).
    let events = s
        .request(sid, upsert_part(text_part("u1", "p1", &"y".repeat(2000))))
        .await;
    let e = error(&events);
    assert_eq!(e.code, "RESOURCE_EXHAUSTED", "{e:?}");
    assert!(e.message.contains("max_update_bytes"), "{e:?}");
    assert!(e.message.contains("1024"), "names the limit: {e:?}");
    assert_eq!(get_session(&mut client, sid).await, before);

    // Just under the limit is fine.
    let a = s
        .expect_ack(sid, upsert_part(text_part("u1", "p1", &"y".repeat(900))))
        .await;
    assert!(a.created);
}

#[tokio::test]
async fn an_update_past_the_transport_cap_is_resource_exhausted_naming_the_flag() {
    // Past max_update_bytes plus the transport's slack, tonic's decoder refuses the
    // message before compactd reads it: the stream cannot skip it and ends.
    let server = start_server_with_options(ServerOptions {
        max_update_bytes: 1024,
        ..Default::default()
    })
    .await;
    let mut client = server.client().await;
    let mut s = server.stream().await;
    let sid = "s-huge";
    s.expect_ack(sid, open(session(sid))).await;
    s.expect_ack(sid, upsert_message(user_msg("u1"))).await;
    let before = get_session(&mut client, sid).await;
    let huge = "y".repeat(200 << 10);
    s.send(sid, upsert_part(text_part("u1", "p1", &huge))).await;
    let status = s.failure().await;
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    assert!(
        status.message().contains("max_update_bytes (1024 bytes)"),
        "{status:?}"
    );
    assert!(
        status.message().contains("--max-update-bytes"),
        "{status:?}"
    );
    assert_eq!(get_session(&mut client, sid).await, before);
    // The unary twin says the same (its status is in the reply's headers).
    let err = client
        .upsert_part(pb::UpsertPartRequest {
            session_id: sid.into(),
            part: Some(text_part("u1", "p1", &huge)),
        })
        .await
        .expect_err("refused");
    assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err:?}");
    assert!(
        err.message().contains("max_update_bytes (1024 bytes)"),
        "{err:?}"
    );
    assert_eq!(get_session(&mut client, sid).await, before);
}

#[tokio::test]
async fn closing_the_sending_side_answers_what_was_sent_then_ends_the_stream() {
    let server = start_server().await;
    let mut s = server.stream().await;
    let sid = "s-close";
    s.expect_ack(sid, open(session(sid))).await;
    let mut seqs = Vec::new();
    for n in 0..20 {
        seqs.push(
            s.send(sid, upsert_message(user_msg(&format!("m{n}"))))
                .await,
        );
    }
    let rest = s.close().await;
    assert_eq!(rest.iter().map(|e| e.seq).collect::<Vec<_>>(), seqs);
    assert!(rest.iter().all(|e| kind(e) == "ack"), "{rest:?}");
    let got = get_session(&mut server.client().await, sid).await;
    assert_eq!(got.messages.len(), 20);
}

#[tokio::test]
async fn two_streams_on_one_session_see_each_others_updates() {
    let server = start_server().await;
    let mut a = server.stream().await;
    let mut b = server.stream().await;
    let sid = "s-two";
    assert!(a.expect_ack(sid, open(session(sid))).await.created);
    assert!(!b.expect_ack(sid, open(session(sid))).await.created);
    a.expect_ack(sid, upsert_message(user_msg("u1"))).await;
    b.expect_ack(sid, upsert_part(text_part("u1", "p1", "from b")))
        .await;
    let events = a
        .request(sid, Update::GetContext(pb::ContextOptions::default()))
        .await;
    let Some(Event::Context(ctx)) = &events[0].event else {
        panic!("{events:?}")
    };
    let Some(pb::part::Kind::Text(t)) = &ctx.messages[0].parts[0].kind else {
        panic!("{ctx:?}")
    };
    assert_eq!(t.text, "from b");
}
