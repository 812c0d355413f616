//! The per-session cache model through the API (`SessionConfig.cache_model`): under the
//! server's default (`anthropic`) a decision on a part a request already sent is held
//! after a finished assistant message while its saving does not pay for the cache
//! rewrite; with `none` it applies at once. Held decisions apply on an explicit `Prune`,
//! together with a later decision that pays, or when the cache went cold. The value is
//! validated and reads back from `GetSession`.

use compactd::server::pb;

use crate::common::*;

/// The old, small output every scenario decides on: 500 tokens.
const OLD: usize = 2_000;
/// A big output: 15,000 tokens (below `capLargeOutputs`' 10% of usable input).
const BIG: usize = 60_000;
/// A tiny output: 50 tokens.
const TINY: usize = 200;

/// Host time of the assistant messages (`assistant_msg`).
const ASSISTANT_AT: i64 = 1_700_000_000_001;

/// Anthropic's cache lives 5 minutes.
const TTL_MS: i64 = 300_000;

/// Overrides of the scenario: the newest two tool results read in full, the cache model
/// as given (empty: the server's).
fn config(cache_model: &str) -> pb::SessionConfig {
    pb::SessionConfig {
        mask_keep: Some(2),
        cache_model: cache_model.into(),
        ..Default::default()
    }
}

/// One assistant step answering `u1`: the message (a new request, which sends every
/// part before it), its `read` outputs, then the message finished. Returns the events of
/// the finishing update.
async fn step(
    s: &mut EventStream,
    sid: &str,
    msg: &str,
    outputs: &[(&str, usize)],
) -> Vec<pb::ServerEvent> {
    s.expect_ack(sid, upsert_message(assistant_msg(msg, "u1")))
        .await;
    for (id, chars) in outputs {
        let part = tool_part(msg, id, "read", &output_of(id, *chars));
        s.expect_ack(sid, upsert_part(part)).await;
    }
    s.request(sid, upsert_message(finished(assistant_msg(msg, "u1"))))
        .await
}

/// The scenario, over the main stream: a small output `t1` (step a1), a big one `t2`
/// (a2), then a tiny `t3` (a3) that pushes `t1` out of the newest two. When a3 finishes,
/// `t1` may be masked; request a3 has sent it, and the big `t2` after it, to the provider.
/// Returns the events of a3's finishing update.
async fn build(s: &mut EventStream, sid: &str, cache_model: &str) -> Vec<pb::ServerEvent> {
    s.expect_ack(
        sid,
        open(session_with_config(
            sid,
            200_000,
            20_000,
            config(cache_model),
        )),
    )
    .await;
    s.expect_ack(sid, upsert_message(user_msg("u1"))).await;
    s.expect_ack(sid, upsert_part(text_part("u1", "u1-t", "read both files")))
        .await;
    let a1 = step(s, sid, "a1", &[("t1", OLD)]).await;
    assert_eq!(kinds(&a1), ["ack"], "nothing to decide yet: {a1:?}");
    let a2 = step(s, sid, "a2", &[("t2", BIG)]).await;
    assert_eq!(kinds(&a2), ["ack"], "two results, both kept: {a2:?}");
    step(s, sid, "a3", &[("t3", TINY)]).await
}

/// The output `id` reads as in the session's context.
async fn shown(c: &mut Client, sid: &str, id: &str) -> String {
    let ctx = get_context(c, sid).await;
    tool_state(find_part(&ctx.messages, id)).output.clone()
}

/// Asserts `output` is `t1`'s maskObservations placeholder: tool, call id, size, recall.
fn assert_masked_t1(output: &str) {
    assert_eq!(
        output,
        "[read output hidden to save context (2.0 KB); call compactd_recall with call_id \"call_t1\" to see it]"
    );
}

/// (part, strategy) of every part a report marked, in order.
fn marked(r: &pb::PruneReport) -> Vec<(&str, &str)> {
    r.marked
        .iter()
        .map(|m| (m.part_id.as_str(), m.strategy.as_str()))
        .collect()
}

