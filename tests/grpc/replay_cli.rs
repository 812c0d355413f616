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

// ---- the `replay --json` contract ----

/// The lanes every replay runs, in report order.
const LANES: [&str; 4] = ["none", "opencode", "masking-10", "compactd"];

/// The keys of every lane object: a contract other tools read.
const FIGURES: [&str; 6] = [
    "prompt_tokens",
    "cost",
    "cache_breaks",
    "references",
    "dangling_references",
    "compactions",
];

/// The modes of replay's `prediction` objects.
const PREDICTION_MODES: [&str; 4] = ["chars4", "o200k", "cl100k", "calibrated"];

/// Two traces for the contract: a short OpenCode one and an OpenHands one where the lanes
/// differ.
const CONTRACT_TRACES: [&str; 2] = [
    concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/traces/opencode-nimble-pixel.json"
    ),
    concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/traces/openhands-ponyc-4595.json"
    ),
];

/// `replay --json ARGS` over the contract traces: stdout as one JSON document.
fn replay_json(extra: &[&str]) -> serde_json::Value {
    let mut args = vec!["--json"];
    args.extend_from_slice(extra);
    args.extend_from_slice(&CONTRACT_TRACES);
    let out = replay_clean(&args);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // `from_str` refuses anything after the document: stdout holds exactly one.
    serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("not one JSON document: {e}\n{stdout}"))
}

/// The object's keys, sorted.
fn keys(v: &serde_json::Value) -> Vec<String> {
    let mut k: Vec<String> = v
        .as_object()
        .unwrap_or_else(|| panic!("not an object: {v}"))
        .keys()
        .cloned()
        .collect();
    k.sort();
    k
}

fn sorted(names: &[&str]) -> Vec<String> {
    let mut k: Vec<String> = names.iter().map(|s| s.to_string()).collect();
    k.sort();
    k
}

/// Checks one lane object: exactly the contract's keys, integers but for `cost`.
fn assert_lane_shape(where_: &str, lane: &serde_json::Value) {
    assert_eq!(keys(lane), sorted(&FIGURES), "{where_}: {lane}");
    for k in FIGURES {
        if k == "cost" {
            assert!(lane[k].is_number(), "{where_}.{k}: {lane}");
            assert!(lane[k].as_f64().is_some_and(|c| c >= 0.0), "{where_}.{k}");
        } else {
            assert!(lane[k].is_u64(), "{where_}.{k} is not an integer: {lane}");
        }
    }
}

fn int(v: &serde_json::Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not an integer: {v}"))
}

