//! Every input the proto conversion refuses, as a table: what is sent, the code and the
//! field path the client reads back.

use std::collections::HashMap;

use tonic::Code;

use crate::domain::{MAX_ID_BYTES, MAX_JSON_DEPTH};

use super::*;

fn tool(call_id: &str, tool: &str, status: &str) -> pb::Part {
    pb::Part {
        id: "p1".into(),
        message_id: "m1".into(),
        kind: Some(pb::part::Kind::Tool(pb::ToolPart {
            call_id: call_id.into(),
            tool: tool.into(),
            state: Some(pb::ToolState {
                status: status.into(),
                ..Default::default()
            }),
            metadata: None,
        })),
        extra: None,
        mark: None,
    }
}

fn text(id: &str, message_id: &str) -> pb::Part {
    pb::Part {
        id: id.into(),
        message_id: message_id.into(),
        kind: Some(pb::part::Kind::Text(pb::TextPart::default())),
        extra: None,
        mark: None,
    }
}

fn message(id: &str, role: &str) -> pb::MessageInfo {
    pb::MessageInfo {
        id: id.into(),
        role: role.into(),
        ..Default::default()
    }
}

fn session(config: pb::SessionConfig) -> pb::SessionInfo {
    pb::SessionInfo {
        id: "s".into(),
        config: Some(config),
        ..Default::default()
    }
}

fn deep(depth: usize) -> prost_types::Struct {
    let mut s = prost_types::Struct::default();
    for _ in 0..depth {
        s = prost_types::Struct {
            fields: [(
                "a".to_string(),
                prost_types::Value {
                    kind: Some(Kind::StructValue(s)),
                },
            )]
            .into(),
        };
    }
    s
}

type Outcome = Result<(), Rejection>;

fn part(p: pb::Part) -> Outcome {
    part_from_pb(p).map(drop)
}

fn info(s: pb::SessionInfo) -> Outcome {
    session_from_pb(s, "").map(drop)
}