#[tokio::test]
async fn a_decision_on_a_sent_part_is_held_under_anthropic_and_applies_at_once_without_a_cache() {
    let server = start_server().await;
    let mut c = server.client().await;
    let mut s = server.stream().await;

    // The server's default model (anthropic): masking t1 saves ~475 tokens but rewrites
    // the ~15,000 cached after it. Held: no event, the context still reads t1 in full.
    let held = build(&mut s, "cm-anthropic", "").await;
    assert_eq!(kinds(&held), ["ack"], "held: {held:?}");
    assert_eq!(
        shown(&mut c, "cm-anthropic", "t1").await,
        output_of("t1", OLD)
    );
    let stored = get_session(&mut c, "cm-anthropic").await;
    assert!(find_part(&stored.messages, "t1").mark.is_none());

    // The same sequence without a cache: applied when a3 finishes.
    let applied = build(&mut s, "cm-none", "none").await;
    assert_eq!(kinds(&applied), ["pruned", "ack"], "{applied:?}");
    let r = pruned(&applied)[0];
    assert_eq!(marked(r), [("t1", "maskObservations")], "{r:?}");
    assert!(!r.committed, "OpenCode's prune had nothing to clear: {r:?}");
    let savings: Vec<(&str, u32)> = r
        .strategies
        .iter()
        .map(|s| (s.strategy.as_str(), s.parts))
        .collect();
    assert_eq!(savings, [("maskObservations", 1)]);
    assert_masked_t1(&shown(&mut c, "cm-none", "t1").await);
    // The newest two read in full; the stored session keeps t1's output and the mark.
    assert_eq!(shown(&mut c, "cm-none", "t2").await, output_of("t2", BIG));
    assert_eq!(shown(&mut c, "cm-none", "t3").await, output_of("t3", TINY));
    let stored = get_session(&mut c, "cm-none").await;
    let t1 = find_part(&stored.messages, "t1");
    assert_eq!(tool_state(t1).output, output_of("t1", OLD));
    assert_eq!(
        t1.mark.as_ref().map(|m| m.strategy.as_str()),
        Some("maskObservations")
    );

    // The two sessions differ by exactly what the held decision would save.
    let full = get_context(&mut c, "cm-anthropic").await.estimated_tokens;
    let masked = get_context(&mut c, "cm-none").await.estimated_tokens;
    assert_eq!(full - masked, r.strategy_tokens_saved);
    assert!(r.strategy_tokens_saved > 400, "{r:?}");
}

#[tokio::test]
async fn an_explicit_prune_applies_held_decisions() {
    let server = start_server().await;
    let mut c = server.client().await;
    let mut s = server.stream().await;
    let sid = "cm-prune";
    let held = build(&mut s, sid, "anthropic").await;
    assert_eq!(kinds(&held), ["ack"], "{held:?}");

    // The held decision is queued, not dropped: a dry run lists it and changes nothing.
    let before = get_context(&mut c, sid).await;
    let dry = prune(&mut c, sid, true).await;
    assert_eq!(marked(&dry), [("t1", "maskObservations")], "{dry:?}");
    assert_eq!(get_context(&mut c, sid).await, before);

    // Prune applies it whatever the cache model says.
    let r = prune(&mut c, sid, false).await;
    assert_eq!(marked(&r), [("t1", "maskObservations")], "{r:?}");
    assert_masked_t1(&shown(&mut c, sid, "t1").await);
    assert_eq!(
        before.estimated_tokens - get_context(&mut c, sid).await.estimated_tokens,
        r.strategy_tokens_saved
    );
    let again = prune(&mut c, sid, false).await;
    assert!(again.marked.is_empty(), "applied once: {again:?}");
}

#[tokio::test]
async fn held_decisions_apply_together_once_the_saving_pays_for_the_rewrite() {
    let server = start_server().await;
    let mut c = server.client().await;
    let mut s = server.stream().await;
    let sid = "cm-pays";
    let held = build(&mut s, sid, "").await;
    assert_eq!(kinds(&held), ["ack"], "{held:?}");

    // a4's output pushes the big t2 out of the newest two: masking it saves ~15,000 of the
    // ~16,000 tokens after t1, which pays for the rewrite within the warm streak. Both
    // decisions apply together, the held one first.
    let events = step(&mut s, sid, "a4", &[("t4", OLD)]).await;
    assert_eq!(kinds(&events), ["pruned", "ack"], "{events:?}");
    let r = pruned(&events)[0];
    let mut ids = marked(r);
    ids.sort();
    assert_eq!(
        ids,
        [("t1", "maskObservations"), ("t2", "maskObservations")],
        "{r:?}"
    );
    assert_masked_t1(&shown(&mut c, sid, "t1").await);
    let t2 = shown(&mut c, sid, "t2").await;
    assert!(
        t2.starts_with("[read output hidden") && t2.contains("call_t2"),
        "{t2}"
    );
    assert_eq!(shown(&mut c, sid, "t4").await, output_of("t4", OLD));
}

