//! A host that lets compactd compact for it reloads a session whole (ImportSession with
//! `replace`) from its own history, which lacks compactd's messages: with
//! `keep_compactions` the compaction stays, so the summarized head is not sent again and
//! no second summary is paid for.

use compactd::server::pb;

use crate::common::compaction::*;
use crate::common::fake_llm::{FakeLlm, Reply};
use crate::common::*;

/// The example export (three user turns) with limits, so it can be compacted.
fn host_import(sid: &str) -> pb::ImportSessionRequest {
    pb::ImportSessionRequest {
        limits: Some(limits(100_000, 20_000)),
        ..example_import(sid)
    }
}

/// `req` as a reload keeping compactd's compactions.
fn keeping(req: pb::ImportSessionRequest) -> pb::ImportSessionRequest {
    pb::ImportSessionRequest {
        replace: true,
        keep_compactions: true,
        ..req
    }
}

async fn compacted_example(client: &mut Client) -> (pb::SessionCompacted, pb::Context) {
    client
        .import_session(host_import(SID))
        .await
        .expect("ImportSession");
    let events = compact(client, SID).await;
    let done = compacted(&events).clone();
    let context = get_context(client, SID).await;
    assert_eq!(
        context_ids(&context)[..2],
        [
            done.user_message_id.clone(),
            done.summary_message_id.clone()
        ]
    );
    (done, context)
}

#[tokio::test]
async fn a_reload_from_the_hosts_history_keeps_compactds_compaction() {
    let fake = FakeLlm::start(vec![Reply::text(["the summary of turn one"])]).await;
    let server = server_with_llm(&fake).await;
    let mut client = server.client().await;
    let (_, context) = compacted_example(&mut client).await;

    // The host's history again: it never held compactd's two messages.
    client
        .import_session(keeping(host_import(SID)))
        .await
        .expect("ImportSession keeping compactions");
    let reloaded = get_context(&mut client, SID).await;
    assert_eq!(context_ids(&reloaded), context_ids(&context));
    assert_eq!(reloaded.estimated_tokens, context.estimated_tokens);
    assert_eq!(reloaded.boundary_message_id, context.boundary_message_id);
    assert_eq!(fake.requests().len(), 1, "no second summary");

    // Without the flag the import is the host's history as it is: the head is back.
    client
        .import_session(pb::ImportSessionRequest {
            replace: true,
            ..host_import(SID)
        })
        .await
        .expect("ImportSession");
    let plain = get_context(&mut client, SID).await;
    assert!(
        plain.estimated_tokens > context.estimated_tokens,
        "{plain:?}"
    );
    assert_eq!(plain.boundary_message_id, "");
}

#[tokio::test]
async fn a_reload_of_a_history_that_lost_a_summarized_message_keeps_no_compaction() {
    let fake = FakeLlm::start(vec![Reply::text(["the summary of turn one"])]).await;
    let server = server_with_llm(&fake).await;
    let mut client = server.client().await;
    compacted_example(&mut client).await;

    // The host's history without its second message (summarized): another history.
    let mut export: serde_json::Value =
        serde_json::from_str(&host_import(SID).export_json).expect("example is JSON");
    let messages = export["messages"].as_array_mut().expect("messages");
    messages.remove(1);
    let trimmed = keeping(pb::ImportSessionRequest {
        export_json: export.to_string(),
        ..host_import(SID)
    });
    client
        .import_session(trimmed)
        .await
        .expect("ImportSession keeping compactions");
    let reloaded = get_context(&mut client, SID).await;
    assert_eq!(reloaded.boundary_message_id, "");
    assert_eq!(context_ids(&reloaded).len(), 10);
}

#[tokio::test]
async fn a_replaced_session_that_cannot_be_read_is_still_replaced() {
    use crate::durable::{connect, data_dir, sigterm, start_on};
    let dir = data_dir("keep-compactions-unreadable");
    let bin = start_on(dir.path(), "sync", &[], &[]);
    let mut client = connect(&bin.addr).await;
    client
        .import_session(host_import(SID))
        .await
        .expect("ImportSession");
    sigterm(bin).await;
    rusqlite::Connection::open(dir.path().join("compactd.db"))
        .expect("open the store")
        .execute(
            "UPDATE sessions SET snapshot = '{\"format\":1,\"session\":{' WHERE id = ?1",
            [SID],
        )
        .expect("damage the stored session");

    let bin = start_on(dir.path(), "sync", &[], &[]);
    let mut client = connect(&bin.addr).await;
    let unreadable = client
        .get_context(pb::GetContextRequest {
            session_id: SID.into(),
            ..Default::default()
        })
        .await
        .expect_err("the damaged session is not served");
    assert_eq!(unreadable.code(), tonic::Code::DataLoss);
    // The host's history repairs it, keeping compactions or not.
    client
        .import_session(keeping(host_import(SID)))
        .await
        .expect("the replace goes through");
    assert_eq!(context_ids(&get_context(&mut client, SID).await).len(), 11);
    sigterm(bin).await;
}

/// A reload keeping compactions that is refused leaves everything as it was, a
/// compaction running on the session included: it goes on and commits. Before, it was
/// cancelled before the document was built, so a document refused at the build cost the
/// session its compaction.
#[tokio::test]
async fn a_refused_reload_leaves_a_running_compaction_running() {
    use compactd::server::pb::compaction_event::Event as Ce;
    use tokio_stream::StreamExt;
    let chunks: Vec<String> = (0..6).map(|i| format!("part {i}. ")).collect();
    let fake = FakeLlm::start(vec![Reply::slow(
        chunks,
        std::time::Duration::from_millis(100),
    )])
    .await;
    let server = server_with_llm(&fake).await;
    let mut client = server.client().await;
    client
        .import_session(host_import(SID))
        .await
        .expect("ImportSession");
    let mut running = started_compaction(&mut client, SID).await;

    // The host's history with a message of more parts than a message may hold: read
    // whole, refused as it is built.
    let mut export: serde_json::Value =
        serde_json::from_str(&host_import(SID).export_json).expect("json");
    let message = &mut export["messages"][10];
    let template = message["parts"][0].clone();
    let parts: Vec<serde_json::Value> = (0..=compactd::config::MAX_PARTS_PER_MESSAGE)
        .map(|i| {
            let mut p = template.clone();
            p["id"] = format!("prt_many_{i:05}").into();
            p
        })
        .collect();
    message["parts"] = parts.into();
    let refused = client
        .import_session(keeping(pb::ImportSessionRequest {
            export_json: export.to_string(),
            ..host_import(SID)
        }))
        .await
        .expect_err("too many parts");
    assert_eq!(
        refused.code(),
        tonic::Code::ResourceExhausted,
        "{refused:?}"
    );
    // Named where the document holds it.
    let at = format!(
        "export_json.messages[10].parts[{}].id: ",
        compactd::config::MAX_PARTS_PER_MESSAGE
    );
    assert!(refused.message().starts_with(&at), "{refused:?}");

    let mut last = None;
    while let Some(e) = running.next().await {
        last = Some(e.expect("event").event);
    }
    assert!(
        matches!(last, Some(Some(Ce::Compacted(_)))),
        "the compaction went on: {last:?}"
    );
}
