//! Ingest under each durability mode, on the real release binary over loopback: many
//! concurrent `Stream`s, each filling its own session with turns of 4 KB tool outputs.
//! Prints updates per second, ack latency (p50, p99), and disk bytes per session against
//! the raw text bytes sent.
//!
//! Run: `cargo bench --bench durability` (env `STREAMS`, `TURNS` override the workload,
//! `MODES` the durability modes compared, e.g. `MODES=sync`, `TOKENIZER` the server's
//! tokenizer, e.g. `TOKENIZER=chars4`).
//!
//! The server is started and each stream driven by `compactd bench`'s own helpers
//! (`cli::bench::spawn`, `cli::bench::drive`).

use std::ffi::OsString;
use std::path::Path;
use std::time::{Duration, Instant};

use compactd::cli::bench::drive::{self, Compactd};
use compactd::cli::bench::spawn::Spawned;
use compactd::server::pb;
use compactd::server::pb::client_update::Update;

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
    let server = start(mode, dir.path());
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", server.addr))
        .expect("endpoint")
        .connect()
        .await
        .expect("connect");
    let began = Instant::now();
    let mut tasks = Vec::new();
    for s in 0..streams {
        let wire = Compactd::new(channel.clone());
        tasks.push(tokio::spawn(run_stream(wire, format!("bench-{s}"), turns)));
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
    server.stop();
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

/// Starts the release binary (stopped by the caller).
fn start(mode: &str, dir: &Path) -> Spawned {
    // `COMPACTD_BIN` runs another build (e.g. one from before the durable store, with
    // `MODES=legacy`: no durability flags) against the same load.
    let bin =
        std::env::var("COMPACTD_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_compactd").into());
    let mut args: Vec<OsString> = Vec::new();
    if mode != "legacy" {
        args.extend(["--durability".into(), mode.into(), "--data-dir".into()]);
        args.push(dir.into());
        // `TOKENIZER` counts with another tokenizer than the default (`auto`: o200k for
        // these sessions); `chars4` leaves the most CPU to the store.
        if let Ok(tokenizer) = std::env::var("TOKENIZER") {
            args.extend(["--tokenizer".into(), tokenizer.into()]);
        }
    }
    Spawned::compactd(Path::new(&bin), &args).expect("compactd starts")
}

/// One stream: opens its session and sends every turn, `WINDOW` updates in flight.
/// Returns each update's ack latency and the raw text bytes sent.
async fn run_stream(wire: Compactd, sid: String, turns: usize) -> (Vec<Duration>, u64) {
    let updates = workload(&sid, turns);
    let raw: u64 = updates.iter().map(raw_bytes).sum();
    let total = updates.len();
    let mut queue = updates
        .into_iter()
        .enumerate()
        .map(|(i, u)| pb::ClientUpdate {
            seq: i as u64 + 1,
            session_id: sid.clone(),
            update: Some(u),
        });
    let no_deadline = Instant::now() + Duration::from_secs(24 * 3600);
    let driven = drive::drive(wire, &mut queue, total, WINDOW, no_deadline).await;
    assert_eq!(driven.errors, 0, "{sid}: {:?}", driven.first_error);
    (driven.latencies, raw)
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
