//! Compaction planning and commit: the verbatim tail, folding the previous summary,
//! deterministic anchors, messages that arrive while the summarizer runs, and rejections
//! that leave the session untouched.

use super::*;
use crate::domain::{Todo, TokenUsage};
use crate::engine::{
    AUTO_CONTINUE, CommitIds, CompactionError, CompactionPlan, CompactionRequest, SummaryOutcome,
    TailOptions, Trigger,
};

pub(super) const TAIL: TailOptions = TailOptions {
    turns: 2,
    max_tokens: 15_000,
};

pub(super) fn req(tail: TailOptions, auto: bool) -> CompactionRequest {
    CompactionRequest {
        tail,
        auto,
        overflow: auto,
    }
}

fn outcome(text: &str) -> SummaryOutcome {
    SummaryOutcome {
        text: text.into(),
        usage: Some(TokenUsage {
            input: 900,
            output: 40,
            ..Default::default()
        }),
        cost: 0.0,
        model: None,
    }
}

fn ids(n: u32) -> CommitIds {
    CommitIds {
        prefix: format!("cmp{n}"),
    }
}

pub(super) fn commit(
    s: &mut Session,
    plan: &CompactionPlan,
    text: &str,
    auto: bool,
    n: u32,
) -> crate::engine::Committed {
    {
        let mut plan = plan.clone();
        plan.request.auto = auto;
        plan.request.overflow = auto;
        s.commit_compaction(&plan, &outcome(text), &ids(n), NOW, &config())
    }
    .unwrap_or_else(|e| panic!("commit failed: {e}"))
}

/// Ids of the context's messages, in order.
pub(super) fn context_ids(s: &Session) -> Vec<String> {
    s.build_context()
        .messages
        .iter()
        .map(|m| m.info.id.clone())
        .collect()
}

/// [`FIXTURE`] with prune protecting only the newest 100 tokens and no minimum saving.
fn fixture_pruning_past_100_tokens() -> Session {
    session_with(
        FIXTURE,
        SessionOverrides {
            prune_protect: Some(100),
            prune_minimum: Some(0),
            ..Default::default()
        },
    )
}

fn ids_of(s: &Session, positions: &[usize]) -> Vec<String> {
    positions
        .iter()
        .map(|&i| s.messages()[i].info.id.clone())
        .collect()
}

pub(super) const FIXTURE: &str = "
    user u1 text:t1=10
    assistant a1 read:p1=3000
    user u2 text:t2=10
    assistant a2 bash:p2=200
    user u3 text:t3=10
    assistant a3 text:t4=50
";

#[test]
fn tail_keeps_the_last_two_user_turns() {
    let s = session(FIXTURE);
    let plan = s.plan_compaction(req(TAIL, true)).expect("plan");
    assert_eq!(ids_of(&s, &plan.head), ["u1", "a1"]);
    assert_eq!(
        plan.tail_start.map(|i| s.messages()[i].info.id.clone()),
        Some("u2".into())
    );
    assert_eq!(plan.previous_summary, None);
    assert_eq!(plan.covers, 6);
    assert_eq!(plan.tokens_before, s.context_tokens());
}

/// An errored assistant message is not sent: its parts take no room in the tail's budget
/// (before, 16,000 tokens of a failed step's text pushed u2's turn into the head though
/// the context never sends them), and a summary is not measured against them.
#[test]
fn the_tail_budget_leaves_out_what_is_not_sent() {
    let s = session(
        "user u1 text:t1=10
         assistant a1 read:p1=3000
         user u2 text:t2=10
         assistant a2 error=APIError text:t3=16000
         user u3 text:t4=10
         assistant a3 text:t5=50",
    );
    let plan = s.plan_compaction(req(TAIL, true)).expect("plan");
    assert_eq!(ids_of(&s, &plan.head), ["u1", "a1"]);
    assert_eq!(
        plan.tail_start.map(|i| s.messages()[i].info.id.clone()),
        Some("u2".into())
    );
}

#[test]
fn tail_budget_drops_turns_that_do_not_fit() {
    let s = session(FIXTURE);
    // u2..a3 hold ~280 tokens; u3..a3 ~60.
    let plan = s
        .plan_compaction(req(
            TailOptions {
                turns: 2,
                max_tokens: 100,
            },
            true,
        ))
        .expect("plan");
    assert_eq!(ids_of(&s, &plan.head), ["u1", "a1", "u2", "a2"]);
    // Nothing fits: everything is summarized.
    let plan = s
        .plan_compaction(req(
            TailOptions {
                turns: 2,
                max_tokens: 10,
            },
            true,
        ))
        .expect("plan");
    assert_eq!(plan.tail_start, None);
    assert_eq!(plan.head.len(), 6);
    // No tail asked for.
    let plan = s
        .plan_compaction(req(
            TailOptions {
                turns: 0,
                max_tokens: 15_000,
            },
            true,
        ))
        .expect("plan");
    assert_eq!(plan.head.len(), 6);
}

/// A turn larger than what the tail has left keeps its newest steps that fit, as
/// OpenCode's `splitTurn` does. Before, the tail was left empty: an agent in the middle of
/// a long turn lost every step of it, its latest tool results included, to the summary.
#[test]
fn a_turn_too_large_for_the_tail_keeps_its_newest_steps() {
    let s = session(
        "user u1 text:t1=10
         assistant a1 text:t2=50
         user u2 text:t3=10
         assistant a2 read:p1=3000
         assistant a3 bash:p2=200
         assistant a4 text:t4=50",
    );
    let budget = |max_tokens| TailOptions {
        turns: 2,
        max_tokens,
    };
    let plan = s.plan_compaction(req(budget(300), true)).expect("plan");
    assert_eq!(ids_of(&s, &plan.head), ["u1", "a1", "u2", "a2"]);
    assert_eq!(
        plan.tail_start.map(|i| s.messages()[i].info.id.clone()),
        Some("a3".into())
    );
    // Only the last step fits.
    let plan = s.plan_compaction(req(budget(100), true)).expect("plan");
    assert_eq!(
        plan.tail_start.map(|i| s.messages()[i].info.id.clone()),
        Some("a4".into())
    );

    // The split turn is the last one kept: an older turn never follows it in.
    let mut s = session(
        "user u1 text:t1=10
         assistant a1 text:t2=50
         user u2 text:t3=10
         assistant a2 read:p1=3000
         assistant a3 text:t4=50
         user u3 text:t5=10
         assistant a4 text:t6=50",
    );
    let plan = s.plan_compaction(req(budget(300), true)).expect("plan");
    assert_eq!(ids_of(&s, &plan.head), ["u1", "a1", "u2", "a2"]);
    // The context after the commit: the summary, then the kept steps, then the newer turn.
    commit(&mut s, &plan, "summary", false, 1);
    assert_eq!(
        context_ids(&s),
        ["cmp1_user", "cmp1_summary", "a3", "u3", "a4"]
    );
}

#[test]
fn nothing_to_compact_when_everything_is_tail() {
    let s = session("user u1 text:t1=10\nassistant a1 text:t2=10");
    assert_eq!(
        s.plan_compaction(req(TAIL, true)),
        Err(CompactionError::NothingToCompact)
    );
}

