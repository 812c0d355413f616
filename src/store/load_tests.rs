//! Loading a cold session: callers that come while it is being loaded wait for that load
//! and never load it a second time beside it (a second copy read from disk before the
//! first one changed would replace it).

use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::{Condvar, Mutex};
use std::time::Duration;

use super::backend::{Committed, Stored};
use super::durable_tests::{durable, feed, info, observed, store_over, turn};
use super::*;

/// SQLite whose loads are scripted: the first fails once released, the third reads the
/// disk and then waits until released; the others read it at once.
struct ScriptedLoads {
    inner: Arc<dyn Backend>,
    calls: AtomicUsize,
    released: Mutex<[bool; 2]>,
    wake: Condvar,
}

impl std::fmt::Debug for ScriptedLoads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ScriptedLoads")
    }
}

impl ScriptedLoads {
    fn release(&self, which: usize) {
        self.released.lock().expect("lock")[which] = true;
        self.wake.notify_all();
    }

    fn wait(&self, which: usize) {
        let mut released = self.released.lock().expect("lock");
        while !released[which] {
            released = self.wake.wait(released).expect("lock");
        }
    }
}

impl Backend for ScriptedLoads {
    fn sessions(&self) -> Result<Vec<String>, BackendError> {
        self.inner.sessions()
    }
    fn last_incarnation(&self) -> Result<u64, BackendError> {
        self.inner.last_incarnation()
    }
    fn load(&self, id: &str) -> Result<Option<Stored>, BackendError> {
        match self.calls.fetch_add(1, SeqCst) {
            0 => {
                self.wait(0);
                Err(BackendError::Io("injected: the first load fails".into()))
            }
            2 => {
                let stored = self.inner.load(id);
                self.wait(1);
                stored
            }
            _ => self.inner.load(id),
        }
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

/// A caller waiting on a load that failed, and one that came after the failure: before,
/// the failed load dropped the per-id lock the first still waited on, the second made a
/// new one, and both read the disk. The one admitted first took a change and went cold
/// again; the other then admitted what it had read before that change, losing it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cold_session_is_loaded_once_by_callers_that_overlap() {
    let d = tempfile::tempdir().expect("dir");
    {
        let store = durable(d.path(), Limits::default(), 0);
        let (h, _) = store.open(info("x")).await.expect("open");
        feed(&h, turn(0, 1, 100)).await;
        store.close().await;
    }
    let sqlite = Sqlite::open(d.path(), Durability::Sync, None, 0).expect("open");
    let backend = Arc::new(ScriptedLoads {
        inner: Arc::new(sqlite),
        calls: AtomicUsize::new(0),
        released: Mutex::new([false, false]),
        wake: Condvar::new(),
    });
    let store = Arc::new(store_over(backend.clone()));
    let get = |store: &Arc<Store>| {
        let store = store.clone();
        tokio::spawn(async move { store.get("x").await.map(drop) })
    };
    let a = get(&store);
    while backend.calls.load(SeqCst) == 0 {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let b = get(&store);
    tokio::time::sleep(Duration::from_millis(50)).await; // b waits on a's load
    backend.release(0);
    assert!(a.await.expect("joined").is_err(), "the first load failed");
    let c = get(&store);
    // One of b and c loads at once and is admitted; if the other loads too, it reads the
    // disk now and waits.
    tokio::time::timeout(Duration::from_secs(10), async {
        while store.hot_len() == 0 {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    })
    .await
    .expect("admitted");
    let h = store.get("x").await.expect("held");
    feed(&h, turn(1, 1, 100)).await;
    let changed = observed(&h).await;
    assert!(h.evict().await, "sent cold");
    drop(h);
    backend.release(1);
    b.await.expect("joined").expect("b");
    c.await.expect("joined").expect("c");
    let h = store.get("x").await.expect("held");
    assert_eq!(observed(&h).await, changed, "the change is kept");
}

/// SQLite whose loads go through `hook` (given the inner backend and the id).
pub(super) struct OnLoad<F> {
    pub(super) inner: Arc<dyn Backend>,
    pub(super) hook: F,
}

impl<F> std::fmt::Debug for OnLoad<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OnLoad")
    }
}

impl<F> Backend for OnLoad<F>
where
    F: Fn(&dyn Backend, &str) -> Result<Option<Stored>, BackendError> + Send + Sync + 'static,
{
    fn sessions(&self) -> Result<Vec<String>, BackendError> {
        self.inner.sessions()
    }
    fn last_incarnation(&self) -> Result<u64, BackendError> {
        self.inner.last_incarnation()
    }
    fn load(&self, id: &str) -> Result<Option<Stored>, BackendError> {
        (self.hook)(self.inner.as_ref(), id)
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

/// A store over the sessions `ids` written (one turn each) in `dir`, read back through
/// `hook`.
async fn stored_then_read_through<F>(dir: &std::path::Path, ids: &[String], hook: F) -> Store
where
    F: Fn(&dyn Backend, &str) -> Result<Option<Stored>, BackendError> + Send + Sync + 'static,
{
    {
        let store = durable(dir, Limits::default(), 0);
        for id in ids {
            let (h, _) = store.open(info(id)).await.expect("open");
            feed(&h, turn(0, 1, 100)).await;
        }
        store.close().await;
    }
    let sqlite = Sqlite::open(dir, Durability::Sync, None, 0).expect("open");
    store_over(Arc::new(OnLoad {
        inner: Arc::new(sqlite),
        hook,
    }))
}

/// Loads in all, running now, and the most that ran at once.
#[derive(Default)]
pub(super) struct Counts {
    pub(super) total: AtomicUsize,
    now: AtomicUsize,
    pub(super) most: AtomicUsize,
}

impl Counts {
    /// A load hook taking `each` per load, counted here.
    pub(super) fn hook(
        self: &Arc<Self>,
        each: Duration,
    ) -> impl Fn(&dyn Backend, &str) -> Result<Option<Stored>, BackendError>
    + Send
    + Sync
    + 'static
    + use<> {
        let c = self.clone();
        move |inner: &dyn Backend, id: &str| {
            c.total.fetch_add(1, SeqCst);
            let running = c.now.fetch_add(1, SeqCst) + 1;
            c.most.fetch_max(running, SeqCst);
            std::thread::sleep(each);
            let stored = inner.load(id);
            c.now.fetch_sub(1, SeqCst);
            stored
        }
    }
}

/// Every host reconnecting after a restart asks for its cold session at once: at most
/// MAX_CONCURRENT_LOADS are read and decoded side by side (each outside the budget until
/// admitted), the others wait their turn and load after. Found in review: all of them
/// loaded at once (ten 50 MB sessions, about 1 GB, past the pod's memory limit: a crash
/// loop, as every host reconnects again).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cold_sessions_asked_for_at_once_load_a_few_at_a_time() {
    let d = tempfile::tempdir().expect("dir");
    let ids: Vec<String> = (0..8).map(|i| format!("s{i}")).collect();
    let counts = Arc::new(Counts::default());
    let store =
        stored_then_read_through(d.path(), &ids, counts.hook(Duration::from_millis(40))).await;
    let store = Arc::new(store);
    let gets: Vec<_> = ids
        .iter()
        .map(|id| {
            let (store, id) = (store.clone(), id.clone());
            tokio::spawn(async move { store.get(&id).await.map(drop) })
        })
        .collect();
    for g in gets {
        g.await.expect("joined").expect("loaded");
    }
    assert_eq!(store.hot_len(), ids.len(), "every session loaded");
    let most = counts.most.load(SeqCst);
    assert!(
        (1..=MAX_CONCURRENT_LOADS).contains(&most),
        "{most} loads at once"
    );
}

/// A stored session whose reading back panics is a bug (INTERNAL to the client), not the
/// disk unavailable: a retry would panic again. Found in review: the panic was reported
/// as an I/O error (UNAVAILABLE), which tells the client to retry. (Not DATA_LOSS either:
/// a host might replace a session a fixed build reads.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_whose_loading_panics_is_an_internal_error() {
    let d = tempfile::tempdir().expect("dir");
    let store = stored_then_read_through(d.path(), &["x".to_string()], |_, _| {
        panic!("injected: a row the decoder chokes on")
    })
    .await;
    match store.get("x").await.map(drop) {
        Err(StoreError::LoadPanicked(id)) => assert_eq!(id, "x"),
        other => panic!("expected LoadPanicked, got {other:?}"),
    }
}

/// A caller that gives up on a load (a client's deadline) while the disk is read does not
/// free its turn for another load beside the one still decoding. Found in review of the
/// limit above: the turn belonged to the caller, so retries after deadlines decoded more
/// sessions at once than the limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_load_whose_caller_gave_up_keeps_its_turn_until_it_ends() {
    let d = tempfile::tempdir().expect("dir");
    let ids: Vec<String> = (0..4).map(|i| format!("s{i}")).collect();
    let counts = Arc::new(Counts::default());
    let store =
        stored_then_read_through(d.path(), &ids, counts.hook(Duration::from_millis(300))).await;
    let store = Arc::new(store);
    let get = |id: &str| {
        let (store, id) = (store.clone(), id.to_string());
        tokio::spawn(async move { store.get(&id).await.map(drop) })
    };
    let (a, b) = (get(&ids[0]), get(&ids[1]));
    while counts.now.load(SeqCst) < 2 {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    a.abort();
    b.abort();
    let (c, e) = (get(&ids[2]), get(&ids[3]));
    c.await.expect("joined").expect("loaded");
    e.await.expect("joined").expect("loaded");
    let most = counts.most.load(SeqCst);
    assert!(most <= MAX_CONCURRENT_LOADS, "{most} loads at once");
}

/// A load that read the session, then saw its id deleted, created again and sent cold
/// before it was admitted, does not install the copy it read (the deleted incarnation):
/// it reads the id again. Before, the deleted session was served, and an update
/// acknowledged on it under `sync` was written to no row (lost at the restart).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_load_overtaken_by_a_delete_and_re_creation_serves_the_new_session() {
    let dir = tempfile::tempdir().expect("dir");
    let ids = ["x".to_string()];
    // The first read (of the first incarnation) waits until `release` opens.
    let release = Arc::new(Gate::default());
    let reads = Arc::new(AtomicUsize::new(0));
    let (gate, count) = (release.clone(), reads.clone());
    let store = stored_then_read_through(dir.path(), &ids, move |inner, id| {
        let stored = inner.load(id);
        if count.fetch_add(1, SeqCst) == 0 {
            gate.wait();
        }
        stored
    })
    .await;
    let store = Arc::new(store);
    let loader = get_x_once_read(&store, &reads).await;
    // The first incarnation is read; now the id is deleted, created again and sent cold.
    assert!(store.remove("x").await.expect("deleted"));
    let new_session = created_again_and_sent_cold(&store).await;
    release.open();
    let served = loader.await.expect("joined").expect("loaded");
    assert_eq!(
        observed(&served).await,
        new_session,
        "the session the id names now"
    );
    assert_eq!(reads.load(SeqCst), 2, "read again");
    // An update acknowledged on it is on disk.
    feed(&served, turn(9, 1, 100)).await;
    let acked = observed(&served).await;
    store.close().await;
    drop(served);
    drop(store);
    let store = durable(dir.path(), Limits::default(), 0);
    let h = store.get("x").await.expect("loaded from disk");
    assert_eq!(
        observed(&h).await,
        acked,
        "acknowledged under sync, so on disk"
    );
    store.close().await;
}

