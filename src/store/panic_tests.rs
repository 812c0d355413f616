//! A job that panics on the session's actor: the session is not left dead in the map. A
//! durable one is rebuilt from the disk and the changes acknowledged before the panic,
//! and goes on; one in memory is dropped, and its id opens afresh.

use std::sync::Arc;
use std::time::Duration;

use super::durable_tests::{
    commit_planned, durable, feed, info, observed, planned_after_two_turns, turn,
};
use super::tests::{factors, of_model, taught};
use super::*;
use crate::engine::Update;
use crate::engine::calibration::Factors;
use crate::store::sqlite::Sqlite;

/// A job that changes the session, then panics, as a bug in the engine would.
pub(super) async fn panic_in(h: &SessionHandle) {
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

/// Session `id` as [`info`] has it, of the model [`taught`] taught the store.
fn of_taught_model(id: &str) -> crate::domain::SessionInfo {
    crate::domain::SessionInfo {
        model: of_model(id, "claude-sonnet-4-5").model,
        ..info(id)
    }
}

/// Session "b", opened with no model and then told the model [`taught`] taught the store
/// (as the OpenCode plugin does once it learns it): it starts from that model's prior.
async fn told_its_model_after_opening(store: &Store) -> (SessionHandle, Factors) {
    let (_taught, learned) = taught(store).await;
    let (b, _) = store.open(info("b")).await.expect("open");
    let told = Update::Configure(of_taught_model("b"));
    b.call(move |tx, _| tx.step(told, 0).map(|_| ()))
        .await
        .expect("served")
        .expect("configured");
    assert_eq!(factors(&b).await, learned, "live: the model's prior");
    (b, learned)
}

/// The prior a session was given when a `Configure` named its model is part of what
/// the disk holds of it. Found in review: the store set it outside the log, so a session
/// rebuilt after a panicking job replayed the `Configure` and went back to NEUTRAL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_rebuilt_after_a_panic_keeps_the_prior_its_model_gave_it() {
    let dir = tempfile::tempdir().expect("dir");
    let store = durable(dir.path(), Limits::default(), 0);
    let (b, learned) = told_its_model_after_opening(&store).await;
    panic_in(&b).await;
    let (again, created) = store.open(info("b")).await.expect("reachable");
    assert!(!created);
    assert_eq!(factors(&again).await, learned, "rebuilt as it was");
    store.close().await;
}

/// The same across a restart: the reopened store has learned nothing of the model, and
/// the session still predicts with the prior it was given.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_loaded_after_a_restart_keeps_the_prior_its_model_gave_it() {
    let dir = tempfile::tempdir().expect("dir");
    let store = durable(dir.path(), Limits::default(), 0);
    let (_b, learned) = told_its_model_after_opening(&store).await;
    store.close().await;
    let reopened = durable(dir.path(), Limits::default(), 0);
    let h = reopened.get("b").await.expect("on disk");
    assert_eq!(factors(&h).await, learned);
    reopened.close().await;
}

/// An imported session of a model starts from its prior, as one opened does, and keeps
/// it across a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_imported_session_starts_from_its_models_prior() {
    let dir = tempfile::tempdir().expect("dir");
    let store = durable(dir.path(), Limits::default(), 0);
    let (_taught, learned) = taught(&store).await;
    let config = EngineConfig::default();
    let mut imported = Session::new(of_taught_model("i"), &config);
    for u in turn(0, 2, 1_000) {
        imported.apply(u, &config).expect("applied");
    }
    let h = store.insert(imported, false).await.expect("imported");
    assert_eq!(factors(&h).await, learned);
    store.close().await;
    let reopened = durable(dir.path(), Limits::default(), 0);
    let h = reopened.get("i").await.expect("on disk");
    assert_eq!(factors(&h).await, learned);
    reopened.close().await;
}

/// A compaction planned on a durable session, then `meanwhile` on it, then a job that
/// panics (the actor rebuilds the session from the disk): what its commit answers.
async fn committed_after_a_panic(
    meanwhile: Option<Update>,
) -> Result<crate::engine::Committed, crate::engine::CompactionError> {
    let dir = tempfile::tempdir().expect("dir");
    let store = durable(dir.path(), Limits::default(), 0);
    let (h, _) = store.open(info("s")).await.expect("open");
    let plan = planned_after_two_turns(&h).await;
    if let Some(u) = meanwhile {
        feed(&h, vec![u]).await;
    }
    panic_in(&h).await;
    let (h, created) = store.open(info("s")).await.expect("reachable");
    assert!(!created);
    let r = commit_planned(&h, plan).await;
    store.close().await;
    r
}

/// A summarized message the host changed while the summary was written, then a job that
/// panicked: the rebuilt session still knows the change, and the commit is stale. Found
/// in review: the rebuild gave every message a new, unknown edit, and the commit hid it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_summarized_message_changed_before_a_panic_makes_the_commit_stale() {
    let deleted = Update::DeletePart {
        message_id: "a0".into(),
        part_id: "a0-0".into(),
    };
    let r = committed_after_a_panic(Some(deleted)).await;
    assert!(
        matches!(r, Err(crate::engine::CompactionError::Stale(_))),
        "{r:?}"
    );
    committed_after_a_panic(None)
        .await
        .expect("rebuilt as it was: the summary commits");
}
