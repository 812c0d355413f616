//! More compaction over gRPC against the fake OpenAI-compatible endpoint: the folded
//! previous summary, carried todos, the cooldown, failures that must change nothing
//! (exhausted retries, a stream cut after tokens, a timeout mid-stream), one compaction
//! per session, `Subscribe` (all sessions, one session, a watcher that stops reading),
//! cost, the API key read from a file by the real binary, and the context's shape after
//! an automatic compaction with messages arriving while the summary is written.

use std::sync::Arc;
use std::time::Duration;

use compactd::server::pb;
use compactd::server::pb::compaction_event::Event as Ce;
use compactd::server::pb::session_event::Event as Se;
use compactd::server::{CompactionConfig, ServerOptions};
use compactd::summarize::{ApiKey, LlmConfig, OpenAiSummarizer};
use prost::Message as _;
use tokio_stream::StreamExt;

use crate::common::binary::Binary;
use crate::common::fake_llm::{FakeLlm, Reply};
use crate::common::*;

const SECRET: &str = "sk-test-MORE-0123456789";
const SID: &str = "cm";
/// The auto-continue text (seed 02).
const CONTINUE: &str = "Continue if you have next steps";

// ---- helpers (small copies of compaction.rs's, so that file stays untouched) ----------

/// A server whose summarizer talks to `fake`, with fast retries and `tune` applied.
async fn server_with(fake: &FakeLlm, tune: impl FnOnce(&mut LlmConfig)) -> TestServer {
    let mut llm = LlmConfig::new(fake.base_url(), "fake-model");
    llm.api_key = Some(ApiKey::new(SECRET));
    llm.timeout = Duration::from_secs(20);
    llm.retry_base = Duration::from_millis(5);
    tune(&mut llm);
    let compaction = CompactionConfig {
        summarizer: Some(Arc::new(OpenAiSummarizer::new(llm))),
        ..Default::default()
    };
    start_server_with_options(ServerOptions {
        compaction,
        ..Default::default()
    })
    .await
}

async fn server_with_llm(fake: &FakeLlm) -> TestServer {
    server_with(fake, |_| {}).await
}

/// Three user turns u1..u3, each answered (a1..a3) with a 4,000-character `read` output.
async fn seed_turns(client: &mut Client, sid: &str) {
    for (u, a, n) in [("u1", "a1", 1), ("u2", "a2", 2), ("u3", "a3", 3)] {
        put_message(client, sid, user_msg(u)).await;
        put_part(
            client,
            sid,
            text_part(u, &format!("{u}-t"), &format!("user turn {n}")),
        )
        .await;
        put_message(client, sid, assistant_msg(a, u)).await;
        put_part(
            client,
            sid,
            tool_part(
                a,
                &format!("{a}-read"),
                "read",
                &output_of(&format!("{a}-read"), 4_000),
            ),
        )
        .await;
        put_message(client, sid, finished(assistant_msg(a, u))).await;
    }
}

/// A roomy session (never overflows) with three turns.
async fn seed_session(client: &mut Client, sid: &str) {
    open_session(client, session_with_limits(sid, 100_000, 20_000)).await;
    seed_turns(client, sid).await;
}

fn opts(tail_turns: Option<u32>) -> pb::CompactOptions {
    pb::CompactOptions {
        tail_turns,
        ..Default::default()
    }
}

/// Runs `Compact` to its end and returns every event.
async fn compact_with(
    client: &mut Client,
    sid: &str,
    options: pb::CompactOptions,
) -> Result<Vec<pb::CompactionEvent>, tonic::Status> {
    let request = pb::CompactRequest {
        session_id: sid.into(),
        options: Some(options),
    };
    let mut stream = client.compact(request).await?.into_inner();
    let mut events = Vec::new();
    while let Some(e) = stream.next().await {
        events.push(e?);
    }
    Ok(events)
}

async fn compact(client: &mut Client, sid: &str) -> Vec<pb::CompactionEvent> {
    compact_with(client, sid, opts(None))
        .await
        .expect("Compact runs")
}

