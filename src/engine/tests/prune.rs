//! Seed 01/02 prune: every edge case and constant, then the incremental index against the
//! literal reference scan.

use super::*;
use crate::config::{CacheModel, PLACEHOLDER, PROTECT_TURNS, PRUNE_MINIMUM, PRUNE_PROTECT};
use crate::engine::{Event, NotCommitted, PrunedPart, step};
use crate::tokens::CHARS_PER_TOKEN;

fn overrides(protect: u64, minimum: u64) -> SessionOverrides {
    SessionOverrides {
        prune_protect: Some(protect),
        prune_minimum: Some(minimum),
        ..Default::default()
    }
}

// ---- constants -----------------------------------------------------------------------

#[test]
fn seed_constants() {
    assert_eq!(
        (PRUNE_PROTECT, PRUNE_MINIMUM, PROTECT_TURNS, CHARS_PER_TOKEN),
        (40_000, 20_000, 2, 4)
    );
    let mut s = session("");
    assert_eq!(s.settings().protected_tools, vec!["skill".to_string()]);
    let r = s.prune(PruneMode::DryRun, NOW);
    assert_eq!((r.prune_protect, r.prune_minimum), (40_000, 20_000));
}

/// Token.estimate = max(0, round(len / 4)) over UTF-16 units; the prune weighs exactly this.
#[test]
fn estimate_is_round_len_over_four() {
    let cases: &[(&str, u64)] = &[
        ("", 0),
        ("a", 0),     // 0.25
        ("ab", 1),    // 0.5 rounds up
        ("abc", 1),   // 0.75
        ("abcd", 1),  // 1
        ("abcde", 1), // 1.25
        ("abcdef", 2),
        ("abcdefghij", 3), // 2.5 rounds up
        ("😀", 1),         // two UTF-16 units
        ("éé", 1),         // two units, four bytes
    ];
    for &(output, want) in cases {
        // PRUNE_PROTECT 0 / PRUNE_MINIMUM 0: every token of the one output is pruned.
        let mut s = new_session(overrides(0, 0), ModelLimits::default());
        for u in parse("user u1\nassistant a1\nuser u2\nuser u3") {
            apply(&mut s, u);
        }
        apply(&mut s, Update::UpsertPart(tool("a1", "p1", "read", output)));
        let r = s.prune(PruneMode::DryRun, NOW);
        assert_eq!(r.tokens_saved, want, "estimate of {output:?}");
        assert_eq!(r.tokens_scanned, want, "estimate of {output:?}");
    }
    // With the seed constants: 80000 chars behind a full window are exactly 20000 tokens.
    let mut s = session("user u1\nassistant a0\nassistant a1 read:p0=40000\nuser u2\nuser u3");
    apply(
        &mut s,
        Update::UpsertPart(tool("a0", "p1", "read", &chars(80_000))),
    );
    let r = s.prune(PruneMode::DryRun, NOW);
    assert_eq!(
        (part_ids(&r), r.tokens_saved),
        (vec!["p1".to_string()], 20_000)
    );
}

// ---- edge cases (seed 01 "Edge Cases") ------------------------------------------------

#[test]
fn empty_session() {
    check_prune("", false, &[], 0);
    let r = session("").prune(PruneMode::Commit, NOW);
    assert_eq!(r.tokens_scanned, 0);
    assert_eq!(r.reason, Some(NotCommitted::NothingBeyond));
    assert_eq!(
        r.reason_text().as_deref(),
        Some("nothing beyond the protected window (PRUNE_PROTECT 40000)")
    );
}

#[test]
fn no_tool_outputs() {
    check_prune(
        "
        user u1 text:t1=90000
        assistant a1 text:t2=90000
        user u2 text:t3=90000
        assistant a2 text:t4=90000
        user u3
        user u4
        ",
        false,
        &[],
        0,
    );
}

#[test]
fn all_protected() {
    check_prune(
        "
        user u1
        assistant a1 skill:s1=60000 skill:s2=60000
        user u2
        assistant a2 skill:s3=60000
        user u3
        user u4
        ",
        false,
        &[],
        0,
    );
}

#[test]
fn fewer_than_two_user_turns() {
    check_prune(
        "
        user u1
        assistant a1 read:p1=100000 read:p2=100000
        ",
        false,
        &[],
        0,
    );
}

