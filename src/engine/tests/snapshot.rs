//! Snapshots and the change log: a session encoded and decoded is the same session (its
//! context, figures, recall and everything it decides later), a change log replayed on a
//! snapshot rebuilds the live session exactly, and damaged input is an error, never a
//! panic. The fixtures `data/snapshot_v<N>.json` pin the formats (see `snapshot.rs`).

use proptest::prelude::*;
use serde_json::json;

use super::*;
use crate::config::{CacheModel, StrategySet};
use crate::domain::{MessageTime, StepFinishPart, TokenUsage};
use crate::engine::{
    Change, CommitIds, CompactionRequest, Document, Performed, RecallKey, SNAPSHOT_FORMAT,
    SnapshotError, SummaryOutcome, TailOptions, Trigger, decode_change, decode_session,
    encode_change, encode_session,
};

/// The clock of the scenario's first message.
const T0: i64 = 1_705_000_000_000;

/// How much smaller than the tests' scenario the fixture's is (sizes and limits divided).
const FIXTURE_SCALE: u64 = 4;

thread_local! {
    /// The scale of the scenario being built or replayed on this thread (1: full size).
    static SCALE: std::cell::Cell<u64> = const { std::cell::Cell::new(1) };
}

/// `n` divided by the current scale.
fn sized(n: u64) -> u64 {
    n / SCALE.with(|s| s.get())
}

/// Runs `f` with the scenario `scale` times smaller.
fn at_scale<T>(scale: u64, f: impl FnOnce() -> T) -> T {
    SCALE.with(|s| s.set(scale));
    let out = f();
    SCALE.with(|s| s.set(1));
    out
}

/// Strategies on (the `compactd` preset), Anthropic's cache model (so the scheduler holds
/// decisions), a small prune window.
fn rich_config() -> EngineConfig {
    EngineConfig {
        prune_protect: sized(300),
        prune_minimum: sized(100),
        mask_keep: 3,
        strategies: StrategySet::default(),
        cache_model: CacheModel::ANTHROPIC,
        tokenizer: crate::tokens::Tokenizer::Chars4,
        ..EngineConfig::default()
    }
}

fn rich_info() -> SessionInfo {
    SessionInfo {
        id: "ses_snap".into(),
        title: "snapshot test".into(),
        limits: ModelLimits {
            context: sized(12_000),
            input: 0,
            output: sized(2_000),
        },
        ..Default::default()
    }
}

fn fresh() -> Session {
    Session::new(rich_info(), &rich_config())
}

/// Encodes and decodes `s`.
fn round_trip(s: &Session) -> Session {
    decode_session(&encode_session(s)).unwrap_or_else(|e| panic!("decode failed: {e}"))
}

/// What a host can observe of a session, compared whole.
#[derive(Debug, PartialEq)]
struct Observed {
    context: crate::engine::ContextView,
    messages: Vec<crate::engine::Message>,
    total_tokens: u64,
    context_tokens: u64,
    compacted: usize,
    parts: usize,
    overflow: crate::engine::OverflowCheck,
    auto: crate::engine::AutoState,
    recall: Vec<Option<crate::engine::Recalled>>,
    held: usize,
}

fn observe(s: &Session) -> Observed {
    let recall = s
        .messages()
        .iter()
        .flat_map(|m| &m.parts)
        .map(|p| s.recall(&RecallKey::PartId(p.part.id.clone())))
        .collect();
    let mut context = s.build_context();
    context.messages = without_bytes(&context.messages);
    Observed {
        context,
        messages: without_bytes(s.messages()),
        total_tokens: s.total_tokens(),
        context_tokens: s.context_tokens(),
        compacted: s.compacted_count(),
        parts: s.part_count(),
        overflow: s.check_overflow(Trigger::Request),
        auto: s.auto_state(),
        recall,
        held: s.tracker_pending(),
    }
}

/// The messages with each part's byte figure cleared: it describes the part's allocation,
/// which a decoder makes differently (the restored figure is checked against a recount).
fn without_bytes(messages: &[crate::engine::Message]) -> Vec<crate::engine::Message> {
    let mut messages = messages.to_vec();
    for p in messages.iter_mut().flat_map(|m| &mut m.parts) {
        p.bytes = 0;
    }
    messages
}