fn compacted(events: &[pb::CompactionEvent]) -> &pb::SessionCompacted {
    match events.last().and_then(|e| e.event.as_ref()) {
        Some(Ce::Compacted(c)) => c,
        other => panic!("expected session.compacted last, got {other:?} in {events:?}"),
    }
}

fn failure(events: &[pb::CompactionEvent]) -> &pb::CompactionFailed {
    match events.last().and_then(|e| e.event.as_ref()) {
        Some(Ce::Failed(f)) => f,
        other => panic!("expected a failure last, got {other:?} in {events:?}"),
    }
}

fn text_of(m: &pb::Message) -> String {
    m.parts
        .iter()
        .filter_map(|p| match &p.kind {
            Some(pb::part::Kind::Text(t)) => Some(t.text.as_str()),
            _ => None,
        })
        .collect()
}

fn ids(ctx: &pb::Context) -> Vec<String> {
    ctx.messages
        .iter()
        .map(|m| m.info.as_ref().expect("message info").id.clone())
        .collect()
}

fn stored_message<'a>(session: &'a pb::GetSessionResponse, id: &str) -> &'a pb::Message {
    session
        .messages
        .iter()
        .find(|m| m.info.as_ref().is_some_and(|i| i.id == id))
        .unwrap_or_else(|| panic!("message {id} is stored"))
}

/// GetSession, compared as a message and as its encoded bytes.
fn assert_unchanged(before: &pb::GetSessionResponse, after: &pb::GetSessionResponse, what: &str) {
    assert_eq!(after, before, "{what}: the session is unchanged");
    assert_eq!(
        after.encode_to_vec(),
        before.encode_to_vec(),
        "{what}: GetSession is byte-for-byte the same"
    );
}

/// Finishes assistant message `id` (answering u3, with a text part so it shows in the
/// context) reporting `input` tokens; returns the seq of the finishing update.
async fn finish_reporting(s: &mut EventStream, sid: &str, id: &str, input: u64) -> u64 {
    s.expect_ack(sid, upsert_message(assistant_msg(id, "u3")))
        .await;
    s.expect_ack(
        sid,
        upsert_part(text_part(id, &format!("{id}-t"), &format!("answer {id}"))),
    )
    .await;
    let mut done = finished(assistant_msg(id, "u3"));
    done.tokens = Some(usage(input));
    s.send(sid, upsert_message(done)).await
}

/// Collects compaction events (all carrying `seq`) until one ends the compaction.
async fn follow(s: &mut EventStream, seq: u64) -> Vec<pb::CompactionEvent> {
    let mut out = Vec::new();
    loop {
        let e = s.next_event().await;
        assert_eq!(e.seq, seq, "{e:?}");
        let Some(pb::server_event::Event::Compaction(c)) = e.event else {
            panic!("expected a compaction event, got {e:?}")
        };
        let end = matches!(c.event, Some(Ce::Compacted(_) | Ce::Failed(_)));
        out.push(c);
        if end {
            return out;
        }
    }
}

/// The next watcher event; a guard (not a speed assertion) so a missing event fails the
/// test instead of hanging it.
async fn next_watched(
    watch: &mut tonic::Streaming<pb::SessionEvent>,
) -> Result<pb::SessionEvent, tonic::Status> {
    tokio::time::timeout(Duration::from_secs(20), watch.message())
        .await
        .expect("the watcher got an event within 20 s")
        .map(|e| e.expect("the watch stream is still open"))
}

// ---- 1. the previous summary is folded in --------------------------------------------

