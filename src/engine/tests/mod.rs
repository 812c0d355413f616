//! Engine unit and property tests (written against the seeds, beside the pure code).
//!
//! Fixtures are small text sessions, one message per line, parsed by [`parse`]:
//!
//! ```text
//! user u1 text:t1=10              user message u1 with a 10-token text part
//! assistant a1 read:p1=30000      assistant answering the last user, finished ("stop"),
//!                                 with a completed `read` whose output is 30000 tokens
//! assistant a2 bash:p2=5@running  tool status suffix: @pending @running @error @compacted
//! assistant s1 summary            a finished compaction summary (summary: true)
//! assistant a3 unfinished error=MessageAbortedError
//! user u2 compaction:c1           user message holding a compaction part
//! user u3 ignored:t3=5            an ignored text part (also: reasoning:ID=N, step:ID)
//! ```
//!
//! Sizes are tokens of the chars/4 heuristic: `N` tokens are `4 × N` ASCII characters.
//! Each behaviour has one `check_*` helper that builds the fixture, runs the engine and
//! compares whole values.

mod carry;
mod compaction;
mod context;
mod context_cache;
mod memory;
mod overflow;
mod pins;
mod pins_compaction;
mod props;
mod prune;
mod recall;
mod rendered_tokens;
mod snapshot;
mod strategies;
mod tokenizer;
mod turns;

use super::{PruneMode, PrunePlan, PruneReport, Session, Update, eligible_end, estimate};
use crate::config::{EngineConfig, SessionOverrides};
use crate::domain::{
    CompactionPart, Extra, MessageError, MessageInfo, ModelLimits, Part, PartKind, ReasoningPart,
    Role, SessionInfo, TextPart, ToolPart, ToolState, ToolStatus,
};
use crate::tokens::{CharsPerToken, TokenCounter};

/// The clock of every test (epoch ms).
pub(super) const NOW: i64 = 1_705_512_345_678;

/// The server defaults with the strategies off, no prompt cache to protect (prune
/// applies as soon as it decides) and OpenCode's chars ÷ 4 counts: these tests check
/// OpenCode's layers (seeds 01/02) on their own, with the seeds' figures; `strategies/`
/// and `scheduler` tests turn the rest on, `tokenizer` tests the real tokenizers.
pub(super) fn config() -> EngineConfig {
    EngineConfig {
        strategies: crate::config::StrategySet::NONE,
        cache_model: crate::config::CacheModel::NONE,
        tokenizer: crate::tokens::Tokenizer::Chars4,
        ..EngineConfig::default()
    }
}

/// An empty session with the given overrides and limits, counting chars/4.
pub(super) fn new_session(overrides: SessionOverrides, limits: ModelLimits) -> Session {
    let info = SessionInfo {
        id: "ses_test".into(),
        limits,
        config: overrides,
        ..Default::default()
    };
    Session::new(info, &config())
}

/// Applies one update; fixtures are valid, so a rejection is a test failure.
pub(super) fn apply(s: &mut Session, update: Update) {
    s.apply(update.clone(), &config())
        .unwrap_or_else(|e| panic!("{update:?} rejected: {e}"));
}

/// Whether `update` is an unpin of a part that only its message's pin covers, which is
/// refused (the part would stay pinned): the property tests' random pins meet it.
pub(super) fn unpin_of_a_part_only_its_message_pins(s: &Session, update: &Update) -> bool {
    let Update::Pin {
        message_id,
        part_id: Some(part_id),
        pinned: false,
    } = update
    else {
        return false;
    };
    s.position(message_id)
        .is_some_and(|m| s.pins().holds(m, None) && !s.pins().holds(m, Some(part_id)))
}

/// A session built from a fixture with default settings.
pub(super) fn session(fixture: &str) -> Session {
    session_with(fixture, SessionOverrides::default())
}

/// A session built from a fixture with per-session overrides.
pub(super) fn session_with(fixture: &str, overrides: SessionOverrides) -> Session {
    let mut s = new_session(overrides, ModelLimits::default());
    for u in parse(fixture) {
        apply(&mut s, u);
    }
    s
}

// ---- builders ------------------------------------------------------------------------

/// `n` ASCII characters.
pub(super) fn chars(n: usize) -> String {
    "x".repeat(n)
}

/// A user message.
pub(super) fn user(id: &str) -> MessageInfo {
    MessageInfo::new(id, Role::User)
}

/// A finished assistant message answering `parent`.
pub(super) fn assistant(id: &str, parent: &str) -> MessageInfo {
    let mut m = MessageInfo::new(id, Role::Assistant);
    m.parent_id = parent.into();
    m.finish = "stop".into();
    m
}

