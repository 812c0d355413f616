//! Issue 13, "no input can kill the sidecar": hostile clients against the real `compactd`
//! binary, run under an address-space cap that stands in for a container memory limit.
//!
//! Every test here proves three things about one attack the issue reports:
//! - the process is still running afterwards (an allocation past the cap aborts it);
//! - a bystander session on another connection got an ack for every update it sent
//!   while the attack ran (one every ~50 ms, 15 s allowed for each), and a few more
//!   after the attack ended;
//! - the attacker was refused with `RESOURCE_EXHAUSTED` and a message naming the limit
//!   (or, for a client that only pipelines, was flow-controlled without losing its
//!   connection: other calls on its channel keep working).
//!
//! Each test prints one line of figures (`--nocapture`): the child's peak RSS and peak
//! address space, the attack's duration and what the attacker got back.
//!
//! The tests run one at a time ([`Capped::start`] takes a lock): each loads the machine's
//! two cores, and a bystander starved by another test's attack would prove nothing.
//!
//! The attacks themselves are in `amplification.rs` (decode amplification), `imports.rs`
//! (oversized and many-part imports) and `streams.rs` (clients that pipeline or do not
//! read); `wire.rs` builds raw protobuf payloads and sends them as they are.

mod amplification;
mod imports;
mod streams;
mod wire;

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use compactd::server::pb;
use compactd::server::pb::client_update::Update;
use compactd::server::pb::server_event::Event;
use compactd::server::pb::sessions_client::SessionsClient;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Code;
use tonic::transport::Channel;

use crate::common::binary::Binary;
use crate::common::*;

/// Address-space cap of the child (`prlimit --as`): 1.5 GiB, standing in for a container
/// memory limit. Address space is not RSS: the debug binary idles at ~170 MiB of it (code,
/// debug sections, thread stacks), and jemalloc (compactd's allocator) keeps the address
/// ranges of memory it has given back to the OS for reuse (`opt.retain`), so refusing
/// four 500k-part imports peaked at ~810 MiB of address space for ~210 MiB of RSS (the
/// `peak_vm` and `peak_rss` figures). The reproductions used 1 GiB with glibc's
/// malloc; the unbounded allocations they found grow far past either cap (four
/// amplifying requests at once: ~3.7 GB; 1,300 unread 5 MiB contexts: ~6.5 GB).
pub const CAP_BYTES: u64 = 3 << 29;
/// `--memory-budget`: 384 MiB, as in the issue.
pub const MEMORY_BUDGET: u64 = 384 << 20;
/// `--slow-reader-grace-secs`.
pub const GRACE_SECS: u64 = 2;
/// How long the bystander waits for any one ack before it counts as hung.
const ACK_TIMEOUT: Duration = Duration::from_secs(15);
/// The bystander's pace.
const BYSTANDER_PERIOD: Duration = Duration::from_millis(50);
/// Acks the bystander must get after the attack ended.
const ACKS_AFTER: u64 = 3;

/// One hostile test at a time (see the module doc).
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// `compactd serve` under [`CAP_BYTES`], with its peak memory sampled every 10 ms (the
/// figures survive the process: a killed process has no `/proc` entry to read).
pub struct Capped {
    bin: Arc<Mutex<Binary>>,
    /// `host:port`.
    pub addr: String,
    peak_rss: Arc<AtomicU64>,
    peak_vm: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    sampler: Option<std::thread::JoinHandle<()>>,
    _serial: tokio::sync::MutexGuard<'static, ()>,
}

/// What a finished server leaves: the figures and its whole log.
pub struct Finished {
    pub alive: bool,
    pub peak_rss: u64,
    pub peak_vm: u64,
    pub log: String,
}

