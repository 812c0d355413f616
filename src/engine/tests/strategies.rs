//! The aggressive strategies (seed 03, issue 5) with the server defaults (all on):
//! one test per row of seed 03's table (t35–t45), the base supersede layer, the rules
//! (idempotence, last two user turns, protected tools and files, switches and presets, dry
//! run, live vs import), and property tests over random sessions.
//!
//! Sessions are small and realistic: tool calls carry the inputs OpenCode sends
//! (`{"filePath": ...}`, `{"command": "ls -la"}`, `{"url": ...}`), call ids are
//! `call_<part id>`. Every commit goes through [`commit`], which also checks the report's
//! accounting against the context before and after.

use std::collections::BTreeMap;
use std::sync::Arc;

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
fn cfg() -> EngineConfig {
    EngineConfig::default()
}

fn open(o: SessionOverrides) -> Session {
    let info = SessionInfo {
        id: "ses_strat".into(),
        config: o,
        ..Default::default()
    };
    Session::new(info, &cfg(), Arc::new(CharsPerToken))
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
/// by exactly its reported tokens (> 0), outputs prune cleared (when it committed) may
/// change, every other part reads the same. So no strategy ever grows the context.
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
    for ((id, old), (_, new)) in b.iter().zip(&a) {
        if let Some(m) = report.strategies.parts.iter().find(|m| &m.part_id == id) {
            if m.tokens == 0 || old.checked_sub(*new) != Some(m.tokens) {
                return Err(format!(
                    "{id} ({}) reported {} tokens, went {old} -> {new}",
                    m.strategy, m.tokens
                ));
            }
        } else if !(report.committed && report.parts.iter().any(|p| &p.part_id == id)) && old != new
        {
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

// ---- t35–t45: seed 03's test table ---------------------------------------------------

#[test]
fn t35_input_leak_superseded_write_keeps_only_its_path() {
    let content = "A".repeat(5000);
    let write_input = json!({ "filePath": "test.txt", "content": content });
    let mut sc = Script::new();
    sc.user("u1", "Create test.txt, then check it.").assistant(
        "a1",
        vec![
            call(
                "a1",
                "w1",
                "write",
                write_input.clone(),
                "Wrote file successfully.",
            ),
            read("a1", "r1", "test.txt", &content),
        ],
    );
    let run = sc.commit();

    expect_marks(&sc.s, &[("w1", St::AggressiveFilePrune, "r1")]);
    let w1 = shown(&run.after, "w1");
    assert_eq!(state(w1).input, json!({ "filePath": "test.txt" }));
    // The note would be longer than the write's own short output, which stays.
    assert_eq!(state(w1).output, "Wrote file successfully.");
    assert_eq!(
        state(&find(&sc.s, "w1")).input,
        write_input,
        "original kept"
    );
    assert_eq!(
        tool_result(&run.after.to_openai(), "call_w1"),
        "Wrote file successfully."
    );

    // Accounting: the output stays as it was, so the file strategy's own saving is 0 and
    // the input-leak fix has all of it.
    let old = count(&write_input.to_string()) + count("Wrote file successfully.");
    let new =
        count(&json!({ "filePath": "test.txt" }).to_string()) + count("Wrote file successfully.");
    assert_eq!(saving(&run.report, St::AggressiveFilePrune), Some((1, 0)));
    assert_eq!(
        saving(&run.report, St::PruneToolInputs),
        Some((1, old - new))
    );
    assert!(old - new > 1200, "the 5000-char content left the context");
    assert_eq!(run.before.tokens - run.after.tokens, old - new);
}

#[test]
fn t35_input_leak_without_the_fix_a_write_is_not_worth_superseding() {
    let content = "A".repeat(5000);
    let write_input = json!({ "filePath": "test.txt", "content": content });
    let mut sc = Script::with(switches(&[("prune_tool_inputs", false)]));
    sc.user("u1", "Create test.txt, then check it.").assistant(
        "a1",
        vec![
            call(
                "a1",
                "w1",
                "write",
                write_input.clone(),
                "Wrote file successfully.",
            ),
            read("a1", "r1", "test.txt", &content),
        ],
    );
    let run = sc.commit();
    // The note alone is longer than the write's output: a rewrite that does not shrink
    // the part is not applied, and the input keeps its content.
    expect_marks(&sc.s, &[]);
    assert_eq!(state(shown(&run.after, "w1")).input, write_input);
    assert!(run.report.strategies.is_empty());
}

#[test]
fn t35_input_leak_a_call_cleared_by_prune_keeps_only_its_path() {
    let write_input = json!({ "filePath": "notes.md", "content": "B".repeat(4000) });
    let mut sc = Script::with(SessionOverrides {
        prune_protect: Some(0),
        prune_minimum: Some(0),
        ..Default::default()
    });
    sc.user("u1", "Write the notes.")
        .assistant(
            "a1",
            vec![call(
                "a1",
                "w1",
                "write",
                write_input.clone(),
                "Wrote file successfully.",
            )],
        )
        .user("u2", "ok")
        .user("u3", "ok");
    let run = sc.commit();
    assert!(run.report.committed);
    assert_eq!(part_ids(&run.report), ["w1"]);
    let w1 = shown(&run.after, "w1");
    assert_eq!(state(w1).output, PLACEHOLDER);
    assert_eq!(state(w1).input, json!({ "filePath": "notes.md" }));
    let stripped =
        count(&write_input.to_string()) - count(&json!({ "filePath": "notes.md" }).to_string());
    assert_eq!(
        saving(&run.report, St::PruneToolInputs),
        Some((1, stripped))
    );
    expect_no_marks(&sc.s);
}

#[test]
fn prune_counts_only_what_is_left_of_an_output_a_strategy_already_shortened() {
    let mut sc = Script::with(SessionOverrides {
        prune_protect: Some(0),
        prune_minimum: Some(0),
        ..Default::default()
    });
    let (old, new) = (file_body(8_000), file_body(6_000));
    sc.user("u1", "Read it twice.")
        .assistant("a1", vec![read("a1", "r1", "src/lib.rs", &old)])
        .assistant("a2", vec![read("a2", "r2", "src/lib.rs", &new)])
        .user("u2", "ok")
        .user("u3", "ok");
    let run = sc.commit();
    assert!(run.report.committed);
    assert_eq!(part_ids(&run.report), ["r1", "r2"]);
    // The seed's figure weighs both outputs in full...
    assert_eq!(run.report.tokens_saved, count(&old) + count(&new));
    // ...but r1 was already down to its supersede note: prune's own saving is r2's output
    // giving way to the placeholder, and with the strategies' it is the whole change.
    assert_eq!(
        run.report.context_tokens_saved,
        (count(&new) - count(PLACEHOLDER)) as i64
    );
    assert_eq!(
        run.before.tokens - run.after.tokens,
        run.report.context_tokens_saved as u64 + run.report.strategies.tokens()
    );
}

#[test]
fn t36_one_file_one_view_any_operation_supersedes_all_earlier_ones() {
    let v1 = file_body(60);
    let mut sc = Script::new();
    sc.user("u1", "Look at the config.")
        .assistant("a1", vec![read("a1", "r1", "src/config.json", &v1)])
        .user("u2", "Again?")
        .assistant("a2", vec![read("a2", "r2", "./src/config.json", &v1)])
        .user("u3", "Rewrite it.")
        .assistant(
            "a3",
            vec![call(
                "a3",
                "w1",
                "write",
                json!({ "filePath": "src/config.json", "content": file_body(50) }),
                "Wrote file successfully.",
            )],
        )
        .user("u4", "Fix one value.")
        .assistant(
            "a4",
            vec![call(
                "a4",
                "e1",
                "edit",
                json!({ "filePath": "src//config.json", "oldString": "x".repeat(300),
                    "newString": "y".repeat(300) }),
                "Edit applied successfully.",
            )],
        )
        .user("u5", "Show me.")
        .assistant(
            "a5",
            vec![
                read("a5", "r3", "src/config.json", &file_body(55)),
                read("a5", "o1", "src/other.json", &file_body(20)),
            ],
        );
    let run = sc.commit();

    // read → read → write → edit → read: only the last view stays; normalized paths
    // (`./src/…`, `src//…`) are the same file; another file is untouched. A supersede may
    // touch the last two user turns (e1 is in turn u4): it is about staleness.
    expect_marks(
        &sc.s,
        &[
            ("r1", St::AggressiveFilePrune, "r2"),
            ("r2", St::AggressiveFilePrune, "w1"),
            ("w1", St::AggressiveFilePrune, "e1"),
            ("e1", St::AggressiveFilePrune, "r3"),
        ],
    );
    for (id, by) in [("r1", "r2"), ("r2", "w1"), ("w1", "e1"), ("e1", "r3")] {
        // The note replaces an output only when it is shorter.
        let note = superseded_text(&format!("call_{by}"));
        let original = state(&find(&sc.s, id)).output.clone();
        let expected = if note.len() < original.len() {
            note
        } else {
            original
        };
        assert_eq!(state(shown(&run.after, id)).output, expected, "{id}");
    }
    assert_eq!(state(shown(&run.after, "r3")).output, file_body(55));
    assert_eq!(state(shown(&run.after, "o1")).output, file_body(20));
    assert_eq!(
        state(shown(&run.after, "e1")).input,
        json!({ "filePath": "src//config.json" })
    );
    assert_eq!(state(&find(&sc.s, "r1")).output, v1, "original kept");
    expect_saving(&run.report, St::AggressiveFilePrune, 4);
    // Only the write and the edit had inputs worth stripping.
    expect_saving(&run.report, St::PruneToolInputs, 2);
    assert_eq!(
        saved_by(&run.report),
        [St::PruneToolInputs, St::AggressiveFilePrune]
    );
}

#[test]
fn t36_one_file_one_view_a_patch_goes_once_all_its_files_have_newer_views() {
    let patch = "*** Begin Patch\n*** Update File: src/a.rs\n@@\n-old\n+new\n*** Update File: src/b.rs\n@@\n-old\n+new\n*** End Patch";
    let mut sc = Script::new();
    sc.user("u1", "Patch both.").assistant(
        "a1",
        vec![
            call(
                "a1",
                "p1",
                "apply_patch",
                json!({ "patchText": patch }),
                &"Success. Updated the following files:\nM src/a.rs\nM src/b.rs\n".repeat(4),
            ),
            read("a1", "ra", "src/a.rs", &file_body(30)),
        ],
    );
    sc.commit();
    // src/b.rs has no newer view yet: the patch stays.
    expect_no_marks(&sc.s);

    sc.assistant("a2", vec![read("a2", "rb", "src/b.rs", &file_body(30))]);
    let run = sc.commit();
    expect_marks(&sc.s, &[("p1", St::AggressiveFilePrune, "rb")]);
    expect_saving(&run.report, St::AggressiveFilePrune, 1);
}

#[test]
fn t37_step_markers_are_filtered_from_the_context() {
    let build = |o: SessionOverrides| {
        let mut sc = Script::with(o);
        sc.user("u1", "Where is main?").assistant(
            "a1",
            vec![
                step_start("a1", "s1"),
                text("a1", "x1", "Let me look."),
                read("a1", "r1", "src/main.rs", &file_body(10)),
                step_finish("a1", "f1"),
                step_start("a1", "s2"),
                text("a1", "x2", "It is in src/main.rs."),
                step_finish("a1", "f2"),
            ],
        );
        sc
    };
    let mut on = build(SessionOverrides::default());
    let run = on.commit();
    let types = |v: &ContextView| -> Vec<&'static str> {
        v.messages[1]
            .parts
            .iter()
            .map(|p| p.part.kind.type_name())
            .collect()
    };
    assert_eq!(types(&run.after), ["text", "tool", "text"]);
    assert_eq!(on.s.messages()[1].parts.len(), 7, "markers are kept");
    // A rendering rule: nothing is marked, and markers weigh nothing in the estimate.
    expect_no_marks(&on.s);
    assert!(run.report.strategies.is_empty());

    let mut off = build(switches(&[("pruneStepMarkers", false)]));
    let off_run = off.commit();
    assert_eq!(
        types(&off_run.after),
        [
            "step-start",
            "text",
            "tool",
            "step-finish",
            "step-start",
            "text",
            "step-finish"
        ]
    );
    // The OpenAI rendering finds the step boundary (text after a call) without them.
    assert_eq!(run.after.to_openai(), off_run.after.to_openai());
    assert_eq!(
        run.after.to_openai().as_array().map(Vec::len),
        Some(4),
        "user, assistant+call, tool, assistant"
    );

    // A message holding nothing but markers is not sent at all.
    on.assistant("a2", vec![step_start("a2", "s3"), step_finish("a2", "f3")]);
    let view = on.s.build_context();
    assert!(view.messages.iter().all(|m| m.info.id != "a2"));
}

#[test]
fn t38_source_url_newest_fetch_of_a_url_or_search_stays() {
    let page = "# tokio\n".to_string() + &"Docs line.\n".repeat(200);
    let hits = "1. tokio::select! cancellation safety\n".repeat(20);
    let mut sc = Script::new();
    sc.user("u1", "Read the tokio docs.")
        .assistant(
            "a1",
            vec![
                call(
                    "a1",
                    "f1",
                    "webfetch",
                    json!({ "url": "https://docs.rs/tokio/latest/tokio/", "format": "markdown" }),
                    &page,
                ),
                call(
                    "a1",
                    "q1",
                    "websearch",
                    json!({ "query": "tokio select cancel safety" }),
                    &hits,
                ),
            ],
        )
        .user("u2", "And again.")
        .assistant(
            "a2",
            vec![
                call(
                    "a2",
                    "f2",
                    "webfetch",
                    json!({ "url": "https://docs.rs/tokio/latest/tokio/#modules",
                        "format": "markdown" }),
                    &page,
                ),
                call(
                    "a2",
                    "g1",
                    "webfetch",
                    json!({ "url": "https://example.com/other", "format": "markdown" }),
                    &page,
                ),
                call(
                    "a2",
                    "q2",
                    "websearch",
                    json!({ "query": "tokio select cancel safety" }),
                    &hits,
                ),
            ],
        );
    let run = sc.commit();
    // The fragment never reaches the server: same document.
    expect_marks(
        &sc.s,
        &[
            ("f1", St::PruneSourceUrls, "f2"),
            ("q1", St::PruneSourceUrls, "q2"),
        ],
    );
    assert_eq!(
        state(shown(&run.after, "f1")).output,
        superseded_text("call_f2")
    );
    assert_eq!(state(shown(&run.after, "g1")).output, page);
    assert_eq!(state(&find(&sc.s, "f1")).output, page);
    expect_saving(&run.report, St::PruneSourceUrls, 2);
    assert_eq!(saved_by(&run.report), [St::PruneSourceUrls]);
}

#[test]
fn t39_state_query_only_the_newest_ls_or_git_status_stays() {
    let listing = "drwxr-xr-x  5 dev dev 4096 Jan  1 00:00 src\n".repeat(30);
    let status = "On branch main\nChanges not staged for commit:\n".to_string()
        + &"\tmodified:   src/lib.rs\n".repeat(20);
    let mut sc = Script::new();
    sc.user("u1", "What is the state?")
        .assistant(
            "a1",
            vec![
                call(
                    "a1",
                    "l1",
                    "bash",
                    json!({ "command": "ls -la", "description": "List files" }),
                    &listing,
                ),
                bash("a1", "g1", "git status", &status),
                bash("a1", "c1", "cargo build", &"Compiling x\n".repeat(30)),
                bash(
                    "a1",
                    "n1",
                    "find . -name '*.rs'",
                    &"./src/lib.rs\n".repeat(30),
                ),
            ],
        )
        .user("u2", "And now?")
        .assistant(
            "a2",
            vec![
                call(
                    "a2",
                    "l2",
                    "bash",
                    json!({ "command": "ls -la", "description": "List files again" }),
                    &listing,
                ),
                bash("a2", "g2", "  git   status ", &status),
                bash("a2", "l3", "ls", &"src\n".repeat(30)),
                bash(
                    "a2",
                    "c2",
                    "cargo build --release",
                    &"Compiling x\n".repeat(30),
                ),
                bash(
                    "a2",
                    "n2",
                    "find . -name '*.rs'",
                    &"./src/lib.rs\n".repeat(30),
                ),
            ],
        );
    let run = sc.commit();
    // `ls` and `ls -la` are different queries; builds are not queries; whitespace in the
    // command does not matter; an identical `find` is a state query before a duplicate.
    expect_marks(
        &sc.s,
        &[
            ("l1", St::StateQuerySupersede, "l2"),
            ("g1", St::StateQuerySupersede, "g2"),
            ("n1", St::StateQuerySupersede, "n2"),
        ],
    );
    assert_eq!(
        state(shown(&run.after, "g1")).output,
        superseded_text("call_g2")
    );
    assert_eq!(
        state(shown(&run.after, "c1")).output,
        "Compiling x\n".repeat(30)
    );
    expect_saving(&run.report, St::StateQuerySupersede, 3);
    assert_eq!(saved_by(&run.report), [St::StateQuerySupersede]);
}

#[test]
fn t40_snapshot_only_the_latest_snapshot_is_retained() {
    let tree = "- button \"Submit\" [ref=e12]\n".repeat(80);
    let mut sc = Script::new();
    sc.user("u1", "Check the page.")
        .assistant(
            "a1",
            vec![
                call("a1", "s1", "playwright_browser_snapshot", json!({}), &tree),
                call("a1", "s2", "browser_snapshot", json!({}), &tree),
            ],
        )
        .user("u2", "Click submit and check again.")
        .assistant(
            "a2",
            vec![call(
                "a2",
                "s3",
                "playwright_browser_snapshot",
                json!({}),
                &tree,
            )],
        );
    let run = sc.commit();
    expect_marks(
        &sc.s,
        &[
            ("s1", St::PruneSnapshots, "s2"),
            ("s2", St::PruneSnapshots, "s3"),
        ],
    );
    assert_eq!(
        state(shown(&run.after, "s2")).output,
        superseded_text("call_s3")
    );
    assert_eq!(state(shown(&run.after, "s3")).output, tree);
    expect_saving(&run.report, St::PruneSnapshots, 2);

    // Which tools are snapshots is configurable.
    let mut custom = Script::with(SessionOverrides {
        snapshot_tools: Some(vec!["capture_state".into()]),
        ..Default::default()
    });
    custom.user("u1", "Capture.").assistant(
        "a1",
        vec![
            call("a1", "b1", "browser_snapshot", json!({ "tab": 1 }), &tree),
            call("a1", "c1", "capture_state", json!({ "tab": 1 }), &tree),
            call("a1", "b2", "browser_snapshot", json!({ "tab": 2 }), &tree),
            call("a1", "c2", "mcp_capture_state", json!({ "tab": 2 }), &tree),
        ],
    );
    custom.commit();
    expect_marks(&custom.s, &[("c1", St::PruneSnapshots, "c2")]);
}

#[test]
fn t41_retry_failed_attempt_pruned_on_success() {
    let err = |what: &str| {
        format!("error[E0425]: {what}\n") + &" --> src/main.rs:3:5\n  |\n3 |     x\n".repeat(12)
    };
    let ok = "test result: ok. 42 passed; 0 failed\n".repeat(5);
    let mut sc = Script::new();
    sc.user("u1", "Run the tests.")
        .assistant(
            "a1",
            vec![
                failed(
                    "a1",
                    "e1",
                    "bash",
                    json!({ "command": "cargo test", "timeout": 60000 }),
                    &err("cannot find value `x`"),
                ),
                call(
                    "a1",
                    "k1",
                    "bash",
                    json!({ "timeout": 60000, "command": "cargo test" }),
                    &ok,
                ),
                failed(
                    "a1",
                    "e2",
                    "bash",
                    json!({ "command": "npm test" }),
                    &err("npm"),
                ),
                bash("a1", "k2", "npm test -- --watch=false", &ok),
            ],
        )
        .user("u2", "Lint too.")
        .assistant(
            "a2",
            vec![
                failed(
                    "a2",
                    "e3",
                    "bash",
                    json!({ "command": "cargo clippy" }),
                    &err("a"),
                ),
                failed(
                    "a2",
                    "e4",
                    "bash",
                    json!({ "command": "cargo clippy" }),
                    &err("b"),
                ),
                bash("a2", "k3", "cargo clippy", &ok),
                bash("a2", "k4", "make", &ok),
                failed(
                    "a2",
                    "e5",
                    "bash",
                    json!({ "command": "make" }),
                    &err("make"),
                ),
            ],
        );
    let run = sc.commit();
    // Same tool + canonical input (key order does not matter); a different input is not a
    // retry; every failure before the success goes; a failure after a success stays.
    expect_marks(
        &sc.s,
        &[
            ("e1", St::PruneRetryParts, "k1"),
            ("e3", St::PruneRetryParts, "k3"),
            ("e4", St::PruneRetryParts, "k3"),
        ],
    );
    let e1 = shown(&run.after, "e1");
    assert_eq!(state(e1).status, ToolStatus::Error);
    assert_eq!(state(e1).error, superseded_text("call_k1"));
    assert_eq!(
        tool_result(&run.after.to_openai(), "call_e1"),
        superseded_text("call_k1")
    );
    assert_eq!(state(shown(&run.after, "e2")).error, err("npm"));
    assert_eq!(state(shown(&run.after, "e5")).error, err("make"));
    assert_eq!(
        state(&find(&sc.s, "e1")).error,
        err("cannot find value `x`")
    );
    expect_saving(&run.report, St::PruneRetryParts, 3);
    assert_eq!(saved_by(&run.report), [St::PruneRetryParts]);
}

#[test]
fn t42_file_masking_attachments_are_masked_with_breadcrumbs() {
    let inlined = format!(
        "<path>/repo/AGENTS.md</path>\n<type>file</type>\n<content>{}",
        "x".repeat(3000)
    );
    let mut sc = Script::new();
    sc.user_with(
        "u1",
        "What is wrong in this screenshot?",
        vec![
            synthetic("u1", "i1", &inlined),
            file("u1", "f1", "shot.png", "image/png", &png(40_960)),
        ],
    )
    .assistant("a1", vec![text("a1", "x1", "A layout bug.")])
    .user("u2", "Thanks.")
    .assistant("a2", vec![text("a2", "x2", "Welcome.")]);
    let run = sc.commit();
    // One user turn newer: still in the last two turns.
    expect_no_marks(&sc.s);
    assert!(run.report.strategies.is_empty());

    sc.user_with(
        "u3",
        "Another one.",
        vec![file("u3", "f3", "shot2.png", "image/png", &png(40_960))],
    )
    .assistant("a3", vec![text("a3", "x3", "Same bug.")]);
    let run = sc.commit();
    expect_marks(
        &sc.s,
        &[("f1", St::PruneFiles, ""), ("i1", St::PruneFiles, "")],
    );
    assert_eq!(shown_text(&run.after, "f1"), "[File: shot.png, 30KB]");
    assert_eq!(shown_text(&run.after, "i1"), "[File: /repo/AGENTS.md, 3KB]");
    assert!(
        matches!(&find(&sc.s, "f1").kind, PartKind::File(f) if f.url == png(40_960)),
        "original kept"
    );
    let openai = run.after.to_openai();
    assert_eq!(
        openai[0]["content"],
        json!([
            {"type": "text", "text": "What is wrong in this screenshot?"},
            {"type": "text", "text": "[File: /repo/AGENTS.md, 3KB]"},
            {"type": "text", "text": "[File: shot.png, 30KB]"},
        ])
    );
    // The attachment of the newest turn is still sent as an image.
    assert!(openai.to_string().contains("image_url"));
    expect_saving(&run.report, St::PruneFiles, 2);
    assert_eq!(saved_by(&run.report), [St::PruneFiles]);
}

#[test]

fn t42_file_masking_a_text_attachment_adds_nothing_to_the_payload() {
    // OpenCode sends a text attachment as its synthetic text, never the file part itself
    // (`to_openai` skips text/plain file parts). Masking the file part would turn it into
    // a synthetic text part that is sent: the payload would grow while the estimate
    // shrank. (Found by this test; fixed.)
    let body = "line of notes\n".repeat(300);
    let mut sc = Script::new();
    sc.user_with(
        "u1",
        "Read my notes.",
        vec![file(
            "u1",
            "f1",
            "notes.txt",
            "text/plain",
            &format!("data:text/plain,{body}"),
        )],
    )
    .user("u2", "ok")
    .user("u3", "ok");
    let before = sc.s.build_context().to_openai();
    let run = sc.commit();
    // Its content travels as synthetic text (masked on its own); the part is left alone.
    expect_marks(&sc.s, &[]);
    let after = run.after.to_openai();
    assert!(
        after.to_string().len() <= before.to_string().len(),
        "payload grew: {} -> {}",
        before[0],
        after[0]
    );
}

#[test]
fn t43_user_code_old_code_blocks_are_truncated() {
    let asked = format!(
        "Why does this fail?\n```rust\n{}```\nthanks",
        "let x = compute(1);\n".repeat(15)
    );
    let mut sc = Script::new();
    sc.user("u1", &asked).assistant(
        "a1",
        vec![text(
            "a1",
            "x1",
            &format!("Try:\n```rust\n{}```", "let y = 2;\n".repeat(15)),
        )],
    );
    // A synthetic user text (a host note) is not the user's code.
    put(
        &mut sc.s,
        Update::UpsertPart(synthetic(
            "u1",
            "y1",
            &format!("```text\n{}```", "tool note\n".repeat(15)),
        )),
    );
    for n in 2..=5 {
        sc.user(&format!("u{n}"), "next");
        sc.commit();
    }
    // Four user turns newer: not yet.
    expect_no_marks(&sc.s);

    sc.user("u6", "next");
    let run = sc.commit();
    expect_marks(&sc.s, &[("u1_t", St::PruneUserCodeBlocks, "")]);
    assert_eq!(
        shown_text(&run.after, "u1_t"),
        "Why does this fail?\n[Code block: rust, 15 lines - truncated to save context]\nthanks"
    );
    assert!(
        shown_text(&run.after, "x1").contains("let y = 2;"),
        "assistant text kept"
    );
    assert!(matches!(&find(&sc.s, "u1_t").kind, PartKind::Text(t) if t.text == asked));
    expect_saving(&run.report, St::PruneUserCodeBlocks, 1);
    assert_eq!(saved_by(&run.report), [St::PruneUserCodeBlocks]);
}

#[test]
fn t44_error_truncation_old_errors_keep_their_first_line() {
    let error = stack_error("Error: Something failed", 20);
    let mut sc = Script::new();
    sc.user("u1", "Build it.").assistant(
        "a1",
        vec![
            failed(
                "a1",
                "e1",
                "bash",
                json!({ "command": "npm run build" }),
                &error,
            ),
            failed(
                "a1",
                "e2",
                "read",
                json!({ "filePath": "missing.txt" }),
                "Error: file not found",
            ),
        ],
    );
    for n in 2..=3 {
        sc.user(&format!("u{n}"), "next");
        sc.commit();
    }
    // Two user turns newer: not yet.
    expect_no_marks(&sc.s);

    sc.user("u4", "next");
    let run = sc.commit();
    // A one-line error would not get shorter.
    expect_marks(&sc.s, &[("e1", St::TruncateOldErrors, "")]);
    let e1 = shown(&run.after, "e1");
    assert_eq!(
        state(e1).error,
        format!(
            "Error: Something failed\n[Error output truncated - {} chars total]",
            error.chars().count()
        )
    );
    // Not a supersede: the input stays as it was.
    assert_eq!(state(e1).input, json!({ "command": "npm run build" }));
    assert_eq!(state(&find(&sc.s, "e1")).error, error);
    expect_saving(&run.report, St::TruncateOldErrors, 1);
    assert_eq!(saved_by(&run.report), [St::TruncateOldErrors]);
}

#[test]
fn t45_compaction_awareness_compacted_outputs_are_not_processed_twice() {
    // An output the host already compacted is not superseded again.
    let body = file_body(80);
    let mut compacted = read("a1", "r1", "src/a.rs", &body);
    state_mut(&mut compacted).time.compacted = Some(NOW - 1_000);
    let mut sc = Script::new();
    sc.user("u1", "Read a.rs.")
        .assistant("a1", vec![compacted])
        .user("u2", "Again.")
        .assistant("a2", vec![read("a2", "r2", "src/a.rs", &body)]);
    let run = sc.commit();
    expect_no_marks(&sc.s);
    assert!(run.report.strategies.is_empty());
    assert_eq!(state(shown(&run.after, "r1")).output, PLACEHOLDER);
    assert_eq!(run.before, run.after);
}

#[test]
fn t45_compaction_awareness_prune_after_a_strategy_keeps_the_strategy_reading() {
    let body = file_body(200);
    let mut sc = Script::with(SessionOverrides {
        prune_protect: Some(0),
        prune_minimum: Some(0),
        ..Default::default()
    });
    sc.user("u1", "Read a.rs twice.")
        .assistant(
            "a1",
            vec![
                read("a1", "r1", "src/a.rs", &body),
                read("a1", "r2", "src/a.rs", &body),
            ],
        )
        .user("u2", "ok")
        .user("u3", "ok");
    let run = sc.commit();
    // The strategies run first; prune then clears both outputs, but r1 keeps reading as
    // the strategy made it and its tokens are not removed twice.
    assert!(run.report.committed);
    assert_eq!(part_ids(&run.report), ["r1", "r2"]);
    expect_marks(&sc.s, &[("r1", St::AggressiveFilePrune, "r2")]);
    assert_eq!(
        state(shown(&run.after, "r1")).output,
        superseded_text("call_r2")
    );
    assert_eq!(state(shown(&run.after, "r2")).output, PLACEHOLDER);
    let r2_saved = part_tokens(&run.before, "r2") - part_tokens(&run.after, "r2");
    assert_eq!(
        run.before.tokens - run.after.tokens,
        run.report.strategies.tokens() + r2_saved
    );
    // A second run: both are compacted, nothing is processed again.
    let again = sc.commit();
    assert!(again.report.strategies.is_empty() && !again.report.committed);
    assert_eq!(again.before, again.after);
}

#[test]
fn t45_compaction_awareness_parts_summarized_away_are_left_alone() {
    let body = file_body(80);
    let mut sc = Script::new();
    sc.user("u1", "Read a.rs.")
        .assistant(
            "a1",
            vec![
                read("a1", "r1", "src/a.rs", &body),
                failed(
                    "a1",
                    "e1",
                    "bash",
                    json!({ "command": "cargo test" }),
                    &stack_error("boom", 20),
                ),
            ],
        )
        .user_with("u2", "", vec![compaction("u2", "c1")]);
    put(&mut sc.s, Update::UpsertMessage(summary("s1", "u2")));
    put(
        &mut sc.s,
        Update::UpsertPart(text("s1", "s1_t", "We read a.rs; cargo test failed.")),
    );
    sc.user("u3", "Go on.")
        .assistant(
            "a3",
            vec![
                read("a3", "r2", "src/a.rs", &body),
                bash("a3", "k1", "cargo test", "ok"),
            ],
        )
        .user("u4", "next")
        .user("u5", "next")
        .user("u6", "next");
    let run = sc.commit();
    // r1 and e1 are behind the compaction boundary: the summary already replaced them.
    expect_no_marks(&sc.s);
    assert!(run.report.strategies.is_empty());
    assert_eq!(run.after.boundary_message_id.as_deref(), Some("u2"));
}

// ---- the base supersede layer --------------------------------------------------------

#[test]
fn base_supersede_duplicates_identical_calls_keep_the_newest() {
    let rows = "| id | name |\n".repeat(60);
    let mut sc = Script::new();
    sc.user("u1", "Query the db.")
        .assistant(
            "a1",
            vec![
                call(
                    "a1",
                    "d1",
                    "db_query",
                    json!({ "sql": "select * from users", "limit": 50 }),
                    &rows,
                ),
                call(
                    "a1",
                    "d2",
                    "db_query",
                    json!({ "sql": "select * from users", "limit": 51 }),
                    &rows,
                ),
            ],
        )
        .user("u2", "Again.")
        .assistant(
            "a2",
            vec![call(
                "a2",
                "d3",
                "db_query",
                json!({ "limit": 50, "sql": "select * from users" }),
                &rows,
            )],
        );
    let run = sc.commit();
    expect_marks(&sc.s, &[("d1", St::SupersedeDuplicates, "d3")]);
    assert_eq!(
        state(shown(&run.after, "d1")).output,
        superseded_text("call_d3")
    );
    expect_saving(&run.report, St::SupersedeDuplicates, 1);
    assert_eq!(saved_by(&run.report), [St::SupersedeDuplicates]);
}

fn todos(items: &[(&str, &str)]) -> Value {
    json!({ "todos": items.iter().enumerate().map(|(i, (c, s))| json!({
        "id": i.to_string(), "content": c, "status": s, "priority": "high"
    })).collect::<Vec<_>>() })
}

#[test]
fn base_todo_only_the_newest_todo_state_stays_even_though_protected() {
    let list1 = todos(&[
        ("Reproduce the failing test", "in_progress"),
        ("Fix the parser", "pending"),
        ("Update the changelog", "pending"),
    ]);
    let list2 = todos(&[
        ("Reproduce the failing test", "completed"),
        ("Fix the parser", "in_progress"),
        ("Update the changelog", "pending"),
    ]);
    let mut sc = Script::new();
    sc.user("u1", "Plan it.")
        .assistant(
            "a1",
            vec![call(
                "a1",
                "t1",
                "todowrite",
                list1.clone(),
                &list1["todos"].to_string(),
            )],
        )
        .user("u2", "Go.")
        .assistant(
            "a2",
            vec![
                call(
                    "a2",
                    "t2",
                    "todoread",
                    json!({}),
                    &list1["todos"].to_string(),
                ),
                call(
                    "a2",
                    "t3",
                    "todowrite",
                    list2.clone(),
                    &list2["todos"].to_string(),
                ),
            ],
        );
    let run = sc.commit();
    expect_marks(
        &sc.s,
        &[
            ("t1", St::SupersedeTodos, "t2"),
            ("t2", St::SupersedeTodos, "t3"),
        ],
    );
    assert_eq!(
        state(shown(&run.after, "t1")).output,
        superseded_text("call_t2")
    );
    assert_eq!(
        state(shown(&run.after, "t3")).output,
        list2["todos"].to_string()
    );
    expect_saving(&run.report, St::SupersedeTodos, 2);
}

#[test]
fn base_searches_glob_and_grep_keyed_by_path_pattern_and_include() {
    let hits = "src/lib.rs:10: fn main() {}\n".repeat(30);
    let mut sc = Script::new();
    sc.user("u1", "Find main.")
        .assistant(
            "a1",
            vec![
                call(
                    "a1",
                    "g1",
                    "glob",
                    json!({ "pattern": "**/*.rs", "path": "/repo/src" }),
                    &hits,
                ),
                call(
                    "a1",
                    "r1",
                    "grep",
                    json!({ "pattern": "fn main", "path": "src", "include": "*.rs" }),
                    &hits,
                ),
                call(
                    "a1",
                    "r2",
                    "grep",
                    json!({ "pattern": "fn main", "path": "src" }),
                    &hits,
                ),
            ],
        )
        .user("u2", "Again.")
        .assistant(
            "a2",
            vec![
                call(
                    "a2",
                    "g2",
                    "glob",
                    json!({ "pattern": "**/*.rs", "path": "/repo/src/" }),
                    &hits,
                ),
                call(
                    "a2",
                    "r3",
                    "grep",
                    json!({ "pattern": "fn main", "path": "./src", "include": "*.rs" }),
                    &hits,
                ),
                call(
                    "a2",
                    "g3",
                    "glob",
                    json!({ "pattern": "**/*.ts", "path": "/repo/src" }),
                    &hits,
                ),
            ],
        );
    let run = sc.commit();
    expect_marks(
        &sc.s,
        &[
            ("g1", St::SupersedeSearches, "g2"),
            ("r1", St::SupersedeSearches, "r3"),
        ],
    );
    expect_saving(&run.report, St::SupersedeSearches, 2);
    assert_eq!(saved_by(&run.report), [St::SupersedeSearches]);
}

// ---- a session using every strategy --------------------------------------------------

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

#[test]
fn every_strategy_applies_once_in_a_rich_session() {
    let mut s = import(&rich_messages(), SessionOverrides::default());
    let run = commit(&mut s, NOW);
    assert_eq!(marks(&s), rich_marks());
    // Every strategy that marks, plus the input-leak fix, reports a saving.
    assert_eq!(
        saved_by(&run.report),
        [
            St::PruneToolInputs,
            St::PruneSourceUrls,
            St::StateQuerySupersede,
            St::PruneSnapshots,
            St::PruneRetryParts,
            St::PruneFiles,
            St::PruneUserCodeBlocks,
            St::TruncateOldErrors,
            St::AggressiveFilePrune,
            St::SupersedeDuplicates,
            St::SupersedeTodos,
            St::SupersedeSearches,
        ]
    );
    // Protected `task` calls are identical but never superseded.
    assert!(!marks(&s).contains_key("k1"));
    // The context keeps every message and every call: only contents are shorter.
    assert_eq!(ids(&run.before), ids(&run.after));
    assert!(run.after.tokens < run.before.tokens);
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

// ---- rules ---------------------------------------------------------------------------

#[test]
fn rule_idempotence_a_second_commit_marks_nothing_and_changes_nothing() {
    let mut s = import(&rich_messages(), SessionOverrides::default());
    commit(&mut s, NOW);
    let messages = s.messages().to_vec();
    let view = s.build_context();

    let again = commit(&mut s, NOW + 1);
    assert!(again.report.strategies.is_empty(), "{:?}", again.report);
    assert_eq!(s.messages(), messages.as_slice());
    assert_eq!(s.build_context(), view);

    // A settings change rebuilds the strategy state from the messages: the same decisions,
    // all already applied.
    put(
        &mut s,
        Update::Configure(SessionInfo {
            id: "ses_strat".into(),
            config: SessionOverrides {
                prune_minimum: Some(30_000),
                ..Default::default()
            },
            ..Default::default()
        }),
    );
    let rebuilt = commit(&mut s, NOW + 2);
    assert!(rebuilt.report.strategies.is_empty(), "{:?}", rebuilt.report);
    assert_eq!(s.messages(), messages.as_slice());
    assert_eq!(s.build_context(), view);
    assert!(s.prune(PruneMode::DryRun, NOW + 3).strategies.is_empty());
}

#[test]
fn rule_age_strategies_respect_their_thresholds_and_never_touch_the_last_two_turns() {
    let mut sc = Script::new();
    for n in 1..=8usize {
        let u = format!("u{n}");
        let a = format!("a{n}");
        sc.user_with(
            &u,
            &format!("Case {n}:\n```python\n{}```", "print(1)\n".repeat(10)),
            vec![file(
                &u,
                &format!("f{n}"),
                "shot.png",
                "image/png",
                &png(8_000),
            )],
        )
        .assistant(
            &a,
            vec![failed(
                &a,
                &format!("e{n}"),
                "bash",
                json!({ "command": format!("pytest tests/test_{n}.py") }),
                &stack_error("AssertionError: 1 != 2", 15),
            )],
        );
        sc.commit();
        // A part of turn k is `n - k` user turns old: files go at 2, errors at 3, user
        // code at 5; the last two turns (age 0 and 1) are never touched.
        let mut expected = Vec::new();
        for k in 1..=n {
            let age = n - k;
            if age >= FILE_AGE_TURNS {
                expected.push((format!("f{k}"), St::PruneFiles));
            }
            if age >= ERROR_AGE_TURNS {
                expected.push((format!("e{k}"), St::TruncateOldErrors));
            }
            if age >= CODE_BLOCK_AGE_TURNS {
                expected.push((format!("u{k}_t"), St::PruneUserCodeBlocks));
            }
        }
        let expected: Vec<(&str, St, &str)> = expected
            .iter()
            .map(|(id, st)| (id.as_str(), *st, ""))
            .collect();
        assert_eq!(marks(&sc.s), want(&expected), "after {n} user turns");
    }
}

#[test]
fn rule_age_thresholds_are_the_seed_values() {
    assert_eq!(
        (FILE_AGE_TURNS, ERROR_AGE_TURNS, CODE_BLOCK_AGE_TURNS),
        (2, 3, 5)
    );
}

#[test]
fn rule_protected_tools_and_files_are_never_marked_but_todos_are_superseded() {
    let page = "Result line.\n".repeat(100);
    let mut sc = Script::with(SessionOverrides {
        protected_file_globs: Some(vec!["Cargo.toml".into(), "secrets/**".into()]),
        ..Default::default()
    });
    let list1 = todos(&[("One", "pending"), ("Two", "pending"), ("Three", "pending")]);
    let list2 = todos(&[
        ("One", "completed"),
        ("Two", "pending"),
        ("Three", "pending"),
    ]);
    sc.user("u1", "Explore.")
        .assistant(
            "a1",
            vec![
                call(
                    "a1",
                    "k1",
                    "task",
                    json!({ "description": "explore", "prompt": "find the bug" }),
                    &page,
                ),
                call(
                    "a1",
                    "k2",
                    "task",
                    json!({ "description": "explore", "prompt": "find the bug" }),
                    &page,
                ),
                call("a1", "s1", "skill", json!({ "name": "rust" }), &page),
                call("a1", "s2", "skill", json!({ "name": "rust" }), &page),
                read("a1", "c1", "Cargo.toml", &page),
                read("a1", "c2", "./Cargo.toml", &page),
                read("a1", "x1", "secrets/api/key.txt", &page),
                call(
                    "a1",
                    "x2",
                    "write",
                    json!({ "filePath": "secrets/api/key.txt", "content": "k".repeat(900) }),
                    "Wrote file successfully.",
                ),
                failed(
                    "a1",
                    "k3",
                    "task",
                    json!({ "description": "fix", "prompt": "fix it" }),
                    &stack_error("Error: subagent failed", 20),
                ),
                call("a1", "t1", "todowrite", list1.clone(), &list1.to_string()),
            ],
        )
        .user("u2", "Go on.")
        .assistant(
            "a2",
            vec![call(
                "a2",
                "t2",
                "todowrite",
                list2.clone(),
                &list2.to_string(),
            )],
        );
    for n in 3..=6 {
        sc.user(&format!("u{n}"), "next");
    }
    let run = sc.commit();
    expect_marks(&sc.s, &[("t1", St::SupersedeTodos, "t2")]);
    assert_eq!(state(shown(&run.after, "k1")).output, page);
    assert_eq!(state(shown(&run.after, "c1")).output, page);
    assert_eq!(
        state(shown(&run.after, "k3")).error,
        stack_error("Error: subagent failed", 20)
    );
}

#[test]

fn rule_protected_files_errors_are_not_truncated_for_age() {
    // Issue 5: "Protected means never cleared for age or size" — tools and file globs.
    let mut sc = Script::with(SessionOverrides {
        protected_file_globs: Some(vec!["Cargo.toml".into()]),
        ..Default::default()
    });
    sc.user("u1", "Bump the version.").assistant(
        "a1",
        vec![failed(
            "a1",
            "e1",
            "edit",
            json!({ "filePath": "Cargo.toml", "oldString": "0.1.0", "newString": "0.2.0" }),
            &stack_error("Error: oldString not found in content", 20),
        )],
    );
    for n in 2..=4 {
        sc.user(&format!("u{n}"), "next");
    }
    sc.commit();
    expect_no_marks(&sc.s);
}

#[test]
fn rule_protected_tools_are_configurable() {
    let body = file_body(40);
    let page = "Result line.\n".repeat(100);
    let mut sc = Script::with(SessionOverrides {
        strategy_protected_tools: Some(vec!["Read".into()]),
        ..Default::default()
    });
    sc.user("u1", "Go.").assistant(
        "a1",
        vec![
            read("a1", "r1", "src/a.rs", &body),
            read("a1", "r2", "src/a.rs", &body),
            call("a1", "k1", "task", json!({ "prompt": "explore" }), &page),
            call("a1", "k2", "task", json!({ "prompt": "explore" }), &page),
        ],
    );
    sc.commit();
    // The list replaces the default: reads are protected now, tasks no longer.
    expect_marks(&sc.s, &[("k1", St::SupersedeDuplicates, "k2")]);
}

#[test]
fn rule_switches_a_strategy_off_by_either_name_is_not_applied() {
    let listing = "drwxr-xr-x src\n".repeat(40);
    let body = file_body(40);
    let build = |o: SessionOverrides| {
        let mut sc = Script::with(o);
        sc.user("u1", "Look.").assistant(
            "a1",
            vec![
                read("a1", "r1", "src/a.rs", &body),
                call(
                    "a1",
                    "r2",
                    "read",
                    json!({ "filePath": "src/a.rs", "offset": 0 }),
                    &body,
                ),
                bash("a1", "l1", "ls -la", &listing),
                call(
                    "a1",
                    "l2",
                    "bash",
                    json!({ "command": "ls -la", "description": "again" }),
                    &listing,
                ),
            ],
        );
        sc.commit();
        sc
    };
    let all = build(SessionOverrides::default());
    expect_marks(
        &all.s,
        &[
            ("r1", St::AggressiveFilePrune, "r2"),
            ("l1", St::StateQuerySupersede, "l2"),
        ],
    );
    let snake = build(switches(&[("aggressive_file_prune", false)]));
    expect_marks(&snake.s, &[("l1", St::StateQuerySupersede, "l2")]);
    let camel = build(switches(&[("stateQuerySupersede", false)]));
    expect_marks(&camel.s, &[("r1", St::AggressiveFilePrune, "r2")]);
}

fn configure(s: &mut Session, o: SessionOverrides) {
    put(
        s,
        Update::Configure(SessionInfo {
            id: "ses_strat".into(),
            config: o,
            ..Default::default()
        }),
    );
}

#[test]
fn rule_switches_turning_a_strategy_off_after_marks_restores_the_content() {
    let body = file_body(40);
    let listing = "drwxr-xr-x src\n".repeat(40);
    let msgs = || -> Vec<(MessageInfo, Vec<Part>)> {
        vec![
            (user("u1"), vec![text("u1", "u1_t", "Look.")]),
            (
                assistant("a1", "u1"),
                vec![
                    read("a1", "r1", "src/a.rs", &body),
                    call(
                        "a1",
                        "r2",
                        "read",
                        json!({ "filePath": "src/a.rs", "offset": 0 }),
                        &body,
                    ),
                    bash("a1", "l1", "ls -la", &listing),
                    bash("a1", "l2", "ls -la", &listing),
                ],
            ),
        ]
    };
    let mut s = import(&msgs(), SessionOverrides::default());
    let marked = commit(&mut s, NOW).after;
    expect_marks(
        &s,
        &[
            ("r1", St::AggressiveFilePrune, "r2"),
            ("l1", St::StateQuerySupersede, "l2"),
        ],
    );

    // Off: r1 reads as it was (the mark stays, inactive), the figures follow at once.
    configure(&mut s, switches(&[("aggressiveFilePrune", false)]));
    let view = s.build_context();
    assert_eq!(state(shown(&view, "r1")).output, body);
    assert_eq!(state(shown(&view, "l1")).output, superseded_text("call_l2"));
    assert!(find(&s, "r1").mark.is_some(), "marks are lazy");
    assert_eq!(s.total_tokens(), rendered_tokens_from_scratch(&s));
    assert_eq!(view.tokens, view_tokens_from_parts(&view));
    let mut off_from_start = import(&msgs(), switches(&[("aggressiveFilePrune", false)]));
    commit(&mut off_from_start, NOW);
    let off = off_from_start.build_context();
    assert_eq!(view.to_openai(), off.to_openai());
    assert_eq!(view.tokens, off.tokens);
    let again = commit(&mut s, NOW + 1);
    assert!(again.report.strategies.is_empty());

    // On again: the mark applies again without a new decision.
    configure(&mut s, switches(&[("aggressive_file_prune", true)]));
    assert_eq!(s.build_context(), marked);
    assert_eq!(s.total_tokens(), rendered_tokens_from_scratch(&s));
    assert!(commit(&mut s, NOW + 2).report.strategies.is_empty());
}

#[test]

fn rule_switches_turning_a_strategy_off_lets_the_others_decide() {
    // r1 and r2 are identical reads: one-file-one-view marks r1 first. With it off, the
    // duplicate rule (on) should supersede r1, as it does when the strategy was off from
    // the start (and as a re-import with these settings would).
    let body = file_body(40);
    let msgs = vec![
        (user("u1"), vec![text("u1", "u1_t", "Look.")]),
        (
            assistant("a1", "u1"),
            vec![
                read("a1", "r1", "src/a.rs", &body),
                read("a1", "r2", "src/a.rs", &body),
            ],
        ),
    ];
    let mut s = import(&msgs, SessionOverrides::default());
    commit(&mut s, NOW);
    expect_marks(&s, &[("r1", St::AggressiveFilePrune, "r2")]);
    configure(&mut s, switches(&[("aggressiveFilePrune", false)]));
    commit(&mut s, NOW + 1);

    let mut fresh = import(&msgs, switches(&[("aggressiveFilePrune", false)]));
    commit(&mut fresh, NOW + 1);
    expect_marks(&fresh, &[("r1", St::SupersedeDuplicates, "r2")]);
    assert_eq!(
        state(shown(&s.build_context(), "r1")).output,
        superseded_text("call_r2")
    );
}

#[test]

fn rule_switches_a_marked_part_never_reads_larger_than_its_original() {
    // The write was marked only because, inputs stripped, it shrank. Without the fix the
    // note (longer than "Wrote file successfully.") is added on top of the full input.
    let content = "A".repeat(5000);
    let msgs = vec![
        (user("u1"), vec![text("u1", "u1_t", "Write, then read.")]),
        (
            assistant("a1", "u1"),
            vec![
                call(
                    "a1",
                    "w1",
                    "write",
                    json!({ "filePath": "test.txt", "content": content }),
                    "Wrote file successfully.",
                ),
                read("a1", "r1", "test.txt", &content),
            ],
        ),
    ];
    let mut s = import(&msgs, SessionOverrides::default());
    commit(&mut s, NOW);
    expect_marks(&s, &[("w1", St::AggressiveFilePrune, "r1")]);
    configure(&mut s, switches(&[("pruneToolInputs", false)]));
    let unmarked = import(&msgs, switches(&[("pruneToolInputs", false)]));
    let view = s.build_context();
    assert!(
        part_tokens(&view, "w1") <= part_tokens(&unmarked.build_context(), "w1"),
        "w1 reads {} tokens marked vs {} unmarked",
        part_tokens(&view, "w1"),
        part_tokens(&unmarked.build_context(), "w1")
    );
}

#[test]
fn rule_presets_balanced_and_verbose() {
    let msgs = rich_messages();
    let preset = |p: StrategyPreset| SessionOverrides {
        strategy_preset: Some(p),
        ..Default::default()
    };

    // balanced: everything but user code and error truncation.
    let mut balanced = import(&msgs, preset(StrategyPreset::Balanced));
    commit(&mut balanced, NOW);
    let mut expected = rich_marks();
    expected.remove("u1_t");
    expected.remove("e2");
    assert_eq!(marks(&balanced), expected);

    // compact is the default.
    let mut compact = import(&msgs, preset(StrategyPreset::Compact));
    commit(&mut compact, NOW);
    assert_eq!(marks(&compact), rich_marks());

    // verbose: nothing; the context is the one without strategies (step markers too).
    let mut verbose = import(&msgs, preset(StrategyPreset::Verbose));
    let run = commit(&mut verbose, NOW);
    expect_no_marks(&verbose);
    assert!(run.report.strategies.is_empty());
    let mut none = import(&msgs, SessionOverrides::default());
    configure(
        &mut none,
        SessionOverrides {
            strategy_preset: Some(StrategyPreset::Verbose),
            ..Default::default()
        },
    );
    assert_eq!(run.after, none.build_context());
    let plain = {
        let mut s = Session::new(
            SessionInfo {
                id: "ses_plain".into(),
                ..Default::default()
            },
            &config(),
            Arc::new(CharsPerToken),
        );
        for (info, parts) in &msgs {
            put(&mut s, Update::UpsertMessage(info.clone()));
            for p in parts {
                put(&mut s, Update::UpsertPart(p.clone()));
            }
        }
        s
    };
    assert_eq!(run.after.to_openai(), plain.build_context().to_openai());
    assert_eq!(run.after.tokens, plain.build_context().tokens);
    assert_eq!(
        StrategySet::preset(StrategyPreset::Verbose),
        config().strategies
    );

    // A preset, then switches.
    let mut files_only = import(
        &msgs,
        SessionOverrides {
            strategy_preset: Some(StrategyPreset::Verbose),
            strategies: [(St::PruneFiles, true)].into_iter().collect(),
            ..Default::default()
        },
    );
    commit(&mut files_only, NOW);
    expect_marks(&files_only, &[("f1", St::PruneFiles, "")]);
}

#[test]
fn rule_dry_run_reports_exactly_what_the_commit_does_and_changes_nothing() {
    let mut s = import(&rich_messages(), SessionOverrides::default());
    let messages = s.messages().to_vec();
    let view = s.build_context();
    let dry = s.prune(PruneMode::DryRun, NOW);
    assert!(dry.dry_run && !dry.changed());
    assert_eq!(
        s.messages(),
        messages.as_slice(),
        "a dry run changed the session"
    );
    assert_eq!(s.build_context(), view);
    assert_eq!(dry.strategies.parts.len(), rich_marks().len());

    let run = commit(&mut s, NOW);
    assert_eq!(dry.strategies, run.report.strategies);
    let reported: BTreeMap<String, (String, String)> = dry
        .strategies
        .parts
        .iter()
        .map(|m| {
            (
                m.part_id.clone(),
                (m.strategy.name().to_string(), m.superseded_by.clone()),
            )
        })
        .collect();
    assert_eq!(reported, marks(&s));
    assert_eq!(view.tokens - run.after.tokens, dry.strategies.tokens());
}

#[test]

fn rule_dry_run_equals_commit_when_a_marked_part_is_cleared_by_prune() {
    let content = "A".repeat(5000);
    let msgs = vec![
        (user("u1"), vec![text("u1", "u1_t", "Write, then read.")]),
        (
            assistant("a1", "u1"),
            vec![
                call(
                    "a1",
                    "w1",
                    "write",
                    json!({ "filePath": "test.txt", "content": content }),
                    "Wrote file successfully.",
                ),
                read("a1", "r1", "test.txt", &content),
            ],
        ),
        (user("u2"), vec![text("u2", "u2_t", "ok")]),
        (user("u3"), vec![text("u3", "u3_t", "ok")]),
    ];
    let mut s = import(&msgs, SessionOverrides::default());
    commit(&mut s, NOW);
    expect_marks(&s, &[("w1", St::AggressiveFilePrune, "r1")]);
    configure(
        &mut s,
        SessionOverrides {
            prune_protect: Some(0),
            prune_minimum: Some(0),
            strategies: [(St::AggressiveFilePrune, false)].into_iter().collect(),
            ..Default::default()
        },
    );
    let dry = s.clone().prune(PruneMode::DryRun, NOW + 1);
    let run = commit(&mut s, NOW + 1);
    assert!(run.report.committed);
    assert_eq!(dry.strategies, run.report.strategies);
}

#[test]
fn rule_rebuild_live_and_import_end_with_the_same_marks_and_context() {
    let msgs = rich_messages();
    let mut imported = import(&msgs, SessionOverrides::default());
    commit(&mut imported, NOW);
    let mut lived = live(&msgs, SessionOverrides::default());
    // The last message finished through `step`: nothing is left to commit.
    assert!(commit(&mut lived, NOW).report.strategies.is_empty());
    assert_eq!(marks(&lived), rich_marks());
    assert_eq!(marks(&imported), marks(&lived));
    let (a, b) = (lived.build_context(), imported.build_context());
    assert_eq!(timeless(&a), timeless(&b));
    assert_eq!(a.to_openai(), b.to_openai());
    assert_eq!(lived.total_tokens(), imported.total_tokens());
}

#[test]

fn rule_a_supersede_is_undone_when_the_newer_call_is_deleted() {
    // E.g. the user reverts the turn that read the file again: the host deletes its parts.
    let body = file_body(60);
    let mut sc = Script::new();
    sc.user("u1", "Read a.rs.")
        .assistant("a1", vec![read("a1", "r1", "src/a.rs", &body)])
        .user("u2", "Again.")
        .assistant("a2", vec![read("a2", "r2", "src/a.rs", &body)]);
    sc.commit();
    expect_marks(&sc.s, &[("r1", St::AggressiveFilePrune, "r2")]);
    put(
        &mut sc.s,
        Update::DeletePart {
            message_id: "a2".into(),
            part_id: "r2".into(),
        },
    );
    sc.commit();
    // The only view of the file left must be readable.
    assert_eq!(state(shown(&sc.s.build_context(), "r1")).output, body);
}

#[test]

fn rule_rebuild_a_late_retry_gives_the_same_decision_live_and_imported() {
    // The failed read ages past 3 user turns; then its successful retry arrives in the
    // same (older) assistant message. Live, the age decision came first; imported, the
    // retry sits before the newer user messages and comes first.
    let mut s = open(SessionOverrides::default());
    put(&mut s, Update::UpsertMessage(user("u1")));
    put(
        &mut s,
        Update::UpsertPart(text("u1", "u1_t", "Read the readme.")),
    );
    put(&mut s, Update::UpsertMessage(assistant("a1", "u1")));
    put(
        &mut s,
        Update::UpsertPart(failed(
            "a1",
            "e1",
            "read",
            json!({ "filePath": "README.md" }),
            &stack_error("Error: EBUSY README.md", 20),
        )),
    );
    for n in 2..=4 {
        let u = format!("u{n}");
        put(&mut s, Update::UpsertMessage(user(&u)));
        put(
            &mut s,
            Update::UpsertPart(text(&u, &format!("{u}_t"), "next")),
        );
    }
    put(
        &mut s,
        Update::UpsertPart(read("a1", "k1", "README.md", &file_body(40))),
    );
    commit(&mut s, NOW);
    let mut imported = import(&final_messages(&s), SessionOverrides::default());
    commit(&mut imported, NOW);
    assert_eq!(marks(&s), marks(&imported));
}

/// Documented: the strategies are part of the automatic prune layer. With automatic
/// prune off (`prune: false`, `COMPACTD_DISABLE_PRUNE`) nothing is marked live; an
/// explicit prune run applies them.
#[test]
fn rule_switches_strategies_follow_the_automatic_prune_switch() {
    let body = file_body(40);
    let msgs = vec![
        (user("u1"), vec![text("u1", "u1_t", "Read a.rs twice.")]),
        (
            assistant("a1", "u1"),
            vec![
                read("a1", "r1", "src/a.rs", &body),
                read("a1", "r2", "src/a.rs", &body),
            ],
        ),
    ];
    let mut s = live(
        &msgs,
        SessionOverrides {
            prune: Some(false),
            ..Default::default()
        },
    );
    expect_marks(&s, &[]);
    commit(&mut s, NOW);
    expect_marks(&s, &[("r1", St::AggressiveFilePrune, "r2")]);
}

// ---- property tests ------------------------------------------------------------------

/// One thing a host does to a session.
#[derive(Debug, Clone)]
enum Op {
    /// A user message: text (with a ``` block of `code` lines when non-zero) and maybe an
    /// attachment (1: an image, 2: a text file inlined as synthetic text).
    User { code: u8, attach: u8 },
    /// An unfinished assistant message answering the last user message.
    Assistant,
    /// A tool call from the pool on the last assistant message (running, then final).
    Tool { pick: u8, fail: bool, size: u16 },
    /// A text part on the last assistant message.
    Text { chars: u16 },
    /// A step marker on the last assistant message.
    StepFinish,
    /// The last assistant message finishes (automatic prune through `step`).
    Finish,
    /// An explicit prune commit (after a dry run on a copy).
    Commit,
}

const PATHS: [&str; 3] = ["src/main.rs", "src/lib.rs", "README.md"];
const URLS: [&str; 2] = ["https://docs.rs/tokio", "https://example.com/guide#intro"];
const COMMANDS: [&str; 3] = ["ls -la", "git status", "cargo test"];

/// Tool, input and output of pool entry `pick` (`size` shapes contents and outputs).
fn pool(pick: u8, size: u16) -> (&'static str, Value, String) {
    let n = usize::from(size);
    let path = |i: u8| {
        let p = PATHS[usize::from(i) % PATHS.len()];
        if size % 3 == 0 {
            format!("./{p}")
        } else {
            p.to_string()
        }
    };
    let out = "o".repeat(n);
    match pick % 18 {
        i @ 0..=2 => ("read", json!({ "filePath": path(i) }), file_body(n / 30)),
        i @ 3..=5 => (
            "write",
            json!({ "filePath": path(i), "content": "w".repeat(n) }),
            "Wrote file successfully.".into(),
        ),
        i @ 6..=8 => (
            "edit",
            json!({ "filePath": path(i), "oldString": "a".repeat(n / 2),
                "newString": "b".repeat(n / 2) }),
            "Edit applied successfully.".into(),
        ),
        i @ 9..=11 => (
            "bash",
            json!({ "command": COMMANDS[usize::from(i - 9)] }),
            out,
        ),
        i @ 12..=13 => ("webfetch", json!({ "url": URLS[usize::from(i - 12)] }), out),
        14 => (
            "todowrite",
            todos(&[(
                "Step",
                if size % 2 == 0 {
                    "pending"
                } else {
                    "completed"
                },
            )]),
            out,
        ),
        15 => ("glob", json!({ "pattern": "**/*.rs" }), out),
        16 => ("task", json!({ "prompt": "explore" }), out),
        _ => ("browser_snapshot", json!({ "tab": size % 2 }), out),
    }
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (prop_oneof![3 => Just(0u8), 1 => 2u8..20], 0u8..4)
            .prop_map(|(code, attach)| Op::User { code, attach }),
        3 => Just(Op::Assistant),
        12 => (any::<u8>(), prop::bool::weighted(0.25), 0u16..1_200)
            .prop_map(|(pick, fail, size)| Op::Tool { pick, fail, size }),
        1 => (0u16..200).prop_map(|chars| Op::Text { chars }),
        1 => Just(Op::StepFinish),
        3 => Just(Op::Finish),
        2 => Just(Op::Commit),
    ]
}

/// Builds a session op by op as a live host does, checking every prune run.
struct Driver {
    s: Session,
    o: SessionOverrides,
    next: usize,
    now: i64,
    last_user: Option<String>,
    last_assistant: Option<String>,
    /// Tool calls may still land on an assistant message after a newer user message.
    late: bool,
}

impl Driver {
    fn new(o: SessionOverrides, late: bool) -> Driver {
        Driver {
            s: open(o.clone()),
            o,
            late,
            next: 0,
            now: NOW,
            last_user: None,
            last_assistant: None,
        }
    }

    fn id(&mut self, prefix: &str) -> String {
        self.next += 1;
        format!("{prefix}{}", self.next)
    }

    fn step(&mut self, u: Update) -> Vec<Event> {
        self.now += 1;
        step(&mut self.s, u.clone(), &cfg(), self.now)
            .unwrap_or_else(|e| panic!("{u:?} rejected: {e}"))
            .events
    }

    fn run(&mut self, op: &Op) -> Result<(), TestCaseError> {
        match *op {
            Op::User { code, attach } => {
                let id = self.id("u");
                self.step(Update::UpsertMessage(user(&id)));
                let say = if code > 0 {
                    format!(
                        "Look:\n```rust\n{}```\nok?",
                        "let v = 1;\n".repeat(code.into())
                    )
                } else {
                    "Go on.".to_string()
                };
                let t = self.id("t");
                self.step(Update::UpsertPart(text(&id, &t, &say)));
                if attach == 1 {
                    let f = self.id("f");
                    let p = file(&id, &f, "shot.png", "image/png", &png(6_000));
                    self.step(Update::UpsertPart(p));
                } else if attach == 2 {
                    let y = self.id("y");
                    let body = format!(
                        "<path>/repo/NOTES.md</path>\n<type>file</type>\n<content>{}",
                        "n".repeat(2_000)
                    );
                    self.step(Update::UpsertPart(synthetic(&id, &y, &body)));
                    let f = self.id("f");
                    let p = file(
                        &id,
                        &f,
                        "NOTES.md",
                        "text/plain",
                        &format!("data:text/plain,{}", "n".repeat(2_000)),
                    );
                    self.step(Update::UpsertPart(p));
                }
                self.last_user = Some(id);
                if !self.late {
                    self.last_assistant = None;
                }
            }
            Op::Assistant => {
                let Some(parent) = self.last_user.clone() else {
                    return Ok(());
                };
                let id = self.id("a");
                let mut info = assistant(&id, &parent);
                info.finish.clear();
                self.step(Update::UpsertMessage(info));
                let st = self.id("s");
                self.step(Update::UpsertPart(step_start(&id, &st)));
                self.last_assistant = Some(id);
            }
            Op::Tool { pick, fail, size } => {
                let Some(msg) = self.last_assistant.clone() else {
                    return Ok(());
                };
                let id = self.id("p");
                let (tool_name, input, output) = pool(pick, size);
                let mut running = call(&msg, &id, tool_name, input.clone(), "");
                state_mut(&mut running).status = ToolStatus::Running;
                self.step(Update::UpsertPart(running));
                let last = if fail {
                    let error = stack_error("Error: command failed", usize::from(size / 40));
                    failed(&msg, &id, tool_name, input, &error)
                } else {
                    call(&msg, &id, tool_name, input, &output)
                };
                self.step(Update::UpsertPart(last));
            }
            Op::Text { chars: n } => {
                let Some(msg) = self.last_assistant.clone() else {
                    return Ok(());
                };
                let id = self.id("x");
                self.step(Update::UpsertPart(text(&msg, &id, &chars(n.into()))));
            }
            Op::StepFinish => {
                let Some(msg) = self.last_assistant.clone() else {
                    return Ok(());
                };
                let id = self.id("z");
                self.step(Update::UpsertPart(step_finish(&msg, &id)));
            }
            Op::Finish => {
                let Some(id) = self.last_assistant.take() else {
                    return Ok(());
                };
                let mut info = self.s.messages()[self.s.position(&id).expect("exists")]
                    .info
                    .clone();
                info.finish = "stop".into();
                let before = self.s.build_context();
                let events = self.step(Update::UpsertMessage(info));
                let report = events.into_iter().find_map(|e| match e {
                    Event::Pruned(r) => Some(r),
                    _ => None,
                });
                let after = self.s.build_context();
                check_run(&mut self.s, &before, &after, report.as_ref(), self.now)?;
            }
            Op::Commit => {
                self.now += 1;
                let dry = self.s.clone().prune(PruneMode::DryRun, self.now);
                let before = self.s.build_context();
                let total = self.s.total_tokens();
                let report = self.s.prune(PruneMode::Commit, self.now);
                let after = self.s.build_context();
                prop_assert_eq!(&dry.strategies, &report.strategies, "dry run vs commit");
                prop_assert_eq!(&dry.parts, &report.parts);
                // Prune's own saving and the strategies' add up to the whole reduction,
                // each token counted once (a dry run says the same, if prune would commit).
                check_run(&mut self.s, &before, &after, Some(&report), self.now)?;
                let own = if report.committed {
                    report.context_tokens_saved
                } else {
                    0
                };
                prop_assert_eq!(
                    total as i64 - self.s.total_tokens() as i64,
                    own + report.strategies.tokens() as i64,
                    "{:#?}",
                    report
                );
                if report.committed {
                    prop_assert_eq!(dry.context_tokens_saved, report.context_tokens_saved);
                }
            }
        }
        Ok(())
    }
}

/// The properties of one prune run, `before` and `after` being the context around it.
fn check_run(
    s: &mut Session,
    before: &ContextView,
    after: &ContextView,
    report: Option<&PruneReport>,
    now: i64,
) -> Result<(), TestCaseError> {
    // (a) No strategy makes the context larger: each marked part shrank by what the
    // report says, nothing else changed but outputs prune cleared.
    check_part_deltas(before, after, report.unwrap_or(&PruneReport::default()))
        .map_err(TestCaseError::fail)?;
    if !report.is_some_and(|r| r.committed) {
        prop_assert!(after.tokens <= before.tokens);
    }
    // (b) It never loses a message or a tool call: only contents are shortened.
    prop_assert_eq!(ids(before), ids(after));
    // (c) The running figures equal a recount from scratch.
    prop_assert_eq!(s.total_tokens(), rendered_tokens_from_scratch(s));
    prop_assert_eq!(after.tokens, view_tokens_from_parts(after));
    prop_assert_eq!(s.context_tokens(), after.tokens);
    // The report accounts for the delta.
    if let Some(r) = report {
        let run = &r.strategies;
        if !r.committed {
            prop_assert_eq!(before.tokens - after.tokens, run.tokens());
        }
        for m in &run.parts {
            let mark = find(s, &m.part_id).mark.expect("reported parts are marked");
            prop_assert_eq!(mark.time, now);
            prop_assert_eq!(mark.strategy, m.strategy);
        }
    }
    check_marks(s)?;
    // (d) Running again at once marks nothing new and changes nothing.
    let again = s.prune(PruneMode::Commit, now + 1);
    prop_assert!(again.strategies.parts.is_empty(), "{:?}", again.strategies);
    prop_assert_eq!(&s.build_context(), after);
    Ok(())
}

/// Every mark obeys the rules: age marks only outside the last 2 user turns and past
/// their threshold, nothing protected is marked (but todos), a supersede names a newer
/// call that exists.
fn check_marks(s: &Session) -> Result<(), TestCaseError> {
    let msgs = s.messages();
    let mut calls: BTreeMap<String, (usize, usize)> = BTreeMap::new();
    for (mi, m) in msgs.iter().enumerate() {
        for (pi, p) in m.parts.iter().enumerate() {
            if let PartKind::Tool(t) = &p.part.kind {
                calls.insert(t.call_id.clone(), (mi, pi));
            }
        }
    }
    for (mi, m) in msgs.iter().enumerate() {
        let newer_users = msgs[mi + 1..]
            .iter()
            .filter(|x| x.info.role == Role::User)
            .count();
        for (pi, p) in m.parts.iter().enumerate() {
            let Some(mark) = &p.part.mark else { continue };
            let st: St = mark.strategy;
            let threshold = match st {
                St::PruneFiles => Some(FILE_AGE_TURNS),
                St::TruncateOldErrors => Some(ERROR_AGE_TURNS),
                St::PruneUserCodeBlocks => Some(CODE_BLOCK_AGE_TURNS),
                _ => None,
            };
            if let Some(turns) = threshold {
                prop_assert!(newer_users >= turns.max(2), "{} aged too early", p.part.id);
                prop_assert!(mark.superseded_by.is_empty());
            } else {
                prop_assert!(st.supersedes(), "{st} marks nothing");
                let by = calls.get(&mark.superseded_by);
                prop_assert!(
                    by.is_some_and(|&at| at > (mi, pi)),
                    "{} superseded by {} which is not a newer call",
                    p.part.id,
                    mark.superseded_by
                );
            }
            if let PartKind::Tool(t) = &p.part.kind {
                prop_assert!(
                    st == St::SupersedeTodos || !s.settings().is_strategy_protected(&t.tool),
                    "protected {} marked by {st}",
                    t.tool
                );
            }
        }
    }
    Ok(())
}

fn small_prune(on: bool) -> SessionOverrides {
    if on {
        SessionOverrides {
            prune_protect: Some(300),
            prune_minimum: Some(0),
            ..Default::default()
        }
    } else {
        SessionOverrides::default()
    }
}

/// The final messages of a session as the host holds them: no marks, no stamps from
/// compactd's own prune.
fn final_messages(s: &Session) -> Vec<(MessageInfo, Vec<Part>)> {
    s.messages()
        .iter()
        .map(|m| {
            let parts = m
                .parts
                .iter()
                .map(|p| Part {
                    mark: None,
                    ..p.part.clone()
                })
                .collect();
            (m.info.clone(), parts)
        })
        .collect()
}

proptest! {
    // No regression files: they would be written outside this directory.
    #![proptest_config(ProptestConfig {
        cases: 96,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    /// After every commit (automatic or explicit), with OpenCode prune idle or busy.
    #[test]
    fn strategy_runs_never_grow_the_context_or_lose_a_call(
        busy_prune in any::<bool>(),
        ops in prop::collection::vec(op(), 1..80),
    ) {
        let mut d = Driver::new(small_prune(busy_prune), true);
        for op in &ops {
            d.run(op)?;
        }
        d.run(&Op::Commit)?;
    }

    /// Live (prune runs interleaved) and import (all at once, one prune) agree, parts
    /// arriving in position order (see the late-write test for the other case).
    #[test]
    fn live_and_import_end_with_the_same_marks_and_context(
        ops in prop::collection::vec(op(), 1..80),
    ) {
        let mut d = Driver::new(SessionOverrides::default(), false);
        for op in &ops {
            d.run(op)?;
        }
        d.run(&Op::Commit)?;
        // Default PRUNE_PROTECT/MINIMUM: OpenCode prune never commits at these sizes, so
        // the final parts carry no stamp of compactd's.
        prop_assert_eq!(d.s.compacted_count(), 0);
        let mut imported = import(&final_messages(&d.s), d.o.clone());
        imported.prune(PruneMode::Commit, NOW);
        prop_assert_eq!(marks(&imported), marks(&d.s));
        let (a, b) = (d.s.build_context(), imported.build_context());
        prop_assert_eq!(timeless(&a), timeless(&b));
        prop_assert_eq!(a.to_openai(), b.to_openai());
        prop_assert_eq!(d.s.total_tokens(), imported.total_tokens());
    }
}

/// Found in review: positions recorded before a non-tool part was deleted made the newest
/// read look older than the one before it.
#[test]
fn deleting_non_tool_parts_does_not_reorder_the_calls() {
    let body = file_body(30);
    let mut s = open(SessionOverrides::default());
    put(&mut s, Update::UpsertMessage(user("u1")));
    put(
        &mut s,
        Update::UpsertPart(text("u1", "u1_t", "Read x twice.")),
    );
    put(&mut s, Update::UpsertMessage(assistant("a1", "u1")));
    put(
        &mut s,
        Update::UpsertPart(text("a1", "t1", "thinking out loud")),
    );
    put(&mut s, Update::UpsertPart(text("a1", "t2", "more")));
    put(
        &mut s,
        Update::UpsertPart(read("a1", "r1", "src/x.rs", &body)),
    );
    for id in ["t1", "t2"] {
        put(
            &mut s,
            Update::DeletePart {
                message_id: "a1".into(),
                part_id: id.into(),
            },
        );
    }
    put(
        &mut s,
        Update::UpsertPart(read("a1", "r2", "src/x.rs", &body)),
    );
    commit(&mut s, NOW);
    expect_marks(&s, &[("r1", St::AggressiveFilePrune, "r2")]);
    let again = commit(&mut s, NOW);
    assert!(again.report.strategies.parts.is_empty());
}
