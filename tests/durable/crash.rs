//! The crash test (issue 14): `compactd serve --durability sync` is killed with SIGKILL
//! at random moments while four clients stream updates into sixteen sessions, restarted
//! on the same data dir, and checked against a reference server (`--durability memory`,
//! started once) fed the same acknowledged updates in the same order per session.
//!
//! Each round:
//! 1. The durable server starts on the data dir (the first round on an empty one).
//! 2. Every session is checked (see [`verify`]): the updates acknowledged in the last
//!    round are fed to the reference; each one's messages and parts must be on the
//!    restarted server ("every acknowledged update is present"), and `GetSession` and
//!    `GetContext` must equal the reference's. Updates that were sent but not answered
//!    when the kill hit may or may not have landed: they are fed to the reference one at a
//!    time until the two agree (they must, by the last one), and those that had not
//!    landed are sent again in the next round, as a host resends what was not
//!    acknowledged.
//! 3. Four clients, each owning four sessions, send turns the way a host does: user and
//!    assistant messages, text and tool parts (half of the outputs 4 KB, some sent running
//!    then completed, some errors), usage reports, finished assistant messages (so the
//!    automatic prune and the strategies run: prune's protect window is lowered to 4,000
//!    tokens so it fires within the test), pins and unpins, part deletes and title
//!    changes. Most go on the Stream, pipelined up to six deep; some through the unary
//!    twins.
//! 4. SIGKILL, at a seeded random moment: after a random number of acknowledgements plus
//!    a random pause, or (rounds [`MID_COMPACTION`]) right after the first summary delta
//!    of a manual compaction that streams slowly from the fake LLM. The session being
//!    compacted must then read as the reference, which never compacted: a crash
//!    mid-compaction leaves the session as it was. In round [`COMPACTED`] a compaction
//!    runs to `session.compacted`, the session is read from the live server and the kill
//!    follows at once: after every later restart it must read exactly so (the reference
//!    cannot replay a compaction's ids and times, so that session takes no more updates).
//!
//! The comparisons clear `held_bytes` and `created` (see [`State`]) and, against the
//! reference only, the times the server takes from its own clock (prune stamps, strategy
//! marks): the reference applies each update later than the durable server did. The
//! frozen compacted session is compared with every field, stamps included.
//!
//! Hosts' timestamps are the wall clock at the time each turn is planned, the same bytes
//! on both servers, so the cache-aware scheduler decides the same on both.
//!
//! The durable server runs with a one-second idle TTL, so sessions left alone are
//! written out, sent cold and loaded back; rounds [`ALL_COLD`] wait until every session
//! is cold before the load starts, so the kill hits sessions being loaded back. `COMPACTD_CRASH_BUDGET=<bytes>` adds a
//! memory budget to the durable server (1572864 sends sessions cold for memory all the
//! time; the reference keeps the default).
//!
//! The seed is printed; `COMPACTD_CRASH_SEED=<n>` reruns one (the kill timing still
//! depends on the machine).

use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use compactd::server::pb;
use compactd::server::pb::client_update::Update;
use compactd::server::pb::compaction_event::Event as Ce;
use tokio::sync::watch;

use super::*;
use crate::common::binary::Binary;
use crate::common::fake_llm::{FakeLlm, Reply};

const SESSIONS: usize = 16;
const CLIENTS: usize = 4;
const ROUNDS: usize = 22;
/// Stream updates a client has sent and not yet seen answered, at most.
const WINDOW: usize = 6;
/// Rounds killed right after the first summary delta of a slow compaction.
const MID_COMPACTION: [usize; 3] = [4, 9, 14];
/// The round whose compaction completes before the kill.
const COMPACTED: usize = 17;
/// Rounds whose load starts once every session has gone cold (idle TTL): each first
/// update loads one back, while the others stream and the kill comes.
const ALL_COLD: [usize; 4] = [2, 7, 12, 19];
/// Each session's window: roomy enough that no session overflows (so no automatic
/// compaction, which the reference could not reproduce, ever starts).
const CONTEXT: u64 = 200_000;
const OUTPUT: u64 = 32_000;
/// Most acknowledgements a round waits for before the kill.
const MAX_ACKS: u64 = 150;
/// The slow summary: ten deltas, 300 ms apart.
const SLOW_CHUNK: Duration = Duration::from_millis(300);