#[test]
fn commit_records_opencodes_shape_and_the_context_starts_at_it() {
    let mut s = session(FIXTURE);
    let plan = s.plan_compaction(req(TAIL, true)).expect("plan");
    let before = s.context_tokens();
    let done = commit(&mut s, &plan, "We fixed the parser; next: tests.", true, 1);

    let user = &s.messages()[s.position(&done.user_message_id).unwrap()];
    assert_eq!(user.info.role, Role::User);
    match &user.parts[0].part.kind {
        PartKind::Compaction(c) => {
            assert!(c.auto && c.overflow);
            assert_eq!(c.tail_start_id, "u2");
        }
        other => panic!("expected a compaction part, got {other:?}"),
    }
    let summary = &s.messages()[s.position(&done.summary_message_id).unwrap()];
    assert!(summary.info.summary);
    assert_eq!(
        (summary.info.mode.as_str(), summary.info.agent.as_str()),
        ("compaction", "compaction")
    );
    assert_eq!(summary.info.parent_id, done.user_message_id);
    assert_eq!(summary.info.finish, "stop");
    assert_eq!(summary.info.tokens.map(|t| t.input), Some(900));

    // Context: compaction message, summary, verbatim tail, then the auto-continue.
    assert_eq!(
        context_ids(&s),
        [
            "cmp1_user",
            "cmp1_summary",
            "u2",
            "a2",
            "u3",
            "a3",
            "cmp1_continue"
        ]
    );
    let view = s.build_context();
    assert_eq!(view.boundary_message_id.as_deref(), Some("cmp1_user"));
    let openai = view.to_openai();
    assert_eq!(
        openai[0],
        serde_json::json!({"role": "user", "content": "What did we do so far?"})
    );
    assert_eq!(openai[1]["content"], "We fixed the parser; next: tests.");
    let last = &openai[openai.as_array().unwrap().len() - 1];
    assert_eq!(last["content"], AUTO_CONTINUE);

    assert_eq!(done.tokens_before, before);
    assert_eq!(done.tokens_after, s.context_tokens());
    assert!(done.tokens_after < done.tokens_before);
}

#[test]
fn manual_commit_has_no_continue_message() {
    let mut s = session(FIXTURE);
    let plan = s.plan_compaction(req(TAIL, true)).expect("plan");
    commit(&mut s, &plan, "summary", false, 1);
    assert_eq!(
        context_ids(&s),
        ["cmp1_user", "cmp1_summary", "u2", "a2", "u3", "a3"]
    );
}

#[test]
fn messages_arriving_while_the_summary_is_written_stay_after_it() {
    let mut s = session(FIXTURE);
    let plan = s
        .plan_compaction(req(
            TailOptions {
                turns: 0,
                max_tokens: 0,
            },
            true,
        ))
        .expect("plan");
    for u in parse("user u4 text:t5=10\nassistant a4 grep:p3=40") {
        apply(&mut s, u);
    }
    commit(&mut s, &plan, "summary of u1..a3", false, 1);
    // No tail: everything up to the start is summarized; u4/a4 arrived meanwhile.
    assert_eq!(context_ids(&s), ["cmp1_user", "cmp1_summary", "u4", "a4"]);
}

/// A summarized message written to while its summary was written (a part added, a
/// part deleted, a tool finishing): the summary holds the message as it was, and the
/// commit would hide the change from every later request. The commit is stale (the
/// compaction is retried on what the session holds) and changes nothing.
#[test]
fn a_summarized_message_changed_while_the_summary_was_written_makes_the_commit_stale() {
    let everything = TailOptions {
        turns: 0,
        max_tokens: 0,
    };
    let edits: [(&str, Update); 2] = [
        ("a part added", parse("assistant a3 text:t9=400").remove(1)),
        (
            "a part deleted",
            Update::DeletePart {
                message_id: "a1".into(),
                part_id: "p1".into(),
            },
        ),
    ];
    for (what, edit) in edits {
        let mut s = session(FIXTURE);
        let plan = s.plan_compaction(req(everything, true)).expect("plan");
        apply(&mut s, edit.clone());
        let mut before = session(FIXTURE);
        apply(&mut before, edit);
        let err = s.commit_compaction(
            &plan,
            &outcome("summary of u1..a3"),
            &ids(1),
            NOW,
            &config(),
        );
        assert!(
            matches!(err, Err(CompactionError::Stale(_))),
            "{what}: {err:?}"
        );
        super::snapshot::assert_same(&s, &before, "a stale commit changes nothing");
    }
    // A mark the engine sets on a summarized message (prune clearing p1) is not the
    // host's content: the commit still holds.
    let mut s = fixture_pruning_past_100_tokens();
    let plan = s.plan_compaction(req(TAIL, true)).expect("plan");
    let report = s.prune(PruneMode::Commit, NOW);
    assert!(report.parts.iter().any(|p| p.part_id == "p1"), "{report:?}");
    commit(&mut s, &plan, "summary", true, 1);
}

/// A session the store sends cold (or its actor rebuilds) and loads back as the same
/// value holds new edit values: a compaction planned before still commits on it, as
/// before edits were compared. And a part sent again as it is stored is no change.
#[test]
fn a_reloaded_session_and_a_part_sent_again_unchanged_leave_the_commit_standing() {
    let everything = TailOptions {
        turns: 0,
        max_tokens: 0,
    };
    let planned = session(FIXTURE);
    let plan = planned
        .plan_compaction(req(everything, true))
        .expect("plan");
    let bytes = crate::engine::encode_session(&planned);
    let mut loaded = crate::engine::decode_session(&bytes).expect("decodes");
    loaded.resume(planned.to_resume());
    let ids_one = ids(1);
    loaded
        .commit_compaction(&plan, &outcome("summary"), &ids_one, NOW, &config())
        .expect("commits on the reloaded value");

    let mut s = session(FIXTURE);
    let plan = s.plan_compaction(req(everything, true)).expect("plan");
    let again = parse("assistant a1 read:p1=3000").remove(1);
    apply(&mut s, again);
    s.commit_compaction(&plan, &outcome("summary"), &ids(1), NOW, &config())
        .expect("a part sent again unchanged changes nothing");
}

/// A summarized message the host changed while the summary was written, and the session
/// then sent cold and loaded back as the same value (or rebuilt by its actor): the change
/// is still seen, and the commit is stale. Found in review: the load gave the session a
/// new edit epoch, and edits were compared only within one, so the commit went through
/// and hid the host's change.
#[test]
fn a_summarized_message_changed_before_a_reload_makes_the_commit_stale() {
    let everything = TailOptions {
        turns: 0,
        max_tokens: 0,
    };
    let mut s = session(FIXTURE);
    let plan = s.plan_compaction(req(everything, true)).expect("plan");
    apply(
        &mut s,
        Update::DeletePart {
            message_id: "a1".into(),
            part_id: "p1".into(),
        },
    );
    let err = sent_cold_and_back(&s).commit_compaction(
        &plan,
        &outcome("summary"),
        &ids(1),
        NOW,
        &config(),
    );
    assert!(matches!(err, Err(CompactionError::Stale(_))), "{err:?}");
    // Rebuilt by its actor from the disk's copy, the same.
    let mut rebuilt = round_trip(&s);
    rebuilt.resume_from(&s);
    let err = rebuilt.commit_compaction(&plan, &outcome("summary"), &ids(1), NOW, &config());
    assert!(matches!(err, Err(CompactionError::Stale(_))), "{err:?}");
}

