//! Under `Durability::Sync`, a session's first write (its `Create`) failing: nothing is
//! acknowledged on a session that was never written, and a failed replacement changes
//! nothing. And the last incarnation a store may hand out.

use std::sync::atomic::Ordering::SeqCst;
use std::time::Duration;

use super::durable_tests::{Faulty, NOW, durable, feed, info, observed, store_over, turn};
use super::*;

fn store(backend: Faulty) -> Store {
    store_over(Arc::new(backend))
}

/// Opens session "s" with one turn written; returns what it holds.
async fn session_s(store: &Store) -> String {
    let (h, _) = store.open(info("s")).await.expect("open");
    feed(&h, turn(0, 1, 100)).await;
    observed(&h).await
}

/// Waits (10 s at most) until `done` holds.
async fn until(what: &str, done: impl Fn() -> bool) {
    let waited = tokio::time::timeout(Duration::from_secs(10), async {
        while !done() {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    })
    .await;
    assert!(waited.is_ok(), "{what} in time");
}

/// A second opener of a new id finds the session while its `Create` is being written:
/// its update waits for that write, and when it fails, the update fails too (before, it
/// was acknowledged and landed nowhere: the session had no row).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_sync_no_update_is_acknowledged_before_its_session_is_written() {
    let d = tempfile::tempdir().expect("dir");
    let store = Arc::new(store(Faulty::sync(
        d.path(),
        Some(Duration::from_millis(1_000)),
    )));
    let first = tokio::spawn({
        let store = store.clone();
        async move { store.open(info("s")).await.map(|(_, created)| created) }
    });
    until("the session is in the map", || store.hot_len() == 1).await;
    let (h, created) = store.open(info("s")).await.expect("found");
    assert!(!created, "the first opener created it");
    let Some(update) = turn(0, 1, 100).into_iter().next() else {
        panic!("a turn has updates");
    };
    let answered = h.call(move |s, _| s.step(update, NOW)).await;
    assert!(
        answered.is_err(),
        "an update on a session never written was acknowledged: {answered:?}"
    );
    match first.await.expect("the first opener ran") {
        Err(StoreError::Storage(BackendError::Full(_))) => {}
        other => panic!("expected the first opener to see the full disk, got {other:?}"),
    }
    assert!(matches!(store.get("s").await, Err(StoreError::NotFound(_))));
    // A fresh attempt creates it, and what it acknowledges is on disk.
    let (h, created) = store.open(info("s")).await.expect("opened again");
    assert!(created);
    feed(&h, turn(0, 1, 100)).await;
    let after = observed(&h).await;
    store.close().await;
    let store = durable(d.path(), Limits::default(), 0);
    let h = store.get("s").await.expect("on disk");
    assert_eq!(observed(&h).await, after);
}

/// An import replacing a session (in memory, or only on disk) whose `Create` fails
/// changes nothing: the old session is still reachable, as it was, and still written
/// (before, it was NOT_FOUND until a restart).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_sync_a_failed_replacement_leaves_the_old_session_as_it_was() {
    let d = tempfile::tempdir().expect("dir");
    {
        let store = durable(d.path(), Limits::default(), 0);
        for id in ["hot", "cold"] {
            let (h, _) = store.open(info(id)).await.expect("open");
            feed(&h, turn(0, 2, 1_000)).await;
        }
        store.close().await;
    }
    let backend = Faulty::sync(d.path(), Some(Duration::from_millis(100)));
    backend.creates_to_fail.store(2, SeqCst);
    let store = store(backend);
    let old = store.get("hot").await.expect("loaded");
    let before = observed(&old).await;
    for id in ["hot", "cold"] {
        let replacement = Session::new(info(id), &EngineConfig::default());
        match store.insert(replacement, true).await {
            Err(StoreError::Storage(BackendError::Full(_))) => {}
            other => panic!("expected {id}'s import to fail on the full disk, got {other:?}"),
        }
    }
    let h = store
        .get("hot")
        .await
        .expect("the old session is reachable");
    assert!(h.same(&old), "the same actor as before the import");
    assert_eq!(observed(&h).await, before);
    assert_eq!(store.cold_ids(), vec!["cold".to_string()], "still on disk");
    // Both go on being written where they were.
    feed(&h, turn(1, 1, 100)).await;
    let hot = observed(&h).await;
    let c = store.get("cold").await.expect("loads from disk");
    feed(&c, turn(1, 1, 100)).await;
    let cold = observed(&c).await;
    store.close().await;
    let store = durable(d.path(), Limits::default(), 0);
    let h = store.get("hot").await.expect("on disk");
    assert_eq!(observed(&h).await, hot);
    let c = store.get("cold").await.expect("on disk");
    assert_eq!(observed(&c).await, cold);
}

/// A store whose last incarnation is the largest a backend stores refuses to create a
/// session, naming why (before, the next one was clamped to the same incarnation as the
/// stored session, whose late writes would then land in the new one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_incarnation_past_the_largest_is_handed_out() {
    let d = tempfile::tempdir().expect("dir");
    {
        let store = durable(d.path(), Limits::default(), 0);
        store.open(info("old")).await.expect("open");
        store.close().await;
    }
    rusqlite::Connection::open(d.path().join(DB_FILE))
        .expect("open")
        .execute_batch("UPDATE sessions SET incarnation = 9223372036854775807")
        .expect("the largest incarnation");
    let store = durable(d.path(), Limits::default(), 0);
    match store.open(info("new")).await {
        Err(StoreError::Storage(BackendError::Io(why))) => {
            assert!(why.contains("no incarnation left"), "{why}");
        }
        other => panic!("expected no incarnation left, got {other:?}"),
    }
    let replacement = Session::new(info("old"), &EngineConfig::default());
    assert!(store.insert(replacement, true).await.is_err());
    store
        .get("old")
        .await
        .expect("the stored session is served");
}