/// A finished compaction summary answering `parent`.
pub(super) fn summary(id: &str, parent: &str) -> MessageInfo {
    let mut m = assistant(id, parent);
    m.summary = true;
    m.mode = "compaction".into();
    m.agent = "compaction".into();
    m
}

fn part(msg: &str, id: &str, kind: PartKind) -> Part {
    Part {
        id: id.into(),
        message_id: msg.into(),
        kind,
        mark: None,
        extra: Extra::new(),
    }
}

/// A text part.
pub(super) fn text(msg: &str, id: &str, text: &str) -> Part {
    part(
        msg,
        id,
        PartKind::Text(TextPart {
            text: text.into(),
            ..Default::default()
        }),
    )
}

/// A completed tool call with the given output (call id `call_<id>`, input `{}`).
pub(super) fn tool(msg: &str, id: &str, tool_name: &str, output: &str) -> Part {
    tool_in(msg, id, tool_name, ToolStatus::Completed, output)
}

/// A tool call in any status; the output is set whatever the status.
pub(super) fn tool_in(
    msg: &str,
    id: &str,
    tool_name: &str,
    status: ToolStatus,
    output: &str,
) -> Part {
    let mut state = ToolState::new(status);
    state.output = output.into();
    if status == ToolStatus::Error {
        state.error = output.into();
    }
    part(
        msg,
        id,
        PartKind::Tool(Box::new(ToolPart {
            call_id: format!("call_{id}"),
            tool: tool_name.into(),
            state,
            metadata: None,
        })),
    )
}

/// A user `compaction` part.
pub(super) fn compaction(msg: &str, id: &str) -> Part {
    part(
        msg,
        id,
        PartKind::Compaction(CompactionPart {
            auto: true,
            ..Default::default()
        }),
    )
}

/// A `step-start` part.
pub(super) fn step_start(msg: &str, id: &str) -> Part {
    part(
        msg,
        id,
        PartKind::StepStart {
            snapshot: String::new(),
        },
    )
}

/// The tool state of a tool part.
pub(super) fn state(p: &Part) -> &ToolState {
    match &p.kind {
        PartKind::Tool(t) => &t.state,
        other => panic!("part {} is a {}, not a tool", p.id, other.type_name()),
    }
}

/// The tool state of a tool part, mutably.
pub(super) fn state_mut(p: &mut Part) -> &mut ToolState {
    match &mut p.kind {
        PartKind::Tool(t) => &mut t.state,
        other => panic!("part {} is a {}, not a tool", p.id, other.type_name()),
    }
}

/// A stored part by id.
pub(super) fn find(s: &Session, part_id: &str) -> Part {
    s.messages()
        .iter()
        .flat_map(|m| &m.parts)
        .find(|p| p.part.id == part_id)
        .unwrap_or_else(|| panic!("no part {part_id}"))
        .part
        .clone()
}

// ---- fixture parser ------------------------------------------------------------------

/// Parses a fixture (see the module docs) into the updates that build it.
pub(super) fn parse(fixture: &str) -> Vec<Update> {
    let mut updates = Vec::new();
    let mut last_user = String::new();
    for line in fixture
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
    {
        let mut words = line.split_whitespace();
        let role = words.next().unwrap_or_default();
        let id = words
            .next()
            .unwrap_or_else(|| panic!("no message id in {line:?}"));
        let mut info = match role {
            "user" => {
                last_user = id.to_string();
                user(id)
            }
            "assistant" => assistant(id, &last_user),
            other => panic!("unknown role {other:?} in {line:?}"),
        };
        let mut parts = Vec::new();
        for w in words {
            match w {
                "summary" => {
                    info.summary = true;
                    info.agent = "compaction".into();
                }
                "unfinished" => info.finish.clear(),
                _ if w.starts_with("error=") => {
                    info.error = Some(MessageError {
                        name: w["error=".len()..].into(),
                        data: serde_json::Value::Null,
                    })
                }
                _ => parts.push(parse_part(id, w)),
            }
        }
        updates.push(Update::UpsertMessage(info));
        updates.extend(parts.into_iter().map(Update::UpsertPart));
    }
    updates
}

