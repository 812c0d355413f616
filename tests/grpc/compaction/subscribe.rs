//! `Subscribe` around compactions: watchers of all sessions and of one session see what
//! they asked for, and a watcher that stops reading is dropped while the session keeps
//! acking.

use compactd::server::pb::compaction_event::Event as Ce;
use compactd::server::pb::session_event::Event as Se;

use crate::common::compaction::*;
use crate::common::fake_llm::{FakeLlm, Reply};
use crate::common::*;

#[tokio::test]
async fn watchers_of_all_sessions_and_of_one_session_see_what_they_asked_for() {
    let fake = FakeLlm::start(vec![Reply::text(["watched ", "summary"])]).await;
    let server = server_with_llm(&fake).await;
    let mut client = server.client().await;
    seed_session(&mut client, "a").await;
    open_session(&mut client, session_with_limits("b", 20_000, 4_000)).await;

    let mut all = subscribe(&mut client, "").await;
    let mut only_b = subscribe(&mut client, "b").await;

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
    let mut slow = subscribe(&mut small_window_client(server.url()).await, SID).await;

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