#[tokio::test]
async fn a_second_compaction_folds_the_previous_summary_in() {
    const FIRST: &str = "FIRST-SUMMARY: the parser drops trailing commas in src/parse.rs";
    let fake = FakeLlm::start(vec![
        Reply::text([FIRST]),
        Reply::text(["SECOND-SUMMARY ", "combined"]),
    ])
    .await;
    let server = server_with_llm(&fake).await;
    let mut client = server.client().await;
    seed_session(&mut client, SID).await;

    let first = compact(&mut client, SID).await;
    let first_done = compacted(&first).clone();
    // Nothing new arrived: the second compaction summarizes the old tail (tail_turns 0).
    let second = compact_with(&mut client, SID, opts(Some(0)))
        .await
        .expect("second Compact");
    let done = compacted(&second);
    assert_eq!(fake.request_count(), 2);

    let req = fake.last_request();
    let texts = req.message_texts();
    assert!(
        texts[1].starts_with(&format!(
            "=== Summary of the earlier conversation ===\n{FIRST}"
        )),
        "the first summary opens the transcript: {}",
        texts[1]
    );
    assert!(
        texts[1].contains("=== Newer conversation ==="),
        "{}",
        texts[1]
    );
    assert!(texts[1].contains("user turn 2") && texts[1].contains("user turn 3"));
    assert!(
        !texts[1].contains("user turn 1"),
        "nothing before the previous summary is sent again"
    );
    assert_eq!(
        texts[1].matches(FIRST).count(),
        1,
        "the previous summary is folded in once, not also summarized as a message"
    );
    let ask = texts.last().expect("prompt");
    assert!(
        ask.contains("newer conversation") && ask.contains("combines it"),
        "the fold instruction: {ask}"
    );
    // The first request had nothing to fold.
    let first_req = &fake.requests()[0];
    assert!(!first_req.message_texts()[1].contains("=== Summary of the earlier"));
    assert!(!first_req.message_texts()[2].contains("newer conversation"));

    // Afterwards the context is the second compaction and its summary, nothing else.
    let ctx = get_context(&mut client, SID).await;
    assert_eq!(
        ids(&ctx),
        [
            done.user_message_id.clone(),
            done.summary_message_id.clone()
        ]
    );
    assert_eq!(text_of(&ctx.messages[1]), "SECOND-SUMMARY combined");
    assert_eq!(ctx.boundary_message_id, done.user_message_id);
    assert!(
        !ids(&ctx).contains(&first_done.summary_message_id),
        "the first summary left the context"
    );
    assert!(
        !format!("{ctx:?}").contains("FIRST-SUMMARY"),
        "no trace of the first summary in the context"
    );
}

// ---- 2. todos are carried verbatim ---------------------------------------------------

#[tokio::test]
async fn the_todo_list_is_appended_verbatim_after_the_streamed_summary() {
    let todos = vec![
        pb::Todo {
            id: "t1".into(),
            content: "Fix `parse_args` in src/cli.rs: \"--flag=\" panics (exit 101)".into(),
            status: "in_progress".into(),
            priority: "high".into(),
        },
        pb::Todo {
            id: "t2".into(),
            content: "Run `cargo test --test all` — then ünïcödé check".into(),
            status: "pending".into(),
            priority: String::new(),
        },
    ];
    let fake = FakeLlm::start(vec![Reply::text(["Summary ", "of the ", "work."])]).await;
    let server = server_with_llm(&fake).await;
    let mut client = server.client().await;
    open_session(
        &mut client,
        pb::SessionInfo {
            todos: todos.clone(),
            ..session_with_limits(SID, 100_000, 20_000)
        },
    )
    .await;
    seed_turns(&mut client, SID).await;

    let events = compact(&mut client, SID).await;
    let done = compacted(&events);
    let streamed = deltas(&events);
    assert_eq!(streamed, "Summary of the work.");
    assert!(
        !streamed.contains("parse_args"),
        "the todos are compactd's, not streamed by the model"
    );

    let session = get_session(&mut client, SID).await;
    let text = text_of(stored_message(&session, &done.summary_message_id));
    let (model_text, anchors) = text
        .split_once("\n\n")
        .expect("the summary, a blank line, then the anchors");
    assert_eq!(
        model_text, streamed,
        "the model's text comes first, unchanged"
    );
    let mut lines = anchors.lines();
    assert_eq!(
        lines.next(),
        Some("## Todo list (carried verbatim by compactd)")
    );
    for t in &todos {
        let line = lines.next().expect("one line per todo, in order");
        assert!(
            line.contains(&t.content),
            "todo {} verbatim in {line:?}",
            t.id
        );
        assert!(line.contains(&t.status), "{line:?}");
    }
    assert_eq!(lines.next(), None, "nothing else was appended");
    // The context carries the same text: the todos survive into the next request.
    let ctx = get_context(&mut client, SID).await;
    assert_eq!(text_of(&ctx.messages[1]), text);
}

