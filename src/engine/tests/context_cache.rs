//! The context cache: a call renders only the messages that changed since the cache last
//! saw them, and reads exactly as a context rendered whole after every kind of change
//! (the traces' every change is checked in `tests/snapshot.rs`; here the changes the
//! traces never make: pins on carried messages, new settings, a trial rolled back or kept).

use super::*;
use crate::config::Strategy;
use crate::engine::ContextCache;
use crate::engine::session::Rendering;

/// Asserts the cached context reads as one rendered whole.
fn assert_fresh(s: &Session, cache: &mut ContextCache, what: &str) {
    assert_eq!(
        s.context_openai_cached(cache).json,
        s.context_openai().json,
        "{what}"
    );
}

#[test]
fn a_call_renders_only_the_messages_changed_since_the_last() {
    let mut s = session(
        "
        user u1 text:t1=10
        assistant a1 read:p1=300 text:x1=40
        user u2 text:t2=10
        assistant a2 bash:p2=200
        ",
    );
    let mut cache = ContextCache::default();
    let render = |s: &Session, cache: &mut ContextCache| {
        let mut rendered = 0;
        let c = s.context_openai_chunks(cache, "count", |_, out| {
            rendered += 1;
            out.push(b'x');
        });
        (c.json.len(), rendered)
    };
    assert_eq!(
        render(&s, &mut cache),
        (4, 4),
        "the first call renders every message"
    );
    assert_eq!(render(&s, &mut cache), (4, 0), "nothing changed");
    apply(&mut s, Update::UpsertPart(text("a2", "x2", "done")));
    assert_eq!(render(&s, &mut cache), (4, 1), "only a2 changed");
    apply(&mut s, Update::UpsertMessage(user("u3")));
    apply(&mut s, Update::UpsertPart(text("u3", "t3", "next")));
    assert_eq!(render(&s, &mut cache), (5, 1), "only u3 is new");
    // Two shapes are kept at once (a reply may carry both); a third replaces the one
    // used least recently.
    assert_fresh(&s, &mut cache, "JSON");
    assert_eq!(render(&s, &mut cache), (5, 0), "both shapes kept");
    let third = s.context_openai_chunks(&mut cache, "third", |_, out| out.push(b'y'));
    assert_eq!(third.json.len(), 5);
    assert_eq!(render(&s, &mut cache), (5, 0), "the JSON shape went");
    assert_eq!(cache.len(), 10);
}

#[test]
fn the_cache_counts_its_bytes_and_lets_go_of_summarized_messages() {
    let mut s = session(
        "
        user u1 text:t1=10
        assistant a1 read:p1=3000 text:x1=40
        user u2 text:t2=10
        assistant a2 bash:p2=200
        user u3 text:t3=10
        assistant a3 text:x3=50
        ",
    );
    let mut cache = ContextCache::default();
    let json = s.context_openai_cached(&mut cache).json;
    assert_eq!(cache.len(), 6);
    // Each message's chunk: its elements without the brackets and the commas between.
    let chunks = json.len() - 2 - 5;
    let slots = cache.held_bytes() - chunks as u64 - 6 * 16;
    assert!(slots > 0 && slots <= 6 * 128, "slots {slots}");
    compact_keeping(&mut s, 1, "Read the parser.", "cmp1");
    let before = cache.held_bytes();
    assert_fresh(&s, &mut cache, "after the compaction");
    // The compaction's two messages and the tail (u3, a3) are kept; u1 to a2 let go.
    assert_eq!(cache.len(), 4);
    assert!(
        cache.held_bytes() < before,
        "the read's chunk is given back"
    );
    cache.clear();
    assert!(cache.is_empty());
    assert_fresh(&s, &mut cache, "after clearing");
}

#[test]
fn pinning_a_part_of_a_carried_message_sends_it_at_once() {
    let mut s = session(THREE_TURNS_TO_PIN);
    let pin = |part: &str| Update::Pin {
        message_id: "a1".into(),
        part_id: Some(part.into()),
        pinned: true,
    };
    apply(&mut s, pin("p2"));
    compact_keeping(&mut s, 2, "Read the parser.", "cmp1");
    let mut cache = ContextCache::default();
    let before = s.context_openai_cached(&mut cache).json;
    assert!(before.contains("call_p2"));
    // a1 is carried for p2 alone; pinning its text carries that too.
    apply(&mut s, pin("x1"));
    let after = s.context_openai_cached(&mut cache).json;
    assert!(
        after.len() > before.len() + 100,
        "the newly pinned text is sent"
    );
    assert_fresh(&s, &mut cache, "after the pin");
}

#[test]
fn new_settings_render_every_message_again() {
    let (mut s, cfg) = twice_read();
    let report = s.prune(PruneMode::Commit, NOW);
    assert_eq!(report.strategies.parts.len(), 1);
    let mut cache = ContextCache::default();
    let json = s.context_openai_cached(&mut cache).json;
    assert_eq!(
        json.matches(&chars(4_000)).count(),
        1,
        "r1 reads superseded"
    );
    let mut info = s.info().clone();
    info.config
        .strategies
        .insert(Strategy::SupersedeDuplicates, false);
    s.apply(Update::Configure(info), &cfg).expect("configure");
    let json = s.context_openai_cached(&mut cache).json;
    assert_eq!(json.matches(&chars(4_000)).count(), 2, "r1 reads verbatim");
    assert_fresh(&s, &mut cache, "after the new settings");
}

#[test]
fn a_trial_rolled_back_reads_as_before_and_a_kept_one_as_its_outcome() {
    let (mut s, _) = twice_read();
    let mut cache = ContextCache::default();
    let before = s.context_openai_cached(&mut cache).json;
    let mark = crate::domain::StrategyMark {
        strategy: Strategy::SupersedeDuplicates,
        superseded_by: "call_r2".into(),
        time: NOW,
        keep: 0,
    };
    let run = |s: &mut Session, keep: bool| {
        let ((), (), kept) = s.trial_judged(
            |s| {
                s.rerender(1, 0, Rendering::Mark(Some(mark.clone())), true);
            },
            |_| ((), keep),
        );
        assert_eq!(kept, keep);
    };
    run(&mut s, false);
    // Rolled back: the context as before, and nothing rendered again (the message got
    // its revision back with its rendering).
    let rendered = cache.rendered_reused().0;
    assert_eq!(s.context_openai_cached(&mut cache).json, before);
    assert_eq!(cache.rendered_reused().0, rendered);
    run(&mut s, true);
    let after = s.context_openai_cached(&mut cache).json;
    assert_ne!(after, before, "the kept mark shows");
    assert_fresh(&s, &mut cache, "after the kept trial");
}