pub(super) fn parse_part(msg: &str, word: &str) -> Part {
    let (kind, rest) = word
        .split_once(':')
        .unwrap_or_else(|| panic!("part {word:?} is not kind:id[=tokens][@status]"));
    let (rest, suffix) = match rest.split_once('@') {
        Some((r, s)) => (r, Some(s)),
        None => (rest, None),
    };
    let (id, tokens) = match rest.split_once('=') {
        Some((id, n)) => (id, n.parse::<usize>().expect("token count")),
        None => (rest, 0),
    };
    let body = chars(tokens * 4);
    match kind {
        "text" => text(msg, id, &body),
        "ignored" => {
            let mut p = text(msg, id, &body);
            if let PartKind::Text(t) = &mut p.kind {
                t.ignored = true;
            }
            p
        }
        "reasoning" => part(
            msg,
            id,
            PartKind::Reasoning(ReasoningPart {
                text: body,
                ..Default::default()
            }),
        ),
        "compaction" => compaction(msg, id),
        "step" => step_start(msg, id),
        tool_name => {
            let status = match suffix {
                None | Some("compacted") => ToolStatus::Completed,
                Some(s) => ToolStatus::parse(s).unwrap_or_else(|| panic!("status {s:?}")),
            };
            let mut p = tool_in(msg, id, tool_name, status, &body);
            if suffix == Some("compacted") {
                state_mut(&mut p).time.compacted = Some(1);
            }
            p
        }
    }
}

// ---- shared checks -------------------------------------------------------------------

/// The plan the seed's literal algorithm gives for the session as it is now.
pub(super) fn reference(s: &Session) -> PrunePlan {
    let end = eligible_end(s.users(), s.messages().len(), s.settings().protect_turns);
    super::prune_index::reference_scan_pinned(s.messages(), end, s.settings(), s.pins())
}

/// Brings the incremental index up to date and returns its plan.
pub(super) fn index_plan(s: &mut Session) -> PrunePlan {
    s.prune_plan()
}

/// Asserts the incremental index and the reference scan give the same plan.
pub(super) fn assert_index_agrees(s: &mut Session, context: &str) {
    let want = reference(s);
    let got = index_plan(s);
    assert_eq!(got, want, "index vs reference_scan after {context}");
}

/// Ids of the parts a report lists, oldest first.
pub(super) fn part_ids(r: &PruneReport) -> Vec<String> {
    r.parts.iter().map(|p| p.part_id.clone()).collect()
}

/// Ids of the tool parts stamped `time.compacted == at`, in session order.
pub(super) fn compacted_at(s: &Session, at: i64) -> Vec<String> {
    s.messages()
        .iter()
        .flat_map(|m| &m.parts)
        .filter(|p| matches!(&p.part.kind, PartKind::Tool(t) if t.state.time.compacted == Some(at)))
        .map(|p| p.part.id.clone())
        .collect()
}

/// The session's messages with every `time.compacted` stamped at `at` removed.
pub(super) fn without_stamps(s: &Session, at: i64) -> Vec<super::Message> {
    let mut messages = s.messages().to_vec();
    for p in messages.iter_mut().flat_map(|m| &mut m.parts) {
        if let PartKind::Tool(t) = &mut p.part.kind
            && t.state.time.compacted == Some(at)
        {
            t.state.time.compacted = None;
            // The rendered size that comes with the stamp.
            p.reduced = None;
        }
    }
    messages
}

/// What one prune commit did, compared whole.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct PruneOutcome {
    pub committed: bool,
    pub pruned: Vec<String>,
    pub saved: u64,
}

/// Builds `fixture`, commits a prune at [`NOW`] and compares the outcome; also checks that
/// a dry run on a copy reports the same parts and tokens, the index agrees with the
/// reference scan, exactly the listed parts get `time.compacted = NOW` when committed (none
/// otherwise) and nothing else changes (outputs are kept: lazy deletion).
pub(super) fn check_prune(fixture: &str, committed: bool, pruned: &[&str], saved: u64) {
    check_prune_with(
        fixture,
        SessionOverrides::default(),
        committed,
        pruned,
        saved,
    );
}

/// [`check_prune`] with per-session overrides.
pub(super) fn check_prune_with(
    fixture: &str,
    overrides: SessionOverrides,
    committed: bool,
    pruned: &[&str],
    saved: u64,
) {
    let mut s = session_with(fixture, overrides);
    assert_index_agrees(&mut s, "building the fixture");
    let before = s.messages().to_vec();

    let dry = s.clone().prune(PruneMode::DryRun, NOW);
    let report = s.prune(PruneMode::Commit, NOW);
    let expected = PruneOutcome {
        committed,
        pruned: pruned.iter().map(|p| p.to_string()).collect(),
        saved,
    };
    let actual = PruneOutcome {
        committed: report.committed,
        pruned: part_ids(&report),
        saved: report.tokens_saved,
    };
    assert_eq!(actual, expected, "prune of\n{fixture}");

    assert!(dry.dry_run && !dry.committed);
    assert_eq!(
        (&dry.parts, dry.tokens_saved, dry.tokens_scanned),
        (&report.parts, report.tokens_saved, report.tokens_scanned),
        "dry run and commit disagree"
    );

    let marked = if committed { expected.pruned } else { vec![] };
    assert_eq!(compacted_at(&s, NOW), marked, "parts stamped with now_ms");
    assert_eq!(
        without_stamps(&s, NOW),
        before,
        "only the stamps may change"
    );
    assert_index_agrees(&mut s, "the commit");
}

