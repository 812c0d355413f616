//! Limits: each returns RESOURCE_EXHAUSTED naming the limit and its value, and leaves the
//! server and the other sessions working; idle sessions are evicted with an event.

use std::sync::Arc;
use std::time::Duration;

use compactd::config::EngineConfig;
use compactd::server::{ServerOptions, pb};
use compactd::store::Store;
use compactd::tokens::CharsPerToken;
use tokio_stream::StreamExt;

use crate::common::*;

#[tokio::test]
async fn max_sessions_refuses_one_more_and_the_others_keep_working() {
    let store = Store::new(EngineConfig::default(), Arc::new(CharsPerToken)).with_max_sessions(2);
    let server = start_server_on(store, ServerOptions::default()).await;
    let mut c = server.client().await;
    open_session(&mut c, session("s1")).await;
    open_session(&mut c, session("s2")).await;
    let third = c
        .open_session(pb::OpenSessionRequest {
            session: Some(session("s3")),
        })
        .await;
    let status = assert_status(third, tonic::Code::ResourceExhausted, "max_sessions (2)");
    assert!(status.message().contains("--max-sessions"), "{status:?}");
    // An import is a new session too.
    let import = c
        .import_session(pb::ImportSessionRequest {
            export_json: std::fs::read_to_string(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/examples/session.json"
            ))
            .expect("example"),
            session_id: "s4".into(),
            ..Default::default()
        })
        .await;
    assert_status(import, tonic::Code::ResourceExhausted, "max_sessions");
    // Existing sessions still take updates; reopening one is not a new session.
    put_message(&mut c, "s1", user_msg("u1")).await;
    open_session(&mut c, session("s2")).await;
    // Deleting one makes room.
    c.delete_session(pb::DeleteSessionRequest {
        session_id: "s2".into(),
    })
    .await
    .expect("delete");
    open_session(&mut c, session("s3")).await;
}

#[tokio::test]
async fn max_parts_per_message_refuses_one_more_and_keeps_the_session() {
    let server = start_server_with_config(EngineConfig {
        max_parts_per_message: 3,
        ..EngineConfig::default()
    })
    .await;
    let mut c = server.client().await;
    open_session(&mut c, session("p")).await;
    put_message(&mut c, "p", user_msg("u1")).await;
    for i in 0..3 {
        put_part(&mut c, "p", text_part("u1", &format!("t{i}"), "x")).await;
    }
    let before = get_session(&mut c, "p").await;
    let fourth = c
        .upsert_part(pb::UpsertPartRequest {
            session_id: "p".into(),
            part: Some(text_part("u1", "t3", "x")),
        })
        .await;
    assert_status(
        fourth,
        tonic::Code::ResourceExhausted,
        "max_parts_per_message",
    );
    assert_eq!(get_session(&mut c, "p").await, before, "nothing changed");
    // Updating an existing part is still fine, and so is another message.
    put_part(&mut c, "p", text_part("u1", "t0", "edited")).await;
    put_message(&mut c, "p", user_msg("u2")).await;
    put_part(&mut c, "p", text_part("u2", "t9", "y")).await;
}

#[tokio::test]
async fn idle_sessions_are_evicted_with_an_event_and_busy_ones_stay() {
    let server = start_server_with_options(ServerOptions {
        idle_ttl: Some(Duration::from_millis(400)),
        ..Default::default()
    })
    .await;
    let mut c = server.client().await;
    let mut watch = c
        .subscribe(pb::SubscribeRequest {
            session_id: String::new(),
        })
        .await
        .expect("subscribe")
        .into_inner();
    open_session(&mut c, session("idle")).await;
    open_session(&mut c, session("busy")).await;
    // Keep `busy` in use for longer than the TTL.
    for _ in 0..12 {
        get_context(&mut c, "busy").await;
        tokio::time::sleep(Duration::from_millis(60)).await;
    }
    let evicted = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            let e = watch.next().await.expect("event").expect("ok");
            if let Some(pb::session_event::Event::Evicted(ev)) = e.event {
                break (e.session_id, ev);
            }
        }
    })
    .await
    .expect("an eviction event");
    assert_eq!(evicted.0, "idle");
    assert_eq!(evicted.1.reason, "idle");
    assert!(evicted.1.idle_ms >= 400, "{:?}", evicted.1);
    let gone = c
        .get_context(pb::GetContextRequest {
            session_id: "idle".into(),
            ..Default::default()
        })
        .await;
    assert_status(gone, tonic::Code::NotFound, "idle");
    get_context(&mut c, "busy").await;
}

#[tokio::test]
async fn a_stream_client_that_stops_reading_is_disconnected_and_its_session_kept() {
    let server = start_server_with_options(ServerOptions {
        slow_reader_grace: Duration::from_millis(300),
        ..Default::default()
    })
    .await;
    let mut c = server.client().await;
    open_session(&mut c, session("slow")).await;
    // A ~12 KB context: each answer to a context request is that big.
    put_message(&mut c, "slow", user_msg("u0")).await;
    put_part(
        &mut c,
        "slow",
        text_part("u0", "big", &output_of("big", 12_000)),
    )
    .await;
    let (tx, rx) = tokio::sync::mpsc::channel::<pb::ClientUpdate>(64);
    let mut events = c
        .stream(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .expect("stream")
        .into_inner();
    // Ask for far more than the event buffer and the HTTP/2 windows hold, reading
    // nothing back. The sender blocks once the server stops reading from this stream.
    let sender = tokio::spawn(async move {
        for i in 0..5_000u64 {
            let update = pb::ClientUpdate {
                seq: i + 1,
                session_id: "slow".into(),
                update: Some(pb::client_update::Update::GetContext(
                    pb::ContextOptions::default(),
                )),
            };
            if tx.send(update).await.is_err() {
                break;
            }
        }
    });
    tokio::time::sleep(Duration::from_millis(1_500)).await;

    // Another client is not held up meanwhile.
    let mut other = server.client().await;
    open_session(&mut other, session("other")).await;
    put_message(&mut other, "other", user_msg("x")).await;

    // Reading now: the buffered events, then the closing status.
    let mut acked = 0u64;
    let status = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match events.next().await {
                Some(Ok(_)) => acked += 1,
                Some(Err(status)) => break status,
                None => panic!("the stream ended without a status"),
            }
        }
    })
    .await
    .expect("the stream ends");
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains("not reading"), "{status:?}");
    assert!(acked >= 1000, "the buffered events came first: {acked}");
    assert!(
        acked < 5_000,
        "the stream ended before every request was answered"
    );
    sender.abort();

    // The session is intact and takes more.
    assert_eq!(get_session(&mut c, "slow").await.messages.len(), 1);
    put_message(&mut c, "slow", user_msg("after")).await;
    assert_eq!(get_session(&mut c, "slow").await.messages.len(), 2);
}