/// One update as it was sent.
#[derive(Clone, Debug)]
struct Sent {
    update: Update,
    /// Through its unary twin, not the Stream.
    unary: bool,
}

/// What a session holds once everything planned has applied: enough to plan valid
/// updates (pins and deletes of parts that exist).
#[derive(Default)]
struct Model {
    opened: bool,
    turns: u32,
    /// Parts that exist, (message, part).
    parts: Vec<(String, String)>,
    pinned: Vec<(String, String)>,
    pinned_messages: HashSet<String>,
    /// Rough tokens of everything sent (chars/4).
    tokens: u64,
    /// Usage reports so far (each report's figure is distinct).
    reports: u64,
    titles: u32,
}

/// One session as the test drives it.
struct Sess {
    idx: usize,
    id: String,
    rng: Rng,
    model: Model,
    /// Planned, not yet sent (updates to send again after a crash come first).
    queue: VecDeque<Update>,
    /// Sent in this round, not answered.
    inflight: Vec<Sent>,
    /// Acknowledged in this round, not yet fed to the reference.
    acked: Vec<Sent>,
    total_acked: u64,
    /// After its compaction completed: what it must read as from then on.
    frozen: Option<State>,
}

impl Sess {
    fn new(idx: usize, seed: u64) -> Sess {
        Sess {
            idx,
            id: format!("crash-{idx:02}"),
            rng: Rng::fork(seed, 1_000 + idx as u64),
            model: Model::default(),
            queue: VecDeque::new(),
            inflight: Vec::new(),
            acked: Vec::new(),
            total_acked: 0,
            frozen: None,
        }
    }

    fn next_update(&mut self) -> Update {
        if self.queue.is_empty() {
            self.plan();
        }
        self.queue.pop_front().expect("planned")
    }

    /// The oldest update in flight was acknowledged.
    fn ack_first(&mut self) {
        let sent = self.inflight.remove(0);
        self.acked.push(sent);
    }

    fn info(&self) -> pb::SessionInfo {
        let mut info = session_with_limits(&self.id, CONTEXT, OUTPUT);
        info.title = format!("{} (title {})", self.id, self.model.titles);
        info
    }

    fn next_usage(&mut self) -> pb::TokenUsage {
        self.model.reports += 1;
        usage(self.model.tokens.min(80_000) + self.model.reports)
    }

    fn add_part(&mut self, part: pb::Part, chars: usize) {
        self.model.tokens += chars as u64 / 4;
        let key = (part.message_id.clone(), part.id.clone());
        if !self.model.parts.contains(&key) {
            self.model.parts.push(key);
        }
        self.queue.push_back(upsert_part(part));
    }

