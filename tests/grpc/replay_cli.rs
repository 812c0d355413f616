//! `compactd replay --summarize-with`: a real trace through full compaction against an
//! OpenAI-compatible endpoint, run as the real binary.

use std::process::Command;

use crate::common::fake_llm::{FakeLlm, Reply};

#[tokio::test]
async fn replay_runs_full_compactions_against_an_endpoint() {
    let fake = FakeLlm::start(vec![Reply::text([
        "## Objective\\nShip the DuckDB client.",
        " Next: CRUD tests.",
    ])])
    .await;
    let trace = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/traces/opencode-silent-panda.json"
    );
    let url = fake.base_url();
    // The binary blocks on HTTP: run it off the test's runtime so the fake can answer.
    let out = tokio::task::spawn_blocking(move || {
        Command::new(env!("CARGO_BIN_EXE_compactd"))
            .args([
                "replay",
                trace,
                "--context",
                "64000",
                "--output",
                "8000",
                "--summarize-with",
                &url,
            ])
            .output()
            .expect("replay runs")
    })
    .await
    .expect("join");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let compactions = stdout.matches("COMPACTED").count();
    assert!(compactions >= 1, "{stdout}");
    assert!(!stdout.contains("COMPACTION FAILED"), "{stdout}");
    assert_eq!(
        fake.request_count(),
        compactions,
        "one request per compaction"
    );
    // After a compaction the context shrinks: the row's with-prune figure drops.
    let req = fake.last_request();
    assert!(
        req.message_texts()[1].contains("--- user ---"),
        "the head travels as a transcript"
    );
}
