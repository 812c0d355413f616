//! The API key never appears in logs, events, errors, `GetSession` or `--help`: the real
//! binary runs with the key in its environment and verbose logging, against an endpoint
//! that echoes the key back in its error (as some providers do).

use std::process::Command;

use compactd::server::pb;
use compactd::server::pb::compaction_event::Event as Ce;
use tokio_stream::StreamExt;

use crate::common::binary::Binary;
use crate::common::compaction::{SID, compact, failure, seed_session, server_with};
use crate::common::fake_llm::{FakeLlm, Reply, error_body};
use crate::common::*;

const KEY: &str = "sk-live-DO-NOT-LEAK-4f1c9a7e";

#[tokio::test]
async fn the_api_key_stays_out_of_logs_events_errors_and_help() {
    let echo = error_body(
        &format!("Incorrect API key provided: {KEY}"),
        "invalid_request_error",
        None,
        Some("invalid_api_key"),
    );
    let fake = FakeLlm::start(vec![Reply::Status {
        code: 401,
        body: echo,
        retry_after: None,
    }])
    .await;

    let bin = Binary::start(
        &[],
        &[
            ("COMPACTD_LOG", "debug"),
            ("COMPACTD_LLM_BASE_URL", &fake.base_url()),
            ("COMPACTD_LLM_MODEL", "fake-model"),
            ("COMPACTD_LLM_API_KEY", KEY),
            // async-openai's own variables are not compactd's: not sent.
            ("OPENAI_ORG_ID", "org-not-compactds"),
            ("OPENAI_PROJECT_ID", "proj-not-compactds"),
        ],
    );
    let addr = bin.addr.clone();

    let mut client = pb::sessions_client::SessionsClient::connect(format!("http://{addr}"))
        .await
        .expect("connect");
    open_session(&mut client, session_with_limits("k", 100_000, 20_000)).await;
    for (u, a) in [("u1", "a1"), ("u2", "a2"), ("u3", "a3")] {
        put_message(&mut client, "k", user_msg(u)).await;
        put_part(
            &mut client,
            "k",
            text_part(u, &format!("{u}t"), "some work"),
        )
        .await;
        put_message(&mut client, "k", finished(assistant_msg(a, u))).await;
        put_part(
            &mut client,
            "k",
            tool_part(a, &format!("{a}r"), "read", &output_of(a, 3_000)),
        )
        .await;
    }
    let mut stream = client
        .compact(pb::CompactRequest {
            session_id: "k".into(),
            options: None,
        })
        .await
        .expect("compact")
        .into_inner();
    let mut events = Vec::new();
    while let Some(e) = stream.next().await {
        events.push(e.expect("event"));
    }
    let Some(Ce::Failed(f)) = &events.last().and_then(|e| e.event.clone()) else {
        panic!("{events:?}")
    };
    assert!(
        f.reason.contains("Incorrect API key provided: [redacted]"),
        "{}",
        f.reason
    );
    assert_eq!(
        fake.last_request().header("authorization"),
        Some(format!("Bearer {KEY}").as_str())
    );
    for header in ["openai-organization", "openai-project"] {
        assert_eq!(fake.last_request().header(header), None, "{header}");
    }
    // The window discovery requests (/props, /v1/models) carry the key too.
    let asked = fake.discovery_requests();
    assert_eq!(asked.len(), 2, "{asked:?}");
    for r in &asked {
        assert_eq!(
            r.header("authorization"),
            Some(format!("Bearer {KEY}").as_str())
        );
    }
    let session = get_session(&mut client, "k").await;

    let log = bin.finish();
    assert!(
        log.contains("compaction failed"),
        "the failure was logged: {log}"
    );
    assert!(
        log.contains("window discovery")
            && log.contains("does not tell the compaction model's window"),
        "the discovery was logged: {log}"
    );
    for (what, text) in [
        ("logs", log),
        ("events", format!("{events:?}")),
        ("GetSession", format!("{session:?}")),
    ] {
        assert!(!text.contains(KEY), "the key leaked into {what}");
    }

    // A base URL carrying credentials (an Azure-style `?api-key=`, `user:key@`) in the
    // environment: --help shows env values beside their flags.
    let help = Command::new(env!("CARGO_BIN_EXE_compactd"))
        .args(["serve", "--help"])
        .env(
            "COMPACTD_LLM_BASE_URL",
            format!("https://user:{KEY}@llm.example.com/v1?api-key={KEY}"),
        )
        .env("COMPACTD_LLM_API_KEY", KEY)
        .output()
        .expect("help");
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(help.contains("--llm-base-url"), "{help}");
    assert!(!help.contains(KEY), "the key leaked into --help");
}

