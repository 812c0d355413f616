//! A client cannot forge log lines: a session id holding a newline, a carriage return and
//! an ANSI escape reaches the human log escaped, on one line, and the JSON log stays one
//! valid JSON document per line.

use compactd::server::pb;

use crate::common::binary::Binary;
use crate::common::*;

const EVIL: &str = "evil\n2026-01-01T00:00:00.000000Z  INFO compactd: forged line\r\u{1b}[31mred";

/// Imports, reopens and deletes a session named [`EVIL`] (each logs its id).
async fn touch_evil_session(addr: &str) {
    let mut client = pb::sessions_client::SessionsClient::connect(format!("http://{addr}"))
        .await
        .expect("connect");
    let mut req = example_import(EVIL);
    req.session_id = EVIL.into();
    client.import_session(req).await.expect("imported");
    client
        .delete_session(pb::DeleteSessionRequest {
            session_id: EVIL.into(),
        })
        .await
        .expect("deleted");
}

#[tokio::test]
async fn a_session_id_cannot_forge_or_colour_a_pretty_log_line() {
    let bin = Binary::start_pretty(&[], &[("COMPACTD_LOG", "debug")]);
    let addr = bin.addr.clone();
    touch_evil_session(&addr).await;
    let log = bin.finish();
    assert!(
        !log.contains('\u{1b}'),
        "an escape sequence reached the log:\n{log}"
    );
    assert!(!log.contains('\r'), "a carriage return reached the log");
    assert!(
        !log.lines()
            .any(|l| l.contains("forged line") && !l.contains("evil")),
        "a client forged a line of its own:\n{log}"
    );
    let logged: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("session deleted"))
        .collect();
    assert_eq!(logged.len(), 1, "{log}");
    assert!(
        logged[0].contains(r"evil\u{a}2026-01-01") && logged[0].contains(r"\u{1b}[31mred"),
        "the id is logged, escaped: {}",
        logged[0]
    );
}

#[tokio::test]
async fn the_json_log_stays_one_valid_document_per_line() {
    let bin = Binary::start(&[], &[("COMPACTD_LOG", "debug")]);
    let addr = bin.addr.clone();
    touch_evil_session(&addr).await;
    let log = bin.finish();
    let mut ids = 0;
    for line in log.lines().filter(|l| !l.trim().is_empty()) {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line:?}"));
        ids += usize::from(v["fields"]["session_id"] == EVIL);
    }
    assert!(ids > 0, "the id is logged, intact, as JSON data:\n{log}");
}
