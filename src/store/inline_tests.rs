//! Jobs run inline (`SessionHandle::try_run`): only when the session's order holds and
//! nothing needs its actor, counted as use by idle eviction, accounted as the actor's
//! jobs are, and a panicking one takes down its session only.

use std::time::Duration;

use tokio::sync::mpsc::error::TryRecvError;

use super::durable_tests::durable;
use super::*;
use crate::domain::{MessageInfo, Role, SessionInfo};
use crate::engine::Update;

fn info(id: &str) -> SessionInfo {
    SessionInfo {
        id: id.into(),
        ..SessionInfo::default()
    }
}

/// A job that appends a user message `id` to the session.
fn add(id: &'static str) -> impl FnOnce(&mut Tx<'_>, &EngineConfig) + Send + 'static {
    move |tx, _| {
        tx.step(Update::UpsertMessage(MessageInfo::new(id, Role::User)), 0)
            .expect("message");
    }
}

/// Runs `job` inline, which must be possible (`why`).
fn ran<R>(
    handle: &SessionHandle,
    job: impl FnOnce(&mut Tx<'_>, &EngineConfig) -> R,
    why: &str,
) -> R {
    match handle.try_run(job) {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => panic!("{e}: {why}"),
        Err(_) => panic!("handed back, expected to run inline: {why}"),
    }
}

/// The session's message ids, in order.
async fn ids(handle: &SessionHandle) -> Vec<String> {
    handle
        .call(|tx, _| tx.messages().iter().map(|m| m.info.id.clone()).collect())
        .await
        .expect("served")
}

/// On one thread the actor cannot run a queued job before this test yields, so the
/// job is still queued when `try_run` looks: it must queue behind it, not overtake it.
#[tokio::test(flavor = "current_thread")]
async fn a_job_runs_inline_only_when_no_job_is_queued_before_it() {
    let store = Store::new(EngineConfig::default());
    let (handle, _) = store.open(info("s")).await.expect("open");
    let first = handle.submit(add("m1")).await.expect("queued");
    let second = handle.try_run(add("m2"));
    assert!(second.is_err(), "a job is queued: this one is handed back");
    first.await.expect("ran").expect("durable");
    ran(&handle, add("m3"), "nothing queued: run inline");
    assert_eq!(ids(&handle).await, ["m1", "m3"]);
    ran(&handle, add("m4"), "inline again");
    assert_eq!(ids(&handle).await, ["m1", "m3", "m4"]);
}

/// While the actor runs a job, a job offered inline is handed back (it would otherwise
/// run beside it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_is_not_run_inline_while_the_actor_runs_one() {
    let store = Store::new(EngineConfig::default());
    let (handle, _) = store.open(info("s")).await.expect("open");
    let (started_tx, started_rx) = std::sync::mpsc::channel();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let running = handle
        .submit(move |tx, c| {
            started_tx.send(()).expect("told");
            go_rx.recv().expect("released");
            add("m1")(tx, c);
        })
        .await
        .expect("queued");
    started_rx.recv().expect("the actor runs it");
    assert!(
        handle.try_run(add("m2")).is_err(),
        "the actor holds the session"
    );
    go_tx.send(()).expect("release");
    running.await.expect("ran").expect("durable");
    ran(&handle, add("m3"), "inline");
    assert_eq!(ids(&handle).await, ["m1", "m3"]);
}

/// A session used only by inline jobs is not idle: it stays while used, and goes one TTL
/// after its last use; a handle taken before cannot run a job on it after. On tokio's
/// paused clock (the store's clock and the actor's timers are tokio's): in real time a
/// loaded machine stretched a 40 ms step past the TTL.
#[tokio::test(start_paused = true)]
async fn inline_jobs_keep_the_session_and_it_leaves_a_ttl_after_the_last() {
    const TTL: Duration = Duration::from_millis(200);
    let store = Store::new(EngineConfig::default());
    let mut evictions = store.evict_idle_after(TTL);
    let (handle, _) = store.open(info("s")).await.expect("open");
    let mut last = tokio::time::Instant::now();
    for _ in 0..10 {
        ran(&handle, |_, _| (), "inline");
        last = tokio::time::Instant::now();
        tokio::time::sleep(Duration::from_millis(40)).await;
    }
    assert_eq!(evictions.try_recv(), Err(TryRecvError::Empty), "used: kept");
    let evicted = tokio::time::timeout(Duration::from_secs(5), evictions.recv())
        .await
        .expect("an eviction in time")
        .expect("the store is alive");
    assert!(last.elapsed() >= TTL, "{evicted:?}");
    assert!(evicted.idle >= TTL, "{evicted:?}");
    assert!(handle.try_run(|_, _| ()).is_err(), "gone: handed back");
    assert_eq!(
        handle.call(|_, _| ()).await,
        Err(StoreError::NotFound("s".into()))
    );
}