/// A rebuild (a refused commit's reload) that lacks only compactd's own prune stamps of a
/// summarized message holds what the host wrote: the commit stands. Found in review:
/// the rebuild compared whole parts, stamps included, and made the summary stale.
#[test]
fn a_rebuild_without_the_engines_own_stamps_leaves_the_commit_standing() {
    let everything = TailOptions {
        turns: 0,
        max_tokens: 0,
    };
    let mut s = fixture_pruning_past_100_tokens();
    let plan = s.plan_compaction(req(everything, true)).expect("plan");
    let on_disk = round_trip(&s);
    let report = s.prune(PruneMode::Commit, NOW);
    assert!(report.committed && !report.parts.is_empty(), "{report:?}");
    // The prune's batch refused: the actor rebuilds the session as the disk holds it.
    let mut rebuilt = on_disk;
    rebuilt.resume_from(&s);
    rebuilt
        .commit_compaction(&plan, &outcome("summary"), &ids(1), NOW, &config())
        .expect("no summarized message changed but for compactd's own stamps");
}

/// `s` encoded and decoded, as the store writes and reads it.
fn round_trip(s: &Session) -> Session {
    crate::engine::decode_session(&crate::engine::encode_session(s)).expect("decodes")
}

/// `s` as the store sends it cold and loads it back as the same value.
fn sent_cold_and_back(s: &Session) -> Session {
    let mut loaded = round_trip(s);
    loaded.resume(s.to_resume());
    loaded
}

/// What the edits carried across a reload keep: a compaction planned before commits
/// when the host only wrote new messages meanwhile (up to [`crate::engine::RECENT_EDITS`]
/// of them before the reload), and is stale, for all the session still knows, past that.
#[test]
fn across_a_reload_new_messages_leave_the_commit_standing_up_to_a_bound() {
    let everything = TailOptions {
        turns: 0,
        max_tokens: 0,
    };
    let written = |n: usize| {
        let mut s = session(FIXTURE);
        let plan = s.plan_compaction(req(everything, true)).expect("plan");
        for k in 0..n {
            for u in parse(&format!("user n{k} text:n{k}t=10")) {
                apply(&mut s, u);
            }
        }
        (s, plan)
    };
    let (s, plan) = written(crate::engine::RECENT_EDITS);
    let mut loaded = sent_cold_and_back(&s);
    loaded
        .commit_compaction(&plan, &outcome("summary"), &ids(1), NOW, &config())
        .expect("new messages change no summarized one");
    // Written after the reload: known exactly, however many.
    let (s, plan) = written(0);
    let mut loaded = sent_cold_and_back(&s);
    for k in 0..2 * crate::engine::RECENT_EDITS {
        for u in parse(&format!("user m{k} text:m{k}t=10")) {
            apply(&mut loaded, u);
        }
    }
    loaded
        .commit_compaction(&plan, &outcome("summary"), &ids(1), NOW, &config())
        .expect("what was written since the reload is known");
    let (s, plan) = written(crate::engine::RECENT_EDITS + 1);
    let err = sent_cold_and_back(&s).commit_compaction(
        &plan,
        &outcome("summary"),
        &ids(1),
        NOW,
        &config(),
    );
    assert!(matches!(err, Err(CompactionError::Stale(_))), "{err:?}");
}

#[test]
fn a_second_compaction_folds_the_first_summary() {
    let mut s = session(FIXTURE);
    let plan = s.plan_compaction(req(TAIL, true)).expect("plan");
    commit(&mut s, &plan, "first summary", true, 1);
    for u in parse(
        "user u4 text:t5=10\nassistant a4 read:p4=900\nuser u5 text:t6=10\nassistant a5 text:t7=5",
    ) {
        apply(&mut s, u);
    }
    let plan = s.plan_compaction(req(TAIL, true)).expect("plan");
    assert_eq!(plan.previous_summary.as_deref(), Some("first summary"));
    // The old boundary pair is represented by the previous summary, not summarized again.
    // The last two user turns (u4, u5) are the new verbatim tail.
    assert_eq!(
        ids_of(&s, &plan.head),
        ["u2", "a2", "u3", "a3", "cmp1_continue"]
    );
    commit(&mut s, &plan, "second summary", false, 2);
    assert_eq!(
        context_ids(&s),
        ["cmp2_user", "cmp2_summary", "u4", "a4", "u5", "a5"]
    );
}

#[test]
fn a_second_compaction_right_after_the_first_leaves_the_first_pair_out() {
    // Found in review: the new tail (the last two user turns) starts inside the first
    // compaction's tail, before its pair in storage order, and the context used to take
    // every message from there on but the new pair: the first pair came back, its old
    // summary after newer turns, and was counted as replaced.
    let mut s = session(FIXTURE);
    let plan = s.plan_compaction(req(TAIL, true)).expect("plan");
    commit(&mut s, &plan, "first summary", true, 1);
    for u in parse("assistant a4 text:t8=5") {
        apply(&mut s, u);
    }
    let plan = s.plan_compaction(req(TAIL, true)).expect("plan");
    assert_eq!(ids_of(&s, &plan.head), ["u2", "a2"]);
    commit(&mut s, &plan, "second", false, 2);
    assert_eq!(
        context_ids(&s),
        [
            "cmp2_user",
            "cmp2_summary",
            "u3",
            "a3",
            "cmp1_continue",
            "a4"
        ]
    );
    for id in ["cmp1_user", "cmp1_summary"] {
        let i = s.position(id).expect("stored");
        assert!(!s.in_context(i), "{id} is not in the context");
    }
    let sent: u64 = s.build_context().tokens;
    assert_eq!(s.context_tokens(), sent);
    // A third compaction summarizes the second summary's turns, not the first pair again.
    for u in parse("user u6 text:t9=10\nassistant a6 text:t10=5\nuser u7 text:t11=10") {
        apply(&mut s, u);
    }
    let plan = s.plan_compaction(req(TAIL, true)).expect("plan");
    assert_eq!(plan.previous_summary.as_deref(), Some("second"));
    assert_eq!(ids_of(&s, &plan.head), ["u3", "a3", "cmp1_continue", "a4"]);
}

#[test]
fn a_folded_summary_only_has_to_be_smaller_than_the_head_and_the_summary_it_replaces() {
    // Found by the gRPC tests: a long first summary and a short new head made every
    // accurate folded summary fail as "not smaller than the head".
    let mut s = session(FIXTURE);
    let plan = s.plan_compaction(req(TAIL, true)).expect("plan");
    let first = chars(2_500 * 4); // a 2,500-token summary of a 3,011-token head
    commit(&mut s, &plan, &first, false, 1);
    for u in parse(
        "user u4 text:t5=10\nassistant a4 text:t8=5\nuser u5 text:t6=10\nassistant a5 text:t7=5",
    ) {
        apply(&mut s, u);
    }
    let plan = s.plan_compaction(req(TAIL, false)).expect("plan");
    assert!(
        plan.head_tokens < 1_500,
        "the new head is small: {}",
        plan.head_tokens
    );
    assert!(plan.replaced_tokens > 2_500, "{}", plan.replaced_tokens);
    let folded = chars(1_500 * 4); // bigger than the head, smaller than all it replaces
    let done = s.commit_compaction(&plan, &outcome(&folded), &ids(2), NOW, &config());
    assert!(done.is_ok(), "{done:?}");
}

