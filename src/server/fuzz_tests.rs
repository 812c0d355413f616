//! Property-based fuzzing of every decoder a client reaches through the server (issue 13):
//! protobuf bytes → `pb::ClientUpdate` → `request::decode_update` → `engine::step` on a
//! real session, as the store's actor runs it.
//!
//! Each target asserts: no panic; a refusal is a clean [`Rejection`] (a code a client can
//! act on, a message, the field at fault); a refusal by the engine leaves the session
//! exactly as it was (its whole `Debug` form, every private field included, is compared
//! before and after); an accepted update keeps the byte figure equal to a recount and the
//! session readable back by a protobuf client (`GetSession` and the context event encode
//! and decode again).
//!
//! Bounded for CI: each target runs a fixed number of cases, multiplied by the environment
//! variable `COMPACTD_FUZZ_CASES` for longer runs (`COMPACTD_FUZZ_CASES=100 cargo test
//! --lib fuzz_ -- --nocapture`), and prints `fuzz <target>: <cases> cases in <secs> s`.
//! A failure prints the shrunk input; `PROPTEST_RNG_SEED` replays a run.

use std::sync::LazyLock;

use proptest::collection::{btree_map, hash_map, vec};
use proptest::option;
use proptest::prelude::*;
use proptest::sample::select;
use proptest::test_runner::TestCaseError;
use prost::Message as _;
use prost_types::value::Kind;
use tonic::Code;

use super::convert;
use super::pb;
use super::pb::client_update::Update as U;
use super::reply::ContextBody;
use super::request::{DEFAULT_MAX_UPDATE_BYTES, Op, decode_update};
use super::status::Rejection;
use crate::config::{EngineConfig, Strategy as Named};
use crate::domain::{MAX_ID_BYTES, MAX_JSON_DEPTH};
use crate::engine::{self, ByteLimit, ContextCache, PruneMode, Session, Trigger, Update};

// The harness (`fuzz`, `Tally`) is shared with the integration targets.
#[path = "../../tests/fuzz/harness.rs"]
mod harness;
use harness::{Tally, fuzz};

// ---- the session every case starts from ------------------------------------------------

const SID: &str = "ses_fuzz";
/// The clock of every case (epoch ms).
const NOW: i64 = 1_705_512_345_678;
/// Message ids of the base session, and two it does not hold yet.
const MESSAGES: [&str; 6] = ["u1", "a1", "u2", "a2", "m_new", "a_new"];
/// Part ids of the base session, and two it does not hold yet.
const PARTS: [&str; 8] = ["t1", "s1", "p1", "t2", "t3", "p2", "x_new", "y_new"];
const TOOLS: [&str; 9] = [
    "read",
    "bash",
    "grep",
    "skill",
    "edit",
    "task",
    "todowrite",
    "browser_snapshot",
    "compactd_recall",
];

/// The server defaults, every strategy and the prompt-cache model on (the most code).
fn config() -> &'static EngineConfig {
    static CONFIG: LazyLock<EngineConfig> = LazyLock::new(EngineConfig::default);
    &CONFIG
}

fn text_part(id: &str, message_id: &str, text: &str) -> pb::Part {
    pb::Part {
        id: id.into(),
        message_id: message_id.into(),
        kind: Some(pb::part::Kind::Text(pb::TextPart {
            text: text.into(),
            ..Default::default()
        })),
        ..Default::default()
    }
}

fn tool_part(id: &str, message_id: &str, tool: &str, status: &str, output: &str) -> pb::Part {
    let input = prost_types::Struct {
        fields: [(
            "filePath".to_string(),
            prost_types::Value {
                kind: Some(Kind::StringValue("src/lib.rs".into())),
            },
        )]
        .into(),
    };
    pb::Part {
        id: id.into(),
        message_id: message_id.into(),
        kind: Some(pb::part::Kind::Tool(pb::ToolPart {
            call_id: format!("call_{id}"),
            tool: tool.into(),
            state: Some(pb::ToolState {
                status: status.into(),
                input: Some(input),
                output: output.into(),
                time: Some(pb::ToolTime {
                    start: NOW - 10,
                    end: Some(NOW - 5),
                    compacted: None,
                }),
                ..Default::default()
            }),
            metadata: None,
        })),
        ..Default::default()
    }
}

fn message(id: &str, role: &str, parent: &str, finish: &str) -> pb::MessageInfo {
    pb::MessageInfo {
        id: id.into(),
        role: role.into(),
        parent_id: parent.into(),
        finish: finish.into(),
        time: Some(pb::MessageTime {
            created: NOW - 100,
            completed: (!finish.is_empty()).then_some(NOW - 50),
        }),
        ..Default::default()
    }
}

fn update(u: U) -> pb::ClientUpdate {
    pb::ClientUpdate {
        seq: 1,
        session_id: SID.into(),
        update: Some(u),
    }
}

