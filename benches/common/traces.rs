//! The shared traces' files, for the benches that build their workload from them.

use std::path::PathBuf;

/// Every trace file (`tests/data/traces/*.json`), in name order.
pub fn files() -> Vec<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/traces");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .expect("tests/data/traces readable")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    files.sort();
    files
}
