//! compactd's own policies on in-memory sessions: observation masking, the oversized-output
//! cap, and the cache-aware scheduler that decides when a rewrite of the prompt's past is
//! worth its cache cost.

use super::*;
use crate::config::CacheModel;
use crate::engine::RecallKey;
use crate::engine::overflow::Trigger;
use crate::engine::scheduler::{Decision, Scope, Why, pays};

const T0: i64 = 1_700_000_000_000;
const TTL: i64 = 300_000;

/// A session on the product defaults (anthropic cache model) with `o` and `limits`.
fn session(o: SessionOverrides, limits: ModelLimits) -> Session {
    let info = SessionInfo {
        id: "ses_cd".into(),
        limits,
        config: o,
        ..Default::default()
    };
    Session::new(info, &chars4())
}

/// Only the listed strategies of compactd on, with `mask_keep` and the cache model.
fn only(list: &[St], keep: u32, model: CacheModel) -> SessionOverrides {
    let mut o = SessionOverrides {
        strategy_preset: Some(StrategyPreset::Verbose),
        mask_keep: Some(keep),
        cache_model: Some(model),
        // OpenCode's prune stays idle: these tests are about the other layers.
        prune_minimum: Some(u64::MAX),
        ..Default::default()
    };
    for st in list {
        o.strategies.insert(*st, true);
    }
    o
}

/// The server defaults, counting chars ÷ 4 (the figures these tests reason in).
fn chars4() -> EngineConfig {
    EngineConfig {
        tokenizer: crate::tokens::Tokenizer::Chars4,
        ..EngineConfig::default()
    }
}

fn go(s: &mut Session, u: Update, now: i64) -> Vec<Event> {
    step(s, u.clone(), &chars4(), now)
        .unwrap_or_else(|e| panic!("{u:?} rejected: {e}"))
        .events
}

/// Turn `n`: a user message at `at`, then an assistant message (created at `at + 1`)
/// calling each `(tool, output size)`, finished at `at + 10`. Returns the finish's events.
fn turn(s: &mut Session, n: usize, at: i64, outputs: &[(&str, usize)]) -> Vec<Event> {
    turn_of(s, n, at, outputs.len(), |a, id, i| {
        let (tool, size) = outputs[i];
        let body = format!("HEAD-{id} {} TAIL-{id}", "o".repeat(size));
        let input = json!({ "command": format!("run {id}") });
        call(a, id, tool, input, &body)
    })
}

/// Turn `n` as [`turn`], with `calls` tool parts made by `part(message, part id, index)`.
fn turn_of(
    s: &mut Session,
    n: usize,
    at: i64,
    calls: usize,
    part: impl Fn(&str, &str, usize) -> Part,
) -> Vec<Event> {
    user_says(s, n, at);
    let (u, a) = (format!("u{n}"), format!("a{n}"));
    let mut info = assistant(&a, &u);
    info.time.created = at + 1;
    info.finish.clear();
    go(s, Update::UpsertMessage(info.clone()), at + 1);
    for i in 0..calls {
        let id = format!("{a}-p{i}");
        go(s, Update::UpsertPart(part(&a, &id, i)), at + 2);
    }
    info.finish = "tool-calls".into();
    info.time.completed = Some(at + 10);
    go(s, Update::UpsertMessage(info), at + 10)
}

/// A user message `u<n>` written at `at`; returns its events.
fn user_says(s: &mut Session, n: usize, at: i64) -> Vec<Event> {
    let u = format!("u{n}");
    let mut info = user(&u);
    info.time.created = at;
    let mut events = go(s, Update::UpsertMessage(info), at);
    events.extend(go(
        s,
        Update::UpsertPart(text(&u, &format!("{u}-t"), "go on")),
        at,
    ));
    events
}

/// How a tool part's output reads in the context.
fn output_in(v: &ContextView, id: &str) -> String {
    match &shown(v, id).kind {
        PartKind::Tool(t) => t.state.output.clone(),
        other => panic!("{id} is not a tool part: {other:?}"),
    }
}

fn strategy_of(s: &Session, id: &str) -> Option<St> {
    find(s, id).mark.map(|m| m.strategy)
}

fn marked(events: &[Event]) -> Vec<String> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::Pruned(r) => Some(r.strategies.parts.iter().map(|m| m.part_id.clone())),
            _ => None,
        })
        .flatten()
        .collect()
}

#[test]
fn masking_hides_outputs_older_than_the_newest_n_and_names_the_call() {
    let mut s = session(
        only(&[St::MaskObservations], 2, CacheModel::NONE),
        ModelLimits::default(),
    );
    // Five parallel calls in one step: the model has not seen them yet, so none is
    // masked (before, the three oldest were, the model never reading them).
    let outputs = [
        ("bash", 2_000),
        ("bash", 2_000),
        ("bash", 2_000),
        ("bash", 2_000),
        ("bash", 2_000),
    ];
    let events = turn(&mut s, 1, T0, &outputs);
    assert!(marked(&events).is_empty(), "{:?}", marked(&events));
    // The next message's results: its request sent the first five, which masking now
    // reaches.
    let events = turn(&mut s, 2, T0 + 10, &[("bash", 2_000)]);
    assert_eq!(marked(&events), ["a1-p0", "a1-p1", "a1-p2", "a1-p3"]);
    let v = s.build_context();
    let masked = output_in(&v, "a1-p0");
    for needle in ["bash", "call_a1-p0", "2.0 KB", "compactd_recall"] {
        assert!(masked.contains(needle), "{needle} missing from {masked:?}");
    }
    assert!(
        output_in(&v, "a1-p4").starts_with("HEAD-a1-p4"),
        "the newest two read in full"
    );
    assert!(output_in(&v, "a2-p0").starts_with("HEAD-a2-p0"));
    assert_eq!(
        shown_text(&v, "u1-t"),
        "go on",
        "user messages are never masked"
    );
    // Lazy: the original is kept, and switching masking off gives it back.
    let PartKind::Tool(t) = find(&s, "a1-p0").kind else {
        unreachable!()
    };
    assert!(t.state.output.starts_with("HEAD-a1-p0") && t.state.output.ends_with("TAIL-a1-p0"));
    let off = SessionInfo {
        config: switches(&[("maskObservations", false)]),
        ..Default::default()
    };
    go(&mut s, Update::Configure(off), T0 + 20);
    let v = s.build_context();
    assert!(output_in(&v, "a1-p0").ends_with("TAIL-a1-p0"));
    assert_eq!(s.total_tokens(), rendered_tokens_from_scratch(&s));
}

