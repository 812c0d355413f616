//! `compactd bench` smoke-run on the debug binary with tiny bounds: it starts its own
//! server and echo, finishes without errors, and prints every figure of its table (and of
//! its `--json` document). Never timed: no assertion looks at a figure's value.

use std::process::{Command, Output};

/// Sizes, stream counts and tokenizers of the default table.
const SIZES: [(&str, u64); 2] = [("4", 4096), ("20", 20480)];
const STREAMS: [u64; 2] = [1, 64];
const TOKENIZERS: [&str; 2] = ["chars4", "o200k"];

/// The repository's traces.
const TRACES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/traces");

/// Runs `compactd bench` with tiny bounds and two rounds plus `extra`, with no inherited
/// `COMPACTD_*`.
fn bench(extra: &[&str]) -> Output {
    bench_with(TRACES, &[&["--rounds", "2"], extra].concat())
}

/// [`bench`] replaying the traces of `traces`.
fn bench_with(traces: &str, extra: &[&str]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_compactd"));
    cmd.args(["bench", "--traces", traces])
        .args(["--updates", "40", "--duration", "0.3", "--window", "4"])
        .args(["--context-tokens", "2000"])
        .args(extra);
    for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("COMPACTD_")) {
        cmd.env_remove(k);
    }
    cmd.output().expect("compactd bench runs")
}

fn succeeded(out: &Output) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// True when some line's first words are `words`.
fn has_row(text: &str, words: &[&str]) -> bool {
    text.lines().any(|l| {
        let got: Vec<&str> = l.split_whitespace().collect();
        got.len() > words.len() && got[..words.len()] == *words
    })
}

#[test]
fn bench_prints_every_figure_of_its_table() {
    let stdout = succeeded(&bench(&[]));
    for header in [
        "INGEST",
        "ACK LATENCY",
        "GETCONTEXT",
        "SERVER RSS: start",
        "targets missed:",
    ] {
        assert!(stdout.contains(header), "{header} missing:\n{stdout}");
    }
    let ingest_header = stdout
        .lines()
        .find(|l| l.starts_with("part") && l.contains("streams"))
        .unwrap_or_else(|| panic!("no ingest header:\n{stdout}"));
    for column in [
        "CPU", "count", "client", "ratio", "bound", "rounds", "target",
    ] {
        assert!(
            ingest_header.split_whitespace().any(|w| w == column),
            "no {column} column: {ingest_header}"
        );
    }
    for (kb, _) in SIZES {
        for streams in STREAMS {
            let streams = streams.to_string();
            for tokenizer in TOKENIZERS {
                let words = [kb, "KB", &streams, tokenizer];
                let row = stdout.lines().find(|l| has_row(l, &words));
                let row = row.unwrap_or_else(|| {
                    panic!("no ingest row {kb} KB x {streams} {tokenizer}:\n{stdout}")
                });
                // ratio, range and target are percentages; a BPE row's bound too
                // (where the CPU figures it needs can be read), a chars4 row's is `-`.
                let percents = row.split_whitespace().filter(|w| w.ends_with('%')).count();
                let bound = usize::from(tokenizer != "chars4" && cfg!(target_os = "linux"));
                assert_eq!(percents, 3 + bound, "{row}");
            }
        }
        for tokenizer in TOKENIZERS {
            assert!(
                has_row(&stdout, &[kb, "KB", tokenizer]),
                "no latency row {kb} KB {tokenizer}:\n{stdout}"
            );
        }
    }
    for row in [
        ["compactd", "GetContext"],
        ["echo,", "unary,"],
        ["ratio", ""],
    ] {
        let words: Vec<&str> = row.into_iter().filter(|w| !w.is_empty()).collect();
        assert!(has_row(&stdout, &words), "no {row:?} row:\n{stdout}");
    }
    assert!(stdout.contains("o200k raw, 1 thread"), "{stdout}");
    assert!(stdout.contains("echo + o200k count"), "{stdout}");
    assert!(stdout.trim_end().ends_with("errors: 0"), "{stdout}");
}