#[test]
fn todos_and_protected_outputs_are_carried_verbatim() {
    let mut s = session(
        "
        user u1 text:t1=10
        assistant a1 skill:k1=30 read:p1=3000
        user u2 text:t2=10
        assistant a2 text:t3=5
        user u3 text:t4=10
        ",
    );
    let mut info = s.info().clone();
    info.todos = vec![Todo {
        id: "1".into(),
        content: "write the migration".into(),
        status: "in_progress".into(),
        priority: "high".into(),
    }];
    apply(&mut s, Update::Configure(info));
    let plan = s.plan_compaction(req(TAIL, true)).expect("plan");
    let skill_output = match &find(&s, "k1").kind {
        PartKind::Tool(t) => t.state.output.clone(),
        _ => unreachable!(),
    };
    commit(&mut s, &plan, "model summary", false, 1);
    let view = s.build_context();
    let text = match &view.messages[1].parts[0].part.kind {
        PartKind::Text(t) => t.text.clone(),
        other => panic!("summary text expected, got {other:?}"),
    };
    assert!(text.starts_with("model summary\n\n## Todo list"), "{text}");
    assert!(
        text.contains("- [in_progress] write the migration (high)"),
        "{text}"
    );
    assert!(
        text.contains(&format!("### skill (call_k1)\n{skill_output}")),
        "{text}"
    );
}

/// A second compaction carries the first one's protected outputs on, verbatim. Before,
/// they lived only in the previous summary's text, which the model rewrites: the second
/// summary kept them only if the model copied them out whole.
#[test]
fn protected_outputs_outlive_a_second_compaction() {
    let mut s = session(
        "
        user u1 text:t1=10
        assistant a1 skill:k1=30 read:p1=3000
        user u2 text:t2=10
        assistant a2 read:p2=3000
        user u3 text:t4=10
        ",
    );
    let skill_output = match &find(&s, "k1").kind {
        PartKind::Tool(t) => t.state.output.clone(),
        _ => unreachable!(),
    };
    let carried = format!("### skill (call_k1)\n{skill_output}\n");
    let plan = s.plan_compaction(req(TAIL, false)).expect("plan");
    commit(&mut s, &plan, "first summary", false, 1);
    for u in parse(
        "
        assistant a3 skill:k2=20 read:p3=3000
        user u4 text:t5=10
        assistant a4 text:t6=5
        user u5 text:t7=10
        ",
    ) {
        apply(&mut s, u);
    }
    let plan = s.plan_compaction(req(TAIL, false)).expect("plan");
    let previous = plan.previous_summary.clone().expect("a previous summary");
    assert!(previous.starts_with("first summary"), "{previous}");
    assert!(
        !previous.contains(&carried),
        "the model is not asked to copy what compactd carries: {previous}"
    );
    commit(&mut s, &plan, "second summary", false, 2);
    let view = s.build_context();
    let text = match &view.messages[1].parts[0].part.kind {
        PartKind::Text(t) => t.text.clone(),
        other => panic!("summary text expected, got {other:?}"),
    };
    assert!(text.starts_with("second summary\n\n"), "{text}");
    assert_eq!(text.matches(&carried).count(), 1, "{text}");
    assert_eq!(
        text.matches("## Protected tool outputs").count(),
        1,
        "{text}"
    );
    // Oldest first: the first compaction's, then the second head's.
    let (k1, k2) = (text.find("(call_k1)"), text.find("(call_k2)"));
    assert!(k1.is_some() && k1 < k2, "{text}");
}

/// What a compaction carries on verbatim is not replaced by the summary: it does not
/// count in what the summary must be smaller than. Before, a previous summary's 3,000
/// tokens of carried outputs let a model summary larger than the whole head pass, and
/// the context grew. The same protected output loaded again is carried once.
#[test]
fn carried_outputs_are_not_counted_as_replaced_nor_carried_twice() {
    let mut s = session(
        "
        user u1 text:t1=10
        assistant a1 skill:k1=3000 read:p1=1000
        user u2 text:t2=10
        assistant a2 read:p2=300
        user u3 text:t3=10
        ",
    );
    let plan = s.plan_compaction(req(TAIL, false)).expect("plan");
    assert!(
        plan.replaced_tokens < 1_300,
        "the skill output stays: {}",
        plan.replaced_tokens
    );
    commit(&mut s, &plan, "first summary", false, 1);
    let skill = match &find(&s, "k1").kind {
        PartKind::Tool(t) => t.state.output.clone(),
        _ => unreachable!(),
    };
    // The same skill loaded again, and a small head.
    let mut again = parse("assistant a3 read:p3=200");
    again.push(Update::UpsertPart(Part {
        id: "k2".into(),
        message_id: "a3".into(),
        ..find(&s, "k1")
    }));
    for u in again.into_iter().chain(parse(
        "
        user u4 text:t4=10
        assistant a4 text:t5=5
        user u5 text:t6=10
        ",
    )) {
        apply(&mut s, u);
    }
    let plan = s.plan_compaction(req(TAIL, false)).expect("plan");
    // The carried output is not replaced; its reloaded copy is (it is carried once).
    assert!(
        (3_000..4_000).contains(&plan.replaced_tokens),
        "the copy and the small head: {}",
        plan.replaced_tokens
    );
    // A model summary larger than all it replaces is refused; a smaller one commits.
    let larger = chars(4 * 4_200);
    let err = s.commit_compaction(&plan, &outcome(&larger), &ids(2), NOW, &config());
    assert!(
        matches!(err, Err(CompactionError::NotSmaller { .. })),
        "{err:?}"
    );
    commit(&mut s, &plan, &chars(4 * 1_500), false, 2);
    let view = s.build_context();
    let text = match &view.messages[1].parts[0].part.kind {
        PartKind::Text(t) => t.text.clone(),
        other => panic!("summary text expected, got {other:?}"),
    };
    assert_eq!(text.matches(skill.as_str()).count(), 1, "carried once");
}

/// An output that is only a line of a carried one is still carried: the dedupe compares
/// whole entries.
#[test]
fn a_short_output_inside_a_carried_one_is_still_carried() {
    use crate::engine::anchors::carries;
    let carried = "### skill (c1)\nrun(x)\nok\n";
    assert!(!carries(carried, "skill", "ok"));
    assert!(carries(carried, "skill", "run(x)\nok"));
    let two = "### skill (c1)\nrun(x)\nok\n### skill (c2)\nother\n";
    assert!(carries(two, "skill", "run(x)\nok"));
    assert!(!carries(two, "skill", "ok"));
    // A line of a skill that looks like a heading is not one.
    let markdown = "### skill (c1)\n# Deploy\n### Verify (required)\nRun the tests.\n";
    assert!(!carries(markdown, "skill", "Run the tests."));
    assert!(carries(
        markdown,
        "skill",
        "# Deploy\n### Verify (required)\nRun the tests."
    ));
}

/// Only compactd's own summary has its carried section split off; one the model copied
/// the heading into before (a summary written before outputs were carried on) splits at
/// compactd's own section, the last. A host's summary carries nothing.
#[test]
fn the_carried_section_is_compactds_own_last_one() {
    let (text, carried) = crate::engine::anchors::split_carried(
        "Model text.\n\n## Protected tool outputs (carried verbatim by compactd)\n### skill (c0)\ncopied\n\nMore model text.\n\n## Protected tool outputs (carried verbatim by compactd)\n### skill (c1)\nreal\n",
    );
    assert!(text.ends_with("More model text."), "{text}");
    assert_eq!(carried, "### skill (c1)\nreal\n");
}

#[test]
fn empty_or_larger_summaries_are_rejected_and_change_nothing() {
    let mut s = session(FIXTURE);
    let plan = s.plan_compaction(req(TAIL, true)).expect("plan");
    let before = s.messages().to_vec();
    let err = s.commit_compaction(&plan, &outcome("  \n"), &ids(1), NOW, &config());
    assert_eq!(err, Err(CompactionError::EmptySummary));
    let huge = chars(4 * 3_100);
    let err = s.commit_compaction(&plan, &outcome(&huge), &ids(1), NOW, &config());
    assert!(
        matches!(err, Err(CompactionError::NotSmaller { .. })),
        "{err:?}"
    );
    assert_eq!(s.messages(), &before[..]);
}

