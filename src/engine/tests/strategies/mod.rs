//! The aggressive strategies (seed 03, issue 5) with the server defaults (all on):
//! one test per row of seed 03's table (t35–t45), the base supersede layer, the rules
//! (idempotence, last two user turns, protected tools and files, switches and presets, dry
//! run, live vs import), and property tests over random sessions.
//!
//! Sessions are small and realistic: tool calls carry the inputs OpenCode sends
//! (`{"filePath": ...}`, `{"command": "ls -la"}`, `{"url": ...}`), call ids are
//! `call_<part id>`. Every commit goes through [`commit`], which also checks the report's
//! accounting against the context before and after.

mod base_layer;
mod compactd;
mod every_strategy;
mod props;
mod rules;
mod seed_table;

use std::collections::BTreeMap;

use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use serde_json::{Value, json};

use super::*;
use crate::config::{
    CODE_BLOCK_AGE_TURNS, ERROR_AGE_TURNS, FILE_AGE_TURNS, PLACEHOLDER, StrategyPreset, StrategySet,
};
use crate::domain::{FilePart, StepFinishPart};
use crate::engine::strategies::{Strategy as St, superseded_text};
use crate::engine::{ContextView, Event, step};

// ---- fixtures ------------------------------------------------------------------------

/// The server defaults: every strategy on (ACP's `compact` preset).
/// ACP's strategies applied at once (no prompt cache to protect): these tests check
/// seed 03's rules; compactd's own strategies and the scheduler have their own tests.
fn cfg() -> EngineConfig {
    EngineConfig {
        strategies: StrategySet::acp(),
        cache_model: crate::config::CacheModel::NONE,
        tokenizer: crate::tokens::Tokenizer::Chars4,
        ..EngineConfig::default()
    }
}

fn open(o: SessionOverrides) -> Session {
    let info = SessionInfo {
        id: "ses_strat".into(),
        config: o,
        ..Default::default()
    };
    Session::new(info, &cfg())
}

fn put(s: &mut Session, u: Update) {
    s.apply(u.clone(), &cfg())
        .unwrap_or_else(|e| panic!("{u:?} rejected: {e}"));
}

/// Overrides switching strategies by name (camelCase or snake_case, as hosts send them).
fn switches(list: &[(&str, bool)]) -> SessionOverrides {
    SessionOverrides {
        strategies: list
            .iter()
            .map(|(name, on)| (name.parse::<St>().expect("strategy name"), *on))
            .collect(),
        ..Default::default()
    }
}

/// A completed tool call `call_<id>` with a real input.
fn call(msg: &str, id: &str, tool_name: &str, input: Value, output: &str) -> Part {
    let mut p = tool(msg, id, tool_name, output);
    state_mut(&mut p).input = input;
    p
}

/// A failed tool call `call_<id>`.
fn failed(msg: &str, id: &str, tool_name: &str, input: Value, error: &str) -> Part {
    let mut p = tool_in(msg, id, tool_name, ToolStatus::Error, error);
    let st = state_mut(&mut p);
    st.input = input;
    st.output.clear();
    p
}

fn read(msg: &str, id: &str, path: &str, output: &str) -> Part {
    call(msg, id, "read", json!({ "filePath": path }), output)
}

fn bash(msg: &str, id: &str, command: &str, output: &str) -> Part {
    call(msg, id, "bash", json!({ "command": command }), output)
}

fn file(msg: &str, id: &str, filename: &str, mime: &str, url: &str) -> Part {
    part(
        msg,
        id,
        PartKind::File(FilePart {
            mime: mime.into(),
            filename: filename.into(),
            url: url.into(),
            ..Default::default()
        }),
    )
}

fn synthetic(msg: &str, id: &str, body: &str) -> Part {
    part(
        msg,
        id,
        PartKind::Text(TextPart {
            text: body.into(),
            synthetic: true,
            ..Default::default()
        }),
    )
}

fn step_finish(msg: &str, id: &str) -> Part {
    part(
        msg,
        id,
        PartKind::StepFinish(StepFinishPart {
            reason: "tool-calls".into(),
            ..Default::default()
        }),
    )
}

/// `n` lines of a file as `read` returns it.
fn file_body(n: usize) -> String {
    (1..=n)
        .map(|i| format!("{i:05}| let value_{i} = compute({i});\n"))
        .collect()
}

