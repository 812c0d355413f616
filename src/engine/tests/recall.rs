//! Recall: the original content of a part, by call id or part id, with how the context
//! reads it now; and the tool definition a host gives its model.

use serde_json::json;

use super::*;
use crate::engine::{
    RECALL_TOOL, RecallKey, Recalled, RecalledCall, RecalledContent, Reduction, recall_tool,
    recall_tool_json,
};

const SESSION: &str = "
    user u1 text:t1=10
    assistant a1 read:p1=30000 read:p2=30000 read:p3=30000
    user u2 text:t2=10
    assistant a2 text:x2=10
    user u3 text:t3=10
    assistant a3 text:x3=10
";

fn call_id(id: &str) -> RecallKey {
    RecallKey::CallId(id.into())
}

fn part_id(id: &str) -> RecallKey {
    RecallKey::PartId(id.into())
}

#[test]
fn a_cleared_output_is_recalled_whole_by_call_id_and_by_part_id() {
    let mut s = session(SESSION);
    let mut input = find(&s, "p1");
    state_mut(&mut input).input = json!({"filePath": "src/parser.rs"});
    apply(&mut s, Update::UpsertPart(input));
    assert!(s.prune(PruneMode::Commit, NOW).committed);

    let placeholder = s.counter().count(crate::config::PLACEHOLDER);
    let want = Recalled {
        message_id: "a1".into(),
        part_id: "p1".into(),
        part_type: "tool",
        content: RecalledContent::Call(Box::new(RecalledCall {
            tool: "read".into(),
            call_id: "call_p1".into(),
            status: ToolStatus::Completed,
            input: json!({"filePath": "src/parser.rs"}),
            output: chars(120_000),
            error: String::new(),
        })),
        reduction: Some(Reduction::Cleared),
        pinned: false,
        tokens: find_stored(&s, "p1").est.base + 30_000,
        context_tokens: find_stored(&s, "p1").context_tokens(),
    };
    assert!(want.context_tokens < placeholder + 20, "{want:?}");
    assert_eq!(s.recall(&call_id("call_p1")), Some(want.clone()));
    assert_eq!(s.recall(&part_id("p1")), Some(want));
    // The newest output reads verbatim.
    let p3 = s.recall(&call_id("call_p3")).expect("p3");
    assert_eq!(p3.reduction, None);
    assert_eq!(p3.context_tokens, p3.tokens);
}

/// A provider that numbers calls per response reuses call ids across turns. Recalled by
/// such an id, the part the context hides comes back (the newest of them), not the one
/// the agent can already read. Before, the newest part with the id always came back:
/// p1 and p2, cleared and naming `call_0`, could not be reached with the tool's only
/// parameter.
#[test]
fn a_reused_call_id_recalls_the_part_the_context_hides() {
    let mut s = session(SESSION);
    for id in ["p1", "p2", "p3"] {
        let mut p = find(&s, id);
        if let PartKind::Tool(t) = &mut p.kind {
            t.call_id = "call_0".into();
        }
        apply(&mut s, Update::UpsertPart(p));
    }
    assert!(s.prune(PruneMode::Commit, NOW).committed);
    let r = s.recall(&call_id("call_0")).expect("recalled");
    assert_eq!(
        (r.part_id.as_str(), r.reduction),
        ("p2", Some(Reduction::Cleared))
    );
    // By part id, each is reached as before.
    let p3 = s.recall(&part_id("p3")).expect("p3");
    assert_eq!(p3.reduction, None);
}

#[test]
fn unknown_ids_recall_nothing_and_text_parts_recall_their_text() {
    let s = session(SESSION);
    assert_eq!(s.recall(&call_id("call_nope")), None);
    assert_eq!(s.recall(&part_id("nope")), None);
    // A call id is not a part id, nor the other way round.
    assert_eq!(s.recall(&call_id("p1")), None);
    assert_eq!(s.recall(&part_id("call_p1")), None);
    let t = s.recall(&part_id("t2")).expect("text");
    assert_eq!(
        (t.part_type, t.content, t.reduction),
        ("text", RecalledContent::Text(chars(40)), None)
    );
    assert_eq!(
        (call_id("x").field(), part_id("y").field()),
        ("call_id", "part_id")
    );
}

#[test]
fn a_summarized_part_is_recalled_and_a_pinned_one_is_not_summarized() {
    let mut s = session(
        "
        user u1 text:t1=10
        assistant a1 bash:p1=400 bash:p2=400
        user u2 text:t2=10
        assistant a2 text:x2=10
        user u3 text:t3=10
        assistant a3 text:x3=10
        ",
    );
    apply(
        &mut s,
        Update::Pin {
            message_id: "a1".into(),
            part_id: Some("p2".into()),
            pinned: true,
        },
    );
    compact_keeping(&mut s, 2, "Ran two commands.", "cmp");

    let p1 = s.recall(&call_id("call_p1")).expect("p1");
    assert_eq!(
        (p1.reduction, p1.context_tokens),
        (Some(Reduction::Summarized), 0)
    );
    match &p1.content {
        RecalledContent::Call(c) => assert_eq!(c.output, chars(1_600)),
        other => panic!("expected a call, got {other:?}"),
    }
    let p2 = s.recall(&call_id("call_p2")).expect("p2");
    assert_eq!((p2.reduction, p2.pinned), (None, true));
    assert_eq!(p2.context_tokens, p2.tokens);
}

#[test]
fn the_tool_definition_is_an_openai_function_taking_a_call_id() {
    let tool = recall_tool();
    assert_eq!(tool["type"], "function");
    assert_eq!(tool["function"]["name"], RECALL_TOOL);
    assert_eq!(RECALL_TOOL, "compactd_recall");
    let params = &tool["function"]["parameters"];
    assert_eq!(params["type"], "object");
    assert_eq!(params["properties"]["call_id"]["type"], "string");
    assert_eq!(params["required"], json!(["call_id"]));
    assert!(
        tool["function"]["description"]
            .as_str()
            .is_some_and(|d| d.contains("call")),
    );
    let text = recall_tool_json();
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&text).expect("json"),
        tool
    );
}

/// A stored part by id, with its figures.
fn find_stored(s: &Session, part_id: &str) -> crate::engine::StoredPart {
    s.messages()
        .iter()
        .flat_map(|m| &m.parts)
        .find(|p| p.part.id == part_id)
        .unwrap_or_else(|| panic!("no part {part_id}"))
        .clone()
}
