//! A job that panics on the session's actor: the session is not left dead in the map. A
//! durable one is rebuilt from the disk and the changes acknowledged before the panic,
//! and goes on; one in memory is dropped, and its id opens afresh.

use std::sync::Arc;
use std::time::Duration;

use super::durable_tests::{durable, feed, info, observed, turn};
use super::*;
use crate::engine::Update;
use crate::store::sqlite::Sqlite;

/// A job that changes the session, then panics, as a bug in the engine would.
async fn panic_in(h: &SessionHandle) {
    let r = h
        .call(|s, _| -> () {
            let ghost = crate::domain::MessageInfo::new("ghost", crate::domain::Role::User);
            s.step(Update::UpsertMessage(ghost), 0).expect("applied");
            panic!("a bug in a job")
        })
        .await;
    assert!(r.is_err(), "the panicking job answers an error");
}

/// The session's generation (a compaction commits only on the one it was planned on).
async fn generation(h: &SessionHandle) -> crate::engine::Generation {
    h.call(|s, _| s.generation()).await.expect("served")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_durable_session_whose_job_panics_comes_back_as_it_was_and_goes_on() {
    let dir = tempfile::tempdir().expect("dir");
    let store = durable(dir.path(), Limits::default(), 0);
    let (h, _) = store.open(info("s")).await.expect("open");
    feed(&h, turn(0, 3, 2_000)).await;
    let before = observed(&h).await;
    let planned_on = generation(&h).await;
    panic_in(&h).await;
    let (again, created) = store.open(info("s")).await.expect("reachable");
    assert!(!created, "the session is still there");
    assert_eq!(
        observed(&again).await,
        before,
        "without the panicking job's change"
    );
    assert_eq!(generation(&again).await, planned_on, "the same value");
    feed(&again, turn(1, 1, 500)).await;
    assert_ne!(observed(&again).await, before, "and takes updates");
    store.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_interval_changes_acknowledged_before_a_panic_are_kept() {
    let dir = tempfile::tempdir().expect("dir");
    let backend = Sqlite::open(
        dir.path(),
        Durability::Interval(Duration::from_millis(300)),
        None,
        0,
    )
    .expect("open");
    let store = Store::new(EngineConfig::default())
        .with_backend(Arc::new(backend))
        .expect("listed");
    let (h, _) = store.open(info("s")).await.expect("open");
    // Acknowledged at once: most wait in memory for the batch in flight when the job
    // panics.
    feed(&h, turn(0, 4, 1_000)).await;
    let before = observed(&h).await;
    panic_in(&h).await;
    let (again, created) = store.open(info("s")).await.expect("reachable");
    assert!(!created);
    assert_eq!(observed(&again).await, before);
    // What the next batch writes is the rebuilt session's: its next change logs on.
    feed(&again, turn(1, 1, 300)).await;
    let after = observed(&again).await;
    store.close().await;
    // And what was acknowledged reached the disk.
    let reopened = durable(dir.path(), Limits::default(), 0);
    let h = reopened.get("s").await.expect("on disk");
    assert_eq!(observed(&h).await, after);
    reopened.close().await;
}

#[tokio::test]
async fn a_session_in_memory_whose_job_panics_on_its_actor_opens_afresh() {
    let store = Store::new(EngineConfig::default()).with_limits(Limits {
        max_sessions: 1,
        ..Limits::default()
    });
    let (h, _) = store.open(info("s")).await.expect("open");
    h.call(|s, _| {
        s.step(
            Update::UpsertMessage(crate::domain::MessageInfo::new(
                "u",
                crate::domain::Role::User,
            )),
            0,
        )
    })
    .await
    .expect("served")
    .expect("applied");
    panic_in(&h).await;
    let (again, created) = store.open(info("s")).await.expect("the id opens");
    assert!(created, "a new session: memory held the only copy");
    let messages = again.call(|s, _| s.messages().len()).await.expect("served");
    assert_eq!(messages, 0);
}
