//! Under `Durability::Sync`, a failed commit makes the actor reload its session from
//! disk: those reloads take turns with the store's loads, so a disk that fails every
//! session's batch at once does not decode every session beside its copy at once; and
//! memory pressure on a failing disk does not send the same session cold (a whole write,
//! failed, then a reload) after every job.

use std::sync::atomic::Ordering::SeqCst;
use std::time::Duration;

use super::durable_tests::{Faulty, NOW, feed, info, turn};
use super::load_tests::{Counts, OnLoad};
use super::*;

/// A backend over `faulty` whose loads take `pause` each, counted in `counts`.
fn counted(faulty: Arc<Faulty>, counts: Arc<Counts>, pause: Duration) -> Arc<dyn Backend> {
    Arc::new(OnLoad {
        inner: faulty,
        hook: counts.hook(pause),
    })
}

/// A store over `faulty` whose loads take 150 ms each (counted in `counts`), holding
/// eight sessions fed one turn each.
async fn eight_sessions(faulty: Arc<Faulty>, counts: Arc<Counts>) -> (Store, Vec<SessionHandle>) {
    let store = Store::new(EngineConfig::default())
        .with_backend(counted(faulty, counts, Duration::from_millis(150)))
        .expect("listed");
    let mut handles = Vec::new();
    for i in 0..8 {
        let (h, _) = store.open(info(&format!("s{i}"))).await.expect("open");
        feed(&h, turn(0, 1, 1000)).await;
        handles.push(h);
    }
    (store, handles)
}

/// The sessions were read back (`what`), at most [`MAX_CONCURRENT_LOADS`] at a time.
fn assert_took_turns(counts: &Counts, what: &str) {
    let most = counts.most.load(SeqCst);
    assert!(most >= 1, "no {what}");
    assert!(
        most <= MAX_CONCURRENT_LOADS,
        "{most} {what} at once, past {MAX_CONCURRENT_LOADS}"
    );
}

/// Eight sessions' updates refused by a failing disk at once: each actor reloads its
/// session, at most [`MAX_CONCURRENT_LOADS`] at a time. Before, all eight read and
/// decoded at once (each beside the copy it replaces, outside the budget).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reloads_after_failed_commits_take_turns_with_loads() {
    let dir = tempfile::tempdir().expect("dir");
    let faulty = Arc::new(Faulty::sync(dir.path(), None));
    let counts = Arc::new(Counts::default());
    let (store, handles) = eight_sessions(faulty.clone(), counts.clone()).await;
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
    assert_took_turns(&counts, "reloads");
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

/// Eight sessions whose jobs panic at once (a bug one kind of update meets on every
/// session): each actor rebuilds its session from the disk, at most
/// [`MAX_CONCURRENT_LOADS`] at a time, and each goes on. Before, the rebuilds took no
/// turn: all eight read and decoded at once, each beside its copy in memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rebuilds_after_panicking_jobs_take_turns_with_loads() {
    let dir = tempfile::tempdir().expect("dir");
    let faulty = Arc::new(Faulty::sync(dir.path(), None));
    let counts = Arc::new(Counts::default());
    let (store, handles) = eight_sessions(faulty, counts.clone()).await;
    let panicked: Vec<_> = handles
        .iter()
        .cloned()
        .map(|h| tokio::spawn(async move { super::panic_tests::panic_in(&h).await }))
        .collect();
    for p in panicked {
        p.await.expect("joined");
    }
    for h in &handles {
        let u = turn(1, 1, 100).remove(0);
        h.call(move |s, _| s.step(u, NOW))
            .await
            .expect("ran")
            .expect("applied");
    }
    assert_took_turns(&counts, "rebuilds");
    store.close().await;
}

/// Memory pressure on a disk that refuses every write (`sync`): a session whose try to
/// go cold failed (a whole write, then a reload) is not tried again before its wait is
/// over. Before, every job woke the evictor, which tried the same session again: the
/// review measured 36 failed whole writes and 36 reloads during 10 read-only jobs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_sync_memory_pressure_waits_out_a_full_disk() {
    let dir = tempfile::tempdir().expect("dir");
    let faulty = Arc::new(Faulty::sync(dir.path(), None));
    let counts = Arc::new(Counts::default());
    let budget: u64 = 4 << 20;
    let store = Store::new(EngineConfig::default())
        .with_limits(Limits {
            memory_budget: budget,
            ..Limits::default()
        })
        .with_backend(counted(faulty.clone(), counts.clone(), Duration::ZERO))
        .expect("listed");
    let mut handles = Vec::new();
    for i in 0..4 {
        let (h, _) = store.open(info(&format!("s{i}"))).await.expect("open");
        handles.push(h);
    }
    let mut t = 0;
    while store.ledger().counted() < budget / 100 * 78 {
        feed(&handles[t % 4], turn(t, 1, 40_000)).await;
        t += 1;
    }
    for h in &handles {
        h.flush().await.expect("written");
    }
    faulty.fail_all.store(true, SeqCst);
    // Past the high-water mark: every job asks the evictor for room.
    let need = (budget / 1000 * 900)
        .saturating_sub(store.ledger().counted())
        .saturating_add(50_000);
    let _held = store
        .ledger()
        .reserve(need, "test")
        .expect("within the share");
    let (writes, reloads) = (faulty.writes(), counts.total.load(SeqCst));
    for _ in 0..10 {
        handles[0].call(|_, _| ()).await.expect("a read is served");
    }
    let (writes, reloads) = (
        faulty.writes() - writes,
        counts.total.load(SeqCst) - reloads,
    );
    // Each session tries on its own clock (0.25 s, 0.5 s, ...): a try or two each, not
    // one after every job.
    assert!(writes <= 8, "{writes} whole writes tried during 10 jobs");
    assert!(reloads <= 8, "{reloads} reloads during 10 jobs");
    faulty.fail_all.store(false, SeqCst);
    store.close().await;
}