/// Plans on `planned`, replaces the session by `replaced` (an import over it, a delete
/// and re-create: same session id, other messages) and commits the plan there: the
/// commit must be refused as stale and leave `replaced` exactly as it was.
fn check_stale_commit(planned: &str, replaced: &str, auto: bool) -> CompactionError {
    let plan = session(planned)
        .plan_compaction(req(TAIL, auto))
        .expect("plan");
    let mut s = session(replaced);
    let before = session(replaced);
    let err = s
        .commit_compaction(&plan, &outcome("summary"), &ids(1), NOW, &config())
        .expect_err("a plan of another session is refused");
    assert!(matches!(err, CompactionError::Stale(_)), "{err:?}");
    super::snapshot::assert_same(&s, &before, "a stale commit changes nothing");
    err
}

#[test]
fn a_plan_committed_on_a_shorter_replacement_is_stale_not_a_panic() {
    // Replaced by an older, shorter export of the same conversation: the plan's tail
    // (u2) and part of its head are past the end. Indexing would panic the actor.
    let err = check_stale_commit(FIXTURE, "user u1 text:t1=10", true);
    assert_eq!(
        err.to_string(),
        "the session changed while the summary was written: \
         position 1 of the plan is past the session's 1 messages"
    );
    // Everything summarized (no tail), the replacement shorter than the head.
    let no_tail = "user u1 text:t1=10\nassistant a1 read:p1=3000";
    let plan = session(no_tail)
        .plan_compaction(req(
            TailOptions {
                turns: 0,
                max_tokens: 0,
            },
            false,
        ))
        .expect("plan");
    let mut s = session("user x1 text:t1=10");
    let before = session("user x1 text:t1=10");
    let err = s.commit_compaction(&plan, &outcome("summary"), &ids(1), NOW, &config());
    assert!(matches!(err, Err(CompactionError::Stale(_))), "{err:?}");
    super::snapshot::assert_same(&s, &before, "a stale commit changes nothing");
}

#[test]
fn a_plan_committed_on_a_longer_replacement_is_stale_not_a_silent_summary() {
    // Another conversation, longer: every position exists, but the summary of u1..a1
    // would hide its first messages.
    let other = "
        user x1 text:t1=10
        assistant y1 read:p1=3000
        user x2 text:t2=10
        assistant y2 bash:p2=200
        user x3 text:t3=10
        assistant y3 text:t4=50
        user x4 text:t5=10
    ";
    let err = check_stale_commit(FIXTURE, other, false);
    assert_eq!(
        err.to_string(),
        "the session changed while the summary was written: \
         message u1 is no longer at position 0 (x1 is)"
    );
}

#[test]
fn a_plan_committed_after_its_first_messages_were_removed_is_stale() {
    // The same conversation without its first turn (an export trimmed before the
    // import): the ids exist, at other positions.
    let trimmed = "
        user u2 text:t2=10
        assistant a2 bash:p2=200
        user u3 text:t3=10
        assistant a3 text:t4=50
    ";
    let err = check_stale_commit(FIXTURE, trimmed, true);
    assert_eq!(
        err.to_string(),
        "the session changed while the summary was written: \
         message u1 is no longer at position 0 (u2 is)"
    );
    // Only the tail moved: its first message is elsewhere.
    let tail_moved = "
        user u1 text:t1=10
        assistant a1 read:p1=3000
        user u9 text:t9=10
        user u2 text:t2=10
    ";
    let err = check_stale_commit(FIXTURE, tail_moved, true);
    assert_eq!(
        err.to_string(),
        "the session changed while the summary was written: \
         message u2 is no longer at position 2 (u9 is)"
    );
}

#[test]
fn a_plan_committed_on_a_replacement_with_the_same_ids_is_stale() {
    // The same export imported again over the session (or the conversation deleted and
    // re-created with the same ids): every planned position holds the planned id, but
    // the session is another value. Its summary was written from the old value's
    // messages, which the new one may hold with other content: the commit is refused.
    let err = check_stale_commit(FIXTURE, FIXTURE, true);
    assert_eq!(
        err.to_string(),
        "the session changed while the summary was written: \
         it was replaced under the same id"
    );
    // The same ids with other content: what the old summary would have hidden.
    let rewritten = FIXTURE.replace("read:p1=3000", "read:p1=2000");
    check_stale_commit(FIXTURE, &rewritten, false);
    // A copy of the session it was planned on is that session: the plan commits there.
    let planned = session(FIXTURE);
    let plan = planned.plan_compaction(req(TAIL, true)).expect("plan");
    let mut copy = planned.clone();
    commit(&mut copy, &plan, "summary", true, 1);
}

#[test]
fn a_logged_plan_is_still_bounds_checked() {
    // A plan read back from the log carries positions only (its commit was checked when
    // performed): on a session it does not fit, the commit is refused, never a panic.
    let plan = session(FIXTURE)
        .plan_compaction(req(TAIL, true))
        .expect("plan");
    let logged = crate::engine::encode_change(&crate::engine::Change::CommitCompaction {
        plan,
        outcome: outcome("summary"),
        ids: ids(1),
        now_ms: NOW,
    });
    let Ok(crate::engine::Change::CommitCompaction { plan, .. }) =
        crate::engine::decode_change(&logged)
    else {
        panic!("the change decodes as a commit")
    };
    let mut s = session("user u1 text:t1=10");
    let before = session("user u1 text:t1=10");
    let err = s.commit_compaction(&plan, &outcome("summary"), &ids(1), NOW, &config());
    assert!(matches!(err, Err(CompactionError::Stale(_))), "{err:?}");
    super::snapshot::assert_same(&s, &before, "a stale commit changes nothing");
    // On the session it was planned on, the logged plan commits as the live one does.
    let mut live = session(FIXTURE);
    let mut replayed = session(FIXTURE);
    let live_plan = live.plan_compaction(req(TAIL, true)).expect("plan");
    commit(&mut live, &live_plan, "summary", true, 1);
    commit(&mut replayed, &plan, "summary", true, 1);
    super::snapshot::assert_same(&replayed, &live, "the logged plan replays");
}

#[test]
fn a_replayed_commit_is_not_refused_for_a_summary_that_counts_larger_now() {
    // A commit read back from the log was checked when it was performed. Replayed after
    // the server's tokenizer changed, its summary may count as many tokens as the head
    // it replaced (a plan keeps the figures of its own count): a live commit of that
    // summary is refused, the logged one is performed again.
    let plan = session(FIXTURE)
        .plan_compaction(req(TAIL, true))
        .expect("plan");
    let larger = chars(4 * 3_100);
    let logged = || {
        let bytes = crate::engine::encode_change(&crate::engine::Change::CommitCompaction {
            plan: plan.clone(),
            outcome: outcome(&larger),
            ids: ids(1),
            now_ms: NOW,
        });
        crate::engine::decode_change(&bytes).expect("decodes")
    };
    let mut live = session(FIXTURE);
    let refused = live.perform(logged(), &config());
    assert!(
        matches!(
            refused,
            crate::engine::Performed::CommitCompaction(Err(CompactionError::NotSmaller { .. }))
        ),
        "{refused:?}"
    );
    let mut replayed = session(FIXTURE);
    let done = replayed.replay(logged(), &config());
    assert!(
        matches!(done, crate::engine::Performed::CommitCompaction(Ok(_))),
        "{done:?}"
    );
    assert_eq!(context_ids(&replayed)[..2], ["cmp1_user", "cmp1_summary"]);
    // Replay is over: the next live commit is checked again.
    let again = replayed.plan_compaction(req(TAIL, false)).expect("plan");
    let larger_still = chars(4 * (again.replaced_tokens as usize + 100));
    let err = replayed.commit_compaction(&again, &outcome(&larger_still), &ids(2), NOW, &config());
    assert!(
        matches!(err, Err(CompactionError::NotSmaller { .. })),
        "{err:?}"
    );
}