#[test]
fn every_refusal_names_its_field() {
    let long = "x".repeat(MAX_ID_BYTES + 1);
    let mut no_state = tool("c1", "read", "completed");
    if let Some(pb::part::Kind::Tool(t)) = &mut no_state.kind {
        t.state = None;
    }
    let mut deep_input = tool("c1", "read", "completed");
    if let Some(pb::part::Kind::Tool(t)) = &mut deep_input.kind {
        t.state.as_mut().expect("state").input = Some(deep(MAX_JSON_DEPTH + 1));
    }
    let deep_extra = pb::Part {
        extra: Some(deep(MAX_JSON_DEPTH + 1)),
        ..text("p1", "m1")
    };
    let cases: Vec<(&str, Outcome, &str)> = vec![
        ("part without id", part(text("", "m1")), "id"),
        ("part id too long", part(text(&long, "m1")), "id"),
        ("part without message", part(text("p1", "")), "message_id"),
        (
            "part message id too long",
            part(text("p1", &long)),
            "message_id",
        ),
        (
            "part without kind",
            part(pb::Part {
                kind: None,
                ..text("p1", "m1")
            }),
            "kind",
        ),
        (
            "tool without name",
            part(tool("c1", "", "completed")),
            "tool.tool",
        ),
        (
            "tool without call id",
            part(tool("", "read", "completed")),
            "tool.call_id",
        ),
        (
            "call id too long",
            part(tool(&long, "read", "completed")),
            "tool.call_id",
        ),
        ("tool without state", part(no_state), "tool.state"),
        (
            "unknown tool status",
            part(tool("c1", "read", "done")),
            "tool.state.status",
        ),
        ("tool input too deep", part(deep_input), "tool.state.input"),
        ("part extra too deep", part(deep_extra), "extra"),
        (
            "message without id",
            message_from_pb(message("", "user")).map(drop),
            "id",
        ),
        (
            "message id too long",
            message_from_pb(message(&long, "user")).map(drop),
            "id",
        ),
        (
            "unknown role",
            message_from_pb(message("m1", "system")).map(drop),
            "role",
        ),
        (
            "parent id too long",
            message_from_pb(pb::MessageInfo {
                parent_id: long.clone(),
                ..message("m1", "assistant")
            })
            .map(drop),
            "parent_id",
        ),
        (
            "session id too long",
            info(pb::SessionInfo {
                id: long.clone(),
                ..Default::default()
            }),
            "id",
        ),
        ("session without id", info(pb::SessionInfo::default()), "id"),
        (
            "model name too long",
            info(pb::SessionInfo {
                id: "s".into(),
                model: Some(pb::ModelRef {
                    provider_id: "openai".into(),
                    model_id: long.clone(),
                }),
                ..Default::default()
            }),
            "model.model_id",
        ),
        (
            "provider name too long",
            info(pb::SessionInfo {
                id: "s".into(),
                model: Some(pb::ModelRef {
                    provider_id: long.clone(),
                    model_id: "gpt-5".into(),
                }),
                ..Default::default()
            }),
            "model.provider_id",
        ),
        (
            "compaction model name too long",
            info(session(pb::SessionConfig {
                compaction_model: Some(long.clone()),
                ..Default::default()
            })),
            "config.compaction_model",
        ),
        (
            "session id differs from the update's",
            session_from_pb(
                pb::SessionInfo {
                    id: "a".into(),
                    ..Default::default()
                },
                "b",
            )
            .map(drop),
            "id",
        ),
        (
            "threshold above 1",
            info(session(pb::SessionConfig {
                threshold: Some(1.5),
                ..Default::default()
            })),
            "config.threshold",
        ),
        (
            "protect_turns too high",
            info(session(pb::SessionConfig {
                protect_turns: Some(5000),
                ..Default::default()
            })),
            "config.protect_turns",
        ),
        (
            "blank placeholder",
            info(session(pb::SessionConfig {
                placeholder: Some(" ".into()),
                ..Default::default()
            })),
            "config.placeholder",
        ),
        (
            "oversized prompt",
            info(session(pb::SessionConfig {
                compaction_prompt: Some("x".repeat(crate::config::MAX_PROMPT + 1)),
                ..Default::default()
            })),
            "config.compaction_prompt",
        ),
        (
            "bad glob",
            info(session(pb::SessionConfig {
                protected_file_globs: Some(pb::StringList {
                    values: vec!["src/[".into()],
                }),
                ..Default::default()
            })),
            "config.protected_file_globs",
        ),
        (
            // Accepted before, it built no matcher: every glob of the list protected
            // nothing (regex's nesting limit is 250).
            "glob nested past the matcher's limit",
            info(session(pb::SessionConfig {
                protected_file_globs: Some(pb::StringList {
                    // 1,021 bytes: under the length bound, nested past the matcher's.
                    values: vec![
                        "src/secret/**".into(),
                        format!("{}b{}", "{a,".repeat(255), "}".repeat(255)),
                    ],
                }),
                ..Default::default()
            })),
            "config.protected_file_globs",
        ),
        (
            // Before, its parse recursed once per level: 100,000 levels overflowed the
            // worker's stack and aborted the process, every session with it.
            "glob nested 100,000 deep",
            info(session(pb::SessionConfig {
                protected_file_globs: Some(pb::StringList {
                    values: vec![format!("{}{}", "{".repeat(100_000), "}".repeat(100_000))],
                }),
                ..Default::default()
            })),
            "config.protected_file_globs",
        ),
        (
            "unknown strategy",
            info(session(pb::SessionConfig {
                strategies: HashMap::from([("pruneEverything".to_string(), true)]),
                ..Default::default()
            })),
            "config.strategies",
        ),
        (
            "unknown strategy preset",
            info(session(pb::SessionConfig {
                strategy_preset: "loud".into(),
                ..Default::default()
            })),
            "config.strategy_preset",
        ),
        (
            "unknown cache counting",
            info(session(pb::SessionConfig {
                cache_counting: 99,
                ..Default::default()
            })),
            "config.cache_counting",
        ),
        (
            "unknown overflow preset",
            info(session(pb::SessionConfig {
                preset: 99,
                ..Default::default()
            })),
            "config.preset",
        ),
    ];
    let mut wrong = Vec::new();
    for (what, outcome, field) in cases {
        match outcome {
            Err(r) if r.code == Code::InvalidArgument && r.field == field => {}
            other => wrong.push(format!("{what}: expected {field}, got {other:?}")),
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn an_empty_prompt_inherits_but_an_empty_placeholder_is_refused() {
    let o = overrides_from_pb(pb::SessionConfig {
        compaction_prompt: Some(String::new()),
        ..Default::default()
    })
    .expect("valid");
    assert_eq!(o.compaction_prompt, None);
    let r = overrides_from_pb(pb::SessionConfig {
        placeholder: Some(String::new()),
        ..Default::default()
    })
    .expect_err("blank placeholder");
    assert_eq!(r.field, "placeholder");
}

/// A compaction request's own prompts and model are held to the rules a session's are
/// (64 KiB, 256 bytes), named where they sit. Before, they were bounded only by the
/// update limit, held for the whole compaction outside the ledger, and the model was
/// checked only after the head had been copied out of the session.
#[test]
fn a_compaction_requests_prompts_and_model_are_bounded_like_a_sessions() {
    use crate::server::request::decode_update;
    let long = "x".repeat(crate::config::MAX_PROMPT + 1);
    let compact = |o: pb::CompactOptions| pb::ClientUpdate {
        seq: 1,
        session_id: "s".into(),
        update: Some(pb::client_update::Update::Compact(o)),
    };
    let cases = [
        (
            pb::CompactOptions {
                instructions: long.clone(),
                ..Default::default()
            },
            "compact.instructions",
        ),
        (
            pb::CompactOptions {
                prompt: long.clone(),
                ..Default::default()
            },
            "compact.prompt",
        ),
        (
            pb::CompactOptions {
                system: long.clone(),
                ..Default::default()
            },
            "compact.system",
        ),
        (
            pb::CompactOptions {
                template: long.clone(),
                ..Default::default()
            },
            "compact.template",
        ),
        (
            pb::CompactOptions {
                model: "m".repeat(300),
                ..Default::default()
            },
            "compact.model",
        ),
    ];
    for (options, field) in cases {
        let u = compact(options);
        let len = prost::Message::encoded_len(&u);
        match decode_update(u, len, 16 << 20) {
            Err(r) => assert_eq!((r.code, r.field.as_str()), (Code::InvalidArgument, field)),
            Ok(_) => panic!("{field} accepted"),
        }
    }
    let fits = compact(pb::CompactOptions {
        instructions: "focus on the failing test".into(),
        ..Default::default()
    });
    let len = prost::Message::encoded_len(&fits);
    assert!(decode_update(fits, len, 16 << 20).is_ok());
}

/// A refusal quotes the beginning of what it refuses, never all of it: a megabyte of
/// control characters as a role, a status, a strategy or preset name, a cache model, a
/// tokenizer or a session id came back whole and escaped (about 9 bytes on the wire per
/// byte sent), past what clients read of a trailer.
#[test]
fn a_refusal_quotes_only_the_beginning_of_a_long_value() {
    let big = "\u{1}".repeat(1 << 20);
    let mut open = session(pb::SessionConfig::default());
    open.id = big.clone();
    let cases: Vec<(&str, Outcome, &str)> = vec![
        (
            "role",
            message_from_pb(message("m1", &big)).map(drop),
            "role",
        ),
        (
            "status",
            part(tool("c1", "read", &big)),
            "tool.state.status",
        ),
        (
            "strategy",
            info(session(pb::SessionConfig {
                strategies: HashMap::from([(big.clone(), true)]),
                ..Default::default()
            })),
            "config.strategies",
        ),
        (
            "preset",
            info(session(pb::SessionConfig {
                strategy_preset: big.clone(),
                ..Default::default()
            })),
            "config.strategy_preset",
        ),
        (
            "cache model",
            info(session(pb::SessionConfig {
                cache_model: format!("custom:{big}:1:1"),
                ..Default::default()
            })),
            "config.cache_model",
        ),
        (
            "tokenizer",
            info(session(pb::SessionConfig {
                tokenizer: big.clone(),
                ..Default::default()
            })),
            "config.tokenizer",
        ),
        (
            "session id against the update's",
            session_from_pb(open, "s").map(drop),
            "id",
        ),
    ];
    for (what, outcome, field) in cases {
        let r = outcome.expect_err(what);
        assert_eq!(r.field, field, "{what}");
        assert!(r.message.len() < 1024, "{what}: {} bytes", r.message.len());
    }
}

/// Two keys of `strategies` naming one strategy (ACP's name and its snake_case twin, or
/// the same name in another case) are refused, naming both: the map arrives in no order,
/// so which one won was chance. Before, `{"maskObservations": true, "mask_observations":
/// false}` was accepted, on or off from one decode to the next.
#[test]
fn two_spellings_of_one_strategy_are_refused_naming_both() {
    for (a, b) in [
        ("maskObservations", "mask_observations"),
        ("maskObservations", "MASKOBSERVATIONS"),
    ] {
        for values in [(true, false), (true, true)] {
            let r = info(session(pb::SessionConfig {
                strategies: HashMap::from([(a.to_string(), values.0), (b.to_string(), values.1)]),
                ..Default::default()
            }))
            .expect_err("two spellings");
            assert_eq!(
                (r.code, r.field.as_str()),
                (Code::InvalidArgument, "config.strategies"),
                "{a} and {b}"
            );
            assert!(
                r.message.contains(a) && r.message.contains(b),
                "{a} and {b}: {}",
                r.message
            );
        }
    }
    // One spelling each of two strategies is fine.
    let o = overrides_from_pb(pb::SessionConfig {
        strategies: HashMap::from([
            ("maskObservations".to_string(), false),
            ("cap_large_outputs".to_string(), true),
        ]),
        ..Default::default()
    })
    .expect("valid");
    assert_eq!(o.strategies.len(), 2);
}

/// A blank (white space only) prompt, system prompt or template in `CompactOptions` is
/// not given: the session's or the server's is used, as a blank one in `SessionConfig`.
/// Before, `prompt: " "` replaced the server's prompt, and the summarizer was asked with
/// no instruction.
#[test]
fn a_blank_compaction_prompt_inherits_as_a_sessions_does() {
    use crate::server::request::{Op, decode_update};
    let u = pb::ClientUpdate {
        seq: 1,
        session_id: "s".into(),
        update: Some(pb::client_update::Update::Compact(pb::CompactOptions {
            prompt: " ".into(),
            system: "\n\t".into(),
            template: "  \r\n".into(),
            instructions: "focus on the failing test".into(),
            ..Default::default()
        })),
    };
    let len = prost::Message::encoded_len(&u);
    let Ok(Op::Compact(o)) = decode_update(u, len, 16 << 20) else {
        panic!("a compact update");
    };
    assert_eq!(
        (o.prompt.as_str(), o.system.as_str(), o.template.as_str()),
        ("", "", "")
    );
    assert_eq!(o.instructions, "focus on the failing test");
    // And in a session's config, the same texts inherit.
    let s = overrides_from_pb(pb::SessionConfig {
        compaction_prompt: Some(" ".into()),
        compaction_system: Some("\n\t".into()),
        compaction_template: Some("  \r\n".into()),
        ..Default::default()
    })
    .expect("valid");
    assert_eq!(
        (
            s.compaction_prompt,
            s.compaction_system,
            s.compaction_template
        ),
        (None, None, None)
    );
}
