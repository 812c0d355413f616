//! Property-based fuzzing of the decoders a client reaches outside the gRPC protobuf path
//! (issue 13): the `opencode export` import (`import.rs`) and the TOML configuration file
//! (`config.rs`). The protobuf targets are in-crate, beside the server
//! (`src/server/fuzz_tests.rs`).
//!
//! Bounded for CI: each target runs a fixed number of cases, multiplied by the environment
//! variable `COMPACTD_FUZZ_CASES` for longer runs (`COMPACTD_FUZZ_CASES=100 cargo test
//! --test all fuzz_ -- --nocapture`), and prints `fuzz <target>: <cases> cases in <secs> s`.
//! A failure prints the shrunk input; `PROPTEST_RNG_SEED` replays a run.

mod config;
mod import;

use std::time::Instant;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

/// `COMPACTD_FUZZ_CASES` (a multiplier, default 1) applied to a target's own case count.
fn scaled(cases: u32) -> u32 {
    let factor = std::env::var("COMPACTD_FUZZ_CASES")
        .ok()
        .and_then(|v| v.trim().parse::<u32>().ok())
        .unwrap_or(1)
        .max(1);
    cases.saturating_mul(factor)
}

/// How often each outcome happened in a target's run (so a target that stopped reaching
/// the code it is meant for shows it).
#[derive(Default)]
struct Tally(std::sync::Mutex<std::collections::BTreeMap<&'static str, u64>>);

impl Tally {
    /// Counts one `outcome`.
    fn hit(&self, outcome: &'static str) {
        *self
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(outcome)
            .or_default() += 1;
    }

    fn summary(&self) -> String {
        let counts = self.0.lock().unwrap_or_else(|e| e.into_inner());
        counts
            .iter()
            .map(|(k, v)| format!("{k} {v}"))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// Runs `test` on `cases` inputs drawn from `strategy` (shrinking a failure), then prints
/// the target's figures and the tally of outcomes. Nothing is written to the source tree.
fn fuzz<S: Strategy>(
    target: &str,
    cases: u32,
    strategy: S,
    test: impl Fn(S::Value, &Tally) -> Result<(), TestCaseError>,
) {
    let tally = Tally::default();
    let cases = scaled(cases);
    let mut runner = TestRunner::new(Config {
        cases,
        failure_persistence: None,
        ..Config::default()
    });
    let began = Instant::now();
    let outcome = runner.run(&strategy, |v| test(v, &tally));
    eprintln!(
        "fuzz {target}: {cases} cases in {:.1} s ({})",
        began.elapsed().as_secs_f64(),
        tally.summary()
    );
    if let Err(e) = outcome {
        panic!("fuzz {target}: {e}");
    }
}

/// Strings a hostile file holds: plain, control and bidi characters, any Unicode.
fn text() -> BoxedStrategy<String> {
    let odd = prop_oneof![
        any::<char>(),
        proptest::sample::select(vec![
            '\0', '\n', '\r', '\t', '\u{1b}', '\u{7f}', '\u{85}', '\u{202e}', '\u{feff}', '"',
            '\\', '\'', '.', '[', ']', '{', '}', '=', '#', '$', ',',
        ]),
    ];
    prop_oneof![
        6 => "[a-z0-9_]{0,12}",
        3 => proptest::collection::vec(odd, 0..16).prop_map(String::from_iter),
        1 => proptest::sample::select(vec![255usize, 256, 257, 5_000]).prop_map(|n| "i".repeat(n)),
    ]
    .boxed()
}