/// Encountering `time.compacted` breaks the whole loop: p1 (older) is never counted.
#[test]
fn previous_compaction_stops_the_scan() {
    check_prune(
        "
        user u1
        assistant a1 read:p1=50000
        user u2
        assistant a2 read:p2=30000@compacted read:p3=20000
        user u3
        assistant a3 read:p4=45000
        user u4
        user u5
        ",
        true,
        &["p3", "p4"],
        65_000,
    );
}

#[test]
fn below_minimum_does_not_commit() {
    check_prune(
        "
        user u1
        assistant a1 read:p1=15000 read:p2=40000
        user u2
        user u3
        ",
        false,
        &["p1"],
        15_000,
    );
}

/// `pruned > PRUNE_MINIMUM`: a saving of exactly 20000 is not enough, 20001 is.
#[test]
fn minimum_is_strict() {
    let fixture = |n: u32| {
        format!(
            "
            user u1
            assistant a1 read:p1={n} read:p2=40000
            user u2
            user u3
            "
        )
    };
    check_prune(&fixture(19_999), false, &["p1"], 19_999);
    check_prune(&fixture(20_000), false, &["p1"], 20_000);
    check_prune(&fixture(20_001), true, &["p1"], 20_001);
    // The reason carries the figures, and says them only when asked.
    let held = session(&fixture(20_000)).prune(PruneMode::Commit, NOW);
    assert_eq!(held.reason, Some(NotCommitted::UnderMinimum));
    assert_eq!(
        held.reason_text().as_deref(),
        Some("saving 20000 is not above PRUNE_MINIMUM 20000")
    );
    let done = session(&fixture(20_001)).prune(PruneMode::Commit, NOW);
    assert_eq!((done.reason, done.reason_text()), (None, None));
}

/// `total > PRUNE_PROTECT`: a running total of exactly 40000 is still protected.
#[test]
fn protect_boundary_is_exact() {
    let fixture = |mid: u32| {
        format!(
            "
            user u1
            assistant a1 read:p1=25000
            assistant a2 read:p2={mid}
            assistant a3 read:p3=30000
            user u2
            user u3
            "
        )
    };
    // p3 30000, p2 → 40000 (protected), p1 → 65000 (pruned).
    check_prune(&fixture(10_000), true, &["p1"], 25_000);
    // p2 → 40001 > 40000: pruned, and so is everything older.
    check_prune(&fixture(10_001), true, &["p1", "p2"], 35_001);
}

/// One output alone above PRUNE_PROTECT is pruned itself (its own estimate counts first).
#[test]
fn a_single_output_above_protect_is_pruned() {
    check_prune(
        "
        user u1
        assistant a1 read:p1=40001
        user u2
        user u3
        ",
        true,
        &["p1"],
        40_001,
    );
}

/// A host sending a cleared output again as it first sent it (it knows nothing of
/// compactd's prune) does not bring it back: the stamp stays, as a strategy's mark does.
/// Before, the part read verbatim again for good (prune's scan stops at the newest part
/// it cleared, so it never went back to it).
#[test]
fn a_cleared_output_sent_again_stays_cleared() {
    let mut s = session("user u1\nassistant a1\nuser u2\nuser u3");
    let output = chars(160_004);
    apply(
        &mut s,
        Update::UpsertPart(tool("a1", "p1", "read", &output)),
    );
    let r = s.prune(PruneMode::Commit, NOW);
    assert_eq!(part_ids(&r), ["p1"]);
    let cleared = s.build_context();
    apply(
        &mut s,
        Update::UpsertPart(tool("a1", "p1", "read", &output)),
    );
    let now = s.build_context();
    assert!(
        now == cleared,
        "still cleared: {} tokens, {} before",
        now.tokens,
        cleared.tokens
    );
    assert!(matches!(
        &find(&s, "p1").kind,
        PartKind::Tool(t) if t.state.time.compacted == Some(NOW)
    ));
    assert_eq!(s.total_tokens(), rendered_tokens_from_scratch(&s));
    // Sent again with another output, it is another output: the stamp was for the old.
    let other = chars(1_000);
    apply(&mut s, Update::UpsertPart(tool("a1", "p1", "read", &other)));
    assert!(matches!(
        &find(&s, "p1").kind,
        PartKind::Tool(t) if t.state.time.compacted.is_none() && t.state.output == other
    ));
    assert_eq!(s.total_tokens(), rendered_tokens_from_scratch(&s));
}

