//! Test support: every shared trace (`tests/data/traces`) loaded as a session with the
//! default settings, for tests that check a context shape against a reference on real
//! agent sessions.

use crate::config::EngineConfig;
use crate::engine::{PruneMode, Session};

/// Calls `f` with every shared trace's session (default settings), as loaded and then
/// pruned (placeholders, strategy marks, stripped inputs), and a name saying which.
/// Asserts there are at least ten traces and that the prunes reduced something.
pub(crate) fn each_trace_session(mut f: impl FnMut(&str, &Session)) {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/traces");
    let (mut traces, mut pruned) = (0, 0);
    for entry in std::fs::read_dir(dir).expect("traces readable").flatten() {
        let path = entry.path();
        if path.extension().is_none_or(|e| e != "json") {
            continue;
        }
        let text = std::fs::read_to_string(&path).expect("trace readable");
        let export = crate::trace::parse_export(&text).expect("trace parses");
        let config = EngineConfig::default();
        let mut s = crate::trace::load(export, Default::default(), Default::default(), &config)
            .expect("trace loads");
        f(&format!("{} as loaded", path.display()), &s);
        let report = s.prune(PruneMode::Commit, i64::MAX / 2);
        pruned += report.parts.len() + report.strategies.parts.len();
        f(&format!("{} pruned", path.display()), &s);
        traces += 1;
    }
    assert!(traces >= 10, "only {traces} traces");
    assert!(pruned > 0, "no trace pruned anything");
}
