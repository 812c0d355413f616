//! The counting threads: real BPE counts of long texts, off the async runtime.
//!
//! A 4 KB tool output takes ~150 µs to count with o200k, too long for a runtime worker.
//! Tokio's blocking pool ran those counts before, one thread per count in flight: a
//! stream reading ahead, or 64 streams at once, put tens of threads on two cores, and
//! every new thread rebuilt its regex search cache. These threads are as many as the
//! machine has cores and live as long as the server, so each keeps its cache warm, and
//! the counts queue in arrival order (FIFO across streams) instead of preempting each
//! other.

use std::panic::AssertUnwindSafe;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};

use tokio::sync::oneshot;

use crate::store::Reservation;
use crate::tokens::TokenCounter;

type Job = Box<dyn FnOnce() + Send>;

/// What every counting thread's name starts with (`compactd-count-N`), so tools such as
/// `compactd bench` can tell the counting's CPU from the rest of the process's. Linux keeps
/// 15 bytes of a thread's name: this prefix survives whole.
pub const THREAD_PREFIX: &str = "compactd-count";

/// The counting threads and their queue; dropping it ends them once the queue is empty.
#[derive(Debug)]
pub struct CountPool {
    jobs: Option<mpsc::Sender<Job>>,
}

/// A count queued on the pool: done once its texts' counts are in the count cache (or
/// the count could not run, and the session's actor counts them itself).
#[derive(Debug)]
pub struct Queued(Option<oneshot::Receiver<()>>);

impl CountPool {
    /// Starts one counting thread per core.
    pub fn per_core() -> CountPool {
        CountPool::new(std::thread::available_parallelism().map_or(2, std::num::NonZero::get))
    }

    /// Starts `threads` counting threads (fewer if the OS refuses some; with none, every
    /// count is left to the sessions' actors).
    pub fn new(threads: usize) -> CountPool {
        let (tx, rx) = mpsc::channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        let mut started = 0;
        for i in 0..threads.max(1) {
            let rx = rx.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("{THREAD_PREFIX}-{i}"))
                .spawn(move || work(&rx));
            match spawned {
                Ok(_) => started += 1,
                Err(e) => tracing::warn!(error = %e, "could not start a counting thread"),
            }
        }
        tracing::debug!(threads = started, "counting threads started");
        CountPool {
            jobs: (started > 0).then_some(tx),
        }
    }

    /// Queues counting `texts` with `counter` into the count cache. `held` is the texts'
    /// reservation in the store's ledger, given back when the job ends: the queue holds
    /// copies of them. A count whose waiter is gone (its request cancelled) is skipped.
    pub fn count(
        &self,
        counter: &'static dyn TokenCounter,
        texts: Vec<String>,
        held: Reservation,
    ) -> Queued {
        let Some(jobs) = &self.jobs else {
            return Queued(None);
        };
        let (done, rx) = oneshot::channel();
        let job: Job = Box::new(move || {
            let _held = held;
            if done.is_closed() {
                return;
            }
            crate::tokens::precount(counter, texts.iter().map(String::as_str));
            let _ = done.send(());
        });
        Queued(jobs.send(job).is_ok().then_some(rx))
    }
}

impl Queued {
    /// True once the count is done (or cannot happen); never waits.
    pub fn is_done(&mut self) -> bool {
        let done = match &mut self.0 {
            None => true,
            Some(rx) => !matches!(rx.try_recv(), Err(oneshot::error::TryRecvError::Empty)),
        };
        if done {
            // A receiver is not polled again once it answered.
            self.0 = None;
        }
        done
    }

    /// Waits for the count.
    pub async fn done(&mut self) {
        if let Some(rx) = &mut self.0 {
            let _ = rx.await;
        }
        self.0 = None;
    }
}

/// A counting thread: runs jobs until the pool is dropped. A job that panics only loses
/// its count (its sender drops, so its waiter goes on).
fn work(rx: &Mutex<mpsc::Receiver<Job>>) {
    loop {
        let job = match rx.lock() {
            Ok(rx) => rx.recv(),
            Err(poisoned) => poisoned.into_inner().recv(),
        };
        let Ok(job) = job else {
            return;
        };
        if std::panic::catch_unwind(AssertUnwindSafe(job)).is_err() {
            tracing::warn!("a count panicked; its session's actor counts the texts itself");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokens::Counting;

    #[tokio::test]
    async fn counts_land_in_the_cache() {
        let pool = CountPool::new(2);
        let counter = Counting::O200k.counter();
        let text = "cargo build: Compiling crate-17 v0.3.1\n".repeat(100);
        assert!(!counter.is_cached(&text));
        let mut queued = pool.count(counter, vec![text.clone()], Reservation::default());
        queued.done().await;
        assert!(queued.is_done());
        assert!(counter.is_cached(&text));
        // Asked in either order, any number of times.
        let mut again = pool.count(
            counter,
            vec![text.replace("17", "18")],
            Reservation::default(),
        );
        while !again.is_done() {
            tokio::task::yield_now().await;
        }
        assert!(again.is_done());
        again.done().await;
    }

    /// A count whose request went away before its turn is not made, and the texts'
    /// reservation is given back either way once the job has run.
    #[tokio::test]
    async fn a_count_nobody_waits_for_is_skipped_and_its_reservation_given_back() {
        let pool = CountPool::new(1);
        let counter = Counting::O200k.counter();
        let ledger = Arc::new(crate::store::Ledger::new(1 << 30));
        // A count that keeps the one thread busy for a while (o200k: ~40 MB/s).
        let long = "compiling crate-a v0.1.0 (/src/a)\n".repeat(30_000);
        let mut first = pool.count(counter, vec![long], Reservation::default());
        let skipped = "warning: unused variable `x_41`\n".repeat(500);
        let dropped = pool.count(
            counter,
            vec![skipped.clone()],
            ledger.reserve(1_000, "counts").expect("room"),
        );
        drop(dropped);
        let mut last = pool.count(
            counter,
            vec!["error[E0308]: mismatched types\n".repeat(500)],
            Reservation::default(),
        );
        first.done().await;
        last.done().await;
        assert!(
            !counter.is_cached(&skipped),
            "the cancelled count was skipped"
        );
        assert_eq!(ledger.in_flight(), 0, "its reservation went with the job");
    }

    #[tokio::test]
    async fn a_pool_without_threads_leaves_counts_to_the_actors() {
        let pool = CountPool { jobs: None };
        let mut queued = pool.count(
            Counting::O200k.counter(),
            vec!["x".repeat(4096)],
            Reservation::default(),
        );
        assert!(queued.is_done());
        queued.done().await;
    }
}