/// The base session's history: an open, two turns, a finished assistant message with a
/// completed tool call and a usage report, an unfinished one with a running call.
fn history() -> Vec<pb::ClientUpdate> {
    let open = pb::SessionInfo {
        id: SID.into(),
        title: "fuzz".into(),
        limits: Some(pb::ModelLimits {
            context: 12_000,
            input: 0,
            output: 2_000,
        }),
        config: Some(pb::SessionConfig {
            threshold: Some(0.9),
            prune_protect: Some(200),
            prune_minimum: Some(100),
            protect_turns: Some(1),
            protected_tools: Some(pb::StringList {
                values: vec!["skill".into()],
            }),
            strategies: [("supersedeDuplicates".to_string(), true)].into(),
            cache_model: "anthropic".into(),
            ..Default::default()
        }),
        ..Default::default()
    };
    vec![
        update(U::Open(open)),
        update(U::UpsertMessage(message("u1", "user", "", ""))),
        update(U::UpsertPart(text_part("t1", "u1", "read the file"))),
        update(U::UpsertMessage(message("a1", "assistant", "u1", ""))),
        update(U::UpsertPart(pb::Part {
            id: "s1".into(),
            message_id: "a1".into(),
            kind: Some(pb::part::Kind::StepStart(pb::StepStartPart::default())),
            ..Default::default()
        })),
        update(U::UpsertPart(tool_part(
            "p1",
            "a1",
            "read",
            "completed",
            &"fn main() {}\n".repeat(200),
        ))),
        update(U::UpsertPart(text_part("t2", "a1", "done"))),
        update(U::UpsertMessage(message("a1", "assistant", "u1", "stop"))),
        update(U::ReportUsage(pb::UsageReport {
            message_id: "a1".into(),
            tokens: Some(pb::TokenUsage {
                input: 900,
                output: 20,
                cache: Some(pb::CacheTokens {
                    read: 100,
                    write: 50,
                }),
                ..Default::default()
            }),
        })),
        update(U::UpsertMessage(message("u2", "user", "", ""))),
        update(U::UpsertPart(text_part("t3", "u2", "again"))),
        update(U::UpsertMessage(message("a2", "assistant", "u2", ""))),
        update(U::UpsertPart(tool_part("p2", "a2", "bash", "running", ""))),
    ]
}

/// Valid updates of every kind the stream takes that are not in [`history`] (every other
/// part kind, deletes, pins, the requests): run after the history.
fn more() -> Vec<pb::ClientUpdate> {
    let kinds: Vec<pb::part::Kind> = vec![
        pb::part::Kind::Reasoning(pb::ReasoningPart {
            text: "thinking".into(),
            ..Default::default()
        }),
        pb::part::Kind::StepStart(pb::StepStartPart {
            snapshot: "abc".into(),
        }),
        pb::part::Kind::StepFinish(pb::StepFinishPart {
            reason: "stop".into(),
            cost: 0.01,
            tokens: Some(pb::TokenUsage {
                input: 10,
                output: 5,
                ..Default::default()
            }),
            ..Default::default()
        }),
        pb::part::Kind::File(pb::FilePart {
            mime: "text/plain".into(),
            filename: "a.txt".into(),
            url: "file:///a.txt".into(),
            size: 3,
            ..Default::default()
        }),
        pb::part::Kind::Snapshot(pb::SnapshotPart {
            snapshot: "def".into(),
        }),
        pb::part::Kind::Patch(pb::PatchPart {
            hash: "h".into(),
            files: vec!["a.txt".into()],
        }),
        pb::part::Kind::Agent(pb::AgentPart {
            name: "build".into(),
            source: None,
        }),
        pb::part::Kind::Subtask(pb::SubtaskPart {
            prompt: "p".into(),
            description: "d".into(),
            agent: "general".into(),
            ..Default::default()
        }),
        pb::part::Kind::Retry(pb::RetryPart {
            attempt: 1,
            error: Some(prost_types::Struct::default()),
            created: NOW,
        }),
        pb::part::Kind::Compaction(pb::CompactionPart {
            auto: true,
            ..Default::default()
        }),
    ];
    let mut out: Vec<pb::ClientUpdate> = kinds
        .into_iter()
        .enumerate()
        .map(|(i, kind)| {
            update(U::UpsertPart(pb::Part {
                id: format!("k{i}"),
                message_id: "a2".into(),
                kind: Some(kind),
                ..Default::default()
            }))
        })
        .collect();
    out.extend([
        update(U::DeletePart(pb::PartRef {
            message_id: "a1".into(),
            part_id: "t2".into(),
        })),
        update(U::Pin(pb::PinUpdate {
            message_id: "a1".into(),
            part_id: "p1".into(),
            pinned: Some(true),
        })),
        update(U::GetContext(pb::ContextOptions { format: 0 })),
        update(U::Prune(pb::PruneOptions { dry_run: true })),
        update(U::CheckOverflow(pb::CheckOverflowOptions {})),
        update(U::Compact(pb::CompactOptions {
            instructions: "keep the plan".into(),
            tail_turns: Some(1),
            ..Default::default()
        })),
        update(U::CancelCompaction(pb::CancelCompaction {})),
    ]);
    out
}

/// A valid update of every kind (and every part kind): the seeds of the mutated bytes.
fn corpus() -> Vec<pb::ClientUpdate> {
    let mut all = history();
    all.extend(more());
    all
}