#[test]
fn a_commit_over_the_byte_limit_adds_nothing_and_one_under_it_adds_all() {
    let base = session(FIXTURE);
    let plan = base.clone().plan_compaction(req(TAIL, true)).expect("plan");
    // What the commit really adds, with no limit.
    let mut free = base.clone();
    let start = free.held_bytes();
    free.commit_compaction(&plan, &outcome("summary"), &ids(1), NOW, &config())
        .expect("commit");
    let added = free.held_bytes() - start;
    let limit = |bytes| crate::engine::ByteLimit {
        bytes,
        name: "max_session_bytes",
        value: bytes,
    };
    // One byte short: the first updates alone would fit, but the commit is refused
    // before any of them, so no compaction part is left without its summary.
    let mut s = base.clone();
    let held = s.held_bytes();
    assert_eq!(held, s.held_bytes_from_scratch(), "a clone counts itself");
    s.set_byte_limit(limit(held + added - 1));
    let err = s.commit_compaction(&plan, &outcome("summary"), &ids(1), NOW, &config());
    assert!(
        matches!(&err, Err(CompactionError::Apply(e)) if e.message.contains("max_session_bytes")),
        "{err:?}"
    );
    assert_eq!(s.messages(), base.messages());
    assert_eq!(s.held_bytes(), held);
    // With room: every update lands, the summary included.
    s.set_byte_limit(limit(held + 2 * added));
    s.commit_compaction(&plan, &outcome("summary"), &ids(1), NOW, &config())
        .expect("fits");
    assert_eq!(s.messages().len(), free.messages().len());
    assert_eq!(s.held_bytes(), free.held_bytes());
}

/// The fixture after a usage report of `input` prompt tokens.
fn fixture_reporting(input: u64) -> Session {
    let mut s = session(FIXTURE);
    apply(
        &mut s,
        Update::ReportUsage {
            message_id: None,
            tokens: TokenUsage {
                input,
                ..Default::default()
            },
        },
    );
    s
}

#[test]
fn prune_stops_at_the_summary_and_usage_restarts_from_the_new_context() {
    let mut s = fixture_reporting(150_000);
    let plan = s.plan_compaction(req(TAIL, true)).expect("plan");
    commit(&mut s, &plan, "summary", true, 1);
    let c = s.check_overflow(Trigger::Request);
    // No report anchors the new context yet: it is estimated as counted.
    assert_eq!((c.used, c.predicted), (0, s.context_tokens()));
    // Nothing before the summary is a prune candidate any more.
    for u in parse("user u9 text:t9=1\nassistant a9 text:t10=1\nuser u10 text:t11=1") {
        apply(&mut s, u);
    }
    assert_eq!(reference(&s).prune, vec![]);
    assert_index_agrees(&mut s, "after a compaction");
}

#[test]
fn a_compactions_own_usage_teaches_the_calibration_nothing() {
    let mut s = fixture_reporting(150_000);
    let (calibration, sample) = (*s.calibration(), s.prediction_sample());
    let plan = s.plan_compaction(req(TAIL, true)).expect("plan");
    // The summary message carries the compaction request's usage (900 tokens of head to
    // the compaction model): not a request of this session's prompt.
    commit(&mut s, &plan, "summary", true, 1);
    assert_eq!(s.calibration(), &calibration);
    assert_eq!(s.prediction_sample(), sample);
}

#[test]
fn a_host_written_summary_neither_checks_nor_anchors_a_prediction() {
    let mut s = overflowing();
    finish_with_usage(&mut s, "b1", 10_000);
    let (calibration, sample) = (*s.calibration(), s.prediction_sample());
    // The host compacts: its summary reports the compaction request (the head, 9,000).
    let mut sm = summary("s9", "u3");
    sm.finish.clear();
    apply(&mut s, Update::UpsertMessage(sm.clone()));
    sm.finish = "stop".into();
    sm.tokens = Some(TokenUsage {
        input: 9_000,
        ..Default::default()
    });
    apply(&mut s, Update::UpsertMessage(sm));
    assert_eq!(s.calibration(), &calibration, "the summary's report");
    // The next request of the session reports 3,000: measured against the summary's
    // 9,000 it would teach that added text counts negative.
    finish_with_usage(&mut s, "b2", 3_000);
    assert_eq!(s.calibration(), &calibration, "the report after it");
    assert_eq!(s.prediction_sample(), sample);
    // The one after that is checked again.
    finish_with_usage(&mut s, "b3", 3_100);
    assert_ne!(s.prediction_sample(), sample);
}

/// The host compacts (OpenCode's own compaction, forwarded): its summary's report is the
/// compaction request (the old history), and once the summary completes the context is
/// the summary and what follows. Before, that report was the baseline: the session still
/// read as over the threshold right after a successful compaction (`used` 15,000 of
/// 14,720), so a host asking before its next request compacted again.
#[test]
fn after_a_host_compaction_the_summarys_report_is_not_the_sessions_size() {
    for report_after_finish in [false, true] {
        let mut s = overflowing();
        finish_with_usage(&mut s, "b1", 15_000);
        assert!(s.check_overflow(Trigger::Request).overflow, "over before");
        let mut updates =
            parse("user c1 compaction:cp1\nassistant s9 summary unfinished text:t9=20");
        let Update::UpsertMessage(mut done) = updates[2].clone() else {
            panic!("the summary's message")
        };
        done.finish = "stop".into();
        let report = Update::ReportUsage {
            message_id: Some("s9".into()),
            tokens: TokenUsage {
                input: 15_000,
                output: 300,
                ..Default::default()
            },
        };
        if report_after_finish {
            updates.push(Update::UpsertMessage(done));
            updates.push(report);
        } else {
            updates.push(report);
            updates.push(Update::UpsertMessage(done));
        }
        for u in updates {
            apply(&mut s, u);
        }
        let c = s.check_overflow(Trigger::Request);
        assert!(
            !c.overflow,
            "report after finish {report_after_finish}: {c:?}"
        );
        assert_eq!(
            (c.used, c.predicted),
            (0, s.context_tokens()),
            "report after finish {report_after_finish}: the new context, as counted"
        );
        // The host undoes it (its summary gains an error): the whole history is the
        // context again, estimated whole.
        let Update::UpsertMessage(mut undone) = parse("user c1\nassistant s9 summary").remove(1)
        else {
            panic!("the summary's message")
        };
        undone.error = Some(MessageError {
            name: "APIError".into(),
            data: serde_json::Value::Null,
        });
        apply(&mut s, Update::UpsertMessage(undone));
        let c = s.check_overflow(Trigger::Request);
        assert_eq!(c.predicted, s.context_tokens(), "undone: {c:?}");
    }
}