/// Four 502s with `body`: every attempt of a failing compaction (one retry, as
/// `failing_compaction_at` configures) answered the same.
fn bad_gateways(body: &str) -> Vec<Reply> {
    (0..4)
        .map(|_| Reply::Status {
            code: 502,
            body: body.to_string(),
            retry_after: None,
        })
        .collect()
}

/// Asserts that no secret of `secrets` is in the log or the events.
fn assert_absent(log: &str, events: &str, secrets: &[&str]) {
    for (what, text) in [("log", log), ("events", events)] {
        for secret in secrets {
            assert!(
                !text.contains(secret),
                "{secret} reached the {what}:\n{text}"
            );
        }
    }
}

/// Runs one failing compaction against the endpoint at `base_url` with the key in the
/// environment at log level `level` (`None`: the default), and returns the log and the
/// events.
async fn failing_compaction_at(base_url: String, level: Option<&str>) -> (String, String) {
    let mut env = vec![
        ("COMPACTD_LLM_BASE_URL", base_url),
        ("COMPACTD_LLM_MODEL", "fake-model".to_string()),
        ("COMPACTD_LLM_API_KEY", KEY.to_string()),
        ("COMPACTD_LLM_MAX_RETRIES", "1".to_string()),
    ];
    if let Some(level) = level {
        env.push(("COMPACTD_LOG", level.to_string()));
    }
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let bin = Binary::start(&[], &env);
    let mut client = pb::sessions_client::SessionsClient::connect(format!("http://{}", bin.addr))
        .await
        .expect("connect");
    let mut req = example_import("echo");
    req.session_id = "echo".into();
    client.import_session(req).await.expect("imported");
    let mut stream = client
        .compact(pb::CompactRequest {
            session_id: "echo".into(),
            options: None,
        })
        .await
        .expect("compact")
        .into_inner();
    let mut events = Vec::new();
    while let Some(e) = stream.next().await {
        events.push(e.expect("event"));
    }
    assert!(
        matches!(
            events.last().and_then(|e| e.event.clone()),
            Some(Ce::Failed(_))
        ),
        "{events:?}"
    );
    (bin.finish(), format!("{events:?}"))
}

#[tokio::test]
async fn a_5xx_body_echoing_the_headers_leaks_the_key_nowhere() {
    use base64::Engine as _;
    let b64 = base64::engine::general_purpose::STANDARD.encode(KEY);
    // What some gateways answer: the request's headers, the key among them, in a 5xx body.
    let echo = format!(
        "{{\"error\": {{\"message\": \"upstream failed; request headers: authorization: Bearer {KEY}, x-api-key: {b64}\", \"type\": \"server_error\"}}}}"
    );
    for level in [None, Some("debug")] {
        let fake = FakeLlm::start(bad_gateways(&echo)).await;
        let (log, events) = failing_compaction_at(fake.base_url(), level).await;
        // The echo reached compactd: the 502 is reported, its body redacted.
        assert!(log.contains("LLM request failed: 502"), "{log}");
        assert_absent(&log, &events, &[KEY, b64.trim_end_matches('=')]);
    }
}

