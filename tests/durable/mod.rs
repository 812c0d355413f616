//! Issue 14, sessions survive restarts and crashes: the real `compactd` binary with its
//! durable store (`--data-dir`, `--durability`), killed or stopped and started again on
//! the same data dir.
//!
//! - `crash.rs`: concurrent clients stream updates into many sessions; the process is
//!   killed with SIGKILL at random moments (some of them during a compaction), restarted
//!   on the same dir, and every session must read as a reference server (`--durability
//!   memory`) fed the acknowledged updates reads (plus, for updates in flight when the
//!   kill hit, some prefix of them).
//! - `restart.rs`: 1,000 sessions built from the shared traces survive a clean restart
//!   byte for byte; the restore time is printed (`--nocapture`).
//! - `cold.rs`: with a small memory budget, ten times more sessions than fit are created
//!   and read back; held bytes stay under the budget, cold sessions load back, and a
//!   cold session's `DeleteSession` removes it from disk. Also: a session sent cold after
//!   one of its parts was deleted loads back.
//!
//! The helpers below: starting and killing the binary on a given data dir, a Stream driver
//! that reports a dead server instead of panicking, a session's state (`GetSession` and
//! `GetContext`) compared without the fields that may differ after a restore, `/metrics`
//! scraping and a seeded RNG. `scrape` and `metric` are copies of the helpers in
//! `tests/grpc/metrics.rs` (private there).

mod cold;
mod crash;
mod restart;

use std::path::Path;
use std::process::Command;
use std::time::{SystemTime, UNIX_EPOCH};

use compactd::server::pb;
use compactd::server::pb::client_update::Update;
use compactd::server::pb::server_event::Event;
use prost::Message as _;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use crate::common::binary::Binary;
use crate::common::*;

/// A client of the binary at `addr` (`host:port`), with 64 MiB message limits.
pub async fn connect(addr: &str) -> Client {
    pb::sessions_client::SessionsClient::connect(format!("http://{addr}"))
        .await
        .unwrap_or_else(|e| panic!("connect to compactd at {addr}: {e}"))
        .max_decoding_message_size(CLIENT_MAX_MESSAGE)
        .max_encoding_message_size(CLIENT_MAX_MESSAGE)
}

/// `compactd serve --data-dir <dir> --durability <durability>` plus `extra`.
pub fn start_on(dir: &Path, durability: &str, extra: &[&str], env: &[(&str, &str)]) -> Binary {
    let dir = dir.to_str().expect("a UTF-8 temp path");
    let mut args = vec!["--data-dir", dir, "--durability", durability];
    args.extend_from_slice(extra);
    Binary::start(&args, env)
}

/// SIGKILL, then reaps the process; returns its log.
pub fn sigkill(bin: Binary) -> String {
    let status = Command::new("kill")
        .args(["-KILL", &bin.pid().to_string()])
        .status()
        .expect("kill runs");
    assert!(status.success(), "kill -KILL {}", bin.pid());
    bin.finish()
}

/// SIGTERM, waits for a clean exit; returns the log.
pub async fn sigterm(mut bin: Binary) -> String {
    bin.sigterm();
    let status = bin.wait_exit().await;
    let log = bin.finish();
    assert!(status.success(), "compactd exited with {status:?}:\n{log}");
    log
}

/// A fresh data dir, removed (with its content) on drop; `what` names it.
pub fn data_dir(what: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("compactd-durable-{what}-"))
        .tempdir()
        .expect("create the data dir")
}

/// The last `n` lines of a log, for failure messages.
pub fn tail(log: &str, n: usize) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Wall-clock time in epoch milliseconds (what hosts put in their timestamps).
pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

// ---- a session's state ----

/// What a client can read of a session: `GetSession` and `GetContext` (both shapes),
/// with `held_bytes` and `created` cleared (`held_bytes` depends on the allocation
/// history, which a restore does not repeat; `created` says what the call did).
#[derive(Clone, Debug, PartialEq)]
pub struct State {
    pub session: pb::GetSessionResponse,
    pub context: pb::Context,
}

impl State {
    /// Both replies, encoded: what "byte for byte" compares.
    pub fn encoded(&self) -> (Vec<u8>, Vec<u8>) {
        (self.session.encode_to_vec(), self.context.encode_to_vec())
    }

