//! `grpc.health.v1.Health/Check`.

use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;

use crate::common::*;

#[tokio::test]
async fn the_server_and_the_sessions_service_are_serving() {
    let server = start_server().await;
    let mut health = server.health().await;
    for service in ["", "compactd.v1.Sessions"] {
        let r = health
            .check(HealthCheckRequest {
                service: service.to_string(),
            })
            .await
            .unwrap_or_else(|s| panic!("Check({service:?}): {s:?}"))
            .into_inner();
        assert_eq!(
            r.status,
            ServingStatus::Serving as i32,
            "Check({service:?})"
        );
    }
}

#[tokio::test]
async fn an_unknown_service_is_not_found() {
    let server = start_server().await;
    let mut health = server.health().await;
    let status = health
        .check(HealthCheckRequest {
            service: "compactd.v1.Nope".to_string(),
        })
        .await
        .expect_err("unknown service");
    assert_eq!(status.code(), tonic::Code::NotFound);
}