#[test]
fn prune_reaching_summarized_outputs_does_not_lower_the_prediction() {
    // Found in review: a compaction's pair is stored after its tail, so for two user
    // turns OpenCode's prune scan (kept literal) starts before the pair and reaches the
    // summarized messages. Clearing an output no request sends must not make the next
    // request look smaller.
    let mut s = fixture_pruning_past_100_tokens();
    compact_keeping(&mut s, 2, "summary", "cmp1");
    let before = s.check_overflow(Trigger::Request);
    assert_eq!(before.predicted, s.context_tokens());
    let report = s.prune(PruneMode::Commit, NOW);
    assert!(report.committed);
    let cleared: Vec<&str> = report.parts.iter().map(|p| p.part_id.as_str()).collect();
    assert!(cleared.contains(&"p1"), "a summarized output: {cleared:?}");
    assert!(
        cleared.contains(&"p2"),
        "an output of the tail: {cleared:?}"
    );
    // The context lost p2's output only, and so did the prediction.
    let after = s.check_overflow(Trigger::Request);
    assert!(s.context_tokens() < before.predicted);
    assert_eq!(after.predicted, s.context_tokens());
    assert_eq!(s.total_tokens(), rendered_tokens_from_scratch(&s));
}

/// After a compaction (and before any report), the prediction is the context: a change
/// the context does not send moves neither. Found in review: an upsert or delete of a
/// part of a summarized message moved the prediction (the OpenCode plugin mirrors
/// OpenCode's own prune stamping summarized outputs: 3,000 tokens less predicted), and
/// a pin on one, which carries the part after the summary, left it where it was.
#[test]
fn the_prediction_follows_the_context_through_changes_to_summarized_messages() {
    let mut s = session(FIXTURE);
    compact_keeping(&mut s, 2, "summary", "cmp1");
    let check = |s: &mut Session, what: &str| {
        let c = s.check_overflow(Trigger::Request);
        assert_eq!(c.predicted, s.context_tokens(), "{what}: {c:?}");
        assert_eq!(s.total_tokens(), rendered_tokens_from_scratch(s), "{what}");
    };
    check(&mut s, "compacted");
    // The host stamps a summarized output as cleared (OpenCode's prune).
    let mut p1 = find(&s, "p1");
    state_mut(&mut p1).time.compacted = Some(NOW);
    apply(&mut s, Update::UpsertPart(p1.clone()));
    check(&mut s, "summarized output stamped");
    state_mut(&mut p1).time.compacted = None;
    apply(&mut s, Update::UpsertPart(p1));
    check(&mut s, "summarized output restored");
    // A part written into, and deleted from, a summarized message.
    apply(
        &mut s,
        Update::UpsertPart(text("u1", "late", &chars(4_000))),
    );
    check(&mut s, "text added to a summarized message");
    apply(
        &mut s,
        Update::DeletePart {
            message_id: "u1".into(),
            part_id: "late".into(),
        },
    );
    check(&mut s, "text deleted from a summarized message");
    // Pinned, the summarized part is carried after the summary: the context grows.
    let pin = |message: &str, part: Option<&str>, pinned: bool| Update::Pin {
        message_id: message.into(),
        part_id: part.map(Into::into),
        pinned,
    };
    let before = s.context_tokens();
    apply(&mut s, pin("a1", Some("p1"), true));
    assert!(s.context_tokens() > before + 2_000, "p1 is carried");
    check(&mut s, "summarized part pinned");
    // A carried part's edits are sent.
    let mut p1 = find(&s, "p1");
    state_mut(&mut p1).output = chars(8_000);
    apply(&mut s, Update::UpsertPart(p1));
    check(&mut s, "carried part edited");
    apply(&mut s, pin("a1", None, true));
    check(&mut s, "summarized message pinned");
    apply(&mut s, pin("a1", Some("p1"), false));
    check(&mut s, "part unpinned, its message still pinned");
    apply(&mut s, pin("a1", None, false));
    assert_eq!(s.context_tokens(), before, "nothing carried");
    check(&mut s, "summarized message unpinned");
}

/// Two summaries of one compaction (a host that ran it twice): the context opens at the
/// later one, as a recount (`find_boundary`, seed 02's newest-first walk) finds it.
/// Found in review: the boundary kept the first to complete, a recount took the later,
/// so any unrelated recount (a compaction part added and deleted elsewhere) switched the
/// summary sent and reset the usage figures.
#[test]
fn a_second_summary_of_one_compaction_opens_the_context_as_a_recount_does() {
    let mut s = session(FIXTURE);
    apply(&mut s, Update::UpsertMessage(user("c1")));
    apply(&mut s, Update::UpsertPart(compaction("c1", "cp1")));
    for id in ["s1", "s2"] {
        apply(&mut s, Update::UpsertMessage(summary(id, "c1")));
        apply(
            &mut s,
            Update::UpsertPart(text(id, &format!("{id}t"), &chars(400))),
        );
    }
    let live = context_ids(&s);
    assert!(live.contains(&"s2".to_string()), "{live:?}");
    assert_eq!(
        s.check_overflow(Trigger::Request).predicted,
        s.context_tokens()
    );
    // A recount (a compaction part added and deleted on another user message) agrees.
    apply(&mut s, Update::UpsertPart(compaction("u3", "cpx")));
    apply(
        &mut s,
        Update::DeletePart {
            message_id: "u3".into(),
            part_id: "cpx".into(),
        },
    );
    assert_eq!(context_ids(&s), live);
    // Completing in the other order gives the same context.
    let mut t = session(FIXTURE);
    apply(&mut t, Update::UpsertMessage(user("c1")));
    apply(&mut t, Update::UpsertPart(compaction("c1", "cp1")));
    for id in ["s1", "s2"] {
        let mut m = summary(id, "c1");
        m.finish.clear();
        apply(&mut t, Update::UpsertMessage(m));
        apply(
            &mut t,
            Update::UpsertPart(text(id, &format!("{id}t"), &chars(400))),
        );
    }
    for id in ["s2", "s1"] {
        apply(&mut t, Update::UpsertMessage(summary(id, "c1")));
    }
    assert_eq!(context_ids(&t), live);
}

/// The boundary's compaction part sent again with another tail: messages enter or leave
/// the context, and the prediction follows (found in review: it stayed on the old
/// context until the next report: 279 predicted for a context of 68).
#[test]
fn a_compaction_part_sent_again_with_another_tail_moves_the_prediction() {
    let mut s = session(FIXTURE);
    compact_keeping(&mut s, 2, "summary", "cmp1");
    let compaction_part = |s: &Session| {
        s.messages()
            .iter()
            .flat_map(|m| &m.parts)
            .find(|p| matches!(p.part.kind, PartKind::Compaction(_)))
            .map(|p| p.part.clone())
            .expect("a compaction part")
    };
    let before = context_ids(&s);
    for (tail, what) in [("u3", "tail shortened"), ("u1", "tail lengthened")] {
        let mut part = compaction_part(&s);
        if let PartKind::Compaction(c) = &mut part.kind {
            c.tail_start_id = tail.into();
        }
        apply(&mut s, Update::UpsertPart(part));
        assert_ne!(context_ids(&s), before, "{what}");
        let c = s.check_overflow(Trigger::Request);
        assert_eq!(c.predicted, s.context_tokens(), "{what}: {c:?}");
    }
}

// ---- automatic compaction -------------------------------------------------------------

