//! The fuzz harness, one file for both homes of the targets: the in-crate protobuf targets
//! (`src/server/fuzz_tests.rs`, which includes this file by path) and the integration
//! targets beside it. Runs a target for a bounded number of cases (scaled by
//! `COMPACTD_FUZZ_CASES`), prints its figures and a tally of outcomes, and panics with
//! the shrunk input on failure.

use std::time::Instant;

use proptest::strategy::Strategy;
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
pub struct Tally(std::sync::Mutex<std::collections::BTreeMap<&'static str, u64>>);

impl Tally {
    /// Counts one `outcome`.
    pub fn hit(&self, outcome: &'static str) {
        *self
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(outcome)
            .or_default() += 1;
    }

    /// The tally as `outcome count, ...`.
    pub fn summary(&self) -> String {
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
pub fn fuzz<S: Strategy>(
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