#[test]
fn masking_leaves_tiny_outputs_protected_tools_and_pinned_parts_alone() {
    let mut s = session(
        only(&[St::MaskObservations], 1, CacheModel::NONE),
        ModelLimits::default(),
    );
    user_says(&mut s, 1, T0);
    let mut a = assistant("a1", "u1");
    a.finish.clear();
    go(&mut s, Update::UpsertMessage(a.clone()), T0);
    let parts = [
        call("a1", "tiny", "bash", json!({"command": "true"}), "ok"),
        call(
            "a1",
            "sub",
            "task",
            json!({"prompt": "explore"}),
            &"t".repeat(3_000),
        ),
        call(
            "a1",
            "kept",
            "bash",
            json!({"command": "ls"}),
            &"k".repeat(3_000),
        ),
        call(
            "a1",
            "old",
            "bash",
            json!({"command": "pwd"}),
            &"o".repeat(3_000),
        ),
        call(
            "a1",
            "new",
            "bash",
            json!({"command": "env"}),
            &"n".repeat(3_000),
        ),
    ];
    for p in parts {
        go(&mut s, Update::UpsertPart(p), T0);
    }
    let pin = Update::Pin {
        message_id: "a1".into(),
        part_id: Some("kept".into()),
        pinned: true,
    };
    go(&mut s, pin, T0);
    go(&mut s, Update::UpsertMessage(assistant("a1", "u1")), T0 + 1);
    // The next step's result: its request sent a1's.
    turn(&mut s, 2, T0 + 10, &[("bash", 10)]);
    for id in ["old", "new"] {
        assert_eq!(strategy_of(&s, id), Some(St::MaskObservations), "{id}");
    }
    for id in ["tiny", "sub", "kept"] {
        assert_eq!(strategy_of(&s, id), None, "{id} must read in full");
    }
}

#[test]
fn an_oversized_output_reads_as_head_and_tail_and_is_recalled_whole() {
    // Usable input 8,000 tokens; the cap is 10% of it at four characters a token.
    let limits = ModelLimits {
        context: 10_000,
        input: 0,
        output: 2_000,
    };
    let mut s = session(only(&[St::CapLargeOutputs], 10, CacheModel::NONE), limits);
    turn(&mut s, 1, T0, &[("bash", 20_000), ("task", 20_000)]);
    let mark = find(&s, "a1-p0").mark.expect("capped");
    assert_eq!((mark.strategy, mark.keep), (St::CapLargeOutputs, 3_200));
    let v = s.build_context();
    let out = output_in(&v, "a1-p0");
    assert!(
        out.starts_with("HEAD-a1-p0") && out.ends_with("TAIL-a1-p0"),
        "{out}"
    );
    assert!(
        out.contains("omitted") && out.contains("call_a1-p0"),
        "{out}"
    );
    assert!(out.len() < 3_200 + 200, "{} characters kept", out.len());
    assert_eq!(
        strategy_of(&s, "a1-p1"),
        None,
        "a protected tool keeps its output"
    );
    let recalled = s
        .recall(&RecallKey::CallId("call_a1-p0".into()))
        .expect("recalled");
    let text = format!("{:?}", recalled.content);
    assert!(text.contains("TAIL-a1-p0") && text.len() > 20_000);
}

/// What the agent recalled is what it asked to read whole: the recall's result is never
/// capped nor masked. Before, a 20,000-character recall of a capped output was capped
/// again, its text inviting a recall of the recall: the output could never be read.
#[test]
fn a_recalls_result_is_neither_capped_nor_masked() {
    let limits = ModelLimits {
        context: 10_000,
        input: 0,
        output: 2_000,
    };
    let both = only(
        &[St::CapLargeOutputs, St::MaskObservations],
        1,
        CacheModel::NONE,
    );
    let mut s = session(both, limits);
    turn(&mut s, 1, T0, &[("bash", 20_000)]);
    assert_eq!(strategy_of(&s, "a1-p0"), Some(St::CapLargeOutputs));
    turn(&mut s, 2, T0 + 100, &[(crate::engine::RECALL_TOOL, 20_000)]);
    turn(&mut s, 3, T0 + 200, &[("bash", 10)]);
    assert_eq!(strategy_of(&s, "a2-p0"), None, "the recall stays whole");
    let v = s.build_context();
    let out = output_in(&v, "a2-p0");
    assert!(
        out.ends_with("TAIL-a2-p0") && out.len() > 20_000,
        "{} characters",
        out.len()
    );
}

/// `live` committed, then an import of its final messages (with its settings and window)
/// committed once: the marks and the context must be the same, what a from-scratch run
/// decides.
fn expect_as_imported(live: &mut Session, at: i64) {
    live.prune(PruneMode::Commit, at);
    let info = SessionInfo {
        id: "ses_cd".into(),
        limits: live.info().limits,
        config: live.info().config.clone(),
        ..Default::default()
    };
    let mut imported = Session::new(info, &chars4());
    for (info, parts) in final_messages(live) {
        go(&mut imported, Update::UpsertMessage(info), at);
        for mut p in parts {
            p.mark = None; // a host knows nothing of marks
            go(&mut imported, Update::UpsertPart(p), at);
        }
    }
    imported.prune(PruneMode::Commit, at);
    assert_eq!(marks(live), marks(&imported), "marks, live and imported");
    let (a, b) = (live.build_context(), imported.build_context());
    assert_eq!(timeless(&a), timeless(&b));
    assert_eq!(live.total_tokens(), rendered_tokens_from_scratch(live));
    assert_eq!(live.total_tokens(), imported.total_tokens());
}

