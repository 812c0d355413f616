//! The server's wall clock. The engine never reads a clock: the shell passes it the time
//! (epoch ms), so engine tests and trace replays are deterministic.

use std::time::{SystemTime, UNIX_EPOCH};

/// Wall clock in epoch ms, for the engine's timestamps and compaction ids (0 before 1970,
/// saturating far in the future).
pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}