/// The session every case starts from: two turns, a finished assistant message with a
/// completed tool call, an unfinished one with a running call, settings from an open.
fn base() -> &'static Session {
    static BASE: LazyLock<Session> = LazyLock::new(|| {
        let updates = history();
        let info = match decode_update(
            updates[0].clone(),
            updates[0].encoded_len(),
            DEFAULT_MAX_UPDATE_BYTES,
        ) {
            Ok(Op::Open(info)) => *info,
            other => panic!("the base open decodes: {other:?}"),
        };
        let mut s = Session::new(info, config());
        for u in updates.into_iter().skip(1) {
            let update = match decode_update(u.clone(), u.encoded_len(), DEFAULT_MAX_UPDATE_BYTES) {
                Ok(Op::Apply(update)) => *update,
                other => panic!("{u:?} decodes: {other:?}"),
            };
            engine::step(&mut s, update, config(), NOW).expect("the base history applies");
        }
        assert_eq!(s.messages().len(), 4);
        s
    });
    &BASE
}

// ---- the checks ------------------------------------------------------------------------

/// A refusal a client can act on: a code among those the API documents for updates, a
/// message, and the field at fault (only a size limit may name none).
fn check_rejection(r: &Rejection, codes: &[Code]) -> Result<(), TestCaseError> {
    prop_assert!(codes.contains(&r.code), "unexpected code in {r:?}");
    prop_assert!(!r.message.trim().is_empty(), "no message in {r:?}");
    prop_assert!(
        !r.field.is_empty() || r.code == Code::ResourceExhausted,
        "no field in {r:?}"
    );
    // As the stream reports it.
    let event = pb::Error::from(r.clone());
    prop_assert!(!event.code.is_empty() && event.message == r.message);
    Ok(())
}

const DECODE_CODES: [Code; 2] = [Code::InvalidArgument, Code::ResourceExhausted];
const APPLY_CODES: [Code; 4] = [
    Code::InvalidArgument,
    Code::NotFound,
    Code::FailedPrecondition,
    Code::ResourceExhausted,
];

/// The context in `format` from `cache` (kept across the session's updates), which must
/// read exactly as one rendered from nothing: no change leaves a stale rendering behind.
fn context_checked(
    s: &Session,
    cache: &mut ContextCache,
    format: pb::ContextFormat,
) -> Result<pb::Context, TestCaseError> {
    let n = s.messages().len();
    let cached = ContextBody::of(s, cache, format).into_pb(n);
    let fresh = ContextBody::of(s, &mut ContextCache::default(), format).into_pb(n);
    // As bytes: a NaN cost never equals itself.
    prop_assert!(
        cached.encode_to_vec() == fresh.encode_to_vec(),
        "the cached context differs from a fresh one"
    );
    Ok(cached)
}

/// What a protobuf client reads back of the session: `GetSession` and a context event
/// encode, and decode again with prost's default recursion limit.
fn check_readable(s: &Session, cache: &mut ContextCache) -> Result<(), TestCaseError> {
    let session = pb::GetSessionResponse {
        info: Some(convert::session_to_pb(s.info())),
        messages: s.messages().iter().map(convert::message_to_pb).collect(),
        summary: Some(convert::summary_to_pb(s, false)),
    };
    let bytes = session.encode_to_vec();
    let back = pb::GetSessionResponse::decode(bytes.as_slice());
    prop_assert!(back.is_ok(), "GetSession does not decode: {back:?}");
    let context = pb::ServerEvent {
        seq: 1,
        session_id: SID.into(),
        event: Some(pb::server_event::Event::Context(context_checked(
            s,
            cache,
            pb::ContextFormat::Unspecified,
        )?)),
    };
    let bytes = context.encode_to_vec();
    let back = pb::ServerEvent::decode(bytes.as_slice());
    prop_assert!(back.is_ok(), "the context event does not decode: {back:?}");
    Ok(())
}

/// Applies `update` as the actor does; a refusal must be clean and change nothing.
fn apply_checked(
    s: &mut Session,
    cache: &mut ContextCache,
    update: Update,
    t: &Tally,
) -> Result<(), TestCaseError> {
    let before = format!("{s:?}");
    match engine::step(s, update, config(), NOW) {
        Err(e) => {
            t.hit("refused by the engine");
            check_rejection(&Rejection::from(e.clone()), &APPLY_CODES)?;
            let after = format!("{s:?}");
            prop_assert!(before == after, "refused with {e} but the session changed");
        }
        Ok(report) => {
            t.hit("applied");
            if !report.events.is_empty() {
                t.hit("applied with events");
            }
            prop_assert_eq!(s.held_bytes(), s.held_bytes_from_scratch(), "byte figure");
            check_readable(s, cache)?;
        }
    }
    Ok(())
}

/// Decodes one update and runs what it asks for on `s`, as the stream would.
fn run_update(
    s: &mut Session,
    cache: &mut ContextCache,
    u: pb::ClientUpdate,
    max: usize,
    t: &Tally,
) -> Result<(), TestCaseError> {
    let len = u.encoded_len();
    let op = match decode_update(u, len, max) {
        Err(r) => {
            t.hit("refused by decode_update");
            return check_rejection(&r, &DECODE_CODES);
        }
        Ok(op) => op,
    };
    prop_assert!(!op.kind().is_empty());
    match op {
        Op::Apply(update) => apply_checked(s, cache, *update, t)?,
        // The store opens another id as a new session, and reconfigures this one.
        Op::Open(info) if info.id == s.info().id => {
            apply_checked(s, cache, Update::Configure(*info), t)?;
        }
        Op::Open(info) => {
            t.hit("opened another session");
            let fresh = Session::new(*info, config());
            check_readable(&fresh, &mut ContextCache::default())?;
        }
        Op::Context(format) => {
            t.hit("requests");
            context_checked(s, cache, format)?;
        }
        Op::Prune { dry_run } => {
            t.hit("requests");
            let mode = if dry_run {
                PruneMode::DryRun
            } else {
                PruneMode::Commit
            };
            let _ = convert::prune_to_pb(&s.prune(mode, NOW));
            prop_assert_eq!(s.held_bytes(), s.held_bytes_from_scratch(), "byte figure");
        }
        Op::CheckOverflow => {
            t.hit("requests");
            let _ = convert::overflow_to_pb(&s.check_overflow(Trigger::Request));
        }
        // The server's compaction machinery (an LLM), not a decoder: decoding is the check.
        Op::Compact(_) | Op::CancelCompaction => t.hit("requests"),
    }
    Ok(())
}

