//! The embedded durable backend: one SQLite database in WAL mode, written by one thread
//! that commits everything queued in one transaction (group commit: concurrent updates of
//! all sessions share one fsync).
//!
//! Schema (version in `PRAGMA user_version`):
//! - `sessions(id, incarnation, snapshot_seq, snapshot, updated_ms)`: one row per
//!   session, the snapshot as JSON text (`json_extract(snapshot, '$.session.info.title')`
//!   works in the `sqlite3` shell);
//! - `log(session_id, incarnation, seq, change)`: the changes after the snapshot, JSON.
//!
//! A log row or snapshot of an incarnation that is no longer stored (deleted or replaced)
//! is not written. Reads use their own connection: WAL lets them run beside the writer.

use std::fs::File;
use std::io::{Read as _, Write as _};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex, RwLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rusqlite::types::{ToSqlOutput, ValueRef};
use rusqlite::{Connection, ErrorCode, OptionalExtension, ToSql, params};
use tokio::sync::oneshot;

use super::backend::{
    Backend, BackendError, BackendState, Committed, Durability, Observer, StoreEvent, Stored, Write,
};

/// The database file inside the data directory.
pub const DB_FILE: &str = "compactd.db";
/// The schema this build writes. Older schemas are migrated on open (`migrate`).
const SCHEMA: i64 = 1;
/// A batch stops gathering past this many bytes (one transaction stays bounded).
const MAX_BATCH_BYTES: usize = 64 << 20;

/// The writer connection's page cache, KiB (SQLite's default is 2,000). Outside the
/// memory budget, like the process's own few MB.
const WRITER_CACHE_KIB: u32 = 16 << 10;

/// Writes queued for the writer thread, with where to report their outcome.
struct Request {
    writes: Vec<Write>,
    done: oneshot::Sender<Result<(), BackendError>>,
    /// When the oldest of its changes was acknowledged (under `interval`, the writer
    /// commits within the interval of it).
    since: Option<Instant>,
    /// Someone waits for what is queued: the writer commits it at once
    /// ([`Backend::expedite`]).
    urgent: bool,
}

/// SQLite behind the [`Backend`] trait.
#[derive(Debug)]
pub struct Sqlite {
    path: PathBuf,
    durability: Durability,
    queue: RwLock<Option<Sender<Request>>>,
    reader: Mutex<Connection>,
    state: Arc<Mutex<BackendState>>,
    writer: Mutex<Option<JoinHandle<()>>>,
    /// Stops the checkpointer when dropped.
    checkpoints: Mutex<Option<(Sender<()>, JoinHandle<()>)>>,
    /// Raised by [`Backend::hurry`]: the writer stops gathering for the interval.
    hurry: Arc<AtomicBool>,
    /// The data dir's lock, held until the backend is closed (see [`lock_data_dir`]).
    lock: Mutex<Option<File>>,
}

/// The file in the data dir a running backend holds locked.
pub const LOCK_FILE: &str = "compactd.lock";

/// Locks the data dir for this process: two servers on one directory would share the
/// database (SQLite lets them) and hand out the same incarnations, so one's writes could
/// land on the other's sessions. The lock is the OS's (released when the process ends,
/// however it ends); the file holds the holder's pid, to name it.
fn lock_data_dir(dir: &Path) -> Result<File, BackendError> {
    let path = dir.join(LOCK_FILE);
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(|e| BackendError::Io(format!("cannot open {}: {e}", path.display())))?;
    match file.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => {
            let mut holder = String::new();
            // Best effort: the pid is only named in the message.
            let _ = file.read_to_string(&mut holder);
            let holder = holder.trim();
            let by = if holder.is_empty() || holder.len() > 20 {
                String::new()
            } else {
                format!(" (pid {holder})")
            };
            return Err(BackendError::Io(format!(
                "data dir {} is in use by another compactd{by}: give each server its own --data-dir",
                dir.display()
            )));
        }
        Err(std::fs::TryLockError::Error(e)) => {
            return Err(BackendError::Io(format!(
                "cannot lock {}: {e}",
                path.display()
            )));
        }
    }
    let pid = std::process::id().to_string();
    file.set_len(0)
        .and_then(|()| file.write_all(pid.as_bytes()))
        .map_err(|e| BackendError::Io(format!("cannot write {}: {e}", path.display())))?;
    Ok(file)
}