/// An inline job moves the store's byte total and the handle's figure as a queued one
/// does.
#[tokio::test]
async fn an_inline_job_is_accounted_as_a_queued_one() {
    let store = Store::new(EngineConfig::default());
    let (inline, _) = store.open(info("a")).await.expect("open");
    let (queued, _) = store.open(info("b")).await.expect("open");
    let before = store.held_bytes();
    ran(&inline, add("m1"), "inline");
    queued.call(add("m1")).await.expect("queued");
    assert!(inline.held_bytes() > 0);
    assert_eq!(inline.held_bytes(), queued.held_bytes());
    let held = inline.call(|tx, _| tx.held_bytes()).await.expect("served");
    assert_eq!(inline.held_bytes(), held);
    assert!(store.held_bytes() > before);
    assert_eq!(
        store.held_bytes(),
        inline.held_bytes() + queued.held_bytes()
    );
}

/// A durable session's results wait on its journal, which only its actor keeps: its jobs
/// are never run inline.
#[tokio::test]
async fn a_durable_session_never_runs_a_job_inline() {
    let dir = tempfile::tempdir().expect("dir");
    let store = durable(dir.path(), Limits::default(), 0);
    let (handle, _) = store.open(info("s")).await.expect("open");
    handle.call(add("m1")).await.expect("written");
    assert!(handle.try_run(add("m2")).is_err());
    assert_eq!(ids(&handle).await, ["m1"]);
}

/// A job that panics inline takes down its session (half changed, as a panicking actor
/// took it down) and gives its bytes back, but not the caller's task (a stream's reader
/// goes on with its other sessions) and no other session. The dead session leaves the
/// map at its next job, and the id can be opened again.
#[tokio::test]
async fn a_panicking_inline_job_takes_down_only_its_session() {
    let store = Store::new(EngineConfig::default());
    let (doomed, _) = store.open(info("a")).await.expect("open");
    let (other, _) = store.open(info("b")).await.expect("open");
    ran(&other, add("m1"), "inline");
    match doomed.try_run(|_, _| panic!("a bug in a job")) {
        Ok(Err(e)) => assert_eq!(e, StoreError::Closed("a".into())),
        Ok(Ok(())) => panic!("ran"),
        Err(_) => panic!("handed back"),
    }
    assert_eq!(store.held_bytes(), other.held_bytes(), "its bytes are back");
    // Out of the map at once, not at its next job.
    assert!(matches!(store.get("a").await, Err(StoreError::NotFound(_))));
    assert!(doomed.try_run(|_, _| ()).is_err());
    assert_eq!(
        doomed.call(|_, _| ()).await,
        Err(StoreError::NotFound("a".into()))
    );
    assert_eq!(ids(&other).await, ["m1"]);
    ran(&other, add("m2"), "the other session still runs inline");
    let (again, _) = store.open(info("a")).await.expect("the id is free again");
    ran(&again, add("m1"), "a new session under the id runs inline");
}

/// A session whose inline job panicked frees its id and its place under `max_sessions`
/// at once: a client reopening it gets a new session, not the dead one.
#[tokio::test]
async fn a_session_dead_of_a_panic_frees_its_id_at_once() {
    let store = Store::new(EngineConfig::default()).with_limits(Limits {
        max_sessions: 1,
        ..Limits::default()
    });
    let (doomed, _) = store.open(info("a")).await.expect("open");
    assert!(matches!(
        doomed.try_run(|_, _| panic!("a bug in a job")),
        Ok(Err(StoreError::Closed(_)))
    ));
    let (again, created) = store.open(info("a")).await.expect("the place is free");
    assert!(created, "a new session, not the dead one");
    ran(&again, add("m1"), "it runs");
    assert_eq!(ids(&again).await, ["m1"]);
}

/// In memory a change is durable once it has run: what waits for that runs at once.
#[tokio::test(flavor = "current_thread")]
async fn an_inline_job_runs_what_waits_for_durability_at_once() {
    let store = Store::new(EngineConfig::default());
    let (handle, _) = store.open(info("s")).await.expect("open");
    let heard = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let h = heard.clone();
    ran(
        &handle,
        move |s, _| s.when_durable(move || h.store(true, Ordering::SeqCst)),
        "idle",
    );
    assert!(heard.load(Ordering::SeqCst));
}
