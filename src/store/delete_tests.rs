//! Under `Durability::Interval` a delete is acknowledged before it is written. When that
//! write fails (a full disk), the session must not come back: the delete is written
//! again until it lands, and once more when the store closes; a session created under
//! the id meanwhile is never deleted by it.

use std::sync::atomic::Ordering::SeqCst;
use std::time::Duration;

use super::durable_tests::{Faulty, durable, feed, info, observed, store_over, turn};
use super::*;

/// A store under `interval` over `backend`, with session "s" written to disk.
async fn with_session(backend: &Arc<Faulty>) -> Store {
    let store = store_over(backend.clone());
    let (h, _) = store.open(info("s")).await.expect("open");
    feed(&h, turn(0, 1, 100)).await;
    h.flush().await.expect("written");
    assert!(backend.load("s").expect("readable").is_some(), "on disk");
    store
}

/// Deletes "s" while the disk refuses every write, and waits until that write was tried.
async fn delete_on_a_full_disk(store: &Store, backend: &Faulty) {
    backend.fail_all.store(true, SeqCst);
    let tried = backend.writes();
    assert!(
        store.remove("s").await.expect("acknowledged"),
        "it was there"
    );
    let waited = tokio::time::timeout(Duration::from_secs(10), async {
        while backend.writes() == tried {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    })
    .await;
    assert!(waited.is_ok(), "the delete was tried");
    assert!(matches!(store.get("s").await, Err(StoreError::NotFound(_))));
}

/// The disk has room again a moment later: the delete lands without anyone asking again.
/// Before, it was never written again, and the session came back after a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_the_disk_refused_is_written_again_when_it_has_room() {
    let d = tempfile::tempdir().expect("dir");
    let backend = Arc::new(Faulty::open(d.path(), None));
    let store = with_session(&backend).await;
    delete_on_a_full_disk(&store, &backend).await;
    backend.fail_all.store(false, SeqCst);
    let landed = tokio::time::timeout(Duration::from_secs(10), async {
        while backend.load("s").ok().flatten().is_some() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    assert!(landed.is_ok(), "the delete reached the disk");
    store.close().await;
    let store = durable(d.path(), Limits::default(), 0);
    assert!(matches!(store.get("s").await, Err(StoreError::NotFound(_))));
}

/// The store closes (a clean shutdown) before the next try: the close writes the delete.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clean_shutdown_writes_a_delete_the_disk_refused() {
    let d = tempfile::tempdir().expect("dir");
    let backend = Arc::new(Faulty::open(d.path(), None));
    let store = with_session(&backend).await;
    delete_on_a_full_disk(&store, &backend).await;
    backend.fail_all.store(false, SeqCst);
    store.close().await;
    drop(store);
    let store = durable(d.path(), Limits::default(), 0);
    assert!(
        matches!(store.get("s").await, Err(StoreError::NotFound(_))),
        "the deleted session stays deleted after a restart"
    );
}

/// A session created under the id after the refused delete is not deleted by its retry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_delete_spares_a_session_created_under_the_id_since() {
    let d = tempfile::tempdir().expect("dir");
    let backend = Arc::new(Faulty::open(d.path(), None));
    let store = with_session(&backend).await;
    delete_on_a_full_disk(&store, &backend).await;
    backend.fail_all.store(false, SeqCst);
    let (h, created) = store.open(info("s")).await.expect("created again");
    assert!(created);
    feed(&h, turn(7, 1, 200)).await;
    h.flush().await.expect("written");
    let after = observed(&h).await;
    drop(h);
    // Past the first retry's wait.
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert!(
        backend.load("s").expect("readable").is_some(),
        "still on disk"
    );
    store.close().await;
    drop(store);
    let store = durable(d.path(), Limits::default(), 0);
    let h = store.get("s").await.expect("the new session is on disk");
    assert_eq!(observed(&h).await, after);
}
