//! Ingest under each durability mode, on the real release binary over loopback: many
//! concurrent `Stream`s, each filling its own session with turns of 4 KB tool outputs.
//! Prints updates per second, ack latency (p50, p99), and disk bytes per session against
//! the raw text bytes sent.
//!
//! Run: `cargo bench --bench durability` (env `STREAMS`, `TURNS` override the workload,
//! `MODES` the durability modes compared, e.g. `MODES=sync`).

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use compactd::server::pb;
use compactd::server::pb::client_update::Update;
use compactd::server::pb::server_event::Event;
use compactd::server::pb::sessions_client::SessionsClient;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

/// Parts of 4 KB per assistant turn.
const PARTS_PER_TURN: usize = 8;
const PART_BYTES: usize = 4096;
/// Updates a stream keeps in flight (sent, not yet acknowledged).
const WINDOW: usize = 64;

fn main() {
    let streams = env_or("STREAMS", 64);
    let turns = env_or("TURNS", 12);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    println!(
        "workload: {streams} streams, each its own session: {turns} turns of 1 user message + 1 assistant message + {PARTS_PER_TURN} tool parts of {PART_BYTES} B (window {WINDOW})"
    );
    println!(
        "{:<14} {:>10} {:>12} {:>10} {:>10} {:>14} {:>14}",
        "durability", "updates", "updates/s", "p50 ms", "p99 ms", "disk B/session", "raw B/session"
    );
    let mut memory_rate = None;
    let modes = std::env::var("MODES").unwrap_or_else(|_| "memory,interval=100,sync".into());
    for mode in modes.split(',') {
        let r = runtime.block_on(run(mode, streams, turns));
        if mode == "memory" {
            memory_rate = Some(r.rate);
        }
        println!(
            "{:<14} {:>10} {:>12.0} {:>10.2} {:>10.2} {:>14} {:>14}",
            mode,
            r.updates,
            r.rate,
            r.p50.as_secs_f64() * 1e3,
            r.p99.as_secs_f64() * 1e3,
            r.disk_per_session.map_or("-".into(), |b| b.to_string()),
            r.raw_per_session
        );
        if let (Some(m), true) = (memory_rate, mode == "sync") {
            println!("sync ingest = {:.0}% of memory's", r.rate / m * 100.0);
        }
    }
}

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

struct Figures {
    updates: usize,
    rate: f64,
    p50: Duration,
    p99: Duration,
    disk_per_session: Option<u64>,
    raw_per_session: u64,
}

async fn run(mode: &str, streams: usize, turns: usize) -> Figures {
    let dir = tempfile::tempdir().expect("a temp dir");
    let (mut child, addr) = start(mode, dir.path());
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
        .expect("endpoint")
        .connect()
        .await
        .expect("connect");
    let began = Instant::now();
    let mut tasks = Vec::new();
    for s in 0..streams {
        let client = SessionsClient::new(channel.clone())
            .max_decoding_message_size(64 << 20)
            .max_encoding_message_size(64 << 20);
        tasks.push(tokio::spawn(drive(client, format!("bench-{s}"), turns)));
    }
    let mut latencies = Vec::new();
    let mut raw = 0u64;
    for t in tasks {
        let (lat, bytes) = t.await.expect("a stream task");
        latencies.extend(lat);
        raw += bytes;
    }
    let took = began.elapsed();
    latencies.sort();
    let pct = |p: f64| latencies[((latencies.len() as f64 - 1.0) * p) as usize];
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let _ = child.wait();
    let disk =
        (mode != "memory" && mode != "legacy").then(|| dir_bytes(dir.path()) / streams as u64);
    Figures {
        updates: latencies.len(),
        rate: latencies.len() as f64 / took.as_secs_f64(),
        p50: pct(0.50),
        p99: pct(0.99),
        disk_per_session: disk,
        raw_per_session: raw / streams as u64,
    }
}

fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(Result::ok)
                .filter_map(|e| e.metadata().ok())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

/// Starts the release binary and reads its address from the JSON start line (the caller
/// stops and waits for it).
#[allow(clippy::zombie_processes)]
fn start(mode: &str, dir: &Path) -> (Child, String) {
    // `COMPACTD_BIN` runs another build (e.g. one from before the durable store, with
    // `MODES=legacy`: no durability flags) against the same load.
    let bin =
        std::env::var("COMPACTD_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_compactd").into());
    let mut cmd = Command::new(bin);
    cmd.args(["serve", "--log-format", "json", "--listen", "127.0.0.1:0"]);
    if mode != "legacy" {
        cmd.args(["--durability", mode, "--data-dir"]).arg(dir);
    }
    let mut child = cmd
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("compactd starts");
    let mut lines = BufReader::new(child.stderr.take().expect("stderr")).lines();
    loop {
        let line = lines.next().expect("a start line").expect("utf-8");
        let v: serde_json::Value = serde_json::from_str(&line).expect("json log");
        if let Some(listen) = v["fields"]["listen"].as_str() {
            let listen = listen.to_string();
            std::thread::spawn(move || for _ in lines.map_while(Result::ok) {});
            return (child, listen);
        }
    }
}