/// Turn `n` as [`turn`], its calls reading the files `(path, output size)`.
fn turn_reading(s: &mut Session, n: usize, at: i64, reads: &[(&str, usize)]) {
    turn_of(s, n, at, reads.len(), |a, id, i| {
        let (path, size) = reads[i];
        let body = format!("HEAD-{id} {} TAIL-{id}", "o".repeat(size));
        read(a, id, path, &body)
    });
}

/// Found in review: of the strategies' marks only a supersede was ever taken back, so a
/// live session kept marks that a from-scratch run (an import of the same messages) no
/// longer makes. With `mask_keep` 2, a1's 4 KB output was masked when a3's result came;
/// the host then reverted a3 (OpenCode deletes its parts), or sent its call again still
/// running: a1's output is among the newest two results again and reads whole.
#[test]
fn a_mask_is_taken_back_when_a_newer_result_goes() {
    let gone = [
        Update::DeletePart {
            message_id: "a3".into(),
            part_id: "a3-p0".into(),
        },
        Update::UpsertPart({
            let input = json!({ "command": "run a3-p0" });
            let mut p = call("a3", "a3-p0", "bash", input, "");
            state_mut(&mut p).status = ToolStatus::Running;
            p
        }),
    ];
    for update in gone {
        let mut s = session(
            only(&[St::MaskObservations], 2, CacheModel::NONE),
            ModelLimits::default(),
        );
        turn(&mut s, 1, T0, &[("bash", 4_000)]);
        turn(&mut s, 2, T0 + 100, &[("bash", 400)]);
        turn(&mut s, 3, T0 + 200, &[("bash", 400)]);
        assert_eq!(strategy_of(&s, "a1-p0"), Some(St::MaskObservations));
        go(&mut s, update, T0 + 300);
        expect_as_imported(&mut s, T0 + 400);
        assert_eq!(strategy_of(&s, "a1-p0"), None);
        assert!(output_in(&s.build_context(), "a1-p0").ends_with("TAIL-a1-p0"));
    }
}

/// The same after new settings: a larger `mask_keep`, the tool or the files protected, a
/// larger window (a cap at another size). Before, every mask and cap stayed.
#[test]
fn marks_new_settings_no_longer_make_are_taken_back() {
    let small = ModelLimits {
        context: 10_000,
        input: 0,
        output: 2_000,
    };
    let config = |o: SessionOverrides| SessionInfo {
        config: o,
        ..Default::default()
    };
    let changes = [
        config(SessionOverrides {
            mask_keep: Some(5),
            ..Default::default()
        }),
        config(SessionOverrides {
            strategy_protected_tools: Some(vec!["read".into()]),
            ..Default::default()
        }),
        config(SessionOverrides {
            protected_file_globs: Some(vec!["src/**".into()]),
            ..Default::default()
        }),
        SessionInfo {
            limits: ModelLimits {
                context: 20_000,
                input: 0,
                output: 2_000,
            },
            ..Default::default()
        },
    ];
    for change in changes {
        let what = format!("{change:?}");
        let both = [St::MaskObservations, St::CapLargeOutputs];
        let mut s = session(only(&both, 1, CacheModel::NONE), small);
        turn_reading(&mut s, 1, T0, &[("src/a.rs", 20_000), ("src/b.rs", 2_000)]);
        turn_reading(&mut s, 2, T0 + 100, &[("src/c.rs", 40_000)]);
        let ids = ["a1-p0", "a1-p1", "a2-p0"];
        let kept = |s: &Session| ids.map(|id| find(s, id).mark.map(|m| (m.strategy, m.keep)));
        let before = kept(&s);
        assert_eq!(
            before.map(|m| m.map(|(st, _)| st)),
            [
                Some(St::MaskObservations),
                Some(St::MaskObservations),
                Some(St::CapLargeOutputs)
            ]
        );
        go(&mut s, Update::Configure(change), T0 + 200);
        expect_as_imported(&mut s, T0 + 300);
        assert_ne!(kept(&s), before, "{what}");
    }
}

/// Found in review: when prune cleared an output a strategy had masked (or capped, or
/// aged), the input its call stops sending was credited to prune, not to
/// `pruneToolInputs`: only a supersede strips the input, so the masked call still sent
/// it until prune cleared the output.
#[test]
fn clearing_a_masked_output_credits_its_input_to_prune_tool_inputs() {
    let o = only(
        &[St::MaskObservations, St::PruneToolInputs],
        1,
        CacheModel::NONE,
    );
    let mut s = session(o, ModelLimits::default());
    user_says(&mut s, 1, T0);
    let mut info = assistant("a1", "u1");
    info.finish.clear();
    go(&mut s, Update::UpsertMessage(info.clone()), T0);
    let input = json!({ "filePath": "src/a.rs", "content": "w".repeat(4_000) });
    let write = call("a1", "w1", "write", input, &"o".repeat(2_000));
    go(&mut s, Update::UpsertPart(write), T0);
    info.finish = "stop".into();
    go(&mut s, Update::UpsertMessage(info), T0);
    turn(&mut s, 2, T0 + 100, &[("bash", 10)]);
    turn(&mut s, 3, T0 + 200, &[("bash", 10)]);
    assert_eq!(strategy_of(&s, "w1"), Some(St::MaskObservations));
    let clear = SessionOverrides {
        prune_protect: Some(0),
        prune_minimum: Some(0),
        ..Default::default()
    };
    go(
        &mut s,
        Update::Configure(SessionInfo {
            config: clear,
            ..Default::default()
        }),
        T0 + 300,
    );
    let before = part_tokens(&s.build_context(), "w1");
    let report = s.prune(PruneMode::Commit, T0 + 400);
    let after = part_tokens(&s.build_context(), "w1");
    assert!(report.committed && after < before, "{before} -> {after}");
    assert_eq!(part_ids(&report), ["w1"]);
    // The output reads as masked either way: the whole change is the input's.
    assert_eq!(report.context_tokens_saved, 0);
    assert_eq!(
        saving(&report, St::PruneToolInputs),
        Some((1, before - after))
    );
}

