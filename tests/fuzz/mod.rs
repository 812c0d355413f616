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
mod harness;
mod import;

use proptest::prelude::*;

use harness::{Tally, fuzz};

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
