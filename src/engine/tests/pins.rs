//! Pins: a pinned part is never cleared by prune, never marked by a strategy, restored
//! when it already was, carried verbatim through compaction; unknown ids are refused and
//! leave the session as it was.

use serde_json::json;

use super::*;
use crate::domain::StrategyMark;
use crate::engine::{
    ApplyError, ByteLimit, CommitIds, CompactionRequest, ErrorKind, SummaryOutcome, TailOptions,
};

/// Three reads in turn 1 beyond the last two turns: p3 fills most of PRUNE_PROTECT
/// (40000), p1 and p2 are cleared (60000 > PRUNE_MINIMUM).
const PRUNABLE: &str = "
    user u1 text:t1=10
    assistant a1 read:p1=30000 read:p2=30000 read:p3=30000
    user u2 text:t2=10
    assistant a2 text:x2=10
    user u3 text:t3=10
    assistant a3 text:x3=10
";

fn pin(message_id: &str, part_id: Option<&str>, pinned: bool) -> Update {
    Update::Pin {
        message_id: message_id.into(),
        part_id: part_id.map(str::to_string),
        pinned,
    }
}

/// The output a tool part reads as in the context.
fn context_output(s: &Session, part_id: &str) -> Option<String> {
    s.build_context()
        .messages
        .iter()
        .flat_map(|m| &m.parts)
        .find(|p| p.part.id == part_id)
        .map(|p| state(&p.part).output.clone())
}

/// The running figures equal a recount, and the index the pin-aware reference scan.
fn assert_consistent(s: &mut Session, context: &str) {
    assert_eq!(s.total_tokens(), tokens_from_scratch(s), "{context}");
    assert_eq!(s.held_bytes(), s.held_bytes_from_scratch(), "{context}");
    assert_index_agrees(s, context);
}

#[test]
fn a_pinned_output_is_never_pruned_and_the_report_lists_what_was_cleared() {
    let mut s = session(PRUNABLE);
    assert_eq!(
        part_ids(&s.clone().prune(PruneMode::DryRun, NOW)),
        ["p1", "p2"]
    );
    apply(&mut s, pin("a1", Some("p1"), true));
    assert!(s.is_pinned(1, "p1") && !s.is_pinned(1, "p2"));
    assert_consistent(&mut s, "the pin");

    let total = s.total_tokens();
    let report = s.prune(PruneMode::Commit, NOW);
    assert!(report.committed);
    assert_eq!(part_ids(&report), ["p2"]);
    assert_eq!(report.tokens_saved, 30_000);
    // Scanned: p2 and the protected p3; the pinned p1 takes no room in the window.
    assert_eq!(report.tokens_scanned, 60_000);
    assert_eq!(
        total as i64 - s.total_tokens() as i64,
        report.context_tokens_saved
    );
    assert_eq!(compacted_at(&s, NOW), ["p2"]);
    assert_eq!(context_output(&s, "p1"), Some(chars(120_000)));
    assert_consistent(&mut s, "the commit");
    // Nothing is left to clear, now or later.
    assert!(!s.prune(PruneMode::Commit, NOW + 1).committed);
}

#[test]
fn a_pinned_message_keeps_every_part_it_holds_or_will_hold() {
    let mut s = session(PRUNABLE);
    apply(&mut s, pin("a1", None, true));
    apply(
        &mut s,
        Update::UpsertPart(tool("a1", "p4", "bash", &chars(120_000))),
    );
    assert!(s.is_pinned(1, "p4"));
    let report = s.prune(PruneMode::Commit, NOW);
    assert!(!report.committed && report.parts.is_empty(), "{report:?}");
    assert!(compacted_at(&s, NOW).is_empty());
    assert_consistent(&mut s, "a message pin");
}