/// Credentials in the base URL are a secret like the key: an endpoint that echoes its
/// request's headers or the password must not get them into the events. compactd's own
/// start refuses such a URL (`--llm-base-url`), but a library user's `LlmConfig` may
/// carry one. Before, only the API key was redacted from what an endpoint said.
#[tokio::test]
async fn credentials_in_a_configured_base_url_echoed_by_the_endpoint_leak_nowhere() {
    use base64::Engine as _;
    const PASSWORD: &str = "pw-DO-NOT-LEAK-77d2";
    let basic = base64::engine::general_purpose::STANDARD.encode(format!("bob:{PASSWORD}"));
    let echo = format!(
        "{{\"error\": {{\"message\": \"upstream failed; authorization: Basic {basic}; password {PASSWORD}\", \"type\": \"server_error\"}}}}"
    );
    let fake = FakeLlm::start(bad_gateways(&echo)).await;
    let url = fake
        .base_url()
        .replacen("http://", &format!("http://bob:{PASSWORD}@"), 1);
    let server = server_with(&fake, |c| {
        c.base_url = url;
        c.max_retries = 1;
    })
    .await;
    let mut client = server.client().await;
    seed_session(&mut client, SID).await;
    let events = compact(&mut client, SID).await;
    assert!(
        failure(&events).reason.contains("LLM request failed: 502"),
        "{events:?}"
    );
    assert_absent(
        "",
        &format!("{events:?}"),
        &[PASSWORD, basic.trim_end_matches('=')],
    );
}

/// A key in the base URL (credentials, an Azure-style `?api-key=`) is redacted by config
/// print, and the start refuses the URL naming the flag, the key nowhere in its error.
#[test]
fn a_key_in_the_base_url_is_redacted_by_config_print_and_refused_at_start() {
    let url = format!("https://user:{KEY}@llm.example.com/v1?api-key={KEY}&api-version=2024");
    let print = Command::new(env!("CARGO_BIN_EXE_compactd"))
        .args([
            "config",
            "print",
            "--llm-base-url",
            &url,
            "--llm-model",
            "m",
        ])
        .output()
        .expect("config print");
    let text = String::from_utf8_lossy(&print.stdout);
    assert!(print.status.success(), "{text}");
    assert!(
        text.contains("llm.example.com/v1?api-key=[redacted]"),
        "{text}"
    );
    assert!(!text.contains(KEY), "the key reached config print:\n{text}");

    for url in [
        url.clone(),
        format!("https://llm.example.com/v1?api-key={KEY}"),
    ] {
        let mut serve = Command::new(env!("CARGO_BIN_EXE_compactd"));
        serve
            .args(["serve", "--listen", "127.0.0.1:0", "--durability", "memory"])
            .args(["--llm-base-url", &url, "--llm-model", "m"])
            // Started by mistake, it exits at once (its stdin is closed).
            .arg("--exit-on-stdin-eof");
        for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("COMPACTD_")) {
            serve.env_remove(k);
        }
        let start = serve.output().expect("serve");
        let err = String::from_utf8_lossy(&start.stderr);
        assert!(!start.status.success(), "started: {err}");
        assert!(err.contains("--llm-base-url (flag): \"https://"), "{err}");
        assert!(err.contains("llm.example.com"), "{err}");
        assert!(!err.contains(KEY), "the key reached the error:\n{err}");
    }
}

/// A refusal for length quoting the key where a 1,000-character cut of the endpoint's
/// words would fall: the key is redacted before any cut, so no part of it is left behind.
/// Before, the refusal's text was cut first and the key's first half reached the log and
/// the events unredacted.
#[tokio::test]
async fn a_key_astride_the_cut_of_a_long_refusal_leaks_no_part_of_it() {
    let head = "Context size has been exceeded. ";
    let pad = 1_000 - head.len() - " auth=".len() - 12;
    let body = format!("{head}{} auth={KEY}", "x".repeat(pad));
    let replies = (0..10)
        .map(|_| Reply::Status {
            code: 500,
            body: body.clone(),
            retry_after: None,
        })
        .collect();
    let fake = FakeLlm::start(replies).await;
    let (log, events) = failing_compaction_at(fake.base_url(), Some("debug")).await;
    assert!(log.contains("Context size has been exceeded"), "{log}");
    assert_absent(&log, &events, &[&KEY[..12]]);
}
