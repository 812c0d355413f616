//! The SQLite backend on a real database in a temporary directory: writes land in order,
//! snapshots cut the log, incarnations keep a deleted session's late writes out, and a
//! newer schema is refused.

use super::*;

fn dir() -> tempfile::TempDir {
    tempfile::tempdir().expect("a temp dir")
}

async fn write(db: &Sqlite, writes: Vec<Write>) {
    db.write(writes)
        .await
        .expect("the writer answers")
        .expect("the commit succeeds");
}

fn create(id: &str, incarnation: u64, snapshot: &str) -> Write {
    Write::Create {
        id: id.into(),
        incarnation,
        snapshot: snapshot.as_bytes().to_vec(),
    }
}

fn append(id: &str, incarnation: u64, seq: u64, change: &str) -> Write {
    Write::Append {
        id: id.into(),
        incarnation,
        seq,
        change: change.as_bytes().to_vec(),
    }
}

#[tokio::test]
async fn a_session_reads_back_as_its_snapshot_and_log_and_a_snapshot_cuts_the_log() {
    let d = dir();
    let db = Sqlite::open(d.path(), Durability::Sync, None, 0).expect("open");
    write(&db, vec![create("a", 1, "{\"s\":0}")]).await;
    write(
        &db,
        vec![
            append("a", 1, 1, "{\"c\":1}"),
            append("a", 1, 2, "{\"c\":2}"),
        ],
    )
    .await;
    let got = db.load("a").expect("load").expect("stored");
    assert_eq!(got.incarnation, 1);
    assert_eq!(got.snapshot_seq, 0);
    assert_eq!(got.snapshot, b"{\"s\":0}");
    assert_eq!(
        got.log,
        vec![(1, b"{\"c\":1}".to_vec()), (2, b"{\"c\":2}".to_vec())]
    );
    write(
        &db,
        vec![
            append("a", 1, 3, "{\"c\":3}"),
            Write::Snapshot {
                id: "a".into(),
                incarnation: 1,
                seq: 2,
                snapshot: b"{\"s\":2}".to_vec(),
            },
        ],
    )
    .await;
    let got = db.load("a").expect("load").expect("stored");
    assert_eq!(
        (got.snapshot_seq, got.snapshot.as_slice()),
        (2, &b"{\"s\":2}"[..])
    );
    assert_eq!(got.log, vec![(3, b"{\"c\":3}".to_vec())]);
    assert_eq!(db.sessions().expect("ids"), vec!["a".to_string()]);
    assert_eq!(db.last_incarnation().expect("max"), 1);
    assert!(db.load("b").expect("load").is_none());
}

#[tokio::test]
async fn writes_of_a_deleted_or_replaced_incarnation_land_nowhere() {
    let d = dir();
    let db = Sqlite::open(d.path(), Durability::Sync, None, 0).expect("open");
    write(
        &db,
        vec![create("a", 1, "{}"), append("a", 1, 1, "{\"old\":1}")],
    )
    .await;
    write(&db, vec![Write::Delete { id: "a".into() }]).await;
    // The deleted incarnation's actor finishes its queue: nothing reappears.
    write(&db, vec![append("a", 1, 2, "{\"old\":2}")]).await;
    assert!(db.load("a").expect("load").is_none());
    assert!(db.sessions().expect("ids").is_empty());
    // A new incarnation under the same id starts clean; the old one's writes miss it.
    write(&db, vec![create("a", 2, "{\"new\":0}")]).await;
    write(
        &db,
        vec![
            append("a", 1, 3, "{\"old\":3}"),
            Write::Snapshot {
                id: "a".into(),
                incarnation: 1,
                seq: 3,
                snapshot: b"{\"old\":\"snap\"}".to_vec(),
            },
            append("a", 2, 1, "{\"new\":1}"),
        ],
    )
    .await;
    let got = db.load("a").expect("load").expect("stored");
    assert_eq!(got.incarnation, 2);
    assert_eq!(got.snapshot, b"{\"new\":0}");
    assert_eq!(got.log, vec![(1, b"{\"new\":1}".to_vec())]);
}

#[tokio::test]
async fn what_is_written_survives_reopening_and_the_json_is_queryable() {
    let d = dir();
    {
        let db = Sqlite::open(
            d.path(),
            Durability::Interval(Duration::from_millis(20)),
            None,
            0,
        )
        .expect("open");
        write(
            &db,
            vec![create("a", 7, "{\"session\":{\"info\":{\"title\":\"t\"}}}")],
        )
        .await;
        db.write(vec![append("a", 7, 1, "{}")]);
        // close() commits what is queued.
        db.close();
    }
    let db = Sqlite::open(d.path(), Durability::Sync, None, 0).expect("reopen");
    let got = db.load("a").expect("load").expect("stored");
    assert_eq!(got.log.len(), 1, "the queued append was committed at close");
    assert_eq!(db.last_incarnation().expect("max"), 7);
    let conn = Connection::open(d.path().join(DB_FILE)).expect("a second connection");
    let title: String = conn
        .query_row(
            "SELECT json_extract(snapshot, '$.session.info.title') FROM sessions WHERE id = 'a'",
            [],
            |r| r.get(0),
        )
        .expect("sqlite's JSON functions read the snapshot");
    assert_eq!(title, "t");
}

