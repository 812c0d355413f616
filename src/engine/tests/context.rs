//! The context view: compaction boundary (seed 02 `filterCompacted`), OpenCode's rendering
//! rules (traces README) and the OpenAI shape.

use serde_json::json;

use super::*;
use crate::config::{COMPACTION_PROMPT_TEXT, INTERRUPTED, PLACEHOLDER};
use crate::domain::FilePart;
use crate::engine::estimate::IMAGE_TOKENS;
use crate::engine::{ContextView, Trigger};

/// Builds the fixture and compares the boundary and the ids of the messages sent, each
/// with the ids of its parts.
fn check_context(fixture: &str, boundary: Option<&str>, messages: &[(&str, &[&str])]) {
    let s = session(fixture);
    check_view(&s, boundary, messages);
}

fn check_view(s: &Session, boundary: Option<&str>, messages: &[(&str, &[&str])]) {
    let view = s.build_context();
    let got: Vec<(String, Vec<String>)> = view
        .messages
        .iter()
        .map(|m| {
            (
                m.info.id.clone(),
                m.parts.iter().map(|p| p.part.id.clone()).collect(),
            )
        })
        .collect();
    let want: Vec<(String, Vec<String>)> = messages
        .iter()
        .map(|(m, ps)| (m.to_string(), ps.iter().map(|p| p.to_string()).collect()))
        .collect();
    assert_eq!((view.boundary_message_id.as_deref(), got), (boundary, want));
    assert_eq!(view.tokens, view_tokens_from_parts(&view));
}

const COMPACTED: &str = "
    user u1 text:t1=5
    assistant a1 read:p1=10
    user u2 compaction:c2
    assistant s2 {summary} text:t2=20
    user u3 text:t3=3
    assistant a3 text:t4=4
    ";

#[test]
fn context_starts_at_the_completed_compaction() {
    check_context(
        &COMPACTED.replace("{summary}", "summary"),
        Some("u2"),
        &[
            ("u2", &["c2"]),
            ("s2", &["t2"]),
            ("u3", &["t3"]),
            ("a3", &["t4"]),
        ],
    );
}

#[test]
fn unfinished_summary_is_no_boundary() {
    check_context(
        &COMPACTED.replace("{summary}", "summary unfinished"),
        None,
        &[
            ("u1", &["t1"]),
            ("a1", &["p1"]),
            ("u2", &["c2"]),
            ("s2", &["t2"]),
            ("u3", &["t3"]),
            ("a3", &["t4"]),
        ],
    );
}

/// An errored summary is no boundary, and as an errored assistant message it is not sent.
#[test]
fn errored_summary_is_no_boundary() {
    check_context(
        &COMPACTED.replace("{summary}", "summary error=APIError"),
        None,
        &[
            ("u1", &["t1"]),
            ("a1", &["p1"]),
            ("u2", &["c2"]),
            ("u3", &["t3"]),
            ("a3", &["t4"]),
        ],
    );
}

#[test]
fn summary_without_compaction_part_is_no_boundary() {
    check_context(
        "
        user u1 text:t1=5
        assistant s1 summary text:t2=20
        user u2 text:t3=3
        ",
        None,
        &[("u1", &["t1"]), ("s1", &["t2"]), ("u2", &["t3"])],
    );
}

#[test]
fn latest_compaction_wins() {
    check_context(
        "
        user u1 compaction:c1
        assistant s1 summary text:t1=5
        user u2 text:t2=5
        user u3 compaction:c3
        assistant s3 summary text:t3=5
        user u4 text:t4=5
        user u5 compaction:c5
        assistant s5 summary unfinished text:t5=5
        ",
        Some("u3"),
        &[
            ("u3", &["c3"]),
            ("s3", &["t3"]),
            ("u4", &["t4"]),
            ("u5", &["c5"]),
            ("s5", &["t5"]),
        ],
    );
}

/// The boundary follows late updates: the summary finishing, the compaction part going.
#[test]
fn boundary_follows_late_updates() {
    let mut s = session(&COMPACTED.replace("{summary}", "summary unfinished"));
    assert_eq!(s.build_context().boundary_message_id, None);
    let mut s2 = s.messages()[s.position("s2").unwrap()].info.clone();
    s2.finish = "stop".into();
    apply(&mut s, Update::UpsertMessage(s2.clone()));
    assert_eq!(s.build_context().boundary_message_id.as_deref(), Some("u2"));
    s2.error = Some(MessageError {
        name: "APIError".into(),
        data: serde_json::Value::Null,
    });
    apply(&mut s, Update::UpsertMessage(s2.clone()));
    assert_eq!(s.build_context().boundary_message_id, None);
    s2.error = None;
    apply(&mut s, Update::UpsertMessage(s2));
    assert_eq!(s.build_context().boundary_message_id.as_deref(), Some("u2"));
    apply(
        &mut s,
        Update::DeletePart {
            message_id: "u2".into(),
            part_id: "c2".into(),
        },
    );
    assert_eq!(s.build_context().boundary_message_id, None);
    assert_eq!(s.build_context().messages.len(), 5, "u2 has no parts left");
}

