//! Overflow detection through the API. Limits context=100000, output=20000 give usable
//! input 80000 and, at the default ratio 0.92, threshold floor(80000 × 0.92) = 73600.

use compactd::config::EngineConfig;
use compactd::server::pb;

use crate::common::*;

const CONTEXT: u64 = 100_000;
const OUTPUT: u64 = 20_000;
const USABLE: u64 = 80_000;
const THRESHOLD: u64 = 73_600;

async fn open_limited(c: &mut Client, sid: &str) {
    open_session(c, session_with_limits(sid, CONTEXT, OUTPUT)).await;
}

#[tokio::test]
async fn usage_at_the_threshold_is_fine_and_one_token_more_overflows() {
    let server = start_server().await;
    let mut c = server.client().await;
    let sid = "o-edge";
    open_limited(&mut c, sid).await;

    let ev = put_usage(&mut c, sid, usage(THRESHOLD)).await;
    assert_eq!(kinds(&ev), ["ack"], "{ev:?}");
    let check = check_overflow(&mut c, sid).await;
    assert!(!check.overflow);
    assert_eq!(check.used, THRESHOLD);
    assert_eq!(check.crossed, "");

    let ev = put_usage(&mut c, sid, usage(THRESHOLD + 1)).await;
    assert_eq!(kinds(&ev), ["overflow", "ack"], "{ev:?}");
    let o = overflows(&ev)[0];
    assert!(o.overflow);
    assert_eq!(o.used, 73_601);
    assert_eq!(o.threshold, THRESHOLD);
    assert_eq!(o.usable, USABLE);
    assert_eq!(o.reserved, 0);
    assert_eq!(o.ratio, 0.92);
    assert_eq!(o.crossed, "used");
    assert_eq!(o.counting, "input+cache.read+output");
    assert_eq!(o.trigger, "usage");
    assert_eq!(o.reason, "");

    // The same figures on request.
    let check = check_overflow(&mut c, sid).await;
    assert!(check.overflow);
    assert_eq!((check.used, check.crossed.as_str()), (73_601, "used"));
    assert_eq!(check.trigger, "request");
}

#[tokio::test]
async fn the_stream_sends_the_overflow_event_before_the_ack_of_the_report() {
    let server = start_server().await;
    let mut s = server.stream().await;
    let sid = "o-stream";
    s.expect_ack(sid, open(session_with_limits(sid, CONTEXT, OUTPUT)))
        .await;
    let a = s.expect_ack(sid, report_usage(usage(THRESHOLD))).await;
    assert_eq!(a.kind, "report_usage");

    let seq = s.send(sid, report_usage(usage(THRESHOLD + 1))).await;
    let events = s.reply(seq).await;
    assert_eq!(kinds(&events), ["overflow", "ack"]);
    assert!(events.iter().all(|e| e.seq == seq && e.session_id == sid));
    let o = overflows(&events)[0];
    assert_eq!(
        (o.used, o.threshold, o.usable, o.crossed.as_str()),
        (73_601, THRESHOLD, USABLE, "used")
    );
    assert_eq!(o.ratio, 0.92);
}

#[tokio::test]
async fn cache_reads_output_and_total_count_towards_used() {
    let server = start_server().await;
    let mut c = server.client().await;
    let sid = "o-count";
    open_limited(&mut c, sid).await;

    // input + cache.read + output
    let ev = put_usage(
        &mut c,
        sid,
        pb::TokenUsage {
            input: 70_000,
            output: 3_000,
            cache: Some(pb::CacheTokens {
                read: 600,
                write: 0,
            }),
            ..Default::default()
        },
    )
    .await;
    assert_eq!(kinds(&ev), ["ack"], "73600 is not above: {ev:?}");
    let ev = put_usage(
        &mut c,
        sid,
        pb::TokenUsage {
            input: 70_000,
            output: 3_000,
            cache: Some(pb::CacheTokens {
                read: 601,
                write: 0,
            }),
            ..Default::default()
        },
    )
    .await;
    assert_eq!(overflows(&ev)[0].used, 73_601);

    // A provider total wins over the sum.
    let ev = put_usage(
        &mut c,
        sid,
        pb::TokenUsage {
            total: Some(1_000),
            input: 99_000,
            ..Default::default()
        },
    )
    .await;
    assert_eq!(kinds(&ev), ["ack"]);
    let check = check_overflow(&mut c, sid).await;
    assert_eq!((check.used, check.counting.as_str()), (1_000, "total"));

    // CACHE_COUNTING_INCLUDED: input already holds the cache reads.
    let sid2 = "o-included";
    open_session(
        &mut c,
        session_with_config(
            sid2,
            CONTEXT,
            OUTPUT,
            pb::SessionConfig {
                cache_counting: pb::CacheCounting::Included as i32,
                ..Default::default()
            },
        ),
    )
    .await;
    let ev = put_usage(
        &mut c,
        sid2,
        pb::TokenUsage {
            input: 73_000,
            cache: Some(pb::CacheTokens {
                read: 50_000,
                write: 0,
            }),
            ..Default::default()
        },
    )
    .await;
    assert_eq!(kinds(&ev), ["ack"]);
    let check = check_overflow(&mut c, sid2).await;
    assert_eq!(
        (check.used, check.counting.as_str()),
        (73_000, "input+output")
    );
}