/// Asserts two sessions are the same: observably and in every stored figure.
pub(crate) fn assert_same(a: &Session, b: &Session, what: &str) {
    // Compared as text: a NaN cost is not equal to itself.
    let (x, y) = (format!("{:#?}", observe(a)), format!("{:#?}", observe(b)));
    if let Some((i, (l, r))) = x
        .lines()
        .zip(y.lines())
        .enumerate()
        .find(|(_, (l, r))| l != r)
    {
        let from = i.saturating_sub(12);
        let context: Vec<&str> = x.lines().skip(from).take(i - from).collect();
        panic!(
            "{what}: line {i} differs:\n{}\n< {l}\n> {r}",
            context.join("\n")
        );
    }
    assert_eq!(x, y, "{what}");
    assert_eq!(
        String::from_utf8_lossy(&encode_session(a)),
        String::from_utf8_lossy(&encode_session(b)),
        "{what}: stored state"
    );
}

fn msg(id: &str, role: Role, parent: &str, created: i64) -> MessageInfo {
    let mut m = MessageInfo::new(id, role);
    m.parent_id = parent.into();
    m.time = MessageTime {
        created,
        completed: None,
    };
    m.agent = "build".into();
    m
}

fn tool_call(
    m: &str,
    id: &str,
    name: &str,
    input: serde_json::Value,
    status: ToolStatus,
    out: &str,
) -> Part {
    let mut p = tool_in(m, id, name, status, out);
    if let PartKind::Tool(t) = &mut p.kind {
        t.state.input = input;
    }
    p
}

fn usage(input: u64, output: u64) -> TokenUsage {
    TokenUsage {
        input,
        output,
        cache_read: input / 2,
        ..Default::default()
    }
}