impl Sqlite {
    /// Queues one request for the writer (answered `Closed` once it has stopped).
    fn queue_request(&self, writes: Vec<Write>, since: Option<Instant>, urgent: bool) -> Committed {
        let (done, rx) = oneshot::channel();
        let queue = self.queue.read().unwrap_or_else(|e| e.into_inner());
        let request = Request {
            writes,
            done,
            since,
            urgent,
        };
        match queue.as_ref() {
            Some(q) => {
                if let Err(mpsc::SendError(r)) = q.send(request) {
                    let _ = r.done.send(Err(BackendError::Closed));
                }
            }
            None => {
                let _ = request.done.send(Err(BackendError::Closed));
            }
        }
        rx
    }
    /// Opens (or creates) the database in `dir` and starts its writer.
    /// `observer` hears each commit (the server turns them into metrics). With
    /// `max_disk_bytes` (0: none) the database stops growing there: a write past it fails
    /// as a full disk (`RESOURCE_EXHAUSTED`), before a volume's own limit (a Kubernetes
    /// `emptyDir` `sizeLimit` evicts the whole pod) is reached.
    pub fn open(
        dir: &Path,
        durability: Durability,
        observer: Option<Observer>,
        max_disk_bytes: u64,
    ) -> Result<Sqlite, BackendError> {
        std::fs::create_dir_all(dir).map_err(|e| {
            BackendError::Io(format!("cannot create data dir {}: {e}", dir.display()))
        })?;
        let lock = lock_data_dir(dir)?;
        let path = dir.join(DB_FILE);
        let writer_conn = connect(&path)?;
        migrate(&writer_conn, &path)?;
        if max_disk_bytes > 0 {
            let page: i64 = writer_conn
                .query_row("PRAGMA page_size", [], |r| r.get(0))
                .map_err(db)?;
            let pages = max_disk_bytes / u64::try_from(page.max(512)).unwrap_or(4096);
            writer_conn
                .execute_batch(&format!("PRAGMA max_page_count = {}", pages.max(1)))
                .map_err(db)?;
        }
        // Checkpoints (copying the WAL into the database) run on their own thread, off
        // the writer's commit path. The writer's page cache holds a whole group commit
        // (a few MB under load): with SQLite's 2 MB default, a batch spilled dirty pages
        // to the WAL mid-transaction and read them back (`pagerStress`, 12% of the
        // writer's time under `sync` ingest).
        writer_conn
            .execute_batch(&format!(
                "PRAGMA wal_autocheckpoint=0; PRAGMA journal_size_limit=67108864; \
                 PRAGMA cache_size=-{WRITER_CACHE_KIB};"
            ))
            .map_err(db)?;
        let reader = connect(&path)?;
        let checkpoints = {
            let conn = connect(&path)?;
            let (stop, stopped) = mpsc::channel::<()>();
            let thread = std::thread::Builder::new()
                .name("compactd-checkpoint".into())
                .spawn(move || run_checkpoints(&conn, &stopped))
                .map_err(|e| BackendError::Io(format!("cannot start the checkpointer: {e}")))?;
            (stop, thread)
        };
        let (tx, rx) = mpsc::channel();
        let state = Arc::new(Mutex::new(BackendState::Ok));
        let hurry = Arc::new(AtomicBool::new(false));
        let writer = {
            let (state, hurry) = (state.clone(), hurry.clone());
            std::thread::Builder::new()
                .name("compactd-store".into())
                .spawn(move || run_writer(writer_conn, rx, durability, (state, hurry), observer))
                .map_err(|e| BackendError::Io(format!("cannot start the store writer: {e}")))?
        };
        Ok(Sqlite {
            lock: Mutex::new(Some(lock)),
            path,
            durability,
            queue: RwLock::new(Some(tx)),
            reader: Mutex::new(reader),
            state,
            writer: Mutex::new(Some(writer)),
            checkpoints: Mutex::new(Some(checkpoints)),
            hurry,
        })
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn reader(&self) -> std::sync::MutexGuard<'_, Connection> {
        self.reader.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn connect(path: &Path) -> Result<Connection, BackendError> {
    let conn = Connection::open(path)
        .map_err(|e| BackendError::Io(format!("cannot open {}: {e}", path.display())))?;
    conn.busy_timeout(Duration::from_secs(10)).map_err(db)?;
    // Log rows are a few KB (a tool output): 16 KiB pages hold several without overflow
    // pages. Only takes effect on a new database (before WAL mode is set).
    conn.execute_batch("PRAGMA page_size=16384;").map_err(db)?;
    // WAL: readers never block the writer. FULL: a commit is on disk when it returns.
    let mode: String = conn
        .query_row("PRAGMA journal_mode=WAL", [], |r| r.get(0))
        .map_err(|e| {
            BackendError::Io(format!(
                "{} is not a usable SQLite database: {e}",
                path.display()
            ))
        })?;
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(BackendError::Io(format!(
            "{} cannot use WAL mode (got {mode}); is the data dir on a network filesystem?",
            path.display()
        )));
    }
    conn.execute_batch("PRAGMA synchronous=FULL;").map_err(db)?;
    Ok(conn)
}

/// Brings the schema to [`SCHEMA`]; a newer schema is refused (a downgrade would lose
/// what the newer build wrote).
fn migrate(conn: &Connection, path: &Path) -> Result<(), BackendError> {
    let version: i64 = conn
        .query_row("PRAGMA user_version", [], |r| r.get(0))
        .map_err(db)?;
    if version > SCHEMA {
        return Err(BackendError::Io(format!(
            "{} was written by a newer compactd (schema {version}, this build knows {SCHEMA}); use that version or another --data-dir",
            path.display()
        )));
    }
    if version < 1 {
        conn.execute_batch(
            "BEGIN;
             CREATE TABLE IF NOT EXISTS sessions (
                 id TEXT PRIMARY KEY NOT NULL,
                 incarnation INTEGER NOT NULL,
                 snapshot_seq INTEGER NOT NULL,
                 snapshot TEXT NOT NULL,
                 updated_ms INTEGER NOT NULL
             );
             CREATE TABLE IF NOT EXISTS log (
                 session_id TEXT NOT NULL,
                 incarnation INTEGER NOT NULL,
                 seq INTEGER NOT NULL,
                 change TEXT NOT NULL,
                 PRIMARY KEY (session_id, seq)
             );
             PRAGMA user_version = 1;
             COMMIT;",
        )
        .map_err(db)?;
    }
    // Future schemas: `if version < 2 { ... PRAGMA user_version = 2 }`, in order.
    Ok(())
}

/// JSON bytes bound as SQLite text (so the `sqlite3` shell's JSON functions read it).
struct Json<'a>(&'a [u8]);

