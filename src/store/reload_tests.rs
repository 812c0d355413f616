//! Under `Durability::Sync`, a failed commit makes the actor reload its session from
//! disk: those reloads take turns with the store's loads, so a disk that fails every
//! session's batch at once does not decode every session beside its copy at once.

use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::time::Duration;

use super::backend::{Committed, Stored};
use super::durable_tests::{Faulty, NOW, feed, info, store_over, turn};
use super::*;

/// `Faulty`, whose loads take 150 ms and are counted: how many run now, the most at once.
#[derive(Debug)]
struct CountedLoads {
    inner: Arc<Faulty>,
    now: AtomicUsize,
    most: AtomicUsize,
}

impl Backend for CountedLoads {
    fn sessions(&self) -> Result<Vec<String>, BackendError> {
        self.inner.sessions()
    }
    fn last_incarnation(&self) -> Result<u64, BackendError> {
        self.inner.last_incarnation()
    }
    fn load(&self, id: &str) -> Result<Option<Stored>, BackendError> {
        let running = self.now.fetch_add(1, SeqCst).saturating_add(1);
        self.most.fetch_max(running, SeqCst);
        std::thread::sleep(Duration::from_millis(150));
        let stored = self.inner.load(id);
        self.now.fetch_sub(1, SeqCst);
        stored
    }
    fn write(&self, writes: Vec<Write>) -> Committed {
        self.inner.write(writes)
    }
    fn state(&self) -> BackendState {
        self.inner.state()
    }
    fn durability(&self) -> Durability {
        self.inner.durability()
    }
    fn disk_bytes(&self) -> u64 {
        self.inner.disk_bytes()
    }
    fn close(&self) {
        self.inner.close()
    }
}

/// Eight sessions' updates refused by a failing disk at once: each actor reloads its
/// session, at most [`MAX_CONCURRENT_LOADS`] at a time. Before, all eight read and
/// decoded at once (each beside the copy it replaces, outside the budget).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reloads_after_failed_commits_take_turns_with_loads() {
    let dir = tempfile::tempdir().expect("dir");
    let faulty = Arc::new(Faulty::sync(dir.path(), None));
    let backend = Arc::new(CountedLoads {
        inner: faulty.clone(),
        now: AtomicUsize::new(0),
        most: AtomicUsize::new(0),
    });
    let store = store_over(backend.clone());
    let mut handles = Vec::new();
    for i in 0..8 {
        let (h, _) = store.open(info(&format!("s{i}"))).await.expect("open");
        feed(&h, turn(0, 1, 1000)).await;
        handles.push(h);
    }
    faulty.fail_all.store(true, SeqCst);
    let refused: Vec<_> = handles
        .iter()
        .cloned()
        .map(|h| {
            tokio::spawn(async move {
                let u = turn(1, 1, 100).remove(0);
                h.call(move |s, _| s.step(u, NOW)).await
            })
        })
        .collect();
    for r in refused {
        assert!(r.await.expect("joined").is_err(), "the update is refused");
    }
    let most = backend.most.load(SeqCst);
    assert!(most >= 1, "the sessions were reloaded");
    assert!(
        most <= MAX_CONCURRENT_LOADS,
        "{most} reloads at once, past {MAX_CONCURRENT_LOADS}"
    );
    // Still served, as the disk has them.
    faulty.fail_all.store(false, SeqCst);
    for h in &handles {
        let u = turn(2, 1, 100).remove(0);
        h.call(move |s, _| s.step(u, NOW))
            .await
            .expect("ran")
            .expect("applied");
    }
    store.close().await;
}