/// A multi-line error with a stack trace.
fn stack_error(first: &str, frames: usize) -> String {
    let mut e = format!("{first}\nStack trace:\n");
    for i in 0..frames {
        e.push_str(&format!("  at /repo/src/module.ts:{}:7\n", 100 + i));
    }
    e
}

/// A base64 PNG of `bytes` encoded characters.
fn png(bytes: usize) -> String {
    format!("data:image/png;base64,{}", "A".repeat(bytes))
}

/// A session written message by message (finished assistants, no automatic prune).
struct Script {
    s: Session,
    last_user: String,
}

impl Script {
    fn new() -> Script {
        Script::with(SessionOverrides::default())
    }

    fn with(o: SessionOverrides) -> Script {
        Script {
            s: open(o),
            last_user: String::new(),
        }
    }

    /// A user message `id` saying `say` (text part `<id>_t`), then `more` parts.
    fn user(&mut self, id: &str, say: &str) -> &mut Script {
        self.user_with(id, say, vec![])
    }

    fn user_with(&mut self, id: &str, say: &str, more: Vec<Part>) -> &mut Script {
        put(&mut self.s, Update::UpsertMessage(user(id)));
        put(
            &mut self.s,
            Update::UpsertPart(text(id, &format!("{id}_t"), say)),
        );
        for p in more {
            put(&mut self.s, Update::UpsertPart(p));
        }
        self.last_user = id.into();
        self
    }

    /// A finished assistant message answering the last user message.
    fn assistant(&mut self, id: &str, parts: Vec<Part>) -> &mut Script {
        put(
            &mut self.s,
            Update::UpsertMessage(assistant(id, &self.last_user)),
        );
        for p in parts {
            put(&mut self.s, Update::UpsertPart(p));
        }
        self
    }

    fn commit(&mut self) -> Run {
        commit(&mut self.s, NOW)
    }
}

// ---- checks --------------------------------------------------------------------------

/// One prune run (strategies, then OpenCode prune) with the context around it.
struct Run {
    before: ContextView,
    after: ContextView,
    report: PruneReport,
}

/// Commits a prune run and checks its accounting: every marked part saved tokens, each
/// strategy's part count matches its marked parts, the savings add up to the context
/// delta (exactly when OpenCode prune did not commit too), each marked part's saving is its
/// own context delta, and the running total equals a recount from scratch.
fn commit(s: &mut Session, now: i64) -> Run {
    let before = s.build_context();
    let report = s.prune(PruneMode::Commit, now);
    let after = s.build_context();
    let run = &report.strategies;
    if let Err(e) = check_part_deltas(&before, &after, &report) {
        panic!("{e}");
    }
    for m in &run.parts {
        let stored = find(s, &m.part_id);
        let mark = stored.mark.expect("a reported part is marked");
        assert_eq!(
            (mark.strategy, mark.superseded_by.as_str(), mark.time),
            (m.strategy, m.superseded_by.as_str(), now)
        );
    }
    for saving in &run.savings {
        if saving.strategy != St::PruneToolInputs {
            let marked = run
                .parts
                .iter()
                .filter(|m| m.strategy == saving.strategy)
                .count();
            assert_eq!(saving.parts as usize, marked, "{}", saving.strategy);
        }
    }
    if !report.committed {
        assert_eq!(
            before.tokens - after.tokens,
            run.tokens(),
            "strategy savings vs context delta"
        );
        assert_eq!(
            run.parts.iter().map(|m| m.tokens).sum::<u64>(),
            run.tokens(),
            "marked parts vs savings"
        );
    }
    assert_eq!(s.total_tokens(), rendered_tokens_from_scratch(s));
    assert_eq!(after.tokens, view_tokens_from_parts(&after));
    Run {
        before,
        after,
        report,
    }
}

/// Context tokens of one part in a view.
fn part_tokens(v: &ContextView, id: &str) -> u64 {
    let p = v
        .messages
        .iter()
        .flat_map(|m| &m.parts)
        .find(|p| p.part.id == id)
        .unwrap_or_else(|| panic!("{id} is not in the context"));
    p.reduced.unwrap_or(p.est.base + p.est.output)
}