// ---- 3. cooldown ---------------------------------------------------------------------

#[tokio::test]
async fn a_compaction_that_leaves_the_context_over_waits_two_finished_messages() {
    // Head: a1's 100,000-character output (25,000 tokens). The summary the fake writes is
    // 60,000 characters (15,000 tokens): smaller than the head, so it commits, but with
    // the tail the context stays above the threshold (14,720 of 16,000 usable).
    let big_summary = output_of("BIG-SUMMARY", 60_000);
    let fake = FakeLlm::start(vec![
        Reply::text([big_summary.as_str()]),
        Reply::text(["second summary"]),
    ])
    .await;
    let server = server_with_llm(&fake).await;
    let mut client = server.client().await;
    open_session(&mut client, session_with_limits(SID, 100_000, 20_000)).await;
    seed_turns(&mut client, SID).await;
    put_part(
        &mut client,
        SID,
        tool_part("a1", "a1-huge", "bash", &output_of("a1-huge", 100_000)),
    )
    .await;
    open_session(&mut client, session_with_limits(SID, 20_000, 4_000)).await;
    let mut s = server.stream().await;

    // The first automatic compaction runs and commits...
    let seq = finish_reporting(&mut s, SID, "b1", 19_000).await;
    assert_eq!(kinds(&s.reply(seq).await), ["overflow", "ack"]);
    let events = follow(&mut s, seq).await;
    assert_eq!(names(&events).last(), Some(&"compacted"), "{events:?}");
    let done = compacted(&events);
    assert!(done.auto);
    // ...and leaves the context over the threshold.
    let check = check_overflow(&mut client, SID).await;
    assert!(
        check.overflow && done.tokens_after > check.threshold,
        "precondition: still over after the compaction: {check:?} {done:?}"
    );
    assert_eq!(fake.request_count(), 1);

    // The next two finished assistant messages overflow but start nothing.
    for id in ["b2", "b3"] {
        let seq = finish_reporting(&mut s, SID, id, 19_000).await;
        assert_eq!(kinds(&s.reply(seq).await), ["overflow", "ack"], "{id}");
        // A compaction started by `id` would send its events (with `id`'s seq) before this
        // update's ack; `reply` fails on any event with another seq.
        let probe = s
            .send(
                SID,
                upsert_part(text_part("u3", &format!("{id}-probe"), "x")),
            )
            .await;
        assert_eq!(kinds(&s.reply(probe).await), ["ack"], "{id}");
        assert_eq!(
            fake.request_count(),
            1,
            "{id}: no compaction in the cooldown"
        );
    }

    // The third one compacts again.
    let seq = finish_reporting(&mut s, SID, "b4", 19_000).await;
    assert_eq!(kinds(&s.reply(seq).await), ["overflow", "ack"]);
    let events = follow(&mut s, seq).await;
    let Some(Ce::Started(started)) = &events[0].event else {
        panic!("started first: {events:?}")
    };
    assert!(started.auto);
    assert_eq!(names(&events).last(), Some(&"compacted"), "{events:?}");
    assert_eq!(fake.request_count(), 2);
}

// ---- 4-6. failures leave the session exactly as it was -------------------------------

#[tokio::test]
async fn a_server_error_that_keeps_coming_exhausts_the_retries_and_changes_nothing() {
    const MAX_RETRIES: u32 = 2;
    let fake = FakeLlm::start(vec![Reply::status(500)]).await;
    let server = server_with(&fake, |c| c.max_retries = MAX_RETRIES).await;
    let mut client = server.client().await;
    seed_session(&mut client, SID).await;
    let before = get_session(&mut client, SID).await;

    let events = compact(&mut client, SID).await;
    assert_eq!(
        names(&events),
        ["started", "retrying", "retrying", "failed"]
    );
    let attempts: Vec<u32> = events
        .iter()
        .filter_map(|e| match &e.event {
            Some(Ce::Retrying(r)) => Some(r.attempt),
            _ => None,
        })
        .collect();
    assert_eq!(attempts, [2, 3]);
    let f = failure(&events);
    assert_eq!((f.kind.as_str(), f.retryable), ("request", true), "{f:?}");
    assert!(f.reason.contains("500"), "{}", f.reason);
    assert!(!f.auto_compaction_paused, "a manual failure pauses nothing");
    assert_eq!(fake.request_count(), 1 + MAX_RETRIES as usize);
    assert_unchanged(&before, &get_session(&mut client, SID).await, "500s");
}