/// Masking (keep 3) and capping under Anthropic's prices, a 200k window, nothing yet.
fn masking_under_anthropic_prices() -> Session {
    let limits = ModelLimits {
        context: 200_000,
        input: 0,
        output: 32_000,
    };
    session(
        only(
            &[St::MaskObservations, St::CapLargeOutputs],
            3,
            CacheModel::ANTHROPIC,
        ),
        limits,
    )
}

/// [`masking_under_anthropic_prices`] after two turns: a1's 400-token output, then
/// a2's 40,000.
fn two_turns_under_anthropic_prices() -> Session {
    let mut s = masking_under_anthropic_prices();
    turn(&mut s, 1, T0, &[("bash", 400)]);
    turn(&mut s, 2, T0 + 1_000, &[("bash", 40_000)]);
    s
}

#[test]
fn a_small_saving_on_a_cached_part_is_held_and_fresh_parts_still_change() {
    let mut s = two_turns_under_anthropic_prices();
    // a3's outputs are new: capping a3-p0 costs nothing; masking a1-p0 saves 100 tokens
    // but rewrites the 10,000 cached after it.
    let events = turn(&mut s, 3, T0 + 2_000, &[("bash", 600_000), ("bash", 100)]);
    assert_eq!(marked(&events), ["a3-p0"]);
    assert_eq!(strategy_of(&s, "a3-p0"), Some(St::CapLargeOutputs));
    assert_eq!(strategy_of(&s, "a1-p0"), None, "held");
    let d = s.clone().schedule(T0 + 2_020);
    assert_eq!(d.why, Why::Held, "{d:?}");
    assert!(d.saved > 0 && d.tail > 10 * d.saved, "{d:?}");
    assert!(!pays(d.saved, d.tail, d.horizon, 0.1, 1.25));

    // A user message within the TTL keeps it held; an explicit prune applies it.
    let mut warm = s.clone();
    let events = user_says(&mut warm, 4, T0 + 2_010 + TTL);
    assert!(marked(&events).is_empty(), "{events:?}");
    let report = warm.prune(PruneMode::Commit, T0 + 2_010 + TTL);
    assert!(report.strategies.parts.iter().any(|m| m.part_id == "a1-p0"));
    assert_eq!(strategy_of(&warm, "a1-p0"), Some(St::MaskObservations));

    // A user message after the TTL: the cache is cold anyway, everything held applies.
    let events = user_says(&mut s, 4, T0 + 2_010 + TTL + 1);
    assert!(marked(&events).contains(&"a1-p0".to_string()), "{events:?}");
}

/// A host compaction that keeps a tail reorders the prompt ([B, S, tail…]): nothing
/// after the system prompt is cached for the next request, so a decision held to spare
/// the cache costs nothing until that request is sent, and applies at the next user
/// message. Before, the scheduler went on weighing the old prefix: held (tail 10,206),
/// read again at every request, or paid for later as a real rewrite.
#[test]
fn after_a_compaction_held_decisions_apply_before_the_next_request() {
    let mut s = two_turns_under_anthropic_prices();
    turn(&mut s, 3, T0 + 2_000, &[("bash", 600_000), ("bash", 100)]);
    assert_eq!(strategy_of(&s, "a1-p0"), None, "held");
    assert_eq!(s.clone().schedule(T0 + 2_020).why, Why::Held);
    // The host compacts, keeping u1 on as its tail.
    let mut c = user("c1");
    c.time.created = T0 + 3_000;
    go(&mut s, Update::UpsertMessage(c), T0 + 3_000);
    let mut part = compaction("c1", "c1-p");
    if let PartKind::Compaction(cp) = &mut part.kind {
        cp.tail_start_id = "u1".into();
    }
    go(&mut s, Update::UpsertPart(part), T0 + 3_000);
    let mut summary = summary("s1", "c1");
    summary.time.created = T0 + 3_001;
    go(&mut s, Update::UpsertMessage(summary.clone()), T0 + 3_001);
    go(
        &mut s,
        Update::UpsertPart(text("s1", "s1-t", "What happened so far.")),
        T0 + 3_002,
    );
    assert!(s.build_context().boundary_message_id.is_some(), "compacted");
    let d = s.clone().schedule(T0 + 3_020);
    assert_ne!(d.why, Why::Held, "{d:?}");
    // The next user message (within the TTL) applies what was held.
    user_says(&mut s, 4, T0 + 3_030);
    assert_eq!(strategy_of(&s, "a1-p0"), Some(St::MaskObservations));
}

/// compactd's own automatic compaction writes the message that continues the session
/// itself: no host message follows to apply what is held before that request, the first
/// on the reordered context, of which nothing is cached. The commit applies it. Before,
/// the held masking of a1-p0 (in the verbatim tail) went out with the continuing request
/// and was weighed afresh against the cache that request wrote.
#[test]
fn compactds_own_compaction_applies_what_is_held_in_its_commit() {
    let mut s = masking_under_anthropic_prices();
    turn(&mut s, 0, T0 - 1_000, &[("bash", 100)]);
    turn(&mut s, 1, T0, &[("bash", 400)]);
    turn(&mut s, 2, T0 + 1_000, &[("bash", 40_000)]);
    turn(&mut s, 3, T0 + 2_000, &[("bash", 600_000), ("bash", 100)]);
    assert_eq!(strategy_of(&s, "a1-p0"), None, "held");
    assert_eq!(s.clone().schedule(T0 + 2_020).why, Why::Held);
    let tail = crate::engine::TailOptions {
        turns: 3,
        max_tokens: 1_000_000,
    };
    let plan = s
        .plan_compaction(crate::engine::CompactionRequest {
            tail,
            auto: true,
            overflow: true,
        })
        .expect("plan");
    let outcome = crate::engine::SummaryOutcome {
        text: "What happened so far.".into(),
        ..Default::default()
    };
    let ids = crate::engine::CommitIds {
        prefix: "cmp1".into(),
    };
    let done = s
        .commit_compaction(&plan, &outcome, &ids, T0 + 3_000, &chars4())
        .expect("commit");
    let ids_now = super::super::compaction::context_ids(&s);
    assert_eq!(
        ids_now[..2],
        [
            done.user_message_id.clone(),
            done.summary_message_id.clone()
        ]
    );
    assert_eq!(strategy_of(&s, "a1-p0"), Some(St::MaskObservations));
    assert_eq!(
        done.tokens_after,
        s.context_tokens(),
        "after what it applied"
    );
}

