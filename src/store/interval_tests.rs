//! Under `interval=<ms>`, an acknowledged change is on disk within the interval of its
//! acknowledgement, even when it waited for the batch before it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::durable_tests::{feed, info, turn};
use super::sqlite::Sqlite;
use super::*;

/// The last change of session `id` on disk (its snapshot's or its log's).
fn durable_seq(dir: &std::path::Path, id: &str) -> i64 {
    let conn = rusqlite::Connection::open(dir.join(super::sqlite::DB_FILE)).expect("db");
    let snapshot: i64 = conn
        .query_row(
            "SELECT coalesce(max(snapshot_seq), -1) FROM sessions WHERE id = ?1",
            [id],
            |r| r.get(0),
        )
        .expect("sessions");
    let logged: i64 = conn
        .query_row(
            "SELECT coalesce(max(seq), -1) FROM log WHERE session_id = ?1",
            [id],
            |r| r.get(0),
        )
        .expect("log");
    snapshot.max(logged)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_that_waited_for_the_batch_before_it_is_on_disk_within_its_interval() {
    const INTERVAL: Duration = Duration::from_secs(3);
    let dir = tempfile::tempdir().expect("dir");
    let backend = Sqlite::open(dir.path(), Durability::Interval(INTERVAL), None, 0).expect("open");
    let store = Store::new(EngineConfig::default())
        .with_backend(Arc::new(backend))
        .expect("listed");
    // The session's row goes out at once and the writer holds it for the interval; the
    // changes acknowledged meanwhile wait for it.
    let (h, _) = store.open(info("s")).await.expect("open");
    let updates = turn(0, 1, 200);
    let last = i64::try_from(updates.len()).expect("few");
    feed(&h, updates).await;
    let acked = Instant::now();
    let path = dir.path().to_path_buf();
    let on_disk = tokio::task::spawn_blocking(move || {
        while durable_seq(&path, "s") < last {
            assert!(acked.elapsed() < 4 * INTERVAL, "never written");
            std::thread::sleep(Duration::from_millis(20));
        }
        acked.elapsed()
    })
    .await
    .expect("polled");
    // One interval and the commit's time; the batch after the row's used to wait a
    // second interval (about 6 s here).
    assert!(
        on_disk < INTERVAL + Duration::from_millis(1500),
        "on disk {on_disk:?} after its acknowledgement"
    );
    store.close().await;
}
