//! Who decides how a compaction runs: no endpoint configured, the compaction model and
//! prompts per session and per request, the operator's allow-list of models, and the API
//! key read from a file by the real binary.

use compactd::server::ServerOptions;
use compactd::server::pb;
use compactd::server::pb::compaction_event::Event as Ce;

use crate::common::binary::Binary;
use crate::common::compaction::*;
use crate::common::fake_llm::{FakeLlm, Reply};
use crate::common::*;

#[tokio::test]
async fn without_an_endpoint_compaction_is_a_failed_precondition_and_nothing_else_breaks() {
    let server = start_server().await;
    let mut client = server.client().await;
    seed_session_with_cleared_output(&mut client, SID).await;
    let err = compact_with(&mut client, SID, pb::CompactOptions::default())
        .await
        .expect_err("no endpoint");
    assert_eq!(err.code(), tonic::Code::FailedPrecondition);
    assert!(
        err.message().contains("--llm-base-url"),
        "{}",
        err.message()
    );
    assert_eq!(get_context(&mut client, SID).await.context_messages, 6);
}

#[tokio::test]
async fn the_compaction_model_and_prompts_can_be_chosen_per_session_and_per_request() {
    let fake = FakeLlm::start(vec![Reply::text(["first"]), Reply::text(["second"])]).await;
    let server = server_with_llm(&fake).await;
    let mut client = server.client().await;
    seed_session_with_cleared_output(&mut client, SID).await;
    open_session(
        &mut client,
        session_with_config(
            SID,
            100_000,
            20_000,
            pb::SessionConfig {
                compaction_model: Some("session-model".into()),
                ..Default::default()
            },
        ),
    )
    .await;

    // The session's compaction model replaces the server's; prompts stay the defaults.
    let events = compact(&mut client, SID).await;
    let Some(Ce::Started(started)) = &events[0].event else {
        panic!("started first: {events:?}")
    };
    assert_eq!(started.model, "session-model");
    let req = fake.last_request();
    assert_eq!(req.body["model"], "session-model");
    assert!(
        req.message_texts()[0].contains("Objective"),
        "default template"
    );

    // A request's own model and prompts win over both.
    let options = pb::CompactOptions {
        model: "request-model".into(),
        system: "SYSTEM-OVERRIDE".into(),
        template: "TEMPLATE-OVERRIDE".into(),
        prompt: "PROMPT-OVERRIDE".into(),
        tail_turns: Some(0),
        ..Default::default()
    };
    let events = compact_with(&mut client, SID, options)
        .await
        .expect("compact");
    assert!(
        matches!(
            events.last().and_then(|e| e.event.as_ref()),
            Some(Ce::Compacted(_))
        ),
        "second compaction commits"
    );
    let req = fake.last_request();
    assert_eq!(req.body["model"], "request-model");
    let texts = req.message_texts();
    assert_eq!(texts[0], "SYSTEM-OVERRIDE\n\nTEMPLATE-OVERRIDE");
    assert!(
        texts.last().expect("prompt").starts_with("PROMPT-OVERRIDE"),
        "{texts:?}"
    );

    // The committed summary says which model wrote it.
    let session = get_session(&mut client, SID).await;
    let summary = session
        .messages
        .iter()
        .rev()
        .find(|m| m.info.as_ref().is_some_and(|i| i.summary))
        .expect("a summary message");
    let model = summary.info.as_ref().and_then(|i| i.model.clone());
    assert_eq!(model.map(|m| m.model_id).as_deref(), Some("request-model"));
}