/// An output masked by observation masking recalls as `masked` (it reads as a
/// placeholder naming the call), not as cut short. Before, `truncated`.
#[test]
fn a_masked_output_recalls_as_masked() {
    let mut s = session(
        only(&[St::MaskObservations], 1, CacheModel::NONE),
        ModelLimits::default(),
    );
    turn(&mut s, 1, T0, &[("bash", 2_000)]);
    turn(&mut s, 2, T0 + 1_000, &[("bash", 2_000)]);
    turn(&mut s, 3, T0 + 2_000, &[("bash", 2_000)]);
    assert_eq!(strategy_of(&s, "a1-p0"), Some(St::MaskObservations));
    let r = s
        .recall(&RecallKey::PartId("a1-p0".into()))
        .expect("recalled");
    assert_eq!(r.reduction, Some(crate::engine::Reduction::Masked));
    assert!(r.context_tokens < r.tokens, "{r:?}");
}

#[test]
fn a_saving_that_pays_for_the_rewrite_applies_at_once() {
    let mut s = session(
        only(&[St::MaskObservations], 1, CacheModel::ANTHROPIC),
        ModelLimits::default(),
    );
    turn(&mut s, 1, T0, &[("bash", 40_000)]);
    let mut probe = s.clone();
    user_says(&mut probe, 2, T0 + 1_000);
    let events = turn(&mut s, 2, T0 + 1_000, &[("bash", 100), ("bash", 100)]);
    // a2-p0 waits for a later step: the model has not seen it yet.
    assert_eq!(marked(&events), ["a1-p0"]);
    // What the scheduler weighed at that finish: nearly the whole tail is saved.
    let mut a = assistant("a2", "u2");
    a.time.created = T0 + 1_001;
    a.finish.clear();
    go(&mut probe, Update::UpsertMessage(a.clone()), T0 + 1_001);
    for (i, size) in [100usize, 100].iter().enumerate() {
        let id = format!("a2-p{i}");
        let body = format!("HEAD-{id} {} TAIL-{id}", "o".repeat(*size));
        let p = call(
            "a2",
            &id,
            "bash",
            json!({ "command": format!("run {id}") }),
            &body,
        );
        go(&mut probe, Update::UpsertPart(p), T0 + 1_002);
    }
    let d = probe.schedule(T0 + 1_010);
    assert_eq!(d.why, Why::Pays, "{d:?}");
}

/// Masking (keep 1) in a window of 10,000 usable tokens (threshold 9,200), after one
/// turn with a 400-character output.
fn small_window_after_one_turn() -> Session {
    let limits = ModelLimits {
        context: 12_000,
        input: 0,
        output: 2_000,
    };
    let mut s = session(
        only(&[St::MaskObservations], 1, CacheModel::ANTHROPIC),
        limits,
    );
    turn(&mut s, 1, T0, &[("bash", 400)]);
    s
}

#[test]
fn near_the_threshold_everything_held_applies() {
    let mut s = small_window_after_one_turn();
    let small = turn(&mut s, 2, T0 + 1_000, &[("bash", 3_000)]);
    assert!(
        !marked(&small).contains(&"a1-p0".to_string()),
        "held while far from it"
    );
    let outputs = [("bash", 3_900); 10];
    let events = turn(&mut s, 3, T0 + 2_000, &outputs);
    assert!(marked(&events).contains(&"a1-p0".to_string()), "{events:?}");
}

#[test]
fn past_the_threshold_whatever_is_sent_next_everything_applies_unweighed() {
    let mut s = small_window_after_one_turn();
    // About 11,000 tokens sent: over the threshold before the next turn adds anything.
    turn(&mut s, 2, T0 + 1_000, &[("bash", 44_000)]);
    let small = [("bash", 400)];
    let mut probe = s.clone();
    user_says(&mut probe, 3, T0 + 2_000);
    let mut a = assistant("a3", "u3");
    a.time.created = T0 + 2_001;
    go(&mut probe, Update::UpsertMessage(a), T0 + 2_001);
    let check = probe.check_overflow(Trigger::Finished);
    assert!(probe.overflow_certain(&check), "{check:?}");
    // What weighing would have decided, and what the commit decides without it.
    let (weighed, _) = probe.clone().weigh_by_trial(check, T0 + 2_010, false);
    assert_eq!(weighed.why, Why::NearOverflow, "{weighed:?}");
    let d = probe.schedule(T0 + 2_010);
    assert_eq!(
        d,
        Decision {
            scope: Scope::All,
            ..weighed
        }
    );
    // The cached a2-p0 is masked at once.
    let events = turn(&mut s, 3, T0 + 2_000, &small);
    assert!(marked(&events).contains(&"a2-p0".to_string()), "{events:?}");
}

#[test]
fn with_the_none_model_or_the_opencode_preset_decisions_apply_at_once() {
    for o in [
        only(&[St::MaskObservations], 1, CacheModel::NONE),
        SessionOverrides {
            preset: Some(crate::config::OverflowPreset::OpenCode),
            cache_model: None,
            ..only(&[St::MaskObservations], 1, CacheModel::ANTHROPIC)
        },
    ] {
        let mut s = session(o, ModelLimits::default());
        turn(&mut s, 1, T0, &[("bash", 400)]);
        let events = turn(&mut s, 2, T0 + 1_000, &[("bash", 40_000), ("bash", 40_000)]);
        assert_eq!(marked(&events), ["a1-p0"], "a2-p0 is not seen yet");
        let events = turn(&mut s, 3, T0 + 2_000, &[("bash", 400)]);
        assert_eq!(marked(&events), ["a2-p0", "a2-p1"]);
    }
}