/// A delete the disk refuses: the session is still there, in memory and after a restart
/// alike (before, it was gone from memory, NOT_FOUND to a retried delete, and came back
/// from disk after a restart).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_sync_a_refused_delete_leaves_the_session_as_it_was() {
    let d = tempfile::tempdir().expect("dir");
    let backend = Arc::new(Faulty::sync(d.path(), None));
    let store = store_over(backend.clone());
    let held = session_s(&store).await;
    backend.fail_all.store(true, SeqCst);
    match store.remove("s").await {
        Err(StoreError::Storage(BackendError::Full(_))) => {}
        other => panic!("expected the delete to fail on the full disk, got {other:?}"),
    }
    let h = store.get("s").await.expect("still held");
    assert_eq!(observed(&h).await, held);
    drop(h);
    // The disk has room again: the delete goes through.
    backend.fail_all.store(false, SeqCst);
    assert!(
        store.remove("s").await.expect("deleted"),
        "it was there to delete"
    );
    assert!(matches!(store.get("s").await, Err(StoreError::NotFound(_))));
    store.close().await;
    let store = durable(d.path(), Limits::default(), 0);
    assert!(
        matches!(store.get("s").await, Err(StoreError::NotFound(_))),
        "deleted on disk"
    );
}

/// The caller of a delete the disk refuses goes away before the refusal arrives (a
/// client's deadline, a dropped connection: tonic drops the handler's future). Before,
/// nothing put the session back: it was gone from memory (NOT_FOUND) and came back after
/// a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_delete_whose_caller_went_away_leaves_the_session_as_it_was() {
    let d = tempfile::tempdir().expect("dir");
    let backend = Arc::new(Faulty::sync(d.path(), None));
    let store = store_over(backend.clone());
    let held = session_s(&store).await;
    // The refusal comes long after the caller gives up, however late the runtime runs
    // it: with 200 ms, a worker stalled 180 ms past the caller's deadline found both
    // ready and the delete answered first.
    backend.fail_after_ms.store(1_000, SeqCst);
    backend.fail_all.store(true, SeqCst);
    let gone = tokio::time::timeout(Duration::from_millis(20), store.remove("s")).await;
    assert!(gone.is_err(), "the caller gave up first");
    until("the refusal arrived and was undone", || {
        store.hot_len() == 1
    })
    .await;
    backend.fail_all.store(false, SeqCst);
    let h = store.get("s").await.expect("still held");
    assert_eq!(observed(&h).await, held);
}

/// A new session's first write and its delete both refused: its actor ends while the
/// delete is out, and the refused delete puts back what it took. Before, that was the
/// ended actor: every call on the id failed NOT_FOUND, and a new session could not be
/// created under it ("exists") until a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_delete_does_not_put_back_a_session_whose_actor_ended() {
    let d = tempfile::tempdir().expect("dir");
    // The delete must go out before the `Create` fails (1 s after it went out), and be
    // refused after (2 s after it went out). With 50 ms for the first, a loaded machine
    // let the `Create` fail before the delete: the session was gone, nothing to refuse.
    let backend = Arc::new(Faulty::sync(d.path(), Some(Duration::from_secs(1))));
    let store = Arc::new(store_over(backend.clone()));
    let opening = tokio::spawn({
        let store = store.clone();
        async move { store.open(info("s")).await.map(drop) }
    });
    until("the new session is in the map", || store.hot_len() == 1).await;
    backend.fail_after_ms.store(2_000, SeqCst);
    backend.fail_all.store(true, SeqCst);
    assert!(store.remove("s").await.is_err(), "the delete was refused");
    assert!(
        opening.await.expect("joined").is_err(),
        "its create was refused"
    );
    backend.fail_all.store(false, SeqCst);
    let (h, created) = store.open(info("s")).await.expect("the id is usable");
    assert!(created, "nothing was written under it");
    feed(&h, turn(0, 1, 100)).await;
}

/// A delete and a new session under the same id, both refused by the disk: the session
/// the delete took out comes back (the disk still holds it). Before, the refused delete
/// found the id taken by the new session (its write still in flight) and put nothing
/// back; then the new session was refused too and left: the stored session was out of
/// reach (NOT_FOUND) though the client was told the delete failed, and the next open
/// would have written an empty session over it (20 of 20 runs in the review).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_refused_delete_racing_a_refused_create_keeps_the_session() {
    for _ in 0..5 {
        let dir = tempfile::tempdir().expect("dir");
        let faulty = Arc::new(Faulty::sync(dir.path(), None));
        let store = Arc::new(store_over(faulty.clone()));
        let kept = session_s(&store).await;
        // Every write fails, 500 ms after it was asked for: the new session is placed
        // before the delete is refused.
        faulty.fail_after_ms.store(500, SeqCst);
        faulty.fail_all.store(true, SeqCst);
        let delete = {
            let store = store.clone();
            tokio::spawn(async move { store.remove("s").await })
        };
        until("the delete took the session out", || {
            store.hot("s").is_none()
        })
        .await;
        assert!(
            store.open(info("s")).await.is_err(),
            "the create is refused"
        );
        assert!(
            delete.await.expect("joined").is_err(),
            "the delete is refused"
        );
        assert!(store.holds("s"), "the session is still there");
        faulty.fail_all.store(false, SeqCst);
        let h = store.get("s").await.expect("reachable");
        assert_eq!(observed(&h).await, kept);
        store.close().await;
    }
}
