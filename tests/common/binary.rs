//! The real `compactd` binary as a child process: started on ephemeral ports, its
//! addresses read from the JSON start log, the rest of its log kept for assertions.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A running `compactd serve`.
pub struct Binary {
    child: Child,
    /// The gRPC address from the start log (`host:port` or `unix:/path`).
    pub addr: String,
    /// The metrics address, when `--metrics-listen` was given.
    pub metrics: Option<String>,
    log: Arc<Mutex<String>>,
    reader: Option<std::thread::JoinHandle<()>>,
    /// The data dir the test did not choose (removed with the binary).
    _data: Option<tempfile::TempDir>,
}

impl Binary {
    /// Starts `compactd serve --log-format json` plus `args` with `env`. Without a
    /// `--listen` in `args` it listens on 127.0.0.1:0; without a `--data-dir` it stores
    /// sessions (durability `sync`, the default) in a fresh temporary directory. Inherited `COMPACTD_*` variables
    /// are removed so only what the test sets applies.
    pub fn start(args: &[&str], env: &[(&str, &str)]) -> Binary {
        Binary::start_with("json", args, env)
    }

    /// Like [`Binary::start`] with the human log format (`--log-format pretty`).
    pub fn start_pretty(args: &[&str], env: &[(&str, &str)]) -> Binary {
        Binary::start_with("pretty", args, env)
    }

    /// Like [`Binary::start`] under an address-space cap of `bytes` (`prlimit --as`),
    /// standing in for a container memory limit: an allocation past it aborts the process.
    pub fn start_capped(bytes: u64, args: &[&str], env: &[(&str, &str)]) -> Binary {
        let cap = format!("--as={bytes}");
        let mut cmd = Command::new("prlimit");
        cmd.args([cap.as_str(), "--", env!("CARGO_BIN_EXE_compactd")]);
        Binary::spawn(cmd, "json", args, env)
    }

    /// Like [`Binary::start`] with at most `n` open file descriptors (`prlimit
    /// --nofile`), standing in for a container's descriptor limit.
    pub fn start_nofile(n: u64, args: &[&str], env: &[(&str, &str)]) -> Binary {
        let cap = format!("--nofile={n}");
        let mut cmd = Command::new("prlimit");
        cmd.args([cap.as_str(), "--", env!("CARGO_BIN_EXE_compactd")]);
        Binary::spawn(cmd, "json", args, env)
    }

    /// Like [`Binary::start`] under the file-creation mask `umask` (octal, as `sh`'s
    /// `umask` takes it): a shell sets it and execs the server.
    #[cfg(unix)]
    pub fn start_under_umask(umask: &str, args: &[&str], env: &[(&str, &str)]) -> Binary {
        let mut cmd = Command::new("sh");
        cmd.args([
            "-c",
            &format!("umask {umask} && exec \"$0\" \"$@\""),
            env!("CARGO_BIN_EXE_compactd"),
        ]);
        Binary::spawn(cmd, "json", args, env)
    }

    fn start_with(format: &str, args: &[&str], env: &[(&str, &str)]) -> Binary {
        Binary::spawn(
            Command::new(env!("CARGO_BIN_EXE_compactd")),
            format,
            args,
            env,
        )
    }

    fn spawn(mut cmd: Command, format: &str, args: &[&str], env: &[(&str, &str)]) -> Binary {
        cmd.args(["serve", "--log-format", format]);
        if !args.contains(&"--listen") {
            cmd.args(["--listen", "127.0.0.1:0"]);
        }
        cmd.args(args);
        let data = (!args.contains(&"--data-dir")).then(|| {
            let dir = tempfile::tempdir().expect("a temp data dir");
            cmd.arg("--data-dir").arg(dir.path());
            dir
        });
        for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("COMPACTD_")) {
            cmd.env_remove(k);
        }
        cmd.envs(env.iter().copied());
        let mut child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("compactd starts");
        let mut lines = BufReader::new(child.stderr.take().expect("stderr")).lines();
        let log = Arc::new(Mutex::new(String::new()));
        let (addr, metrics) = loop {
            let line = lines.next().expect("a start line").expect("utf-8");
            {
                let mut l = log.lock().unwrap();
                l.push_str(&line);
                l.push('\n');
            }
            if format == "pretty" {
                let field = |name: &str| {
                    line.split_whitespace()
                        .find_map(|w| w.strip_prefix(name))
                        .map(str::to_owned)
                };
                if let Some(listen) = field("listen=") {
                    break (listen, field("metrics_listen=").filter(|m| !m.is_empty()));
                }
                continue;
            }
            let v: serde_json::Value = serde_json::from_str(&line).expect("json log");
            if let Some(listen) = v["fields"]["listen"].as_str() {
                let metrics = v["fields"]["metrics_listen"]
                    .as_str()
                    .filter(|m| !m.is_empty())
                    .map(str::to_owned);
                break (listen.to_string(), metrics);
            }
        };
        // Keep reading, so the child never blocks on a full pipe.
        let sink = log.clone();
        let reader = std::thread::spawn(move || {
            for line in lines.map_while(Result::ok) {
                let mut l = sink.lock().unwrap();
                l.push_str(&line);
                l.push('\n');
            }
        });
        Binary {
            child,
            addr,
            metrics,
            log,
            reader: Some(reader),
            _data: data,
        }
    }

    /// The process id (the server itself: `prlimit` execs it).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Resident set size of the process now, in bytes (`VmRSS` in `/proc/<pid>/status`).
    pub fn rss_bytes(&self) -> u64 {
        proc_status_kib(self.pid(), "VmRSS:") * 1024
    }

    /// Peak resident set size so far, in bytes (`VmHWM`).
    pub fn peak_rss_bytes(&self) -> u64 {
        proc_status_kib(self.pid(), "VmHWM:") * 1024
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// The log so far.
    pub fn log_so_far(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    /// Sends SIGTERM.
    pub fn sigterm(&self) {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("kill runs");
        assert!(status.success());
    }

    /// Waits (without blocking the runtime) for the process to exit, at most 10 s.
    pub async fn wait_exit(&mut self) -> ExitStatus {
        for _ in 0..200 {
            if let Some(status) = self.child.try_wait().expect("wait") {
                return status;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let _ = self.child.kill();
        panic!("compactd did not exit within 10 s");
    }

    /// Stops the process (if still running) and returns its whole log.
    pub fn finish(mut self) -> String {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
        self.log.lock().unwrap().clone()
    }
}

/// A `kB` line of `/proc/<pid>/status` (0 when the process is gone).
fn proc_status_kib(pid: u32, key: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix(key))
                .and_then(|v| v.split_whitespace().next())
                .and_then(|n| n.parse().ok())
        })
        .unwrap_or(0)
}

impl Drop for Binary {
    fn drop(&mut self) {
        let _ = self.child.kill();
    }
}
