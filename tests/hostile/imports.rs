//! Imports that are over the limits and must be refused before they are built:
//! - four concurrent ~15 MiB exports of real OpenCode content (big strings), each a
//!   session over `--max-session-bytes`;
//! - four concurrent ~15 MiB exports of 500,000 tiny parts each (hundreds of MB once
//!   built), each over `--max-session-bytes`;
//! - one such 500k-part export alone, which must also be refused for less memory than
//!   the budget it protects (the issue: refused only after a 342 MB build).
//!
//! Each must end RESOURCE_EXHAUSTED naming a limit, with the process up under the cap
//! and a bystander served throughout. A small import from the same builder succeeds
//! first, so the refusals are about size only.

use std::time::{Duration, Instant};

use compactd::server::pb;
use serde_json::{Value, json};

use super::*;

/// Wire size of each real-content export (under the default 16 MiB `max_update_bytes`).
const REAL_EXPORT_BYTES: usize = 31 * (1 << 20) / 2;
/// `--max-session-bytes` against the real-content exports: a quarter of each export, so
/// every one is over it (such a session holds more bytes than its JSON).
const REAL_SESSION_LIMIT: u64 = 4 << 20;
/// Parts of a many-part export, and the messages they are spread over (under the default
/// `max_parts_per_message`). 32 bytes of JSON each: 15.3 MiB in all.
const TINY_PARTS: usize = 500_000;
const TINY_MESSAGES: usize = 500;
/// `--max-session-bytes` against the many-part exports: such a session holds ~240 MB.
const TINY_SESSION_LIMIT: u64 = 64 << 20;
/// How long the imports get. (Before issue 13's fixes, the debug build of one 500k-part
/// session with 10,000 parts per message took longer than 90 s.)
const ATTACK_LIMIT: Duration = Duration::from_secs(60);

/// Messages of a real trace, copied with fresh ids (`-r<k>` appended) for as long as the
/// export's JSON stays under `bytes`.
fn replicated_export(id: &str, bytes: usize) -> String {
    let trace = trace_files()
        .into_iter()
        .find(|p| p.ends_with("opencode-quick-falcon.json"))
        .expect("the quick-falcon trace");
    let doc: Value = serde_json::from_str(&std::fs::read_to_string(trace).expect("readable"))
        .expect("trace is JSON");
    let source = doc["messages"].as_array().expect("messages").clone();
    let suffix = |v: &mut Value, key: &str, k: usize| {
        if let Some(s) = v.get(key).and_then(Value::as_str).filter(|s| !s.is_empty()) {
            v[key] = Value::String(format!("{s}-r{k}"));
        }
    };
    let mut messages = Vec::new();
    let mut size = 0;
    'fill: for k in 0.. {
        for m in &source {
            let mut m = m.clone();
            suffix(&mut m["info"], "id", k);
            suffix(&mut m["info"], "parentID", k);
            for p in m["parts"].as_array_mut().into_iter().flatten() {
                suffix(p, "id", k);
                suffix(p, "messageID", k);
            }
            let len = m.to_string().len() + 1;
            if size + len > bytes {
                break 'fill;
            }
            size += len;
            messages.push(m);
        }
    }
    json!({"info": {"id": id, "title": "replicated"}, "messages": messages}).to_string()
}