// ---- properties ------------------------------------------------------------------------

/// One turn of a random session: the gap before it (ms), its outputs, and a pin.
#[derive(Debug, Clone)]
struct Turn {
    gap: i64,
    outputs: Vec<(bool, u16)>,
    pin: Option<u8>,
}

fn turn_strategy() -> impl Strategy<Value = Turn> {
    (
        prop_oneof![4 => 1_000i64..60_000, 1 => 290_000i64..400_000],
        prop::collection::vec((prop::bool::weighted(0.1), 0u16..12_000), 0..5),
        prop::option::weighted(0.2, any::<u8>()),
    )
        .prop_map(|(gap, outputs, pin)| Turn { gap, outputs, pin })
}

/// The automatic commit keeps the scheduler's trial run when it applies everything:
/// checks it leaves the session, report and decision exactly as weighing, rolling back
/// and running the commit again do.
fn same_as_weighing_then_committing(before: &Session, at: i64) -> Result<(), TestCaseError> {
    let mut kept = before.clone();
    let (report, decision) = kept.auto_commit(at);
    let mut made = before.clone();
    let weighed = made.schedule(at);
    let committed = made.prune_scoped(at, weighed.scope);
    prop_assert_eq!(decision, weighed);
    prop_assert_eq!(report, committed);
    crate::engine::tests::snapshot::assert_same(&kept, &made, "kept trial vs commit run");
    Ok(())
}

/// Parts (by position) whose context tokens differ between two contexts.
fn changed(before: &Session, after: &Session) -> Vec<((usize, usize), u64, u64)> {
    let mut out = Vec::new();
    for (mi, (b, a)) in before.messages().iter().zip(after.messages()).enumerate() {
        for (pi, (pb, pa)) in b.parts.iter().zip(&a.parts).enumerate() {
            if pb.context_tokens() != pa.context_tokens() {
                out.push(((mi, pi), pb.context_tokens(), pa.context_tokens()));
            }
        }
    }
    out
}

fn run_turns(turns: &[Turn], keep: u32, context: u64) -> Result<Session, TestCaseError> {
    let limits = ModelLimits {
        context,
        input: 0,
        output: 8_000,
    };
    let mut o = only(
        &[St::MaskObservations, St::CapLargeOutputs],
        keep,
        CacheModel::ANTHROPIC,
    );
    o.prune_minimum = None; // OpenCode's prune takes part too
    o.prune_protect = Some(4_000);
    let mut s = session(o, limits);
    let mut originals: BTreeMap<String, String> = BTreeMap::new();
    let mut pinned: Vec<String> = Vec::new();
    let mut at = T0;
    for (n, t) in turns.iter().enumerate() {
        at += t.gap;
        user_says(&mut s, n, at);
        let (u, a) = (format!("u{n}"), format!("a{n}"));
        let mut info = assistant(&a, &u);
        info.time.created = at + 1;
        info.finish.clear();
        go(&mut s, Update::UpsertMessage(info.clone()), at + 1);
        for (i, (task, size)) in t.outputs.iter().enumerate() {
            let id = format!("{a}-p{i}");
            let body = format!("{id}:{}", "x".repeat(usize::from(*size)));
            let tool = if *task { "task" } else { "bash" };
            let p = call(&a, &id, tool, json!({ "command": id }), &body);
            go(&mut s, Update::UpsertPart(p), at + 2);
            originals.insert(id, body);
        }
        if let Some(k) = t.pin.filter(|_| !originals.is_empty()) {
            let id = originals
                .keys()
                .nth(usize::from(k) % originals.len())
                .cloned()
                .unwrap_or_default();
            let msg = id.split('-').next().unwrap_or_default().to_string();
            let pin = Update::Pin {
                message_id: msg,
                part_id: Some(id.clone()),
                pinned: true,
            };
            go(&mut s, pin, at + 3);
            pinned.push(id);
        }
        info.finish = "tool-calls".into();
        info.time.completed = Some(at + 10);
        // What the scheduler decides at this finish, on a copy holding the finished info.
        let mut before = s.clone();
        before
            .apply(Update::UpsertMessage(info.clone()), &chars4())
            .map_err(|e| TestCaseError::fail(e.to_string()))?;
        let d = before.clone().schedule(at + 10);
        same_as_weighing_then_committing(&before, at + 10)?;
        // Weighing skipped because the overflow is certain decides as weighing would.
        let check = before.check_overflow(Trigger::Finished);
        if before.overflow_certain(&check) {
            let (weighed, _) = before.clone().weigh_by_trial(check, at + 10, false);
            prop_assert_eq!(weighed.why, Why::NearOverflow, "{:?}", weighed);
        }
        go(&mut s, Update::UpsertMessage(info), at + 10);
        let changes = changed(&before, &s);
        let cached: Vec<_> = changes
            .iter()
            .filter(|((m, p), ..)| before.request_log().is_sent(*m, *p))
            .collect();
        // The scheduler never applies a change to a cached part the cost model rejects,
        // unless an overflow is near (the cold case comes with user messages, below).
        if d.why == Why::Held {
            prop_assert!(
                cached.is_empty(),
                "held, yet cached parts changed: {cached:?} {d:?}"
            );
        }
        if !cached.is_empty() {
            prop_assert!(
                matches!(d.why, Why::Pays | Why::NearOverflow),
                "cached parts changed under {d:?}"
            );
        }
        if d.why == Why::Pays {
            prop_assert!(pays(d.saved, d.tail, d.horizon, 0.1, 1.25));
            // The figures it weighed, recounted here.
            let saved: u64 = cached.iter().map(|(_, b, a)| b.saturating_sub(*a)).sum();
            prop_assert_eq!(d.saved, saved);
            let first = cached.iter().map(|(at, ..)| *at).min().expect("a change");
            prop_assert_eq!(d.first, Some(first), "{:?} {:?}", d, cached);
            let log = before.request_log();
            let tail: u64 = before
                .messages()
                .iter()
                .enumerate()
                .flat_map(|(m, msg)| {
                    msg.parts
                        .iter()
                        .enumerate()
                        .map(move |(p, part)| ((m, p), part))
                })
                .filter(|(at, _)| *at >= first && log.is_sent(at.0, at.1))
                .map(|(_, p)| p.context_tokens())
                .sum();
            prop_assert_eq!(d.tail, tail);
        }
        check_policies(&s, &originals, &pinned)?;
    }
    Ok(s)
}