#[test]
fn replay_json_keeps_its_contract() {
    let doc = replay_json(&[]);
    assert_eq!(keys(&doc), sorted(&["cache_model", "traces", "total"]));
    assert_eq!(doc["cache_model"], "anthropic", "the default cache model");

    let traces = doc["traces"].as_array().expect("traces is an array");
    assert_eq!(traces.len(), CONTRACT_TRACES.len(), "one entry per file");
    for (trace, path) in traces.iter().zip(CONTRACT_TRACES) {
        assert_eq!(
            keys(trace),
            sorted(&["file", "requests", "lanes", "prediction"]),
            "{trace}"
        );
        let stem = std::path::Path::new(path)
            .file_stem()
            .and_then(|s| s.to_str())
            .expect("a file stem");
        assert_eq!(trace["file"], stem);
        assert!(int(&trace["requests"]) > 0, "{trace}");
        let lanes = &trace["lanes"];
        assert_eq!(keys(lanes), sorted(&LANES), "{stem}");
        for lane in LANES {
            assert_lane_shape(&format!("{stem}.{lane}"), &lanes[lane]);
        }
        // The agent's references are the same whatever a lane sends; the unmanaged lane
        // holds every one of them.
        let refs = int(&lanes["none"]["references"]);
        for lane in LANES {
            assert_eq!(int(&lanes[lane]["references"]), refs, "{stem}.{lane}");
        }
        assert_eq!(int(&lanes["none"]["dangling_references"]), 0, "{stem}");
        assert_eq!(
            int(&lanes["none"]["cache_breaks"]),
            0,
            "{stem}: none only grows"
        );
    }

    // The total is the sum over the traces, lane by lane.
    let total = &doc["total"];
    assert_eq!(keys(total), sorted(&["lanes", "prediction"]));
    // The prediction: each mode with the same keys, every trace's requests in the total.
    let predictions = traces
        .iter()
        .map(|t| &t["prediction"])
        .chain([&total["prediction"]]);
    for p in predictions {
        assert_eq!(keys(p), sorted(&PREDICTION_MODES), "{p}");
        for mode in PREDICTION_MODES {
            assert_eq!(
                keys(&p[mode]),
                sorted(&[
                    "requests",
                    "median_abs_pct",
                    "p95_abs_pct",
                    "worst_under_pct",
                    "worst_under_pct_large"
                ]),
                "{mode}: {p}"
            );
            let m = &p[mode];
            let pct = |k: &str| m[k].as_f64().unwrap_or(-1.0);
            assert!(pct("median_abs_pct") <= pct("p95_abs_pct"), "{mode}: {m}");
            assert!(pct("worst_under_pct") >= 0.0, "{mode}: {m}");
        }
    }
    let requests = |p: &serde_json::Value| int(&p["calibrated"]["requests"]);
    let per_trace: u64 = traces.iter().map(|t| requests(&t["prediction"])).sum();
    assert!(per_trace > 0);
    assert_eq!(requests(&total["prediction"]), per_trace);
    assert_eq!(keys(&total["lanes"]), sorted(&LANES));
    for lane in LANES {
        let t = &total["lanes"][lane];
        assert_lane_shape(&format!("total.{lane}"), t);
        for k in FIGURES.into_iter().filter(|k| *k != "cost") {
            let sum: u64 = traces.iter().map(|tr| int(&tr["lanes"][lane][k])).sum();
            assert_eq!(int(&t[k]), sum, "total.{lane}.{k}");
        }
        // Costs are printed to a tenth: the total may differ from the rounded parts by
        // their rounding only.
        let sum: f64 = traces
            .iter()
            .map(|tr| tr["lanes"][lane]["cost"].as_f64().unwrap_or(f64::NAN))
            .sum();
        let cost = t["cost"].as_f64().unwrap_or(f64::NAN);
        assert!(
            (cost - sum).abs() <= 0.1 * traces.len() as f64,
            "total.{lane}.cost {cost} vs {sum}"
        );
    }
    assert_eq!(int(&total["lanes"]["none"]["dangling_references"]), 0);
    // The managed lanes send less than the unmanaged one.
    let tokens = |lane: &str| int(&total["lanes"][lane]["prompt_tokens"]);
    assert!(tokens("compactd") < tokens("none"), "{total}");
    assert!(tokens("masking-10") < tokens("none"), "{total}");
}

#[test]
fn replay_json_without_a_cache_costs_the_tokens_sent() {
    let doc = replay_json(&["--cache-model", "none"]);
    assert_eq!(doc["cache_model"], "none");
    let traces = doc["traces"].as_array().expect("traces");
    let lanes = traces
        .iter()
        .map(|t| (t["file"].to_string(), &t["lanes"]))
        .chain([("total".to_string(), &doc["total"]["lanes"])]);
    for (name, lanes) in lanes {
        for lane in LANES {
            let l = &lanes[lane];
            assert_eq!(
                l["cost"].as_f64(),
                Some(int(&l["prompt_tokens"]) as f64),
                "{name}.{lane}: {l}"
            );
        }
    }
    // The reference lanes send the same prompts under any model: only the prices differ.
    let anthropic = replay_json(&[]);
    let total =
        |doc: &serde_json::Value, lane: &str, k: &str| doc["total"]["lanes"][lane][k].clone();
    for lane in ["none", "opencode", "masking-10"] {
        assert_eq!(
            total(&anthropic, lane, "prompt_tokens"),
            total(&doc, lane, "prompt_tokens"),
            "{lane}"
        );
        assert_ne!(
            total(&anthropic, lane, "cost"),
            total(&doc, lane, "cost"),
            "{lane}"
        );
    }
    // The compactd lane runs with the flag's model: without a cache its scheduler applies
    // every decision at once; under anthropic it holds the ones that do not pay for the
    // cache rewrite, so it sends more.
    assert!(
        int(&total(&doc, "compactd", "prompt_tokens"))
            < int(&total(&anthropic, "compactd", "prompt_tokens")),
        "none {} vs anthropic {}",
        total(&doc, "compactd", "prompt_tokens"),
        total(&anthropic, "compactd", "prompt_tokens")
    );
}