#[test]
fn stops_at_summary_message() {
    check_prune(
        "
        user u1
        assistant a1 read:p1=50000
        user u2 compaction:c2
        assistant s2 summary text:t2=100
        user u3
        assistant a3 read:p3=30000
        user u4
        assistant a4 read:p4=45000
        user u5
        assistant a5 read:p5=1000
        user u6
        ",
        true,
        &["p3", "p4"],
        75_000,
    );
}

/// The seed stops at `msg.summary` on an assistant, finished or not.
#[test]
fn stops_at_unfinished_summary_too() {
    check_prune(
        "
        user u1
        assistant a1 read:p1=50000
        assistant s1 summary unfinished
        user u2
        assistant a2 read:p2=45000
        user u3
        user u4
        ",
        true,
        &["p2"],
        45_000,
    );
}

/// Only an assistant's `summary` is the compaction flag (a user's is a UI title).
#[test]
fn user_summary_flag_does_not_stop_the_scan() {
    check_prune(
        "
        user u1
        assistant a1 read:p1=30000
        user u2 summary
        assistant a2 read:p2=40000
        user u3
        user u4
        ",
        true,
        &["p1"],
        30_000,
    );
}

/// A summary inside the last two turns is skipped like everything else there.
#[test]
fn summary_in_the_active_turns_does_not_stop_the_scan() {
    check_prune(
        "
        user u1
        assistant a1 read:p1=30000
        assistant a2 read:p2=40000
        user u2
        assistant s2 summary
        user u3
        ",
        true,
        &["p1"],
        30_000,
    );
}

/// Turns are user messages seen newest first; messages are skipped while fewer than two
/// were seen. So the second-to-last user message is eligible and everything after it is not.
#[test]
fn skips_the_last_two_user_turns() {
    let base = "
        user u1
        assistant a1 read:p1=30000
        user u2
        assistant a2 read:p2=30000
        user u3 {u3}
        assistant a3 read:p3=50000
        user u4
        assistant a4 read:p4=50000
        ";
    check_prune(&base.replace("{u3}", ""), true, &["p1"], 30_000);
    // A tool part on the second-to-last user message itself is counted and pruned.
    check_prune(
        &base.replace("{u3}", "read:p0=45000"),
        true,
        &["p1", "p2", "p0"],
        105_000,
    );
}

#[test]
fn eligible_end_counts_turns_from_the_end() {
    let cases: &[(&[usize], usize, u32, Option<usize>)] = &[
        (&[], 0, 2, None),
        (&[0], 2, 2, None),
        (&[0, 2], 4, 2, Some(0)),
        (&[0, 2, 4, 6], 8, 2, Some(4)),
        (&[0, 2, 4, 6], 7, 2, Some(4)),
        (&[0, 2, 4], 6, 1, Some(4)),
        (&[0, 2, 4], 6, 3, Some(0)),
        (&[0, 2], 5, 0, Some(4)),
        (&[], 0, 0, None),
    ];
    for &(users, len, turns, want) in cases {
        assert_eq!(
            eligible_end(users, len, turns),
            want,
            "users {users:?} len {len} turns {turns}"
        );
    }
}

/// `skill` outputs are skipped (not counted, not pruned) and the scan goes on past them,
/// even past a compacted one (the protected check comes before the compacted check).
#[test]
fn protected_tool_is_skipped_without_stopping() {
    check_prune(
        "
        user u1
        assistant a1 read:p1=30000
        user u2
        assistant a2 read:p2=40000 skill:s1=100000 skill:s2=5@compacted
        user u3
        user u4
        ",
        true,
        &["p1"],
        30_000,
    );
}

#[test]
fn protected_tools_follow_settings() {
    let o = SessionOverrides {
        protected_tools: Some(vec!["read".into()]),
        ..Default::default()
    };
    check_prune_with(
        "
        user u1
        assistant a1 skill:p1=30000 read:r1=90000
        assistant a2 skill:p2=40000
        user u2
        user u3
        ",
        o,
        true,
        &["p1"],
        30_000,
    );
}