impl ToSql for Json<'_> {
    fn to_sql(&self) -> rusqlite::Result<ToSqlOutput<'_>> {
        Ok(ToSqlOutput::Borrowed(ValueRef::Text(self.0)))
    }
}

fn db(e: rusqlite::Error) -> BackendError {
    match &e {
        rusqlite::Error::SqliteFailure(f, _) if f.code == ErrorCode::DiskFull => {
            BackendError::Full(e.to_string())
        }
        _ => BackendError::Io(e.to_string()),
    }
}

/// A read error: a value of the wrong type in a row (damaged on disk, not a failing disk)
/// makes the session unreadable (`Corrupt`, DATA_LOSS); anything else is [`db`]'s.
fn damaged(e: rusqlite::Error, corrupt: &impl Fn(String) -> BackendError) -> BackendError {
    match e {
        rusqlite::Error::InvalidColumnType(..)
        | rusqlite::Error::FromSqlConversionFailure(..)
        | rusqlite::Error::IntegralValueOutOfRange(..) => corrupt(e.to_string()),
        e => db(e),
    }
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

fn to_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// How often the checkpointer copies committed WAL frames into the database.
const CHECKPOINT_EVERY: Duration = Duration::from_millis(100);

/// The checkpointer thread: a passive checkpoint (never blocks the writer or readers)
/// every [`CHECKPOINT_EVERY`] until told to stop, then a last one.
fn run_checkpoints(conn: &Connection, stop: &Receiver<()>) {
    loop {
        let stopping = !matches!(
            stop.recv_timeout(CHECKPOINT_EVERY),
            Err(mpsc::RecvTimeoutError::Timeout)
        );
        if let Err(e) = conn.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(())) {
            tracing::warn!(error = %e, "session store checkpoint failed");
        }
        if stopping {
            return;
        }
    }
}