#[test]
fn pending_and_running_tools_read_as_interrupted() {
    let s = session(
        "
        user u1 text:t1=1
        assistant a1 read:p1=5@pending bash:p2=5@running read:p3=5 bash:p4=5@error
        ",
    );
    let view = s.build_context();
    let got: Vec<(String, ToolStatus, String, usize)> = view.messages[1]
        .parts
        .iter()
        .map(|p| {
            let st = state(&p.part);
            (
                p.part.id.clone(),
                st.status,
                st.error.clone(),
                st.output.len(),
            )
        })
        .collect();
    let err = chars(20);
    assert_eq!(
        got,
        vec![
            ("p1".into(), ToolStatus::Error, INTERRUPTED.into(), 20),
            ("p2".into(), ToolStatus::Error, INTERRUPTED.into(), 20),
            ("p3".into(), ToolStatus::Completed, String::new(), 20),
            ("p4".into(), ToolStatus::Error, err, 20),
        ]
    );
    // The session itself is unchanged.
    assert_eq!(state(&find(&s, "p1")).status, ToolStatus::Pending);
    assert_eq!(view.tokens, view_tokens_from_parts(&view));
}

/// Errored assistant messages are skipped unless aborted with content other than
/// step-start and reasoning.
#[test]
fn errored_assistant_messages_are_skipped_unless_aborted_with_content() {
    check_context(
        "
        user u1 text:t1=1
        assistant a1 error=APIError text:t2=5
        assistant a2 error=MessageAbortedError text:t3=5
        assistant a3 error=MessageAbortedError step:s3
        assistant a4 error=MessageAbortedError step:s4 reasoning:r4=5
        assistant a5 error=MessageAbortedError step:s5 read:p5=5@running
        assistant a6 error=MessageAbortedError
        assistant a7 error=ContextOverflowError read:p7=5
        assistant a8 text:t8=1
        ",
        None,
        &[
            ("u1", &["t1"]),
            ("a2", &["t3"]),
            ("a5", &["s5", "p5"]),
            ("a8", &["t8"]),
        ],
    );
}

#[test]
fn step_start_only_messages_are_dropped() {
    check_context(
        "
        user u1 text:t1=1
        assistant a1 step:s1
        assistant a2 step:s2 text:t2=1
        assistant a3 step:s3 ignored:t3=5
        assistant a4 step:s4a step:s4b
        assistant a5
        user u2 text:t4=1
        ",
        None,
        &[("u1", &["t1"]), ("a2", &["s2", "t2"]), ("u2", &["t4"])],
    );
}

#[test]
fn ignored_text_is_dropped() {
    let fixture = "
        user u1 text:t1=2 ignored:t2=50
        user u2 ignored:t3=5
        assistant a2 text:t4=3
        ";
    check_context(fixture, None, &[("u1", &["t1"]), ("a2", &["t4"])]);
    assert_eq!(session(fixture).build_context().tokens, 2 + 3);
}

#[test]
fn compacted_output_reads_as_placeholder() {
    let mut s = session(
        "
        user u1 text:t1=1
        assistant a1 read:p1=100@compacted read:p2=3
        ",
    );
    let mut p1 = find(&s, "p1");
    state_mut(&mut p1).attachments.push(FilePart {
        mime: "image/png".into(),
        url: "data:image/png;base64,AAAA".into(),
        ..Default::default()
    });
    apply(&mut s, Update::UpsertPart(p1));
    let view = s.build_context();
    let rendered = &view.messages[1].parts;
    assert_eq!(state(&rendered[0].part).output, PLACEHOLDER);
    assert!(state(&rendered[0].part).attachments.is_empty());
    assert_eq!(state(&rendered[0].part).time.compacted, Some(1));
    assert_eq!(state(&rendered[1].part).output, chars(12));
    // Stored output untouched.
    assert_eq!(state(&find(&s, "p1")).output.len(), 400);
    // t1 1; input `{}` 1 token each, placeholder 8, p2 output 3.
    assert_eq!(view.tokens, 1 + (1 + 8) + (1 + 3));
    assert_eq!(view.tokens, view_tokens_from_parts(&view));
}