impl Capped {
    /// Starts the server with the memory budget, the slow-reader grace and `extra` flags.
    pub async fn start(extra: &[&str]) -> Capped {
        let serial = SERIAL.lock().await;
        let budget = MEMORY_BUDGET.to_string();
        let grace = GRACE_SECS.to_string();
        let mut args = vec![
            "--memory-budget",
            budget.as_str(),
            "--slow-reader-grace-secs",
            grace.as_str(),
        ];
        args.extend_from_slice(extra);
        // `HOSTILE_COMPACTD_LOG=info,h2=debug` shows why a connection was dropped.
        let filter = std::env::var("HOSTILE_COMPACTD_LOG").unwrap_or_else(|_| "info".into());
        let bin = Binary::start_capped(CAP_BYTES, &args, &[("COMPACTD_LOG", &filter)]);
        let addr = bin.addr.clone();
        let pid = bin.pid();
        let bin = Arc::new(Mutex::new(bin));
        let peak_rss = Arc::new(AtomicU64::new(0));
        let peak_vm = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let sampler = {
            // A weak reference: a test that panics drops the server (and kills the child).
            let (bin, peak_rss, peak_vm, stop) = (
                Arc::downgrade(&bin),
                peak_rss.clone(),
                peak_vm.clone(),
                stop.clone(),
            );
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let Some(bin) = bin.upgrade() else { break };
                    let rss = bin.lock().unwrap().peak_rss_bytes();
                    drop(bin);
                    peak_rss.fetch_max(rss, Ordering::Relaxed);
                    peak_vm.fetch_max(vm_peak_bytes(pid), Ordering::Relaxed);
                    std::thread::sleep(Duration::from_millis(10));
                }
            })
        };
        Capped {
            bin,
            addr,
            peak_rss,
            peak_vm,
            stop,
            sampler: Some(sampler),
            _serial: serial,
        }
    }

    /// A new connection (its own HTTP/2 connection: a tonic `Channel`).
    pub async fn channel(&self) -> Channel {
        Channel::from_shared(format!("http://{}", self.addr))
            .expect("valid url")
            .connect()
            .await
            .expect("connect to compactd")
    }

    /// A client on a new connection with no message size limits of its own.
    pub async fn client(&self) -> Client {
        client_on(self.channel().await)
    }

    /// Whether the process is still running.
    pub fn alive(&self) -> bool {
        self.bin.lock().unwrap().is_running()
    }

    /// Stops sampling, checks whether the process survived, stops it and returns its log.
    pub fn finish(self) -> Finished {
        let Capped {
            bin,
            peak_rss,
            peak_vm,
            stop,
            sampler,
            ..
        } = self;
        stop.store(true, Ordering::Relaxed);
        if let Some(s) = sampler {
            s.join().expect("sampler");
        }
        let bin = Arc::try_unwrap(bin)
            .unwrap_or_else(|_| unreachable!("the sampler holds a weak reference only"))
            .into_inner()
            .unwrap();
        let mut bin = bin;
        let alive = bin.is_running();
        let peak_rss = peak_rss.load(Ordering::Relaxed).max(bin.peak_rss_bytes());
        let peak_vm = peak_vm.load(Ordering::Relaxed);
        Finished {
            alive,
            peak_rss,
            peak_vm,
            log: bin.finish(),
        }
    }
}

/// A Sessions client on `channel` with no message size limits of its own.
pub fn client_on(channel: Channel) -> Client {
    SessionsClient::new(channel)
        .max_decoding_message_size(usize::MAX)
        .max_encoding_message_size(usize::MAX)
}

/// `VmPeak` (peak address space) of `pid` in bytes, 0 when it is gone.
fn vm_peak_bytes(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmPeak:"))
                .and_then(|v| v.split_whitespace().next())
                .and_then(|n| n.parse::<u64>().ok())
        })
        .map_or(0, |kib| kib * 1024)
}

// ---- the bystander ----

/// A session on its own connection that sends an update every ~50 ms on its own
/// `Stream` and waits for each ack, for as long as the attack runs.
pub struct Bystander {
    stop: Arc<AtomicBool>,
    acks: Arc<AtomicU64>,
    slowest_ms: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<Result<(), String>>,
}

/// What the bystander saw.
pub struct BystanderReport {
    pub acks: u64,
    pub slowest_ms: u64,
    /// The first update it got no ack for, and why.
    pub failure: Option<String>,
}