/// Runs `updates` on a copy of the base session, with a byte limit `slack` bytes above
/// what it holds when one is given (so the limit's refusals are reached too).
fn run_session(
    updates: Vec<pb::ClientUpdate>,
    slack: Option<u64>,
    max: usize,
    t: &Tally,
) -> Result<(), TestCaseError> {
    let mut s = base().clone();
    if let Some(slack) = slack {
        let bytes = s.held_bytes().saturating_add(slack);
        s.set_byte_limit(ByteLimit {
            bytes,
            name: "max_session_bytes",
            value: bytes,
        });
    }
    let mut cache = ContextCache::default();
    for u in updates {
        run_update(&mut s, &mut cache, u, max, t)?;
    }
    Ok(())
}

// ---- target a: bytes -------------------------------------------------------------------

/// One edit of an encoded update. Positions are taken modulo the length.
#[derive(Debug, Clone)]
enum Mutation {
    Flip {
        at: usize,
        bit: u8,
    },
    Set {
        at: usize,
        byte: u8,
    },
    Insert {
        at: usize,
        bytes: Vec<u8>,
    },
    Delete {
        at: usize,
        len: usize,
    },
    Truncate {
        at: usize,
    },
    /// Copies a run of the message over itself (repeated fields, merged oneofs).
    Repeat {
        from: usize,
        len: usize,
    },
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        4 => (any::<usize>(), 0u8..8).prop_map(|(at, bit)| Mutation::Flip { at, bit }),
        2 => (any::<usize>(), select(vec![0x00, 0x01, 0x08, 0x0a, 0x12, 0x7f, 0x80, 0xff]))
            .prop_map(|(at, byte)| Mutation::Set { at, byte }),
        2 => (any::<usize>(), vec(any::<u8>(), 1..6))
            .prop_map(|(at, bytes)| Mutation::Insert { at, bytes }),
        2 => (any::<usize>(), 1usize..8).prop_map(|(at, len)| Mutation::Delete { at, len }),
        1 => any::<usize>().prop_map(|at| Mutation::Truncate { at }),
        1 => (any::<usize>(), 1usize..64).prop_map(|(from, len)| Mutation::Repeat { from, len }),
    ]
}

fn mutate(mut bytes: Vec<u8>, mutations: &[Mutation]) -> Vec<u8> {
    for m in mutations {
        let n = bytes.len();
        match m {
            Mutation::Flip { at, bit } if n > 0 => bytes[at % n] ^= 1 << bit,
            Mutation::Set { at, byte } if n > 0 => bytes[at % n] = *byte,
            Mutation::Insert { at, bytes: new } => {
                let at = at % (n + 1);
                bytes.splice(at..at, new.iter().copied());
            }
            Mutation::Delete { at, len } if n > 0 => {
                let at = at % n;
                bytes.drain(at..(at + len).min(n));
            }
            Mutation::Truncate { at } => bytes.truncate(at % (n + 1)),
            Mutation::Repeat { from, len } if n > 0 => {
                let from = from % n;
                let run = bytes[from..(from + len).min(n)].to_vec();
                bytes.extend(run);
            }
            _ => {}
        }
    }
    bytes
}

/// Raw bytes, valid updates mutated, and two valid updates concatenated (protobuf merges
/// them: the second oneof wins, repeated fields append).
fn wire_bytes() -> impl Strategy<Value = Vec<u8>> {
    let seeds: Vec<Vec<u8>> = corpus().iter().map(|u| u.encode_to_vec()).collect();
    let n = seeds.len();
    let mutated = {
        let seeds = seeds.clone();
        let edits = prop_oneof![3 => vec(mutation(), 1..3), 1 => vec(mutation(), 3..8)];
        (0..n, edits).prop_map(move |(i, ms)| mutate(seeds[i].clone(), &ms))
    };
    let merged = (0..n, 0..n, vec(mutation(), 0..3)).prop_map(move |(i, j, ms)| {
        let mut b = seeds[i].clone();
        b.extend_from_slice(&seeds[j]);
        mutate(b, &ms)
    });
    prop_oneof![
        2 => vec(any::<u8>(), 0..256),
        6 => mutated,
        2 => merged,
    ]
}

#[test]
fn fuzz_update_bytes() {
    let max = prop_oneof![3 => Just(DEFAULT_MAX_UPDATE_BYTES), 1 => 0usize..512];
    fuzz(
        "update_bytes",
        4000,
        (vec(wire_bytes(), 1..4), max),
        |(inputs, max), t| {
            let mut updates = Vec::new();
            for bytes in inputs {
                // Not protobuf at all is the transport's refusal (tonic answers INTERNAL
                // for a body prost cannot decode); what decodes must decode cleanly.
                match pb::ClientUpdate::decode(bytes.as_slice()) {
                    Ok(u) => updates.push(u),
                    Err(_) => t.hit("not protobuf"),
                }
            }
            run_session(updates, None, max, t)
        },
    );
}