    /// The same state with every time the server took from its own clock set to 0:
    /// the prune stamp (`time.compacted`) and a strategy mark's `time`. A server fed
    /// the same updates later stamps later; everything else must be equal.
    pub fn without_server_clock(mut self) -> State {
        let parts = self
            .session
            .messages
            .iter_mut()
            .chain(self.context.messages.iter_mut())
            .flat_map(|m| m.parts.iter_mut());
        for p in parts {
            if let Some(mark) = &mut p.mark {
                mark.time = 0;
            }
            if let Some(pb::part::Kind::Tool(t)) = &mut p.kind
                && let Some(time) = t.state.as_mut().and_then(|s| s.time.as_mut())
                && time.compacted.is_some()
            {
                time.compacted = Some(0);
            }
        }
        self
    }
}

/// The session's state, or None when the server does not know it (NOT_FOUND).
pub async fn read_state(c: &mut Client, sid: &str) -> Option<State> {
    let session = c
        .get_session(pb::GetSessionRequest {
            session_id: sid.to_string(),
        })
        .await;
    let mut session = match session {
        Ok(r) => r.into_inner(),
        Err(s) if s.code() == tonic::Code::NotFound => return None,
        Err(s) => panic!("GetSession {sid}: {s:?}"),
    };
    if let Some(summary) = &mut session.summary {
        summary.held_bytes = 0;
        summary.created = false;
    }
    let context = c
        .get_context(pb::GetContextRequest {
            session_id: sid.to_string(),
            format: pb::ContextFormat::Unspecified as i32,
        })
        .await
        .unwrap_or_else(|s| panic!("GetContext {sid}: {s:?}"))
        .into_inner();
    Some(State { session, context })
}

/// Where two states first differ, briefly (a whole session is too long to print).
pub fn first_difference(a: &Option<State>, b: &Option<State>) -> String {
    let (a, b) = match (a, b) {
        (Some(a), Some(b)) => (a, b),
        (a, b) => {
            return format!(
                "one side has no session: left {}, right {}",
                a.is_some(),
                b.is_some()
            );
        }
    };
    if a.session.info != b.session.info {
        return format!("info: {:?}\n  vs {:?}", a.session.info, b.session.info);
    }
    if a.session.summary != b.session.summary {
        return format!(
            "summary: {:?}\n  vs {:?}",
            a.session.summary, b.session.summary
        );
    }
    let messages = |what: &str, x: &[pb::Message], y: &[pb::Message]| -> Option<String> {
        if x.len() != y.len() {
            let ids = |ms: &[pb::Message]| -> Vec<String> {
                ms.iter()
                    .map(|m| m.info.as_ref().map_or(String::new(), |i| i.id.clone()))
                    .collect()
            };
            return Some(format!(
                "{what}: {} vs {} messages: {:?}\n  vs {:?}",
                x.len(),
                y.len(),
                ids(x),
                ids(y)
            ));
        }
        for (m, n) in x.iter().zip(y) {
            if m.info != n.info {
                return Some(format!("{what} message: {:?}\n  vs {:?}", m.info, n.info));
            }
            if m.parts.len() != n.parts.len() {
                let ids =
                    |m: &pb::Message| m.parts.iter().map(|p| p.id.clone()).collect::<Vec<_>>();
                return Some(format!(
                    "{what} parts of {:?}: {:?} vs {:?}",
                    m.info.as_ref().map(|i| &i.id),
                    ids(m),
                    ids(n)
                ));
            }
            for (p, q) in m.parts.iter().zip(&n.parts) {
                if p != q {
                    let short = |p: &pb::Part| {
                        let s = format!("{p:?}");
                        s.chars().take(1500).collect::<String>()
                    };
                    return Some(format!(
                        "{what} part {}: {}\n  vs {}",
                        p.id,
                        short(p),
                        short(q)
                    ));
                }
            }
        }
        None
    };
    if let Some(d) = messages("GetSession", &a.session.messages, &b.session.messages) {
        return d;
    }
    if let Some(d) = messages("GetContext", &a.context.messages, &b.context.messages) {
        return d;
    }
    let (mut x, mut y) = (a.context.clone(), b.context.clone());
    x.messages.clear();
    y.messages.clear();
    if x.openai_messages != y.openai_messages {
        return "GetContext openai_messages differ".to_string();
    }
    format!("GetContext: {x:?}\n  vs {y:?}")
}

// ---- updates ----

/// A Stream driver that, unlike `EventStream`, tells a dead server apart from a refusal
/// instead of panicking (the crash test kills the server under it).
pub struct Pipe {
    tx: mpsc::Sender<pb::ClientUpdate>,
    events: tonic::Streaming<pb::ServerEvent>,
    next_seq: u64,
}