/// Pending, running and errored calls neither count toward PRUNE_PROTECT nor get pruned.
#[test]
fn non_completed_tools_are_ignored() {
    check_prune(
        "
        user u1
        assistant a1 read:p1=30000 bash:e1=50000@error
        user u2
        assistant a2 read:r1=50000@running bash:q1=50000@pending read:p2=40000
        user u3
        user u4
        ",
        true,
        &["p1"],
        30_000,
    );
}

#[test]
fn commit_stamps_now_and_keeps_outputs() {
    let mut s = session(
        "
        user u1
        assistant a1 read:p1=30000
        assistant a2 read:p2=40000
        user u2
        user u3
        ",
    );
    let before = find(&s, "p1");
    let total = s.total_tokens();
    let r = s.prune(PruneMode::Commit, NOW);
    assert!(r.committed);
    let after = find(&s, "p1");
    assert_eq!(state(&after).time.compacted, Some(NOW));
    assert_eq!(state(&after).output, state(&before).output);
    assert_eq!(state(&after).output.len(), 120_000);
    assert_eq!(state(&find(&s, "p2")).time.compacted, None);
    assert_eq!(s.compacted_count(), 1);
    // The output now counts as the placeholder (33 chars → 8 tokens).
    assert_eq!(s.total_tokens(), total - 30_000 + 8);
    assert_eq!(s.total_tokens(), tokens_from_scratch(&s));
}

#[test]
fn committed_output_reads_as_placeholder_in_context() {
    let mut s = session(
        "
        user u1
        assistant a1 read:p1=30000
        assistant a2 read:p2=40000
        user u2
        user u3
        ",
    );
    s.prune(PruneMode::Commit, NOW);
    let view = s.build_context();
    let outputs: Vec<(String, String)> = view
        .messages
        .iter()
        .flat_map(|m| &m.parts)
        .filter(|p| matches!(p.part.kind, PartKind::Tool(_)))
        .map(|p| {
            let out = &state(&p.part).output;
            (
                p.part.id.clone(),
                if out.len() > 40 {
                    "<full>".into()
                } else {
                    out.clone()
                },
            )
        })
        .collect();
    assert_eq!(
        outputs,
        vec![
            ("p1".to_string(), PLACEHOLDER.to_string()),
            ("p2".to_string(), "<full>".to_string()),
        ]
    );
    // The stored session still holds the output.
    assert_eq!(state(&find(&s, "p1")).output.len(), 120_000);
}

#[test]
fn pruning_twice_changes_nothing_the_second_time() {
    let mut s = session(
        "
        user u1
        assistant a1 read:p1=30000 read:p2=25000
        assistant a2 read:p3=40000
        user u2
        user u3
        ",
    );
    assert!(s.prune(PruneMode::Commit, NOW).committed);
    let after = s.messages().to_vec();
    let second = s.prune(PruneMode::Commit, NOW + 1);
    assert_eq!(
        (second.committed, second.parts.len(), second.tokens_saved),
        (false, 0, 0)
    );
    assert_eq!(s.messages(), after);
}

#[test]
fn dry_run_changes_nothing() {
    let mut s = session(
        "
        user u1
        assistant a1 read:p1=30000
        assistant a2 read:p2=40000
        user u2
        user u3
        ",
    );
    let before = s.messages().to_vec();
    let total = s.total_tokens();
    let r = s.prune(PruneMode::DryRun, NOW);
    assert_eq!(
        (r.dry_run, r.committed, part_ids(&r), r.tokens_saved),
        (true, false, vec!["p1".to_string()], 30_000)
    );
    assert_eq!(r.reason, Some(NotCommitted::DryRun));
    assert_eq!(r.reason_text().as_deref(), Some("dry run"));
    assert_eq!(s.messages(), before);
    assert_eq!(s.total_tokens(), total);
}

#[test]
fn prune_pending_is_the_plans_saving() {
    let mut s = session(
        "
        user u1
        assistant a1 read:p1=15000 read:p2=40000
        user u2
        user u3
        ",
    );
    assert_eq!(s.prune_pending(), 15_000);
    assert_eq!(session("").prune_pending(), 0);
}

// ---- automatic prune through `step` --------------------------------------------------

const AUTO: &str = "
    user u1
    assistant a1 read:p1=30000
    user u2
    assistant a2 read:p2=40000
    user u3
    user u4
    ";

