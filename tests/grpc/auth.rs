//! Bearer-token authentication over TCP (in-process server) and over a Unix domain socket
//! (the real binary): missing and wrong tokens get UNAUTHENTICATED, the right one works,
//! health stays open for probes unless configured otherwise, the socket is mode 0600, and
//! the token never reaches the logs.

use std::time::Duration;

use compactd::server::pb::sessions_client::SessionsClient;
use compactd::server::{AuthConfig, BearerToken, ServerOptions, pb};
use tonic::metadata::MetadataValue;
use tonic::transport::{Channel, Endpoint};

use crate::common::binary::Binary;
use crate::common::*;

const TOKEN: &str = "tok-3f9a-SECRET-d41c";

/// Adds `authorization: Bearer <token>` to every call.
#[derive(Clone)]
struct Bearer(&'static str);

impl tonic::service::Interceptor for Bearer {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        let value: MetadataValue<_> = format!("Bearer {}", self.0).parse().expect("ascii");
        req.metadata_mut().insert("authorization", value);
        Ok(req)
    }
}

type Authed = SessionsClient<tonic::service::interceptor::InterceptedService<Channel, Bearer>>;

fn with_token(channel: Channel, token: &'static str) -> Authed {
    SessionsClient::with_interceptor(channel, Bearer(token))
}

async fn health_status(channel: Channel) -> Result<i32, tonic::Status> {
    tonic_health::pb::health_client::HealthClient::new(channel)
        .check(tonic_health::pb::HealthCheckRequest {
            service: String::new(),
        })
        .await
        .map(|r| r.into_inner().status)
}

#[tokio::test]
async fn over_tcp_only_the_right_token_gets_in_and_health_stays_open() {
    let server = start_server_with_options(ServerOptions {
        auth: AuthConfig {
            token: BearerToken::new(TOKEN).ok(),
            ..Default::default()
        },
        ..Default::default()
    })
    .await;
    let channel = server.channel().await;

    let mut anonymous = SessionsClient::new(channel.clone());
    let err = anonymous
        .list_sessions(pb::ListSessionsRequest::default())
        .await
        .expect_err("no token");
    assert_eq!(err.code(), tonic::Code::Unauthenticated);
    assert!(!err.message().contains(TOKEN));

    let mut wrong = with_token(channel.clone(), "tok-3f9a-SECRET-d41");
    let err = wrong
        .list_sessions(pb::ListSessionsRequest::default())
        .await
        .expect_err("wrong token");
    assert_eq!(err.code(), tonic::Code::Unauthenticated);

    let mut right = with_token(channel.clone(), TOKEN);
    right
        .open_session(pb::OpenSessionRequest {
            session: Some(session("authed")),
        })
        .await
        .expect("the right token works");
    let listed = right
        .list_sessions(pb::ListSessionsRequest::default())
        .await
        .expect("list")
        .into_inner();
    assert_eq!(listed.sessions.len(), 1);

    // Probes cannot send a token: health answers without one.
    assert_eq!(health_status(channel).await.expect("health open"), 1);
}

#[tokio::test]
async fn health_can_require_the_token_too() {
    let server = start_server_with_options(ServerOptions {
        auth: AuthConfig {
            token: BearerToken::new(TOKEN).ok(),
            protect_health: true,
            ..Default::default()
        },
        ..Default::default()
    })
    .await;
    let err = health_status(server.channel().await)
        .await
        .expect_err("health needs the token");
    assert_eq!(err.code(), tonic::Code::Unauthenticated);
}

#[cfg(unix)]
#[tokio::test]
async fn over_a_unix_socket_with_a_token_file() {
    use std::os::unix::fs::PermissionsExt;

    let dir = std::env::temp_dir().join(format!("compactd-uds-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let sock = dir.join("compactd.sock");
    let token_file = dir.join("token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).expect("token file");

    let listen = format!("unix:{}", sock.display());
    let mut bin = Binary::start(
        &[
            "--listen",
            &listen,
            "--auth-token-file",
            token_file.to_str().expect("utf-8 path"),
        ],
        &[("COMPACTD_LOG", "debug")],
    );
    assert_eq!(bin.addr, listen);
    let mode = std::fs::metadata(&sock)
        .expect("socket exists")
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(mode, 0o600, "the socket is private by default");

    let path = sock.clone();
    let channel = Endpoint::try_from("http://localhost")
        .expect("endpoint")
        .connect_timeout(Duration::from_secs(5))
        .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
            let path = path.clone();
            async move {
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                    tokio::net::UnixStream::connect(path).await?,
                ))
            }
        }))
        .await
        .expect("connect over the socket");

    let err = SessionsClient::new(channel.clone())
        .list_sessions(pb::ListSessionsRequest::default())
        .await
        .expect_err("no token");
    assert_eq!(err.code(), tonic::Code::Unauthenticated);
    let mut right = with_token(channel, TOKEN);
    right
        .open_session(pb::OpenSessionRequest {
            session: Some(session("over-uds")),
        })
        .await
        .expect("the token from the file (newline trimmed) works");

    bin.sigterm();
    let status = bin.wait_exit().await;
    assert!(status.success(), "{status:?}");
    let log = bin.finish();
    assert!(!log.contains(TOKEN), "the token never reaches the logs");
    assert!(!sock.exists(), "the socket file is removed on exit");
    std::fs::remove_dir_all(&dir).ok();
}

