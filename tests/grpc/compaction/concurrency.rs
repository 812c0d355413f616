//! One compaction per session at a time, while updates keep flowing; cancelling a
//! compaction by dropping `Compact` or from the main stream.

use std::time::Duration;

use compactd::server::pb;
use compactd::server::pb::compaction_event::Event as Ce;
use tokio_stream::StreamExt;

use crate::common::compaction::*;
use crate::common::fake_llm::{FakeLlm, Reply};
use crate::common::*;

#[tokio::test]
async fn one_compaction_at_a_time_and_updates_keep_flowing() {
    // ~6 s of summary: the refused second Compact, a new stream and three acks all come
    // while it streams, on a loaded machine too (3 x 150 ms was not always enough).
    let fake = FakeLlm::start(vec![Reply::slow(
        ["slow ", "summary ", "text"],
        Duration::from_secs(2),
    )])
    .await;
    let server = server_with_llm(&fake).await;
    let mut client = server.client().await;
    seed_session_with_cleared_output(&mut client, SID).await;
    let mut other = server.client().await;
    open_session(&mut other, session("other")).await;

    let mut running = client.clone();
    let first = tokio::spawn(async move {
        compact_with(&mut running, SID, pb::CompactOptions::default()).await
    });
    fake.wait_for_requests(1).await;

    let err = compact_with(&mut client, SID, pb::CompactOptions::default())
        .await
        .expect_err("second compaction");
    assert_eq!(err.code(), tonic::Code::FailedPrecondition);
    assert!(
        err.message().contains("already running"),
        "{}",
        err.message()
    );

    // The session and another one keep applying updates while the summary streams.
    let mut s = server.stream().await;
    s.expect_ack(SID, upsert_message(user_msg("u4"))).await;
    s.expect_ack(
        SID,
        upsert_part(text_part("u4", "u4-t", "arrived during compaction")),
    )
    .await;
    s.expect_ack("other", upsert_message(user_msg("o1"))).await;
    assert!(
        fake.active_connections() > 0,
        "still summarizing while those were acked"
    );

    let events = first.await.expect("task").expect("compact");
    let Some(Ce::Compacted(done)) = &events.last().expect("events").event else {
        panic!("{events:?}")
    };
    let ctx = get_context(&mut client, SID).await;
    assert_eq!(
        context_ids(&ctx),
        [
            done.user_message_id.as_str(),
            done.summary_message_id.as_str(),
            "u2",
            "a2",
            "u3",
            "a3",
            "u4"
        ]
    );
}

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

    let err = compact_with(&mut client, SID, pb::CompactOptions::default())
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

#[tokio::test]
async fn dropping_compact_cancels_the_llm_request_and_frees_the_session() {
    let fake = FakeLlm::start(vec![Reply::Hang]).await;
    let server = server_with_llm(&fake).await;
    let mut client = server.client().await;
    seed_session_with_cleared_output(&mut client, SID).await;
    let before = get_session(&mut client, SID).await;
    let request = pb::CompactRequest {
        session_id: SID.into(),
        options: None,
    };
    let mut stream = client.compact(request).await.expect("compact").into_inner();
    assert!(matches!(
        stream.next().await,
        Some(Ok(pb::CompactionEvent {
            event: Some(Ce::Started(_)),
            ..
        }))
    ));
    fake.wait_for_active(1).await;
    drop(stream);
    fake.wait_for_cancelled(1).await;

    // Nothing committed, and a new compaction may start once the old one is gone.
    assert_eq!(get_session(&mut client, SID).await, before);
    fake.push(Reply::text(["after cancel"]));
    let events = loop {
        match compact_with(&mut client, SID, pb::CompactOptions::default()).await {
            Err(e) if e.message().contains("already running") => tokio::task::yield_now().await,
            other => break other.expect("compact"),
        }
    };
    assert_eq!(names(&events).last(), Some(&"compacted"));
}

#[tokio::test]
async fn a_cancel_on_the_main_stream_stops_the_llm_request() {
    let fake = FakeLlm::start(vec![Reply::Hang]).await;
    let server = server_with_llm(&fake).await;
    let mut client = server.client().await;
    seed_session_with_cleared_output(&mut client, SID).await;
    let before = get_session(&mut client, SID).await;
    let mut s = server.stream().await;

    let cancel = || pb::client_update::Update::CancelCompaction(pb::CancelCompaction {});
    let seq = s.send(SID, cancel()).await;
    let none = s.reply(seq).await;
    assert_eq!(error(&none).code, "NOT_FOUND", "nothing to cancel yet");

    let started = s
        .send(
            SID,
            pb::client_update::Update::Compact(pb::CompactOptions::default()),
        )
        .await;
    assert_eq!(kinds(&s.reply(started).await), ["compaction", "ack"]);
    fake.wait_for_active(1).await;
    let seq = s.send(SID, cancel()).await;
    // The ack and the compaction's end may interleave; collect both.
    let mut acked = false;
    let mut failed = None;
    while !(acked && failed.is_some()) {
        let e = s.next_event().await;
        match e.event {
            Some(pb::server_event::Event::Ack(_)) if e.seq == seq => acked = true,
            Some(pb::server_event::Event::Compaction(c)) => {
                assert_eq!(e.seq, started);
                if let Some(Ce::Failed(f)) = c.event {
                    failed = Some(f);
                }
            }
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(failed.map(|f| f.kind), Some("cancelled".to_string()));
    fake.wait_for_cancelled(1).await;
    assert_eq!(get_session(&mut client, SID).await, before);
}