#[tokio::test]
async fn a_stream_cut_after_tokens_is_not_retried_and_changes_nothing() {
    // Were it retried, the second reply would succeed and commit.
    let fake = FakeLlm::start(vec![
        Reply::disconnect_after(["partial ", "summary"]),
        Reply::text(["a retry must not happen"]),
    ])
    .await;
    let server = server_with_llm(&fake).await;
    let mut client = server.client().await;
    seed_session(&mut client, SID).await;
    let before = get_session(&mut client, SID).await;

    let events = compact(&mut client, SID).await;
    assert_eq!(names(&events), ["started", "delta", "delta", "failed"]);
    assert_eq!(deltas(&events), "partial summary");
    let f = failure(&events);
    assert_eq!(f.kind, "broken_stream", "{f:?}");
    assert_eq!(fake.request_count(), 1, "no retry once tokens arrived");
    assert_unchanged(&before, &get_session(&mut client, SID).await, "cut");
}

#[tokio::test]
async fn a_timeout_while_tokens_are_streaming_fails_and_changes_nothing() {
    // A token every 250 ms, twenty of them; the whole summary may take 600 ms.
    let chunks: Vec<String> = (0..20).map(|i| format!("t{i} ")).collect();
    let fake = FakeLlm::start(vec![Reply::slow(chunks, Duration::from_millis(250))]).await;
    let server = server_with(&fake, |c| c.timeout = Duration::from_millis(600)).await;
    let mut client = server.client().await;
    seed_session(&mut client, SID).await;
    let before = get_session(&mut client, SID).await;

    let events = compact(&mut client, SID).await;
    let n = names(&events);
    assert_eq!(n.first(), Some(&"started"));
    assert!(
        n.contains(&"delta"),
        "some tokens streamed before the deadline: {n:?}"
    );
    assert!(n.len() < 20, "the deadline cut the stream short: {n:?}");
    let f = failure(&events);
    assert_eq!((f.kind.as_str(), f.retryable), ("timeout", true), "{f:?}");
    assert_eq!(fake.request_count(), 1, "a timeout is not retried");
    assert_unchanged(&before, &get_session(&mut client, SID).await, "timeout");
    fake.wait_for_cancelled(1).await; // the HTTP request was dropped, not left running
}

// ---- 7. one compaction per session ---------------------------------------------------

#[tokio::test]
async fn a_second_compact_is_refused_naming_the_running_compaction() {
    let fake = FakeLlm::start(vec![Reply::Hang]).await;
    let server = server_with_llm(&fake).await;
    let mut client = server.client().await;
    seed_session(&mut client, SID).await;

    let mut first = client
        .compact(pb::CompactRequest {
            session_id: SID.into(),
            options: None,
        })
        .await
        .expect("first Compact")
        .into_inner();
    let started = first
        .next()
        .await
        .expect("an event")
        .expect("started, not a status");
    assert!(matches!(started.event, Some(Ce::Started(_))), "{started:?}");
    let running = started.compaction_id;
    assert!(!running.is_empty());
    fake.wait_for_active(1).await;

    let err = compact_with(&mut client, SID, opts(None))
        .await
        .expect_err("a second compaction of the same session");
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err:?}");
    assert!(
        err.message().contains(&running),
        "{:?} names {running}",
        err.message()
    );

    // The same answer on the main stream.
    let mut s = server.stream().await;
    let events = s
        .request(
            SID,
            pb::client_update::Update::Compact(pb::CompactOptions::default()),
        )
        .await;
    let e = error(&events);
    assert_eq!(e.code, "FAILED_PRECONDITION", "{e:?}");
    assert!(e.message.contains(&running), "{e:?}");

    drop(first);
    fake.wait_for_cancelled(1).await;
    assert_eq!(fake.request_count(), 1, "the refused ones sent nothing");
}