    /// Plans the next turn (or the session's open).
    fn plan(&mut self) {
        if !self.model.opened {
            self.model.opened = true;
            let info = self.info();
            self.queue.push_back(open(info));
            return;
        }
        let now = now_ms();
        let t = self.model.turns;
        self.model.turns += 1;
        let (u, a) = (format!("u{t:03}"), format!("a{t:03}"));

        let mut user = user_msg(&u);
        user.time = Some(pb::MessageTime {
            created: now,
            completed: None,
        });
        self.queue.push_back(upsert_message(user));
        let ask = if t.is_multiple_of(3) {
            format!("turn {t}: this fails, fix it\n```rust\nfn f{t}() -> u32 {{ {t} }}\n```\n")
        } else {
            format!("turn {t}: go on with {}", self.id)
        };
        let len = ask.len();
        self.add_part(text_part(&u, &format!("{u}-t"), &ask), len);

        let mut assistant = assistant_msg(&a, &u);
        assistant.time = Some(pb::MessageTime {
            created: now + 1,
            completed: None,
        });
        self.queue.push_back(upsert_message(assistant.clone()));
        for j in 0..1 + self.rng.below(3) {
            let id = format!("{a}-c{j}");
            let tool = ["read", "bash", "grep", "read", "edit"][self.rng.below(5)];
            let size = match self.rng.below(10) {
                0..5 => 4_096,
                5..7 => 12_288,
                _ => self.rng.range(100, 1_500) as usize,
            };
            let error = self.rng.chance(0.15);
            let input = match tool {
                "bash" => {
                    serde_json::json!({"command": format!("cargo test t{}", self.rng.below(4))})
                }
                "grep" => serde_json::json!({"pattern": format!("fn f{t}")}),
                _ => {
                    let paths = [
                        "src/lib.rs",
                        "src/main.rs",
                        "README.md",
                        "src/engine/mod.rs",
                    ];
                    serde_json::json!({ "filePath": paths[self.rng.below(4)] })
                }
            };
            let output = output_of(&format!("{}-{id}", self.id), size);
            let mut call = tool_part_with_status(&a, &id, tool, "running", "");
            if let Some(pb::part::Kind::Tool(tp)) = &mut call.kind {
                let state = tp.state.as_mut().expect("state");
                state.input = Some(json_to_struct(&input));
                state.time = Some(pb::ToolTime {
                    start: now + 2,
                    end: None,
                    compacted: None,
                });
            }
            if self.rng.chance(0.3) {
                self.add_part(call.clone(), 0);
            }
            if let Some(pb::part::Kind::Tool(tp)) = &mut call.kind {
                let state = tp.state.as_mut().expect("state");
                if error {
                    state.status = "error".into();
                    state.error = format!("Error: {}", &output[..size.min(400)]);
                } else {
                    state.status = "completed".into();
                    state.output = output;
                }
                state.time = Some(pb::ToolTime {
                    start: now + 2,
                    end: Some(now + 3),
                    compacted: None,
                });
            }
            self.add_part(call, size);
        }
        if self.rng.chance(0.7) {
            let text = format!("turn {t} of {}: done, ", self.id).repeat(1 + self.rng.below(20));
            if self.rng.chance(0.4) {
                let half = &text[..text.len() / 2];
                self.add_part(text_part(&a, &format!("{a}-t"), half), 0);
            }
            let len = text.len();
            self.add_part(text_part(&a, &format!("{a}-t"), &text), len);
        }
        self.extras();
        let mut done = finished(assistant);
        done.time = Some(pb::MessageTime {
            created: now + 1,
            completed: Some(now + 4),
        });
        done.tokens = Some(self.next_usage());
        self.queue.push_back(upsert_message(done));
        self.extras();
    }

    /// Pins, unpins, deletes, usage reports and title changes, each by chance.
    fn extras(&mut self) {
        let free: Vec<(String, String)> = self
            .model
            .parts
            .iter()
            .filter(|p| {
                !self.model.pinned.contains(p) && !self.model.pinned_messages.contains(&p.0)
            })
            .cloned()
            .collect();
        if !free.is_empty() && self.rng.chance(0.3) {
            let (m, p) = free[self.rng.below(free.len())].clone();
            self.model.pinned.push((m.clone(), p.clone()));
            self.queue.push_back(pin(&m, &p, true));
        }
        if !self.model.pinned.is_empty() && self.rng.chance(0.15) {
            let (m, p) = self
                .model
                .pinned
                .remove(self.rng.below(self.model.pinned.len()));
            self.queue.push_back(pin(&m, &p, false));
        }
        let free: Vec<(String, String)> = self
            .model
            .parts
            .iter()
            .filter(|p| {
                !self.model.pinned.contains(p) && !self.model.pinned_messages.contains(&p.0)
            })
            .cloned()
            .collect();
        if free.len() > 3 && self.rng.chance(0.25) {
            let (m, p) = free[self.rng.below(free.len())].clone();
            self.model.parts.retain(|x| *x != (m.clone(), p.clone()));
            self.queue.push_back(delete_part(&m, &p));
        }
        if self.model.turns % 7 == 3 && self.rng.chance(0.3) {
            let m = format!("u{:03}", self.model.turns - 1);
            if self.model.pinned_messages.insert(m.clone()) {
                self.queue.push_back(pin(&m, "", true));
            }
        }
        if self.rng.chance(0.4) {
            let tokens = self.next_usage();
            self.queue.push_back(report_usage(tokens));
        }
        if self.rng.chance(0.08) {
            self.model.titles += 1;
            let info = self.info();
            self.queue.push_back(open(info));
        }
    }
}

/// An update, for a message: its debug form cut to 300 characters.
fn short(u: &Update) -> String {
    let s = format!("{u:?}");
    match s.char_indices().nth(300) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s,
    }
}