/// A scenario of changes, performed on a driver session as it is built (the compaction's
/// plan is made from the session as it is then): messages and tool calls that supersede,
/// mask and cap each other, parallel calls completing out of order, usage reports, pins
/// and unpins, a deleted part, a settings change, held decisions, explicit prunes, a
/// compaction, its recorded outcome, a failure, a refused update and a cold cache.
fn scenario() -> Vec<Change> {
    let config = rich_config();
    let mut live = fresh();
    let mut changes = Vec::new();
    let mut push = |live: &mut Session, c: Change| {
        live.perform(c.clone(), &config);
        changes.push(c);
    };
    let step = |update: Update, now_ms: i64| Change::Step { update, now_ms };
    let mut t = T0;
    push(&mut live, step(Update::Configure(rich_info()), t));
    for turn in 0..9 {
        t += 20_000;
        if turn == 7 {
            t += 400_000; // the cache has gone cold
        }
        let u = format!("u{turn}");
        let a = format!("a{turn}");
        push(
            &mut live,
            step(Update::UpsertMessage(msg(&u, Role::User, "", t)), t),
        );
        let body = if turn % 3 == 0 {
            format!(
                "look at this\n```rust\n{}\n```\n",
                chars(sized(400) as usize)
            )
        } else {
            format!("turn {turn} {}", chars(40))
        };
        push(
            &mut live,
            step(Update::UpsertPart(text(&u, &format!("{u}_t"), &body)), t),
        );
        push(
            &mut live,
            step(
                Update::UpsertMessage(msg(&a, Role::Assistant, &u, t + 1)),
                t + 1,
            ),
        );
        push(
            &mut live,
            step(Update::UpsertPart(step_start(&a, &format!("{a}_s"))), t + 1),
        );
        let read = tool_call(
            &a,
            &format!("{a}_read"),
            "read",
            json!({"filePath": "src/main.rs"}),
            ToolStatus::Completed,
            &chars(sized(1200 + turn as u64 * 40) as usize),
        );
        push(&mut live, step(Update::UpsertPart(read), t + 2));
        // Two parallel calls, the second completing first.
        let (p1, p2) = (format!("{a}_ls"), format!("{a}_big"));
        for (id, name) in [(&p1, "bash"), (&p2, "grep")] {
            let input = json!({"command": "ls -la", "pattern": format!("x{turn}"), "path": "."});
            push(
                &mut live,
                step(
                    Update::UpsertPart(tool_call(&a, id, name, input, ToolStatus::Running, "")),
                    t + 3,
                ),
            );
        }
        let input = json!({"command": "ls -la", "pattern": format!("x{turn}"), "path": "."});
        push(
            &mut live,
            step(
                Update::UpsertPart(tool_call(
                    &a,
                    &p2,
                    "grep",
                    input.clone(),
                    ToolStatus::Completed,
                    &chars(sized(9000) as usize),
                )),
                t + 4,
            ),
        );
        let status = if turn == 2 {
            ToolStatus::Error
        } else {
            ToolStatus::Completed
        };
        push(
            &mut live,
            step(
                Update::UpsertPart(tool_call(
                    &a,
                    &p1,
                    "bash",
                    input,
                    status,
                    &chars(sized(800) as usize),
                )),
                t + 5,
            ),
        );
        let mut finish = step_start(&a, &format!("{a}_f"));
        finish.kind = PartKind::StepFinish(StepFinishPart {
            reason: "stop".into(),
            snapshot: String::new(),
            cost: if turn == 4 {
                f64::NAN
            } else {
                0.001 * turn as f64
            },
            tokens: Some(usage(sized(2000 + 900 * turn as u64), 50)),
        });
        push(&mut live, step(Update::UpsertPart(finish), t + 6));
        let mut done = msg(&a, Role::Assistant, &u, t + 1);
        done.finish = "stop".into();
        done.time.completed = Some(t + 7);
        done.tokens = Some(usage(sized(2000 + 900 * turn as u64), 50));
        done.cost = if turn == 5 { f64::INFINITY } else { 0.25 };
        push(&mut live, step(Update::UpsertMessage(done), t + 7));
        match turn {
            1 => {
                push(
                    &mut live,
                    step(
                        Update::Pin {
                            message_id: a.clone(),
                            part_id: Some(format!("{a}_read")),
                            pinned: true,
                        },
                        t + 8,
                    ),
                );
                push(
                    &mut live,
                    step(
                        Update::ReportUsage {
                            message_id: Some(a.clone()),
                            tokens: usage(sized(5000), 80),
                        },
                        t + 8,
                    ),
                );
            }
            2 => {
                push(
                    &mut live,
                    step(
                        Update::Pin {
                            message_id: u.clone(),
                            part_id: None,
                            pinned: true,
                        },
                        t + 8,
                    ),
                );
                // Refused: the message does not exist (changes nothing).
                push(
                    &mut live,
                    step(Update::UpsertPart(text("nope", "x", "y")), t + 8),
                );
            }
            3 => {
                push(
                    &mut live,
                    step(
                        Update::DeletePart {
                            message_id: a.clone(),
                            part_id: format!("{a}_s"),
                        },
                        t + 8,
                    ),
                );
                push(&mut live, Change::Prune { now_ms: t + 8 });
            }
            4 => {
                let mut info = rich_info();
                info.config.mask_keep = Some(2);
                push(&mut live, step(Update::Configure(info), t + 8));
                push(
                    &mut live,
                    step(
                        Update::Pin {
                            message_id: "a1".into(),
                            part_id: Some("a1_read".into()),
                            pinned: false,
                        },
                        t + 8,
                    ),
                );
            }
            5 => {
                let plan = live
                    .plan_compaction(CompactionRequest {
                        tail: TailOptions {
                            turns: 2,
                            max_tokens: sized(6_000),
                        },
                        auto: true,
                        overflow: true,
                    })
                    .expect("something to compact");
                let outcome = SummaryOutcome {
                    text: "We read main.rs and listed files.".into(),
                    usage: Some(usage(sized(3000), 40)),
                    cost: f64::NEG_INFINITY,
                    model: None,
                };
                let ids = CommitIds {
                    prefix: "cmp1".into(),
                };
                push(
                    &mut live,
                    logged(Change::CommitCompaction {
                        plan,
                        outcome,
                        ids,
                        now_ms: t + 8,
                    }),
                );
                push(
                    &mut live,
                    Change::RecordCompaction {
                        auto: true,
                        ok: true,
                    },
                );
            }
            6 => push(
                &mut live,
                Change::RecordCompaction {
                    auto: true,
                    ok: false,
                },
            ),
            _ => push(&mut live, Change::Prune { now_ms: t + 8 }),
        }
    }
    // The prior the store gives a session its model's sessions taught (after the
    // fixture's point, which it leaves as it was).
    push(
        &mut live,
        Change::CalibrationPrior {
            factors: [1.6, 0.9, 1.1, 1.0, 0.5],
        },
    );
    changes
}

/// `c` as the change log holds it (encoded and decoded). The scenario is replayed on
/// other session values than the one it was built on, as a restore replays the log: a
/// live compaction plan names the session value it was made on, and its commit on
/// another value is stale; the logged plan carries no such name.
fn logged(c: Change) -> Change {
    decode_change(&encode_change(&c)).unwrap_or_else(|e| panic!("the change decodes: {e}"))
}

/// The scenario performed from a fresh session, with each change's result.
fn perform_all(changes: &[Change]) -> (Session, Vec<Performed>) {
    let mut s = fresh();
    let results = changes
        .iter()
        .map(|c| s.perform(c.clone(), &rich_config()))
        .collect();
    (s, results)
}