/// Tokens of the view are the sum of the rendered parts' estimates, and only from the
/// boundary on.
#[test]
fn view_tokens_are_the_sum_of_part_estimates() {
    let s = session(
        "
        user u0 text:t0=1000
        assistant a0 read:p0=5000
        user u1 text:t1=10 compaction:c1
        assistant s1 summary text:ts=20
        user u2 ignored:t2=99 text:t3=4
        assistant a1 read:p1=100@compacted bash:p2=7@running reasoning:r1=6 step:st
        assistant a2 error=APIError text:t9=500
        ",
    );
    let view = s.build_context();
    // t1 10 + compaction prompt 6 | ts 20 | t3 4 | p1 1+8, p2 1+8 (interrupted), r1 6.
    assert_eq!(view.tokens, 10 + 6 + 20 + 4 + 9 + 9 + 6);
    assert_eq!(view.tokens, view_tokens_from_parts(&view));
    assert_eq!(CharsPerToken.count(COMPACTION_PROMPT_TEXT), 6);
    assert_eq!(CharsPerToken.count(INTERRUPTED), 8);
    assert_eq!(CharsPerToken.count(PLACEHOLDER), 8);
    // Everything held, before the boundary and errored messages included.
    assert_eq!(s.total_tokens(), tokens_from_scratch(&s));
    assert_eq!(s.total_tokens(), view.tokens + 1000 + 5001 + 500);
}

fn tool_with(
    msg: &str,
    id: &str,
    name: &str,
    input: serde_json::Value,
    status: ToolStatus,
    out: &str,
) -> Part {
    let mut p = tool_in(msg, id, name, status, out);
    state_mut(&mut p).input = input;
    p
}