#[test]
fn finished_assistant_runs_auto_prune() {
    let mut s = session(AUTO);
    let report = step(
        &mut s,
        Update::UpsertMessage(assistant("a4", "u4")),
        &config(),
        NOW,
    )
    .unwrap();
    let expected = PruneReport {
        committed: true,
        dry_run: false,
        tokens_saved: 30_000,
        // The output leaves the context; the placeholder takes its place.
        context_tokens_saved: 30_000 - CharsPerToken.count(crate::config::PLACEHOLDER) as i64,
        tokens_scanned: 70_000,
        parts: vec![PrunedPart {
            message_id: "a1".into(),
            part_id: "p1".into(),
            call_id: "call_p1".into(),
            tool: "read".into(),
            tokens: 30_000,
        }],
        reason: None,
        prune_protect: 40_000,
        prune_minimum: 20_000,
        strategies: Default::default(),
    };
    assert_eq!(report.events, vec![Event::Pruned(expected)]);
    assert_eq!(compacted_at(&s, NOW), vec!["p1".to_string()]);
}

#[test]
fn prune_off_means_no_auto_prune() {
    let o = SessionOverrides {
        prune: Some(false),
        ..Default::default()
    };
    let mut s = session_with(AUTO, o);
    let report = step(
        &mut s,
        Update::UpsertMessage(assistant("a4", "u4")),
        &config(),
        NOW,
    )
    .unwrap();
    assert_eq!(report.events, vec![]);
    assert_eq!(compacted_at(&s, NOW), Vec::<String>::new());
}

#[test]
fn unfinished_assistant_does_not_prune() {
    let mut s = session(AUTO);
    let mut a = assistant("a4", "u4");
    a.finish.clear();
    let report = step(&mut s, Update::UpsertMessage(a.clone()), &config(), NOW).unwrap();
    assert_eq!(report.events, vec![]);
    // Finishing it later does.
    a.finish = "stop".into();
    let report = step(&mut s, Update::UpsertMessage(a), &config(), NOW).unwrap();
    assert!(report.applied.finished);
    assert!(matches!(report.events.as_slice(), [Event::Pruned(r)] if r.committed));
}

/// Outputs prune will not clear (their saving is under PRUNE_MINIMUM) are no decision
/// waiting: they do not count toward the scheduler's MAX_HELD, past which it applies
/// every decision without weighing its cost. Before, 600 small old outputs beyond the
/// protected window switched the cache scheduler off for good.
#[test]
fn outputs_prune_will_not_clear_are_not_held_decisions() {
    // 600 small old outputs (12,000 tokens) behind a newer 39,990 that fills the window.
    let mut fixture = String::new();
    for i in 0..600 {
        fixture.push_str(&format!("user v{i}\nassistant b{i} read:s{i}=20\n"));
    }
    fixture.push_str("user u1\nassistant a1 read:big=39990\nuser u2\nuser u3\n");
    let mut s = session_with(&fixture, SessionOverrides::default());
    assert_eq!(
        s.held_decisions(),
        0,
        "12,000 tokens: under PRUNE_MINIMUM, nothing waits"
    );
    // With a minimum they reach, they are decisions waiting.
    let o = SessionOverrides {
        prune_minimum: Some(100),
        ..Default::default()
    };
    let mut s = session_with(&fixture, o);
    assert_eq!(s.held_decisions(), 600);
}