#[tokio::test]
async fn models_outside_the_operators_allow_list_are_refused() {
    let fake = FakeLlm::start(vec![Reply::text(["cheap summary"])]).await;
    let mut compaction = compaction_config(llm_config(&fake));
    compaction.allowed_models = vec!["cheap".into()];
    let server = start_server_with_options(ServerOptions {
        compaction,
        ..Default::default()
    })
    .await;
    let mut client = server.client().await;
    seed_session_with_cleared_output(&mut client, SID).await;
    // A session cannot pick an expensive compaction model...
    let open = client
        .open_session(pb::OpenSessionRequest {
            session: Some(session_with_config(
                SID,
                100_000,
                20_000,
                pb::SessionConfig {
                    compaction_model: Some("expensive".into()),
                    ..Default::default()
                },
            )),
        })
        .await;
    let status = assert_status(
        open,
        tonic::Code::PermissionDenied,
        "session.config.compaction_model",
    );
    assert!(
        status
            .message()
            .contains("--compaction-allowed-models (cheap)"),
        "{status:?}"
    );
    // ...nor an imported one...
    let import = client
        .import_session(pb::ImportSessionRequest {
            config: Some(pb::SessionConfig {
                compaction_model: Some("expensive".into()),
                ..Default::default()
            }),
            ..example_import("imported")
        })
        .await;
    assert_status(
        import,
        tonic::Code::PermissionDenied,
        "config.compaction_model",
    );
    // ...nor can one request; the session is as it was and an allowed model works.
    let before = get_session(&mut client, SID).await;
    let options = |model: &str| pb::CompactOptions {
        model: model.into(),
        ..Default::default()
    };
    let refused = client
        .compact(pb::CompactRequest {
            session_id: SID.into(),
            options: Some(options("expensive")),
        })
        .await;
    assert_status(refused, tonic::Code::PermissionDenied, "options.model");
    // On the main stream the options are the update's `compact`.
    let mut s = server.stream().await;
    let events = s
        .request(
            SID,
            pb::client_update::Update::Compact(options("expensive")),
        )
        .await;
    let e = error(&events);
    assert_eq!(
        (e.code.as_str(), e.field.as_str()),
        ("PERMISSION_DENIED", "compact.model"),
        "{e:?}"
    );
    assert_eq!(get_session(&mut client, SID).await, before);
    assert_eq!(fake.request_count(), 0);
    let events = compact_with(&mut client, SID, options("cheap"))
        .await
        .expect("allowed");
    assert!(
        matches!(
            events.last().and_then(|e| e.event.as_ref()),
            Some(Ce::Compacted(_))
        ),
        "the allowed model compacts"
    );
    assert_eq!(fake.last_request().body["model"], "cheap");
}

#[tokio::test]
async fn the_api_key_is_read_from_a_file_without_its_newline_and_never_logged() {
    const KEY: &str = "sk-file-KEY-7d3a91c0ffee";
    let fake = FakeLlm::start(vec![Reply::text(["file key ", "summary"])]).await;
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let key_file = dir.join(format!("compactd-key-{}.txt", std::process::id()));
    std::fs::write(&key_file, format!("{KEY}\n")).expect("write the key file");

    let key_arg = key_file.to_str().expect("utf-8 path");
    let bin = Binary::start(
        &["--llm-api-key-file", key_arg],
        &[
            ("COMPACTD_LOG", "debug"),
            ("COMPACTD_LLM_BASE_URL", &fake.base_url()),
            ("COMPACTD_LLM_MODEL", "fake-model"),
        ],
    );
    let addr = bin.addr.clone();

    let mut client = pb::sessions_client::SessionsClient::connect(format!("http://{addr}"))
        .await
        .expect("connect");
    seed_session(&mut client, "k").await;
    let events = compact(&mut client, "k").await;
    compacted(&events);
    let auth = fake
        .last_request()
        .header("authorization")
        .map(str::to_owned);
    let session = get_session(&mut client, "k").await;

    let log = bin.finish();
    let _ = std::fs::remove_file(&key_file);
    assert_eq!(
        auth.as_deref(),
        Some(format!("Bearer {KEY}").as_str()),
        "the key as written, without the file's trailing newline"
    );
    assert!(log.contains("session.compacted"), "logging works: {log}");
    for (what, text) in [
        ("logs", log),
        ("events", format!("{events:?}")),
        ("GetSession", format!("{session:?}")),
    ] {
        assert!(!text.contains(KEY), "the key leaked into {what}");
    }
}

#[tokio::test]
async fn a_compaction_model_name_past_256_bytes_is_refused_naming_the_field() {
    // No allow-list: any name passes it, but each name the endpoint is asked about is a
    // key kept for the process's life, so its length is bounded.
    let fake = FakeLlm::start(vec![Reply::text(["summary"])]).await;
    let server = start_server_with_options(ServerOptions {
        compaction: compaction_config(llm_config(&fake)),
        ..Default::default()
    })
    .await;
    let mut client = server.client().await;
    seed_session_with_cleared_output(&mut client, SID).await;
    let before = get_session(&mut client, SID).await;
    let refused = client
        .compact(pb::CompactRequest {
            session_id: SID.into(),
            options: Some(pb::CompactOptions {
                model: "m".repeat(257),
                ..Default::default()
            }),
        })
        .await;
    let status = assert_status(refused, tonic::Code::InvalidArgument, "options.model");
    assert!(status.message().contains("at most 256 bytes"), "{status:?}");
    assert_eq!(get_session(&mut client, SID).await, before);
    assert_eq!(fake.request_count(), 0);
}
