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
