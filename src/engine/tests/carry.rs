//! A replacing import keeps compactd's compactions (`carry.rs`): a host reloading a
//! session whole holds none of compactd's own messages; they are put back where they were
//! as long as the host's history is the one they summarized.

use super::compaction::{FIXTURE, TAIL, commit, context_ids, req};
use super::*;
use crate::engine::ExportMessage;
use crate::engine::carry::exported;

/// The session's messages as the host holds them: without compactd's (`cmp*` ids).
fn host_export(s: &Session) -> Vec<ExportMessage> {
    s.messages()
        .iter()
        .filter(|m| !m.info.id.starts_with("cmp"))
        .map(exported)
        .collect()
}

/// A new session loaded from an export, as ImportSession loads one.
fn load(messages: &[ExportMessage]) -> Session {
    let mut s = new_session(SessionOverrides::default(), ModelLimits::default());
    for (info, parts) in messages {
        apply(&mut s, Update::UpsertMessage(info.clone()));
        for p in parts {
            apply(&mut s, Update::UpsertPart(p.clone()));
        }
    }
    s
}

fn ids(messages: &[ExportMessage]) -> Vec<&str> {
    messages.iter().map(|(i, _)| i.id.as_str()).collect()
}

/// FIXTURE compacted automatically (tail u2..a3), then one more turn.
fn compacted() -> Session {
    let mut s = session(FIXTURE);
    let plan = s.plan_compaction(req(TAIL, true)).expect("plan");
    commit(&mut s, &plan, "We fixed the parser; next: tests.", true, 1);
    for u in parse("user u4 text:t5=10\nassistant a4 text:t6=40") {
        apply(&mut s, u);
    }
    s
}

#[test]
fn a_reload_without_compactds_messages_keeps_the_compaction() {
    let s = compacted();
    let mut export = host_export(&s);
    assert!(
        context_ids(&load(&export)).contains(&"u1".to_string()),
        "without carrying, the summarized head is sent again"
    );

    assert_eq!(s.compaction_trail().carry_into(&mut export), 3);
    let reloaded = load(&export);
    assert_eq!(ids(&export), ids(&host_export_with_all(&s)));
    assert_eq!(context_ids(&reloaded), context_ids(&s));
    assert_eq!(reloaded.context_tokens(), s.context_tokens());
}

/// Every message of the session, compactd's included, in stored order.
fn host_export_with_all(s: &Session) -> Vec<ExportMessage> {
    s.messages()
        .iter()
        .map(|m| (m.info.clone(), Vec::new()))
        .collect()
}

#[test]
fn messages_the_host_has_and_compactd_never_saw_follow_the_compaction() {
    let s = compacted();
    let mut export = host_export(&s);
    // A turn compactd missed, between a3 and u4 in the host's history.
    let at = export.iter().position(|(i, _)| i.id == "u4").expect("u4");
    let missed = parse("user ux text:tx=10");
    let Update::UpsertMessage(info) = &missed[0] else {
        panic!("fixture")
    };
    export.insert(at, (info.clone(), Vec::new()));

    assert_eq!(s.compaction_trail().carry_into(&mut export), 3);
    assert_eq!(
        ids(&export),
        [
            "u1",
            "a1",
            "u2",
            "a2",
            "u3",
            "a3",
            "cmp1_user",
            "cmp1_summary",
            "cmp1_continue",
            "ux",
            "u4",
            "a4"
        ]
    );
}

#[test]
fn a_history_that_lost_a_summarized_message_keeps_no_compaction() {
    let s = compacted();
    let mut export = host_export(&s);
    export.retain(|(i, _)| i.id != "a1");
    let before = ids(&export)
        .into_iter()
        .map(String::from)
        .collect::<Vec<_>>();
    assert_eq!(s.compaction_trail().carry_into(&mut export), 0);
    assert_eq!(ids(&export), before);
}

#[test]
fn a_history_in_another_order_keeps_no_compaction() {
    let s = compacted();
    let mut export = host_export(&s);
    export.swap(2, 3); // a2 before u2
    assert_eq!(s.compaction_trail().carry_into(&mut export), 0);
}