// ---- 8-9. Subscribe --------------------------------------------------------------------

#[tokio::test]
async fn watchers_of_all_sessions_and_of_one_session_see_what_they_asked_for() {
    let fake = FakeLlm::start(vec![Reply::text(["watched ", "summary"])]).await;
    let server = server_with_llm(&fake).await;
    let mut client = server.client().await;
    seed_session(&mut client, "a").await;
    open_session(&mut client, session_with_limits("b", 20_000, 4_000)).await;

    let subscribe = |session_id: &str| pb::SubscribeRequest {
        session_id: session_id.into(),
    };
    let mut all = client
        .subscribe(subscribe(""))
        .await
        .expect("Subscribe to all")
        .into_inner();
    let mut only_b = client
        .subscribe(subscribe("b"))
        .await
        .expect("Subscribe to b")
        .into_inner();

    let events = compact(&mut client, "a").await;
    let done = compacted(&events).clone();
    // Then one event of session b: an overflow reported by a usage report.
    let reply = put_usage(&mut client, "b", usage(19_000)).await;
    assert_eq!(kinds(&reply), ["overflow", "ack"]);

    // The all-sessions watcher: a's compaction, ending with the same session.compacted...
    let mut seen = Vec::new();
    let watched = loop {
        let e = next_watched(&mut all)
            .await
            .expect("an event, not a status");
        assert_eq!(e.session_id, "a", "a's events come first: {e:?}");
        let Some(Se::Compaction(c)) = &e.event else {
            panic!("only compaction events for a: {e:?}")
        };
        seen.push(c.clone());
        if let Some(Ce::Compacted(w)) = &c.event {
            break w.clone();
        }
    };
    assert_eq!(watched.summary_message_id, done.summary_message_id);
    assert_eq!(
        watched, done,
        "the same session.compacted as the Compact stream"
    );
    assert_eq!(
        names(&seen),
        names(&events),
        "every event of the compaction"
    );
    // ...then b's overflow.
    let e = next_watched(&mut all).await.expect("b's event");
    assert_eq!(e.session_id, "b");
    assert!(matches!(e.event, Some(Se::Overflow(_))), "{e:?}");

    // The watcher of b saw none of a's events: b's overflow is the first thing it got.
    let e = next_watched(&mut only_b).await.expect("b's event");
    assert_eq!(e.session_id, "b", "{e:?}");
    assert!(matches!(e.event, Some(Se::Overflow(_))), "{e:?}");
}

#[tokio::test]
async fn a_watcher_that_never_reads_is_dropped_while_the_session_keeps_acking() {
    const UPDATES: usize = 3_000; // below the bus's 4,096: only the slow reader can fall behind
    let server = start_server().await;
    let mut client = server.client().await;
    open_session(&mut client, session_with_limits(SID, 20_000, 4_000)).await;

    // A watcher on its own connection with a small HTTP/2 window, which never reads.
    let channel = tonic::transport::Endpoint::from_shared(server.url())
        .expect("url")
        .initial_stream_window_size(Some(65_535))
        .initial_connection_window_size(Some(65_535))
        .connect()
        .await
        .expect("connect");
    let mut slow = pb::sessions_client::SessionsClient::new(channel)
        .subscribe(pb::SubscribeRequest {
            session_id: SID.into(),
        })
        .await
        .expect("Subscribe")
        .into_inner();

    // Every usage report overflows and publishes an overflow event; each one is acked.
    let mut s = server.stream().await;
    for batch in 0..UPDATES / 100 {
        let mut seqs = Vec::with_capacity(100);
        for i in 0..100 {
            let input = 19_000 + (batch * 100 + i) as u64;
            seqs.push(s.send(SID, report_usage(usage(input))).await);
        }
        for seq in seqs {
            assert_eq!(kinds(&s.reply(seq).await), ["overflow", "ack"]);
        }
    }

    // Now read: what was buffered, then a clear status, then the end.
    let mut delivered = 0;
    let status = loop {
        match next_watched(&mut slow).await {
            Ok(e) => {
                assert!(matches!(e.event, Some(Se::Overflow(_))), "{e:?}");
                delivered += 1;
            }
            Err(status) => break status,
        }
    };
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    assert_eq!(
        status.message(),
        "watcher is not reading its events; dropped"
    );
    assert!(
        delivered < UPDATES,
        "dropped before all {UPDATES} events: {delivered}"
    );
    assert!(
        matches!(slow.message().await, Ok(None)),
        "the stream ends after the status"
    );

    // The session is fine and still acks.
    let seq = s.send(SID, report_usage(usage(1_000))).await;
    assert_eq!(kinds(&s.reply(seq).await), ["ack"]);
    assert_eq!(
        check_overflow(&mut client, SID).await.used,
        1_000,
        "the last report was applied"
    );
}