#[test]
fn pinning_a_cleared_output_restores_it_and_a_resent_stamp_is_dropped() {
    let mut s = session(PRUNABLE);
    assert_eq!(part_ids(&s.prune(PruneMode::Commit, NOW)), ["p1", "p2"]);
    assert_eq!(context_output(&s, "p1").as_deref(), Some(PLACEHOLDER_TEXT));
    let (before, compacted) = (s.total_tokens(), s.compacted_count());

    apply(&mut s, pin("a1", Some("p1"), true));
    assert_eq!(state(&find(&s, "p1")).time.compacted, None);
    assert_eq!(context_output(&s, "p1"), Some(chars(120_000)));
    assert_eq!(s.compacted_count(), compacted - 1);
    assert!(s.total_tokens() > before + 29_000);
    assert_consistent(&mut s, "restoring p1");

    // A host re-sending the part with OpenCode's stamp does not clear it again.
    let mut resent = find(&s, "p1");
    state_mut(&mut resent).time.compacted = Some(NOW);
    apply(&mut s, Update::UpsertPart(resent));
    assert_eq!(context_output(&s, "p1"), Some(chars(120_000)));
    assert!(!s.prune(PruneMode::Commit, NOW + 1).committed);
    assert_consistent(&mut s, "the re-sent part");
}

#[test]
fn unknown_ids_are_refused_naming_the_field_and_change_nothing() {
    let mut s = session(PRUNABLE);
    apply(&mut s, pin("a1", Some("p2"), true));
    let (messages, bytes, tokens) = (s.messages().to_vec(), s.held_bytes(), s.total_tokens());
    let refused = |s: &mut Session, u: Update| s.apply(u, &config()).expect_err("refused");

    let e: ApplyError = refused(&mut s, pin("nope", Some("p1"), true));
    assert_eq!(
        (e.kind, e.field.as_str()),
        (ErrorKind::NotFound, "message_id")
    );
    assert!(e.message.contains("nope"), "{e}");
    let e = refused(&mut s, pin("a1", Some("nope"), true));
    assert_eq!((e.kind, e.field.as_str()), (ErrorKind::NotFound, "part_id"));
    // A part of another message is not this message's part.
    let e = refused(&mut s, pin("u1", Some("p1"), false));
    assert_eq!(e.field, "part_id");
    let e = refused(&mut s, pin("nope", None, false));
    assert_eq!(e.field, "message_id");

    assert_eq!(s.messages(), messages.as_slice());
    assert_eq!((s.held_bytes(), s.total_tokens()), (bytes, tokens));
    assert!(!s.is_pinned(1, "p1") && s.is_pinned(1, "p2"));
}

#[test]
fn pins_count_toward_the_bytes_held_and_go_with_their_part() {
    let mut s = session(PRUNABLE);
    let empty = s.held_bytes();
    apply(&mut s, pin("a1", Some("p1"), true));
    apply(&mut s, pin("a1", None, true));
    let pinned = s.held_bytes();
    assert!(pinned > empty);
    assert_eq!(pinned, s.held_bytes_from_scratch());
    // The same pin twice holds nothing more.
    apply(&mut s, pin("a1", Some("p1"), true));
    assert_eq!(s.held_bytes(), pinned);

    // A pin past the byte limit is refused like any growth.
    s.set_byte_limit(ByteLimit {
        bytes: pinned,
        name: "max_session_bytes",
        value: pinned,
    });
    let e = s
        .apply(pin("a1", Some("p3"), true), &config())
        .expect_err("over the limit");
    assert_eq!(e.kind, ErrorKind::ResourceExhausted);
    assert!(!s.pins().holds(1, Some("p3")));
    assert_eq!(s.held_bytes(), pinned);
    s.set_byte_limit(ByteLimit::NONE);

    // Unpinning the message leaves the part's own pin; deleting the part drops it.
    apply(&mut s, pin("a1", None, false));
    assert!(s.is_pinned(1, "p1") && !s.is_pinned(1, "p2"));
    apply(
        &mut s,
        Update::DeletePart {
            message_id: "a1".into(),
            part_id: "p1".into(),
        },
    );
    assert!(!s.is_pinned(1, "p1"));
    assert_consistent(&mut s, "the deletion");
}