#[test]
fn the_scenario_reaches_every_kind_of_state() {
    let changes = scenario();
    let (s, results) = perform_all(&changes);
    let parts: Vec<&Part> = s
        .messages()
        .iter()
        .flat_map(|m| &m.parts)
        .map(|p| &p.part)
        .collect();
    assert!(parts.iter().any(|p| p.mark.is_some()), "a strategy mark");
    assert!(
        s.compacted_count() > 0
            || parts
                .iter()
                .any(|p| matches!(&p.kind, PartKind::Tool(t) if t.state.time.compacted.is_some())),
        "a prune stamp"
    );
    assert!(
        s.build_context().boundary_message_id.is_some(),
        "a compaction"
    );
    assert!(!s.pins().is_empty(), "a pin");
    assert!(s.usage().last().is_some(), "usage");
    assert!(results.iter().any(|r| !r.changed()), "a refused change");
    // Held decisions at some point of the scenario.
    let mut live = fresh();
    let held = changes.iter().any(|c| {
        live.perform(c.clone(), &rich_config());
        live.tracker_pending() > 0
    });
    assert!(held, "the scheduler held decisions");
}

#[test]
fn a_decoded_session_is_the_session_at_every_point() {
    let changes = scenario();
    let config = rich_config();
    let mut live = fresh();
    assert_same(&live, &round_trip(&live), "a fresh session");
    for (i, c) in changes.iter().enumerate() {
        live.perform(c.clone(), &config);
        let restored = round_trip(&live);
        assert_same(
            &live,
            &restored,
            &format!("after change {i} ({})", c.kind()),
        );
        assert_eq!(
            restored.held_bytes_from_scratch(),
            restored.held_bytes(),
            "held bytes after change {i}"
        );
    }
}

#[test]
fn a_restored_session_goes_on_exactly_like_the_live_one() {
    let changes = scenario();
    let config = rich_config();
    for cut in (0..=changes.len()).step_by(7).chain([changes.len()]) {
        let mut live = fresh();
        for c in &changes[..cut] {
            live.perform(c.clone(), &config);
        }
        let mut restored = round_trip(&live);
        for (i, c) in changes[cut..].iter().enumerate() {
            let a = live.perform(c.clone(), &config);
            let b = restored.perform(c.clone(), &config);
            assert_eq!(a, b, "cut {cut}, change {} ({})", cut + i, c.kind());
        }
        assert_same(&live, &restored, &format!("cut {cut}"));
    }
}

#[test]
fn a_snapshot_and_its_log_replay_to_the_live_session() {
    let changes = scenario();
    let config = rich_config();
    for start in [0, 5, changes.len() / 2] {
        let mut live = fresh();
        for c in &changes[..start] {
            live.perform(c.clone(), &config);
        }
        let snapshot = encode_session(&live);
        // The store's side: encode, perform, log what changed.
        let mut log = Vec::new();
        for c in &changes[start..] {
            let bytes = encode_change(c);
            if live.perform(c.clone(), &config).changed() {
                log.push(bytes);
            }
        }
        let mut replayed = decode_session(&snapshot).expect("snapshot");
        for bytes in &log {
            let change = decode_change(bytes).expect("change");
            assert!(
                replayed.perform(change, &config).changed(),
                "a logged change replays"
            );
        }
        assert_same(&live, &replayed, &format!("log from {start}"));
    }
}

#[test]
fn a_commit_whose_continue_id_is_taken_changes_nothing() {
    // The commit's third message (auto compaction) must be checked like the first two:
    // otherwise a refused commit is not "unchanged" and a logged replay could differ.
    let changes = scenario();
    let at = changes
        .iter()
        .position(|c| matches!(c, Change::CommitCompaction { .. }))
        .expect("a commit");
    let (mut s, _) = perform_all(&changes[..at]);
    let mut taken = msg("cmp1_continue", Role::Assistant, "u0", T0);
    taken.finish = "stop".into();
    s.perform(
        Change::Step {
            update: Update::UpsertMessage(taken),
            now_ms: T0,
        },
        &rich_config(),
    );
    let before = encode_session(&s);
    let r = s.perform(changes[at].clone(), &rich_config());
    assert!(
        matches!(r, Performed::CommitCompaction(Err(_))) && !r.changed(),
        "{r:?}"
    );
    assert_eq!(
        encode_session(&s),
        before,
        "a refused commit changes nothing"
    );
}

#[test]
fn every_change_round_trips() {
    for c in scenario() {
        let back = decode_change(&encode_change(&c)).expect("decodes");
        // NaN costs are not equal to themselves: compare the encodings.
        assert_eq!(encode_change(&back), encode_change(&c));
    }
}