/// The writer thread: gathers everything queued (for up to the interval under
/// `Durability::Interval`), commits it in one transaction, reports to each request.
fn run_writer(
    mut conn: Connection,
    rx: Receiver<Request>,
    durability: Durability,
    (state, hurry): (Arc<Mutex<BackendState>>, Arc<AtomicBool>),
    observer: Option<Observer>,
) {
    // Once hurried (the store is closing), what is queued is committed at once.
    let hurried = || hurry.load(Ordering::Acquire);
    while let Ok(first) = rx.recv() {
        let mut bytes: usize = first.writes.iter().map(Write::bytes).sum();
        // Under `interval`, within the interval of the oldest change acknowledged.
        let due = |r: &Request, d: Duration| {
            let since = r.since.unwrap_or_else(Instant::now);
            since.checked_add(d).unwrap_or(since)
        };
        let mut deadline = match durability {
            Durability::Interval(d) if !hurried() && !first.urgent => Some(due(&first, d)),
            _ => None,
        };
        let mut batch = vec![first];
        while bytes < MAX_BATCH_BYTES {
            let next = match deadline {
                None => rx.try_recv().ok(),
                Some(at) => rx
                    .recv_timeout(at.saturating_duration_since(Instant::now()))
                    .ok(),
            };
            let Some(next) = next else { break };
            bytes = bytes.saturating_add(next.writes.iter().map(Write::bytes).sum());
            if let (Some(at), Durability::Interval(d)) = (deadline, durability) {
                deadline = Some(at.min(due(&next, d)));
            }
            if hurried() || next.urgent {
                deadline = None;
            }
            batch.push(next);
        }
        // A panic here (a bug, in this code or the metrics it reports to) fails this
        // batch and the writer goes on: a dead writer would answer every later write
        // `Closed`, which the sessions take for the store closing (acknowledged changes
        // dropped under `interval`, health still SERVING).
        let began = Instant::now();
        let committed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            commit_batch(&mut conn, &batch)
        }));
        let (group_ok, results) = committed.unwrap_or_else(|_| {
            tracing::error!(requests = batch.len(), "the session store's writer panicked while committing; its writes are refused and written again");
            let failed = BackendError::Io(
                "the session store's writer failed while committing (a panic)".into(),
            );
            (false, vec![Err(failed); batch.len()])
        });
        if let Some(o) = &observer {
            let event = StoreEvent::Commit {
                requests: batch.len(),
                bytes: bytes as u64,
                took: began.elapsed(),
                ok: group_ok,
            };
            // What was committed stays committed, and reported so, whatever the observer does.
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| o(&event))).is_err() {
                tracing::error!("the session store's commit observer panicked");
            }
        }
        {
            let mut s = state.lock().unwrap_or_else(|e| e.into_inner());
            *s = match results.iter().find_map(|r| r.as_ref().err()) {
                None => BackendState::Ok,
                Some(e) => {
                    let failed = results.iter().filter(|r| r.is_err()).count();
                    tracing::error!(error = %e, requests = failed, "session store commit failed");
                    BackendState::Failing(e.to_string())
                }
            };
        }
        for (r, result) in batch.into_iter().zip(results) {
            let _ = r.done.send(result);
        }
    }
}

/// Commits `batch`: whether the group commit went through, and one result per request.
/// One request's failure (a snapshot past the disk limit, a constraint) must not fail the
/// sessions it was batched with: after a failed group commit each request is committed
/// again on its own, and only the ones that fail again fail.
fn commit_batch(conn: &mut Connection, batch: &[Request]) -> (bool, Vec<Result<(), BackendError>>) {
    let result = commit(conn, batch);
    let group_ok = result.is_ok();
    let results = match result {
        Err((e, true)) if batch.len() > 1 => {
            tracing::warn!(error = %e, requests = batch.len(), "session store group commit failed: committing each request alone");
            batch
                .iter()
                .map(|r| commit(conn, std::slice::from_ref(r)).map_err(|(e, _)| e))
                .collect()
        }
        result => vec![result.map_err(|(e, _)| e); batch.len()],
    };
    (group_ok, results)
}

/// Commits `batch` in one transaction. A failure is tagged with whether one request may
/// have caused it alone (a constraint, a row too big, the disk or `--max-disk-bytes` full:
/// the others may fit), as opposed to the database itself failing (busy, I/O), which
/// committing each request alone would only repeat.
fn commit(conn: &mut Connection, batch: &[Request]) -> Result<(), (BackendError, bool)> {
    let failed = |e: rusqlite::Error| {
        let one = matches!(
            e.sqlite_error_code(),
            Some(ErrorCode::ConstraintViolation | ErrorCode::TooBig | ErrorCode::DiskFull)
        );
        (db(e), one)
    };
    let tx = conn.transaction().map_err(failed)?;
    for r in batch {
        for w in &r.writes {
            apply(&tx, w).map_err(failed)?;
        }
    }
    tx.commit().map_err(failed)
}

