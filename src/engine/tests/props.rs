//! Property tests: random sessions built update by update (users, assistants with tool
//! calls of random sizes and statuses incl. the protected `skill`, summaries, compaction
//! parts, pre-compacted outputs, late edits of old parts, deletions, settings changes,
//! usage reports, commits, pins), checked after the updates against the seed's rules.

use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

use super::*;
use crate::engine::step;

/// One thing a host does to a session.
#[derive(Debug, Clone)]
enum Op {
    /// A user message, with a text part of `text` chars and maybe a compaction part.
    User { text: u16, compaction: bool },
    /// An unfinished assistant message answering the last user message, opening with
    /// `lead` non-tool parts (step-start, reasoning) as OpenCode's do.
    Assistant { summary: bool, lead: u8 },
    /// A tool part on the last assistant message.
    Tool {
        tool: u8,
        status: u8,
        chars: u16,
        compacted: bool,
    },
    /// A text part on the last message.
    Text { chars: u16 },
    /// The last assistant message finishes (automatic prune runs).
    Finish,
    /// A late rewrite of an existing tool part (status, output, compacted stamp).
    Retool {
        pick: usize,
        status: u8,
        chars: u16,
        compacted: bool,
    },
    /// Deletes an existing part (a non-tool one when `non_tool` and the run allows it).
    Delete { pick: usize, non_tool: bool },
    /// Flips `summary` on an existing assistant message.
    ToggleSummary { pick: usize },
    /// Changes the prune settings.
    Configure { protect: u8, minimum: u8, turns: u8 },
    /// A provider usage report.
    Usage { tokens: u32 },
    /// An explicit prune commit.
    Commit,
    /// Pins or unpins an existing part (its whole message when `whole`).
    Pin {
        pick: usize,
        whole: bool,
        pinned: bool,
    },
}

const TOOLS: [&str; 4] = ["read", "bash", "grep", "skill"];
const PROTECT: [u64; 5] = [0, 20, 50, 100, 200];
const MINIMUM: [u64; 4] = [0, 50, 150, 400];
const TURNS: [u32; 5] = [2, 2, 1, 3, 0];
/// Stamp of the probing commits on copies (no driver stamp is ever this large).
const PROBE: i64 = i64::MAX - 7;

fn status(n: u8) -> ToolStatus {
    match n % 6 {
        0..=2 => ToolStatus::Completed,
        3 => ToolStatus::Pending,
        4 => ToolStatus::Running,
        _ => ToolStatus::Error,
    }
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0u16..40, prop::bool::weighted(0.1))
            .prop_map(|(text, compaction)| Op::User { text, compaction }),
        3 => (prop::bool::weighted(0.06), 0u8..3)
            .prop_map(|(summary, lead)| Op::Assistant { summary, lead }),
        12 => (any::<u8>(), any::<u8>(), 0u16..800, prop::bool::weighted(0.05)).prop_map(
            |(tool, status, chars, compacted)| Op::Tool { tool, status, chars, compacted }
        ),
        2 => (0u16..80).prop_map(|chars| Op::Text { chars }),
        3 => Just(Op::Finish),
        2 => (any::<usize>(), any::<u8>(), 0u16..800, prop::bool::weighted(0.2)).prop_map(
            |(pick, status, chars, compacted)| Op::Retool { pick, status, chars, compacted }
        ),
        3 => (any::<usize>(), any::<bool>())
            .prop_map(|(pick, non_tool)| Op::Delete { pick, non_tool }),
        1 => any::<usize>().prop_map(|pick| Op::ToggleSummary { pick }),
        1 => (any::<u8>(), any::<u8>(), any::<u8>())
            .prop_map(|(protect, minimum, turns)| Op::Configure { protect, minimum, turns }),
        1 => (0u32..3_000).prop_map(|tokens| Op::Usage { tokens }),
        3 => Just(Op::Commit),
        2 => (any::<usize>(), prop::bool::weighted(0.3), prop::bool::weighted(0.7))
            .prop_map(|(pick, whole, pinned)| Op::Pin { pick, whole, pinned }),
    ]
}

/// Ops, each with whether to check the invariants right after it (checking syncs the
/// index; skipping lets it catch up over several updates at once).
fn ops() -> impl Strategy<Value = Vec<(Op, bool)>> {
    prop::collection::vec((op(), prop::bool::weighted(0.7)), 1..64)
}

