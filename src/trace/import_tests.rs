//! The limited import: refused at the first message past the limit, not after building
//! the rest; the same document within the limit reads exactly as the unlimited parse.

use super::*;

/// An export of `n` messages of one text part each, `info` placed after the messages
/// when `info_last` (JSON objects have no order).
fn document(n: usize, info_last: bool) -> String {
    let messages: Vec<Value> = (0..n)
        .map(|i| {
            serde_json::json!({
                "info": {"id": format!("m{i}"), "sessionID": "s", "role": "user", "time": {"created": i}},
                "parts": [{"id": format!("p{i}"), "messageID": format!("m{i}"), "sessionID": "s", "type": "text", "text": "x".repeat(1000)}],
            })
        })
        .collect();
    let info = serde_json::json!({"id": "s", "title": "t"});
    let doc = if info_last {
        serde_json::json!({"messages": messages, "info": info, "extra_field": 1})
    } else {
        serde_json::json!({"info": info, "messages": messages, "extra_field": 1})
    };
    doc.to_string()
}

fn limit(bytes: u64) -> ByteLimit {
    ByteLimit {
        bytes,
        name: "max_session_bytes",
        value: bytes,
    }
}

#[test]
fn within_the_limit_it_reads_as_the_unlimited_parse_in_any_field_order() {
    for info_last in [false, true] {
        let json = document(20, info_last);
        let limited = parse_export_limited(&json, limit(10 << 20), "").expect("within");
        assert_eq!(limited, parse_export(&json).expect("valid"));
        assert_eq!(limited.messages.len(), 20);
        assert_eq!(limited.info.id, "s");
        assert!(limited.info.extra.contains_key("extra_field"));
    }
}

#[test]
fn past_the_limit_it_stops_at_the_first_message_over() {
    let json = document(10_000, false);
    let e = parse_export_limited(&json, limit(50_000), "").expect_err("over");
    let LimitedError::TooLarge { path, bytes, .. } = &e else {
        panic!("{e:?}");
    };
    // Each message holds over a kilobyte: the parse stops within the first hundred.
    let index: usize = path
        .trim_start_matches("messages[")
        .trim_end_matches(']')
        .parse()
        .expect("a message path");
    assert!(index < 100, "{path}");
    assert!(*bytes > 50_000);
    assert!(e.to_string().contains("max_session_bytes"), "{e}");
    // The Value form stops at the same message.
    let doc: Value = serde_json::from_str(&json).expect("json");
    let e2 = from_value_limited(doc, limit(50_000), "").expect_err("over");
    assert_eq!(e, e2);
}