/// One stream: opens its session and sends every turn, `WINDOW` updates in flight.
/// Returns each update's ack latency and the raw text bytes sent.
async fn drive(
    mut client: SessionsClient<tonic::transport::Channel>,
    sid: String,
    turns: usize,
) -> (Vec<Duration>, u64) {
    let updates = workload(&sid, turns);
    let raw: u64 = updates.iter().map(raw_bytes).sum();
    let (tx, rx) = mpsc::channel(WINDOW);
    let mut events = client
        .stream(ReceiverStream::new(rx))
        .await
        .expect("stream opens")
        .into_inner();
    let mut sent_at = Vec::with_capacity(updates.len());
    let mut latencies = Vec::with_capacity(updates.len());
    let total = updates.len();
    let mut queue = updates.into_iter().enumerate();
    let mut in_flight = 0usize;
    loop {
        while in_flight < WINDOW {
            let Some((i, u)) = queue.next() else { break };
            sent_at.push(Instant::now());
            tx.send(pb::ClientUpdate {
                seq: i as u64 + 1,
                session_id: sid.clone(),
                update: Some(u),
            })
            .await
            .expect("send");
            in_flight += 1;
        }
        if latencies.len() == total {
            break;
        }
        let ev = events
            .message()
            .await
            .expect("an event")
            .expect("the stream stays open");
        match ev.event {
            Some(Event::Ack(_)) => {
                let i = usize::try_from(ev.seq).expect("seq") - 1;
                latencies.push(sent_at[i].elapsed());
                in_flight -= 1;
            }
            Some(Event::Error(e)) => panic!("update {} refused: {e:?}", ev.seq),
            _ => {}
        }
    }
    (latencies, raw)
}

fn raw_bytes(u: &Update) -> u64 {
    match u {
        Update::UpsertPart(p) => match &p.kind {
            Some(pb::part::Kind::Tool(t)) => t.state.as_ref().map_or(0, |s| s.output.len() as u64),
            Some(pb::part::Kind::Text(t)) => t.text.len() as u64,
            _ => 0,
        },
        _ => 0,
    }
}

fn workload(sid: &str, turns: usize) -> Vec<Update> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64);
    let mut u = vec![Update::Open(pb::SessionInfo {
        id: sid.to_string(),
        ..Default::default()
    })];
    for t in 0..turns {
        let user = format!("u{t}");
        let asst = format!("a{t}");
        u.push(Update::UpsertMessage(pb::MessageInfo {
            id: user.clone(),
            role: "user".into(),
            time: Some(pb::MessageTime {
                created: now,
                completed: None,
            }),
            agent: "build".into(),
            ..Default::default()
        }));
        u.push(Update::UpsertPart(pb::Part {
            id: format!("{user}-text"),
            message_id: user.clone(),
            kind: Some(pb::part::Kind::Text(pb::TextPart {
                text: format!("turn {t}: run the tests and fix what fails"),
                ..Default::default()
            })),
            ..Default::default()
        }));
        let mut assistant = pb::MessageInfo {
            id: asst.clone(),
            role: "assistant".into(),
            parent_id: user.clone(),
            time: Some(pb::MessageTime {
                created: now,
                completed: None,
            }),
            agent: "build".into(),
            mode: "build".into(),
            ..Default::default()
        };
        u.push(Update::UpsertMessage(assistant.clone()));
        for p in 0..PARTS_PER_TURN {
            let id = format!("{asst}-p{p}");
            let mut output = format!("{sid} {id}: ");
            while output.len() < PART_BYTES {
                output.push_str("test result line ok 0.01s\n");
            }
            output.truncate(PART_BYTES);
            u.push(Update::UpsertPart(pb::Part {
                id: id.clone(),
                message_id: asst.clone(),
                kind: Some(pb::part::Kind::Tool(pb::ToolPart {
                    call_id: format!("call-{id}"),
                    tool: "bash".into(),
                    state: Some(pb::ToolState {
                        status: "completed".into(),
                        output,
                        input: Some(prost_types::Struct {
                            fields: [(
                                "command".to_string(),
                                prost_types::Value {
                                    kind: Some(prost_types::value::Kind::StringValue(format!(
                                        "cargo test {id}"
                                    ))),
                                },
                            )]
                            .into(),
                        }),
                        title: id.clone(),
                        time: Some(pb::ToolTime {
                            start: now,
                            end: Some(now),
                            compacted: None,
                        }),
                        ..Default::default()
                    }),
                    metadata: None,
                })),
                ..Default::default()
            }));
        }
        assistant.finish = "stop".into();
        u.push(Update::UpsertMessage(assistant));
    }
    u
}
