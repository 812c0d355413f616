//! The durable store on a real full disk (`--max-disk-bytes` caps the SQLite database:
//! SQLITE_FULL, as a full volume gives): the update is `RESOURCE_EXHAUSTED`, the session
//! is exactly as it was, and health reports the store until a commit succeeds again.

use std::time::{Duration, Instant};

use compactd::server::pb;
use compactd::server::pb::sessions_client::SessionsClient;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

use crate::common::binary::Binary;
use crate::common::*;

async fn store_health(health: &mut HealthClient<tonic::transport::Channel>) -> i32 {
    health
        .check(HealthCheckRequest {
            service: "compactd.store".into(),
        })
        .await
        .expect("the store's health is reported")
        .into_inner()
        .status
}

/// Waits (the reporter follows the store every 500 ms) until the store's health is `want`.
async fn until_health(health: &mut HealthClient<tonic::transport::Channel>, want: ServingStatus) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while store_health(health).await != want as i32 {
        assert!(
            Instant::now() < deadline,
            "store health never became {want:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn held_out(client: &mut Client, sid: &str) -> pb::GetSessionResponse {
    let mut s = client
        .get_session(pb::GetSessionRequest {
            session_id: sid.into(),
        })
        .await
        .expect("get")
        .into_inner();
    // Memory, not content: allocation history differs.
    if let Some(summary) = s.summary.as_mut() {
        summary.held_bytes = 0;
    }
    s
}

#[tokio::test]
async fn a_full_disk_refuses_the_update_keeps_the_session_and_reports_the_store() {
    let bin = Binary::start(&["--max-disk-bytes", "262144"], &[]);
    let channel = tonic::transport::Channel::from_shared(format!("http://{}", bin.addr))
        .expect("endpoint")
        .connect()
        .await
        .expect("connect");
    let mut client = SessionsClient::new(channel.clone())
        .max_decoding_message_size(CLIENT_MAX_MESSAGE)
        .max_encoding_message_size(CLIENT_MAX_MESSAGE);
    let mut health = HealthClient::new(channel);
    assert_eq!(
        store_health(&mut health).await,
        ServingStatus::Serving as i32
    );

    client
        .open_session(pb::OpenSessionRequest {
            session: Some(session("s")),
        })
        .await
        .expect("open");
    client
        .upsert_message(pb::UpsertMessageRequest {
            session_id: "s".into(),
            message: Some(user_msg("u1")),
        })
        .await
        .expect("message");
    client
        .upsert_part(pb::UpsertPartRequest {
            session_id: "s".into(),
            part: Some(text_part("u1", "p1", "small")),
        })
        .await
        .expect("a small part fits");
    let before = held_out(&mut client, "s").await;

    let refused = client
        .upsert_part(pb::UpsertPartRequest {
            session_id: "s".into(),
            part: Some(text_part("u1", "big", &"y".repeat(600_000))),
        })
        .await
        .expect_err("the disk is full");
    assert_eq!(
        refused.code(),
        tonic::Code::ResourceExhausted,
        "{refused:?}"
    );
    assert!(refused.message().contains("disk is full"), "{refused:?}");
    assert_eq!(
        held_out(&mut client, "s").await,
        before,
        "the session is as it was"
    );
    until_health(&mut health, ServingStatus::NotServing).await;

    // Small updates still fit; the store recovers and says so.
    client
        .upsert_part(pb::UpsertPartRequest {
            session_id: "s".into(),
            part: Some(text_part("u1", "p2", "small again")),
        })
        .await
        .expect("fits");
    until_health(&mut health, ServingStatus::Serving).await;
    drop(bin);
}