fn overrides(protect: u8, minimum: u8, turns: u8) -> SessionOverrides {
    SessionOverrides {
        prune_protect: Some(PROTECT[protect as usize % PROTECT.len()]),
        prune_minimum: Some(MINIMUM[minimum as usize % MINIMUM.len()]),
        protect_turns: Some(TURNS[turns as usize % TURNS.len()]),
        ..Default::default()
    }
}

/// Runs ops against a session the way the server does (through `step`).
struct Driver {
    s: Session,
    next: usize,
    now: i64,
    last_user: String,
    last_assistant: Option<String>,
    /// Delete any part (text, compaction, ...), not only tool parts.
    delete_any: bool,
}

impl Driver {
    fn new(protect: u8, minimum: u8, delete_any: bool) -> Self {
        let limits = ModelLimits {
            context: 4_000,
            input: 0,
            output: 500,
        };
        Driver {
            s: new_session(overrides(protect, minimum, 0), limits),
            next: 0,
            now: 1_000,
            last_user: String::new(),
            last_assistant: None,
            delete_any,
        }
    }

    fn id(&mut self, prefix: &str) -> String {
        self.next += 1;
        format!("{prefix}{}", self.next)
    }

    fn step(&mut self, u: Update) {
        step(&mut self.s, u.clone(), &config(), self.now)
            .unwrap_or_else(|e| panic!("{u:?} rejected: {e}"));
    }

    fn tool_parts(&self) -> Vec<Part> {
        self.parts()
            .into_iter()
            .filter(|p| matches!(p.kind, PartKind::Tool(_)))
            .collect()
    }

    fn parts(&self) -> Vec<Part> {
        self.s
            .messages()
            .iter()
            .flat_map(|m| &m.parts)
            .map(|p| p.part.clone())
            .collect()
    }

