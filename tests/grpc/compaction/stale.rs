//! A session replaced while its compaction's summary is written: the compaction ends
//! failed and commits nothing on the new session, whose actor keeps serving it.

use std::time::Duration;

use compactd::server::pb;

use crate::common::compaction::*;
use crate::common::fake_llm::{FakeLlm, Reply};
use crate::common::*;

#[tokio::test]
async fn a_session_imported_over_a_running_compaction_is_left_as_imported() {
    let fake = FakeLlm::start(vec![Reply::slow(
        ["summary of ", "the old ", "conversation"],
        Duration::from_millis(200),
    )])
    .await;
    let server = server_with_llm(&fake).await;
    let mut client = server.client().await;
    seed_session(&mut client, SID).await;

    let mut running = client.clone();
    let compaction = tokio::spawn(async move {
        compact_with(&mut running, SID, pb::CompactOptions::default()).await
    });
    fake.wait_for_requests(1).await;
    // Another conversation, longer than the one planned: every planned position exists.
    client
        .import_session(pb::ImportSessionRequest {
            replace: true,
            ..example_import(SID)
        })
        .await
        .expect("ImportSession replaces the session");
    let imported = get_session(&mut client, SID).await;
    let imported_context = get_context(&mut client, SID).await;

    let events = compaction.await.expect("task").expect("Compact runs");
    let failed = failure(&events);
    assert_eq!(failed.kind, "stale", "{failed:?}");
    assert!(
        failed
            .reason
            .contains("the session changed while the summary was written"),
        "{failed:?}"
    );
    assert!(failed.retryable, "{failed:?}");
    assert_unchanged(
        &imported,
        &get_session(&mut client, SID).await,
        "after the stale commit",
    );
    assert_eq!(get_context(&mut client, SID).await, imported_context);

    // The session's actor is alive and its compaction slot free: the imported
    // conversation compacts.
    fake.push(Reply::text(["summary of the imported conversation"]));
    let events = compact(&mut client, SID).await;
    let done = compacted(&events);
    let context = context_ids(&get_context(&mut client, SID).await);
    assert_eq!(
        context[..2],
        [
            done.user_message_id.clone(),
            done.summary_message_id.clone()
        ]
    );
}