#[tokio::test]
async fn a_database_from_a_newer_compactd_is_refused_with_its_schema() {
    let d = dir();
    drop(Sqlite::open(d.path(), Durability::Sync, None, 0).expect("create"));
    Connection::open(d.path().join(DB_FILE))
        .expect("open")
        .execute_batch("PRAGMA user_version = 99")
        .expect("bump");
    let e = Sqlite::open(d.path(), Durability::Sync, None, 0).expect_err("refused");
    assert!(e.to_string().contains("schema 99"), "{e}");
}

#[tokio::test]
async fn a_file_that_is_not_a_database_is_an_error_naming_it() {
    let d = dir();
    std::fs::write(d.path().join(DB_FILE), vec![0x42u8; 8192]).expect("write junk");
    let e = Sqlite::open(d.path(), Durability::Sync, None, 0).expect_err("refused");
    assert!(e.to_string().contains(DB_FILE), "{e}");
}

#[tokio::test]
async fn after_close_writes_fail_as_closed() {
    let d = dir();
    let db = Sqlite::open(d.path(), Durability::Sync, None, 0).expect("open");
    db.close();
    let r = db
        .write(vec![create("a", 1, "{}")])
        .await
        .expect("answered");
    assert_eq!(r, Err(BackendError::Closed));
}

/// A row whose incarnation or snapshot seq is negative (a hand-edited or damaged file) is
/// refused as corrupt when loaded, naming the figure; read as 0, every later write of the
/// session would have matched no row and been acknowledged while landing nowhere.
#[tokio::test]
async fn a_negative_incarnation_or_snapshot_seq_is_refused_as_corrupt() {
    let d = dir();
    let db = Sqlite::open(d.path(), Durability::Sync, None, 0).expect("open");
    write(&db, vec![create("a", 3, "{}"), create("b", 4, "{}")]).await;
    let conn = Connection::open(d.path().join(DB_FILE)).expect("a second connection");
    conn.execute("UPDATE sessions SET incarnation = -5 WHERE id = 'a'", [])
        .expect("damage a");
    conn.execute("UPDATE sessions SET snapshot_seq = -2 WHERE id = 'b'", [])
        .expect("damage b");
    let a = db.load("a").expect_err("a is corrupt");
    assert!(a.to_string().contains("incarnation -5 is negative"), "{a}");
    let b = db.load("b").expect_err("b is corrupt");
    assert!(b.to_string().contains("snapshot seq -2 is negative"), "{b}");
}

#[test]
fn a_second_backend_on_a_data_dir_in_use_is_refused_naming_the_holder() {
    let d = dir();
    let first = Sqlite::open(d.path(), Durability::Sync, None, 0).expect("open");
    let Err(BackendError::Io(message)) = Sqlite::open(d.path(), Durability::Sync, None, 0) else {
        panic!("a second backend opened the same data dir");
    };
    assert!(message.contains("in use by another compactd"), "{message}");
    assert!(
        message.contains(&format!("pid {}", std::process::id())),
        "{message}"
    );
    // Closed (or its process gone), the directory can be taken again.
    first.close();
    drop(Sqlite::open(d.path(), Durability::Sync, None, 0).expect("open after close"));
}

#[tokio::test]
async fn a_write_that_fails_does_not_fail_the_writes_batched_with_it() {
    let d = dir();
    let db = Sqlite::open(
        d.path(),
        Durability::Interval(Duration::from_millis(200)),
        None,
        0,
    )
    .expect("open");
    write(&db, vec![create("a", 1, "{}"), append("a", 1, 1, "{}")]).await;
    // Queued within one interval: one group commit, whose first request fails (seq 1
    // is taken).
    let bad = db.write(vec![append("a", 1, 1, "{\"again\":1}")]);
    let good = db.write(vec![create("b", 2, "{\"b\":0}")]);
    assert!(bad.await.expect("answered").is_err(), "the duplicate fails");
    good.await
        .expect("answered")
        .expect("the other session's write commits");
    assert_eq!(
        db.load("b").expect("load").expect("stored").snapshot,
        b"{\"b\":0}"
    );
    assert_eq!(db.load("a").expect("load").expect("stored").log.len(), 1);
}