    fn run(&mut self, op: &Op) {
        self.now += 1;
        match *op {
            Op::User {
                text: n,
                compaction: c,
            } => {
                let id = self.id("u");
                self.step(Update::UpsertMessage(user(&id)));
                if n > 0 {
                    let pid = self.id("t");
                    self.step(Update::UpsertPart(text(&id, &pid, &chars(n.into()))));
                }
                if c {
                    let pid = self.id("c");
                    self.step(Update::UpsertPart(compaction(&id, &pid)));
                }
                self.last_user = id;
            }
            Op::Assistant { summary: sum, lead } => {
                let id = self.id("a");
                let mut info = if sum {
                    summary(&id, &self.last_user)
                } else {
                    assistant(&id, &self.last_user)
                };
                info.finish.clear();
                self.step(Update::UpsertMessage(info));
                if lead > 0 {
                    let pid = self.id("s");
                    self.step(Update::UpsertPart(step_start(&id, &pid)));
                }
                if lead > 1 {
                    let pid = self.id("r");
                    self.step(Update::UpsertPart(text(&id, &pid, "thinking")));
                }
                self.last_assistant = Some(id);
            }
            Op::Tool {
                tool: t,
                status: st,
                chars: n,
                compacted,
            } => {
                let Some(msg) = self.last_assistant.clone() else {
                    return;
                };
                let pid = self.id("p");
                let mut p = tool_in(
                    &msg,
                    &pid,
                    TOOLS[t as usize % TOOLS.len()],
                    status(st),
                    &chars(n.into()),
                );
                // OpenCode only has `time.compacted` on completed calls.
                if compacted && status(st) == ToolStatus::Completed {
                    state_mut(&mut p).time.compacted = Some(1);
                }
                self.step(Update::UpsertPart(p));
            }
            Op::Text { chars: n } => {
                let Some(msg) = self.s.messages().last().map(|m| m.info.id.clone()) else {
                    return;
                };
                let pid = self.id("t");
                self.step(Update::UpsertPart(text(&msg, &pid, &chars(n.into()))));
            }
            Op::Finish => {
                let Some(id) = self.last_assistant.clone() else {
                    return;
                };
                let mut info = self.s.messages()[self.s.position(&id).unwrap()]
                    .info
                    .clone();
                info.finish = "stop".into();
                self.step(Update::UpsertMessage(info));
            }
            Op::Retool {
                pick,
                status: st,
                chars: n,
                compacted,
            } => {
                let parts = self.tool_parts();
                if parts.is_empty() {
                    return;
                }
                let mut p = parts[pick % parts.len()].clone();
                let state = state_mut(&mut p);
                state.status = status(st);
                state.output = chars(n.into());
                state.time.compacted =
                    (compacted && state.status == ToolStatus::Completed).then_some(self.now);
                self.step(Update::UpsertPart(p));
            }
            Op::Delete { pick, non_tool } => {
                let parts: Vec<Part> = match (self.delete_any, non_tool) {
                    (true, true) => self
                        .parts()
                        .into_iter()
                        .filter(|p| !matches!(p.kind, PartKind::Tool(_)))
                        .collect(),
                    (true, false) => self.parts(),
                    (false, _) => self.tool_parts(),
                };
                if parts.is_empty() {
                    return;
                }
                let p = &parts[pick % parts.len()];
                self.step(Update::DeletePart {
                    message_id: p.message_id.clone(),
                    part_id: p.id.clone(),
                });
            }
            Op::ToggleSummary { pick } => {
                let assistants: Vec<MessageInfo> = self
                    .s
                    .messages()
                    .iter()
                    .filter(|m| m.info.role == Role::Assistant)
                    .map(|m| m.info.clone())
                    .collect();
                if assistants.is_empty() {
                    return;
                }
                let mut info = assistants[pick % assistants.len()].clone();
                info.summary = !info.summary;
                self.step(Update::UpsertMessage(info));
            }
            Op::Configure {
                protect,
                minimum,
                turns,
            } => {
                self.step(Update::Configure(SessionInfo {
                    id: "ses_test".into(),
                    config: overrides(protect, minimum, turns),
                    ..Default::default()
                }));
            }
            Op::Usage { tokens } => {
                self.step(Update::ReportUsage {
                    message_id: None,
                    tokens: crate::domain::TokenUsage {
                        input: tokens.into(),
                        ..Default::default()
                    },
                });
            }
            Op::Commit => {
                self.s.prune(PruneMode::Commit, self.now);
            }
            Op::Pin {
                pick,
                whole,
                pinned,
            } => {
                let parts = self.parts();
                if parts.is_empty() {
                    return;
                }
                let p = &parts[pick % parts.len()];
                let update = Update::Pin {
                    message_id: p.message_id.clone(),
                    part_id: (!whole).then(|| p.id.clone()),
                    pinned,
                };
                // Unpinning a part only its message's pin covers is refused (it would
                // stay pinned), and changes nothing.
                if unpin_of_a_part_only_its_message_pins(&self.s, &update) {
                    let before = self.s.context_openai().json;
                    let e = step(&mut self.s, update, &config(), self.now)
                        .expect_err("covered by the message's pin");
                    assert_eq!(e.field, "part_id", "{e}");
                    assert_eq!(self.s.context_openai().json, before);
                } else {
                    self.step(update);
                }
            }
        }
    }
}

