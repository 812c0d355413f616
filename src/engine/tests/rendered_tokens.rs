//! The token figure of a reduced part is computed from its cached estimate plus a count
//! of the replacing text only (`render::rendered_tokens_as`); it must equal counting the
//! rendered part itself, for every part shape, strategy mark, prune stamp and tokenizer.

use crate::config::{EngineConfig, SessionOverrides, Settings, Strategy, StrategySet};
use crate::domain::Role;
use crate::domain::{
    FilePart, Part, PartKind, StrategyMark, TextPart, ToolPart, ToolState, ToolStatus,
};
use crate::engine::estimate::estimate;
use crate::engine::openai::chat_messages;
use crate::engine::render::{
    Copying, Reading, is_compacted, render_as, render_reading, rendered_tokens_as,
};
use crate::tokens::Counting;

fn part(id: &str, kind: PartKind) -> Part {
    Part {
        id: id.into(),
        message_id: "m1".into(),
        kind,
        mark: None,
        extra: Default::default(),
    }
}

fn tool(id: &str, status: ToolStatus, output: &str, error: &str) -> Part {
    let mut state = ToolState::new(status);
    state.output = output.into();
    state.error = error.into();
    state.input = serde_json::json!({
        "filePath": "src/engine/render.rs",
        "content": "fn main() {\n    println!(\"hello\");\n}\n".repeat(40),
        "limit": 200,
        "nested": {"command": "cargo build --release 2>&1 | tail -50", "notes": "x".repeat(900)},
    });
    part(
        id,
        PartKind::Tool(Box::new(ToolPart {
            call_id: format!("call_{id}"),
            tool: "bash".into(),
            state,
            metadata: None,
        })),
    )
}

/// Parts of every shape a rendering can rewrite (and some it cannot).
fn parts() -> Vec<Part> {
    let log = "   Compiling serde v1.0.229\nwarning: unused variable `x` --> src/lib.rs:4:9\n"
        .repeat(120);
    let user_text = format!(
        "Please look at this:\n```rust\n{}```\nand this file too.",
        "let x = vec![1, 2, 3];\n".repeat(80)
    );
    vec![
        tool("t_done", ToolStatus::Completed, &log, ""),
        tool("t_tiny", ToolStatus::Completed, "ok", ""),
        tool(
            "t_err",
            ToolStatus::Error,
            "",
            &format!("error[E0308]: mismatched types\n{log}"),
        ),
        tool("t_err_short", ToolStatus::Error, "", "boom"),
        tool("t_pending", ToolStatus::Pending, "", ""),
        tool("t_running", ToolStatus::Running, "partial", ""),
        part(
            "x_user",
            PartKind::Text(TextPart {
                text: user_text,
                ..TextPart::default()
            }),
        ),
        part(
            "x_plain",
            PartKind::Text(TextPart {
                text: "done, tests pass".into(),
                ..TextPart::default()
            }),
        ),
        part(
            "f_png",
            PartKind::File(FilePart {
                mime: "image/png".into(),
                filename: "shot.png".into(),
                url: format!("data:image/png;base64,{}", "iVBORw0KGgo".repeat(300)),
                source: None,
                size: 3300,
            }),
        ),
        part(
            "f_text",
            PartKind::File(FilePart {
                mime: "text/plain".into(),
                filename: "notes.txt".into(),
                url: "file:///tmp/notes.txt".into(),
                source: None,
                size: 12,
            }),
        ),
        part(
            "s_start",
            PartKind::StepStart {
                snapshot: String::new(),
            },
        ),
    ]
}

fn marks() -> Vec<Option<StrategyMark>> {
    let mut out = vec![None];
    for strategy in Strategy::ALL {
        for keep in [0, 400] {
            out.push(Some(StrategyMark {
                strategy,
                superseded_by: "call_newer".into(),
                time: 1,
                keep,
            }));
        }
    }
    out
}

#[test]
fn rendered_tokens_equal_counting_the_rendered_part() {
    let mut checked = 0;
    for counting in Counting::ALL {
        for strategies in [StrategySet::all(), StrategySet::NONE] {
            let config = EngineConfig {
                strategies,
                ..EngineConfig::default()
            };
            let settings = config.resolve(&SessionOverrides::default());
            let counter = counting.counter();
            for p in parts() {
                let est = estimate(&p, counter);
                for mark in marks() {
                    for compacted in [false, true] {
                        for strip in [false, true] {
                            let expected =
                                render_as(&p, mark.as_ref(), compacted, &settings, strip).map_or(
                                    0,
                                    |r| {
                                        let e = estimate(&r, counter);
                                        e.base + e.output
                                    },
                                );
                            let fast = rendered_tokens_as(
                                &p,
                                &est,
                                mark.as_ref(),
                                compacted,
                                &settings,
                                strip,
                                counter,
                            );
                            let unstripped = rendered_tokens_as(
                                &p,
                                &est,
                                mark.as_ref(),
                                compacted,
                                &settings,
                                false,
                                counter,
                            );
                            assert_eq!(
                                fast.tokens + fast.input_saved,
                                unstripped.tokens,
                                "input saving of {} under {mark:?}",
                                p.id
                            );
                            let fast = fast.tokens;
                            assert_eq!(
                                fast,
                                expected,
                                "{} under {mark:?}, compacted {compacted}, strip {strip}, {}",
                                p.id,
                                counting.as_str()
                            );
                            checked += 1;
                        }
                    }
                }
            }
        }
    }
    assert!(checked > 2_000, "{checked} cases");
}