/// Part by part, a run changed only what it reports: each part a strategy marked shrank
/// by exactly its reported tokens (> 0) unless prune cleared it too, outputs prune cleared
/// (when it committed) may change, every other part reads the same. So no strategy ever
/// grows the context.
fn check_part_deltas(
    before: &ContextView,
    after: &ContextView,
    report: &PruneReport,
) -> Result<(), String> {
    let parts = |v: &ContextView| -> Vec<(String, u64)> {
        v.messages
            .iter()
            .flat_map(|m| &m.parts)
            .map(|p| {
                (
                    p.part.id.clone(),
                    p.reduced.unwrap_or(p.est.base + p.est.output),
                )
            })
            .collect()
    };
    let (b, a) = (parts(before), parts(after));
    let ids = |v: &[(String, u64)]| v.iter().map(|(id, _)| id.clone()).collect::<Vec<_>>();
    if ids(&b) != ids(&a) {
        return Err(format!("parts changed: {:?} -> {:?}", ids(&b), ids(&a)));
    }
    let cleared = |id: &String| report.committed && report.parts.iter().any(|p| &p.part_id == id);
    for ((id, old), (_, new)) in b.iter().zip(&a) {
        if let Some(m) = report.strategies.parts.iter().find(|m| &m.part_id == id) {
            // Cleared by prune in the same run, a part may change once more (a tiny
            // superseded output reads as the placeholder): that is prune's own change, in
            // its `context_tokens_saved`.
            if m.tokens == 0 || (!cleared(id) && old.checked_sub(*new) != Some(m.tokens)) {
                return Err(format!(
                    "{id} ({}) reported {} tokens, went {old} -> {new}",
                    m.strategy, m.tokens
                ));
            }
        } else if !cleared(id) && old != new {
            return Err(format!("{id} changed {old} -> {new} unreported"));
        }
    }
    Ok(())
}

/// A part as the context shows it.
fn shown<'a>(v: &'a ContextView, id: &str) -> &'a Part {
    v.messages
        .iter()
        .flat_map(|m| &m.parts)
        .map(|p| &p.part)
        .find(|p| p.id == id)
        .unwrap_or_else(|| panic!("{id} is not in the context"))
}

fn shown_text<'a>(v: &'a ContextView, id: &str) -> &'a str {
    match &shown(v, id).kind {
        PartKind::Text(t) => &t.text,
        other => panic!("{id} reads as a {}", other.type_name()),
    }
}

/// Part id → (strategy, superseded_by) of every marked part.
fn marks(s: &Session) -> BTreeMap<String, (String, String)> {
    s.messages()
        .iter()
        .flat_map(|m| &m.parts)
        .filter_map(|p| {
            let m = p.part.mark.as_ref()?;
            Some((
                p.part.id.clone(),
                (m.strategy.name().to_string(), m.superseded_by.clone()),
            ))
        })
        .collect()
}

/// `(part, strategy, superseding part)`; an empty superseding part for age strategies.
fn want(list: &[(&str, St, &str)]) -> BTreeMap<String, (String, String)> {
    list.iter()
        .map(|(id, st, by)| {
            let by = if by.is_empty() {
                String::new()
            } else {
                format!("call_{by}")
            };
            (id.to_string(), (st.name().to_string(), by))
        })
        .collect()
}

fn expect_marks(s: &Session, list: &[(&str, St, &str)]) {
    assert_eq!(marks(s), want(list), "marks");
}

fn expect_no_marks(s: &Session) {
    assert_eq!(marks(s), BTreeMap::new(), "no part is marked");
}

/// (parts, tokens) a strategy saved in a run.
fn saving(r: &PruneReport, st: St) -> Option<(u32, u64)> {
    r.strategies
        .savings
        .iter()
        .find(|s| s.strategy == st)
        .map(|s| (s.parts, s.tokens))
}

/// The strategy saved tokens on exactly `parts` parts.
fn expect_saving(r: &PruneReport, st: St, parts: u32) {
    let (p, t) = saving(r, st).unwrap_or_else(|| panic!("no saving for {st}"));
    assert_eq!(p, parts, "{st} parts");
    assert!(t > 0, "{st} saved no tokens");
}

/// The strategies that saved something, in report order.
fn saved_by(r: &PruneReport) -> Vec<St> {
    r.strategies.savings.iter().map(|s| s.strategy).collect()
}

fn count(text: &str) -> u64 {
    CharsPerToken.count(text)
}

/// The OpenAI `tool` message answering a call.
fn tool_result(openai: &Value, call_id: &str) -> String {
    openai
        .as_array()
        .expect("array")
        .iter()
        .find(|m| m["role"] == "tool" && m["tool_call_id"] == call_id)
        .unwrap_or_else(|| panic!("no tool result for {call_id}"))["content"]
        .as_str()
        .expect("string content")
        .to_string()
}