#[test]
fn a_dry_run_on_a_dirty_tracker_leaves_the_session_as_replay_sees_it() {
    // The live session answers dry runs (not logged); the replayed one never saw them.
    let changes = scenario();
    let config = rich_config();
    let mut live = fresh();
    let mut replayed = fresh();
    for (i, c) in changes.iter().enumerate() {
        live.perform(c.clone(), &config);
        let _ = live.prune(PruneMode::DryRun, T0);
        replayed.perform(c.clone(), &config);
        assert_same(
            &live,
            &replayed,
            &format!("after change {i} ({})", c.kind()),
        );
    }
}

#[test]
fn the_encoding_is_versioned_and_deterministic() {
    let (s, _) = perform_all(&scenario());
    let bytes = encode_session(&s);
    assert_eq!(
        bytes,
        encode_session(&s.clone()),
        "the same session, the same bytes"
    );
    let v: serde_json::Value = serde_json::from_slice(&bytes).expect("json");
    assert_eq!(v["format"], json!(SNAPSHOT_FORMAT));
    assert_eq!(v["session"]["info"]["id"], json!("ses_snap"));
    let c: serde_json::Value =
        serde_json::from_slice(&encode_change(&Change::Prune { now_ms: 5 })).expect("json");
    assert_eq!(
        c,
        json!({"format": SNAPSHOT_FORMAT, "change": {"prune": {"now_ms": 5}}})
    );
}