/// What holds after every step: originals kept, nothing reads longer than it is, pins
/// untouched, and the running figures equal a recount.
fn check_policies(
    s: &Session,
    originals: &BTreeMap<String, String>,
    pinned: &[String],
) -> Result<(), TestCaseError> {
    for m in s.messages() {
        for p in &m.parts {
            // A strategy never makes a part longer (OpenCode's prune placeholder may be, on
            // tiny outputs: it renders regardless, and conformance keeps it so).
            let full = p.est.base.saturating_add(p.est.output);
            if !p.is_compacted() {
                prop_assert!(p.context_tokens() <= full, "{} reads longer", p.part.id);
            }
            if let PartKind::Tool(t) = &p.part.kind
                && let Some(original) = originals.get(&p.part.id)
            {
                prop_assert_eq!(&t.state.output, original, "lazy: the original is kept");
            }
            if pinned.contains(&p.part.id) {
                prop_assert!(
                    p.part.mark.is_none() && !p.is_compacted(),
                    "pinned {} touched",
                    p.part.id
                );
            }
        }
    }
    prop_assert_eq!(s.total_tokens(), rendered_tokens_from_scratch(s));
    // The per-message index the scheduler reads agrees with the parts, message by message.
    for (i, m) in s.messages().iter().enumerate() {
        let own: u64 = m.parts.iter().map(|p| p.context_tokens()).sum();
        prop_assert_eq!(s.tokens_between(i, i + 1), own, "message {}", i);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 64,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    /// The scheduler's decisions agree with the cost model at every finished message.
    #[test]
    fn the_scheduler_only_rewrites_the_cache_when_the_cost_model_allows(
        keep in 0u32..4,
        turns in prop::collection::vec(turn_strategy(), 1..14),
        // Two windows: the small one keeps the session near or past its threshold.
        context in prop::sample::select(vec![16_000u64, 40_000]),
    ) {
        run_turns(&turns, keep, context)?;
    }

    /// Masking and the cap decide the same whether the session streamed in live or was
    /// imported (after an explicit commit applies everything held).
    #[test]
    fn masking_and_the_cap_mark_the_same_live_and_imported(
        keep in 0u32..4,
        turns in prop::collection::vec(turn_strategy(), 1..10),
    ) {
        let mut o = only(&[St::MaskObservations, St::CapLargeOutputs], keep, CacheModel::ANTHROPIC);
        o.prune_minimum = Some(u64::MAX);
        let limits = ModelLimits { context: 40_000, input: 0, output: 8_000 };
        let mut live = run_turns_with(&turns, o.clone(), limits);
        let mut imported = session(o, limits);
        for (info, parts) in final_messages(&live) {
            imported.apply(Update::UpsertMessage(info), &chars4()).map_err(|e| TestCaseError::fail(e.to_string()))?;
            for p in parts {
                imported.apply(Update::UpsertPart(p), &chars4()).map_err(|e| TestCaseError::fail(e.to_string()))?;
            }
        }
        live.prune(PruneMode::Commit, T0);
        imported.prune(PruneMode::Commit, T0);
        let strategies = |s: &Session| -> BTreeMap<String, Option<St>> {
            s.messages().iter().flat_map(|m| &m.parts)
                .map(|p| (p.part.id.clone(), p.part.mark.as_ref().map(|m| m.strategy)))
                .collect()
        };
        prop_assert_eq!(strategies(&live), strategies(&imported));
    }
}

/// [`run_turns`] without the checks or pins, for a given session setup.
fn run_turns_with(turns: &[Turn], o: SessionOverrides, limits: ModelLimits) -> Session {
    let mut s = session(o, limits);
    let mut at = T0;
    for (n, t) in turns.iter().enumerate() {
        at += t.gap;
        let outputs: Vec<(&str, usize)> = t
            .outputs
            .iter()
            .map(|(task, size)| (if *task { "task" } else { "bash" }, usize::from(*size)))
            .collect();
        turn(&mut s, n, at, &outputs);
    }
    s
}

#[test]
fn no_more_than_max_held_decisions_wait() {
    use crate::engine::scheduler::MAX_HELD;
    for (n, applied) in [(MAX_HELD / 2, false), (MAX_HELD + 10, true)] {
        let mut s = session(
            only(&[St::MaskObservations], n as u32, CacheModel::ANTHROPIC),
            ModelLimits::default(),
        );
        let small = vec![("bash", 160); n];
        turn(&mut s, 1, T0, &small);
        turn(&mut s, 2, T0 + 1_000, &[("bash", 40_000)]);
        // Each of turn 3's results pushes one of turn 1's out of the newest `n`: a small
        // saving each, against the cached 10,000-token output after them.
        turn(&mut s, 3, T0 + 2_000, &small);
        assert_eq!(
            strategy_of(&s, "a1-p0") == Some(St::MaskObservations),
            applied,
            "{n} decisions"
        );
    }
}

/// Part ids are scoped to their message: a host that numbers each message's parts from
/// `p0` has its results masked as one whose ids are unique. Before, masking took a result
/// whose id it had seen in any message as a re-sent one: only a1's `p0` was ever counted,
/// and nothing was masked.
#[test]
fn masking_counts_results_by_message_and_part_id() {
    let mut s = session(
        only(&[St::MaskObservations], 1, CacheModel::NONE),
        ModelLimits::default(),
    );
    let p0_turn = |s: &mut Session, n: usize| {
        turn_of(s, n, T0 + 10 * n as i64, 1, |a, _, _| {
            let input = json!({ "command": format!("run {a}") });
            call(a, "p0", "bash", input, &"o".repeat(4_000))
        });
    };
    for n in 1..=3 {
        p0_turn(&mut s, n);
    }
    let marks = |s: &Session| {
        s.messages()
            .iter()
            .filter(|m| m.info.role == Role::Assistant)
            .map(|m| m.parts[0].part.mark.as_ref().map(|m| m.strategy))
            .collect::<Vec<_>>()
    };
    let masked = Some(St::MaskObservations);
    assert_eq!(marks(&s), [masked, masked, None]);
    assert_eq!(s.total_tokens(), rendered_tokens_from_scratch(&s));
    // A snapshot keeps what masking counted: restored, the next turn masks as live.
    let mut restored =
        crate::engine::decode_session(&crate::engine::encode_session(&s)).expect("decodes");
    p0_turn(&mut s, 4);
    p0_turn(&mut restored, 4);
    assert_eq!(marks(&s), [masked, masked, masked, None]);
    assert_eq!(marks(&restored), marks(&s));
}

/// The results that wait are those of the newest message with results, whatever order
/// they arrive in. a2's three results complete while a1's `task` call still runs; a1's
/// result arrives last. Before, masking took the message of the result that just
/// arrived (a1) for the newest and masked a2's q0 and q1 at once, before any request had
/// sent them (a rebuild, which feeds the results in position order, masks neither).
/// (The late call is a protected tool, as a sub-agent's `task` often is: a rebuild masks
/// a late unprotected result, which it cannot tell from one the model has seen.)
#[test]
fn masking_waits_for_the_newest_message_with_results_when_an_older_result_arrives_late() {
    let mut o = only(&[St::MaskObservations], 2, CacheModel::NONE);
    o.strategy_protected_tools = Some(vec!["task".into()]);
    let mut s = session(o, ModelLimits::default());
    user_says(&mut s, 1, T0);
    let body = |id: &str| format!("HEAD-{id} {} TAIL-{id}", "o".repeat(4_000));
    let mut a1 = assistant("a1", "u1");
    a1.time.created = T0 + 1;
    a1.finish.clear();
    go(&mut s, Update::UpsertMessage(a1.clone()), T0 + 1);
    let mut task = call("a1", "a1-p0", "task", json!({ "prompt": "look" }), "");
    state_mut(&mut task).status = ToolStatus::Running;
    go(&mut s, Update::UpsertPart(task.clone()), T0 + 2);
    let mut a2 = assistant("a2", "u1");
    a2.time.created = T0 + 3;
    a2.finish.clear();
    go(&mut s, Update::UpsertMessage(a2.clone()), T0 + 3);
    for q in ["a2-q0", "a2-q1", "a2-q2"] {
        let input = json!({ "command": format!("run {q}") });
        go(
            &mut s,
            Update::UpsertPart(call("a2", q, "bash", input, &body(q))),
            T0 + 4,
        );
    }
    // a1's call completes late.
    let state = state_mut(&mut task);
    state.status = ToolStatus::Completed;
    state.output = body("a1-p0");
    go(&mut s, Update::UpsertPart(task), T0 + 5);
    a1.finish = "tool-calls".into();
    a1.time.completed = Some(T0 + 6);
    go(&mut s, Update::UpsertMessage(a1), T0 + 6);
    a2.finish = "tool-calls".into();
    a2.time.completed = Some(T0 + 7);
    go(&mut s, Update::UpsertMessage(a2), T0 + 7);
    assert_eq!(
        ["a1-p0", "a2-q0", "a2-q1", "a2-q2"].map(|id| strategy_of(&s, id)),
        [None, None, None, None],
        "nothing masked before a request sent it"
    );
    expect_as_imported(&mut s, T0 + 8);
}

#[test]
fn decisions_already_applied_do_not_count_as_held_after_a_rebuild() {
    // Each user message finds the cache cold, so the masks held on sent parts apply.
    // A failed step then settles the marks (a rebuild, which queues every decision the
    // history makes). Before, those already applied stayed queued: past MAX_HELD the next
    // finished message applied everything at once (`TooMany`), a rewrite that did not pay.
    use crate::engine::scheduler::MAX_HELD;
    let mut s = session(
        only(&[St::MaskObservations], 1, CacheModel::ANTHROPIC),
        ModelLimits::default(),
    );
    let gap = TTL + 1_000;
    let n = MAX_HELD + 20;
    for i in 1..=n {
        turn(&mut s, i, T0 + i as i64 * gap, &[("bash", 2_000)]);
    }
    assert!(s.tracker_pending() <= 1, "{}", s.tracker_pending());
    let at = T0 + (n as i64 + 1) * gap;
    let mut bad = assistant("ax", &format!("u{n}"));
    bad.finish.clear();
    bad.time.created = at;
    go(&mut s, Update::UpsertMessage(bad.clone()), at);
    bad.error = Some(crate::domain::MessageError {
        name: "APIError".into(),
        data: json!({ "message": "overloaded" }),
    });
    go(&mut s, Update::UpsertMessage(bad), at);
    assert!(s.tracker_pending() <= 1, "{}", s.tracker_pending());
    assert_ne!(s.schedule(at).why, Why::TooMany);
    // A change that leaves the state to be rebuilt at the next run (an assistant's text
    // deleted), then a dry-run prune: the rebuild drops the applied decisions too.
    let last = format!("a{n}");
    go(&mut s, Update::UpsertPart(text(&last, "note", "Done.")), at);
    go(
        &mut s,
        Update::DeletePart {
            message_id: last,
            part_id: "note".into(),
        },
        at,
    );
    s.prune(crate::engine::PruneMode::DryRun, at);
    assert!(s.tracker_pending() <= 1, "{}", s.tracker_pending());
    assert_ne!(s.schedule(at).why, Why::TooMany);
}