/// Writes one change. The statements that can fail on a constraint say `OR FAIL`: with
/// the default `ABORT`, SQLite keeps a statement journal (a temp file copy of every page
/// the statement touches, to undo that statement alone), which a failure here never
/// needs: any error rolls back the whole batch. Under `sync` ingest that journal was
/// 560 MB of temp-file writes for 84 MB of text.
fn apply(tx: &rusqlite::Transaction<'_>, w: &Write) -> rusqlite::Result<()> {
    match w {
        Write::Create {
            id,
            incarnation,
            snapshot,
        } => {
            tx.prepare_cached("DELETE FROM log WHERE session_id = ?1")?
                .execute(params![id])?;
            tx.prepare_cached(
                "INSERT OR REPLACE INTO sessions (id, incarnation, snapshot_seq, snapshot, updated_ms)
                 VALUES (?1, ?2, 0, ?3, ?4)",
            )?
            .execute(params![id, to_i64(*incarnation), Json(snapshot), now_ms()])?;
        }
        Write::Append {
            id,
            incarnation,
            seq,
            change,
        } => {
            tx.prepare_cached(
                "INSERT OR FAIL INTO log (session_id, incarnation, seq, change)
                 SELECT ?1, ?2, ?3, ?4
                 WHERE EXISTS (SELECT 1 FROM sessions WHERE id = ?1 AND incarnation = ?2)",
            )?
            .execute(params![
                id,
                to_i64(*incarnation),
                to_i64(*seq),
                Json(change)
            ])?;
        }
        Write::Snapshot {
            id,
            incarnation,
            seq,
            snapshot,
        } => {
            let n = tx
                .prepare_cached(
                    "UPDATE OR FAIL sessions SET snapshot = ?3, snapshot_seq = ?4, updated_ms = ?5
                     WHERE id = ?1 AND incarnation = ?2",
                )?
                .execute(params![
                    id,
                    to_i64(*incarnation),
                    Json(snapshot),
                    to_i64(*seq),
                    now_ms()
                ])?;
            if n > 0 {
                tx.prepare_cached("DELETE FROM log WHERE session_id = ?1 AND seq <= ?2")?
                    .execute(params![id, to_i64(*seq)])?;
            }
        }
        Write::Delete { id } => {
            tx.prepare_cached("DELETE FROM sessions WHERE id = ?1")?
                .execute(params![id])?;
            tx.prepare_cached("DELETE FROM log WHERE session_id = ?1")?
                .execute(params![id])?;
        }
    }
    Ok(())
}

impl Backend for Sqlite {
    fn sessions(&self) -> Result<Vec<String>, BackendError> {
        let conn = self.reader();
        let mut stmt = conn.prepare("SELECT rowid, id FROM sessions").map_err(db)?;
        let mut rows = stmt.query([]).map_err(db)?;
        let mut ids = Vec::new();
        while let Some(r) = rows.next().map_err(db)? {
            // A damaged id (not text, not UTF-8) is set aside, not a failed start: every
            // other session is still served.
            match r.get_ref(1).map_err(db)? {
                ValueRef::Text(t) if std::str::from_utf8(t).is_ok() => {
                    ids.push(String::from_utf8_lossy(t).into_owned());
                }
                other => {
                    let rowid: i64 = r.get(0).map_err(db)?;
                    tracing::error!(
                        rowid,
                        kind = ?other.data_type(),
                        "a stored session's id is not text: the row is kept and skipped"
                    );
                }
            }
        }
        Ok(ids)
    }

    fn last_incarnation(&self) -> Result<u64, BackendError> {
        let conn = self.reader();
        // Integers only: a damaged value of another type (which MAX would return, SQLite
        // ordering text above numbers) makes its own session unreadable, not the store.
        let max: Option<i64> = conn
            .query_row(
                "SELECT MAX(incarnation) FROM sessions WHERE typeof(incarnation) = 'integer'",
                [],
                |r| r.get(0),
            )
            .map_err(db)?;
        Ok(max.map_or(0, |m| u64::try_from(m).unwrap_or(0)))
    }

    fn snapshot_bytes(&self, id: &str) -> Option<u64> {
        // SQLite answers from the row's header: the snapshot itself is not read.
        self.reader()
            .query_row(
                "SELECT octet_length(snapshot) FROM sessions WHERE id = ?1",
                params![id],
                |r| r.get::<_, i64>(0),
            )
            .ok()
            .and_then(|n| u64::try_from(n).ok())
    }