#[test]
fn messages_removed_after_the_compaction_leave_it_in_place() {
    // The host reverted the turn after the compaction.
    let s = compacted();
    let mut export = host_export(&s);
    export.retain(|(i, _)| i.id != "u4" && i.id != "a4");
    assert_eq!(s.compaction_trail().carry_into(&mut export), 3);
    assert_eq!(
        ids(&export)[6..],
        ["cmp1_user", "cmp1_summary", "cmp1_continue"]
    );
}

#[test]
fn a_compaction_the_export_holds_is_not_put_in_twice() {
    let s = compacted();
    let mut export: Vec<ExportMessage> = s.messages().iter().map(exported).collect();
    let n = export.len();
    assert_eq!(s.compaction_trail().carry_into(&mut export), 0);
    assert_eq!(export.len(), n);
}

#[test]
fn a_manual_compaction_and_a_second_one_are_both_carried() {
    let mut s = session(FIXTURE);
    let plan = s.plan_compaction(req(TAIL, false)).expect("plan");
    commit(&mut s, &plan, "First summary.", false, 1);
    for u in parse(
        "user u4 text:t5=10\nassistant a4 read:p5=3000\nuser u5 text:t7=10\nassistant a5 text:t8=40",
    ) {
        apply(&mut s, u);
    }
    let plan = s.plan_compaction(req(TAIL, true)).expect("second plan");
    commit(&mut s, &plan, "Second summary.", true, 2);

    let mut export = host_export(&s);
    // Manual: request and summary; automatic: and the continue.
    assert_eq!(s.compaction_trail().carry_into(&mut export), 5);
    let reloaded = load(&export);
    assert_eq!(context_ids(&reloaded), context_ids(&s));
    assert_eq!(reloaded.context_tokens(), s.context_tokens());
}

#[test]
fn a_summary_without_its_request_is_not_carried() {
    // The export holds compactd's request message but not its summary (a host that
    // mirrored one and lost the other): half a compaction is never put back.
    let s = compacted();
    let mut export = host_export(&s);
    let request = s
        .messages()
        .iter()
        .find(|m| m.info.id == "cmp1_user")
        .map(|m| {
            (
                m.info.clone(),
                m.parts.iter().map(|p| p.part.clone()).collect(),
            )
        })
        .expect("request");
    let at = export.iter().position(|(i, _)| i.id == "u4").expect("u4");
    export.insert(at, request);
    assert_eq!(s.compaction_trail().carry_into(&mut export), 0);
}

/// A compaction the host made itself (OpenCode's `/compact`): its request and summary, ids
/// of the host's.
fn host_compaction(s: &mut Session, tail_start: &str) {
    apply(s, Update::UpsertMessage(user("oc_u")));
    apply(
        s,
        Update::UpsertPart(Part {
            id: "oc_u_c".into(),
            message_id: "oc_u".into(),
            kind: PartKind::Compaction(crate::domain::CompactionPart {
                auto: false,
                overflow: false,
                tail_start_id: tail_start.into(),
            }),
            mark: None,
            extra: Default::default(),
        }),
    );
    apply(s, Update::UpsertMessage(summary("oc_s", "oc_u")));
    apply(
        s,
        Update::UpsertPart(text("oc_s", "oc_s_t", "the host's summary")),
    );
}

#[test]
fn a_compaction_the_host_made_and_undid_is_not_brought_back() {
    let mut s = session(FIXTURE);
    host_compaction(&mut s, "u2");
    assert_eq!(context_ids(&s)[..2], ["oc_u", "oc_s"]);
    // The user undid the compaction: the host's history no longer holds it.
    let mut export = host_export(&s);
    export.retain(|(i, _)| !i.id.starts_with("oc_"));
    assert_eq!(s.compaction_trail().carry_into(&mut export), 0);
    assert!(context_ids(&load(&export)).contains(&"u1".to_string()));
}

