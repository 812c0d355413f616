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

/// CPU time a process has used so far (user and system, all its threads), in seconds;
/// None where `/proc/<pid>/stat` does not exist or does not parse. Linux reports it in
/// `USER_HZ` ticks: 100 per second on x86-64 and AArch64, where the bench runs.
pub fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    cpu_seconds_of(&stat)
}

/// CPU time the threads of process `pid` whose names start with `prefix` have used so far
/// (user and system, in seconds), as [`cpu_seconds`] counts it; None where
/// `/proc/<pid>/task` cannot be read. Threads that ended are not counted.
pub fn threads_cpu_seconds(pid: u32, prefix: &str) -> Option<f64> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    let mut seconds = 0.0;
    for task in tasks.flatten() {
        let Ok(stat) = std::fs::read_to_string(task.path().join("stat")) else {
            continue; // the thread ended meanwhile
        };
        if thread_name_of(&stat).is_some_and(|name| name.starts_with(prefix)) {
            seconds += cpu_seconds_of(&stat).unwrap_or(0.0);
        }
    }
    Some(seconds)
}

/// The command (thread) name of one `/proc/<pid>/stat` line: between the first `(` and
/// the last `)`.
fn thread_name_of(stat: &str) -> Option<&str> {
    let (_, rest) = stat.split_once('(')?;
    Some(rest.rsplit_once(')')?.0)
}

/// [`cpu_seconds`] of one `/proc/<pid>/stat` line: `utime` and `stime` are the 14th and
/// 15th fields, counted after the command name, which may itself hold spaces and
/// parentheses (hence the last `)`).
fn cpu_seconds_of(stat: &str) -> Option<f64> {
    const USER_HZ: f64 = 100.0;
    let (_, rest) = stat.rsplit_once(')')?;
    // `rest` starts at the 3rd field (state): utime and stime are its 12th and 13th.
    let mut fields = rest.split_whitespace().skip(11);
    let utime = fields.next()?.parse::<u64>().ok()?;
    let stime = fields.next()?.parse::<u64>().ok()?;
    Some(utime.saturating_add(stime) as f64 / USER_HZ)
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
    /// CPU seconds this process spent meanwhile (the counting threads': nothing else runs
    /// in it then); None where `/proc` is not readable.
    pub cpu_seconds: Option<f64>,
}

/// The CPU seconds spent between two readings of [`cpu_seconds`] (or of
/// [`threads_cpu_seconds`]); None when either is unknown.
pub fn spent(before: Option<f64>, after: Option<f64>) -> Option<f64> {
    before.zip(after).map(|(b, a)| (a - b).max(0.0))
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
    let cpu_before = cpu_seconds(std::process::id());
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
    let elapsed = began.elapsed();
    Counted {
        updates: results.iter().map(|r| r.0).sum(),
        bytes: results.iter().map(|r| r.1).sum(),
        elapsed,
        cpu_seconds: spent(cpu_before, cpu_seconds(std::process::id())),
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

    #[test]
    fn cpu_time_is_read_after_the_command_name() {
        // A command name with spaces and a parenthesis; utime 250, stime 125 ticks.
        let line = "4242 (tokio (rt) worker) S 1 4242 4242 0 -1 4194560 1200 0 0 0 250 125 0 0 20 0 9 0 100 0 0";
        assert_eq!(cpu_seconds_of(line), Some(3.75));
        assert_eq!(cpu_seconds_of("4242 (x) S 1 2"), None);
        assert_eq!(cpu_seconds_of("no parenthesis"), None);
        if cfg!(target_os = "linux") {
            // The real file of this very process parses.
            let me = cpu_seconds(std::process::id());
            assert!(me.is_some_and(|s| s >= 0.0), "{me:?}");
        }
    }

    #[test]
    fn a_thread_is_known_by_its_name() {
        let line = "4243 (compactd-count-) S 1 4242 4242 0 -1 4194560 1200 0 0 0 250 125 0";
        assert_eq!(thread_name_of(line), Some("compactd-count-"));
        let line = "4244 (tokio (rt) worker) S 1";
        assert_eq!(thread_name_of(line), Some("tokio (rt) worker"));
        assert_eq!(thread_name_of("no parenthesis"), None);
        if !cfg!(target_os = "linux") {
            return;
        }
        // A named thread of this process that works until the kernel has charged it a
        // tick (10 ms) is counted under its name's prefix, and only there. The loop gives
        // it up to 5 s.
        let prefix = "bench-stats-t";
        let before = threads_cpu_seconds(std::process::id(), prefix);
        assert_eq!(before, Some(0.0));
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let worker = std::thread::Builder::new()
            .name(format!("{prefix}-1"))
            .spawn(move || {
                let mut x = 0u64;
                while rx.try_recv().is_err() {
                    x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
                }
            })
            .expect("spawn a thread");
        let charged = (0..500).find_map(|_| {
            std::thread::sleep(Duration::from_millis(10));
            threads_cpu_seconds(std::process::id(), prefix).filter(|s| *s > 0.0)
        });
        let _ = tx.send(());
        let _ = worker.join();
        // (Not compared with the whole process's: the kernel scales each figure it
        // reports on its own, so one thread's may read a tick above its process's.)
        assert!(charged.is_some(), "the thread was never charged");
        assert_eq!(
            threads_cpu_seconds(std::process::id(), "no-such-thread"),
            Some(0.0)
        );
    }
}