    fn load(&self, id: &str) -> Result<Option<Stored>, BackendError> {
        let conn = self.reader();
        let corrupt = |reason: String| BackendError::Corrupt {
            id: id.to_string(),
            reason,
        };
        // One read transaction: the snapshot and its log tail are from the same commit.
        // Ended when dropped, however the read ends (a panic included): left open, every
        // later read of the shared connection would fail at its BEGIN.
        let tx = conn.unchecked_transaction().map_err(db)?;
        let read = (|| {
            let row = conn
                .prepare_cached(
                    "SELECT incarnation, snapshot_seq, snapshot FROM sessions WHERE id = ?1",
                )
                .map_err(db)?
                .query_row(params![id], |r| {
                    Ok((
                        r.get::<_, i64>(0)?,
                        r.get::<_, i64>(1)?,
                        r.get_ref(2)?.as_bytes().map(<[u8]>::to_vec),
                    ))
                })
                .optional()
                .map_err(|e| damaged(e, &corrupt))?;
            let Some((incarnation, snapshot_seq, snapshot)) = row else {
                return Ok(None);
            };
            let snapshot = snapshot.map_err(|e| corrupt(format!("snapshot: {e}")))?;
            let mut stmt = conn
                .prepare_cached(
                    "SELECT seq, change FROM log
                     WHERE session_id = ?1 AND incarnation = ?2 AND seq > ?3 ORDER BY seq",
                )
                .map_err(db)?;
            let mut rows = stmt
                .query(params![id, incarnation, snapshot_seq])
                .map_err(db)?;
            let mut log = Vec::new();
            while let Some(r) = rows.next().map_err(db)? {
                let seq: i64 = r.get(0).map_err(|e| damaged(e, &corrupt))?;
                let change = r
                    .get_ref(1)
                    .map_err(db)?
                    .as_bytes()
                    .map_err(|e| corrupt(format!("log entry {seq}: {e}")))?
                    .to_vec();
                let seq = u64::try_from(seq)
                    .map_err(|_| corrupt(format!("log entry {seq}: a negative seq")))?;
                log.push((seq, change));
            }
            // Read as 0, a negative incarnation would make every later write of the
            // session match no row and land nowhere, acknowledged: refused instead.
            let incarnation = u64::try_from(incarnation)
                .map_err(|_| corrupt(format!("incarnation {incarnation} is negative")))?;
            let snapshot_seq = u64::try_from(snapshot_seq)
                .map_err(|_| corrupt(format!("snapshot seq {snapshot_seq} is negative")))?;
            Ok(Some(Stored {
                incarnation,
                snapshot_seq,
                snapshot,
                log,
            }))
        })();
        drop(tx);
        read
    }

    fn write(&self, writes: Vec<Write>) -> Committed {
        self.queue_request(writes, None, false)
    }

    fn write_since(&self, writes: Vec<Write>, since: Instant) -> Committed {
        self.queue_request(writes, Some(since), false)
    }

    fn state(&self) -> BackendState {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn durability(&self) -> Durability {
        self.durability
    }

    fn disk_bytes(&self) -> u64 {
        let mut total = 0u64;
        for suffix in ["", "-wal", "-shm"] {
            let mut p = self.path.clone().into_os_string();
            p.push(suffix);
            if let Ok(m) = std::fs::metadata(&p) {
                total = total.saturating_add(m.len());
            }
        }
        total
    }

    fn hurry(&self) {
        self.hurry.store(true, Ordering::Release);
        // Wakes a writer gathering for the interval (an empty request, its answer unread).
        drop(self.queue_request(Vec::new(), None, false));
    }

    fn expedite(&self) {
        // An empty urgent request: the writer gathering for the interval commits what it
        // holds at once (its answer unread).
        if let Durability::Interval(_) = self.durability {
            drop(self.queue_request(Vec::new(), None, true));
        }
    }

    fn close(&self) {
        // Dropping the sender ends the writer after it commits what is queued.
        self.queue.write().unwrap_or_else(|e| e.into_inner()).take();
        let writer = self.writer.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(w) = writer {
            let _ = w.join();
        }
        let checkpoints = self
            .checkpoints
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some((stop, thread)) = checkpoints {
            drop(stop);
            let _ = thread.join();
        }
        // Nothing more is written: another server may take the directory.
        drop(self.lock.lock().unwrap_or_else(|e| e.into_inner()).take());
    }
}

impl Drop for Sqlite {
    fn drop(&mut self) {
        self.close();
    }
}

#[cfg(test)]
#[path = "sqlite_tests.rs"]
mod tests;