// ---- target b: structured updates ------------------------------------------------------

/// Strings a hostile client sends: empty, control and bidi characters, any Unicode, at and
/// over the id limit, long.
fn text() -> BoxedStrategy<String> {
    let odd = prop_oneof![
        any::<char>(),
        select(vec![
            '\0', '\n', '\r', '\t', '\u{1b}', '\u{7f}', '\u{85}', '\u{202e}', '\u{feff}', '"',
            '\\', '.', '[', ']', '$',
        ]),
    ];
    prop_oneof![
        6 => "[a-z0-9_]{0,12}",
        2 => vec(odd, 0..16).prop_map(String::from_iter),
        1 => select(vec![MAX_ID_BYTES - 1, MAX_ID_BYTES, MAX_ID_BYTES + 1])
            .prop_map(|n| "i".repeat(n)),
        1 => Just("é".repeat(MAX_ID_BYTES / 2 + 1)),
        1 => (1_000usize..40_000).prop_map(|n| "y".repeat(n)),
    ]
    .boxed()
}

/// Ids: mostly ones the base session holds (so updates reach existing messages and
/// parts), else hostile.
fn message_id() -> BoxedStrategy<String> {
    prop_oneof![8 => select(MESSAGES.to_vec()).prop_map(String::from), 2 => text()].boxed()
}

fn part_id() -> BoxedStrategy<String> {
    prop_oneof![8 => select(PARTS.to_vec()).prop_map(String::from), 2 => text()].boxed()
}

fn float() -> BoxedStrategy<f64> {
    prop_oneof![
        4 => 0.0f64..=1.0,
        1 => select(vec![
            f64::NAN,
            -f64::NAN,
            f64::INFINITY,
            f64::NEG_INFINITY,
            -0.0,
            f64::MAX,
            f64::MIN,
            f64::MIN_POSITIVE,
            f64::EPSILON,
            9.0e15,
            -9.0e15,
            1.0 + f64::EPSILON,
        ]),
        2 => any::<f64>(),
    ]
    .boxed()
}

fn uint() -> BoxedStrategy<u64> {
    prop_oneof![
        4 => 0u64..5_000,
        1 => select(vec![u64::MAX, u64::MAX - 1, i64::MAX as u64, 1 << 53, u32::MAX as u64]),
        1 => any::<u64>(),
    ]
    .boxed()
}

fn small_uint() -> BoxedStrategy<u32> {
    prop_oneof![4 => 0u32..8, 1 => Just(u32::MAX), 1 => any::<u32>()].boxed()
}

fn int() -> BoxedStrategy<i64> {
    prop_oneof![
        4 => (NOW - 1_000)..(NOW + 1_000),
        1 => select(vec![0, -1, i64::MIN, i64::MAX, i64::MIN + 1, i64::MAX - 1]),
        1 => any::<i64>(),
    ]
    .boxed()
}

fn enum_value(known: i32) -> BoxedStrategy<i32> {
    prop_oneof![6 => 0..=known, 1 => any::<i32>()].boxed()
}

/// `n` levels of `{"a": ...}` (or `[...]`) around a string: the depth limit's edge.
fn nested(n: usize, lists: bool) -> prost_types::Value {
    let mut v = prost_types::Value {
        kind: Some(Kind::StringValue("leaf".into())),
    };
    for level in 0..n {
        let kind = if lists && level % 2 == 1 {
            Kind::ListValue(prost_types::ListValue { values: vec![v] })
        } else {
            Kind::StructValue(prost_types::Struct {
                fields: [("a".to_string(), v)].into(),
            })
        };
        v = prost_types::Value { kind: Some(kind) };
    }
    v
}

fn json_value() -> BoxedStrategy<prost_types::Value> {
    let leaf = prop_oneof![
        Just(None),
        any::<i32>().prop_map(|n| Some(Kind::NullValue(n))),
        any::<bool>().prop_map(|b| Some(Kind::BoolValue(b))),
        float().prop_map(|f| Some(Kind::NumberValue(f))),
        text().prop_map(|s| Some(Kind::StringValue(s))),
    ]
    .prop_map(|kind| prost_types::Value { kind });
    leaf.prop_recursive(5, 32, 4, |inner| {
        prop_oneof![
            vec(inner.clone(), 0..4).prop_map(|values| prost_types::Value {
                kind: Some(Kind::ListValue(prost_types::ListValue { values })),
            }),
            btree_map(text(), inner, 0..4).prop_map(|fields| prost_types::Value {
                kind: Some(Kind::StructValue(prost_types::Struct { fields })),
            }),
        ]
    })
    .boxed()
}

/// A `google.protobuf.Struct`: small and wide, or nested around the depth limit.
fn json_struct() -> BoxedStrategy<prost_types::Struct> {
    prop_oneof![
        6 => btree_map(text(), json_value(), 0..4)
            .prop_map(|fields| prost_types::Struct { fields }),
        1 => ((MAX_JSON_DEPTH - 3)..(MAX_JSON_DEPTH + 4), any::<bool>()).prop_map(
            |(n, lists)| prost_types::Struct {
                fields: [("deep".to_string(), nested(n, lists))].into(),
            }
        ),
    ]
    .boxed()
}

