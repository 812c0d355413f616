//! Pins and recall through the API: a pinned output survives a `Prune` that clears its
//! neighbours (over `Pin` and over the stream), unpinning gives it back to prune, `Recall`
//! returns an output prune cleared, and `GetRecallTool` (and `compactd recall-tool`) give
//! the tool definition a host hands its model.

use std::process::Command;

use compactd::server::pb;
use compactd::server::pb::client_update::Update;
use compactd::server::pb::server_event::Event;
use tonic::Code;

use crate::common::*;

/// 100_000 chars = 25_000 tokens under chars/4.
const BIG: usize = 100_000;
const BIG_TOKENS: u64 = 25_000;

/// Turn 1 holds four big outputs; turns 2 and 3 are the protected last two turns. Prune
/// keeps t4 (PRUNE_PROTECT 40_000) and clears t1, t2, t3.
const OUTPUTS: [(&str, &str); 4] = [
    ("t1", "read"),
    ("t2", "read"),
    ("t3", "bash"),
    ("t4", "grep"),
];

/// Builds the session; the last assistant message is left unfinished (nothing pruned).
async fn build(c: &mut Client, sid: &str) {
    open_session(c, session(sid)).await;
    for (user, assistant) in [("u1", "a1"), ("u2", "a2"), ("u3", "a3")] {
        put_message(c, sid, user_msg(user)).await;
        put_part(c, sid, text_part(user, &format!("{user}-text"), "go on")).await;
        let mut a = assistant_msg(assistant, user);
        if assistant != "a3" {
            a.finish = "tool-calls".into();
        }
        put_message(c, sid, a).await;
        put_part(
            c,
            sid,
            text_part(assistant, &format!("{assistant}-text"), "ok"),
        )
        .await;
    }
    for (id, tool) in OUTPUTS {
        let ev = put_part(c, sid, tool_part("a1", id, tool, &output_of(id, BIG))).await;
        assert_eq!(kinds(&ev), ["ack"], "{ev:?}");
    }
}

fn pin_request(sid: &str, message_id: &str, part_id: &str, pinned: Option<bool>) -> pb::PinRequest {
    pb::PinRequest {
        session_id: sid.into(),
        message_id: message_id.into(),
        part_id: part_id.into(),
        pinned,
    }
}

fn pin_update(message_id: &str, part_id: &str, pinned: Option<bool>) -> Update {
    Update::Pin(pb::PinUpdate {
        message_id: message_id.into(),
        part_id: part_id.into(),
        pinned,
    })
}

fn recall_request(sid: &str, key: pb::recall_request::Key) -> pb::RecallRequest {
    pb::RecallRequest {
        session_id: sid.into(),
        key: Some(key),
    }
}

fn by_call(id: &str) -> pb::recall_request::Key {
    pb::recall_request::Key::CallId(id.into())
}

fn by_part(id: &str) -> pb::recall_request::Key {
    pb::recall_request::Key::PartId(id.into())
}

/// Part ids a prune report lists, oldest first.
fn cleared(r: &pb::PruneReport) -> Vec<&str> {
    r.parts.iter().map(|p| p.part_id.as_str()).collect()
}

/// What each output reads as in the context.
async fn shown(c: &mut Client, sid: &str) -> Vec<(String, String)> {
    let ctx = get_context(c, sid).await;
    OUTPUTS
        .iter()
        .map(|(id, _)| {
            let out = tool_state(find_part(&ctx.messages, id)).output.clone();
            let out = if out == PLACEHOLDER {
                "cleared".into()
            } else {
                out
            };
            (id.to_string(), out)
        })
        .collect()
}

fn expect(list: [(&str, bool); 4]) -> Vec<(String, String)> {
    list.iter()
        .map(|(id, kept)| {
            let out = if *kept {
                output_of(id, BIG)
            } else {
                "cleared".into()
            };
            (id.to_string(), out)
        })
        .collect()
}

#[tokio::test]
async fn a_pinned_output_survives_a_prune_that_clears_its_neighbours() {
    let server = start_server().await;
    let mut c = server.client().await;
    let sid = "pin-unary";
    build(&mut c, sid).await;
    assert_eq!(cleared(&prune(&mut c, sid, true).await), ["t1", "t2", "t3"]);

    let events = c
        .pin(pin_request(sid, "a1", "t2", None))
        .await
        .expect("Pin")
        .into_inner()
        .events;
    assert_eq!(kinds(&events), ["ack"]);
    assert_eq!(ack(&events).kind, "pin");

    let report = prune(&mut c, sid, false).await;
    assert!(report.committed, "{report:?}");
    assert_eq!(cleared(&report), ["t1", "t3"]);
    assert_eq!(report.tokens_saved, 2 * BIG_TOKENS);
    assert_eq!(
        shown(&mut c, sid).await,
        expect([("t1", false), ("t2", true), ("t3", false), ("t4", true)])
    );
    // The stored part carries no stamp.
    let stored = get_session(&mut c, sid).await;
    let t2 = tool_state(find_part(&stored.messages, "t2"));
    assert_eq!(t2.time.as_ref().and_then(|t| t.compacted), None);
}

