//! Pins through compaction: a pinned part is carried once (after the summary, in its
//! message) and counted once in what the summary replaces; what the context never sends
//! takes nothing from it.

use super::*;
use crate::engine::{
    CommitIds, Committed, CompactionError, CompactionPlan, CompactionRequest, ErrorKind,
    SummaryOutcome, TailOptions,
};

/// A skill output too large to summarize in a head of 110 tokens of text.
fn skill_output() -> String {
    format!("# Deploy skill\n{}", chars(12_000))
}

/// Three turns: `first` (u1 and a1), a `skill` tool part k1 on a1 with `output`, then u2,
/// a2 (`a2_tokens` of text), u3 and a3 (10 tokens each).
fn skill_turns(first: &str, output: &str, a2_tokens: u32) -> Session {
    let mut s = session(first);
    apply(
        &mut s,
        Update::UpsertPart(tool("a1", "k1", "skill", output)),
    );
    let rest = format!(
        "user u2 text:t2=10\nassistant a2 text:x2={a2_tokens}\nuser u3 text:t3=10\nassistant a3 text:x3=10"
    );
    for u in parse(&rest) {
        apply(&mut s, u);
    }
    s
}

fn pin(message_id: &str, part_id: Option<&str>) -> Update {
    Update::Pin {
        message_id: message_id.into(),
        part_id: part_id.map(str::to_string),
        pinned: true,
    }
}

/// An automatic compaction keeping the last `turns` turns.
fn request(turns: u32) -> CompactionRequest {
    CompactionRequest {
        tail: TailOptions {
            turns,
            max_tokens: 15_000,
        },
        auto: true,
        overflow: true,
    }
}

fn commit(
    s: &mut Session,
    plan: &CompactionPlan,
    text: &str,
    prefix: &str,
) -> Result<Committed, CompactionError> {
    let outcome = SummaryOutcome {
        text: text.into(),
        usage: None,
        cost: 0.0,
        model: None,
    };
    let ids = CommitIds {
        prefix: prefix.into(),
    };
    s.commit_compaction(plan, &outcome, &ids, NOW, &config())
}

/// Context tokens of message `i` as stored.
fn tokens_of(s: &Session, i: usize) -> u64 {
    s.messages()[i]
        .parts
        .iter()
        .map(|p| p.context_tokens())
        .sum()
}

/// Before, the pinned skill output was both subtracted as pinned and as a protected
/// output the summary carries: `replaced_tokens` saturated at 0, every summary failed
/// `NotSmaller`, and a commit that passed sent the output twice.
#[test]
fn a_pinned_protected_output_is_carried_once_and_counted_once() {
    let mut s = skill_turns(
        "user u1 text:t1=10\nassistant a1 text:x1=100",
        &skill_output(),
        10,
    );
    apply(&mut s, pin("a1", Some("k1")));
    let plan = s.plan_compaction(request(2)).expect("plan");
    assert_eq!(plan.head, [0, 1]);
    let skill = s.messages()[1].parts[1].context_tokens();
    assert!(skill > 3_000);
    assert_eq!(plan.replaced_tokens, plan.head_tokens - skill);

    let done = commit(&mut s, &plan, &chars(4 * 50), "c1");
    assert!(done.is_ok(), "{done:?}");
    let json = s.context_openai().json;
    assert_eq!(json.matches("# Deploy skill").count(), 1, "{json}");
    assert!(!json.contains("Protected tool outputs"), "{json}");
    assert_unpin_refused(&mut s, "a1", Some("k1"), "k1");

    // A later compaction of everything carries it once still, by the pin alone.
    let plan = s.plan_compaction(request(0)).expect("second plan");
    assert_eq!(plan.carried_outputs, "");
    let done = commit(&mut s, &plan, "Deployed.", "c2");
    assert!(done.is_ok(), "{done:?}");
    let json = s.context_openai().json;
    assert_eq!(json.matches("# Deploy skill").count(), 1, "{json}");
}

/// Before, a pinned part and a protected output of an errored assistant message (which
/// the context never sends, so the head counts none of it) were subtracted from what the
/// summary replaces, and the output was carried into a context that never held it.
#[test]
fn an_unsent_message_takes_nothing_from_what_the_summary_replaces() {
    let mut s = skill_turns(
        "user u1 text:t1=500
         assistant a1 text:x1=100 error=APIError",
        &skill_output(),
        10,
    );
    apply(&mut s, pin("a1", Some("x1")));
    let plan = s.plan_compaction(request(2)).expect("plan");
    assert_eq!(plan.head, [0, 1]);
    assert_eq!(plan.head_tokens, tokens_of(&s, 0));
    assert_eq!(plan.replaced_tokens, plan.head_tokens);

    let done = commit(&mut s, &plan, &chars(4 * 100), "c1");
    assert!(done.is_ok(), "{done:?}");
    let json = s.context_openai().json;
    assert!(!json.contains("# Deploy skill"), "{json}");
}