fn opt_struct() -> BoxedStrategy<Option<prost_types::Struct>> {
    option::weighted(0.3, json_struct()).boxed()
}

fn usage() -> BoxedStrategy<pb::TokenUsage> {
    (
        option::of(uint()),
        uint(),
        uint(),
        uint(),
        option::of((uint(), uint())),
    )
        .prop_map(|(total, input, output, reasoning, cache)| pb::TokenUsage {
            total,
            input,
            output,
            reasoning,
            cache: cache.map(|(read, write)| pb::CacheTokens { read, write }),
        })
        .boxed()
}

fn model() -> BoxedStrategy<Option<pb::ModelRef>> {
    option::of(
        (text(), text()).prop_map(|(provider_id, model_id)| pb::ModelRef {
            provider_id,
            model_id,
        }),
    )
    .boxed()
}

fn part_time() -> BoxedStrategy<Option<pb::PartTime>> {
    option::of((int(), option::of(int())).prop_map(|(start, end)| pb::PartTime { start, end }))
        .boxed()
}

fn file() -> BoxedStrategy<pb::FilePart> {
    (text(), text(), text(), opt_struct(), uint())
        .prop_map(|(mime, filename, url, source, size)| pb::FilePart {
            mime,
            filename,
            url,
            source,
            size,
        })
        .boxed()
}

fn output() -> BoxedStrategy<String> {
    prop_oneof![
        4 => "[a-z \n]{0,64}",
        1 => (1_000usize..60_000).prop_map(|n| "z".repeat(n)),
        1 => text(),
    ]
    .boxed()
}

fn tool() -> BoxedStrategy<pb::ToolPart> {
    let status = prop_oneof![
        6 => select(vec!["pending", "running", "completed", "error"]).prop_map(String::from),
        1 => text(),
    ];
    let name = prop_oneof![6 => select(TOOLS.to_vec()).prop_map(String::from), 1 => text()];
    let call_id = prop_oneof![
        6 => select(vec!["call_p1", "call_p2", "call_x"]).prop_map(String::from),
        1 => text(),
    ];
    let time = option::of(
        (int(), option::of(int()), option::weighted(0.2, int())).prop_map(
            |(start, end, compacted)| pb::ToolTime {
                start,
                end,
                compacted,
            },
        ),
    );
    let state = option::weighted(
        0.95,
        (
            status,
            opt_struct(),
            output(),
            text(),
            text(),
            opt_struct(),
            time,
            vec(file(), 0..2),
            text(),
        )
            .prop_map(
                |(status, input, output, error, title, metadata, time, attachments, raw)| {
                    pb::ToolState {
                        status,
                        input,
                        output,
                        error,
                        title,
                        metadata,
                        time,
                        attachments,
                        raw,
                    }
                },
            ),
    );
    (call_id, name, state, opt_struct())
        .prop_map(|(call_id, tool, state, metadata)| pb::ToolPart {
            call_id,
            tool,
            state,
            metadata,
        })
        .boxed()
}

/// Every part kind, tools the most.
fn part_kind() -> BoxedStrategy<pb::part::Kind> {
    use pb::part::Kind as K;
    prop_oneof![
        3 => (output(), any::<bool>(), any::<bool>(), part_time(), opt_struct()).prop_map(
            |(text, synthetic, ignored, time, metadata)| K::Text(pb::TextPart {
                text,
                synthetic,
                ignored,
                time,
                metadata,
            })
        ),
        1 => (text(), part_time(), opt_struct())
            .prop_map(|(text, time, metadata)| K::Reasoning(pb::ReasoningPart {
                text,
                time,
                metadata,
            })),
        6 => tool().prop_map(K::Tool),
        1 => text().prop_map(|snapshot| K::StepStart(pb::StepStartPart { snapshot })),
        1 => (text(), text(), float(), option::of(usage())).prop_map(
            |(reason, snapshot, cost, tokens)| K::StepFinish(pb::StepFinishPart {
                reason,
                snapshot,
                cost,
                tokens,
            })
        ),
        1 => file().prop_map(K::File),
        1 => text().prop_map(|snapshot| K::Snapshot(pb::SnapshotPart { snapshot })),
        1 => (text(), vec(text(), 0..3))
            .prop_map(|(hash, files)| K::Patch(pb::PatchPart { hash, files })),
        1 => (text(), opt_struct())
            .prop_map(|(name, source)| K::Agent(pb::AgentPart { name, source })),
        1 => (text(), text(), text(), model(), text()).prop_map(
            |(prompt, description, agent, model, command)| K::Subtask(pb::SubtaskPart {
                prompt,
                description,
                agent,
                model,
                command,
            })
        ),
        1 => (small_uint(), opt_struct(), int())
            .prop_map(|(attempt, error, created)| K::Retry(pb::RetryPart {
                attempt,
                error,
                created,
            })),
        1 => (any::<bool>(), any::<bool>(), part_id()).prop_map(
            |(auto, overflow, tail_start_id)| K::Compaction(pb::CompactionPart {
                auto,
                overflow,
                tail_start_id,
            })
        ),
    ]
    .boxed()
}

