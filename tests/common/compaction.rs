//! Shared setup for the compaction tests (`tests/grpc/compaction/`): a server whose
//! summarizer talks to the fake endpoint of `fake_llm`, seeded sessions, and readers for
//! the events of one compaction.

use std::sync::Arc;
use std::time::Duration;

use compactd::server::pb;
use compactd::server::pb::compaction_event::Event as Ce;
use compactd::server::{CompactionConfig, ServerOptions};
use compactd::summarize::{ApiKey, LlmConfig, OpenAiSummarizer};
use prost::Message as _;
use tokio_stream::StreamExt;
use tonic::Streaming;

use super::fake_llm::{FakeLlm, Reply};
use super::*;

/// The API key the test servers send; it must never show up in events or errors.
pub const SECRET: &str = "sk-test-SECRET-0123456789";
/// The session most compaction tests work on.
pub const SID: &str = "cmp";

/// The summarizer's settings for `fake`: model "fake-model", the [`SECRET`] key, a 20 s
/// timeout and fast (5 ms) retries.
pub fn llm_config(fake: &FakeLlm) -> LlmConfig {
    let mut llm = LlmConfig::new(fake.base_url(), "fake-model");
    llm.api_key = Some(ApiKey::new(SECRET).expect("a valid key"));
    llm.timeout = Duration::from_secs(20);
    llm.retry_base = Duration::from_millis(5);
    llm
}

/// Compaction settings whose summarizer uses `llm`; everything else the default.
pub fn compaction_config(llm: LlmConfig) -> CompactionConfig {
    CompactionConfig {
        summarizer: Some(Arc::new(OpenAiSummarizer::new(llm))),
        ..Default::default()
    }
}

/// A server whose summarizer talks to `fake` ([`llm_config`]) with `tune` applied.
pub async fn server_with(fake: &FakeLlm, tune: impl FnOnce(&mut LlmConfig)) -> TestServer {
    let mut llm = llm_config(fake);
    tune(&mut llm);
    start_server_with(
        ServerOptions {
            compaction: compaction_config(llm),
            ..Default::default()
        },
        acp_config(),
    )
    .await
}

/// A server whose summarizer talks to `fake` with the [`llm_config`] settings.
pub async fn server_with_llm(fake: &FakeLlm) -> TestServer {
    server_with(fake, |_| {}).await
}