/// Waits until `count` is past 0.
async fn until_counted(count: &AtomicUsize) {
    while count.load(SeqCst) == 0 {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// `store.get("x")` on a task of its own, returned once its read is counted in `reads`.
async fn get_x_once_read(
    store: &Arc<Store>,
    reads: &AtomicUsize,
) -> tokio::task::JoinHandle<Result<SessionHandle, StoreError>> {
    let loader = {
        let store = store.clone();
        tokio::spawn(async move { store.get("x").await })
    };
    until_counted(reads).await;
    loader
}

/// Creates session "x" again (a turn in it), sends it cold, and returns what it holds.
async fn created_again_and_sent_cold(store: &Store) -> String {
    let (again, created) = store.open(info("x")).await.expect("created again");
    assert!(created);
    feed(&again, turn(5, 1, 100)).await;
    let held = observed(&again).await;
    assert!(again.evict().await, "sent cold");
    held
}

/// A gate a backend's load waits at until the test opens it.
#[derive(Default)]
struct Gate(Mutex<bool>, Condvar);

impl Gate {
    fn wait(&self) {
        let mut open = self.0.lock().unwrap_or_else(|e| e.into_inner());
        while !*open {
            open = self.1.wait(open).unwrap_or_else(|e| e.into_inner());
        }
    }

    fn open(&self) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = true;
        self.1.notify_all();
    }
}

/// A load whose read found the session deleted, with the id created again and sent cold
/// before the load ended, leaves the new session reachable. Before, the load took the id
/// out of the cold sessions: the new session was out of reach until a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_load_that_found_nothing_leaves_a_re_created_session_reachable() {
    let dir = tempfile::tempdir().expect("dir");
    let ids = ["x".to_string()];
    let (before_read, after_read) = (Arc::new(Gate::default()), Arc::new(Gate::default()));
    let (entered, read) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let store = {
        let (before, after) = (before_read.clone(), after_read.clone());
        let (entered, read) = (entered.clone(), read.clone());
        stored_then_read_through(dir.path(), &ids, move |inner, id| {
            let first = entered.fetch_add(1, SeqCst) == 0;
            if first {
                before.wait();
            }
            let stored = inner.load(id);
            if first {
                read.store(1, SeqCst);
                after.wait();
            }
            stored
        })
        .await
    };
    let store = Arc::new(store);
    let loader = get_x_once_read(&store, &entered).await;
    // Deleted before the read: it finds nothing.
    assert!(store.remove("x").await.expect("deleted"));
    before_read.open();
    until_counted(&read).await;
    // Created again and sent cold before the load ends.
    let new_session = created_again_and_sent_cold(&store).await;
    after_read.open();
    let served = loader.await.expect("joined").expect("the new session");
    assert_eq!(observed(&served).await, new_session);
    drop(served);
    let h = store.get("x").await.expect("still reachable");
    assert_eq!(observed(&h).await, new_session);
    store.close().await;
}