fn part() -> BoxedStrategy<pb::Part> {
    let mark = option::weighted(
        0.1,
        (text(), text(), int(), uint()).prop_map(|(strategy, superseded_by, time, keep_chars)| {
            pb::StrategyMark {
                strategy,
                superseded_by,
                time,
                keep_chars,
            }
        }),
    );
    (
        part_id(),
        message_id(),
        option::weighted(0.95, part_kind()),
        opt_struct(),
        mark,
    )
        .prop_map(|(id, message_id, kind, extra, mark)| pb::Part {
            id,
            message_id,
            kind,
            extra,
            mark,
        })
        .boxed()
}

fn message_info() -> BoxedStrategy<pb::MessageInfo> {
    let role = prop_oneof![
        6 => select(vec!["user", "assistant"]).prop_map(String::from),
        1 => text(),
    ];
    let finish = prop_oneof![
        4 => select(vec!["", "stop", "tool-calls", "length", "error"]).prop_map(String::from),
        1 => text(),
    ];
    let mode =
        prop_oneof![4 => Just(String::new()), 1 => Just("compaction".to_string()), 1 => text()];
    let time = option::of(
        (int(), option::of(int()))
            .prop_map(|(created, completed)| pb::MessageTime { created, completed }),
    );
    let error = option::weighted(
        0.1,
        (text(), opt_struct()).prop_map(|(name, data)| pb::MessageError { name, data }),
    );
    (
        (message_id(), role, message_id(), time, any::<bool>()),
        (mode.clone(), mode, finish, option::of(usage()), float()),
        (error, model(), opt_struct()),
    )
        .prop_map(
            |(
                (id, role, parent_id, time, summary),
                (mode, agent, finish, tokens, cost),
                (error, model, extra),
            )| pb::MessageInfo {
                id,
                role,
                parent_id,
                time,
                summary,
                mode,
                agent,
                finish,
                tokens,
                cost,
                error,
                model,
                extra,
            },
        )
        .boxed()
}

fn string_list() -> BoxedStrategy<Option<pb::StringList>> {
    option::weighted(
        0.2,
        vec(
            prop_oneof![3 => select(TOOLS.to_vec()).prop_map(String::from), 1 => text()],
            0..4,
        )
        .prop_map(|values| pb::StringList { values }),
    )
    .boxed()
}

fn session_config() -> BoxedStrategy<pb::SessionConfig> {
    let strategy_name = prop_oneof![
        4 => select(Named::ALL.iter().map(|s| s.name().to_string()).collect::<Vec<_>>()),
        1 => text(),
    ];
    let strategy_preset = prop_oneof![
        4 => select(vec!["", "compactd", "compact", "balanced", "verbose", " compact "])
            .prop_map(String::from),
        1 => text(),
    ];
    let cache_model = prop_oneof![
        4 => select(vec![
            "",
            "anthropic",
            "openai",
            "none",
            "custom:0.1:1.25:300",
            "custom:-1:nan:0",
            "custom:inf:1:1",
            "custom:1:1:18446744073709551616",
            "custom::",
        ])
        .prop_map(String::from),
        1 => text(),
    ];
    let prompt = || option::weighted(0.1, text());
    (
        (
            option::of(any::<bool>()),
            option::of(any::<bool>()),
            option::weighted(0.4, float()),
            option::weighted(0.2, uint()),
            enum_value(2),
            option::weighted(0.3, uint()),
            option::weighted(0.3, uint()),
            string_list(),
        ),
        (
            option::weighted(0.3, small_uint()),
            enum_value(2),
            option::weighted(0.1, text()),
            strategy_preset,
            hash_map(strategy_name, any::<bool>(), 0..3),
            string_list(),
            option::weighted(
                0.1,
                vec(
                    prop_oneof![
                        2 => select(vec!["**/*.lock", "src/**", "[", "{a,b", "**/**/**"])
                            .prop_map(String::from),
                        1 => text(),
                    ],
                    0..3,
                )
                .prop_map(|values| pb::StringList { values }),
            ),
            string_list(),
        ),
        (
            prompt(),
            prompt(),
            prompt(),
            prompt(),
            prompt(),
            option::weighted(0.2, small_uint()),
            option::weighted(0.3, float()),
            cache_model,
        ),
    )
        .prop_map(
            |(
                (
                    auto_compact,
                    prune,
                    threshold,
                    reserved,
                    cache_counting,
                    prune_protect,
                    prune_minimum,
                    protected_tools,
                ),
                (
                    protect_turns,
                    preset,
                    compaction_model,
                    strategy_preset,
                    strategies,
                    strategy_protected_tools,
                    protected_file_globs,
                    snapshot_tools,
                ),
                (
                    placeholder,
                    auto_continue,
                    compaction_system,
                    compaction_prompt,
                    compaction_template,
                    mask_keep,
                    output_cap,
                    cache_model,
                ),
            )| pb::SessionConfig {
                auto_compact,
                prune,
                threshold,
                reserved,
                cache_counting,
                prune_protect,
                prune_minimum,
                protected_tools,
                protect_turns,
                preset,
                compaction_model,
                strategy_preset,
                strategies,
                strategy_protected_tools,
                protected_file_globs,
                snapshot_tools,
                placeholder,
                auto_continue,
                compaction_system,
                compaction_prompt,
                compaction_template,
                mask_keep,
                output_cap,
                cache_model,
                tokenizer: String::new(),
            },
        )
        .boxed()
}

