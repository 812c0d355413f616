//! Input validation over gRPC: client numbers saturate instead of wrapping, every id is
//! bounded on every path (import included), a tool call needs its call id, and JSON
//! nesting is limited so that whatever is accepted reads back with a standard protobuf
//! client (this one: prost with its default recursion limit of 100).

use compactd::domain::{MAX_ID_BYTES, MAX_JSON_DEPTH};
use compactd::server::pb;
use serde_json::{Value, json};
use tonic::Code;

use crate::common::*;

/// `{"a": {"a": ... 1}}`, `depth` objects deep, as a protobuf Struct.
fn nested_struct(depth: usize) -> prost_types::Struct {
    assert!(depth >= 1);
    let mut inner = prost_types::Value {
        kind: Some(prost_types::value::Kind::NumberValue(1.0)),
    };
    for _ in 1..depth {
        inner = prost_types::Value {
            kind: Some(prost_types::value::Kind::StructValue(prost_types::Struct {
                fields: [("a".to_string(), inner)].into(),
            })),
        };
    }
    prost_types::Struct {
        fields: [("a".to_string(), inner)].into(),
    }
}

/// Depth of nested objects in a JSON value read back.
fn json_depth(v: &Value) -> usize {
    match v {
        Value::Object(o) => 1 + o.values().map(json_depth).max().unwrap_or(0),
        Value::Array(a) => 1 + a.iter().map(json_depth).max().unwrap_or(0),
        _ => 0,
    }
}

fn with_input(mut p: pb::Part, input: prost_types::Struct) -> pb::Part {
    if let Some(pb::part::Kind::Tool(t)) = &mut p.kind {
        t.state.as_mut().expect("state").input = Some(input);
    }
    p
}

async fn session_with_one_message(c: &mut Client, id: &str) {
    open_session(c, session_with_limits(id, 100_000, 10_000)).await;
    put_message(c, id, user_msg("u1")).await;
    put_message(c, id, assistant_msg("a1", "u1")).await;
}

#[tokio::test]
async fn a_usage_report_of_u64_max_saturates_and_overflows() {
    let server = start_server().await;
    let mut c = server.client().await;
    session_with_one_message(&mut c, "big").await;
    // input + cache.read + output would wrap to 1 in u64 arithmetic.
    let huge = pb::TokenUsage {
        input: u64::MAX,
        output: 1,
        cache: Some(pb::CacheTokens { read: 1, write: 0 }),
        ..Default::default()
    };
    let events = put_usage(&mut c, "big", huge).await;
    let checks = overflows(&events);
    assert_eq!(checks.len(), 1, "the report overflows: {events:?}");
    assert_eq!((checks[0].used, checks[0].overflow), (u64::MAX, true));
    assert_eq!(checks[0].predicted, u64::MAX);

    let check = check_overflow(&mut c, "big").await;
    assert_eq!((check.used, check.overflow), (u64::MAX, true));
    // The session goes on: the next update is applied and acked.
    put_part(&mut c, "big", text_part("u1", "t1", "still here")).await;
}

/// Limits that leave no input once the answer is reserved (a context at or under
/// min(output, 32000), 32000 when output is 0) would put every count over the threshold
/// and ask for a compaction after every message: OpenSession, a reconfiguring open and
/// ImportSession refuse them naming the field, and the session stays as it was.
#[tokio::test]
async fn limits_that_leave_no_input_are_refused_naming_the_field() {
    let server = start_server().await;
    let mut c = server.client().await;
    let refused = |id: &str, context, output| session_with_limits(id, context, output);
    for (info, field) in [
        (refused("new", 16_384, 0), "session.limits.context"),
        (refused("new", 8_192, 8_192), "session.limits.output"),
    ] {
        let res = c
            .open_session(pb::OpenSessionRequest {
                session: Some(info),
            })
            .await;
        assert_status(res, Code::InvalidArgument, field);
    }
    session_with_one_message(&mut c, "s").await;
    let before = get_session(&mut c, "s").await;
    let res = c
        .open_session(pb::OpenSessionRequest {
            session: Some(refused("s", 4_000, 0)),
        })
        .await;
    assert_status(
        res,
        Code::InvalidArgument,
        "session.limits.context: a context of 4000 tokens leaves no input",
    );
    assert_eq!(
        get_session(&mut c, "s").await,
        before,
        "a refused reconfiguration changes nothing"
    );
    let mut import = example_import("imported");
    import.limits = Some(limits(30_000, 0));
    let res = c.import_session(import).await;
    assert_status(res, Code::InvalidArgument, "limits.context");
    // An input limit, an output that leaves room, or no window at all pass.
    let mut fits = refused("small", 8_192, 1_024);
    open_session(&mut c, fits.clone()).await;
    fits.limits = Some(pb::ModelLimits {
        context: 8_192,
        input: 6_000,
        output: 8_192,
    });
    open_session(&mut c, fits).await;
    open_session(&mut c, refused("unlimited", 0, 0)).await;
}