#[tokio::test]
async fn pins_over_the_stream_hold_a_part_or_a_message_until_unpinned() {
    let server = start_server().await;
    let mut c = server.client().await;
    let sid = "pin-stream";
    build(&mut c, sid).await;
    let mut s = server.stream().await;

    // `pinned` absent pins.
    let a = s.expect_ack(sid, pin_update("a1", "t1", None)).await;
    assert_eq!((a.kind.as_str(), a.created), ("pin", false));
    assert_eq!(cleared(&prune(&mut c, sid, true).await), ["t2", "t3"]);

    // A whole message: nothing of it is cleared.
    s.expect_ack(sid, pin_update("a1", "", Some(true))).await;
    let dry = prune(&mut c, sid, true).await;
    assert!(dry.parts.is_empty(), "{dry:?}");

    // Unpinned again, prune clears what it cleared before.
    s.expect_ack(sid, pin_update("a1", "", Some(false))).await;
    s.expect_ack(sid, pin_update("a1", "t1", Some(false))).await;
    let report = prune(&mut c, sid, false).await;
    assert_eq!(cleared(&report), ["t1", "t2", "t3"]);

    // Pinning a cleared output restores it in the context.
    s.expect_ack(sid, pin_update("a1", "t3", Some(true))).await;
    assert_eq!(
        shown(&mut c, sid).await,
        expect([("t1", false), ("t2", false), ("t3", true), ("t4", true)])
    );
}

#[tokio::test]
async fn recall_returns_a_pruned_output_by_call_id_and_by_part_id() {
    let server = start_server().await;
    let mut c = server.client().await;
    let sid = "recall";
    build(&mut c, sid).await;
    c.pin(pin_request(sid, "a1", "t2", Some(true)))
        .await
        .expect("Pin");
    assert_eq!(cleared(&prune(&mut c, sid, false).await), ["t1", "t3"]);
    assert_eq!(shown(&mut c, sid).await[0].1, "cleared");

    let by_call_id = c
        .recall(recall_request(sid, by_call("call_t1")))
        .await
        .expect("Recall")
        .into_inner();
    assert_eq!(
        (
            by_call_id.message_id.as_str(),
            by_call_id.part_id.as_str(),
            by_call_id.part_type.as_str(),
            by_call_id.reduction.as_str(),
            by_call_id.pinned,
        ),
        ("a1", "t1", "tool", "cleared", false)
    );
    let Some(pb::recalled::Content::Call(call)) = &by_call_id.content else {
        panic!("expected a call: {by_call_id:?}");
    };
    assert_eq!(
        (
            call.tool.as_str(),
            call.call_id.as_str(),
            call.status.as_str()
        ),
        ("read", "call_t1", "completed")
    );
    assert_eq!(call.output, output_of("t1", BIG));
    assert_eq!(call.error, "");
    let input = value_to_json(&prost_types::Value {
        kind: Some(prost_types::value::Kind::StructValue(
            call.input.clone().expect("input"),
        )),
    });
    assert_eq!(input, serde_json::json!({"id": "t1"}));
    assert!(by_call_id.tokens > BIG_TOKENS, "{}", by_call_id.tokens);
    assert!(
        by_call_id.context_tokens < 100,
        "{}",
        by_call_id.context_tokens
    );

    let by_part_id = c
        .recall(recall_request(sid, by_part("t1")))
        .await
        .expect("Recall")
        .into_inner();
    assert_eq!(by_part_id, by_call_id);

    // A pinned output reads verbatim; a text part recalls its text.
    let t2 = c
        .recall(recall_request(sid, by_call("call_t2")))
        .await
        .expect("Recall")
        .into_inner();
    assert_eq!((t2.reduction.as_str(), t2.pinned), ("", true));
    assert_eq!(t2.context_tokens, t2.tokens);
    let text = c
        .recall(recall_request(sid, by_part("u1-text")))
        .await
        .expect("Recall")
        .into_inner();
    assert_eq!(
        text.content,
        Some(pb::recalled::Content::Text("go on".into()))
    );
}