// ---- 10. cost ----------------------------------------------------------------------------

#[tokio::test]
async fn the_cost_is_the_reported_usage_at_the_configured_prices() {
    const PRICE: (f64, f64) = (2.5, 10.0);
    let fake = FakeLlm::start(vec![
        Reply::text(["priced ", "summary"]).with_usage(Some((12_345, 678))),
    ])
    .await;
    let server = server_with(&fake, |c| c.price_per_mtok = PRICE).await;
    let mut client = server.client().await;
    seed_session(&mut client, SID).await;
    let mut watch = client
        .subscribe(pb::SubscribeRequest {
            session_id: SID.into(),
        })
        .await
        .expect("Subscribe")
        .into_inner();

    let events = compact(&mut client, SID).await;
    let done = compacted(&events);
    let u = done.usage.as_ref().expect("usage from the stream");
    assert_eq!((u.input, u.output), (12_345, 678));
    let expected = (12_345.0 * PRICE.0 + 678.0 * PRICE.1) / 1e6;
    assert!(
        (done.cost - expected).abs() < 1e-12,
        "cost {} != {expected}",
        done.cost
    );
    assert!(done.cost > 0.0);

    // The summary message records the same cost and usage.
    let session = get_session(&mut client, SID).await;
    let info = stored_message(&session, &done.summary_message_id)
        .info
        .clone()
        .expect("info");
    assert_eq!(info.cost, done.cost);
    let tokens = info.tokens.expect("tokens on the summary");
    assert_eq!((tokens.input, tokens.output), (12_345, 678));

    // And so does the watcher's session.compacted.
    let watched = loop {
        let e = next_watched(&mut watch).await.expect("event");
        if let Some(Se::Compaction(pb::CompactionEvent {
            event: Some(Ce::Compacted(c)),
            ..
        })) = e.event
        {
            break c;
        }
    };
    assert_eq!(watched.cost, done.cost);
}

// ---- 11. the API key from a file, with the real binary ---------------------------------

#[tokio::test]
async fn the_api_key_is_read_from_a_file_without_its_newline_and_never_logged() {
    const KEY: &str = "sk-file-KEY-7d3a91c0ffee";
    let fake = FakeLlm::start(vec![Reply::text(["file key ", "summary"])]).await;
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let key_file = dir.join(format!("compactd-key-{}.txt", std::process::id()));
    std::fs::write(&key_file, format!("{KEY}\n")).expect("write the key file");

    let key_arg = key_file.to_str().expect("utf-8 path");
    let bin = Binary::start(
        &["--llm-api-key-file", key_arg],
        &[
            ("COMPACTD_LOG", "debug"),
            ("COMPACTD_LLM_BASE_URL", &fake.base_url()),
            ("COMPACTD_LLM_MODEL", "fake-model"),
        ],
    );
    let addr = bin.addr.clone();

    let mut client = pb::sessions_client::SessionsClient::connect(format!("http://{addr}"))
        .await
        .expect("connect");
    seed_session(&mut client, "k").await;
    let events = compact(&mut client, "k").await;
    compacted(&events);
    let auth = fake
        .last_request()
        .header("authorization")
        .map(str::to_owned);
    let session = get_session(&mut client, "k").await;

    let log = bin.finish();
    let _ = std::fs::remove_file(&key_file);
    assert_eq!(
        auth.as_deref(),
        Some(format!("Bearer {KEY}").as_str()),
        "the key as written, without the file's trailing newline"
    );
    assert!(log.contains("session.compacted"), "logging works: {log}");
    for (what, text) in [
        ("logs", log),
        ("events", format!("{events:?}")),
        ("GetSession", format!("{session:?}")),
    ] {
        assert!(!text.contains(KEY), "the key leaked into {what}");
    }
}