#[test]
fn invalid_documents_still_name_their_path() {
    let e = parse_export_limited(
        r#"{"info": {"id": "s"}, "messages": [{"info": 3}]}"#,
        limit(1 << 20),
        "",
    )
    .expect_err("invalid");
    assert_eq!(
        e,
        LimitedError::Invalid(err("messages[0].info", "missing or not an object"))
    );
    let e = parse_export_limited(r#"{"messages": []}"#, limit(1 << 20), "").expect_err("no info");
    assert!(
        matches!(e, LimitedError::Invalid(ImportError { ref path, .. }) if path == "info"),
        "{e:?}"
    );
    assert!(parse_export_limited("[1,2]", limit(1 << 20), "").is_err());
    assert!(
        parse_export_limited(
            r#"{"info": {"id": "s"}, "messages": []} trailing"#,
            limit(1 << 20),
            ""
        )
        .is_err()
    );
}

/// A document whose messages and parts do not say the same thing about where a part
/// belongs, or that holds an id twice, is refused naming the path. Before, a part was
/// filed under the message its own `messageID` named (moved silently, or refused with a
/// path the document does not have), and a second message or part with an id taken was
/// merged into the first: the history reordered, a part lost.
#[test]
fn a_part_under_another_message_or_an_id_twice_is_refused_naming_the_path() {
    let msg = |id: &str, role: &str, parts: Value| serde_json::json!({"info": {"id": id, "sessionID": "s", "role": role, "time": {"created": 1}}, "parts": parts});
    let text = |id: &str, mid: &str| serde_json::json!({"id": id, "messageID": mid, "sessionID": "s", "type": "text", "text": "x"});
    let doc = |messages: Vec<Value>| {
        serde_json::json!({"info": {"id": "s"}, "messages": messages}).to_string()
    };
    let cases = [
        (
            doc(vec![
                msg("m1", "user", serde_json::json!([text("p1", "m2")])),
                msg("m2", "user", serde_json::json!([])),
            ]),
            "messages[0].parts[0].messageID",
        ),
        (
            doc(vec![
                msg("m1", "user", serde_json::json!([])),
                msg("m2", "user", serde_json::json!([text("p1", "m1")])),
            ]),
            "messages[1].parts[0].messageID",
        ),
        (
            doc(vec![
                msg("m1", "user", serde_json::json!([text("p1", "m1")])),
                msg("m2", "assistant", serde_json::json!([])),
                msg("m1", "user", serde_json::json!([text("p2", "m1")])),
            ]),
            "messages[2].info.id",
        ),
        (
            doc(vec![msg(
                "m1",
                "user",
                serde_json::json!([text("p1", "m1"), text("p1", "m1")]),
            )]),
            "messages[0].parts[1].id",
        ),
    ];
    for (document, path) in cases {
        let e = parse_export(&document).expect_err(path);
        assert_eq!(e.path, path, "{e:?}");
    }
    // The same part id under two messages is two parts, as on a Stream.
    let two = doc(vec![
        msg("m1", "user", serde_json::json!([text("p1", "m1")])),
        msg("m2", "user", serde_json::json!([text("p1", "m2")])),
    ]);
    assert_eq!(parse_export(&two).expect("valid").messages.len(), 2);
    // Ids with colons are theirs: message "a" with part "b:c" and message "a:b" with
    // part "c" are four ids, not two.
    let colons = doc(vec![
        msg("a", "user", serde_json::json!([text("b:c", "a")])),
        msg("a:b", "user", serde_json::json!([text("c", "a:b")])),
    ]);
    assert_eq!(parse_export(&colons).expect("valid").messages.len(), 2);
    // A part without its own messageID is the message's, as before.
    let ok = doc(vec![msg(
        "m1",
        "user",
        serde_json::json!([{"id": "p1", "type": "text", "text": "x"}]),
    )]);
    assert_eq!(
        parse_export(&ok).expect("valid").messages[0].1[0].message_id,
        "m1"
    );
}

/// Many small JSON values build many times their text (`[0,0,…]`: 2 bytes of text, tens of
/// `Value`, 96 of `Todo`): each top-level field and each message is read within what the
/// limit leaves, so the document is refused before it is built. Before, a 2 MB document
/// of todos under a 1 MiB limit parsed and loaded as a 96 MB session, and a 16 MB
/// message built 610 MB of JSON before its refusal.
#[test]
fn small_values_are_refused_past_the_limit_before_they_are_built() {
    let zeros = |n: usize| format!("[{}0]", "0,".repeat(n));
    let mib = limit(1 << 20);
    // Todos, an unknown field and `info` itself: read whole before messages.
    for (field, json) in [
        (
            "todos",
            format!(
                r#"{{"info":{{"id":"s"}},"messages":[],"todos":{}}}"#,
                zeros(1_000_000)
            ),
        ),
        (
            "other",
            format!(
                r#"{{"info":{{"id":"s"}},"messages":[],"other":{}}}"#,
                zeros(1_000_000)
            ),
        ),
        (
            "info",
            format!(
                r#"{{"info":{{"id":"s","x":{}}},"messages":[]}}"#,
                zeros(1_000_000)
            ),
        ),
    ] {
        match parse_export_limited(&json, mib, "") {
            Err(LimitedError::TooLarge { path, .. }) => assert_eq!(path, field),
            other => panic!("{field}: {other:?}"),
        }
    }
    // One message holding them, after one that fits.
    let json = format!(
        r#"{{"info":{{"id":"s"}},"messages":[{{"info":{{"id":"m0","role":"user"}},"parts":[]}},{{"info":{{"id":"m1","role":"user","x":{}}},"parts":[]}}]}}"#,
        zeros(1_000_000)
    );
    match parse_export_limited(&json, mib, "") {
        Err(LimitedError::TooLarge { path, .. }) => assert_eq!(path, "messages[1]"),
        other => panic!("{other:?}"),
    }
    // Todos past the limit once built (each item becomes a `Todo`, 96 bytes): refused as
    // their JSON is read, and in a document already parsed (the `export` field) once
    // they are built.
    let todos = zeros(6_000);
    let json = format!(r#"{{"info":{{"id":"s"}},"messages":[],"todos":{todos}}}"#);
    let small = limit(500_000);
    match parse_export_limited(&json, small, "") {
        Err(LimitedError::TooLarge { path, .. }) => assert_eq!(path, "todos"),
        other => panic!("{other:?}"),
    }
    let doc: Value = serde_json::from_str(&json).expect("json");
    match from_value_limited(doc, small, "") {
        Err(LimitedError::TooLarge { path, .. }) => assert_eq!(path, "info"),
        other => panic!("{other:?}"),
    }
    // Within the limit, all of it reads as before.
    let export = parse_export_limited(&json, limit(10 << 20), "").expect("within");
    assert_eq!(export.info.todos.len(), 6_001);
    // Todos after the messages are read within what the fields before them left: here
    // their JSON fits, and the messages built plus the todos built do not.
    let text = "x".repeat(300_000);
    let json = format!(
        r#"{{"info":{{"id":"s"}},"messages":[{{"info":{{"id":"m0","role":"user"}},"parts":[{{"id":"p0","type":"text","text":"{text}"}}]}}],"todos":{}}}"#,
        zeros(2_500)
    );
    match parse_export_limited(&json, small, "") {
        Err(LimitedError::TooLarge { path, .. }) => assert_eq!(path, "info"),
        other => panic!("{other:?}"),
    }
    assert!(parse_export_limited(&json, limit(1 << 20), "").is_ok());
}

/// A key given twice inside a message is refused as well: the last of the two would
/// replace the first (two `parts` arrays imported the second only).
#[test]
fn a_key_given_twice_inside_a_message_is_refused() {
    let json = r#"{"info":{"id":"s"},"messages":[{"info":{"id":"m0","role":"user"},"parts":[{"id":"a","type":"text","text":"A"}],"parts":[]}]}"#;
    match parse_export_limited(json, limit(1 << 20), "") {
        Err(LimitedError::Invalid(e)) => {
            assert!(e.message.contains(r#"key "parts" given twice"#), "{e:?}")
        }
        other => panic!("{other:?}"),
    }
}

/// The domain's field names as the export spells them. Before, a refusal named the
/// protobuf's path (`tool.call_id`, `text.metadata`), which the document does not have.
#[test]
fn domain_fields_are_named_as_the_document_spells_them() {
    for (field, part, json) in [
        ("tool.call_id", true, "callID"),
        ("tool.tool", true, "tool"),
        ("tool.state.input", true, "state.input"),
        ("text.metadata", true, "metadata"),
        ("message_id", true, "messageID"),
        ("extra", true, ""),
        ("id", false, "id"),
        ("parent_id", false, "parentID"),
        ("model.provider_id", false, "model.providerID"),
        ("error.data", false, "error.data"),
    ] {
        assert_eq!(json_field(field, part), json, "{field}");
    }
}

/// A top-level field given twice is refused: a JSON parser keeps one of the two, so a
/// document with two `messages` arrays imported only the last, without a word.
#[test]
fn a_top_level_field_given_twice_is_refused() {
    for (json, field) in [
        (
            r#"{"info":{"id":"s"},"messages":[{"info":{"id":"m0","role":"user"},"parts":[]}],"messages":[]}"#,
            "messages",
        ),
        (
            r#"{"info":{"id":"s"},"info":{"id":"t"},"messages":[]}"#,
            "info",
        ),
        (r#"{"info":{"id":"s"},"messages":[],"x":1,"x":2}"#, "x"),
    ] {
        assert_eq!(
            parse_export_limited(json, limit(1 << 20), ""),
            Err(LimitedError::Invalid(err(
                field,
                "given twice in the document"
            ))),
            "{json}"
        );
    }
}

/// A usage report that is not an object is refused naming it: dropped, the report was
/// lost without a word (and with it what overflow detection learns). Null is no report.
#[test]
fn a_usage_report_that_is_not_an_object_is_refused() {
    let doc = |info_tokens: &str, part_tokens: &str| {
        format!(
            r#"{{"info":{{"id":"s"}},"messages":[{{"info":{{"id":"m0","role":"assistant","tokens":{info_tokens}}},"parts":[{{"id":"p0","type":"step-finish","tokens":{part_tokens}}}]}}]}}"#
        )
    };
    for (json, path) in [
        (doc(r#""12""#, "null"), "messages[0].info.tokens"),
        (doc("null", "[1]"), "messages[0].parts[0].tokens"),
    ] {
        assert_eq!(
            parse_export_limited(&json, limit(1 << 20), ""),
            Err(LimitedError::Invalid(err(path, "not an object"))),
        );
    }
    let export = parse_export_limited(&doc("null", r#"{"input":5}"#), limit(1 << 20), "")
        .expect("null and objects are taken");
    assert_eq!(export.messages[0].0.tokens, None);
}

/// compactd counts reasoning within `output` (a total less the output is the prompt).
/// OpenCode 1.18 writes `output` less the reasoning, with the provider's total (reasoning
/// within): the two are added up, on messages and step-finish parts alike. OpenCode 1.2
/// kept reasoning within `output` (its total holds input, cache and output only, as in
/// tests/data/traces): taken as given. Before, a 1.18 export's prompt read long by the
/// reasoning.
#[test]
fn reasoning_reported_apart_from_the_output_is_counted_within_it() {
    let doc = |tokens: &str| {
        format!(
            r#"{{"info":{{"id":"s"}},"messages":[{{"info":{{"id":"m0","role":"assistant","tokens":{tokens}}},"parts":[{{"id":"p0","type":"step-finish","tokens":{tokens}}}]}}]}}"#
        )
    };
    let apart = r#"{"total":15000,"input":4000,"output":1000,"reasoning":4000,"cache":{"read":6000,"write":0}}"#;
    let within = r#"{"total":15459,"input":15338,"output":121,"reasoning":101,"cache":{"read":0,"write":0}}"#;
    for (tokens, output) in [(apart, 5_000), (within, 121)] {
        let export = parse_export(&doc(tokens)).expect("valid");
        let (info, parts) = &export.messages[0];
        let usage = info.tokens.expect("reported");
        assert_eq!(usage.output, output, "{tokens}");
        assert_eq!(
            usage.total.map(|t| t - usage.output),
            Some(usage.input + usage.cache_read),
            "the prompt: {tokens}"
        );
        match &parts[0].kind {
            PartKind::StepFinish(s) => assert_eq!(s.tokens.map(|t| t.output), Some(output)),
            other => panic!("{other:?}"),
        }
    }
}

/// A retry's `attempt` past `u32` is held at the largest attempt, as every other number
/// of the document is held within its type: cut to 32 bits, 4,294,967,297 read as 1.
#[test]
fn a_retry_attempt_past_u32_is_held_at_the_largest() {
    let doc = |attempt: &str| {
        format!(
            r#"{{"info":{{"id":"s"}},"messages":[{{"info":{{"id":"m0","role":"assistant"}},"parts":[{{"id":"p0","type":"retry","attempt":{attempt}}}]}}]}}"#
        )
    };
    for (attempt, read) in [
        ("4294967297", u32::MAX),
        ("1e30", u32::MAX),
        ("4294967295", u32::MAX),
        ("3", 3),
        ("-2", 0),
    ] {
        let export = parse_export(&doc(attempt)).expect("valid");
        match &export.messages[0].1[0].kind {
            PartKind::Retry(r) => assert_eq!(r.attempt, read, "{attempt}"),
            other => panic!("{other:?}"),
        }
    }
}

/// A `session_id` given stands in for the document's `info.id`: a document without one,
/// or with one past the id bound, reads under the given id (the document's own is not
/// kept). Before, the document's id was required and checked before the given one
/// replaced it.
#[test]
fn a_given_session_id_stands_in_for_the_documents_own() {
    let long = "i".repeat(300);
    for json in [
        r#"{"info": {"title": "t"}, "messages": []}"#.to_string(),
        format!(r#"{{"info": {{"id": "{long}", "title": "t"}}, "messages": []}}"#),
    ] {
        let doc: Value = serde_json::from_str(&json).expect("JSON");
        for export in [
            parse_export_limited(&json, limit(1 << 20), "given").expect("text"),
            from_value_limited(doc, limit(1 << 20), "given").expect("object"),
        ] {
            assert_eq!(export.info.id, "given", "{json}");
            assert_eq!(export.info.title, "t", "{json}");
            assert!(export.info.extra.is_empty(), "{json}");
        }
        // Without one, the document's own id is required and bounded.
        let own = parse_export_limited(&json, limit(1 << 20), "").expect_err("its own id");
        assert!(
            matches!(&own, LimitedError::Invalid(ImportError { path, .. }) if path == "info.id"),
            "{own:?}"
        );
    }
}

/// What the import does not model is kept in `extra` under its own key, wherever it sits:
/// a `model` that is not an object, a message's own fields beside `info` and `parts`,
/// entries of `patch.files` that are not strings, unknown keys of a part's `time`, of a
/// retry's `time` and of a tool state's `time`, attachments that are not objects. Before,
/// each was dropped without a word.
#[test]
fn what_the_import_does_not_model_is_kept_under_its_key() {
    let doc = serde_json::json!({
        "info": {"id": "s"},
        "messages": [
            {
                "info": {"id": "m0", "role": "user", "model": "gpt-4o"},
                "parts": [],
                "revert": {"messageID": "m0"},
            },
            {
                "info": {"id": "m1", "role": "assistant", "parentID": "m0"},
                "parts": [
                    {"id": "p0", "type": "text", "text": "t", "time": {"start": 1, "end": 2, "paused": true}},
                    {"id": "p1", "type": "patch", "hash": "h", "files": ["a.rs", 3, {"b": 1}]},
                    {"id": "p2", "type": "retry", "attempt": 2, "time": {"created": 5, "zone": "utc"}},
                    {"id": "p3", "type": "tool", "callID": "c", "tool": "read", "state": {
                        "status": "completed", "input": {}, "output": "o",
                        "time": {"start": 1, "end": 2, "queued": 0},
                        "attachments": [{"mime": "text/plain", "url": "u"}, "not-a-file", 7],
                    }},
                ],
            },
        ],
    });
    for export in [
        parse_export(&doc.to_string()).expect("text"),
        from_value(doc.clone()).expect("object"),
    ] {
        let (user, _) = &export.messages[0];
        assert_eq!(user.model, None);
        assert_eq!(user.extra.get("model"), Some(&serde_json::json!("gpt-4o")));
        assert_eq!(
            user.extra.get("revert"),
            Some(&serde_json::json!({"messageID": "m0"}))
        );
        let parts = &export.messages[1].1;
        let extra = |j: usize, key: &str| parts[j].extra.get(key).cloned();
        match &parts[0].kind {
            PartKind::Text(t) => assert_eq!(
                t.time,
                Some(PartTime {
                    start: 1,
                    end: Some(2)
                })
            ),
            other => panic!("{other:?}"),
        }
        assert_eq!(extra(0, "time"), Some(serde_json::json!({"paused": true})));
        match &parts[1].kind {
            PartKind::Patch(p) => assert_eq!(p.files, ["a.rs"]),
            other => panic!("{other:?}"),
        }
        assert_eq!(extra(1, "files"), Some(serde_json::json!([3, {"b": 1}])));
        match &parts[2].kind {
            PartKind::Retry(r) => assert_eq!((r.attempt, r.created), (2, 5)),
            other => panic!("{other:?}"),
        }
        assert_eq!(extra(2, "time"), Some(serde_json::json!({"zone": "utc"})));
        match &parts[3].kind {
            PartKind::Tool(t) => {
                assert_eq!((t.state.time.start, t.state.time.end), (1, Some(2)));
                assert_eq!(t.state.attachments.len(), 1);
                assert_eq!(t.state.attachments[0].url, "u");
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(
            extra(3, "state"),
            Some(serde_json::json!({"time": {"queued": 0}, "attachments": ["not-a-file", 7]}))
        );
    }
    // A message's own field that its info also has unknown to the import: one would be
    // lost, so the document is refused naming it.
    let twice = r#"{"info":{"id":"s"},"messages":[{"info":{"id":"m0","role":"user","revert":1},"revert":2}]}"#;
    assert_eq!(
        parse_export(twice),
        Err(err(
            "messages[0].revert",
            "also a field of the message's info, unknown to the import: one of the two would be lost"
        ))
    );
}

/// What a document names (a part type, a key given twice, a message's field clashing
/// with its info's, a message id) is quoted clipped. Before, a 1 MiB part type came back
/// whole in the error, 6 MiB once escaped: past what a client accepts in a trailer.
#[test]
fn a_long_value_a_document_names_is_quoted_clipped() {
    let long = "\u{1}".repeat(1 << 20);
    let part = |extra: &str| {
        format!(
            r#"{{"info":{{"id":"s"}},"messages":[{{"info":{{"id":"m","role":"user"}},"parts":[{{"id":"p",{extra}}}]}}]}}"#
        )
    };
    let documents = [
        (part(&format!(r#""type":"{long}""#)), 64 << 20),
        (
            part(&format!(r#""type":"text","text":"a","messageID":"{long}""#)),
            64 << 20,
        ),
        (
            format!(r#"{{"info":{{"id":"s"}},"messages":[],"{long}":1,"{long}":2}}"#),
            64 << 20,
        ),
        (
            format!(
                r#"{{"info":{{"id":"s"}},"messages":[{{"info":{{"id":"m","role":"user","{long}":1}},"{long}":2,"parts":[]}}]}}"#
            ),
            64 << 20,
        ),
        (
            format!(
                r#"{{"info":{{"id":"s"}},"messages":[],"{long}":[{}]}}"#,
                "1,".repeat(100_000) + "1"
            ),
            // Past the limit in the value of the long key.
            2 << 20,
        ),
    ];
    for (json, bytes) in documents {
        let e = parse_export_limited(&json, limit(bytes), "").expect_err("refused");
        let shown = match &e {
            LimitedError::Invalid(e) => format!("{}: {}", e.path, e.message),
            LimitedError::TooLarge { path, .. } => path.clone(),
        };
        assert!(shown.len() < 1024, "{} bytes: {e:?}", shown.len());
    }
}

/// A document whose title passes the bound on titles (1 KiB) is imported with it clipped,
/// not refused whole: another tool's label. Found in review: the bound refused such an
/// export (and stopped `compactd replay` at its file).
#[test]
fn a_long_title_is_imported_clipped() {
    let title = "t".repeat(5_000);
    let json = format!(r#"{{"info":{{"id":"s","title":"{title}"}},"messages":[]}}"#);
    let export = parse_export_limited(&json, limit(1 << 20), "").expect("imported");
    assert!(export.info.title.len() <= crate::domain::MAX_TITLE_BYTES);
    assert!(export.info.title.starts_with("ttt") && export.info.title.ends_with('…'));
}
