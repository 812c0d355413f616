//! The bench's child processes: a `compactd serve` on 127.0.0.1:0 whose address is read
//! from its JSON start log (as `tests/common/binary.rs` does), and the echo service
//! (`compactd bench --serve-echo`), which prints its address. Both are stopped when their
//! [`Spawned`] is stopped or dropped, so an early error never leaves a server behind.
//! Also: the loopback check on `--target`.

use std::ffi::OsString;
use std::io::{BufRead, BufReader, Read};
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use super::BenchError;

/// How long a child may take to print its address.
const START_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a stopped child gets to exit after SIGTERM before it is killed.
const STOP_GRACE: Duration = Duration::from_secs(10);

/// A running child server.
#[derive(Debug)]
pub struct Spawned {
    child: Child,
    /// Where it listens.
    pub addr: SocketAddr,
    /// Held open: the echo server exits when it closes.
    _stdin: Option<ChildStdin>,
}

impl Spawned {
    /// Starts `bin serve --log-format json --listen 127.0.0.1:0 ARGS` and waits for its
    /// start line. `COMPACTD_*` variables are not passed on: only `args` configure it.
    pub fn compactd(bin: &Path, args: &[OsString]) -> Result<Spawned, BenchError> {
        let mut cmd = Command::new(bin);
        cmd.args(["serve", "--log-format", "json", "--listen", "127.0.0.1:0"])
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        for (k, _) in std::env::vars_os() {
            if k.to_string_lossy().starts_with("COMPACTD_") {
                cmd.env_remove(k);
            }
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| BenchError::Spawn(format!("{} serve: {e}", bin.display())))?;
        let Some(stderr) = child.stderr.take() else {
            return Err(BenchError::Spawn("compactd: no stderr".into()));
        };
        let addr = read_address(stderr, "compactd serve", |v| {
            v["fields"]["listen"].as_str().map(str::to_owned)
        });
        Spawned::started(child, None, addr)
    }

    /// Starts `bin bench --serve-echo` and waits for the address it prints.
    pub fn echo(bin: &Path) -> Result<Spawned, BenchError> {
        let mut child = Command::new(bin)
            .args(["bench", "--serve-echo"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| BenchError::Spawn(format!("{} bench --serve-echo: {e}", bin.display())))?;
        let (Some(stdout), stdin) = (child.stdout.take(), child.stdin.take()) else {
            return Err(BenchError::Spawn("echo: no stdout".into()));
        };
        let addr = read_address(stdout, "the echo server", |v| {
            v["listen"].as_str().map(str::to_owned)
        });
        Spawned::started(child, stdin, addr)
    }

    fn started(
        mut child: Child,
        stdin: Option<ChildStdin>,
        addr: Result<String, BenchError>,
    ) -> Result<Spawned, BenchError> {
        let parsed = addr.and_then(|a| {
            a.parse::<SocketAddr>()
                .map_err(|e| BenchError::Spawn(format!("a listen address {a:?}: {e}")))
        });
        match parsed {
            Ok(addr) => Ok(Spawned {
                child,
                addr,
                _stdin: stdin,
            }),
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                Err(e)
            }
        }
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Asks the process to stop (SIGTERM, so a durable store closes cleanly), and kills it
    /// if it has not exited within a grace period.
    pub fn stop(mut self) {
        self.terminate();
    }

    fn terminate(&mut self) {
        if matches!(self.child.try_wait(), Ok(Some(_))) {
            return;
        }
        #[cfg(unix)]
        {
            let _ = Command::new("kill")
                .args(["-TERM", &self.child.id().to_string()])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
            let until = Instant::now() + STOP_GRACE;
            while Instant::now() < until {
                if matches!(self.child.try_wait(), Ok(Some(_)) | Err(_)) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Spawned {
    fn drop(&mut self) {
        self.terminate();
    }
}

/// Reads lines of `from` until `pick` finds the address in one (JSON) line; keeps
/// reading afterwards on the same thread so the child never blocks on a full pipe.
fn read_address(
    from: impl Read + Send + 'static,
    what: &'static str,
    pick: fn(&serde_json::Value) -> Option<String>,
) -> Result<String, BenchError> {
    let (tx, rx) = mpsc::channel::<Result<String, String>>();
    std::thread::spawn(move || {
        let mut lines = BufReader::new(from).lines();
        let mut seen = Vec::new();
        let mut tx = Some(tx);
        for line in lines.by_ref() {
            let Ok(line) = line else { break };
            if let Some(t) = &tx {
                if let Some(addr) = serde_json::from_str(&line).ok().as_ref().and_then(pick) {
                    let _ = t.send(Ok(addr));
                    tx = None;
                } else if seen.len() < 20 {
                    seen.push(line);
                }
            }
        }
        if let Some(t) = tx {
            let _ = t.send(Err(seen.join("\n")));
        }
    });
    match rx.recv_timeout(START_TIMEOUT) {
        Ok(Ok(addr)) => Ok(addr),
        Ok(Err(log)) => Err(BenchError::Spawn(format!(
            "{what} exited before listening:\n{log}"
        ))),
        Err(_) => Err(BenchError::Spawn(format!(
            "{what} printed no address within {} s",
            START_TIMEOUT.as_secs()
        ))),
    }
}

/// `target` resolved, refused unless every address it names is on this machine
/// (loopback): the bench is a load generator and must not be aimed elsewhere.
pub fn loopback(target: &str) -> Result<SocketAddr, BenchError> {
    let refuse = |why: String| BenchError::Target {
        target: target.to_string(),
        message: why,
    };
    let addrs: Vec<SocketAddr> = target
        .to_socket_addrs()
        .map_err(|e| refuse(format!("not a host:port ({e})")))?
        .collect();
    if let Some(far) = addrs.iter().find(|a| !a.ip().is_loopback()) {
        return Err(refuse(format!(
            "{} is not a loopback address; compactd bench only drives a server on this machine (127.0.0.1, ::1, localhost)",
            far.ip()
        )));
    }
    addrs
        .first()
        .copied()
        .ok_or_else(|| refuse("resolves to no address".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_loopback_targets_are_driven() {
        assert!(loopback("127.0.0.1:50051").is_ok());
        assert!(loopback("[::1]:50051").is_ok());
        let e = loopback("10.1.2.3:50051").expect_err("not loopback");
        assert!(e.to_string().contains("not a loopback address"), "{e}");
        assert!(loopback("nonsense").is_err());
    }
}