/// How an update sent on a [`Pipe`] was answered.
#[derive(Debug)]
pub enum Answer {
    /// Acknowledged.
    Ack,
    /// Refused.
    Refused(pb::Error),
    /// The stream ended or broke before the answer (the server is gone).
    Gone(String),
}

impl Pipe {
    pub async fn open(c: &mut Client) -> Result<Pipe, tonic::Status> {
        let (tx, rx) = mpsc::channel(256);
        let events = c.stream(ReceiverStream::new(rx)).await?.into_inner();
        Ok(Pipe {
            tx,
            events,
            next_seq: 1,
        })
    }

    /// Sends `update` for `sid`; its seq, or None when the stream is closed.
    pub async fn send(&mut self, sid: &str, update: Update) -> Option<u64> {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.tx
            .send(pb::ClientUpdate {
                seq,
                session_id: sid.to_string(),
                update: Some(update),
            })
            .await
            .ok()?;
        Some(seq)
    }

    /// Reads the answer to `seq` (updates are answered in the order sent).
    pub async fn answer(&mut self, seq: u64) -> Answer {
        loop {
            let e = match self.events.message().await {
                Ok(Some(e)) => e,
                Ok(None) => return Answer::Gone("the stream ended".into()),
                Err(s) => return Answer::Gone(format!("{s:?}")),
            };
            assert_eq!(e.seq, seq, "answers come in the order sent: {e:?}");
            match e.event {
                Some(Event::Ack(_)) => return Answer::Ack,
                Some(Event::Error(err)) => return Answer::Refused(err),
                _ => {}
            }
        }
    }

    /// Sends and waits for the answer.
    pub async fn request(&mut self, sid: &str, update: Update) -> Answer {
        match self.send(sid, update).await {
            Some(seq) => self.answer(seq).await,
            None => Answer::Gone("the stream is closed".into()),
        }
    }
}

/// Applies `update` to `sid` through its unary twin (`OpenSession`, `UpsertPart`, ...).
pub async fn unary(c: &mut Client, sid: &str, update: &Update) -> Result<(), tonic::Status> {
    let session_id = sid.to_string();
    match update.clone() {
        Update::Open(mut info) => {
            info.id = session_id;
            c.open_session(pb::OpenSessionRequest {
                session: Some(info),
            })
            .await
            .map(drop)
        }
        Update::UpsertMessage(m) => c
            .upsert_message(pb::UpsertMessageRequest {
                session_id,
                message: Some(m),
            })
            .await
            .map(drop),
        Update::UpsertPart(p) => c
            .upsert_part(pb::UpsertPartRequest {
                session_id,
                part: Some(p),
            })
            .await
            .map(drop),
        Update::DeletePart(r) => c
            .delete_part(pb::DeletePartRequest {
                session_id,
                message_id: r.message_id,
                part_id: r.part_id,
            })
            .await
            .map(drop),
        Update::ReportUsage(u) => c
            .report_usage(pb::ReportUsageRequest {
                session_id,
                usage: Some(u),
            })
            .await
            .map(drop),
        Update::Pin(p) => c
            .pin(pb::PinRequest {
                session_id,
                message_id: p.message_id,
                part_id: p.part_id,
                pinned: p.pinned,
            })
            .await
            .map(drop),
        other => panic!("no unary twin used for {other:?}"),
    }
}

pub use crate::common::metrics::{metric, scrape, try_scrape};

// ---- traces ----

/// One shared trace, parsed: its `info` and its messages, each with its encoded length.
pub struct Trace {
    pub info: serde_json::Value,
    pub messages: Vec<(serde_json::Value, usize)>,
}

impl Trace {
    /// Every trace in `tests/data/traces/`.
    pub fn all() -> Vec<Trace> {
        trace_files()
            .into_iter()
            .map(|path| {
                let text = std::fs::read_to_string(&path).expect("trace readable");
                let mut doc: serde_json::Value = serde_json::from_str(&text).expect("trace JSON");
                let messages = match doc["messages"].take() {
                    serde_json::Value::Array(ms) => ms,
                    _ => panic!("{} has no messages", path.display()),
                };
                Trace {
                    info: doc["info"].take(),
                    messages: messages
                        .into_iter()
                        .map(|m| {
                            let len = serde_json::to_string(&m).expect("encode").len();
                            (m, len)
                        })
                        .collect(),
                }
            })
            .collect()
    }