// ---- shared by the sections -------------------------------------------------------

fn todos(items: &[(&str, &str)]) -> Value {
    json!({ "todos": items.iter().enumerate().map(|(i, (c, s))| json!({
        "id": i.to_string(), "content": c, "status": s, "priority": "high"
    })).collect::<Vec<_>>() })
}

/// Messages (final info, final parts) of a session in which every strategy applies once.
fn rich_messages() -> Vec<(MessageInfo, Vec<Part>)> {
    let body = file_body(60);
    let page = "Docs line.\n".repeat(200);
    let tree = "- button \"Submit\" [ref=e12]\n".repeat(80);
    let hits = "src/lib.rs:10: fn main() {}\n".repeat(30);
    let listing = "drwxr-xr-x  5 dev dev 4096 Jan  1 00:00 src\n".repeat(30);
    let ok = "test result: ok. 42 passed; 0 failed\n".repeat(5);
    let list1 = todos(&[("Reproduce", "in_progress"), ("Fix", "pending")]);
    let list2 = todos(&[("Reproduce", "completed"), ("Fix", "in_progress")]);
    let code = format!(
        "Fix the failing build.\n```rust\n{}```",
        "let x = compute(1);\n".repeat(12)
    );
    let u = |id: &str, say: &str, more: Vec<Part>| {
        let mut parts = vec![text(id, &format!("{id}_t"), say)];
        parts.extend(more);
        (user(id), parts)
    };
    let a = |id: &str, parent: &str, parts: Vec<Part>| (assistant(id, parent), parts);
    vec![
        u(
            "u1",
            &code,
            vec![file("u1", "f1", "shot.png", "image/png", &png(20_000))],
        ),
        a(
            "a1",
            "u1",
            vec![
                step_start("a1", "a1s"),
                text("a1", "a1x", "Looking."),
                read("a1", "r1", "src/lib.rs", &body),
                bash("a1", "ls1", "ls -la", &listing),
                failed(
                    "a1",
                    "e1",
                    "bash",
                    json!({ "command": "cargo test" }),
                    &stack_error("error: test failed", 20),
                ),
                call(
                    "a1",
                    "w1",
                    "webfetch",
                    json!({ "url": "https://docs.rs/tokio" }),
                    &page,
                ),
                step_finish("a1", "a1f"),
            ],
        ),
        u("u2", "Go on.", vec![]),
        a(
            "a2",
            "u2",
            vec![
                step_start("a2", "a2s"),
                bash("a2", "ok1", "cargo test", &ok),
                read("a2", "r2", "src/lib.rs", &body),
                bash("a2", "ls2", "ls -la", &listing),
                call("a2", "t1", "todowrite", list1.clone(), &list1.to_string()),
                call("a2", "sn1", "playwright_browser_snapshot", json!({}), &tree),
                step_finish("a2", "a2f"),
            ],
        ),
        u("u3", "And the docs?", vec![]),
        a(
            "a3",
            "u3",
            vec![
                call(
                    "a3",
                    "w2",
                    "webfetch",
                    json!({ "url": "https://docs.rs/tokio" }),
                    &page,
                ),
                call(
                    "a3",
                    "ed1",
                    "edit",
                    json!({ "filePath": "src/lib.rs", "oldString": "a".repeat(400),
                        "newString": "b".repeat(400) }),
                    "Edit applied successfully.",
                ),
                call(
                    "a3",
                    "gr1",
                    "grep",
                    json!({ "pattern": "fn main", "path": "src" }),
                    &hits,
                ),
                failed(
                    "a3",
                    "e2",
                    "bash",
                    json!({ "command": "cargo clippy" }),
                    &stack_error("error: clippy failed", 20),
                ),
                call("a3", "k1", "task", json!({ "prompt": "explore" }), &page),
            ],
        ),
        u("u4", "ok", vec![]),
        a(
            "a4",
            "u4",
            vec![
                call("a4", "t2", "todowrite", list2.clone(), &list2.to_string()),
                call("a4", "sn2", "browser_snapshot", json!({}), &tree),
                call(
                    "a4",
                    "gr2",
                    "grep",
                    json!({ "pattern": "fn main", "path": "src" }),
                    &hits,
                ),
                read("a4", "r3", "src/lib.rs", &body),
                call("a4", "k2", "task", json!({ "prompt": "explore" }), &page),
            ],
        ),
        u("u5", "continue", vec![]),
        a(
            "a5",
            "u5",
            vec![
                bash("a5", "d1", "cargo fmt --check", &listing),
                text("a5", "a5x", "Formatted."),
            ],
        ),
        u("u6", "more", vec![]),
        a(
            "a6",
            "u6",
            vec![bash("a6", "d2", "cargo fmt --check", &listing)],
        ),
        u("u7", "last", vec![]),
        a("a7", "u7", vec![text("a7", "a7x", "Done.")]),
    ]
}