/// Sessions read from disk while the budget is full wait for room counted as held, so
/// the loads waiting beside them see them. Before, a load gave its turn back once read
/// and waited for room with its session decoded but counted nowhere: loads of many cold
/// sessions at once (a fleet's hosts reconnecting) held them all outside the budget
/// while the evictor worked, and each was admitted against the same figure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_read_while_the_budget_is_full_wait_counted() {
    use super::durable_tests::Faulty;
    let dir = tempfile::tempdir().expect("dir");
    let faulty = Arc::new(Faulty::sync(dir.path(), None));
    let budget: u64 = 16 << 20;
    let store = Arc::new(
        Store::new(EngineConfig::default())
            .with_limits(Limits {
                memory_budget: budget,
                ..Limits::default()
            })
            .with_backend(faulty.clone())
            .expect("listed"),
    );
    let mut hot = Vec::new();
    let mut cold = Vec::new();
    for i in 0..6 {
        let (h, _) = store.open(info(&format!("s{i}"))).await.expect("open");
        feed(&h, turn(0, 4, 100_000)).await;
        h.flush().await.expect("written");
        if i < 4 {
            assert!(h.evict().await, "s{i} went cold");
            cold.push(format!("s{i}"));
        } else {
            hot.push(h);
        }
    }
    // The disk now refuses (slowly) what the hot sessions would write to go cold, and
    // the budget has no room for one more session.
    faulty.fail_after_ms.store(500, SeqCst);
    faulty.fail_all.store(true, SeqCst);
    let full = budget.saturating_sub(store.ledger().counted());
    let _taken = store.ledger().count(full, "test");
    let base = store.ledger().held();
    let loads: Vec<_> = cold
        .iter()
        .map(|id| {
            let (store, id) = (store.clone(), id.clone());
            tokio::spawn(async move { store.get(&id).await.map(drop) })
        })
        .collect();
    // Each session holds over 400 KB: two read and waiting are over 800 KB.
    let mut most = 0;
    for _ in 0..1_000 {
        most = most.max(store.ledger().held().saturating_sub(base));
        if most > 800_000 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert!(
        most > 800_000,
        "sessions waiting for room are counted: {most}"
    );
    for l in loads {
        let _ = l.await.expect("joined");
    }
    faulty.fail_all.store(false, SeqCst);
    drop(hot);
    store.close().await;
}