fn pin(message_id: &str, part_id: &str, pinned: bool) -> Update {
    Update::Pin(pb::PinUpdate {
        message_id: message_id.to_string(),
        part_id: part_id.to_string(),
        pinned: Some(pinned),
    })
}

/// Figures of the whole run, printed at the end.
#[derive(Default)]
struct Stats {
    acked: u64,
    inflight: u64,
    landed: u64,
    mid_compaction: u32,
    all_cold: u32,
    starts: Vec<Duration>,
    /// Sessions sent cold (idle or for memory) and loads back, summed over the rounds
    /// (read just before each kill).
    evicted: f64,
    loads: f64,
    /// Parts pruned and parts a strategy marked, at the last check.
    pruned: u64,
    marked: u64,
}

/// What checking some sessions found.
#[derive(Default)]
struct Checked {
    acked: u64,
    inflight: u64,
    landed: u64,
    pruned: u64,
    marked: u64,
}

/// The servers' flags: both sides run the same engine settings.
fn server_args(llm: &str) -> Vec<String> {
    [
        "--llm-base-url",
        llm,
        "--llm-model",
        "fake-model",
        "--prune-protect",
        "4000",
        "--prune-minimum",
        "2000",
    ]
    .map(str::to_string)
    .to_vec()
}

const ENV: [(&str, &str); 1] = [("COMPACTD_LLM_API_KEY", "k")];

