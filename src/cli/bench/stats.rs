//! The bench's arithmetic and its local measurements: percentiles of latencies (computed
//! by sorting: the samples are few), a process's resident memory from
//! `/proc/<pid>/status`, its threads' CPU time from their `schedstat`, and the raw BPE
//! counting rate of this machine's cores on the bench's own texts (the reference
//! compactd's BPE ingest is held to).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use prost::Message as _;

use super::report::Latency;
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

/// The percentiles of `samples`; NaN for none, so that a case that measured nothing
/// misses its target (its ratio cannot be computed) instead of reading as 0 µs.
pub fn latency(samples: Vec<Duration>) -> Latency {
    let n = samples.len();
    let (p50_us, p99_us) = if n == 0 {
        (f64::NAN, f64::NAN)
    } else {
        p50_p99_us(samples)
    };
    Latency {
        samples: n,
        p50_us,
        p99_us,
    }
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

/// The CPU time each live thread of a process has used so far, in nanoseconds, read from
/// `/proc/<pid>/task/<tid>/schedstat`: the scheduler's own accounting, brought up to date
/// at each switch and each scheduler tick, where `stat` counts 10 ms ticks (a case of
/// 20,000 updates in 1 s would read a client's 4 µs an update to within about ±0.5 µs).
#[derive(Debug, Clone, Default)]
pub struct ThreadTimes(HashMap<u32, u64>);

/// The [`ThreadTimes`] of `pid`'s threads, only of those whose names start with `prefix`
/// when one is given; None where `/proc/<pid>/task` cannot be read (not Linux, or the
/// process is gone) or the kernel keeps no `schedstat` (see [`schedstat_kept`]), so that
/// a figure it cannot know prints as unknown, not as 0. A running thread's figure may
/// lag by up to one scheduler tick (the kernel brings it up to date at switches and
/// ticks), well under 1% of a 1 s case.
pub fn thread_times(pid: u32, prefix: Option<&str>) -> Option<ThreadTimes> {
    if !schedstat_kept() {
        return None;
    }
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    let mut times = HashMap::new();
    for task in tasks.flatten() {
        let Some(tid) = task.file_name().to_str().and_then(|t| t.parse().ok()) else {
            continue;
        };
        if let Some(prefix) = prefix {
            let Ok(name) = std::fs::read_to_string(task.path().join("comm")) else {
                continue; // the thread ended meanwhile
            };
            if !name.starts_with(prefix) {
                continue;
            }
        }
        if let Some(ns) = std::fs::read_to_string(task.path().join("schedstat"))
            .ok()
            .and_then(|s| on_cpu_ns(&s))
        {
            times.insert(tid, ns);
        }
    }
    Some(ThreadTimes(times))
}

impl ThreadTimes {
    /// CPU seconds these threads spent since `before`: each thread's time less its time
    /// then. A thread started since counts whole; one that ended since is not seen, and
    /// its time in between is lost: the runtime's and the counting threads live through
    /// a case, but tokio's blocking-pool threads end after 10 s idle, so a case of a
    /// longer `--duration` may miss a few of theirs.
    pub fn since(&self, before: &ThreadTimes) -> f64 {
        let ns: u64 = self
            .0
            .iter()
            .map(|(tid, now)| now.saturating_sub(before.0.get(tid).copied().unwrap_or(0)))
            .fold(0, u64::saturating_add);
        ns as f64 / 1e9
    }
}

/// The CPU seconds spent between two readings of [`thread_times`]; None when either is
/// unknown.
pub fn spent(before: Option<ThreadTimes>, after: Option<ThreadTimes>) -> Option<f64> {
    Some(after?.since(&before?))
}

/// Whether this kernel keeps per-thread CPU time in `schedstat`: one built or booted
/// without scheduler statistics prints `0 0 0` for every thread, while in a process that
/// has run some thread has been charged (a thread just started may still read 0 until its
/// first tick or switch, so no single thread can tell). A yes is kept: the kernel's
/// configuration does not change while the bench runs. A no is read again next time, so a
/// call before any thread was charged does not turn the CPU figures off for the run.
pub fn schedstat_kept() -> bool {
    static KEPT: AtomicBool = AtomicBool::new(false);
    if KEPT.load(Ordering::Relaxed) {
        return true;
    }
    let kept = std::fs::read_dir("/proc/self/task").is_ok_and(|tasks| {
        tasks.flatten().any(|task| {
            std::fs::read_to_string(task.path().join("schedstat"))
                .ok()
                .and_then(|s| on_cpu_ns(&s))
                .is_some_and(|ns| ns > 0)
        })
    });
    if kept {
        KEPT.store(true, Ordering::Relaxed);
    }
    kept
}

/// The time on a CPU of one `schedstat` line: its first field, in nanoseconds.
fn on_cpu_ns(schedstat: &str) -> Option<u64> {
    schedstat.split_whitespace().next()?.parse().ok()
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
    /// CPU seconds the counting threads spent, their whole lives (they only count), read
    /// while they wait to end, when the kernel's figure is up to date; None where
    /// [`thread_times`] cannot tell.
    pub cpu_seconds: Option<f64>,
}

/// The name prefix of [`raw_bpe`]'s counting threads, by which their time is read.
const RAW_THREAD_PREFIX: &str = "bench-raw-count";

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
    // A thread done counting says so and waits at `gate` (held shut by this thread), so
    // that all their times are read while none runs (a running thread's figure can lag
    // by a tick); then the gate opens and they end.
    let gate = std::sync::RwLock::new(());
    let (results, elapsed, cpu_seconds) = std::thread::scope(|s| {
        let shut = gate.write();
        let (said_done, done) = std::sync::mpsc::channel::<()>();
        let handles: Vec<_> = batches
            .iter()
            .enumerate()
            .filter_map(|(i, batch)| {
                let (said_done, gate) = (said_done.clone(), &gate);
                std::thread::Builder::new()
                    .name(format!("{RAW_THREAD_PREFIX}-{i}"))
                    .spawn_scoped(s, move || {
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
                        let _ = said_done.send(());
                        drop(said_done);
                        drop(gate.read());
                        (n, bytes)
                    })
                    .ok()
            })
            .collect();
        // Every thread has said it is done, or ended (its sender dropped either way).
        drop(said_done);
        done.iter().for_each(drop);
        let elapsed = began.elapsed();
        let cpu_seconds = thread_times(std::process::id(), Some(RAW_THREAD_PREFIX))
            .map(|t| t.since(&ThreadTimes::default()));
        drop(shut);
        let results: Vec<(u64, u64)> = handles
            .into_iter()
            .map(|h| h.join().unwrap_or((0, 0)))
            .collect();
        (results, elapsed, cpu_seconds)
    });
    Counted {
        updates: results.iter().map(|r| r.0).sum(),
        bytes: results.iter().map(|r| r.1).sum(),
        elapsed,
        cpu_seconds,
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

    /// A case with no samples misses its target, and its figures print as unknown
    /// (`null` in `--json`). Before, its p50 was 0 µs, a ratio of 0: met.
    #[test]
    fn no_samples_miss_the_latency_target() {
        use super::super::LATENCY_TARGET;
        use super::super::report::ratio;
        let none = latency(Vec::new());
        assert_eq!(none.samples, 0);
        assert!(!LATENCY_TARGET.met(ratio(none.p50_us, 100.0)), "{none:?}");
        assert!(!LATENCY_TARGET.met(ratio(none.p99_us, 100.0)), "{none:?}");
        // What `--json` prints (serde_json writes a NaN as null).
        let json = serde_json::to_string(&none).expect("serializes");
        assert_eq!(json, r#"{"samples":0,"p50_us":null,"p99_us":null}"#);
        let one = latency(vec![Duration::from_micros(7)]);
        assert_eq!((one.p50_us, one.p99_us), (7.0, 7.0));
    }

    #[test]
    fn cpu_time_is_the_first_field_of_schedstat() {
        assert_eq!(on_cpu_ns("876247 0 1\n"), Some(876_247));
        assert_eq!(on_cpu_ns(""), None);
        assert_eq!(on_cpu_ns("not a number"), None);
        let before = ThreadTimes(HashMap::from([(1, 5_000_000_000), (2, 7)]));
        // Thread 1 ran 1.5 s more, 2 ended (not seen), 3 started and ran 0.5 s.
        let after = ThreadTimes(HashMap::from([(1, 6_500_000_000), (3, 500_000_000)]));
        assert_eq!(after.since(&before), 2.0);
        assert_eq!(spent(Some(before), Some(after)), Some(2.0));
        assert_eq!(spent(None, Some(ThreadTimes::default())), None);
    }

    #[test]
    fn a_thread_is_known_by_its_name_and_charged_its_own_time() {
        if !schedstat_kept() {
            // Not Linux, or a kernel without scheduler statistics: no figure is read.
            assert!(thread_times(std::process::id(), None).is_none());
            return;
        }
        let me = std::process::id();
        let prefix = "bench-stats-t";
        let before = thread_times(me, Some(prefix)).expect("this process's threads");
        assert_eq!(before.since(&ThreadTimes::default()), 0.0);
        // A named thread works until its own reading says 20 ms, then waits to be let go:
        // its time is read while it lives. Its reading is 0 until its first tick or
        // switch, and may lag a tick behind; a reading that fails only means "not yet".
        let own = || {
            std::fs::read_to_string("/proc/thread-self/schedstat")
                .ok()
                .and_then(|s| on_cpu_ns(&s))
        };
        let (worked, done) = std::sync::mpsc::channel::<bool>();
        let (release, released) = std::sync::mpsc::channel::<()>();
        let worker = std::thread::Builder::new()
            .name(format!("{prefix}-1"))
            .spawn(move || {
                let give_up = Instant::now() + Duration::from_secs(60);
                let mut x = 0u64;
                let mut reached = false;
                while !reached && Instant::now() < give_up {
                    x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
                    reached = own().is_some_and(|ns| ns >= 20_000_000);
                }
                let _ = worked.send(reached);
                let _ = released.recv();
            })
            .expect("spawn a thread");
        let reached = done.recv().unwrap_or(false);
        let charged = thread_times(me, Some(prefix)).map(|t| t.since(&before));
        let _ = release.send(());
        let _ = worker.join();
        assert!(
            reached,
            "the worker's own schedstat never read 20 ms in 60 s"
        );
        assert!(charged.is_some_and(|s| s >= 0.02), "charged {charged:?} s");
        // Only the threads of that name: none here by this one.
        let none = thread_times(me, Some("no-such-thread")).expect("this process's threads");
        assert_eq!(none.since(&ThreadTimes::default()), 0.0);
        let all = thread_times(me, None).expect("this process's threads");
        assert!(all.since(&ThreadTimes::default()) > 0.0);
    }
}
