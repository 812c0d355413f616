//! `ImportSession` of every shared `opencode export` trace, then reads over gRPC.

use compactd::server::pb;
use serde_json::Value;
use tonic::Code;

use crate::common::*;

struct Trace {
    name: String,
    json: String,
    doc: Value,
}

fn traces() -> Vec<Trace> {
    let files = trace_files();
    assert_eq!(files.len(), 10, "expected the ten shared traces");
    files
        .into_iter()
        .map(|p| {
            let json = std::fs::read_to_string(&p).expect("trace readable");
            let doc: Value = serde_json::from_str(&json).expect("trace is JSON");
            Trace {
                name: p.file_stem().unwrap().to_string_lossy().into_owned(),
                json,
                doc,
            }
        })
        .collect()
}

fn import_request(t: &Trace, session_id: &str) -> pb::ImportSessionRequest {
    pb::ImportSessionRequest {
        export_json: t.json.clone(),
        session_id: session_id.to_string(),
        limits: Some(limits(200_000, 32_000)),
        ..Default::default()
    }
}

#[tokio::test]
async fn every_trace_imports_with_all_its_messages_and_serves_a_context() {
    let server = start_server().await;
    let mut c = server.client().await;
    for t in traces() {
        let messages = t.doc["messages"].as_array().expect("messages array");
        let parts: usize = messages
            .iter()
            .map(|m| m["parts"].as_array().map_or(0, Vec::len))
            .sum();
        let doc_id = t.doc["info"]["id"].as_str().unwrap_or_default();

        let summary = c
            .import_session(import_request(&t, ""))
            .await
            .unwrap_or_else(|s| panic!("{}: {s:?}", t.name))
            .into_inner();
        assert_eq!(
            summary.id, doc_id,
            "{}: the document's id by default",
            t.name
        );
        assert!(summary.created, "{}", t.name);
        assert_eq!(summary.messages as usize, messages.len(), "{}", t.name);
        assert_eq!(summary.parts as usize, parts, "{}", t.name);
        assert_eq!(summary.limits, Some(limits(200_000, 32_000)), "{}", t.name);
        assert!(summary.estimated_tokens > 0, "{}", t.name);

        let ctx = get_context(&mut c, doc_id).await;
        assert_eq!(ctx.session_messages as usize, messages.len(), "{}", t.name);
        assert!(ctx.context_messages > 0, "{}", t.name);
        assert!(
            ctx.context_messages as usize <= messages.len(),
            "{}",
            t.name
        );
        assert_eq!(ctx.estimated_tokens, summary.context_tokens, "{}", t.name);
        let openai = list_to_json(&ctx.openai_messages.as_ref().unwrap().values);
        assert!(!openai.as_array().unwrap().is_empty(), "{}", t.name);

        let got = get_session(&mut c, doc_id).await;
        assert_eq!(got.messages.len(), messages.len(), "{}", t.name);
        // Message order and ids are the document's.
        for (have, want) in got.messages.iter().zip(messages) {
            assert_eq!(
                have.info.as_ref().unwrap().id,
                want["info"]["id"].as_str().unwrap(),
                "{}",
                t.name
            );
            assert_eq!(
                have.parts.len(),
                want["parts"].as_array().map_or(0, Vec::len),
                "{}",
                t.name
            );
        }

        // OpenCode's own prune marks survive the import and show in the context.
        let marked = messages
            .iter()
            .flat_map(|m| m["parts"].as_array().into_iter().flatten())
            .filter(|p| !p["state"]["time"]["compacted"].is_null())
            .count();
        assert_eq!(summary.compacted_parts as usize, marked, "{}", t.name);
        let placeholders = ctx
            .messages
            .iter()
            .flat_map(|m| &m.parts)
            .filter(|p| matches!(&p.kind, Some(pb::part::Kind::Tool(_))))
            .filter(|p| tool_state(p).output == PLACEHOLDER)
            .count();
        assert_eq!(placeholders, marked, "{}", t.name);
    }

    let list = c
        .list_sessions(pb::ListSessionsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert_eq!(list.sessions.len(), 10);
}

#[tokio::test]
async fn silent_panda_carries_opencodes_31_prune_marks() {
    let server = start_server().await;
    let mut c = server.client().await;
    let t = traces()
        .into_iter()
        .find(|t| t.name == "opencode-silent-panda")
        .expect("silent-panda trace");
    let summary = c
        .import_session(import_request(&t, "panda"))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(summary.id, "panda");
    assert_eq!(summary.compacted_parts, 31);
    // Already pruned by OpenCode: nothing new beyond its marks.
    let dry = prune(&mut c, "panda", true).await;
    assert!(!dry.committed);
}

#[tokio::test]
async fn importing_an_existing_id_needs_replace() {
    let server = start_server().await;
    let mut c = server.client().await;
    let all = traces();
    let small = all
        .iter()
        .find(|t| t.name == "opencode-jolly-eagle")
        .unwrap();
    let other = all
        .iter()
        .find(|t| t.name == "opencode-nimble-pixel")
        .unwrap();

    let first = c
        .import_session(import_request(small, "dup"))
        .await
        .unwrap()
        .into_inner();
    assert!(first.created);
    let before = get_session(&mut c, "dup").await;

    assert_status(
        c.import_session(import_request(other, "dup")).await,
        Code::AlreadyExists,
        "dup",
    );
    assert_eq!(get_session(&mut c, "dup").await, before, "not replaced");

    // An opened (not imported) session is protected the same way.
    open_session(&mut c, session("opened")).await;
    assert_status(
        c.import_session(import_request(other, "opened")).await,
        Code::AlreadyExists,
        "opened",
    );

    let mut req = import_request(other, "dup");
    req.replace = true;
    let replaced = c.import_session(req).await.unwrap().into_inner();
    let n = other.doc["messages"].as_array().unwrap().len();
    assert_eq!(replaced.messages as usize, n);
    assert_eq!(get_session(&mut c, "dup").await.messages.len(), n);

    // The replaced session is live: updates apply to the new one.
    put_message(&mut c, "dup", user_msg("after-replace")).await;
    assert_eq!(get_session(&mut c, "dup").await.messages.len(), n + 1);
}

#[tokio::test]
async fn malformed_exports_are_invalid_arguments() {
    let server = start_server().await;
    let mut c = server.client().await;
    let req = |json: &str| pb::ImportSessionRequest {
        export_json: json.to_string(),
        session_id: "bad".into(),
        ..Default::default()
    };
    assert_status(
        c.import_session(req("")).await,
        Code::InvalidArgument,
        "export_json",
    );
    assert_status(
        c.import_session(req("{not json")).await,
        Code::InvalidArgument,
        "export_json",
    );
    assert_status(
        c.import_session(req(r#"{"messages": []}"#)).await,
        Code::InvalidArgument,
        "export_json.info",
    );
    assert_status(
        c.import_session(req(r#"{"info": {"id": "x"}}"#)).await,
        Code::InvalidArgument,
        "export_json.messages",
    );
    let t = traces().into_iter().next().unwrap();
    let mut bad_config = import_request(&t, "bad");
    bad_config.config = Some(pb::SessionConfig {
        threshold: Some(1.5),
        ..Default::default()
    });
    assert_status(
        c.import_session(bad_config).await,
        Code::InvalidArgument,
        "config.threshold",
    );
    let list = c
        .list_sessions(pb::ListSessionsRequest::default())
        .await
        .unwrap()
        .into_inner();
    assert!(list.sessions.is_empty(), "nothing was imported");
}

#[tokio::test]
async fn an_export_sent_as_an_object_imports_like_the_text() {
    let server = start_server().await;
    let mut c = server.client().await;
    let t = traces()
        .into_iter()
        .find(|t| t.name == "opencode-nimble-pixel")
        .unwrap();
    let as_text = c
        .import_session(import_request(&t, "as-text"))
        .await
        .unwrap()
        .into_inner();
    let as_object = c
        .import_session(pb::ImportSessionRequest {
            export: Some(json_to_struct(&t.doc)),
            session_id: "as-object".into(),
            limits: Some(limits(200_000, 32_000)),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(as_object.messages, as_text.messages);
    assert_eq!(as_object.parts, as_text.parts);
    assert_eq!(as_object.estimated_tokens, as_text.estimated_tokens);
    let (obj, text) = (
        get_context(&mut c, "as-object").await,
        get_context(&mut c, "as-text").await,
    );
    assert_eq!(obj.messages.len(), text.messages.len());
    for (o, t) in obj.messages.iter().zip(&text.messages) {
        assert_eq!(o, t);
    }
    assert_eq!(obj.estimated_tokens, text.estimated_tokens);
    let (oa, ta) = (
        list_to_json(&obj.openai_messages.as_ref().unwrap().values),
        list_to_json(&text.openai_messages.as_ref().unwrap().values),
    );
    // A protobuf Struct has no key order, so tool-call arguments may list their keys in
    // another order than the text document: compare them as JSON values.
    assert_eq!(normalize_arguments(oa), normalize_arguments(ta));

    // Both at once is ambiguous; an object without messages names the path under `export`.
    let mut both = import_request(&t, "both");
    both.export = Some(json_to_struct(&t.doc));
    assert_status(
        c.import_session(both).await,
        Code::InvalidArgument,
        "export",
    );
    let mut no_messages = t.doc.clone();
    no_messages.as_object_mut().unwrap().remove("messages");
    assert_status(
        c.import_session(pb::ImportSessionRequest {
            export: Some(json_to_struct(&no_messages)),
            session_id: "no-messages".into(),
            ..Default::default()
        })
        .await,
        Code::InvalidArgument,
        "export.messages",
    );
}

/// `session_id` is the session's id instead of the document's `info.id`: the document's
/// own is then neither required nor checked (it was, before the override applied: a
/// document without one, or with one over the id bound, was refused), and the given id is
/// checked in its place, as text or object alike.
#[tokio::test]
async fn a_session_id_stands_in_for_the_documents_own() {
    let server = start_server().await;
    let mut c = server.client().await;
    let long = "i".repeat(300);
    let no_id = r#"{"info": {}, "messages": []}"#.to_string();
    let long_id = format!(r#"{{"info": {{"id": "{long}"}}, "messages": []}}"#);
    let text = |json: &str, id: &str| pb::ImportSessionRequest {
        export_json: json.to_string(),
        session_id: id.into(),
        ..Default::default()
    };
    let object = |json: &str, id: &str| pb::ImportSessionRequest {
        export: Some(json_to_struct(&serde_json::from_str(json).expect("JSON"))),
        session_id: id.into(),
        ..Default::default()
    };
    for (what, req, id) in [
        ("no id, as text", text(&no_id, "given"), "given"),
        ("a long id, as text", text(&long_id, "ok"), "ok"),
        (
            "no id, as an object",
            object(&no_id, "given-object"),
            "given-object",
        ),
        (
            "a long id, as an object",
            object(&long_id, "ok-object"),
            "ok-object",
        ),
    ] {
        let summary = c
            .import_session(req)
            .await
            .unwrap_or_else(|e| panic!("{what}: {e:?}"))
            .into_inner();
        assert_eq!(summary.id, id, "{what}");
        let info = get_session(&mut c, id).await.info.expect("info");
        assert_eq!(info.id, id, "{what}");
        assert_eq!(
            info.extra, None,
            "{what}: the document's own id is not kept"
        );
    }
    // Without one the document's id is required and bounded; a given one is bounded too.
    for (req, needle) in [
        (text(&no_id, ""), "export_json.info.id: missing"),
        (text(&long_id, ""), "export_json.info.id: 300 bytes long"),
        (object(&no_id, ""), "export.info.id: missing"),
        (text(&no_id, &long), "session_id: 300 bytes long"),
        (object(&no_id, &long), "session_id: 300 bytes long"),
    ] {
        let status = assert_status(c.import_session(req).await, Code::InvalidArgument, needle);
        assert!(status.message().starts_with(needle), "{status:?}");
    }
}

/// OpenAI messages with each tool call's `arguments` string parsed into JSON.
fn normalize_arguments(mut messages: Value) -> Value {
    for m in messages.as_array_mut().unwrap() {
        if let Some(calls) = m.get_mut("tool_calls").and_then(Value::as_array_mut) {
            for call in calls {
                let args = &mut call["function"]["arguments"];
                let parsed: Value =
                    serde_json::from_str(args.as_str().unwrap()).expect("arguments are JSON");
                *args = parsed;
            }
        }
    }
    messages
}