/// Before, a pinned earlier summary counted in full as replaced though the context
/// carries it on: `replaced_tokens` held its 300 tokens, so a summary that grew the
/// context passed, and its protected output was carried on into the new summary's text
/// as well (sent twice, and a copy of it loaded again in the head too).
#[test]
fn a_pinned_summary_is_not_replaced_and_its_outputs_are_not_carried_on() {
    let skill = "# Deploy skill\nrun it";
    let mut s = skill_turns("user u1 text:t1=10\nassistant a1 text:x1=400", skill, 40);
    // The same skill loaded again, in what the second compaction summarizes.
    apply(&mut s, Update::UpsertPart(tool("a3", "k2", "skill", skill)));
    let plan = s.plan_compaction(request(2)).expect("plan");
    assert!(commit(&mut s, &plan, &chars(4 * 300), "c1").is_ok());
    apply(&mut s, pin("c1_summary", None));
    for u in parse("user u4 text:t4=10\nassistant a4 text:x4=10") {
        apply(&mut s, u);
    }

    let plan = s.plan_compaction(request(2)).expect("second plan");
    let c1_user = s.position("c1_user").expect("c1's request");
    assert!(plan.head_tokens < 100, "{}", plan.head_tokens);
    // What leaves the context: the head and c1's request; c1's summary stays.
    assert_eq!(
        plan.replaced_tokens,
        plan.head_tokens + tokens_of(&s, c1_user)
    );
    let grows = commit(&mut s, &plan, &chars(4 * 100), "c2");
    assert!(
        matches!(grows, Err(CompactionError::NotSmaller { .. })),
        "{grows:?}"
    );
    assert!(commit(&mut s, &plan, "Second.", "c2").is_ok());
    let json = s.context_openai().json;
    assert_eq!(json.matches("# Deploy skill").count(), 1, "{json}");
    assert_eq!(json.matches("Protected tool outputs").count(), 1, "{json}");
    assert_unpin_refused(&mut s, "c1_summary", None, "c1_summary_text");
}

/// Unpinning `part_id` of `message_id` is refused naming `lost` and `pinned`, and leaves
/// the session as it was: the pin alone carries a protected output there (a summary left
/// it to the pin), so the unpin would drop it from the context for good.
fn assert_unpin_refused(s: &mut Session, message_id: &str, part_id: Option<&str>, lost: &str) {
    let before = s.context_openai().json;
    let refused = s.apply(
        Update::Pin {
            message_id: message_id.into(),
            part_id: part_id.map(str::to_string),
            pinned: false,
        },
        &config(),
    );
    let e = refused.expect_err("the unpin would drop a protected output");
    assert_eq!(e.kind, ErrorKind::FailedPrecondition, "{e}");
    assert_eq!(e.field, "pinned", "{e}");
    assert!(e.message.contains(lost), "{e}");
    assert_eq!(s.context_openai().json, before);
    // Replayed from a log (an older build admitted it), the same unpin is applied: what
    // was admitted once is not refused again.
    let mut replayed = s.clone();
    let unpin = Update::Pin {
        message_id: message_id.into(),
        part_id: part_id.map(str::to_string),
        pinned: false,
    };
    let performed = replayed.replay(
        crate::engine::Change::Step {
            update: unpin,
            now_ms: NOW,
        },
        &config(),
    );
    assert!(performed.changed(), "{performed:?}");
}

/// What a summary summarized whole (no protected output), or a protected output the
/// summary holds itself, unpins as before.
#[test]
fn an_unpin_that_drops_no_protected_output_is_applied() {
    let mut s = skill_turns(
        "user u1 text:t1=400\nassistant a1 text:x1=100",
        "# Deploy skill\nrun it",
        10,
    );
    apply(&mut s, pin("a1", Some("x1")));
    let plan = s.plan_compaction(request(2)).expect("plan");
    let done = commit(&mut s, &plan, "First.", "c1");
    assert!(done.is_ok(), "{done:?}");
    // The skill output is in the summary's own text: pinning it and unpinning it again
    // drops nothing.
    apply(&mut s, pin("a1", Some("k1")));
    for part in ["k1", "x1"] {
        apply(
            &mut s,
            Update::Pin {
                message_id: "a1".into(),
                part_id: Some(part.into()),
                pinned: false,
            },
        );
    }
    let json = s.context_openai().json;
    assert_eq!(json.matches("# Deploy skill").count(), 1, "{json}");
}

/// A pin on the earlier summary lifted while the summary was written: its outputs are
/// carried on after all, since the earlier summary leaves the context.
#[test]
fn outputs_of_a_summary_unpinned_meanwhile_are_carried_on() {
    let mut s = skill_turns(
        "user u1 text:t1=10\nassistant a1 text:x1=400",
        "# Deploy skill\nrun it",
        40,
    );
    let plan = s.plan_compaction(request(2)).expect("plan");
    assert!(commit(&mut s, &plan, "First.", "c1").is_ok());
    apply(&mut s, pin("c1_summary", None));
    for u in parse("user u4 text:t4=10\nassistant a4 text:x4=10") {
        apply(&mut s, u);
    }
    let plan = s.plan_compaction(request(2)).expect("second plan");
    assert!(plan.carried_by_pin);
    apply(
        &mut s,
        Update::Pin {
            message_id: "c1_summary".into(),
            part_id: None,
            pinned: false,
        },
    );
    assert!(commit(&mut s, &plan, "Second.", "c2").is_ok());
    let json = s.context_openai().json;
    assert_eq!(json.matches("# Deploy skill").count(), 1, "{json}");
    assert!(!json.contains("First."), "{json}");
}
