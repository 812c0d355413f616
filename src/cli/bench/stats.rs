//! The bench's arithmetic and its two local measurements: percentiles of latencies
//! (computed by sorting: the samples are few), a process's resident memory from
//! `/proc/<pid>/status`, and the raw BPE counting rate of this machine's cores on the
//! bench's own texts (the reference compactd's BPE ingest is held to).

use std::sync::Arc;
use std::time::{Duration, Instant};

use prost::Message as _;

use super::workload::{self, Plan, Pool};
use crate::server::pb::ClientUpdate;
use crate::tokens::bpe::Bpe;

/// The `p` quantile (0..=1) of `sorted` by nearest rank; zero for no samples.
pub fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = (p * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// p50 and p99 of `samples`, in microseconds.
pub fn p50_p99_us(mut samples: Vec<Duration>) -> (f64, f64) {
    samples.sort_unstable();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    (
        us(percentile(&samples, 0.50)),
        us(percentile(&samples, 0.99)),
    )
}

/// A process's memory now (`VmRSS`) and at its peak so far (`VmHWM`), in bytes; None
/// where `/proc/<pid>/status` does not exist (not Linux, or the process is gone).
pub fn rss(pid: u32) -> Option<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kib = |key: &str| -> Option<u64> {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|n| n.parse::<u64>().ok())
            .map(|k| k * 1024)
    };
    Some((kib("VmRSS:")?, kib("VmHWM:")?))
}

/// What counting the texts of a run of updates took.
#[derive(Debug, Clone, Copy, Default)]
pub struct Counted {
    /// Updates whose texts were counted.
    pub updates: u64,
    /// Their protobuf bytes (as they would travel).
    pub bytes: u64,
    /// Wall time, all threads together.
    pub elapsed: Duration,
}

/// Counts, uncached, the texts of the first `n` updates of each `(plan, n)` of `work` (what
/// each compactd stream had acknowledged), the streams dealt round-robin to `threads`
/// threads, until all are counted or `budget` has passed. The updates are built before the
/// clock starts: only counting is timed.
pub fn raw_bpe(
    pool: &Arc<Pool>,
    bpe: &'static Bpe,
    work: &[(Plan, usize)],
    threads: usize,
    budget: Duration,
) -> Counted {
    let threads = threads.max(1);
    let mut batches: Vec<Vec<ClientUpdate>> = vec![Vec::new(); threads];
    for (i, (plan, n)) in work.iter().enumerate() {
        batches[i % threads].extend(pool.updates(plan.clone()).take(*n));
    }
    let began = Instant::now();
    let deadline = began + budget;
    let results: Vec<(u64, u64)> = std::thread::scope(|s| {
        let handles: Vec<_> = batches
            .iter()
            .map(|batch| {
                s.spawn(move || {
                    let (mut n, mut bytes) = (0u64, 0u64);
                    for u in batch {
                        if Instant::now() >= deadline {
                            break;
                        }
                        for t in workload::counted_texts(u) {
                            std::hint::black_box(bpe.count_uncached(t));
                        }
                        n += 1;
                        bytes += u.encoded_len() as u64;
                    }
                    (n, bytes)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or((0, 0)))
            .collect()
    });
    Counted {
        updates: results.iter().map(|r| r.0).sum(),
        bytes: results.iter().map(|r| r.1).sum(),
        elapsed: began.elapsed(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_by_nearest_rank() {
        let ms = |n| Duration::from_millis(n);
        let samples: Vec<Duration> = (1..=100).map(ms).collect();
        assert_eq!(percentile(&samples, 0.50), ms(50));
        assert_eq!(percentile(&samples, 0.99), ms(99));
        assert_eq!(percentile(&[ms(7)], 0.99), ms(7));
        assert_eq!(percentile(&[], 0.5), Duration::ZERO);
    }
}