    /// Bytes of the whole export.
    pub fn bytes(&self) -> usize {
        self.messages.iter().map(|(_, n)| n).sum()
    }

    /// The longest prefix of at least one message whose messages take at most `cap`
    /// bytes, as an `opencode export` document, and its number of messages.
    pub fn prefix(&self, cap: usize) -> (String, usize) {
        let mut used = 0;
        let mut k = 0;
        for (_, n) in &self.messages {
            if k > 0 && used + n > cap {
                break;
            }
            used += n;
            k += 1;
        }
        let messages: Vec<&serde_json::Value> = self.messages[..k].iter().map(|(m, _)| m).collect();
        let doc = serde_json::json!({ "info": self.info, "messages": messages });
        (doc.to_string(), k)
    }
}

/// Checks that `session` holds what `export_json` (an `opencode export` document) holds,
/// followed by `more` messages sent after it: the same messages and parts (by id, in
/// order), the text of text parts and the output of tool parts. Returns the number of
/// parts checked.
pub fn assert_holds_export(
    session: &pb::GetSessionResponse,
    export_json: &str,
    more: usize,
    what: &str,
) -> usize {
    let doc: serde_json::Value = serde_json::from_str(export_json).expect("export JSON");
    let messages = doc["messages"].as_array().expect("messages");
    assert_eq!(
        session.messages.len(),
        messages.len() + more,
        "{what}: the messages sent"
    );
    let stored: Vec<&pb::Message> = session.messages[..messages.len()].iter().collect();
    let want_ids: Vec<&str> = messages
        .iter()
        .map(|m| m["info"]["id"].as_str().unwrap_or(""))
        .collect();
    let got_ids: Vec<&str> = stored
        .iter()
        .map(|m| m.info.as_ref().map_or("", |i| i.id.as_str()))
        .collect();
    assert_eq!(got_ids, want_ids, "{what}: the messages sent");
    let mut checked = 0;
    for (m, s) in messages.iter().zip(&stored) {
        let parts = m["parts"].as_array().map_or(&[][..], |p| p.as_slice());
        let want: Vec<&str> = parts
            .iter()
            .map(|p| p["id"].as_str().unwrap_or(""))
            .collect();
        let got: Vec<&str> = s.parts.iter().map(|p| p.id.as_str()).collect();
        assert_eq!(
            got, want,
            "{what}: the parts of message {:?}",
            m["info"]["id"]
        );
        for (p, q) in parts.iter().zip(&s.parts) {
            match &q.kind {
                Some(pb::part::Kind::Text(t)) => {
                    assert_eq!(
                        Some(t.text.as_str()),
                        p["text"].as_str(),
                        "{what}: text of {}",
                        q.id
                    );
                    checked += 1;
                }
                Some(pb::part::Kind::Tool(t)) => {
                    let output = t.state.as_ref().map_or("", |s| s.output.as_str());
                    let sent = p["state"]["output"].as_str().unwrap_or("");
                    assert_eq!(output, sent, "{what}: output of {}", q.id);
                    checked += 1;
                }
                _ => {}
            }
        }
    }
    checked
}

// ---- a seeded RNG ----

/// SplitMix64: small, seedable, good enough to pick sizes and moments.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    /// A generator for a sub-task, independent of how much this one is used.
    pub fn fork(seed: u64, stream: u64) -> Rng {
        let mut r = Rng(seed ^ stream.wrapping_mul(0xA076_1D64_78BD_642F));
        r.next();
        r
    }

    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        assert!(lo < hi);
        lo + self.next() % (hi - lo)
    }

    /// Uniform in `0..n`.
    pub fn below(&mut self, n: usize) -> usize {
        self.range(0, n as u64) as usize
    }

    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        ((self.next() >> 11) as f64 / (1u64 << 53) as f64) < p
    }
}

/// The seed from `var`, or a fresh one; printed either way so a failure can be rerun.
pub fn seed(var: &str) -> u64 {
    let seed = std::env::var(var)
        .ok()
        .map(|s| {
            s.parse()
                .unwrap_or_else(|_| panic!("{var}={s:?} is not a u64"))
        })
        .unwrap_or_else(|| {
            let t = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .expect("clock")
                .as_nanos() as u64;
            Rng::new(t ^ u64::from(std::process::id())).next()
        });
    eprintln!("seed: {var}={seed}");
    seed
}
