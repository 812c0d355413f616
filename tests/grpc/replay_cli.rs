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

/// Runs `compactd replay ARGS` with no inherited `COMPACTD_*` variable (a
/// `COMPACTD_CACHE_MODEL` in the environment would change the prices): success, and
/// stdout and stderr together.
fn replay(args: &[&str]) -> (bool, String) {
    let out = replay_clean(args);
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

/// `compactd replay ARGS` with no inherited `COMPACTD_*` variable.
fn replay_clean(args: &[&str]) -> std::process::Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_compactd"));
    cmd.arg("replay").args(args);
    for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("COMPACTD_")) {
        cmd.env_remove(k);
    }
    cmd.output().expect("replay runs")
}

/// The line `total: ... compactd N ...` of a replay, as (no-compactd, prune-only, compactd).
fn finals(stdout: &str) -> (u64, u64, u64) {
    let line = stdout
        .lines()
        .find(|l| l.starts_with("total:"))
        .expect("a total line");
    let after = |key: &str| -> u64 {
        let rest = &line[line.find(key).expect(key) + key.len()..];
        rest.split_whitespace()
            .next()
            .and_then(|n| n.parse().ok())
            .expect("a number")
    };
    (
        after("no-compactd "),
        after("prune-only "),
        after("  compactd "),
    )
}

#[test]
fn replay_reports_each_strategy_and_switches_them() {
    let trace = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/traces/opencode-kind-meadow.json"
    );
    let (ok, all) = replay(&[trace]);
    assert!(ok, "{all}");
    let (base, prune, compactd) = finals(&all);
    assert!(compactd < prune && prune <= base, "{all}");
    assert!(all.contains("maskObservations"), "{all}");

    // Only one strategy: only it saves, and less than all of them together.
    let (ok, one) = replay(&[trace, "--strategies", "aggressive_file_prune"]);
    assert!(ok, "{one}");
    let per_strategy = one
        .lines()
        .skip_while(|l| !l.starts_with("strategies (parts"))
        .skip(1)
        .take_while(|l| l.starts_with("  "))
        .collect::<Vec<_>>();
    assert_eq!(per_strategy.len(), 1, "{one}");
    assert!(per_strategy[0].contains("aggressiveFilePrune"), "{one}");
    let (_, _, only_files) = finals(&one);
    assert!(compactd < only_files && only_files < prune, "{one}");

    // None: the compactd lane is the prune-only lane.
    let (ok, none) = replay(&[trace, "--no-strategies"]);
    assert!(ok, "{none}");
    let (_, p, c) = finals(&none);
    assert_eq!(p, c, "{none}");
    assert!(none.contains("strategies: nothing to mark"), "{none}");

    // A misspelt name is refused, naming the flag.
    let (ok, bad) = replay(&[trace, "--strategies", "pruneEverything"]);
    assert!(!ok);
    assert!(
        bad.contains("strategies") && bad.contains("pruneEverything"),
        "{bad}"
    );
}

#[test]
fn replay_writes_a_chart_of_every_lane_with_its_cost() {
    let dir = std::env::temp_dir().join(format!("compactd-chart-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let chart = dir.join("chart.svg");
    let traces = [
        concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/data/traces/opencode-silent-panda.json"
        ),
        concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/data/traces/opencode-nimble-pixel.json"
        ),
    ];
    let (ok, out) = replay(&[
        traces[0],
        traces[1],
        "--chart",
        chart.to_str().expect("utf-8"),
    ]);
    assert!(ok, "{out}");
    // Several traces: one chart each, and the cross-trace table.
    assert!(out.contains("| trace | steps | no compactd | prune only | prune + strategies |"));
    for name in ["opencode-silent-panda", "opencode-nimble-pixel"] {
        let path = dir.join(format!("chart-{name}.svg"));
        let svg = std::fs::read_to_string(&path).expect("chart written");
        assert!(svg.starts_with("<svg"), "{path:?}");
        // Four lanes in the token panel and again in the cost panel.
        assert_eq!(svg.matches("<polyline").count(), 8, "{path:?}");
        for lane in ["none", "opencode", "masking-10", "compactd"] {
            let lines = svg
                .matches(&format!(r#"<polyline data-lane="{lane}""#))
                .count();
            assert_eq!(lines, 2, "{lane} in {path:?}");
        }
        assert!(svg.contains("cost per request, cache model anthropic"));
        assert!(svg.contains("overflow threshold"));
        assert!(svg.contains(name));
    }
    std::fs::remove_dir_all(&dir).ok();
}