#[test]
fn a_message_the_summary_never_saw_before_its_tail_stops_the_carrying() {
    let s = compacted();
    let mut export = host_export(&s);
    // ux, between u1 and a1, would be hidden behind a summary that never read it.
    let missed = parse("user ux text:tx=10");
    let Update::UpsertMessage(info) = &missed[0] else {
        panic!("fixture")
    };
    export.insert(1, (info.clone(), Vec::new()));
    assert_eq!(s.compaction_trail().carry_into(&mut export), 0);
    // In the verbatim tail (after u2) it is sent anyway: the compaction is kept.
    let Update::UpsertPart(part) = &missed[1] else {
        panic!("fixture")
    };
    let mut export = host_export(&s);
    let at = export.iter().position(|(i, _)| i.id == "a2").expect("a2");
    export.insert(at, (info.clone(), vec![part.clone()]));
    assert_eq!(s.compaction_trail().carry_into(&mut export), 3);
    assert!(context_ids(&load(&export)).contains(&"ux".to_string()));
}

#[test]
fn a_synthetic_host_message_after_a_summary_is_not_taken_for_the_continue() {
    // A manual compaction (no continue), then a host message of synthetic text only (an
    // OpenCode `!shell` run), which the user then undid.
    let mut s = session(FIXTURE);
    let plan = s.plan_compaction(req(TAIL, false)).expect("plan");
    commit(&mut s, &plan, "We fixed the parser; next: tests.", false, 1);
    apply(&mut s, Update::UpsertMessage(user("ush")));
    let mut shell = text(
        "ush",
        "ush_t",
        "The following tool was executed by the user",
    );
    if let PartKind::Text(t) = &mut shell.kind {
        t.synthetic = true;
    }
    apply(&mut s, Update::UpsertPart(shell));
    let mut export = host_export(&s);
    export.retain(|(i, _)| i.id != "ush");
    assert_eq!(s.compaction_trail().carry_into(&mut export), 2);
    assert!(!ids(&export).contains(&"ush"));
}

/// A pin is compactd's own state too: a reload that keeps the compactions keeps the pins
/// on what the export still holds. Before, the pinned part of the summarized head fell
/// out of the context after the reload (no pin carried it past the summary).
#[test]
fn a_reload_keeps_the_pins_on_what_the_export_still_holds() {
    let mut s = session(FIXTURE);
    let pin = |message_id: &str, part_id: Option<&str>| Update::Pin {
        message_id: message_id.into(),
        part_id: part_id.map(str::to_string),
        pinned: true,
    };
    apply(&mut s, pin("a1", Some("p1")));
    apply(&mut s, pin("u3", None));
    let plan = s.plan_compaction(req(TAIL, true)).expect("plan");
    commit(&mut s, &plan, "We fixed the parser; next: tests.", true, 1);
    assert!(
        context_ids(&s).contains(&"a1".to_string()),
        "the pin carries a1"
    );

    let mut export = host_export(&s);
    let mut trail = s.compaction_trail();
    assert_eq!(trail.carry_into(&mut export), 3);
    let mut reloaded = load(&export);
    let pinned = trail.repin(&mut reloaded, &config());
    assert_eq!(context_ids(&reloaded), context_ids(&s));
    assert_eq!(reloaded.context_tokens(), s.context_tokens());
    assert!(reloaded.is_pinned(1, "p1"));
    assert_eq!(pinned, 2);
}

#[test]
fn a_pin_on_what_the_export_no_longer_holds_is_left_off() {
    let mut s = session(FIXTURE);
    apply(
        &mut s,
        Update::Pin {
            message_id: "a2".into(),
            part_id: Some("p2".into()),
            pinned: true,
        },
    );
    let mut export = host_export(&s);
    for (_, parts) in export.iter_mut() {
        parts.retain(|p| p.id != "p2");
    }
    let mut trail = s.compaction_trail();
    trail.carry_into(&mut export);
    let mut reloaded = load(&export);
    assert_eq!(trail.repin(&mut reloaded, &config()), 0);
    assert_eq!(reloaded.pins(), &Default::default());
}