// ---- 12. the context after an automatic compaction with messages in flight -----------

#[tokio::test]
async fn after_an_automatic_compaction_the_context_has_the_documented_order() {
    let fake = FakeLlm::start(vec![Reply::slow(
        ["auto ", "summary"],
        Duration::from_millis(300),
    )])
    .await;
    let server = server_with_llm(&fake).await;
    let mut client = server.client().await;
    seed_session(&mut client, SID).await;
    // 20k window, 4k output: usable 16,000, threshold 14,720.
    open_session(&mut client, session_with_limits(SID, 20_000, 4_000)).await;
    let mut s = server.stream().await;

    let seq = finish_reporting(&mut s, SID, "b1", 19_000).await;
    assert_eq!(kinds(&s.reply(seq).await), ["overflow", "ack"]);
    let first = s.next_event().await;
    assert!(
        matches!(&first.event, Some(pb::server_event::Event::Compaction(c)) if matches!(c.event, Some(Ce::Started(_)))),
        "{first:?}"
    );
    fake.wait_for_requests(1).await;

    // Messages arriving while the summary is written, on another stream.
    let mut other = server.stream().await;
    other.expect_ack(SID, upsert_message(user_msg("u4"))).await;
    other
        .expect_ack(SID, upsert_part(text_part("u4", "u4-t", "IN-FLIGHT-U4")))
        .await;
    other
        .expect_ack(SID, upsert_message(assistant_msg("a4", "u4")))
        .await;
    other
        .expect_ack(SID, upsert_part(text_part("a4", "a4-t", "IN-FLIGHT-A4")))
        .await;
    assert!(
        fake.active_connections() > 0,
        "still summarizing while those were acked"
    );

    let events = follow(&mut s, seq).await;
    let Some(Ce::Compacted(done)) = &events.last().and_then(|e| e.event.clone()) else {
        panic!("{events:?}")
    };
    assert!(done.auto);
    // And one message after the compaction.
    other.expect_ack(SID, upsert_message(user_msg("u5"))).await;
    other
        .expect_ack(SID, upsert_part(text_part("u5", "u5-t", "after")))
        .await;

    let ctx = get_context(&mut client, SID).await;
    let cont = ctx
        .messages
        .iter()
        .find(|m| text_of(m) == CONTINUE)
        .and_then(|m| m.info.as_ref())
        .expect("the auto-continue message")
        .id
        .clone();
    // README "After a compaction GetContext returns": compaction message, summary, the
    // verbatim tail, messages that arrived meanwhile, auto-continue, everything after.
    assert_eq!(
        ids(&ctx),
        [
            done.user_message_id.as_str(),
            done.summary_message_id.as_str(),
            "u2",
            "a2",
            "u3",
            "a3",
            "b1",
            "u4",
            "a4",
            cont.as_str(),
            "u5"
        ]
    );
    assert_eq!(text_of(&ctx.messages[1]), "auto summary");
    match &ctx.messages[0].parts[0].kind {
        Some(pb::part::Kind::Compaction(c)) => {
            assert_eq!((c.auto, c.tail_start_id.as_str()), (true, "u2"))
        }
        other => panic!("compaction part expected, got {other:?}"),
    }
    // The in-flight messages were not summarized.
    let sent = fake.last_request().message_texts().join("\n");
    assert!(!sent.contains("IN-FLIGHT"), "{sent}");
}