/// An export of `parts` empty text parts spread over `messages` user messages.
fn tiny_parts_export(id: &str, messages: usize, parts: usize) -> String {
    let per = parts / messages;
    let mut out = format!(r#"{{"info":{{"id":"{id}"}},"messages":["#);
    for i in 0..messages {
        if i > 0 {
            out.push(',');
        }
        out.push_str(&format!(
            r#"{{"info":{{"id":"m{i}","role":"user"}},"parts":["#
        ));
        for j in 0..per {
            if j > 0 {
                out.push(',');
            }
            out.push_str(&format!(r#"{{"id":"p{i}-{j}","type":"text"}}"#));
        }
        out.push_str("]}");
    }
    out.push_str("]}");
    out
}

fn import_request(json: String) -> pb::ImportSessionRequest {
    pb::ImportSessionRequest {
        export_json: json,
        ..Default::default()
    }
}

async fn import(mut client: Client, request: pb::ImportSessionRequest) -> Outcome {
    match client.import_session(request).await {
        Ok(s) => {
            let s = s.into_inner();
            Outcome::Answered(format!(
                "session {} imported: {} parts, {} bytes held",
                s.id, s.parts, s.held_bytes
            ))
        }
        Err(s) => Outcome::from_status(&s),
    }
}

const IMPORT_LIMITS: &[&str] = &["max_session_bytes", "memory_budget", "max_update_bytes"];

/// What one run of concurrent imports left.
struct Run {
    finished: Finished,
    outcomes: Vec<Outcome>,
    bystander: BystanderReport,
    elapsed: Duration,
}

/// Starts a server with `flags`, imports `control` (which must succeed), then sends one
/// import of `export` per id in `ids`, all at once, each on its own connection.
async fn concurrent_imports(flags: &[&str], control: String, export: &str, ids: &[&str]) -> Run {
    let server = Capped::start(flags).await;
    let small = import(server.client().await, import_request(control)).await;
    assert!(
        matches!(small, Outcome::Answered(_)),
        "a small export from the same builder imports: {small:?}"
    );
    let bystander = Bystander::start(&server).await;
    let mut clients = Vec::new();
    for _ in ids {
        clients.push(server.client().await);
    }
    let started = Instant::now();
    let attacks: Vec<_> = clients
        .into_iter()
        .zip(ids)
        .map(|(client, id)| {
            let mut request = import_request(export.to_string());
            request.session_id = id.to_string();
            tokio::spawn(within(ATTACK_LIMIT, import(client, request)))
        })
        .collect();
    let mut outcomes = Vec::new();
    for a in attacks {
        outcomes.push(a.await.expect("the import task"));
    }
    let elapsed = started.elapsed();
    let bystander = bystander.finish().await;
    Run {
        finished: server.finish(),
        outcomes,
        bystander,
        elapsed,
    }
}

fn describe(run: &Run, what: &str) -> String {
    let refused = run
        .outcomes
        .iter()
        .filter(|o| o.is_resource_exhausted())
        .count();
    format!(
        "{what}, {refused}/{} RESOURCE_EXHAUSTED; {}",
        run.outcomes.len(),
        run.outcomes
            .iter()
            .map(Outcome::brief)
            .collect::<Vec<_>>()
            .join("; ")
    )
}

fn assert_all_refused(run: &Run) {
    assert_survived(&run.finished, &run.bystander);
    for (i, outcome) in run.outcomes.iter().enumerate() {
        assert_refused(&format!("import {i}"), outcome, IMPORT_LIMITS);
    }
}

fn mib(bytes: usize) -> f64 {
    bytes as f64 / (1 << 20) as f64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_concurrent_real_exports_over_max_session_bytes_are_refused() {
    let export = replicated_export("real", REAL_EXPORT_BYTES);
    assert!(
        (12 << 20..16 << 20).contains(&export.len()),
        "{} bytes",
        export.len()
    );
    let limit = REAL_SESSION_LIMIT.to_string();
    let run = concurrent_imports(
        &["--max-session-bytes", &limit],
        replicated_export("control", 1 << 20),
        &export,
        &["real-0", "real-1", "real-2", "real-3"],
    )
    .await;
    let what = format!(
        "4 x {:.1} MiB exports of real content, --max-session-bytes {} MiB",
        mib(export.len()),
        REAL_SESSION_LIMIT >> 20
    );
    report(
        "real-content imports x4",
        &run.finished,
        run.elapsed,
        &describe(&run, &what),
        &run.bystander,
    );
    assert_all_refused(&run);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_concurrent_500k_part_exports_over_max_session_bytes_are_refused() {
    let export = tiny_parts_export("tiny", TINY_MESSAGES, TINY_PARTS);
    assert!(export.len() < 16 << 20, "{} bytes", export.len());
    let limit = TINY_SESSION_LIMIT.to_string();
    let run = concurrent_imports(
        &["--max-session-bytes", &limit],
        tiny_parts_export("control", 2, 200),
        &export,
        &["tiny-0", "tiny-1", "tiny-2", "tiny-3"],
    )
    .await;
    let what = format!(
        "4 x {TINY_PARTS} parts in {:.1} MiB of JSON, --max-session-bytes {} MiB",
        mib(export.len()),
        TINY_SESSION_LIMIT >> 20
    );
    report(
        "500k-part imports x4",
        &run.finished,
        run.elapsed,
        &describe(&run, &what),
        &run.bystander,
    );
    assert_all_refused(&run);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_500k_part_export_is_refused_for_less_memory_than_the_budget() {
    let export = tiny_parts_export("tiny", TINY_MESSAGES, TINY_PARTS);
    assert!(export.len() < 16 << 20, "{} bytes", export.len());
    let limit = TINY_SESSION_LIMIT.to_string();
    let run = concurrent_imports(
        &["--max-session-bytes", &limit],
        tiny_parts_export("control", 2, 200),
        &export,
        &["tiny"],
    )
    .await;
    let what = format!(
        "{TINY_PARTS} parts in {:.1} MiB of JSON, --max-session-bytes {} MiB",
        mib(export.len()),
        TINY_SESSION_LIMIT >> 20
    );
    report(
        "500k-part import",
        &run.finished,
        run.elapsed,
        &describe(&run, &what),
        &run.bystander,
    );
    assert_all_refused(&run);
    // The whole process, its bystander and the 15 MiB request included, peaked under the
    // memory budget: the refusal did not build what it refused.
    assert!(
        run.finished.peak_rss < MEMORY_BUDGET,
        "refusing the import peaked at {} MiB of RSS, over the {} MiB memory budget",
        run.finished.peak_rss >> 20,
        MEMORY_BUDGET >> 20
    );
}