/// Found in review: every automatic run copied the whole list of outputs waiting beyond
/// the protected window before it found it could not commit (their saving not above
/// PRUNE_MINIMUM), once per finished message. A run that cannot commit and lists nothing
/// now reports from the window's figures, the same figures, without building the plan.
#[test]
fn a_run_that_cannot_commit_builds_no_plan() {
    use crate::engine::prune_index::PLANS_BUILT;
    use crate::engine::request_log::Scope;
    let plans = || PLANS_BUILT.with(std::cell::Cell::get);
    for model in [CacheModel::NONE, CacheModel::ANTHROPIC] {
        let o = SessionOverrides {
            cache_model: Some(model),
            ..overrides(100, u64::MAX)
        };
        let mut s = new_session(o, ModelLimits::default());
        let before = plans();
        for i in 0..40 {
            let (u, a) = (format!("u{i}"), format!("a{i}"));
            step(&mut s, Update::UpsertMessage(user(&u)), &config(), NOW).unwrap();
            let mut info = assistant(&a, &u);
            info.finish.clear();
            step(&mut s, Update::UpsertMessage(info.clone()), &config(), NOW).unwrap();
            let p = tool(&a, &format!("p{i}"), "read", &chars(400));
            step(&mut s, Update::UpsertPart(p), &config(), NOW).unwrap();
            info.finish = "stop".into();
            step(&mut s, Update::UpsertMessage(info), &config(), NOW).unwrap();
        }
        let quiet = s.prune_run(NOW, true, Scope::All, false);
        assert_eq!(plans(), before, "{model:?}: no plan built");
        assert!(s.prune_pending() > 0, "outputs wait beyond the window");
        let listed = s.prune(PruneMode::Commit, NOW);
        assert_eq!(listed.parts.len(), 37, "an explicit prune lists them");
        assert_eq!(
            PruneReport {
                parts: Vec::new(),
                ..listed
            },
            quiet
        );
    }
}

// ---- the incremental index against the reference scan --------------------------------

/// Applies the fixture one update at a time, checking the index after each.
fn check_index_along(fixture: &str, o: SessionOverrides) -> Session {
    let mut s = new_session(o, ModelLimits::default());
    for (i, u) in parse(fixture).into_iter().enumerate() {
        let what = format!("update {i}: {u:?}");
        apply(&mut s, u);
        assert_index_agrees(&mut s, &what);
    }
    s
}

const LONG: &str = "
    user u1 text:t1=5
    assistant a1 read:p1=60 bash:p2=30 text:t2=5
    user u2
    assistant a2 grep:p3=80 skill:s1=500 read:p4=10@running
    assistant a3 read:p5=45 bash:p6=5@error read:p7=70
    user u3
    assistant a4 read:p8=20@compacted read:p9=90
    user u4
    assistant a5 read:p10=100 read:p11=30
    user u5 compaction:c5
    assistant s5 summary text:t5=40
    user u6
    assistant a6 read:p12=120 read:p13=60 read:p14=10
    user u7
    assistant a7 read:p15=40
    user u8
    assistant a8 read:p16=100
    ";

#[test]
fn index_agrees_while_appending() {
    check_index_along(LONG, overrides(100, 10));
    check_index_along(LONG, overrides(0, 0));
    check_index_along(LONG, SessionOverrides::default());
}

#[test]
fn index_agrees_after_commit_and_more_appends() {
    let mut s = check_index_along(LONG, overrides(100, 10));
    assert!(s.prune(PruneMode::Commit, NOW).committed);
    assert_index_agrees(&mut s, "commit");
    for u in parse(
        "
        user u9
        assistant a9 read:p17=150 read:p18=20
        user u10
        user u11
        ",
    ) {
        apply(&mut s, u);
        assert_index_agrees(&mut s, "append after commit");
    }
    assert!(s.prune(PruneMode::Commit, NOW + 1).committed);
    assert_index_agrees(&mut s, "second commit");
}

/// A call deep in the eligible region completes after the window moved past it.
#[test]
fn index_agrees_after_late_completion_of_an_old_part() {
    let mut s = check_index_along(LONG, overrides(100, 10));
    let mut p4 = find(&s, "p4");
    let st = state_mut(&mut p4);
    st.status = ToolStatus::Completed;
    st.output = chars(4 * 200);
    apply(&mut s, Update::UpsertPart(p4));
    assert_index_agrees(&mut s, "late completion of p4");
    // And an old completed part growing its output.
    let mut p12 = find(&s, "p12");
    state_mut(&mut p12).output = chars(4 * 5);
    apply(&mut s, Update::UpsertPart(p12));
    assert_index_agrees(&mut s, "late edit of p12");
}

#[test]
fn index_agrees_after_deleting_a_tool_part() {
    let mut s = check_index_along(LONG, overrides(100, 10));
    for (msg, part) in [("a6", "p13"), ("a4", "p8"), ("a7", "p15")] {
        apply(
            &mut s,
            Update::DeletePart {
                message_id: msg.into(),
                part_id: part.into(),
            },
        );
        assert_index_agrees(&mut s, &format!("deleting {part}"));
    }
}

