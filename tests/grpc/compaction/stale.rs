//! A session deleted or replaced while its compaction's summary is written: the
//! compaction is cancelled (its LLM request stops) and commits nothing on the new
//! session, whose actor keeps serving it. A summary that arrived before the cancel is
//! refused at commit as stale (`engine/tests/compaction.rs` checks that refusal).

use std::time::Duration;

use compactd::server::pb;

use crate::common::compaction::*;
use crate::common::fake_llm::{FakeLlm, Reply};
use crate::common::*;

/// A summary that takes a few seconds: long enough to delete or replace its session
/// while it streams.
fn slow_summary() -> Reply {
    Reply::slow(
        ["summary of ", "the old ", "conversation"],
        Duration::from_secs(2),
    )
}

#[tokio::test]
async fn a_session_imported_over_a_running_compaction_is_left_as_imported() {
    let fake = FakeLlm::start(vec![slow_summary()]).await;
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
    assert_eq!(failed.kind, "cancelled", "{failed:?}");
    fake.wait_for_cancelled(1).await;
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

#[tokio::test]
async fn a_session_deleted_and_recreated_over_a_running_compaction_is_left_as_recreated() {
    let fake = FakeLlm::start(vec![slow_summary()]).await;
    let server = server_with_llm(&fake).await;
    let mut client = server.client().await;
    seed_session(&mut client, SID).await;

    let mut running = client.clone();
    let compaction = tokio::spawn(async move {
        compact_with(&mut running, SID, pb::CompactOptions::default()).await
    });
    fake.wait_for_requests(1).await;
    client
        .delete_session(pb::DeleteSessionRequest {
            session_id: SID.into(),
        })
        .await
        .expect("DeleteSession");
    // Re-created under the same id with one turn of its own.
    open_session(&mut client, session_with_limits(SID, 100_000, 20_000)).await;
    put_message(&mut client, SID, user_msg("n1")).await;
    put_part(&mut client, SID, text_part("n1", "n1-t", "a new start")).await;
    let recreated = get_session(&mut client, SID).await;

    let events = compaction.await.expect("task").expect("Compact runs");
    assert_eq!(failure(&events).kind, "cancelled", "{events:?}");
    fake.wait_for_cancelled(1).await;
    assert_unchanged(
        &recreated,
        &get_session(&mut client, SID).await,
        "after the cancelled compaction",
    );
    assert_eq!(context_ids(&get_context(&mut client, SID).await), ["n1"]);
}