#[test]
fn unknown_formats_and_damaged_documents_are_named_errors() {
    let (s, _) = perform_all(&scenario());
    let bytes = encode_session(&s);
    let mut v: serde_json::Value = serde_json::from_slice(&bytes).expect("json");
    v["format"] = json!(SNAPSHOT_FORMAT + 1);
    let err = decode_session(&serde_json::to_vec(&v).expect("json")).expect_err("newer");
    assert!(
        matches!(
            err,
            SnapshotError::UnknownFormat {
                what: Document::Session,
                found
            } if found == u64::from(SNAPSHOT_FORMAT + 1)
        ),
        "{err}"
    );
    assert!(
        err.to_string()
            .contains(&format!("format {}", SNAPSHOT_FORMAT + 1)),
        "{err}"
    );
    v["format"] = json!(0);
    let err = decode_session(&serde_json::to_vec(&v).expect("json")).expect_err("zero");
    assert!(
        matches!(err, SnapshotError::UnknownFormat { found: 0, .. }),
        "{err}"
    );

    // The format may follow the payload (hand-written documents).
    let reordered = format!(
        r#"{{"session":{},"format":{SNAPSHOT_FORMAT}}}"#,
        serde_json::to_string(&v["session"]).expect("json")
    );
    let back = decode_session(reordered.as_bytes()).expect("reordered");
    assert_same(&back, &s, "reordered");

    let err = decode_session(&bytes[..bytes.len() / 2]).expect_err("truncated");
    assert!(
        matches!(
            err,
            SnapshotError::Decode {
                format: Some(f),
                ..
            } if f == u64::from(SNAPSHOT_FORMAT)
        ),
        "{err}"
    );
    let err = decode_session(br#"{"session":{}}"#).expect_err("no format");
    assert!(err.to_string().contains("format"), "{err}");
    let err = decode_change(br#"{"format":1,"session":{}}"#).expect_err("wrong kind");
    assert!(err.to_string().contains("logged change"), "{err}");

    // Well-formed but inconsistent: a pin past the messages.
    let mut bad = v.clone();
    bad["format"] = json!(SNAPSHOT_FORMAT);
    bad["session"]["pins"]["messages"] = json!([100_000]);
    let err = decode_session(&serde_json::to_vec(&bad).expect("json")).expect_err("pin");
    assert!(matches!(err, SnapshotError::Inconsistent { .. }), "{err}");
    let mut bad = v.clone();
    bad["format"] = json!(SNAPSHOT_FORMAT);
    bad["session"]["boundary"] = json!({"start": 0, "summary": 100_000});
    let err = decode_session(&serde_json::to_vec(&bad).expect("json")).expect_err("boundary");
    assert!(matches!(err, SnapshotError::Inconsistent { .. }), "{err}");
}

/// The fixture's scenario ([`FIXTURE_SCALE`] times smaller) and where the fixture is
/// taken: after the compaction and its outcome (messages, tool parts, prune stamps,
/// strategy marks, a pin, a compaction and usage).
fn fixture_scenario() -> (Vec<Change>, usize) {
    let changes = at_scale(FIXTURE_SCALE, scenario);
    let at = changes
        .iter()
        .position(|c| matches!(c, Change::RecordCompaction { .. }))
        .expect("the scenario compacts")
        + 1;
    (changes, at)
}

const FIXTURE: &str = include_str!("data/snapshot_v3.json");
const FIXTURE_V2: &str = include_str!("data/snapshot_v2.json");
/// The format 3 fixture as written before masking waited for a step's results to reach
/// the model (it masked one of a5's three results at once): the rule the format 2
/// fixture was written under, so the session it migrates to.
const FIXTURE_V3_MASKED_EARLY: &str = include_str!("data/snapshot_v3_masked_early.json");
const FIXTURE_V1: &str = include_str!("data/snapshot_v1.json");
/// The format 3 fixture as the binaries before stop 58 wrote it: calibrated with every
/// report weighing alike, and without `reordered` (a field written only when set).
const FIXTURE_V3_BEFORE_58: &str = include_str!("data/snapshot_v3_before_58.json");
/// The format 3 fixture as the binaries before stop 59 wrote it: a compaction's commit
/// left the decisions the scheduler held (a prune) for a later request to apply.
const FIXTURE_V3_BEFORE_59: &str = include_str!("data/snapshot_v3_before_59.json");
/// The format 3 fixture as the binaries before stop 70 wrote it: the default strategies
/// had no `supersedeWrites`, and the tracker no `writes` state.
const FIXTURE_V3_BEFORE_70: &str = include_str!("data/snapshot_v3_before_70.json");

/// A format 3 document an older binary wrote still decodes, reads the fields added
/// since as they were before them, and goes on through the rest of the scenario with
/// its figures equal to a recount.
#[test]
fn an_older_format_3_fixture_still_decodes_and_goes_on() {
    assert!(!FIXTURE_V3_BEFORE_58.contains("reordered"));
    for (name, fixture) in [
        ("before 58", FIXTURE_V3_BEFORE_58),
        ("before 59", FIXTURE_V3_BEFORE_59),
        ("before 70", FIXTURE_V3_BEFORE_70),
    ] {
        let mut restored = decode_session(fixture.as_bytes())
            .unwrap_or_else(|e| panic!("the fixture {name} no longer decodes: {e}"));
        assert!(
            !restored.request_log().is_reordered() || fixture.contains("reordered"),
            "{name}: absent reads as before"
        );
        assert!(restored.build_context().boundary_message_id.is_some());
        let (changes, at) = fixture_scenario();
        at_scale(FIXTURE_SCALE, || {
            for c in &changes[at..] {
                // Whatever each change's outcome under today's rules: never a panic.
                let _ = restored.perform(c.clone(), &rich_config());
            }
        });
        assert_eq!(restored.held_bytes(), restored.held_bytes_from_scratch());
        assert_eq!(
            restored.total_tokens(),
            rendered_tokens_from_scratch(&restored),
            "{name}"
        );
    }
}

#[test]
fn snapshot_fixture_v3_decodes_to_the_same_context() {
    // Regenerate (with a format bump, or when the engine's behaviour changes what the
    // scenario stores: keep the replaced fixture as `snapshot_v3_before_<stop>.json`,
    // decoded by `an_older_format_3_fixture_still_decodes_and_goes_on`):
    // COMPACTD_WRITE_FIXTURE=1 cargo test --lib snapshot_fixture.
    let (changes, at) = fixture_scenario();
    let s = at_scale(FIXTURE_SCALE, || perform_all(&changes[..at]).0);
    if std::env::var_os("COMPACTD_WRITE_FIXTURE").is_some() {
        let v: serde_json::Value = serde_json::from_slice(&encode_session(&s)).expect("json");
        let pretty = serde_json::to_string_pretty(&v).expect("json") + "\n";
        std::fs::write(
            concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/src/engine/tests/data/snapshot_v3.json"
            ),
            pretty,
        )
        .expect("write the fixture");
        return;
    }
    // If this fails, the engine's stored state changed: bump SNAPSHOT_FORMAT, add a
    // migration from format 3 (snapshot.rs), keep this fixture decoding through it and
    // add the new format's fixture.
    let restored = decode_session(FIXTURE.as_bytes())
        .unwrap_or_else(|e| panic!("the format 3 fixture no longer decodes: {e}"));
    assert_same(&restored, &s, "the fixture's session");
    let parts: Vec<&Part> = restored
        .messages()
        .iter()
        .flat_map(|m| &m.parts)
        .map(|p| &p.part)
        .collect();
    assert!(parts.iter().any(|p| p.mark.is_some()), "a strategy mark");
    assert!(
        parts
            .iter()
            .any(|p| matches!(&p.kind, PartKind::Tool(t) if t.state.time.compacted.is_some())),
        "a prune stamp"
    );
    assert!(!restored.pins().is_empty(), "a pin");
    assert!(
        restored.build_context().boundary_message_id.is_some(),
        "a compaction"
    );
    assert!(
        restored.usage().last().is_some() || restored.totals().usage().delta() != 0,
        "usage"
    );
    // And it goes on like the live session.
    let (mut live, mut restored) = (s, restored);
    go_on_alike(&mut live, &mut restored, &changes[at..]);
    assert_same(&live, &restored, "after the rest of the scenario");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Truncated, overwritten or random bytes: an error, never a panic.
    #[test]
    fn damaged_snapshots_are_errors_not_panics(
        cut in 0usize..100_000,
        flips in proptest::collection::vec((0usize..100_000, any::<u8>()), 0..8),
        noise in proptest::collection::vec(any::<u8>(), 0..256),
    ) {
        let bytes = FIXTURE.as_bytes();
        let mut damaged = bytes[..cut % (bytes.len() + 1)].to_vec();
        for (at, b) in &flips {
            if !damaged.is_empty() {
                let i = at % damaged.len();
                damaged[i] = *b;
            }
        }
            let _ = decode_session(&damaged);
        let _ = decode_session(&noise);
        let _ = decode_change(&damaged);
        let _ = decode_change(&noise);
    }

    /// Well-formed JSON with the wrong types or values in any one place: an error or a
    /// session that still answers every query (never a panic).
    #[test]
    fn retyped_fields_are_errors_not_panics(pick in 0usize..10_000, kind in 0u8..6) {
        let mut v: serde_json::Value = serde_json::from_str(FIXTURE).expect("json");
        let mut paths = Vec::new();
        collect_paths(&v, &mut Vec::new(), &mut paths);
        let path = &paths[pick % paths.len()];
        let slot = path.iter().fold(&mut v, |v, k| match k {
            Key::Field(f) => &mut v[f.as_str()],
            Key::Index(i) => &mut v[*i],
        });
        *slot = match kind {
            0 => json!(null),
            1 => json!("text"),
            2 => json!(-1),
            3 => json!(u64::MAX),
            4 => json!([]),
            _ => json!({}),
        };
        let bytes = serde_json::to_vec(&v).expect("json");
        let decoded = decode_session(&bytes);
        // A value of the right type but out of range is not checked beyond positions:
        // only wrong types must leave a session that still works.
        if let (Ok(mut s), 0 | 1 | 4 | 5) = (decoded, kind) {
            let _ = observe(&s);
            let _ = s.prune(PruneMode::Commit, T0);
            let _ = s.perform(Change::Step { update: Update::UpsertMessage(user("zz")), now_ms: T0 }, &rich_config());
        }
    }
}

enum Key {
    Field(String),
    Index(usize),
}

/// Every path to a value in `v`.
fn collect_paths(v: &serde_json::Value, at: &mut Vec<Key>, out: &mut Vec<Vec<Key>>) {
    let copy = |at: &Vec<Key>| {
        at.iter()
            .map(|k| match k {
                Key::Field(f) => Key::Field(f.clone()),
                Key::Index(i) => Key::Index(*i),
            })
            .collect()
    };
    out.push(copy(at));
    match v {
        serde_json::Value::Object(m) => {
            for (k, v) in m {
                at.push(Key::Field(k.clone()));
                collect_paths(v, at, out);
                at.pop();
            }
        }
        serde_json::Value::Array(a) => {
            for (i, v) in a.iter().enumerate() {
                at.push(Key::Index(i));
                collect_paths(v, at, out);
                at.pop();
            }
        }
        _ => {}
    }
}

/// Performs `changes` on both sessions (at the fixture's scale), checking each gives
/// both the same outcome.
fn go_on_alike(a: &mut Session, b: &mut Session, changes: &[Change]) {
    at_scale(FIXTURE_SCALE, || {
        for c in changes {
            let config = rich_config();
            assert_eq!(a.perform(c.clone(), &config), b.perform(c.clone(), &config));
        }
    });
}

/// An older format's fixture `text` (format `format`): its JSON, to compare the stored
/// figures with, and the session it decodes to.
fn old_fixture(text: &str, format: u32) -> (serde_json::Value, Session) {
    let raw = serde_json::from_str(text).expect("json");
    let restored = decode_session(text.as_bytes())
        .unwrap_or_else(|e| panic!("the format {format} fixture no longer decodes: {e}"));
    (raw, restored)
}

/// A format 2 session (written before reasoning was a class of its own) migrates: its
/// figures and what its calibration learned stay, the new class starts neutral, and it
/// goes on like the session the scenario builds today.
#[test]
fn snapshot_fixture_v2_migrates() {
    let (raw, restored) = old_fixture(FIXTURE_V2, 2);
    let stored = &raw["session"]["totals"];
    assert_eq!(json!(restored.total_tokens()), stored["tokens"]);
    let c = restored.calibration();
    let factors = c.factors();
    assert_eq!(json!(factors[..4]), stored["calibration"]["factors"]);
    assert_eq!(
        factors[4],
        crate::engine::calibration::NEUTRAL[4],
        "reasoning starts at the neutral prior"
    );
    assert_eq!(
        json!(c.observations()),
        stored["calibration"]["observations"]
    );
    let mut by = [0i64; 5];
    for (slot, class) in by.iter_mut().zip(crate::engine::calibration::Class::ALL) {
        *slot = restored.totals().usage().delta_by().get(class);
    }
    assert_eq!(json!(by[..4]), stored["usage"]["delta_by"]);
    assert_eq!(by[4], 0);
    // The format 3 fixture of the same rules is the same session: the same context, and
    // the same decisions from here on. Its calibration is taken from the format 2
    // session: that one learned under older rules (it also learned from the compaction's
    // own usage report, which no longer teaches anything).
    let mut v3: serde_json::Value = serde_json::from_str(FIXTURE_V3_MASKED_EARLY).expect("json");
    let migrated: serde_json::Value =
        serde_json::from_slice(&encode_session(&restored)).expect("json");
    v3["session"]["totals"]["calibration"] = migrated["session"]["totals"]["calibration"].clone();
    let current =
        decode_session(&serde_json::to_vec(&v3).expect("json")).expect("the format 3 fixture");
    assert_eq!(restored.build_context(), current.build_context());
    let (changes, at) = fixture_scenario();
    let (mut restored, mut current) = (restored, current);
    go_on_alike(&mut restored, &mut current, &changes[at..]);
    assert_eq!(restored.held_bytes(), restored.held_bytes_from_scratch());
}

/// A format 2 document whose class arrays are longer than format 3's is refused, naming
/// the field.
#[test]
fn a_format_2_session_with_too_many_classes_is_refused() {
    let mut v: serde_json::Value = serde_json::from_str(FIXTURE_V2).expect("json");
    v["session"]["totals"]["usage"]["delta_by"] = json!([0, 0, 0, 0, 0, 0]);
    let err = decode_session(&serde_json::to_vec(&v).expect("json")).expect_err("six classes");
    assert!(
        matches!(err, SnapshotError::Migration { from: 2, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("totals.usage.delta_by"), "{err}");
}

/// A format 1 session (written before sessions had a tokenizer and a calibration)
/// migrates: it keeps counting with chars ÷ 4, so its stored estimates stay true, its
/// figures are the ones it was written with, and it goes on taking updates. (Its later
/// decisions may differ from a session built today: the prediction is calibrated now.)
#[test]
fn snapshot_fixture_v1_migrates() {
    let (raw, restored) = old_fixture(FIXTURE_V1, 1);
    let stored = &raw["session"]["totals"];
    assert_eq!(
        restored.settings().tokenizer,
        crate::tokens::Tokenizer::Chars4
    );
    assert_eq!(restored.counter().name(), "chars/4");
    assert_eq!(json!(restored.total_tokens()), stored["tokens"]);
    assert_eq!(
        json!(restored.totals().usage().delta()),
        stored["usage"]["delta"],
        "the usage figures move to the by-class form whole"
    );
    assert_eq!(restored.calibration().observations(), 0);
    let messages = raw["session"]["messages"].as_array().map_or(0, Vec::len);
    assert_eq!(restored.messages().len(), messages);
    let (changes, at) = fixture_scenario();
    let mut restored = restored;
    at_scale(FIXTURE_SCALE, || {
        for c in &changes[at..] {
            // Whatever it decides, it decides without a panic or an inconsistency.
            let _ = restored.perform(c.clone(), &rich_config());
        }
    });
    assert!(restored.messages().len() > messages);
    assert_eq!(restored.held_bytes(), restored.held_bytes_from_scratch());
}

/// The encoder (sonic-rs) writes exactly the bytes serde_json would, for every change of
/// the scenario and the session after each: the decoders, the fixtures and the README's
/// `sqlite3` inspection all read serde_json's JSON.
#[test]
fn snapshots_and_changes_encode_as_serde_json_would() {
    use crate::engine::snapshot::encode_with_serde_json;
    let config = rich_config();
    let mut live = fresh();
    for (i, c) in scenario().iter().enumerate() {
        assert_eq!(
            String::from_utf8_lossy(&encode_change(c)),
            String::from_utf8_lossy(&encode_with_serde_json(Document::Change, c)),
            "change {i} ({})",
            c.kind()
        );
        live.perform(c.clone(), &config);
        assert_eq!(
            String::from_utf8_lossy(&encode_session(&live)),
            String::from_utf8_lossy(&encode_with_serde_json(Document::Session, &live)),
            "session after change {i}"
        );
    }
}