/// A session with a 20k window (usable 16k, threshold 14,720) and three user turns.
fn overflowing() -> Session {
    let mut s = new_session(
        SessionOverrides::default(),
        ModelLimits {
            context: 20_000,
            input: 0,
            output: 4_000,
        },
    );
    for u in parse(FIXTURE) {
        apply(&mut s, u);
    }
    s
}

/// Finishes a new assistant message reporting `input` tokens; returns the events.
fn finish_with_usage(s: &mut Session, id: &str, input: u64) -> Vec<crate::engine::Event> {
    let mut a = assistant(id, "u3");
    a.finish.clear();
    apply(s, Update::UpsertMessage(a.clone()));
    a.finish = "stop".into();
    a.tokens = Some(TokenUsage {
        input,
        ..Default::default()
    });
    crate::engine::step(s, Update::UpsertMessage(a), &config(), NOW)
        .expect("step")
        .events
}

fn needs_compaction(events: &[crate::engine::Event]) -> bool {
    events
        .iter()
        .any(|e| matches!(e, crate::engine::Event::CompactionNeeded(_)))
}

#[test]
fn a_finished_message_over_the_threshold_asks_for_compaction() {
    let mut s = overflowing();
    assert!(
        !needs_compaction(&finish_with_usage(&mut s, "b1", 14_720)),
        "at the threshold"
    );
    assert!(
        needs_compaction(&finish_with_usage(&mut s, "b2", 14_721)),
        "one token over"
    );
}

#[test]
fn summaries_and_auto_off_never_ask() {
    let mut s = overflowing();
    let mut sm = summary("s9", "u3");
    sm.finish.clear();
    apply(&mut s, Update::UpsertMessage(sm.clone()));
    sm.finish = "stop".into();
    sm.tokens = Some(TokenUsage {
        input: 19_000,
        ..Default::default()
    });
    let events = crate::engine::step(&mut s, Update::UpsertMessage(sm), &config(), NOW)
        .expect("step")
        .events;
    assert!(
        !needs_compaction(&events),
        "a summary never triggers another compaction"
    );

    let mut off = new_session(
        SessionOverrides {
            auto_compact: Some(false),
            ..Default::default()
        },
        ModelLimits {
            context: 20_000,
            input: 0,
            output: 4_000,
        },
    );
    for u in parse(FIXTURE) {
        apply(&mut off, u);
    }
    assert!(!needs_compaction(&finish_with_usage(
        &mut off, "b1", 19_000
    )));
}

#[test]
fn prune_that_fixes_the_overflow_prevents_compaction() {
    // Old outputs (turn 1) are large; pruning them brings the prediction under the
    // threshold, so the stale report alone must not trigger a compaction.
    let mut s = new_session(
        SessionOverrides {
            prune_protect: Some(100),
            prune_minimum: Some(100),
            ..Default::default()
        },
        ModelLimits {
            context: 20_000,
            input: 0,
            output: 4_000,
        },
    );
    for u in parse(
        "
        user u1 text:t1=10
        assistant a1 read:p1=6000
        user u2 text:t2=10
        assistant a2 bash:p2=50
        user u3 text:t3=10
        ",
    ) {
        apply(&mut s, u);
    }
    let events = finish_with_usage(&mut s, "b1", 14_800);
    assert!(
        events
            .iter()
            .any(|e| matches!(e, crate::engine::Event::Pruned(_))),
        "{events:?}"
    );
    assert!(!needs_compaction(&events), "{events:?}");
    assert!(!s.check_overflow(Trigger::Request).overflow);
}

#[test]
fn cooldown_after_a_compaction_that_left_the_session_over() {
    let mut s = overflowing();
    assert!(needs_compaction(&finish_with_usage(&mut s, "b1", 19_000)));
    // The compaction succeeded, but a new report still says over: cool down for 2.
    apply(
        &mut s,
        Update::ReportUsage {
            message_id: None,
            tokens: TokenUsage {
                input: 19_500,
                ..Default::default()
            },
        },
    );
    assert!(!s.record_compaction(true, true));
    assert!(!needs_compaction(&finish_with_usage(&mut s, "b2", 19_000)));
    assert!(!needs_compaction(&finish_with_usage(&mut s, "b3", 19_000)));
    assert!(
        needs_compaction(&finish_with_usage(&mut s, "b4", 19_000)),
        "cooldown over"
    );
}

#[test]
fn three_automatic_failures_pause_until_a_success() {
    let mut s = overflowing();
    assert!(!s.record_compaction(true, false));
    assert!(!s.record_compaction(true, false));
    assert!(s.record_compaction(true, false), "the third failure pauses");
    assert!(s.auto_compaction_paused());
    assert!(!needs_compaction(&finish_with_usage(&mut s, "b1", 19_000)));
    // Manual failures do not count; a manual success resumes.
    assert!(!s.record_compaction(false, false));
    assert!(!s.record_compaction(false, true));
    assert!(!s.auto_compaction_paused());
    // That success left the session over the threshold, so the cooldown runs first.
    assert!(!needs_compaction(&finish_with_usage(&mut s, "b2", 19_000)));
    assert!(!needs_compaction(&finish_with_usage(&mut s, "b3", 19_000)));
    assert!(needs_compaction(&finish_with_usage(&mut s, "b4", 19_000)));
}

#[test]
fn the_auto_continue_text_comes_from_the_settings() {
    let cfg = EngineConfig {
        auto_continue: "Go on with the plan.".into(),
        ..config()
    };
    let mut s = Session::new(
        SessionInfo {
            id: "ses_cont".into(),
            ..Default::default()
        },
        &cfg,
    );
    for u in parse(FIXTURE) {
        s.apply(u, &cfg).expect("fixture applies");
    }
    let plan = s.plan_compaction(req(TAIL, true)).expect("plan");
    s.commit_compaction(&plan, &outcome("summary"), &ids(1), NOW, &cfg)
        .expect("commit");
    let texts: Vec<String> = s
        .build_context()
        .messages
        .iter()
        .flat_map(|m| &m.parts)
        .filter_map(|p| match &p.part.kind {
            PartKind::Text(t) => Some(t.text.clone()),
            _ => None,
        })
        .collect();
    assert!(
        texts.iter().any(|t| t == "Go on with the plan."),
        "{texts:?}"
    );
    assert!(!texts.iter().any(|t| t == "Continue if you have next steps"));
}

/// After an automatic compaction the seed's prune scan walks past the compaction request
/// into what the summary replaced and clears it there too (as OpenCode does): that saves
/// no context, and the report says only what the context saves. Before, its
/// `context_tokens_saved` counted p1's 3,000 tokens the summary had already replaced.
#[test]
fn a_prune_after_a_compaction_reports_only_the_context_it_saves() {
    let mut s = fixture_pruning_past_100_tokens();
    let plan = s.plan_compaction(req(TAIL, true)).expect("plan");
    commit(&mut s, &plan, "summary", true, 1);
    assert!(
        !context_ids(&s).contains(&"a1".to_string()),
        "a1 is summarized"
    );
    let before = s.context_tokens();
    let report = s.prune(crate::engine::PruneMode::Commit, NOW);
    assert!(report.committed, "{report:?}");
    let cleared: Vec<&str> = report.parts.iter().map(|p| p.part_id.as_str()).collect();
    assert!(
        cleared.contains(&"p1"),
        "the seed's scan reaches p1: {cleared:?}"
    );
    assert_eq!(
        report.context_tokens_saved,
        i64::try_from(before - s.context_tokens()).expect("fits"),
        "the context saving is what the context lost: {report:?}"
    );
    assert!(report.context_tokens_saved < 3_000, "{report:?}");
}