#[tokio::test]
async fn held_decisions_apply_when_a_user_message_finds_the_cache_cold() {
    let server = start_server().await;
    let mut c = server.client().await;
    let mut s = server.stream().await;
    let sid = "cm-cold";
    let held = build(&mut s, sid, "").await;
    assert_eq!(kinds(&held), ["ack"], "{held:?}");

    let user_at = |id: &str, at: i64| {
        let mut m = user_msg(id);
        m.time = Some(pb::MessageTime {
            created: at,
            completed: None,
        });
        upsert_message(m)
    };
    // Within the TTL the cache is warm: still held.
    let warm = s.request(sid, user_at("u2", ASSISTANT_AT + 60_000)).await;
    assert_eq!(kinds(&warm), ["ack"], "{warm:?}");
    assert_eq!(shown(&mut c, sid, "t1").await, output_of("t1", OLD));

    // Past the TTL since the last request the next one rewrites everything anyway.
    let cold = s
        .request(sid, user_at("u3", ASSISTANT_AT + TTL_MS + 1))
        .await;
    assert_eq!(kinds(&cold), ["pruned", "ack"], "{cold:?}");
    assert_eq!(marked(pruned(&cold)[0]), [("t1", "maskObservations")]);
    assert_masked_t1(&shown(&mut c, sid, "t1").await);
}

#[tokio::test]
async fn the_cache_model_is_validated_and_reads_back() {
    let server = start_server().await;
    let mut c = server.client().await;
    let open_with = |id: &str, cache_model: &str| pb::OpenSessionRequest {
        session: Some(session_with_config(
            id,
            200_000,
            20_000,
            pb::SessionConfig {
                cache_model: cache_model.into(),
                ..Default::default()
            },
        )),
    };
    let read_back = async |c: &mut Client, id: &str| {
        get_session(c, id)
            .await
            .info
            .and_then(|i| i.config)
            .map(|cfg| cfg.cache_model)
    };

    for (given, reads) in [
        ("", ""), // inherits the server's
        ("none", "none"),
        ("OpenAI", "openai"),
        ("custom:0.25:1.5:60", "custom:0.25:1.5:60"),
        // Anthropic's own prices: accepted, and named.
        ("custom:0.1:1.25:300", "anthropic"),
    ] {
        let id = format!("cm-ok-{}", given.replace(':', "-"));
        c.open_session(open_with(&id, given))
            .await
            .unwrap_or_else(|e| panic!("{given:?} is accepted: {e:?}"));
        assert_eq!(
            read_back(&mut c, &id).await.as_deref(),
            Some(reads),
            "{given:?}"
        );
    }

    for bad in ["custom:1:2", "gemini", "custom:0.1:1.25:-5"] {
        let status = assert_status(
            c.open_session(open_with("cm-bad", bad)).await,
            tonic::Code::InvalidArgument,
            "cache_model",
        );
        assert!(status.message().contains(bad), "{status:?}");
    }
    let listed = c
        .list_sessions(pb::ListSessionsRequest::default())
        .await
        .expect("ListSessions")
        .into_inner();
    assert!(listed.sessions.iter().all(|s| s.id != "cm-bad"));

    // Re-opening with other overrides keeps the model; a new one replaces it.
    open_session(
        &mut c,
        pb::SessionInfo {
            config: Some(pb::SessionConfig {
                mask_keep: Some(3),
                ..Default::default()
            }),
            ..session("cm-ok-none")
        },
    )
    .await;
    assert_eq!(
        read_back(&mut c, "cm-ok-none").await.as_deref(),
        Some("none")
    );
    c.open_session(open_with("cm-ok-none", "openai"))
        .await
        .expect("a new model");
    assert_eq!(
        read_back(&mut c, "cm-ok-none").await.as_deref(),
        Some("openai")
    );
}