/// The marks [`rich_messages`] ends with.
fn rich_marks() -> BTreeMap<String, (String, String)> {
    want(&[
        ("r1", St::AggressiveFilePrune, "r2"),
        ("ls1", St::StateQuerySupersede, "ls2"),
        ("e1", St::PruneRetryParts, "ok1"),
        ("w1", St::PruneSourceUrls, "w2"),
        ("r2", St::AggressiveFilePrune, "ed1"),
        ("t1", St::SupersedeTodos, "t2"),
        ("sn1", St::PruneSnapshots, "sn2"),
        ("gr1", St::SupersedeSearches, "gr2"),
        ("ed1", St::AggressiveFilePrune, "r3"),
        ("d1", St::SupersedeDuplicates, "d2"),
        ("f1", St::PruneFiles, ""),
        ("u1_t", St::PruneUserCodeBlocks, ""),
        ("e2", St::TruncateOldErrors, ""),
    ])
}

/// The messages applied all at once (as an import does), not committed.
fn import(msgs: &[(MessageInfo, Vec<Part>)], o: SessionOverrides) -> Session {
    let mut s = open(o);
    for (info, parts) in msgs {
        put(&mut s, Update::UpsertMessage(info.clone()));
        for p in parts {
            let mut p = p.clone();
            p.mark = None; // a host knows nothing of marks
            put(&mut s, Update::UpsertPart(p));
        }
    }
    s
}

/// The messages sent as a live host does, through `step`: assistant info unfinished,
/// each tool part running then final, then the info finished (automatic prune).
fn live(msgs: &[(MessageInfo, Vec<Part>)], o: SessionOverrides) -> Session {
    let mut s = open(o);
    let config = cfg();
    let mut now = NOW - 1_000_000;
    let mut go = |s: &mut Session, u: Update| {
        now += 1;
        step(s, u.clone(), &config, now).unwrap_or_else(|e| panic!("{u:?} rejected: {e}"));
    };
    for (info, parts) in msgs {
        let assistant = info.role == Role::Assistant;
        let mut open_info = info.clone();
        if assistant {
            open_info.finish.clear();
        }
        go(&mut s, Update::UpsertMessage(open_info));
        for p in parts {
            if let PartKind::Tool(_) = p.kind {
                let mut running = p.clone();
                let st = state_mut(&mut running);
                st.status = ToolStatus::Running;
                st.output.clear();
                st.error.clear();
                go(&mut s, Update::UpsertPart(running));
            }
            go(&mut s, Update::UpsertPart(p.clone()));
        }
        if assistant {
            go(&mut s, Update::UpsertMessage(info.clone()));
        }
    }
    s
}

/// The context with mark times cleared (live and import mark at different times).
fn timeless(v: &ContextView) -> ContextView {
    let mut v = v.clone();
    for p in v.messages.iter_mut().flat_map(|m| &mut m.parts) {
        if let Some(m) = &mut p.part.mark {
            m.time = 0;
        }
    }
    v
}

/// Message ids and tool call ids of a view, in order.
fn ids(v: &ContextView) -> (Vec<String>, Vec<String>) {
    let messages = v.messages.iter().map(|m| m.info.id.clone()).collect();
    let calls = v
        .messages
        .iter()
        .flat_map(|m| &m.parts)
        .filter_map(|p| match &p.part.kind {
            PartKind::Tool(t) => Some(t.call_id.clone()),
            _ => None,
        })
        .collect();
    (messages, calls)
}

/// The final messages of a session as the host holds them: no marks, no stamps from
/// compactd's own prune.
fn final_messages(s: &Session) -> Vec<(MessageInfo, Vec<Part>)> {
    s.messages()
        .iter()
        .map(crate::engine::carry::exported)
        .collect()
}