#[tokio::test]
async fn new_tool_output_after_a_report_crosses_as_predicted() {
    let server = start_server().await;
    let mut s = server.stream().await;
    let mut c = server.client().await;
    let sid = "o-predicted";
    s.expect_ack(sid, open(session_with_limits(sid, CONTEXT, OUTPUT)))
        .await;
    s.expect_ack(sid, upsert_message(user_msg("u1"))).await;
    s.expect_ack(sid, upsert_message(assistant_msg("a1", "u1")))
        .await;
    let a = s.expect_ack(sid, report_usage(usage(70_000))).await;
    assert_eq!(a.kind, "report_usage");

    // 20000 chars = 5000 tokens of output, plus 3 tokens of tool input (`{"id":"t1"}`).
    s.expect_ack(
        sid,
        upsert_part(tool_part("a1", "t1", "bash", &output_of("t1", 20_000))),
    )
    .await;
    let check = check_overflow(&mut c, sid).await;
    assert_eq!((check.used, check.predicted), (70_000, 75_003));
    assert!(check.overflow, "the request check sees the prediction too");
    assert_eq!(check.crossed, "predicted");

    // Finishing the assistant message runs the check and reports the prediction.
    let seq = s
        .send(sid, upsert_message(finished(assistant_msg("a1", "u1"))))
        .await;
    let events = s.reply(seq).await;
    assert_eq!(kinds(&events), ["overflow", "ack"], "{events:?}");
    let o = overflows(&events)[0];
    assert!(o.overflow);
    assert_eq!(o.crossed, "predicted");
    assert_eq!(o.trigger, "finished");
    assert_eq!(
        (o.used, o.predicted, o.threshold),
        (70_000, 75_003, THRESHOLD)
    );

    // The next request starts (a new assistant message) and its report is the new
    // baseline: it covers t1, so the prediction restarts from it.
    s.expect_ack(sid, upsert_message(assistant_msg("a2", "u1")))
        .await;
    let events = s.request(sid, report_usage(usage(60_000))).await;
    assert_eq!(kinds(&events), ["ack"]);
    let check = check_overflow(&mut c, sid).await;
    assert_eq!((check.used, check.predicted), (60_000, 60_000));
    assert!(!check.overflow);
}

#[tokio::test]
async fn a_report_does_not_cover_tool_results_of_its_own_request() {
    let server = start_server().await;
    let mut s = server.stream().await;
    let mut c = server.client().await;
    let sid = "o-step";
    s.expect_ack(sid, open(session_with_limits(sid, CONTEXT, OUTPUT)))
        .await;
    s.expect_ack(sid, upsert_message(user_msg("u1"))).await;
    s.expect_ack(sid, upsert_message(assistant_msg("a1", "u1")))
        .await;
    // The tool result arrives before the usage of the request that asked for it.
    s.expect_ack(
        sid,
        upsert_part(tool_part("a1", "t1", "bash", &output_of("t1", 20_000))),
    )
    .await;
    s.expect_ack(sid, report_usage(usage(10_000))).await;
    let check = check_overflow(&mut c, sid).await;
    assert_eq!((check.used, check.predicted), (10_000, 15_000));
}