#[test]
fn openai_shape() {
    let mut s = new_session(SessionOverrides::default(), ModelLimits::default());
    let mut a2 = assistant("a2", "u2");
    a2.finish.clear();
    for u in [
        Update::UpsertMessage(user("u1")),
        Update::UpsertPart(text("u1", "t1", "Read main.rs please")),
        Update::UpsertMessage(assistant("a1", "u1")),
        Update::UpsertPart(step_start("a1", "s1")),
        Update::UpsertPart(text("a1", "t2", "Reading.")),
        Update::UpsertPart(tool_with(
            "a1",
            "p1",
            "read",
            json!({"filePath": "main.rs"}),
            ToolStatus::Completed,
            "fn main() {}",
        )),
        Update::UpsertPart(tool_with(
            "a1",
            "p2",
            "bash",
            json!({"command": "cargo build"}),
            ToolStatus::Error,
            "exit 1",
        )),
        Update::UpsertPart(step_start("a1", "s2")),
        Update::UpsertPart(tool_with(
            "a1",
            "p3",
            "bash",
            json!({"command": "ls"}),
            ToolStatus::Completed,
            "src\nCargo.toml",
        )),
        Update::UpsertPart(step_start("a1", "s3")),
        Update::UpsertPart(text("a1", "t3", "Done.")),
        Update::UpsertPart(text("a1", "t4", "Anything else?")),
        Update::UpsertMessage(user("u2")),
        Update::UpsertPart(compaction("u2", "c2")),
        Update::UpsertMessage(a2),
        Update::UpsertPart(tool_with(
            "a2",
            "p4",
            "grep",
            json!({}),
            ToolStatus::Running,
            "",
        )),
    ] {
        apply(&mut s, u);
    }
    let mut p3 = find(&s, "p3");
    state_mut(&mut p3).time.compacted = Some(NOW);
    apply(&mut s, Update::UpsertPart(p3));

    let expected = json!([
        {"role": "user", "content": "Read main.rs please"},
        {
            "role": "assistant",
            "content": "Reading.",
            "tool_calls": [
                {"id": "call_p1", "type": "function",
                 "function": {"name": "read", "arguments": "{\"filePath\":\"main.rs\"}"}},
                {"id": "call_p2", "type": "function",
                 "function": {"name": "bash", "arguments": "{\"command\":\"cargo build\"}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_p1", "content": "fn main() {}"},
        {"role": "tool", "tool_call_id": "call_p2", "content": "exit 1"},
        {
            "role": "assistant",
            "content": null,
            "tool_calls": [
                {"id": "call_p3", "type": "function",
                 "function": {"name": "bash", "arguments": "{\"command\":\"ls\"}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_p3", "content": PLACEHOLDER},
        {"role": "assistant", "content": "Done.\n\nAnything else?"},
        {"role": "user", "content": "What did we do so far?"},
        {
            "role": "assistant",
            "content": null,
            "tool_calls": [
                {"id": "call_p4", "type": "function",
                 "function": {"name": "grep", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_p4", "content": "[Tool execution was interrupted]"},
    ]);
    let got = s.build_context().to_openai();
    assert_eq!(
        got,
        expected,
        "got {}",
        serde_json::to_string_pretty(&got).unwrap()
    );
    // Every arguments value is a JSON string that parses back to the call's input.
    for call in got
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|m| m.get("tool_calls"))
        .flat_map(|c| c.as_array().unwrap())
    {
        let args = call["function"]["arguments"].as_str().expect("a string");
        serde_json::from_str::<serde_json::Value>(args).expect("valid JSON");
    }
}

#[test]
fn openai_user_content_parts() {
    let mut s = new_session(SessionOverrides::default(), ModelLimits::default());
    let file = |id: &str, mime: &str, url: &str| Part {
        id: id.into(),
        message_id: "u1".into(),
        kind: PartKind::File(FilePart {
            mime: mime.into(),
            filename: "f".into(),
            url: url.into(),
            ..Default::default()
        }),
        mark: None,
        extra: Extra::new(),
    };
    for u in [
        Update::UpsertMessage(user("u1")),
        Update::UpsertPart(text("u1", "t1", "look")),
        Update::UpsertPart(file("f1", "image/png", "data:image/png;base64,AA")),
        Update::UpsertPart(file("f2", "text/plain", "file:///f")),
        Update::UpsertPart(file("f3", "application/pdf", "file:///f.pdf")),
    ] {
        apply(&mut s, u);
    }
    assert_eq!(
        s.build_context().to_openai(),
        json!([{
            "role": "user",
            "content": [
                {"type": "text", "text": "look"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}},
                {"type": "text", "text": "[File: f (application/pdf)]"},
            ],
        }])
    );
}

/// A file is counted as what the provider is sent for it: a text file or a directory is
/// nothing (its content arrives as a synthetic text part, counted there), an image is an
/// image (a provider's tokens per image, not its base64 text), anything else by its name.
/// Before, a 1 MB screenshot counted as ~350,000 tokens of base64 (an instant overflow),
/// and a text file twice.
#[test]
fn files_count_as_what_the_provider_is_sent() {
    let file = |id: &str, mime: &str, url: String| Part {
        id: id.into(),
        message_id: "u1".into(),
        kind: PartKind::File(FilePart {
            mime: mime.into(),
            filename: "f".into(),
            url,
            ..Default::default()
        }),
        mark: None,
        extra: Extra::new(),
    };
    let base64 = "iVBORw0KGgo".repeat(100_000);
    let alone = |part: Option<Part>| {
        let mut s = new_session(SessionOverrides::default(), ModelLimits::default());
        apply(&mut s, Update::UpsertMessage(user("u1")));
        apply(&mut s, Update::UpsertPart(text("u1", "t1", "hello there")));
        if let Some(p) = part {
            apply(&mut s, Update::UpsertPart(p));
        }
        let predicted = s.check_overflow(Trigger::Request).predicted;
        assert_eq!(predicted, s.context_tokens());
        s.context_tokens()
    };
    let text_only = alone(None);
    let text_file = format!("data:text/plain;base64,{base64}");
    assert_eq!(alone(Some(file("f1", "text/plain", text_file))), text_only);
    let dir = "file:///repo/src".to_string();
    assert_eq!(
        alone(Some(file("f1", "application/x-directory", dir))),
        text_only
    );
    let image = alone(Some(file(
        "f1",
        "image/png",
        format!("data:image/png;base64,{base64}"),
    )));
    assert_eq!(image - text_only, IMAGE_TOKENS);
    let linked = alone(Some(file(
        "f1",
        "image/png",
        "https://example.com/a.png".into(),
    )));
    assert_eq!(linked - text_only, IMAGE_TOKENS);
}

/// A stamp on a call that is not completed has no effect on what is sent (only completed
/// outputs are replaced by the placeholder), so it must not change the view's tokens.
#[test]
fn stamp_on_a_non_completed_tool_does_not_count_the_placeholder() {
    let mut s = session(
        "
        user u1 text:t1=1
        assistant a1 read:p1=5@error bash:p2=5@running
        ",
    );
    let clean = s.build_context();
    for id in ["p1", "p2"] {
        let mut p = find(&s, id);
        state_mut(&mut p).time.compacted = Some(NOW);
        apply(&mut s, Update::UpsertPart(p));
    }
    let view = s.build_context();
    let rendered = |v: &ContextView| -> Vec<(ToolStatus, String, String)> {
        v.messages[1]
            .parts
            .iter()
            .map(|p| {
                let st = state(&p.part);
                (st.status, st.output.clone(), st.error.clone())
            })
            .collect()
    };
    assert_eq!(
        rendered(&view),
        rendered(&clean),
        "the stamp changes nothing sent"
    );
    // 1 + (1 + 5 error) + (1 + 8 interrupted)
    assert_eq!(clean.tokens, 16);
    assert_eq!(
        (view.tokens, view_tokens_from_parts(&view)),
        (clean.tokens, clean.tokens)
    );
    assert_eq!(s.total_tokens(), clean.tokens);
}