/// A second server on a live Unix socket is refused instead of taking the path (the
/// first would keep its sessions out of reach, and its exit would delete the second's
/// socket); a stale socket (its server killed) is still replaced, and removed on exit.
#[tokio::test]
async fn a_live_unix_socket_is_not_taken_over_and_a_stale_one_is_replaced() {
    let dir = tempfile::tempdir().expect("temp dir");
    let sock = dir.path().join("compactd.sock");
    let listen = format!("unix:{}", sock.display());
    let args = ["--listen", listen.as_str(), "--durability", "memory"];
    let first = Binary::start(&args, &[]);
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_compactd"))
        .arg("serve")
        .args(args)
        // Started by mistake, it exits at once (its stdin is closed).
        .arg("--exit-on-stdin-eof")
        .env_remove("COMPACTD_LISTEN")
        .output()
        .expect("runs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a second server started: {err}");
    assert!(err.contains("another process is listening"), "{err}");
    std::os::unix::net::UnixStream::connect(&sock).expect("the first still answers");

    // Killed without its cleanup: the socket file stays, stale.
    std::process::Command::new("kill")
        .args(["-KILL", &first.pid().to_string()])
        .status()
        .expect("kill");
    drop(first);
    for _ in 0..100 {
        if std::os::unix::net::UnixStream::connect(&sock).is_err() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(sock.exists(), "the stale socket file stays");
    let mut again = Binary::start(&args, &[]);
    std::os::unix::net::UnixStream::connect(&sock).expect("the new server answers");
    again.sigterm();
    assert!(again.wait_exit().await.success());
    assert!(!sock.exists(), "its own socket is removed on exit");
}

/// Under umask 000 the socket is never seen at its path with a mode other than 0600, and
/// nothing of its making is left beside it. A thread stats the path without pause while
/// the server starts, 20 times (the window is a few microseconds wide). Before, the socket
/// was bound at the path itself (mode 0777 under umask 000, connectable by anyone) and
/// chmodded after: the poller saw 0777 in 2 to 12 of the 20 starts, in each of 8 runs.
#[cfg(unix)]
#[tokio::test]
async fn under_umask_000_the_socket_is_never_seen_with_another_mode_than_0600() {
    use std::collections::BTreeSet;
    use std::os::unix::fs::PermissionsExt;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    let mut wide_open = 0;
    for round in 0..20 {
        let dir = tempfile::tempdir().expect("temp dir");
        let sock = dir.path().join("compactd.sock");
        let listen = format!("unix:{}", sock.display());
        let (stop, seen) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicBool::new(false)),
        );
        let poller = {
            let (sock, stop, seen) = (sock.clone(), stop.clone(), seen.clone());
            std::thread::spawn(move || {
                let mut modes = BTreeSet::new();
                while !stop.load(Ordering::Relaxed) {
                    if let Ok(meta) = std::fs::symlink_metadata(&sock) {
                        modes.insert(meta.permissions().mode() & 0o777);
                        seen.store(true, Ordering::Relaxed);
                    }
                }
                modes
            })
        };
        // The start line comes after the socket is in place; the poller, on a busy
        // machine, may see it only later.
        let mut bin =
            Binary::start_under_umask("000", &["--listen", &listen, "--durability", "memory"], &[]);
        for _ in 0..500 {
            if seen.load(Ordering::Relaxed) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        stop.store(true, Ordering::Relaxed);
        let modes = poller.join().expect("the poller");
        let beside: Vec<_> = std::fs::read_dir(dir.path())
            .expect("read the dir")
            .map(|e| e.expect("an entry").file_name())
            .collect();
        // The first server exits as it would in use; the others are killed (a clean
        // exit waits for the tokenizer's warm-up, a second and more in a debug build).
        let clean_exit = round == 0;
        if clean_exit {
            bin.sigterm();
            assert!(bin.wait_exit().await.success());
        } else {
            bin.finish();
        }
        let octal: Vec<_> = modes.iter().map(|m| format!("{m:o}")).collect();
        assert!(
            modes.contains(&0o600),
            "the socket was seen in place: {octal:?}"
        );
        if modes != BTreeSet::from([0o600]) {
            wide_open += 1;
            eprintln!("modes seen at the path: {octal:?}");
        }
        assert_eq!(beside, [std::ffi::OsString::from("compactd.sock")]);
        if clean_exit {
            assert!(!sock.exists(), "the socket is removed on exit");
            assert_eq!(
                std::fs::read_dir(dir.path()).expect("read the dir").count(),
                0,
                "nothing is left beside it"
            );
        }
    }
    assert_eq!(
        wide_open, 0,
        "starts whose socket was seen with another mode"
    );
}