/// Deleting a non-tool part shifts the positions of the tool parts after it in the same
/// message; the index must not keep pointing at the old positions.
#[test]
fn index_agrees_after_deleting_a_text_part_before_a_candidate() {
    let mut s = check_index_along(
        "
        user u1
        assistant a1 text:t1=5 read:p1=60 read:p2=50
        user u2
        user u3
        ",
        overrides(50, 0),
    );
    assert_eq!(
        part_ids(&s.prune(PruneMode::DryRun, NOW)),
        vec!["p1".to_string()]
    );
    apply(
        &mut s,
        Update::DeletePart {
            message_id: "a1".into(),
            part_id: "t1".into(),
        },
    );
    assert_index_agrees(&mut s, "deleting text t1 before p1");
}

/// The same deletion, seen from the outside: the commit must stamp the parts the seed
/// picks (p1 only with PRUNE_PROTECT 50: p2 is the protected newest output; both with 0).
#[test]
fn commit_after_deleting_a_text_part_marks_the_right_parts() {
    for (protect, want) in [(50, vec!["p1"]), (0, vec!["p1", "p2"])] {
        let mut s = session_with(
            "
            user u1
            assistant a1 text:t1=5 read:p1=60 read:p2=50
            user u2
            user u3
            ",
            overrides(protect, 0),
        );
        // The host (or an earlier update) made the index current before the deletion.
        assert_eq!(part_ids(&s.prune(PruneMode::DryRun, NOW)), want);
        apply(
            &mut s,
            Update::DeletePart {
                message_id: "a1".into(),
                part_id: "t1".into(),
            },
        );
        let r = s.prune(PruneMode::Commit, NOW);
        assert_eq!(part_ids(&r), want, "PRUNE_PROTECT {protect}");
        assert_eq!(compacted_at(&s, NOW), want, "PRUNE_PROTECT {protect}");
    }
}

#[test]
fn index_agrees_after_settings_change() {
    let mut s = check_index_along(LONG, overrides(100, 10));
    let configure = |o: SessionOverrides| {
        Update::Configure(SessionInfo {
            id: "ses_test".into(),
            config: o,
            ..Default::default()
        })
    };
    let before = index_plan(&mut s);
    apply(&mut s, configure(overrides(30, 10)));
    assert_eq!(s.settings().prune_protect, 30);
    assert_index_agrees(&mut s, "prune_protect 100 → 30");
    assert_ne!(index_plan(&mut s), before, "the change must matter");
    apply(&mut s, configure(overrides(1000, 10)));
    assert_index_agrees(&mut s, "prune_protect 30 → 1000");
    for turns in [3, 1, 0, 5] {
        apply(
            &mut s,
            configure(SessionOverrides {
                protect_turns: Some(turns),
                ..Default::default()
            }),
        );
        assert_index_agrees(&mut s, &format!("protect_turns {turns}"));
    }
    apply(
        &mut s,
        configure(SessionOverrides {
            protected_tools: Some(vec!["read".into()]),
            ..Default::default()
        }),
    );
    assert_index_agrees(&mut s, "protected_tools [read]");
}

#[test]
fn index_agrees_after_late_summary_flag() {
    let mut s = check_index_along(LONG, overrides(100, 10));
    let mut a3 = s.messages()[s.position("a3").unwrap()].info.clone();
    a3.summary = true;
    apply(&mut s, Update::UpsertMessage(a3.clone()));
    assert_index_agrees(&mut s, "a3 became a summary");
    a3.summary = false;
    apply(&mut s, Update::UpsertMessage(a3));
    assert_index_agrees(&mut s, "a3 is no summary again");
    let mut s5 = s.messages()[s.position("s5").unwrap()].info.clone();
    s5.summary = false;
    apply(&mut s, Update::UpsertMessage(s5));
    assert_index_agrees(&mut s, "s5 is no summary any more");
}

#[test]
fn index_agrees_after_late_compacted_stamp_from_host() {
    let mut s = check_index_along(LONG, overrides(100, 10));
    let mut p13 = find(&s, "p13");
    state_mut(&mut p13).time.compacted = Some(7);
    apply(&mut s, Update::UpsertPart(p13.clone()));
    assert_index_agrees(&mut s, "p13 stamped by the host");
    state_mut(&mut p13).time.compacted = None;
    apply(&mut s, Update::UpsertPart(p13));
    assert_index_agrees(&mut s, "p13 stamp removed");
}