/// Three user turns u1..u3, each answered (a1..a3) with a 4,000-character `read` output.
pub async fn seed_turns(client: &mut Client, sid: &str) {
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

/// A tool output of `chars` characters that reads like a build log: about four characters
/// a token in o200k, like real outputs (unlike [`output_of`]'s run of one letter, which BPE
/// packs a dozen to a token).
pub fn log_of(tag: &str, chars: usize) -> String {
    let mut s = format!("{tag}:\n");
    let mut i = 0usize;
    while s.len() < chars {
        s.push_str(&format!(
            "step {i}: compiled src/module_{}/parser.rs in {}ms; warning W{:04}: unused variable `item_{i}`\n",
            i % 17,
            i * 37 % 1000,
            i * 13 % 10_000
        ));
        i += 1;
    }
    s.truncate(chars);
    s
}

/// A head of ~20 kB of log-like text in a roomy session (200k window): ten turns with 2 kB
/// outputs, the last two kept verbatim by a compaction.
pub async fn seed_long_session(client: &mut Client, sid: &str) {
    seed_turns_of(client, sid, 2_000).await;
}

/// [`seed_long_session`] with outputs of `output_chars`.
pub async fn seed_turns_of(client: &mut Client, sid: &str, output_chars: usize) {
    open_session(client, session_with_limits(sid, 200_000, 20_000)).await;
    for i in 0..10 {
        let (u, a) = (format!("u{i}"), format!("a{i}"));
        put_message(client, sid, user_msg(&u)).await;
        put_part(
            client,
            sid,
            text_part(&u, &format!("{u}t"), &format!("turn {i}")),
        )
        .await;
        put_message(client, sid, finished(assistant_msg(&a, &u))).await;
        put_part(
            client,
            sid,
            tool_part(&a, &format!("{a}r"), "read", &log_of(&a, output_chars)),
        )
        .await;
    }
}

/// A roomy session (100k window, 20k output: never overflows) with three turns.
pub async fn seed_session(client: &mut Client, sid: &str) {
    open_session(client, session_with_limits(sid, 100_000, 20_000)).await;
    seed_turns(client, sid).await;
}

/// [`seed_session`], plus an older output of a1 (`ORIGINAL-a1-old`, 2,000 characters)
/// already cleared by prune (host-set stamp).
pub async fn seed_session_with_cleared_output(client: &mut Client, sid: &str) {
    seed_session(client, sid).await;
    let mut cleared = tool_part("a1", "a1-old", "bash", &output_of("ORIGINAL-a1-old", 2_000));
    if let Some(pb::part::Kind::Tool(t)) = &mut cleared.kind {
        t.state.as_mut().expect("state").time = Some(pb::ToolTime {
            start: 1,
            end: Some(2),
            compacted: Some(3),
        });
    }
    put_part(client, sid, cleared).await;
}

/// Runs `Compact` with `options` to its end and returns every event.
pub async fn compact_with(
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

/// Starts `Compact` with default options and reads its first event, `started`: the
/// compaction is running when this returns; the rest of its events follow on the stream.
pub async fn started_compaction(client: &mut Client, sid: &str) -> Streaming<pb::CompactionEvent> {
    let mut events = client
        .compact(pb::CompactRequest {
            session_id: sid.into(),
            options: None,
        })
        .await
        .expect("compact")
        .into_inner();
    let first = events.next().await.expect("an event").expect("ok");
    assert!(matches!(first.event, Some(Ce::Started(_))), "{first:?}");
    events
}

/// Runs `Compact` with default options to its end; the call itself must succeed.
pub async fn compact(client: &mut Client, sid: &str) -> Vec<pb::CompactionEvent> {
    compact_with(client, sid, pb::CompactOptions::default())
        .await
        .expect("Compact runs")
}

/// The `session.compacted` ending `events`, or panic.
pub fn compacted(events: &[pb::CompactionEvent]) -> &pb::SessionCompacted {
    match events.last().and_then(|e| e.event.as_ref()) {
        Some(Ce::Compacted(c)) => c,
        other => panic!("expected session.compacted last, got {other:?} in {events:?}"),
    }
}

/// The failure ending `events`, or panic.
pub fn failure(events: &[pb::CompactionEvent]) -> &pb::CompactionFailed {
    match events.last().and_then(|e| e.event.as_ref()) {
        Some(Ce::Failed(f)) => f,
        other => panic!("expected a failure last, got {other:?} in {events:?}"),
    }
}

/// Collects compaction events on the main stream (all carrying `seq`) until one ends
/// the compaction.
pub async fn follow(s: &mut EventStream, seq: u64) -> Vec<pb::CompactionEvent> {
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
pub async fn next_watched(
    watch: &mut Streaming<pb::SessionEvent>,
) -> Result<pb::SessionEvent, tonic::Status> {
    tokio::time::timeout(Duration::from_secs(20), watch.message())
        .await
        .expect("the watcher got an event within 20 s")
        .map(|e| e.expect("the watch stream is still open"))
}

/// GetSession, compared as a message and as its encoded bytes.
pub fn assert_unchanged(
    before: &pb::GetSessionResponse,
    after: &pb::GetSessionResponse,
    what: &str,
) {
    assert_eq!(after, before, "{what}: the session is unchanged");
    assert_eq!(
        after.encode_to_vec(),
        before.encode_to_vec(),
        "{what}: GetSession is byte-for-byte the same"
    );
}

/// One manual compaction of a session with a cleared output, against `failures` and then
/// a summary: each failure must be retried, so the events are `started`, one `retrying`
/// per failure, the delta and `compacted`. Returns the `retrying` events.
pub async fn retried_then_compacted(failures: Vec<Reply>) -> Vec<pb::CompactionRetrying> {
    let n = failures.len();
    let mut replies = failures;
    replies.push(Reply::text(["short summary"]));
    let fake = FakeLlm::start(replies).await;
    let server = server_with_llm(&fake).await;
    let mut client = server.client().await;
    seed_session_with_cleared_output(&mut client, SID).await;
    let events = compact(&mut client, SID).await;
    let mut expected = vec!["started"];
    expected.extend(std::iter::repeat_n("retrying", n));
    expected.extend(["delta", "compacted"]);
    assert_eq!(names(&events), expected);
    assert_eq!(fake.request_count(), n + 1);
    events
        .iter()
        .filter_map(|e| match &e.event {
            Some(Ce::Retrying(r)) => Some(r.clone()),
            _ => None,
        })
        .collect()
}