#[tokio::test]
async fn an_empty_call_id_is_refused_and_the_session_is_unchanged() {
    let server = start_server().await;
    let mut c = server.client().await;
    session_with_one_message(&mut c, "s").await;
    let before = get_session(&mut c, "s").await;
    let mut p = tool_part("a1", "p1", "read", "out");
    if let Some(pb::part::Kind::Tool(t)) = &mut p.kind {
        t.call_id.clear();
    }
    let res = c
        .upsert_part(pb::UpsertPartRequest {
            session_id: "s".into(),
            part: Some(p),
        })
        .await;
    assert_status(res, Code::InvalidArgument, "part.tool.call_id: required");
    assert_eq!(get_session(&mut c, "s").await, before);
}

#[tokio::test]
async fn tool_input_depth_is_limited_and_the_deepest_accepted_reads_back() {
    let server = start_server().await;
    let mut c = server.client().await;
    session_with_one_message(&mut c, "deep").await;
    let before = get_session(&mut c, "deep").await;

    let too_deep = with_input(
        tool_part("a1", "p1", "read", "out"),
        nested_struct(MAX_JSON_DEPTH + 1),
    );
    let res = c
        .upsert_part(pb::UpsertPartRequest {
            session_id: "deep".into(),
            part: Some(too_deep),
        })
        .await;
    let status = assert_status(res, Code::InvalidArgument, "part.tool.state.input");
    assert!(
        status
            .message()
            .contains(&format!("deeper than {MAX_JSON_DEPTH}")),
        "{status:?}"
    );
    assert_eq!(get_session(&mut c, "deep").await, before);

    let deepest = with_input(
        tool_part("a1", "p2", "read", "out"),
        nested_struct(MAX_JSON_DEPTH),
    );
    put_part(&mut c, "deep", deepest).await;
    // Both reads decode in this client (prost's default recursion limit) and carry the
    // input whole.
    let got = get_session(&mut c, "deep").await;
    let input = tool_state(find_part(&got.messages, "p2"))
        .input
        .clone()
        .expect("input");
    let input = Value::Object(
        input
            .fields
            .iter()
            .map(|(k, v)| (k.clone(), value_to_json(v)))
            .collect(),
    );
    assert_eq!(json_depth(&input), MAX_JSON_DEPTH);
    let context = get_context(&mut c, "deep").await;
    let input = tool_state(find_part(&context.messages, "p2"))
        .input
        .as_ref()
        .expect("input in the context");
    assert_eq!(input.fields.len(), 1);
    let openai = c
        .get_context(pb::GetContextRequest {
            session_id: "deep".into(),
            format: pb::ContextFormat::Openai as i32,
        })
        .await
        .expect("GetContext in OpenAI shape decodes")
        .into_inner();
    assert!(openai.openai_messages.is_some());
}

/// The example export with one id replaced by a 257-byte one, or a call id emptied.
fn example_with(edit: impl FnOnce(&mut Value)) -> pb::ImportSessionRequest {
    let mut doc: Value =
        serde_json::from_str(include_str!("../../examples/session.json")).expect("example JSON");
    edit(&mut doc);
    pb::ImportSessionRequest {
        session_id: "imported".into(),
        export_json: doc.to_string(),
        limits: Some(limits(16_000, 4_000)),
        ..Default::default()
    }
}