#[test]
fn pinned_parts_are_carried_verbatim_through_compactions() {
    let mut s = session(THREE_TURNS_TO_PIN);
    apply(&mut s, pin("a1", Some("p2"), true));
    apply(&mut s, pin("u1", None, true));
    let request = CompactionRequest {
        tail: TailOptions {
            turns: 2,
            max_tokens: 15_000,
        },
        auto: false,
        overflow: false,
    };
    let plan = s.plan_compaction(request).expect("plan");
    // The head is summarized whole; what it replaces leaves the pinned parts out.
    assert_eq!(plan.head.len(), 2);
    let carried =
        s.messages()[0].parts[0].context_tokens() + s.messages()[1].parts[2].context_tokens();
    assert!(carried > 500);
    assert_eq!(plan.replaced_tokens, plan.head_tokens - carried);
    let outcome = |text: &str| SummaryOutcome {
        text: text.into(),
        usage: None,
        cost: 0.0,
        model: None,
    };
    let ids = |n: u32| CommitIds {
        prefix: format!("cmp{n}"),
    };
    s.commit_compaction(&plan, &outcome("Read the parser."), &ids(1), NOW, &config())
        .expect("commit");

    // Compaction message, summary, the carried messages with only their pinned parts,
    // then the verbatim tail.
    let view = s.build_context();
    let shape: Vec<(String, Vec<String>)> = view
        .messages
        .iter()
        .map(|m| {
            let parts = m.parts.iter().map(|p| p.part.id.clone()).collect();
            (m.info.id.clone(), parts)
        })
        .collect();
    let expected: Vec<(&str, Vec<&str>)> = vec![
        ("cmp1_user", vec!["cmp1_compaction"]),
        ("cmp1_summary", vec!["cmp1_summary_text"]),
        ("u1", vec!["t1"]),
        ("a1", vec!["p2"]),
        ("u2", vec!["t2"]),
        ("a2", vec!["p3"]),
        ("u3", vec!["t3"]),
        ("a3", vec!["x3"]),
    ];
    let expected: Vec<(String, Vec<String>)> = expected
        .into_iter()
        .map(|(m, ps)| (m.into(), ps.into_iter().map(String::from).collect()))
        .collect();
    assert_eq!(shape, expected);
    assert_eq!(context_output(&s, "p2"), Some(chars(2_000)));
    assert_eq!(view.tokens, view_tokens_from_parts(&view));
    assert_eq!(s.context_tokens(), view.tokens);
    // The OpenAI shape keeps the carried call with its result.
    let openai = view.to_openai();
    let json: serde_json::Value = serde_json::from_str(&s.context_openai().json).unwrap();
    assert_eq!(json, openai);
    let call = openai
        .as_array()
        .expect("array")
        .iter()
        .position(|m| m["tool_calls"][0]["id"] == "call_p2")
        .expect("carried call");
    assert_eq!(
        openai[call + 1],
        json!({"role": "tool", "tool_call_id": "call_p2", "content": chars(2_000)})
    );

    // A second compaction summarizes the old tail and carries the pins again.
    let plan = s
        .plan_compaction(CompactionRequest {
            tail: TailOptions {
                turns: 0,
                max_tokens: 0,
            },
            ..request
        })
        .expect("second plan");
    s.commit_compaction(
        &plan,
        &outcome("Parser read, tests run."),
        &ids(2),
        NOW,
        &config(),
    )
    .expect("second commit");
    let ids: Vec<String> = s
        .build_context()
        .messages
        .iter()
        .map(|m| m.info.id.clone())
        .collect();
    assert_eq!(ids, ["cmp2_user", "cmp2_summary", "u1", "a1"]);
    assert_eq!(context_output(&s, "p2"), Some(chars(2_000)));
}

// ---- with the strategies on ----------------------------------------------------------

fn mark_of(s: &Session, part_id: &str) -> Option<StrategyMark> {
    find(s, part_id).mark
}

#[test]
fn a_pinned_part_is_never_marked_by_a_strategy() {
    let (mut s, cfg) = twice_read();
    s.apply(pin("a1", Some("r1"), true), &cfg).expect("pin");
    let report = s.prune(PruneMode::Commit, NOW);
    assert!(
        report.strategies.parts.is_empty(),
        "{:?}",
        report.strategies
    );
    assert_eq!(mark_of(&s, "r1"), None);
    assert_eq!(context_output(&s, "r1"), Some(chars(4_000)));
}