fn session_info() -> BoxedStrategy<pb::SessionInfo> {
    let id = prop_oneof![4 => Just(SID.to_string()), 2 => Just(String::new()), 1 => text()];
    let limits = option::of(
        (uint(), uint(), uint()).prop_map(|(context, input, output)| pb::ModelLimits {
            context,
            input,
            output,
        }),
    );
    let todo =
        (text(), text(), text(), text()).prop_map(|(id, content, status, priority)| pb::Todo {
            id,
            content,
            status,
            priority,
        });
    (
        id,
        text(),
        model(),
        limits,
        option::weighted(0.8, session_config()),
        vec(todo, 0..2),
        opt_struct(),
    )
        .prop_map(
            |(id, title, model, limits, config, todos, extra)| pb::SessionInfo {
                id,
                title,
                model,
                limits,
                config,
                todos,
                extra,
            },
        )
        .boxed()
}

/// Any update the stream takes, with hostile contents.
fn client_update() -> BoxedStrategy<pb::ClientUpdate> {
    let kind = prop_oneof![
        2 => session_info().prop_map(U::Open),
        4 => message_info().prop_map(U::UpsertMessage),
        8 => part().prop_map(U::UpsertPart),
        2 => (message_id(), part_id())
            .prop_map(|(message_id, part_id)| U::DeletePart(pb::PartRef { message_id, part_id })),
        2 => (prop_oneof![3 => message_id(), 1 => Just(String::new())], option::weighted(0.9, usage()))
            .prop_map(|(message_id, tokens)| U::ReportUsage(pb::UsageReport { message_id, tokens })),
        1 => enum_value(2).prop_map(|format| U::GetContext(pb::ContextOptions { format })),
        1 => any::<bool>().prop_map(|dry_run| U::Prune(pb::PruneOptions { dry_run })),
        1 => Just(U::CheckOverflow(pb::CheckOverflowOptions {})),
        1 => (text(), option::of(small_uint())).prop_map(|(instructions, tail_turns)| {
            U::Compact(pb::CompactOptions {
                instructions,
                tail_turns,
                ..Default::default()
            })
        }),
        1 => Just(U::CancelCompaction(pb::CancelCompaction {})),
        2 => (message_id(), prop_oneof![1 => Just(String::new()), 3 => part_id()], option::of(any::<bool>()))
            .prop_map(|(message_id, part_id, pinned)| U::Pin(pb::PinUpdate {
                message_id,
                part_id,
                pinned,
            })),
    ];
    let session_id =
        prop_oneof![12 => Just(SID.to_string()), 1 => Just(String::new()), 1 => text()];
    (any::<u64>(), session_id, option::weighted(0.97, kind))
        .prop_map(|(seq, session_id, update)| pb::ClientUpdate {
            seq,
            session_id,
            update,
        })
        .boxed()
}

#[test]
fn fuzz_structured_updates() {
    fuzz(
        "structured_updates",
        1500,
        (
            vec(client_update(), 1..6),
            option::weighted(0.3, 0u64..8_192),
        ),
        |(updates, slack), t| run_session(updates, slack, DEFAULT_MAX_UPDATE_BYTES, t),
    );
}

/// The corpus itself: every update kind decodes and runs cleanly (the seeds are valid, so
/// a refusal here would be a decoder or fixture bug, not a fuzz find).
#[test]
fn fuzz_seeds_are_valid_updates() {
    let mut s = base().clone();
    for u in more() {
        let op = decode_update(u.clone(), u.encoded_len(), DEFAULT_MAX_UPDATE_BYTES)
            .unwrap_or_else(|r| panic!("{u:?} refused: {r:?}"));
        if let Op::Apply(update) = op {
            engine::step(&mut s, *update, config(), NOW)
                .unwrap_or_else(|e| panic!("{u:?} refused: {e}"));
        }
    }
}

// ---- regressions -----------------------------------------------------------------------

/// Found by `tests/fuzz/import.rs` (`fuzz_import_documents`): `trace::from_value` bounds
/// the JSON depth of every message and part (`validate`), but not of the session's own
/// unmodelled fields (`info`'s unknown keys, and the document's top-level ones, which land
/// in `info.extra`). `ImportSession` accepts such a document, and the session's
/// `GetSession` reply then exceeds prost's recursion limit: no protobuf client can read
/// it back.
#[test]
fn fuzz_regression_imported_session_reads_back() {
    let mut deep = serde_json::json!("leaf");
    for _ in 0..40 {
        deep = serde_json::json!({ "a": deep });
    }
    for doc in [
        serde_json::json!({"info": {"id": "s", "x": deep.clone()}, "messages": []}),
        serde_json::json!({"info": {"id": "s"}, "messages": [], "x": deep.clone()}),
    ] {
        let Ok(export) = crate::trace::parse_export(&doc.to_string()) else {
            continue; // refused: fixed
        };
        let s = crate::trace::load(export, Default::default(), Default::default(), config())
            .expect("loads");
        let reply = pb::GetSessionResponse {
            info: Some(convert::session_to_pb(s.info())),
            messages: Vec::new(),
            summary: Some(convert::summary_to_pb(&s, false)),
        };
        let back = pb::GetSessionResponse::decode(reply.encode_to_vec().as_slice());
        assert!(back.is_ok(), "GetSession unreadable: {:?}", back.err());
    }
}
