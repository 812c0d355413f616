//! Calls whose caller stops waiting while their write lands (its deadline, a hang-up): a
//! DeleteSession still tells its watchers, over a real socket on a durable store whose
//! deletes take a while. [`SlowWrites`] is also the store of the import's test
//! (`compaction_tests.rs`).

use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio_stream::StreamExt;

use super::pb;
use super::pb::sessions_client::SessionsClient;
use super::{ServerOptions, serve};
use crate::config::EngineConfig;
use crate::store::{Backend, BackendError, BackendState, Durability, Sqlite, Store, Stored, Write};

/// SQLite under `sync` whose batches holding a write that `slow` picks land only after
/// [`PAUSE`].
#[derive(Debug)]
pub(super) struct SlowWrites {
    sqlite: Sqlite,
    slow: fn(&Write) -> bool,
    /// Counts the picked writes begun, so a test drops its call while one waits.
    began: tokio::sync::watch::Sender<usize>,
}

/// How long a picked write takes to be durable: far past the callers' deadlines.
pub(super) const PAUSE: Duration = Duration::from_millis(500);

impl SlowWrites {
    /// A store over SQLite in `dir` whose writes `slow` picks take [`PAUSE`], and the
    /// count of those begun.
    pub(super) fn store(
        dir: &std::path::Path,
        slow: fn(&Write) -> bool,
    ) -> (Store, tokio::sync::watch::Receiver<usize>) {
        let sqlite = Sqlite::open(dir, Durability::Sync, None, 0).expect("sqlite");
        let (began, count) = tokio::sync::watch::channel(0);
        let store = Store::new(EngineConfig::default())
            .with_backend(Arc::new(SlowWrites {
                sqlite,
                slow,
                began,
            }))
            .expect("store");
        (store, count)
    }
}

impl Backend for SlowWrites {
    fn sessions(&self) -> Result<Vec<String>, BackendError> {
        self.sqlite.sessions()
    }
    fn last_incarnation(&self) -> Result<u64, BackendError> {
        self.sqlite.last_incarnation()
    }
    fn load(&self, id: &str) -> Result<Option<Stored>, BackendError> {
        self.sqlite.load(id)
    }
    fn write(
        &self,
        writes: Vec<Write>,
    ) -> tokio::sync::oneshot::Receiver<Result<(), BackendError>> {
        let slow = writes.iter().any(self.slow);
        let landed = self.sqlite.write(writes);
        if !slow {
            return landed;
        }
        self.began.send_modify(|n| *n += 1);
        let (tx, rx) = tokio::sync::oneshot::channel();
        std::thread::spawn(move || {
            std::thread::sleep(PAUSE);
            let _ = tx.send(landed.blocking_recv().unwrap_or(Err(BackendError::Closed)));
        });
        rx
    }
    fn state(&self) -> BackendState {
        self.sqlite.state()
    }
    fn durability(&self) -> Durability {
        self.sqlite.durability()
    }
    fn disk_bytes(&self) -> u64 {
        self.sqlite.disk_bytes()
    }
    fn close(&self) {
        self.sqlite.close()
    }
}

/// Before, the handler was dropped at the write's wait: the session was gone (on disk and
/// in memory) but its watcher was never told and kept waiting, to hear a later session of
/// the same id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_whose_caller_stopped_waiting_still_ends_its_watchers() {
    let dir = tempfile::tempdir().expect("dir");
    let (store, mut began) = SlowWrites::store(dir.path(), |w| matches!(w, Write::Delete { .. }));
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(serve(
        listener,
        Arc::new(store),
        ServerOptions::default(),
        async {
            let _ = stopped.await;
        },
    ));
    let mut client = SessionsClient::connect(format!("http://{addr}"))
        .await
        .expect("connect");
    client
        .open_session(pb::OpenSessionRequest {
            session: Some(pb::SessionInfo {
                id: "s".into(),
                ..Default::default()
            }),
        })
        .await
        .expect("open");
    let mut watcher = client
        .subscribe(pb::SubscribeRequest {
            session_id: "s".into(),
        })
        .await
        .expect("subscribe")
        .into_inner();
    // The caller hangs up once the delete is being written.
    let mut hasty = client.clone();
    let delete = hasty.delete_session(pb::DeleteSessionRequest {
        session_id: "s".into(),
    });
    tokio::select! {
        done = delete => panic!("the delete cannot land before its write: {done:?}"),
        began = began.wait_for(|n| *n > 0) => drop(began.expect("the store is up")),
    }
    let ended = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match watcher.next().await {
                Some(Ok(_)) => continue,
                end => break end,
            }
        }
    })
    .await
    .expect("the watcher was never told of the delete");
    let status = ended
        .expect("a status ends the watcher")
        .expect_err("not an event");
    assert_eq!(status.code(), tonic::Code::NotFound, "{status:?}");
    let gone = client
        .get_session(pb::GetSessionRequest {
            session_id: "s".into(),
        })
        .await
        .expect_err("deleted");
    assert_eq!(gone.code(), tonic::Code::NotFound, "{gone:?}");
    let _ = stop.send(());
}