#[test]
fn pinning_a_marked_part_restores_it_and_unpinning_lets_the_next_run_mark_it() {
    let (mut s, cfg) = twice_read();
    let report = s.prune(PruneMode::Commit, NOW);
    assert_eq!(report.strategies.parts.len(), 1);
    assert_eq!(
        mark_of(&s, "r1").map(|m| m.superseded_by),
        Some("call_r2".into())
    );
    let reduced = s.total_tokens();

    s.apply(pin("a1", Some("r1"), true), &cfg).expect("pin");
    assert_eq!(mark_of(&s, "r1"), None);
    assert_eq!(context_output(&s, "r1"), Some(chars(4_000)));
    assert!(s.total_tokens() > reduced);
    assert_eq!(s.total_tokens(), rendered_tokens_from_scratch(&s));
    assert!(s.prune(PruneMode::Commit, NOW + 1).strategies.is_empty());

    s.apply(pin("a1", Some("r1"), false), &cfg).expect("unpin");
    let again = s.prune(PruneMode::Commit, NOW + 2);
    assert_eq!(again.strategies.parts.len(), 1, "{:?}", again.strategies);
    assert_eq!(again.strategies.parts[0].part_id, "r1");
    assert_eq!(mark_of(&s, "r1").map(|m| m.time), Some(NOW + 2));
    assert_eq!(s.total_tokens(), reduced);
}

/// The text a cleared output reads as.
const PLACEHOLDER_TEXT: &str = crate::config::PLACEHOLDER;

/// A second compaction whose tail starts before the first's boundary skips the first
/// compaction's pair from the order; a pin on that pair's summary is carried all the
/// same. Before, "First summary." left every shape of the context.
#[test]
fn a_pinned_earlier_summary_inside_a_later_tail_is_carried() {
    let mut s = session(
        "user u1 text:t1=10
         assistant a1 text:x1=40
         user u2 text:t2=10
         assistant a2 text:x2=40
         user u3 text:t3=10
         assistant a3 text:x3=50",
    );
    compact_keeping(&mut s, 2, "First summary.", "c1");
    let first = s
        .messages()
        .iter()
        .find(|m| m.info.summary)
        .expect("a summary")
        .info
        .id
        .clone();
    apply(&mut s, pin(&first, None, true));
    for u in parse("user u4 text:t4=10\nassistant a4 text:x4=20") {
        apply(&mut s, u);
    }
    compact_keeping(&mut s, 2, "Second summary.", "c2");
    assert!(s.context_openai().json.contains("Second summary."));
    assert!(
        s.context_openai().json.contains("First summary."),
        "{}",
        s.context_openai().json
    );
    assert!(
        s.build_context()
            .messages
            .iter()
            .any(|m| m.info.id == first)
    );
    assert_consistent(&mut s, "after the second compaction");
}

/// Unpinning a part its message's pin covers is refused naming `part_id`, and the pin
/// stands. Before, it was acknowledged and changed nothing: the part stayed pinned
/// (Recall said so) though the host had just unpinned it. Its own pin, beside the
/// message's, is lifted once the message's is.
#[test]
fn unpinning_a_part_its_message_pin_covers_is_refused() {
    let mut s = session(PRUNABLE);
    apply(&mut s, pin("a1", None, true));
    apply(&mut s, pin("a1", Some("p1"), true));
    let before = s.clone();
    let e = s
        .apply(pin("a1", Some("p2"), false), &config())
        .expect_err("covered by the message's pin");
    assert_eq!(e.kind, ErrorKind::FailedPrecondition, "{e}");
    assert_eq!(e.field, "part_id", "{e}");
    assert!(s.is_pinned(1, "p2"));
    assert_eq!(s.context_openai().json, before.context_openai().json);
    // Unpinned through the message, the part's own pin (p1) is what is left.
    apply(&mut s, pin("a1", None, false));
    assert!(s.is_pinned(1, "p1") && !s.is_pinned(1, "p2"));
    apply(&mut s, pin("a1", Some("p1"), false));
    assert!(!s.is_pinned(1, "p1"));
}