/// Calls `check` with each of `parts` under every strategy set (all, none), strategy
/// mark and prune stamp, as a session's settings would render it.
fn each_case(parts: &[Part], mut check: impl FnMut(&Settings, &Part)) {
    for strategies in [StrategySet::all(), StrategySet::NONE] {
        let config = EngineConfig {
            strategies,
            ..EngineConfig::default()
        };
        let settings = config.resolve(&SessionOverrides::default());
        for p in parts {
            for mark in marks() {
                for compacted in [false, true] {
                    let mut p = p.clone();
                    p.mark = mark.clone();
                    if let PartKind::Tool(t) = &mut p.kind {
                        t.state.time.compacted = compacted.then_some(2);
                    }
                    check(&settings, &p);
                }
            }
        }
    }
}

/// A part `render_reading` lends as stored (a tool part its marks leave alone) reads
/// exactly as the full rewrite would have copied it, for every shape and mark; so does
/// a reduced call read in place for the OpenAI messages, once made whole.
#[test]
fn a_borrowed_rendering_equals_the_rewritten_copy() {
    let (mut borrowed, mut in_place) = (0, 0);
    each_case(&parts(), |settings, p| {
        let strip = settings.strategies.has(Strategy::PruneToolInputs);
        let lent = render_reading(p, settings, Copying::Whole);
        borrowed += usize::from(matches!(lent, Some(Reading::Stored(_))));
        let copied = render_as(p, p.mark.as_ref(), is_compacted(p), settings, strip);
        let mark = &p.mark;
        assert_eq!(
            lent.map(Reading::into_owned),
            copied,
            "{} under {mark:?}",
            p.id
        );
        let sent = render_reading(p, settings, Copying::Sent);
        if matches!(sent, Some(Reading::Tool(..))) {
            in_place += 1;
            assert_eq!(
                sent.map(Reading::into_owned),
                copied,
                "{} under {mark:?}",
                p.id
            );
        }
    });
    assert!(borrowed > 100, "{borrowed} borrowed");
    assert!(in_place > 100, "{in_place} read in place");
}

/// `p` carrying every field the OpenAI messages do not read: metadata, a title, raw
/// input, attachments and extra fields.
fn dressed(mut p: Part) -> Part {
    let meta = serde_json::json!({"diff": "-a\n+b\n".repeat(50), "files": ["src/lib.rs"]});
    p.extra.insert("opencode".into(), meta.clone());
    match &mut p.kind {
        PartKind::Tool(t) => {
            t.metadata = Some(meta.clone());
            t.state.metadata = Some(meta);
            t.state.title = "Build the crate".into();
            t.state.raw = "{\"command\": \"cargo build\"}".into();
            t.state.attachments = vec![FilePart {
                mime: "text/plain".into(),
                filename: "log.txt".into(),
                url: "file:///tmp/log.txt".into(),
                source: None,
                size: 10,
            }];
        }
        PartKind::Text(t) => t.metadata = Some(meta),
        _ => {}
    }
    p
}

/// The OpenAI messages `part` reads as in a message of `role`, as JSON text.
fn openai_json(role: Role, part: Option<&Reading<'_>>) -> String {
    let mut out = Vec::new();
    chat_messages(role, part.map(Reading::read).into_iter(), &mut out);
    serde_json::to_string(&out).unwrap_or_default()
}

/// What GetContext's OpenAI shapes make of a rewritten part (`Copying::Sent`: a lean
/// copy, or a reduced call read in place) reads exactly as the whole copy in the OpenAI
/// messages, for every shape, mark and role, while leaving the metadata behind.
#[test]
fn a_lean_copy_reads_as_the_whole_one_in_the_openai_messages() {
    let (mut compared, mut leaner) = (0, 0);
    let dressed: Vec<Part> = parts().into_iter().map(dressed).collect();
    each_case(&dressed, |settings, p| {
        let mark = &p.mark;
        let whole = render_reading(p, settings, Copying::Whole);
        let sent = render_reading(p, settings, Copying::Sent);
        assert_eq!(whole.is_some(), sent.is_some(), "{} under {mark:?}", p.id);
        leaner += usize::from(match (&whole, &sent) {
            (Some(Reading::Rewritten(w)), Some(Reading::Rewritten(s))) => w != s,
            (Some(Reading::Rewritten(_)), Some(Reading::Tool(..))) => true,
            _ => false,
        });
        for role in [Role::User, Role::Assistant] {
            assert_eq!(
                openai_json(role, sent.as_ref()),
                openai_json(role, whole.as_ref()),
                "{} under {mark:?} as {role:?}",
                p.id
            );
            compared += 1;
        }
    });
    assert!(compared > 1_000, "{compared} compared");
    assert!(leaner > 100, "{leaner} copies left metadata behind");
}