/// The durable server: the shared flags, plus a one-second idle TTL (a session left
/// alone for a second, such as the one compacted before a kill, is written out and sent
/// cold, then loaded back on its next use, so kills also hit evictions and loads), and
/// metrics to count them. `COMPACTD_CRASH_BUDGET=<bytes>` adds a memory budget (sessions
/// sent cold for memory too).
fn start_durable(dir: &Path, args: &[String], stats: &mut Stats) -> Binary {
    let budget = std::env::var("COMPACTD_CRASH_BUDGET").ok();
    let mut args: Vec<&str> = args.iter().map(String::as_str).collect();
    args.extend([
        "--session-idle-ttl-secs",
        "1",
        "--metrics-listen",
        "127.0.0.1:0",
    ]);
    if let Some(b) = &budget {
        args.extend(["--memory-budget", b.as_str()]);
    }
    let began = Instant::now();
    let bin = start_on(dir, "sync", &args, &ENV);
    stats.starts.push(began.elapsed());
    bin
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_updates_survive_sigkill_at_random_moments() {
    let began = Instant::now();
    let seed = seed("COMPACTD_CRASH_SEED");
    let mut rng = Rng::fork(seed, 0);
    let summary: Vec<String> = (0..10).map(|i| format!("summary part {i}. ")).collect();
    let fake = FakeLlm::start(vec![Reply::slow(summary, SLOW_CHUNK)]).await;
    let args = server_args(&fake.base_url());
    let data = data_dir("crash");
    let reference_dir = data_dir("crash-reference");
    let reference = {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        start_on(reference_dir.path(), "memory", &args, &ENV)
    };
    let mut stats = Stats::default();
    let mut sessions: Vec<Sess> = (0..SESSIONS).map(|i| Sess::new(i, seed)).collect();
    let mut server = start_durable(data.path(), &args, &mut stats);
    let mut last_log = String::new();

    for round in 0..ROUNDS {
        sessions = verify(
            &server.addr,
            &reference.addr,
            sessions,
            round,
            &last_log,
            &mut stats,
        )
        .await;
        if ALL_COLD.contains(&round) {
            all_cold(&server.addr).await;
            stats.all_cold += 1;
        }

        // The round's load, until the kill.
        let killed = Arc::new(AtomicBool::new(false));
        let (acks_tx, mut acks) = watch::channel(0u64);
        let acks_tx = Arc::new(acks_tx);
        let mut exclude: HashSet<usize> = sessions
            .iter()
            .filter(|s| s.frozen.is_some())
            .map(|s| s.idx)
            .collect();
        let compacting = (MID_COMPACTION.contains(&round) || round == COMPACTED).then(|| {
            let s = sessions
                .iter()
                .filter(|s| !exclude.contains(&s.idx))
                .max_by_key(|s| s.model.turns)
                .expect("a session to compact");
            exclude.insert(s.idx);
            s.idx
        });
        if let Some(c) = compacting {
            flush_for_compaction(&server.addr, &mut sessions[c], &killed).await;
        }
        let mut owned: Vec<Vec<Sess>> = (0..CLIENTS).map(|_| Vec::new()).collect();
        for s in sessions.drain(..) {
            owned[s.idx % CLIENTS].push(s);
        }
        let tasks: Vec<_> = owned
            .into_iter()
            .enumerate()
            .map(|(k, mine)| {
                let (addr, exclude, killed, acks) = (
                    server.addr.clone(),
                    exclude.clone(),
                    killed.clone(),
                    acks_tx.clone(),
                );
                let rng = Rng::fork(seed, ((round as u64) << 8) | k as u64);
                tokio::spawn(client(addr, mine, exclude, rng, killed, acks))
            })
            .collect();

        let mut frozen = None;
        match compacting {
            Some(c) if round == COMPACTED => {
                fake.push(Reply::text(["The summary of what was done."]));
                let sid = format!("crash-{c:02}");
                let events = compact_until(&server.addr, &sid, true).await;
                assert!(
                    matches!(
                        events.last().and_then(|e| e.event.as_ref()),
                        Some(Ce::Compacted(_))
                    ),
                    "round {round}: the compaction of {sid} completes: {events:?}"
                );
                let mut cl = connect(&server.addr).await;
                let state = read_state(&mut cl, &sid)
                    .await
                    .expect("the compacted session");
                frozen = Some((c, state));
            }
            Some(c) => {
                let sid = format!("crash-{c:02}");
                compact_until(&server.addr, &sid, false).await;
                stats.mid_compaction += 1;
            }
            None => {
                let target = rng.range(1, MAX_ACKS);
                tokio::time::timeout(Duration::from_secs(30), acks.wait_for(|n| *n >= target))
                    .await
                    .unwrap_or_else(|_| {
                        panic!(
                            "round {round}: {target} acknowledgements within 30 s\n{}",
                            tail(&server.log_so_far(), 30)
                        )
                    })
                    .expect("the counter lives");
                tokio::time::sleep(Duration::from_millis(rng.range(0, 20))).await;
            }
        }
        if let Some(m) = try_scrape(server.metrics.as_deref().expect("metrics")).await {
            stats.evicted += metric(&m, "compactd_sessions_evicted_total{reason=\"idle\"}")
                + metric(&m, "compactd_sessions_evicted_total{reason=\"memory\"}");
            stats.loads += metric(&m, "compactd_session_loads_total{result=\"ok\"}");
        }
        killed.store(true, Ordering::SeqCst);
        last_log = sigkill(server);

        for task in tasks {
            let mine = tokio::time::timeout(Duration::from_secs(20), task)
                .await
                .expect("a client ends once the server is killed")
                .expect("client task");
            sessions.extend(mine);
        }
        sessions.sort_by_key(|s| s.idx);
        if let Some((idx, state)) = frozen {
            sessions[idx].frozen = Some(state);
        }
        server = start_durable(data.path(), &args, &mut stats);
    }
    sessions = verify(
        &server.addr,
        &reference.addr,
        sessions,
        ROUNDS,
        &last_log,
        &mut stats,
    )
    .await;
    let frozen = sessions.iter().filter(|s| s.frozen.is_some()).count();
    assert_eq!(frozen, 1, "one session was compacted before a kill");
    let _ = sigterm(server).await;
    reference.finish();

    let max_start = stats.starts.iter().max().copied().unwrap_or_default();
    let mean_start = stats.starts.iter().sum::<Duration>() / stats.starts.len().max(1) as u32;
    eprintln!(
        "crash: seed {seed}, {ROUNDS} SIGKILLs ({} mid-compaction, 1 after one, {} in rounds \
         begun with every session cold), {} updates \
         acknowledged, {} of {} in flight at a kill had landed; at the end {} parts pruned and {} \
         marked by strategies; {} sessions sent cold and {} loads back; start to \
         listening mean {:.0} ms max {:.0} ms, {:.1} s in all",
        stats.mid_compaction,
        stats.all_cold,
        stats.acked,
        stats.landed,
        stats.inflight,
        stats.pruned,
        stats.marked,
        stats.evicted,
        stats.loads,
        mean_start.as_secs_f64() * 1e3,
        max_start.as_secs_f64() * 1e3,
        began.elapsed().as_secs_f64(),
    );
}

/// Waits (on `Subscribe`) until every session is cold: the verification touched them
/// all, so with the one-second idle TTL they leave memory about a second later.
async fn all_cold(addr: &str) {
    let mut c = connect(addr).await;
    let mut watch = c
        .subscribe(pb::SubscribeRequest {
            session_id: String::new(),
        })
        .await
        .expect("Subscribe")
        .into_inner();
    loop {
        let listed = c
            .list_sessions(pb::ListSessionsRequest::default())
            .await
            .expect("ListSessions")
            .into_inner()
            .sessions;
        if listed.iter().all(|s| s.cold) {
            return;
        }
        let e = tokio::time::timeout(Duration::from_secs(20), watch.message())
            .await
            .expect("sessions go cold within 20 s")
            .expect("the watch stream")
            .expect("still open");
        assert!(
            matches!(e.event, Some(pb::session_event::Event::Evicted(_))),
            "only evictions while nothing is sent: {e:?}"
        );
    }
}

/// Before a compaction: the session's planned updates are sent (unary, answered) so no
/// turn is half done, and it gets at least four turns (more than the two the compaction
/// keeps verbatim).
async fn flush_for_compaction(addr: &str, s: &mut Sess, killed: &AtomicBool) {
    let mut c = connect(addr).await;
    while s.model.turns < 4 || !s.queue.is_empty() {
        let update = s.next_update();
        s.inflight.push(Sent {
            update: update.clone(),
            unary: true,
        });
        if let Err(status) = unary(&mut c, &s.id, &update).await {
            assert!(killed.load(Ordering::SeqCst), "{}: {status:?}", s.id);
            return;
        }
        s.ack_first();
    }
}

/// Runs `Compact` on `sid`: to its end when `to_end`, else until the first summary delta.
async fn compact_until(addr: &str, sid: &str, to_end: bool) -> Vec<pb::CompactionEvent> {
    let mut c = connect(addr).await;
    let mut stream = c
        .compact(pb::CompactRequest {
            session_id: sid.to_string(),
            options: None,
        })
        .await
        .unwrap_or_else(|s| panic!("Compact {sid}: {s:?}"))
        .into_inner();
    let mut events = Vec::new();
    loop {
        let e = tokio::time::timeout(Duration::from_secs(30), stream.message())
            .await
            .expect("a compaction event within 30 s")
            .unwrap_or_else(|s| panic!("Compact {sid}: {s:?}"));
        let Some(e) = e else {
            assert!(
                to_end,
                "the compaction of {sid} ended before a delta: {events:?}"
            );
            return events;
        };
        let kind = e.event.clone();
        events.push(e);
        match kind {
            Some(Ce::Delta(_)) if !to_end => return events,
            Some(Ce::Failed(f)) => panic!("the compaction of {sid} failed: {f:?}"),
            Some(Ce::Compacted(_)) if !to_end => {
                panic!("the compaction of {sid} completed before its first delta was seen")
            }
            _ => {}
        }
    }
}

/// One host connection during a round: streams updates into its sessions (pipelined up
/// to [`WINDOW`]) and sometimes calls a unary twin, until the server is killed.
async fn client(
    addr: String,
    mut mine: Vec<Sess>,
    exclude: HashSet<usize>,
    mut rng: Rng,
    killed: Arc<AtomicBool>,
    acks: Arc<watch::Sender<u64>>,
) -> Vec<Sess> {
    let gone = |what: &str| {
        assert!(
            killed.load(Ordering::SeqCst),
            "the server went away before the kill: {what}"
        );
    };
    let active: Vec<usize> = (0..mine.len())
        .filter(|&i| !exclude.contains(&mine[i].idx))
        .collect();
    if active.is_empty() {
        return mine;
    }
    let mut c = match pb::sessions_client::SessionsClient::connect(format!("http://{addr}")).await {
        Ok(c) => c
            .max_decoding_message_size(CLIENT_MAX_MESSAGE)
            .max_encoding_message_size(CLIENT_MAX_MESSAGE),
        Err(e) => {
            gone(&format!("connect: {e}"));
            return mine;
        }
    };
    let mut pipe = match Pipe::open(&mut c).await {
        Ok(p) => p,
        Err(s) => {
            gone(&format!("open the stream: {s:?}"));
            return mine;
        }
    };
    // Stream updates sent and not answered: (seq, index in `mine`).
    let mut pending: VecDeque<(u64, usize)> = VecDeque::new();
    let ack = |s: &mut Sess| {
        s.ack_first();
        acks.send_modify(|n| *n += 1);
    };
    loop {
        if killed.load(Ordering::SeqCst) {
            return mine;
        }
        let i = active[rng.below(active.len())];
        let unary_call = rng.chance(0.15);
        let burst = if unary_call { 1 } else { 1 + rng.below(3) };
        // A unary call goes after the stream's answers (the session's order is kept).
        let must_answer = if unary_call {
            0
        } else {
            WINDOW.saturating_sub(burst)
        };
        while pending.len() > must_answer {
            let (seq, j) = pending.pop_front().expect("pending");
            match pipe.answer(seq).await {
                Answer::Ack => ack(&mut mine[j]),
                Answer::Refused(e) => {
                    let update = short(&mine[j].inflight[0].update);
                    panic!("{} refused {update}: {e:?}", mine[j].id)
                }
                Answer::Gone(why) => {
                    gone(&why);
                    return mine;
                }
            }
        }
        let s = &mut mine[i];
        for _ in 0..burst {
            let update = s.next_update();
            s.inflight.push(Sent {
                update: update.clone(),
                unary: unary_call,
            });
            if unary_call {
                match unary(&mut c, &s.id, &update).await {
                    Ok(()) => ack(s),
                    Err(status) => {
                        gone(&format!("{}: {status:?}", s.id));
                        return mine;
                    }
                }
            } else {
                match pipe.send(&s.id, update).await {
                    Some(seq) => pending.push_back((seq, i)),
                    None => {
                        gone("the stream closed");
                        return mine;
                    }
                }
            }
        }
    }
}

/// Checks every session on the restarted server against the reference (see the module
/// doc), four sessions at a time; returns them ready for the next round.
async fn verify(
    addr: &str,
    reference: &str,
    sessions: Vec<Sess>,
    round: usize,
    log: &str,
    stats: &mut Stats,
) -> Vec<Sess> {
    let mut owned: Vec<Vec<Sess>> = (0..CLIENTS).map(|_| Vec::new()).collect();
    for s in sessions {
        owned[s.idx % CLIENTS].push(s);
    }
    let log = Arc::new(tail(log, 40));
    let tasks: Vec<_> = owned
        .into_iter()
        .map(|mine| {
            let (addr, reference, log) = (addr.to_string(), reference.to_string(), log.clone());
            tokio::spawn(async move { verify_some(&addr, &reference, mine, round, &log).await })
        })
        .collect();
    let mut out = Vec::new();
    stats.pruned = 0;
    stats.marked = 0;
    for t in tasks {
        let (mine, checked) = t.await.expect("verify task");
        stats.acked += checked.acked;
        stats.inflight += checked.inflight;
        stats.landed += checked.landed;
        stats.pruned += checked.pruned;
        stats.marked += checked.marked;
        out.extend(mine);
    }
    out.sort_by_key(|s| s.idx);
    out
}

async fn verify_some(
    addr: &str,
    reference: &str,
    mut mine: Vec<Sess>,
    round: usize,
    log: &str,
) -> (Vec<Sess>, Checked) {
    let mut d = connect(addr).await;
    let mut r = connect(reference).await;
    let mut rp = Pipe::open(&mut r).await.expect("the reference's stream");
    let mut checked = Checked::default();
    for s in &mut mine {
        let got = read_state(&mut d, &s.id).await;
        for p in got
            .iter()
            .flat_map(|g| &g.session.messages)
            .flat_map(|m| &m.parts)
        {
            if let Some(pb::part::Kind::Tool(t)) = &p.kind
                && t.state
                    .as_ref()
                    .and_then(|s| s.time.as_ref())
                    .is_some_and(|t| t.compacted.is_some())
            {
                checked.pruned += 1;
            }
            if p.mark.is_some() {
                checked.marked += 1;
            }
        }
        if let Some(frozen) = &s.frozen {
            assert!(
                got.as_ref() == Some(frozen),
                "after kill {round}: {}, compacted before an earlier kill, reads \
                 otherwise than it did then: {}\nlast log:\n{log}",
                s.id,
                first_difference(&got, &Some(frozen.clone())),
            );
            continue;
        }
        assert_acked_present(s, &got, round, log);
        for sent in s.acked.drain(..) {
            feed(&mut r, &mut rp, &s.id, &sent).await;
            s.total_acked += 1;
            checked.acked += 1;
        }
        let got = got.map(State::without_server_clock);
        let mut want = read_state(&mut r, &s.id)
            .await
            .map(State::without_server_clock);
        let mut n = 0;
        while got != want {
            assert!(
                n < s.inflight.len(),
                "after kill {round}, {} differs from the reference fed its {} \
                 acknowledged updates{}: {}\nlast log:\n{log}",
                s.id,
                s.total_acked,
                if s.inflight.is_empty() {
                    String::new()
                } else {
                    format!(" and any prefix of the {} in flight", s.inflight.len())
                },
                first_difference(&got, &want),
            );
            feed(&mut r, &mut rp, &s.id, &s.inflight[n]).await;
            n += 1;
            want = read_state(&mut r, &s.id)
                .await
                .map(State::without_server_clock);
        }
        checked.inflight += s.inflight.len() as u64;
        checked.landed += n as u64;
        s.total_acked += n as u64;
        // What had not landed is sent again, first.
        let rest: Vec<Sent> = s.inflight.drain(..).skip(n).collect();
        for sent in rest.into_iter().rev() {
            s.queue.push_front(sent.update);
        }
    }
    (mine, checked)
}

/// Every message and part an acknowledged update of the last round wrote is on the
/// restarted server (unless a later update deleted it).
fn assert_acked_present(s: &Sess, got: &Option<State>, round: usize, log: &str) {
    if s.acked.is_empty() {
        return;
    }
    let Some(got) = got else {
        panic!(
            "after kill {round}, {} is gone although {} of its updates \
             were acknowledged\nlast log:\n{log}",
            s.id,
            s.acked.len()
        );
    };
    let deleted: HashSet<(String, String)> = s
        .acked
        .iter()
        .chain(&s.inflight)
        .filter_map(|x| match &x.update {
            Update::DeletePart(r) => Some((r.message_id.clone(), r.part_id.clone())),
            _ => None,
        })
        .collect();
    let messages: HashSet<&str> = got
        .session
        .messages
        .iter()
        .filter_map(|m| m.info.as_ref().map(|i| i.id.as_str()))
        .collect();
    let parts: HashSet<(&str, &str)> = got
        .session
        .messages
        .iter()
        .flat_map(|m| &m.parts)
        .map(|p| (p.message_id.as_str(), p.id.as_str()))
        .collect();
    for sent in &s.acked {
        match &sent.update {
            Update::UpsertMessage(m) => assert!(
                messages.contains(m.id.as_str()),
                "after kill {round}, {}: acknowledged message {} is missing\nlast log:\n{log}",
                s.id,
                m.id
            ),
            Update::UpsertPart(p) if !deleted.contains(&(p.message_id.clone(), p.id.clone())) => {
                assert!(
                    parts.contains(&(p.message_id.as_str(), p.id.as_str())),
                    "after kill {round}, {}: acknowledged part {}/{} is missing\nlast log:\n{log}",
                    s.id,
                    p.message_id,
                    p.id
                )
            }
            _ => {}
        }
    }
}

/// Applies one update to the reference, the way it was sent to the durable server.
async fn feed(r: &mut Client, rp: &mut Pipe, sid: &str, sent: &Sent) {
    if sent.unary {
        unary(r, sid, &sent.update).await.unwrap_or_else(|s| {
            panic!(
                "the reference refused {} on {sid}: {s:?}",
                short(&sent.update)
            )
        });
    } else {
        match rp.request(sid, sent.update.clone()).await {
            Answer::Ack => {}
            other => panic!(
                "the reference refused {} on {sid}: {other:?}",
                short(&sent.update)
            ),
        }
    }
}
