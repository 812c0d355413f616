//! jemalloc's options for the process (the allocator itself is set by the binary; the
//! library stays allocator-neutral). One constant, so `benches/engine.rs` measures the
//! engine under the same allocator settings as `compactd serve` runs it.

/// jemalloc's compiled-in options, read at its first allocation (`_RJEM_MALLOC_CONF` in
/// the environment still overrides them), exported as `_rjem_malloc_conf` by each final
/// binary that uses jemalloc:
/// - `background_thread`: purging runs on jemalloc's own thread, so pages are returned
///   while compactd is idle too, not only on a later allocation;
/// - `dirty_decay_ms:250`, `muzzy_decay_ms:0`: freed pages go back to the OS
///   (`MADV_DONTNEED`, so RSS drops) over 250 ms. 0 ms measured lowest RSS but 2.5x the
///   CPU under churn; jemalloc's defaults (10 s, no background thread) kept churn RSS
///   at 2.6-2.8x the held bytes and 1.1 GB after deleting 1,000 sessions;
/// - `narenas:2`: jemalloc's default is 4 arenas per CPU of the node, not of the
///   container, and each arena keeps its own partly used pages; 2 measured the lowest
///   RSS under churn (2 cores: 1.85-1.91x at peak, against 2.04-2.14x with the default).
pub const JEMALLOC_CONF: &[u8; 69] =
    b"background_thread:true,narenas:2,dirty_decay_ms:250,muzzy_decay_ms:0\0";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_options_are_one_nul_terminated_c_string() {
        let (last, text) = JEMALLOC_CONF.split_last().unwrap_or((&1, &[]));
        assert_eq!(*last, 0, "jemalloc reads a C string");
        assert!(!text.contains(&0) && text.is_ascii());
        assert!(std::str::from_utf8(text).is_ok_and(|t| t.split(',').all(|o| o.contains(':'))));
    }
}
