//! Property tests over random sessions.

use super::*;

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
    /// Pins or unpins an existing part (its whole message when `whole`).
    Pin {
        pick: u16,
        whole: bool,
        pinned: bool,
    },
    /// Deletes an existing part (a host's revert).
    Delete { pick: u16 },
    /// New settings: masking on or off, its `mask_keep`, and the strategy-protected tools
    /// (`protect` picks a list: the server's, `bash` and `read`, or none). The file
    /// strategies stay the run's ([`Driver::writes`]).
    Configure { mask: bool, keep: u8, protect: u8 },
}

const PATHS: [&str; 3] = ["src/main.rs", "src/lib.rs", "README.md"];
const URLS: [&str; 2] = ["https://docs.rs/tokio", "https://example.com/guide#intro"];
const COMMANDS: [&str; 3] = ["ls -la", "git status", "cargo test"];

/// Tool, input and output of pool entry `pick` (`size` shapes contents and outputs).
fn pool(pick: u8, size: u16) -> (&'static str, Value, String) {
    let n = usize::from(size);
    let path = |i: u8| {
        let p = PATHS[usize::from(i) % PATHS.len()];
        if size.is_multiple_of(3) {
            format!("./{p}")
        } else {
            p.to_string()
        }
    };
    let out = "o".repeat(n);
    match pick % 18 {
        // Every fifth a ranged read, which supersedes no write.
        i @ 0..=2 if size.is_multiple_of(5) => (
            "read",
            json!({ "filePath": path(i), "offset": 10 }),
            file_body(n / 30),
        ),
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
                if size.is_multiple_of(2) {
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
        1 => (any::<u16>(), prop::bool::weighted(0.3), prop::bool::weighted(0.7))
            .prop_map(|(pick, whole, pinned)| Op::Pin { pick, whole, pinned }),
        1 => any::<u16>().prop_map(|pick| Op::Delete { pick }),
        1 => (any::<bool>(), 0u8..6, 0u8..3)
            .prop_map(|(mask, keep, protect)| Op::Configure { mask, keep, protect }),
    ]
}

/// Builds a session op by op as a live host does, checking every prune run.
struct Driver {
    s: Session,
    next: usize,
    now: i64,
    last_user: Option<String>,
    last_assistant: Option<String>,
    /// Tool calls may still land on an assistant message after a newer user message.
    late: bool,
    /// `supersedeWrites` in place of `aggressiveFilePrune`, for the whole run: switching
    /// between two supersede strategies that both mark a part keeps the mark made first,
    /// which an import of the final messages need not make.
    writes: bool,
}

impl Driver {
    fn new(o: SessionOverrides, late: bool) -> Driver {
        let writes = o.strategies.get(&St::SupersedeWrites) == Some(&true);
        Driver {
            s: open(o),
            late,
            writes,
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
            Op::Pin {
                pick,
                whole,
                pinned,
            } => {
                let parts: Vec<&Part> = self
                    .s
                    .messages()
                    .iter()
                    .flat_map(|m| &m.parts)
                    .map(|p| &p.part)
                    .collect();
                if parts.is_empty() {
                    return Ok(());
                }
                let p = parts[usize::from(pick) % parts.len()];
                let update = Update::Pin {
                    message_id: p.message_id.clone(),
                    part_id: (!whole).then(|| p.id.clone()),
                    pinned,
                };
                // Unpinning a part only its message's pin covers is refused (it would
                // stay pinned), and changes nothing.
                if unpin_of_a_part_only_its_message_pins(&self.s, &update) {
                    let before = self.s.context_openai().json;
                    let refused = step(&mut self.s, update, &cfg(), self.now);
                    prop_assert!(refused.is_err(), "covered by the message's pin");
                    prop_assert_eq!(self.s.context_openai().json, before);
                    return Ok(());
                }
                self.step(update);
                prop_assert_eq!(self.s.total_tokens(), rendered_tokens_from_scratch(&self.s));
                check_marks(&self.s)?;
            }
            Op::Delete { pick } => {
                let parts: Vec<(String, String)> = self
                    .s
                    .messages()
                    .iter()
                    .flat_map(|m| &m.parts)
                    .map(|p| (p.part.message_id.clone(), p.part.id.clone()))
                    .collect();
                if parts.is_empty() {
                    return Ok(());
                }
                let (message_id, part_id) = parts[usize::from(pick) % parts.len()].clone();
                self.step(Update::DeletePart {
                    message_id,
                    part_id,
                });
                prop_assert_eq!(self.s.total_tokens(), rendered_tokens_from_scratch(&self.s));
                check_marks(&self.s)?;
            }
            Op::Configure {
                mask,
                keep,
                protect,
            } => {
                let tools = |list: &[&str]| Some(list.iter().map(|t| t.to_string()).collect());
                let config = SessionOverrides {
                    strategies: with_writes(self.writes, [(St::MaskObservations, mask)]),
                    mask_keep: Some(u32::from(keep)),
                    strategy_protected_tools: match protect {
                        0 => tools(crate::config::STRATEGY_PROTECTED_TOOLS),
                        1 => tools(&["bash", "read"]),
                        _ => tools(&[]),
                    },
                    ..Default::default()
                };
                self.step(Update::Configure(SessionInfo {
                    config,
                    ..Default::default()
                }));
                prop_assert_eq!(self.s.total_tokens(), rendered_tokens_from_scratch(&self.s));
                check_marks(&self.s)?;
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

/// Every mark obeys the rules: nothing pinned is marked; of the active marks, age marks
/// only outside the last 2 user turns and past their threshold, nothing protected is
/// marked (but todos), a supersede names a newer call that exists.
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
            prop_assert!(!s.is_pinned(mi, &p.part.id), "pinned {} marked", p.part.id);
            if !s.settings().strategies.has(mark.strategy) {
                continue; // inactive: checked once its strategy is on again
            }
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
            } else if st == St::MaskObservations {
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

/// [`marks`] of the strategies on.
fn active_marks(s: &Session) -> BTreeMap<String, (String, String)> {
    let on = s.settings().strategies;
    marks(s)
        .into_iter()
        .filter(|(_, (st, _))| st.parse::<St>().is_ok_and(|st| on.has(st)))
        .collect()
}

/// [`timeless`] without the inactive marks (those of strategies `s` has off).
fn active_view(v: &ContextView, s: &Session) -> ContextView {
    let mut v = timeless(v);
    for p in v.messages.iter_mut().flat_map(|m| &mut m.parts) {
        if p.part
            .mark
            .as_ref()
            .is_some_and(|m| !s.settings().strategies.has(m.strategy))
        {
            p.part.mark = None;
        }
    }
    v
}

/// The strategy switches `list`, and with `writes` compactd's default way with files:
/// `supersedeWrites` on, `aggressiveFilePrune` (which would cover it) off.
fn with_writes<const N: usize>(writes: bool, list: [(St, bool); N]) -> BTreeMap<St, bool> {
    let files = [
        (St::SupersedeWrites, writes),
        (St::AggressiveFilePrune, !writes),
    ];
    list.into_iter().chain(files).collect()
}

fn small_prune(on: bool, writes: bool) -> SessionOverrides {
    let strategies = with_writes(writes, []);
    if on {
        SessionOverrides {
            prune_protect: Some(300),
            prune_minimum: Some(0),
            strategies,
            ..Default::default()
        }
    } else {
        SessionOverrides {
            strategies,
            ..Default::default()
        }
    }
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
        writes in any::<bool>(),
        ops in prop::collection::vec(op(), 1..80),
    ) {
        let mut d = Driver::new(small_prune(busy_prune, writes), true);
        for op in &ops {
            d.run(op)?;
        }
        d.run(&Op::Commit)?;
    }

    /// Live (prune runs interleaved) and import (all at once, one prune) agree, parts
    /// arriving in position order (see the late-write test for the other case), whatever
    /// the host deleted and however the settings changed on the way (the import has the
    /// final ones).
    #[test]
    fn live_and_import_end_with_the_same_marks_and_context(
        writes in any::<bool>(),
        ops in prop::collection::vec(op(), 1..80),
    ) {
        let masking = SessionOverrides {
            strategies: with_writes(writes, [(St::MaskObservations, true)]),
            mask_keep: Some(3),
            ..Default::default()
        };
        let mut d = Driver::new(masking, false);
        // An import carries no pins.
        for op in ops.iter().filter(|op| !matches!(op, Op::Pin { .. })) {
            d.run(op)?;
        }
        d.run(&Op::Commit)?;
        // Default PRUNE_PROTECT/MINIMUM: OpenCode prune never commits at these sizes, so
        // the final parts carry no stamp of compactd's.
        prop_assert_eq!(d.s.compacted_count(), 0);
        let mut imported = import(&final_messages(&d.s), d.s.info().config.clone());
        imported.prune(PruneMode::Commit, NOW);
        // A mark whose strategy was switched off stays on its part, unread (it applies
        // again when switched on): only the active ones are what the session decides.
        prop_assert_eq!(active_marks(&imported), active_marks(&d.s));
        let (a, b) = (d.s.build_context(), imported.build_context());
        prop_assert_eq!(active_view(&a, &d.s), active_view(&b, &imported));
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