#[tokio::test]
async fn usage_on_a_finished_assistant_message_is_checked() {
    let server = start_server().await;
    let mut c = server.client().await;
    let sid = "o-msg-usage";
    open_limited(&mut c, sid).await;
    put_message(&mut c, sid, user_msg("u1")).await;
    let mut a1 = completed(assistant_msg("a1", "u1"));
    a1.tokens = Some(usage(80_000));
    let ev = put_message(&mut c, sid, a1).await;
    assert_eq!(kinds(&ev), ["overflow", "ack"], "{ev:?}");
    let o = overflows(&ev)[0];
    assert_eq!((o.used, o.crossed.as_str()), (80_000, "used"));
}

#[tokio::test]
async fn auto_compact_off_for_a_session_never_reports_overflow() {
    let server = start_server().await;
    let mut c = server.client().await;
    let sid = "o-off";
    open_session(
        &mut c,
        session_with_config(
            sid,
            CONTEXT,
            OUTPUT,
            pb::SessionConfig {
                auto_compact: Some(false),
                ..Default::default()
            },
        ),
    )
    .await;
    let ev = put_usage(&mut c, sid, usage(10_000_000)).await;
    assert_eq!(kinds(&ev), ["ack"], "{ev:?}");
    put_message(&mut c, sid, user_msg("u1")).await;
    put_message(&mut c, sid, assistant_msg("a1", "u1")).await;
    put_part(
        &mut c,
        sid,
        tool_part("a1", "t1", "read", &output_of("t1", 40_000)),
    )
    .await;
    let mut a1 = finished(assistant_msg("a1", "u1"));
    a1.tokens = Some(usage(9_000_000));
    let ev = put_message(&mut c, sid, a1).await;
    assert!(overflows(&ev).is_empty(), "{ev:?}");

    let check = check_overflow(&mut c, sid).await;
    assert!(!check.overflow);
    assert_eq!(check.crossed, "");
    assert_eq!(check.reason, "auto compaction is off");
    assert_eq!(check.used, 9_000_000, "the figures are still shown");

    // Turning it back on makes the same session overflow on the next report.
    open_session(
        &mut c,
        session_with_config(
            sid,
            0,
            0,
            pb::SessionConfig {
                auto_compact: Some(true),
                ..Default::default()
            },
        ),
    )
    .await;
    let ev = put_usage(&mut c, sid, usage(THRESHOLD + 1)).await;
    assert_eq!(kinds(&ev), ["overflow", "ack"], "{ev:?}");
}

#[tokio::test]
async fn auto_compact_off_for_the_server_never_reports_overflow() {
    let server = start_server_with_config(EngineConfig {
        auto_compact: false,
        ..EngineConfig::default()
    })
    .await;
    let mut s = server.stream().await;
    let sid = "o-server-off";
    s.expect_ack(sid, open(session_with_limits(sid, CONTEXT, OUTPUT)))
        .await;
    let events = s.request(sid, report_usage(usage(1_000_000))).await;
    assert_eq!(kinds(&events), ["ack"], "{events:?}");
    s.expect_ack(sid, upsert_message(user_msg("u1"))).await;
    let events = s
        .request(sid, upsert_message(finished(assistant_msg("a1", "u1"))))
        .await;
    assert_eq!(kinds(&events), ["ack"], "{events:?}");
    let events = s
        .request(
            sid,
            compactd::server::pb::client_update::Update::CheckOverflow(Default::default()),
        )
        .await;
    let Some(pb::server_event::Event::OverflowCheck(c)) = &events[0].event else {
        panic!("{events:?}")
    };
    assert!(!c.overflow);
    assert_eq!(c.reason, "auto compaction is off");

    // A session may turn it on for itself.
    let sid = "o-server-off-session-on";
    s.expect_ack(
        sid,
        open(session_with_config(
            sid,
            CONTEXT,
            OUTPUT,
            pb::SessionConfig {
                auto_compact: Some(true),
                ..Default::default()
            },
        )),
    )
    .await;
    let events = s.request(sid, report_usage(usage(THRESHOLD + 1))).await;
    assert_eq!(kinds(&events), ["overflow", "ack"], "{events:?}");
}