/// Context tokens of every part, recomputed from scratch (what `total_tokens` must be).
pub(super) fn tokens_from_scratch(s: &Session) -> u64 {
    let counter = CharsPerToken;
    let placeholder = counter.count(&s.settings().placeholder);
    s.messages()
        .iter()
        .flat_map(|m| &m.parts)
        .map(|p| {
            // Only a completed output can be cleared (and replaced by the placeholder).
            let compacted = matches!(&p.part.kind, PartKind::Tool(t)
                if t.state.status == ToolStatus::Completed && t.state.time.compacted.is_some());
            estimate(&p.part, &counter).in_context(compacted, placeholder)
        })
        .sum()
}

/// A context view's tokens recomputed from its rendered parts.
pub(super) fn view_tokens_from_parts(view: &super::ContextView) -> u64 {
    view.messages
        .iter()
        .flat_map(|m| &m.parts)
        .map(|p| {
            let e = estimate(&p.part, &CharsPerToken);
            e.base + e.output
        })
        .sum()
}

/// Context tokens of every part as it reads now (prune placeholders, strategy marks and
/// the input-leak fix applied), rendered and counted from scratch: what `total_tokens`
/// must be with the strategies on (no cached `reduced` figure is used).
pub(super) fn rendered_tokens_from_scratch(s: &Session) -> u64 {
    s.messages()
        .iter()
        .flat_map(|m| &m.parts)
        .filter_map(|p| super::render::render(&p.part, s.settings()))
        .map(|r| {
            let e = estimate(&r, &CharsPerToken);
            e.base + e.output
        })
        .sum()
}

// ---- sessions shared by several files -------------------------------------------------

/// Three turns whose first assistant message holds a read, a text and a bash call: the
/// pins tests carry some of them through a compaction.
pub(super) const THREE_TURNS_TO_PIN: &str = "
    user u1 text:t1=10
    assistant a1 read:p1=3000 text:x1=40 bash:p2=500
    user u2 text:t2=10
    assistant a2 bash:p3=200
    user u3 text:t3=10
    assistant a3 text:x3=50
";

/// A session whose strategies are all on (the server defaults): two identical reads, so
/// the older one is superseded at the next commit.
pub(super) fn twice_read() -> (Session, EngineConfig) {
    let cfg = EngineConfig {
        tokenizer: crate::tokens::Tokenizer::Chars4,
        ..EngineConfig::default()
    };
    let mut s = Session::new(
        SessionInfo {
            id: "ses_pins".into(),
            ..Default::default()
        },
        &cfg,
    );
    let read = |msg: &str, id: &str| {
        let mut p = tool(msg, id, "read", &chars(4_000));
        state_mut(&mut p).input = serde_json::json!({"filePath": "src/x.rs"});
        p
    };
    for u in [
        Update::UpsertMessage(user("u1")),
        Update::UpsertPart(text("u1", "t1", "read x twice")),
        Update::UpsertMessage(assistant("a1", "u1")),
        Update::UpsertPart(read("a1", "r1")),
        Update::UpsertPart(read("a1", "r2")),
    ] {
        s.apply(u, &cfg).expect("valid");
    }
    (s, cfg)
}

/// Commits a manual compaction keeping the last `turns` turns (at most 15,000 tokens),
/// with `summary` as the summary and `prefix` naming its two messages.
pub(super) fn compact_keeping(s: &mut Session, turns: u32, summary: &str, prefix: &str) {
    use crate::engine::{CommitIds, CompactionRequest, SummaryOutcome, TailOptions};
    let request = CompactionRequest {
        tail: TailOptions {
            turns,
            max_tokens: 15_000,
        },
        auto: false,
        overflow: false,
    };
    let plan = s.plan_compaction(request).expect("plan");
    let outcome = SummaryOutcome {
        text: summary.into(),
        usage: None,
        cost: 0.0,
        model: None,
    };
    let ids = CommitIds {
        prefix: prefix.into(),
    };
    s.commit_compaction(&plan, &outcome, &ids, NOW, &config())
        .expect("commit");
}