/// Every invariant, after an update.
fn check_invariants(s: &mut Session) -> Result<(), TestCaseError> {
    // The incremental index equals the seed's literal scan.
    let want = reference(s);
    let plan = index_plan(s);
    prop_assert_eq!(&plan, &want, "index vs reference_scan");

    // The plan obeys the seed, stated without the reference scan.
    let settings = s.settings().clone();
    let end = eligible_end(s.users(), s.messages().len(), settings.protect_turns);
    for c in &plan.prune {
        let end = end.expect("candidates only exist in an eligible region");
        prop_assert!(c.msg <= end);
        let stored = &s.messages()[c.msg].parts[c.part];
        let PartKind::Tool(t) = &stored.part.kind else {
            return Err(TestCaseError::fail(format!("{c:?} is not a tool part")));
        };
        prop_assert_eq!(t.state.status, ToolStatus::Completed);
        prop_assert_eq!(t.state.time.compacted, None);
        prop_assert!(!settings.is_protected_tool(&t.tool), "protected {}", t.tool);
        prop_assert!(
            !s.is_pinned(c.msg, &stored.part.id),
            "pinned {}",
            stored.part.id
        );
        prop_assert_eq!(c.tokens, CharsPerToken.count(&t.state.output));
        // Not in the last `protect_turns` user turns: that many user messages from here on.
        let users_from_here = s.messages()[c.msg..]
            .iter()
            .filter(|m| m.info.role == Role::User)
            .count();
        prop_assert!(
            users_from_here >= settings.protect_turns as usize,
            "{} is in the last {} turns",
            stored.part.id,
            settings.protect_turns
        );
        // Never older than a summary (up to the eligible end).
        prop_assert!(
            !s.messages()[c.msg + 1..=end]
                .iter()
                .any(|m| m.info.role == Role::Assistant && m.info.summary),
            "{} is older than a summary",
            stored.part.id
        );
    }
    prop_assert!(plan.protected <= settings.prune_protect);
    if let Some(newest) = plan.prune.last() {
        prop_assert!(plan.protected + newest.tokens > settings.prune_protect);
    }
    prop_assert_eq!(
        plan.pruned,
        plan.prune.iter().map(|c| c.tokens).sum::<u64>()
    );

    // A pinned part reads verbatim: no prune stamp, no strategy mark.
    for (mi, m) in s.messages().iter().enumerate() {
        for p in m.parts.iter().filter(|p| s.is_pinned(mi, &p.part.id)) {
            prop_assert!(!p.is_compacted() && p.part.mark.is_none(), "{:?}", p.part);
        }
    }

    // Running figures equal a recount from scratch.
    prop_assert_eq!(s.total_tokens(), tokens_from_scratch(s));
    prop_assert_eq!(s.held_bytes(), s.held_bytes_from_scratch());
    let parts: Vec<&crate::engine::StoredPart> =
        s.messages().iter().flat_map(|m| &m.parts).collect();
    prop_assert_eq!(s.part_count(), parts.len());
    prop_assert_eq!(
        s.compacted_count(),
        parts.iter().filter(|p| p.is_compacted()).count()
    );
    let view = s.build_context();
    prop_assert_eq!(view.tokens, view_tokens_from_parts(&view));

    // Dry run = commit, and a second commit changes nothing (on a copy).
    let mut a = s.clone();
    let before = a.messages().to_vec();
    let dry = a.prune(PruneMode::DryRun, PROBE);
    prop_assert_eq!(&a.messages(), &before, "a dry run changed the session");
    let commit = a.prune(PruneMode::Commit, PROBE);
    prop_assert_eq!(
        (&dry.parts, dry.tokens_saved, dry.tokens_scanned),
        (&commit.parts, commit.tokens_saved, commit.tokens_scanned)
    );
    prop_assert_eq!(
        commit.committed,
        commit.tokens_saved > settings.prune_minimum
    );
    let marked = if commit.committed {
        part_ids(&commit)
    } else {
        vec![]
    };
    prop_assert_eq!(compacted_at(&a, PROBE), marked);
    prop_assert_eq!(
        without_stamps(&a, PROBE),
        before,
        "commit changed more than stamps"
    );
    prop_assert_eq!(a.total_tokens(), tokens_from_scratch(&a));
    let after = a.messages().to_vec();
    let second = a.prune(PruneMode::Commit, PROBE);
    prop_assert!(!second.committed);
    prop_assert_eq!(
        &a.messages(),
        &after,
        "the second commit changed the session"
    );
    let want = reference(&a);
    prop_assert_eq!(
        index_plan(&mut a),
        want,
        "index vs reference after a commit"
    );
    Ok(())
}

fn run(
    protect: u8,
    minimum: u8,
    ops: &[(Op, bool)],
    delete_any: bool,
) -> Result<(), TestCaseError> {
    let mut d = Driver::new(protect, minimum, delete_any);
    for (op, check) in ops {
        d.run(op);
        if *check {
            check_invariants(&mut d.s)?;
        }
    }
    check_invariants(&mut d.s)
}

proptest! {
    // No regression files: they would be written outside this directory.
    #![proptest_config(ProptestConfig {
        cases: 128,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    /// Deletions of tool parts only.
    #[test]
    fn prune_invariants_hold_after_every_update(
        protect in any::<u8>(),
        minimum in any::<u8>(),
        ops in ops(),
    ) {
        run(protect, minimum, &ops, false)?;
    }

    /// Deletions of any part (text, reasoning, compaction parts too).
    #[test]
    fn prune_invariants_hold_when_any_part_is_deleted(
        protect in any::<u8>(),
        minimum in any::<u8>(),
        ops in ops(),
    ) {
        run(protect, minimum, &ops, true)?;
    }
}