#[tokio::test]
async fn unlimited_context_never_reports_overflow() {
    let server = start_server().await;
    let mut c = server.client().await;
    let sid = "o-unlimited";
    open_session(&mut c, session_with_limits(sid, 0, OUTPUT)).await;
    let ev = put_usage(&mut c, sid, usage(5_000_000)).await;
    assert_eq!(kinds(&ev), ["ack"], "{ev:?}");
    put_message(&mut c, sid, user_msg("u1")).await;
    let ev = put_message(&mut c, sid, finished(assistant_msg("a1", "u1"))).await;
    assert_eq!(kinds(&ev), ["ack"], "{ev:?}");
    let check = check_overflow(&mut c, sid).await;
    assert!(!check.overflow);
    assert_eq!(check.reason, "unlimited context (limit.context = 0)");

    // A session opened without limits at all is the same.
    open_session(&mut c, session("o-no-limits")).await;
    let ev = put_usage(&mut c, "o-no-limits", usage(5_000_000)).await;
    assert_eq!(kinds(&ev), ["ack"], "{ev:?}");
}

#[tokio::test]
async fn thresholds_follow_the_preset_ratio_reserved_and_input_limit() {
    let server = start_server().await;
    let mut c = server.client().await;

    // OpenCode today (`session/overflow.ts`): ratio 1.0; without `limit.input` the
    // window less the output is usable as is (80000), and it compacts at that count.
    let sid = "o-opencode";
    let opencode = pb::SessionConfig {
        preset: pb::OverflowPreset::Opencode as i32,
        ..Default::default()
    };
    let s = open_session(
        &mut c,
        session_with_config(sid, CONTEXT, OUTPUT, opencode.clone()),
    )
    .await;
    let o = s.overflow.unwrap();
    assert_eq!(
        (o.usable, o.reserved, o.ratio, o.threshold),
        (USABLE, 0, 1.0, 80_000)
    );
    assert_eq!(kinds(&put_usage(&mut c, sid, usage(79_999)).await), ["ack"]);
    assert_eq!(
        kinds(&put_usage(&mut c, sid, usage(80_000)).await),
        ["overflow", "ack"]
    );
    // With `limit.input`, reserved min(20000, output) comes off it: 50000 - 20000.
    let sid = "o-opencode-input";
    let s = open_session(
        &mut c,
        pb::SessionInfo {
            limits: Some(pb::ModelLimits {
                context: CONTEXT,
                input: 50_000,
                output: OUTPUT,
            }),
            config: Some(opencode),
            ..session(sid)
        },
    )
    .await;
    let o = s.overflow.unwrap();
    assert_eq!(
        (o.usable, o.reserved, o.threshold),
        (50_000, 20_000, 30_000)
    );
    assert_eq!(kinds(&put_usage(&mut c, sid, usage(29_999)).await), ["ack"]);
    assert_eq!(
        kinds(&put_usage(&mut c, sid, usage(30_000)).await),
        ["overflow", "ack"]
    );

    // A custom ratio and reserve: floor((80000 - 10000) × 0.5) = 35000.
    let sid = "o-custom";
    let s = open_session(
        &mut c,
        session_with_config(
            sid,
            CONTEXT,
            OUTPUT,
            pb::SessionConfig {
                threshold: Some(0.5),
                reserved: Some(10_000),
                ..Default::default()
            },
        ),
    )
    .await;
    assert_eq!(s.overflow.unwrap().threshold, 35_000);
    assert_eq!(kinds(&put_usage(&mut c, sid, usage(35_000)).await), ["ack"]);
    assert_eq!(
        kinds(&put_usage(&mut c, sid, usage(35_001)).await),
        ["overflow", "ack"]
    );

    // limit.input is usable input as is; output over 32000 is capped at 32000.
    let sid = "o-input";
    let s = open_session(
        &mut c,
        pb::SessionInfo {
            limits: Some(pb::ModelLimits {
                context: 400_000,
                input: 50_000,
                output: 128_000,
            }),
            ..session(sid)
        },
    )
    .await;
    let o = s.overflow.unwrap();
    assert_eq!((o.usable, o.threshold), (50_000, 46_000));
    let sid = "o-big-output";
    let s = open_session(&mut c, session_with_limits(sid, 400_000, 128_000)).await;
    let o = s.overflow.unwrap();
    assert_eq!((o.usable, o.threshold), (368_000, 338_560));
}