#[test]
fn bench_json_holds_the_same_figures() {
    let stdout = succeeded(&bench(&["--json"]));
    let doc: serde_json::Value = serde_json::from_str(&stdout).expect("one JSON document");
    let number = |v: &serde_json::Value, what: &str| {
        assert!(v.is_number(), "{what} is not a number: {v}");
    };
    let ingest = doc["ingest"].as_array().expect("ingest rows");
    assert_eq!(ingest.len(), 8, "{doc:#}");
    for (_, bytes) in SIZES {
        for streams in STREAMS {
            for tokenizer in TOKENIZERS {
                let row = ingest
                    .iter()
                    .find(|r| {
                        r["part_bytes"] == bytes
                            && r["streams"] == streams
                            && r["tokenizer"] == tokenizer
                    })
                    .unwrap_or_else(|| panic!("no row {bytes} x {streams} {tokenizer}"));
                for rate in ["compactd", "reference_rate"] {
                    number(&row[rate]["updates_per_s"], "updates_per_s");
                    number(&row[rate]["mb_per_s"], "mb_per_s");
                }
                // The started server's and the echo's CPU per update (read in the
                // scheduler's nanoseconds: even a case of 40 updates has some); none for
                // counting on the client.
                if cfg!(target_os = "linux") {
                    let cpu = &row["compactd"]["server_cpu_us"];
                    assert!(cpu.as_f64() > Some(0.0), "{row}");
                    let reference = &row["reference_rate"]["server_cpu_us"];
                    if tokenizer == "chars4" {
                        assert!(reference.as_f64() > Some(0.0), "{row}");
                    } else {
                        assert!(reference.is_null(), "{row}");
                    }
                    // What compactd's counting threads took of it; the echo has none,
                    // the raw reference is all counting.
                    let count = &row["compactd"]["count_cpu_us"];
                    assert!(count.as_f64().is_some_and(|us| us >= 0.0), "{row}");
                    let raw_count = &row["reference_rate"]["count_cpu_us"];
                    // The load generator's own CPU driving each server; the raw
                    // reference has no client.
                    let client = &row["compactd"]["client_cpu_us"];
                    assert!(client.as_f64() > Some(0.0), "{row}");
                    let raw_client = &row["reference_rate"]["client_cpu_us"];
                    // A BPE row's bound, from the raw counting's CPU (its threads' whole
                    // lives, read while they wait to end) and the echo's exchange.
                    let (bound, exchange) = (&row["bound"], &row["bound_exchange_us"]);
                    if tokenizer == "chars4" {
                        assert!(raw_count.is_null() && bound.is_null(), "{row}");
                        assert!(exchange.is_null(), "{row}");
                        assert!(raw_client.as_f64() > Some(0.0), "{row}");
                    } else {
                        assert!(raw_count.as_f64() > Some(0.0), "{row}");
                        assert!(raw_client.is_null(), "{row}");
                        assert!(exchange.as_f64() > Some(0.0), "{row}");
                        assert!(bound.as_f64() > Some(0.0), "{row}");
                    }
                }
                number(&row["ratio"], "ratio");
                // The median round's ratio, within the range of both rounds'.
                let range = row["ratio_range"].as_array().expect("ratio_range");
                let (low, ratio, high) =
                    (range[0].as_f64(), row["ratio"].as_f64(), range[1].as_f64());
                assert!(range.len() == 2 && low <= ratio && ratio <= high, "{row}");
                assert!(row["miss"].is_boolean(), "{row}");
                assert!(row["target"].is_object(), "{row}");
            }
        }
    }
    let latency = doc["latency"].as_array().expect("latency rows");
    assert_eq!(latency.len(), 4, "{doc:#}");
    for row in latency {
        for side in ["compactd", "reference_latency"] {
            number(&row[side]["p50_us"], "p50_us");
            number(&row[side]["p99_us"], "p99_us");
        }
        number(&row["ratio_p50"], "ratio_p50");
        number(&row["ratio_p99"], "ratio_p99");
    }
    let contexts = doc["get_context"].as_array().expect("get_context rows");
    let formats: Vec<_> = contexts.iter().map(|c| c["format"].clone()).collect();
    assert_eq!(formats, ["openai", "openai_json", "native"], "{doc:#}");
    for context in contexts {
        assert!(context["tokens"].as_u64() > Some(0), "{context}");
        assert!(context["reply_bytes"].as_u64() > Some(0), "{context}");
        for side in ["compactd", "echo", "client_decode"] {
            number(&context[side]["p50_us"], "p50_us");
            number(&context[side]["p99_us"], "p99_us");
        }
        // Every reply taken as bytes was decoded afterwards (a reply that does not decode
        // is an error, and `errors` is 0 below).
        assert_eq!(
            context["client_decode"]["samples"], context["compactd"]["samples"],
            "{context}"
        );
        number(&context["ratio_p50"], "ratio_p50");
    }
    // Both shapes carry the same context.
    assert_eq!(contexts[0]["tokens"], contexts[1]["tokens"], "{doc:#}");
    if cfg!(target_os = "linux") {
        for at in ["start", "peak", "end"] {
            number(&doc["rss"][at], "rss");
        }
    }
    assert_eq!(doc["workload"]["rounds"], 2, "{doc:#}");
    assert_eq!(doc["errors"], 0, "{doc:#}");
}

#[test]
fn bench_refuses_what_it_cannot_run() {
    let out = bench_with("/nonexistent/traces", &[]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("--traces /nonexistent/traces"), "{stderr}");

    let out = bench(&["--target", "192.0.2.1:50051"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("not a loopback address"), "{stderr}");

    for rounds in ["0", "21"] {
        let out = bench_with(TRACES, &["--rounds", rounds]);
        assert!(!out.status.success());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("--rounds: must be 1 to 20"), "{stderr}");
    }
}
