//! A history loaded whole (an import, a replay) ages its parts as the live session did:
//! a compaction of compactd's that keeps a verbatim tail does not make the tail's turns
//! look older than they are.

use super::*;
use crate::domain::{FilePart, MessageInfo, Part, PartKind, Role, SessionInfo, TextPart};
use crate::engine::{CommitIds, CompactionRequest, PruneMode, SummaryOutcome, TailOptions};

const NOW: i64 = 1_705_512_345_678;

fn part(msg: &str, id: &str, kind: PartKind) -> Part {
    Part {
        id: id.into(),
        message_id: msg.into(),
        kind,
        mark: None,
        extra: Default::default(),
    }
}

fn text(msg: &str, id: &str, say: &str) -> Part {
    part(
        msg,
        id,
        PartKind::Text(TextPart {
            text: say.into(),
            ..Default::default()
        }),
    )
}

fn screenshot(msg: &str, id: &str) -> Part {
    part(
        msg,
        id,
        PartKind::File(FilePart {
            mime: "image/png".into(),
            filename: format!("{id}.png"),
            url: format!("data:image/png;base64,{}", "A".repeat(8_192)),
            ..Default::default()
        }),
    )
}

/// Three turns, each user message with a screenshot, then a compaction (`auto`: with its
/// auto-continue message) that keeps the last two verbatim.
fn compacted(auto: bool) -> Session {
    let config = EngineConfig::default();
    let mut s = Session::new(
        SessionInfo {
            id: "s".into(),
            ..Default::default()
        },
        &config,
    );
    for t in 0..3 {
        let (u, a) = (format!("u{t}"), format!("a{t}"));
        let mut assistant = MessageInfo::new(&a, Role::Assistant);
        assistant.parent_id = u.clone();
        assistant.finish = "stop".into();
        for update in [
            Update::UpsertMessage(MessageInfo::new(&u, Role::User)),
            Update::UpsertPart(text(&u, &format!("{u}_t"), "Why does it render like this?")),
            Update::UpsertPart(screenshot(&u, &format!("f{t}"))),
            Update::UpsertMessage(assistant),
            Update::UpsertPart(text(&a, &format!("{a}_t"), "Checking.")),
        ] {
            s.apply(update, &config).expect("applied");
        }
    }
    let tail = TailOptions {
        turns: 2,
        max_tokens: 15_000,
    };
    let request = CompactionRequest {
        tail,
        auto,
        overflow: auto,
    };
    let plan = s.plan_compaction(request).expect("plan");
    let outcome = SummaryOutcome {
        text: "Looked at the page.".into(),
        usage: None,
        cost: 0.0,
        model: None,
    };
    let ids = CommitIds {
        prefix: "cmp".into(),
    };
    s.commit_compaction(&plan, &outcome, &ids, NOW, &config)
        .expect("commit");
    s
}

/// Parts the strategies marked, by id.
fn marked(s: &Session) -> Vec<String> {
    let mut ids: Vec<String> = s
        .messages()
        .iter()
        .flat_map(|m| &m.parts)
        .filter(|p| p.part.mark.is_some())
        .map(|p| p.part.id.clone())
        .collect();
    ids.sort();
    ids
}

#[test]
fn a_loaded_compaction_with_a_tail_ages_as_the_live_one() {
    for auto in [true, false] {
        let mut live = compacted(auto);
        let export = Export {
            info: live.info().clone(),
            messages: live
                .messages()
                .iter()
                .map(|m| {
                    (
                        m.info.clone(),
                        m.parts.iter().map(|p| p.part.clone()).collect(),
                    )
                })
                .collect(),
        };
        let config = EngineConfig::default();
        let mut loaded =
            load(export, Default::default(), Default::default(), &config).expect("loads");
        live.prune(PruneMode::Commit, NOW);
        loaded.prune(PruneMode::Commit, NOW);
        // Sent: [request, summary, u1, a1, u2, a2, continue]: u1 is the third user turn
        // from the end (its screenshot ages); without the continue message (a manual
        // compaction) u1 and u2 are the last two. f0 is summarized.
        let aged: &[&str] = if auto { &["f1"] } else { &[] };
        assert_eq!(marked(&live), aged, "auto {auto}: live");
        assert_eq!(marked(&loaded), aged, "auto {auto}: loaded");
    }
}
