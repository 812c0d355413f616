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
}

impl Binary {
    /// Starts `compactd serve --log-format json` plus `args` with `env`. Without a
    /// `--listen` in `args` it listens on 127.0.0.1:0. Inherited `COMPACTD_*` variables
    /// are removed so only what the test sets applies.
    pub fn start(args: &[&str], env: &[(&str, &str)]) -> Binary {
        Binary::start_with("json", args, env)
    }

    /// Like [`Binary::start`] with the human log format (`--log-format pretty`).
    pub fn start_pretty(args: &[&str], env: &[(&str, &str)]) -> Binary {
        Binary::start_with("pretty", args, env)
    }

    fn start_with(format: &str, args: &[&str], env: &[(&str, &str)]) -> Binary {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_compactd"));
        cmd.args(["serve", "--log-format", format]);
        if !args.contains(&"--listen") {
            cmd.args(["--listen", "127.0.0.1:0"]);
        }
        cmd.args(args);
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
        }
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

impl Drop for Binary {
    fn drop(&mut self) {
        let _ = self.child.kill();
    }
}