#[tokio::test]
async fn unknown_ids_are_not_found_naming_the_field_and_change_nothing() {
    let server = start_server().await;
    let mut c = server.client().await;
    let sid = "pin-unknown";
    build(&mut c, sid).await;
    let before = get_session(&mut c, sid).await;

    let r = c.pin(pin_request(sid, "nope", "t1", None)).await;
    assert_status(r, Code::NotFound, "message_id");
    let r = c.pin(pin_request(sid, "a1", "nope", None)).await;
    assert_status(r, Code::NotFound, "part_id");
    let r = c.pin(pin_request("no-session", "a1", "t1", None)).await;
    assert_status(r, Code::NotFound, "session_id");

    let mut s = server.stream().await;
    let events = s.request(sid, pin_update("a1", "nope", None)).await;
    let e = error(&events);
    assert_eq!(
        (e.code.as_str(), e.field.as_str()),
        ("NOT_FOUND", "pin.part_id")
    );
    let events = s.request(sid, pin_update("nope", "", Some(false))).await;
    assert_eq!(error(&events).field, "pin.message_id");

    let r = c.recall(recall_request(sid, by_call("call_nope"))).await;
    assert_status(r, Code::NotFound, "call_id");
    let r = c.recall(recall_request(sid, by_part("nope"))).await;
    assert_status(r, Code::NotFound, "part_id");
    let r = c.recall(recall_request("no-session", by_part("t1"))).await;
    assert_status(r, Code::NotFound, "session_id");

    assert_eq!(get_session(&mut c, sid).await, before);
    assert_eq!(cleared(&prune(&mut c, sid, true).await), ["t1", "t2", "t3"]);
}

#[tokio::test]
async fn empty_and_oversized_requests_are_invalid_arguments() {
    let server = start_server().await;
    let mut c = server.client().await;
    let sid = "pin-invalid";
    build(&mut c, sid).await;
    let before = get_session(&mut c, sid).await;

    let r = c
        .recall(pb::RecallRequest {
            session_id: sid.into(),
            key: None,
        })
        .await;
    let status = assert_status(r, Code::InvalidArgument, "call_id");
    assert!(status.message().contains("part_id"), "{status:?}");
    let r = c.recall(recall_request(sid, by_call(""))).await;
    assert_status(r, Code::InvalidArgument, "call_id");
    let r = c
        .recall(recall_request(sid, by_part(&"p".repeat(300))))
        .await;
    assert_status(r, Code::InvalidArgument, "part_id");
    let r = c.recall(recall_request("", by_part("t1"))).await;
    assert_status(r, Code::InvalidArgument, "session_id");

    let r = c.pin(pin_request(sid, "", "", None)).await;
    assert_status(r, Code::InvalidArgument, "message_id");
    let r = c.pin(pin_request(sid, "a1", &"p".repeat(300), None)).await;
    assert_status(r, Code::InvalidArgument, "part_id");
    let mut s = server.stream().await;
    let events = s.request(sid, pin_update("", "t1", None)).await;
    let e = error(&events);
    assert_eq!(
        (e.code.as_str(), e.field.as_str()),
        ("INVALID_ARGUMENT", "pin.message_id")
    );
    assert!(matches!(events[0].event, Some(Event::Error(_))));

    assert_eq!(get_session(&mut c, sid).await, before);
}

#[tokio::test]
async fn get_recall_tool_returns_the_function_definition_the_cli_prints() {
    let server = start_server().await;
    let mut c = server.client().await;
    let tool = c
        .get_recall_tool(pb::GetRecallToolRequest {})
        .await
        .expect("GetRecallTool")
        .into_inner();
    assert_eq!(tool.name, "compactd_recall");
    let json: serde_json::Value = serde_json::from_str(&tool.json).expect("valid JSON");
    assert_eq!(json["type"], "function");
    assert_eq!(json["function"]["name"], "compactd_recall");
    let params = &json["function"]["parameters"];
    assert_eq!(params["properties"]["call_id"]["type"], "string");
    assert_eq!(params["required"], serde_json::json!(["call_id"]));
    assert!(
        json["function"]["description"]
            .as_str()
            .is_some_and(|d| !d.is_empty())
    );

    let out = Command::new(env!("CARGO_BIN_EXE_compactd"))
        .arg("recall-tool")
        .output()
        .expect("compactd recall-tool runs");
    assert!(out.status.success(), "{out:?}");
    let printed = String::from_utf8(out.stdout).expect("utf-8");
    assert_eq!(printed.trim_end(), tool.json);
}