/// Position (message, part) of the example's first tool part.
fn first_tool(doc: &Value) -> (usize, usize) {
    for (i, m) in doc["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .enumerate()
    {
        for (j, p) in m["parts"].as_array().expect("parts").iter().enumerate() {
            if p["type"] == "tool" {
                return (i, j);
            }
        }
    }
    panic!("the example has a tool part");
}

#[tokio::test]
async fn import_bounds_every_id_and_requires_call_ids() {
    let server = start_server().await;
    let mut c = server.client().await;
    let long = "x".repeat(MAX_ID_BYTES + 1);
    let doc: Value =
        serde_json::from_str(include_str!("../../examples/session.json")).expect("example JSON");
    let (mi, pi) = first_tool(&doc);
    let cases: Vec<(pb::ImportSessionRequest, String)> = vec![
        (
            example_with(|d| d["messages"][0]["info"]["id"] = json!(long)),
            "export_json.messages[0].info.id".to_string(),
        ),
        (
            example_with(|d| d["messages"][0]["parts"][0]["id"] = json!(long)),
            "export_json.messages[0].parts[0].id".to_string(),
        ),
        // The paths are the document's own (`callID` beside the part's `type`), not the
        // protobuf's `tool.call_id`.
        (
            example_with(|d| d["messages"][mi]["parts"][pi]["callID"] = json!(long)),
            format!("export_json.messages[{mi}].parts[{pi}].callID"),
        ),
        (
            example_with(|d| d["messages"][mi]["parts"][pi]["callID"] = json!("")),
            format!("export_json.messages[{mi}].parts[{pi}].callID: required"),
        ),
        (
            example_with(|d| d["messages"][1]["info"]["parentID"] = json!(long)),
            "export_json.messages[1].info.parentID".to_string(),
        ),
    ];
    for (req, field) in cases {
        let status = assert_status(c.import_session(req).await, Code::InvalidArgument, &field);
        if !field.ends_with("required") {
            assert!(status.message().contains("257 bytes"), "{status:?}");
        }
    }
    // Nothing was imported by the refused requests; the untouched example imports.
    let list = c
        .list_sessions(pb::ListSessionsRequest::default())
        .await
        .expect("ListSessions")
        .into_inner();
    assert!(list.sessions.is_empty(), "{list:?}");
    c.import_session(example_with(|_| {}))
        .await
        .expect("the example imports");
}

/// An id a call only looks up is bounded like every id, and never echoed whole: before,
/// a DeletePart, ReportUsage or GetSession with an 8 MB id answered NOT_FOUND with the
/// whole id in `grpc-message` (clients cap metadata at 8-16 KiB, so many read a
/// transport error instead).
#[tokio::test]
async fn a_looked_up_id_past_the_bound_is_refused_and_not_echoed() {
    let server = start_server().await;
    let mut c = server.client().await;
    session_with_one_message(&mut c, "s").await;
    let long = "m".repeat(1 << 20);
    let short = |status: tonic::Status| {
        assert!(
            status.message().len() < 1_000,
            "{} bytes",
            status.message().len()
        );
    };
    short(assert_status(
        c.delete_part(pb::DeletePartRequest {
            session_id: "s".into(),
            message_id: long.clone(),
            part_id: "p".into(),
        })
        .await,
        Code::InvalidArgument,
        "message_id",
    ));
    short(assert_status(
        c.delete_part(pb::DeletePartRequest {
            session_id: "s".into(),
            message_id: "u1".into(),
            part_id: long.clone(),
        })
        .await,
        Code::InvalidArgument,
        "part_id",
    ));
    short(assert_status(
        c.report_usage(pb::ReportUsageRequest {
            session_id: "s".into(),
            usage: Some(pb::UsageReport {
                message_id: long.clone(),
                tokens: Some(usage(10)),
            }),
        })
        .await,
        Code::InvalidArgument,
        "message_id",
    ));
    short(assert_status(
        c.get_session(pb::GetSessionRequest {
            session_id: long.clone(),
        })
        .await,
        Code::InvalidArgument,
        "session_id",
    ));
    // On the stream too, naming the same fields.
    let mut s = server.stream().await;
    for (sid, update, field) in [
        (long.as_str(), report_usage(usage(10)), "session_id"),
        ("s", delete_part(&long, "p"), "delete_part.message_id"),
    ] {
        let events = s.request(sid, update).await;
        let error = error(&events);
        assert_eq!(error.field, field, "{error:?}");
        assert!(error.message.len() < 1_000);
    }
}
