//! The README's grpcurl walk-through, run as written against the real `compactd` binary.
//!
//! The commands come from README.md (between the `walkthrough` markers), so the README
//! cannot drift from what works. grpcurl comes from `$GRPCURL` (set by scripts/test.sh)
//! or `PATH`.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

/// The server process; killed when the test ends, pass or fail.
struct Server {
    child: Child,
    addr: String,
    /// Its data dir, removed with it (the walk-through must not touch the user's).
    _data: tempfile::TempDir,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `compactd serve` on an ephemeral port and reads the bound address from its
/// first JSON log line (the listener is bound before that line is written).
fn start_binary() -> Server {
    let data = tempfile::tempdir().expect("a temp data dir");
    let mut child = Command::new(env!("CARGO_BIN_EXE_compactd"))
        .args(["serve", "--listen", "127.0.0.1:0", "--log-format", "json"])
        .arg("--data-dir")
        .arg(data.path())
        .env("COMPACTD_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("compactd starts");
    let stderr = child.stderr.take().expect("stderr piped");
    let mut lines = BufReader::new(stderr).lines();
    let addr = loop {
        let line = lines
            .next()
            .expect("compactd logged a start line")
            .expect("utf-8 log");
        let v: serde_json::Value = serde_json::from_str(&line).expect("json log line");
        if let Some(listen) = v["fields"]["listen"].as_str() {
            break listen.to_string();
        }
    };
    // Keep draining the log so the child never blocks on a full pipe.
    std::thread::spawn(move || for _ in lines {});
    Server {
        child,
        addr,
        _data: data,
    }
}

fn grpcurl() -> PathBuf {
    if let Some(p) = std::env::var_os("GRPCURL").filter(|p| !p.is_empty()) {
        return PathBuf::from(p);
    }
    let found = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("grpcurl"))
            .find(|p| p.is_file())
    });
    found.unwrap_or_else(|| {
        panic!("grpcurl not found: run `bash scripts/test.sh` (installs it) or set GRPCURL")
    })
}

fn repo_root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The shell commands of the README's walk-through block, comments dropped.
fn readme_commands() -> Vec<String> {
    let readme = std::fs::read_to_string(repo_root().join("README.md")).expect("README.md");
    let start = readme
        .find("<!-- walkthrough:start -->")
        .expect("walkthrough start marker");
    let end = readme
        .find("<!-- walkthrough:end -->")
        .expect("walkthrough end marker");
    readme[start..end]
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with("grpcurl "))
        .map(str::to_string)
        .collect()
}

fn run(cmd: &str, addr: &str, grpcurl: &Path) -> String {
    let cmd = cmd.replace("localhost:50051", addr);
    let dir = grpcurl.parent().expect("grpcurl has a directory");
    let path = format!(
        "{}:{}",
        dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    // The README says `grpcurl`; make sure that name means the binary we found.
    let cmd = cmd.replacen("grpcurl ", &format!("{} ", grpcurl.display()), 1);
    let out = Command::new("bash")
        .args(["-c", &cmd])
        .current_dir(repo_root())
        .env("PATH", path)
        .output()
        .expect("bash runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "command failed: {cmd}\nstdout: {stdout}\nstderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

fn json(out: &str) -> serde_json::Value {
    serde_json::from_str(out).unwrap_or_else(|e| panic!("not JSON ({e}): {out}"))
}

#[test]
fn readme_walkthrough_works_against_the_real_binary() {
    let grpcurl = grpcurl();
    let server = start_binary();
    let cmds = readme_commands();
    assert_eq!(
        cmds.len(),
        13,
        "the walk-through has 13 grpcurl commands: {cmds:#?}"
    );
    let outs: Vec<String> = cmds
        .iter()
        .map(|c| run(c, &server.addr, &grpcurl))
        .collect();

    // list: the service, health and reflection.
    for service in [
        "compactd.v1.Sessions",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    ] {
        assert!(
            outs[0].lines().any(|l| l == service),
            "list lacks {service}: {}",
            outs[0]
        );
    }
    let open = json(&outs[1]);
    assert_eq!(open["id"], "hello");
    assert_eq!(open["created"], true);
    assert_eq!(json(&outs[2])["events"][0]["ack"]["kind"], "upsert_message");
    assert_eq!(json(&outs[3])["events"][0]["ack"]["kind"], "upsert_part");

    let import = json(&outs[4]);
    assert_eq!(import["id"], "demo");
    assert_eq!(import["messages"], 11);

    let overflow = json(&outs[5]);
    assert_eq!(overflow["overflow"], true, "{overflow}");
    assert_eq!(overflow["threshold"], "11040");
    assert_eq!(overflow["crossed"], "used");

    let dry = json(&outs[6]);
    assert_eq!(dry["dryRun"], true);
    assert!(
        dry.get("committed").is_none(),
        "a dry run commits nothing: {dry}"
    );
    let real = json(&outs[7]);
    assert_eq!(real["committed"], true);
    assert_eq!(dry["parts"], real["parts"], "dry run and real prune agree");
    // Counted with o200k (the default for a session that names no model).
    assert_eq!(real["parts"].as_array().map(Vec::len), Some(3));

    // The strategies (on by default) marked what newer calls made stale (the first of two
    // identical test runs) and capped the oversized read.
    let marked = real["marked"].as_array().expect("strategies marked parts");
    let supersedes: Vec<&serde_json::Value> = marked
        .iter()
        .filter(|m| m["supersededBy"].is_string())
        .collect();
    assert!(
        supersedes
            .iter()
            .any(|m| m["strategy"] == "supersedeDuplicates" && m["tool"] == "bash"),
        "{real}"
    );
    assert!(
        marked
            .iter()
            .any(|m| m["strategy"] == "capLargeOutputs" && m["tool"] == "read"),
        "{real}"
    );
    assert_eq!(dry["marked"], real["marked"], "dry run and real run agree");

    let context = json(&outs[8]);
    let tool_contents: Vec<&str> = context["openaiMessages"]
        .as_array()
        .expect("openai messages")
        .iter()
        .filter(|m| m["role"] == "tool")
        .filter_map(|m| m["content"].as_str())
        .collect();
    let cleared = tool_contents
        .iter()
        .filter(|c| **c == "[Old tool result content cleared]")
        .count();
    let superseded = tool_contents
        .iter()
        .filter(|c| c.starts_with("[Superseded by a newer call: "))
        .count();
    assert_eq!(superseded, supersedes.len(), "{tool_contents:?}");
    assert!(
        cleared >= 1,
        "prune cleared what no strategy had: {tool_contents:?}"
    );

    // The same messages as one JSON text.
    let as_json = json(&outs[9]);
    let text = as_json["openaiMessagesJson"].as_str().expect("JSON text");
    assert_eq!(json(text), context["openaiMessages"], "both shapes agree");
    assert!(as_json.get("openaiMessages").is_none(), "{as_json}");

    let session = json(&outs[10]);
    let compacted: Vec<&serde_json::Value> = session["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .flat_map(|m| m["parts"].as_array().into_iter().flatten())
        .filter(|p| p["tool"]["state"]["time"]["compacted"].is_string())
        .collect();
    assert_eq!(
        compacted.len(),
        real["parts"].as_array().map_or(0, Vec::len)
    );
    for p in compacted {
        let output = p["tool"]["state"]["output"].as_str().expect("output kept");
        assert!(output.len() > 1000, "original output kept after prune");
    }

    let list = json(&outs[11]);
    assert_eq!(list["sessions"].as_array().map(Vec::len), Some(2));
    assert_eq!(json(&outs[12])["deleted"], true);
}