impl Bystander {
    /// Connects, opens its session and gets that acked, then keeps sending in the
    /// background.
    pub async fn start(server: &Capped) -> Bystander {
        let mut client = server.client().await;
        let (tx, rx) = mpsc::channel::<pb::ClientUpdate>(16);
        let mut events = client
            .stream(ReceiverStream::new(rx))
            .await
            .expect("the bystander opens its stream")
            .into_inner();
        let sid = "bystander";
        let step = |i: u64| -> Update {
            let msg = format!("b{}", i / 3);
            match i {
                0 => open(session(sid)),
                _ if i % 3 == 1 => upsert_message(user_msg(&msg)),
                _ if i % 3 == 2 => upsert_part(text_part(&msg, &format!("{msg}-t"), "hello")),
                _ => Update::GetContext(pb::ContextOptions::default()),
            }
        };
        async fn one(
            tx: &mpsc::Sender<pb::ClientUpdate>,
            events: &mut tonic::Streaming<pb::ServerEvent>,
            seq: u64,
            update: Update,
        ) -> Result<(), String> {
            tx.send(pb::ClientUpdate {
                seq,
                session_id: "bystander".into(),
                update: Some(update),
            })
            .await
            .map_err(|_| format!("update {seq}: the stream is closed"))?;
            let wait = async {
                loop {
                    match events.message().await {
                        Ok(Some(e)) => match e.event {
                            Some(Event::Ack(_)) if e.seq == seq => return Ok(()),
                            Some(Event::Error(err)) => {
                                return Err(format!("update {seq}: error event {err:?}"));
                            }
                            _ => {}
                        },
                        Ok(None) => return Err(format!("update {seq}: the stream ended")),
                        Err(status) => return Err(format!("update {seq}: {status:?}")),
                    }
                }
            };
            tokio::time::timeout(ACK_TIMEOUT, wait)
                .await
                .map_err(|_| format!("update {seq}: no ack within {ACK_TIMEOUT:?}"))?
        }
        one(&tx, &mut events, 1, step(0))
            .await
            .expect("the bystander's session opens");
        let stop = Arc::new(AtomicBool::new(false));
        let acks = Arc::new(AtomicU64::new(1));
        let slowest_ms = Arc::new(AtomicU64::new(0));
        let task = {
            let (stop, acks, slowest_ms) = (stop.clone(), acks.clone(), slowest_ms.clone());
            tokio::spawn(async move {
                let mut i = 1;
                while !stop.load(Ordering::Relaxed) {
                    let sent = Instant::now();
                    one(&tx, &mut events, i + 1, step(i)).await?;
                    slowest_ms.fetch_max(sent.elapsed().as_millis() as u64, Ordering::Relaxed);
                    acks.fetch_add(1, Ordering::Relaxed);
                    i += 1;
                    tokio::time::sleep(BYSTANDER_PERIOD).await;
                }
                Ok(())
            })
        };
        Bystander {
            stop,
            acks,
            slowest_ms,
            task,
        }
    }

    /// Waits for [`ACKS_AFTER`] more acks (the server still answers once the attack is
    /// over), then stops.
    pub async fn finish(self) -> BystanderReport {
        let target = self.acks.load(Ordering::Relaxed) + ACKS_AFTER;
        let deadline = Instant::now() + ACK_TIMEOUT * (ACKS_AFTER as u32 + 1);
        while self.acks.load(Ordering::Relaxed) < target
            && !self.task.is_finished()
            && Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        self.stop.store(true, Ordering::Relaxed);
        let failure = match tokio::time::timeout(ACK_TIMEOUT * 2, self.task).await {
            Ok(Ok(Ok(()))) => None,
            Ok(Ok(Err(e))) => Some(e),
            Ok(Err(join)) => Some(format!("the bystander task failed: {join}")),
            Err(_) => Some("the bystander hung".to_string()),
        };
        let acks = self.acks.load(Ordering::Relaxed);
        let failure = failure.or_else(|| {
            (acks < target).then(|| format!("only {acks} acks, expected at least {target}"))
        });
        BystanderReport {
            acks,
            slowest_ms: self.slowest_ms.load(Ordering::Relaxed),
            failure,
        }
    }
}

// ---- what an attacker got back ----

/// The end of one attacking request: a reply, or a status (a stream's error event is
/// read as the status it stands for).
#[derive(Debug, Clone)]
pub enum Outcome {
    /// Answered (what with, for the report).
    Answered(String),
    /// Refused or failed.
    Failed { code: Code, message: String },
}