#[test]
fn replay_refuses_an_unknown_cache_model_naming_the_flag() {
    let out = replay_clean(&["--json", "--cache-model", "gemini", CONTRACT_TRACES[0]]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("--cache-model") && stderr.contains("gemini"),
        "{stderr}"
    );
    assert!(out.stdout.is_empty(), "nothing is replayed");
}

#[test]
fn replay_prints_the_lanes_table_for_humans() {
    let out = replay_clean(&CONTRACT_TRACES);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}");
    assert!(
        stdout.lines().any(|l| l == "cache model anthropic"),
        "{stdout}"
    );
    let header = stdout
        .lines()
        .position(|l| l.starts_with("| trace | lane |") && l.contains("dangling"))
        .unwrap_or_else(|| panic!("no lanes table header:\n{stdout}"));
    // Every lane of every trace, then the totals (several traces).
    let rows: Vec<&str> = stdout
        .lines()
        .skip(header + 2)
        .take_while(|l| l.starts_with('|'))
        .collect();
    assert_eq!(
        rows.len(),
        (CONTRACT_TRACES.len() + 1) * LANES.len(),
        "{stdout}"
    );
    for (i, row) in rows.iter().enumerate() {
        let lane = LANES[i % LANES.len()];
        assert!(row.contains(&format!(" | {lane} | ")), "{row}");
    }
    assert!(
        rows.iter()
            .rev()
            .take(LANES.len())
            .all(|r| r.starts_with("| **total** |"))
    );
}

/// An update the engine refuses while a trace replays (here a part past
/// `--max-parts-per-message`) is skipped, and said so on stderr with its file. Before,
/// the warning went nowhere (replay installed no log output): every lane's figures fell
/// without a word.
#[test]
fn a_refused_update_is_reported_with_its_file() {
    let trace = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/traces/opencode-jolly-eagle.json"
    );
    let out = replay_clean(&[trace, "--max-parts-per-message", "1"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("update refused") && stderr.contains("opencode-jolly-eagle.json"),
        "{stderr}"
    );
    // Nothing refused, nothing said.
    let out = replay_clean(&[trace]);
    assert!(
        out.stderr.is_empty(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `--summarize-with` is checked as `--llm-base-url` is, before any file is read: a query
/// is refused naming the flag, its value not shown. Before, it was taken, and every
/// compaction request went to `/v1?key=.../chat/completions`.
#[test]
fn a_summarize_with_url_with_a_query_is_refused_unquoted() {
    let trace = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/traces/opencode-kind-meadow.json"
    );
    let out = replay_clean(&[
        trace,
        "--summarize-with",
        "http://127.0.0.1:9/v1?key=sk-SECRET-42",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(out.stdout.is_empty(), "a file was replayed first");
    assert!(
        err.contains("--summarize-with: \"http://127.0.0.1:9/v1?key=[redacted]\" has a query"),
        "{err}"
    );
    assert!(err.contains("COMPACTD_LLM_API_KEY"), "{err}");
    assert!(!err.contains("SECRET"), "{err}");
}