impl Outcome {
    pub fn from_status(s: &tonic::Status) -> Outcome {
        Outcome::Failed {
            code: s.code(),
            message: s.message().to_string(),
        }
    }

    pub fn from_error_event(e: &pb::Error) -> Outcome {
        let code = (0..=16)
            .map(Code::from_i32)
            .find(|c| compactd::telemetry::code_name(*c) == e.code)
            .unwrap_or(Code::Unknown);
        Outcome::Failed {
            code,
            message: format!("{} (field {:?}, code {})", e.message, e.field, e.code),
        }
    }

    pub fn is_resource_exhausted(&self) -> bool {
        matches!(
            self,
            Outcome::Failed {
                code: Code::ResourceExhausted,
                ..
            }
        )
    }

    /// Short form for the figures line.
    pub fn brief(&self) -> String {
        match self {
            Outcome::Answered(what) => format!("answered ({what})"),
            Outcome::Failed { code, message } => {
                let m: String = message.chars().take(120).collect();
                format!("{code:?}: {m}")
            }
        }
    }
}

/// Asserts `outcome` is `RESOURCE_EXHAUSTED` with a message naming one of `limits`.
pub fn assert_refused(what: &str, outcome: &Outcome, limits: &[&str]) {
    match outcome {
        Outcome::Failed {
            code: Code::ResourceExhausted,
            message,
        } => assert!(
            limits.iter().any(|l| message.contains(l)),
            "{what}: RESOURCE_EXHAUSTED does not name any of {limits:?}: {message:?}"
        ),
        other => panic!("{what}: expected RESOURCE_EXHAUSTED naming {limits:?}, got {other:?}"),
    }
}

/// The figures line of one scenario.
pub fn report(
    scenario: &str,
    finished: &Finished,
    elapsed: Duration,
    attacker: &str,
    bystander: &BystanderReport,
) {
    eprintln!(
        "hostile {scenario}: peak_rss={} MiB peak_vm={} MiB (cap {} MiB) attack={:.1}s alive={} | attacker: {attacker} | bystander: {} acks, slowest {} ms{}",
        finished.peak_rss >> 20,
        finished.peak_vm >> 20,
        CAP_BYTES >> 20,
        elapsed.as_secs_f64(),
        finished.alive,
        bystander.acks,
        bystander.slowest_ms,
        bystander
            .failure
            .as_ref()
            .map_or(String::new(), |f| format!(", FAILED: {f}")),
    );
    // Why the process or a connection went away, when the log says (an allocation past
    // the cap; with HOSTILE_COMPACTD_LOG=info,h2=debug, h2's GOAWAY).
    let telling = [
        "memory allocation of",
        "too many small DATA frames",
        "GoAway",
    ];
    for line in finished
        .log
        .lines()
        .filter(|l| telling.iter().any(|t| l.contains(t)))
        .take(3)
    {
        eprintln!(
            "hostile {scenario}: log: {}",
            line.chars().take(300).collect::<String>()
        );
    }
}

/// The common end of every test: the process survived and the bystander was served.
/// (The attacker's outcome is each test's own business.)
pub fn assert_survived(finished: &Finished, bystander: &BystanderReport) {
    assert!(
        finished.alive,
        "compactd died under the {} MiB cap (peak RSS {} MiB, peak address space {} MiB); the end of its log:\n{}",
        CAP_BYTES >> 20,
        finished.peak_rss >> 20,
        finished.peak_vm >> 20,
        tail(&finished.log, 12)
    );
    if let Some(f) = &bystander.failure {
        panic!("the bystander was not served: {f}");
    }
}

/// The last `n` lines of `log`.
fn tail(log: &str, n: usize) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Runs one attacking request for at most `limit`: a regression must fail, not hang.
pub async fn within(limit: Duration, attack: impl Future<Output = Outcome>) -> Outcome {
    tokio::time::timeout(limit, attack)
        .await
        .unwrap_or_else(|_| Outcome::Failed {
            code: Code::DeadlineExceeded,
            message: format!("no answer within {limit:?}"),
        })
}
