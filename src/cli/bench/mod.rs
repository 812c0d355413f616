//! `compactd bench`: a bounded load generator in the binary. It starts a compactd server
//! (or drives one already running on this machine, `--target`) and a raw tonic echo
//! service as child processes of the same binary, replays sessions built from real
//! traces against both over loopback, and prints compactd's figures next to a reference
//! that shows what the transport (or the tokenizer) alone allows: ingest throughput,
//! ping-pong ack latency, `GetContext` latency of a ~200K-token session, and the server's
//! resident memory. Each compared figure has a target and is marked `MISS` below it. The
//! client shares the machine's cores with the servers, so each ingest row also shows the
//! client's CPU per update and, for a BPE row, the most these cores allow (`bound`).
//!
//! Reading order: this file (flags, the run), `workload.rs` (the updates, from traces;
//! `prepared.rs` builds an ingest case's before its clock starts),
//! `drive.rs` (one stream driven, compactd's or the echo's), `echo.rs` (the echo
//! service), `spawn.rs` (the child processes), `stats.rs` (percentiles, RSS, CPU time,
//! the raw BPE rate), `report.rs` (the tables, the JSON document and the BPE bound).
//!
//! The bench never asserts on speed: a run fails (non-zero exit) only when an RPC failed
//! or an update was refused or left unanswered.

pub mod drive;
pub mod echo;
pub mod prepared;
mod raw;
pub mod report;
pub mod spawn;
pub mod stats;
pub mod workload;

use std::ffi::OsString;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Args;
use prost::Message as _;
use tonic::transport::{Channel, Endpoint};

use self::drive::{Compactd, Driven, Echo, Wire, drive};
use self::prepared::Prepared;
use self::report::{
    ContextRow, IngestRow, LatencyRow, Rate, Report, Rss, ServerInfo, Target, WorkloadInfo,
    bpe_bound, median_round, ratio,
};
use self::spawn::Spawned;
use self::stats::latency;
use self::workload::{Plan, Pool, Sizing};
use crate::server::pb;
use crate::store::Durability;
use crate::tokens::bpe::{Bpe, CL100K, O200K};
use crate::tokens::{Counting, Tokenizer};

/// Ingest of the chars4 sessions against the echo's message rate.
pub const INGEST_TARGET: Target = Target::Min(0.5);
/// Ingest of the BPE sessions against the raw BPE counting rate of the cores in use.
pub const BPE_INGEST_TARGET: Target = Target::Min(0.8);
/// Ack and `GetContext` latency against the echo's (plus counting, for BPE sessions).
pub const LATENCY_TARGET: Target = Target::Max(2.0);

/// Tool outputs of the `GetContext` session are the traces' own, cut at this size.
const CONTEXT_OUTPUT_CAP: usize = 48 << 10;
/// Most `--rounds`: a run stays bounded in time (about 20 s per round by default).
const MAX_ROUNDS: usize = 20;
/// Failures the report quotes (all are counted).
const FAILURES_KEPT: usize = 5;

/// `compactd bench`.
#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    /// Drive this compactd, already running on this machine (host:port, loopback only),
    /// instead of starting one.
    #[arg(long, value_name = "HOST:PORT", conflicts_with_all = ["durability", "serve_args"])]
    pub target: Option<String>,
    /// Directory of `opencode export` traces the sessions replay.
    #[arg(long, value_name = "DIR", default_value = "tests/data/traces")]
    pub traces: PathBuf,
    /// Most updates one measured case sends (all its streams together); also bounds the
    /// ping-pong updates and the GetContext calls of a case.
    #[arg(long, default_value_t = 20_000)]
    pub updates: usize,
    /// Longest one measured case sends for, in seconds (a run has about 30 cases).
    #[arg(long, value_name = "SECONDS", default_value = "1", value_parser = parse_seconds)]
    pub duration: Duration,
    /// Tool output sizes measured, in bytes (comma separated).
    #[arg(long, value_delimiter = ',', default_value = "4096,20480")]
    pub part_sizes: Vec<usize>,
    /// Concurrent streams measured (comma separated); each stream has its own sessions.
    #[arg(long, value_delimiter = ',', default_value = "1,64")]
    pub streams: Vec<usize>,
    /// Updates each stream keeps in flight in the ingest cases.
    #[arg(long, default_value_t = 32)]
    pub window: usize,
    /// Rounds of every case, each run right after its reference, so that a slow moment of
    /// the machine hits both: an ingest row is its median round (the range of the rounds'
    /// ratios is shown beside it); latencies are percentiles of every round's samples.
    /// At most 20.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Size of the GetContext session, in tokens (as GetContext estimates them).
    #[arg(long, default_value_t = 200_000)]
    pub context_tokens: u64,
    /// The BPE the BPE rows count with (auto, o200k, cl100k; the chars4 rows always
    /// run); also the started server's `--tokenizer`.
    #[arg(long, default_value = "auto", value_parser = parse_bpe)]
    pub tokenizer: Tokenizer,
    /// The started server's `--durability` (`memory`, `interval=<ms>`, `sync`); a durable mode
    /// stores in a fresh directory removed afterwards.
    #[arg(long, default_value = "memory", value_parser = Durability::parse)]
    pub durability: Durability,
    /// Another `serve` flag for the started server (repeatable), e.g.
    /// `--serve-arg=--max-update-bytes=8000000`.
    #[arg(long = "serve-arg", value_name = "ARG", allow_hyphen_values = true)]
    pub serve_args: Vec<String>,
    /// Print one JSON document instead of tables.
    #[arg(long)]
    pub json: bool,
    /// Serve the echo service instead (how the bench starts its echo child).
    #[arg(long, hide = true)]
    pub serve_echo: bool,
}

/// Why the bench could not run, or ran with failures.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// A flag cannot work; fix the command line.
    #[error("--{flag}: {message}")]
    Flag {
        /// The flag.
        flag: &'static str,
        /// What is wrong.
        message: String,
    },
    /// The traces could not be loaded.
    #[error(transparent)]
    Traces(#[from] workload::WorkloadError),
    /// `--target` is not a server on this machine.
    #[error("--target {target}: {message}")]
    Target {
        /// As given.
        target: String,
        /// Why it is refused.
        message: String,
    },
    /// A child server did not start.
    #[error("starting a server: {0}")]
    Spawn(String),
    /// A server could not be reached.
    #[error("connecting to {what} at {addr}: {message}")]
    Connect {
        /// Which server.
        what: &'static str,
        /// Its address.
        addr: String,
        /// The transport's error.
        message: String,
    },
    /// A local resource failed (runtime, files, stdout).
    #[error("{0}")]
    Io(String),
    /// The run finished, but RPCs failed or updates were refused or unanswered.
    #[error("{errors} RPCs failed or updates were refused or unanswered (first: {first})")]
    Failed {
        /// How many.
        errors: u64,
        /// The first.
        first: String,
    },
}

/// Runs `compactd bench` (or, with `--serve-echo`, the echo service) and prints the
/// report on stdout. Progress goes to stderr.
pub fn run(args: &BenchArgs) -> Result<(), BenchError> {
    if args.serve_echo {
        return echo::serve();
    }
    check(args)?;
    let pool = Arc::new(Pool::load(&args.traces)?);
    let bin = std::env::current_exe()
        .map_err(|e| BenchError::Io(format!("finding this executable: {e}")))?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| BenchError::Io(format!("starting the async runtime: {e}")))?;
    let data_dir = (args.target.is_none() && args.durability != Durability::Memory)
        .then(|| std::env::temp_dir().join(format!("compactd-bench-{}", std::process::id())));
    let serve_args = serve_args(args, data_dir.as_ref());
    let server = match &args.target {
        Some(t) => Server::Target(spawn::loopback(t)?),
        None => {
            progress("starting compactd serve");
            Server::Spawned(Spawned::compactd(&bin, &serve_args)?)
        }
    };
    let echo = Spawned::echo(&bin)?;
    let info = ServerInfo {
        addr: server.addr().to_string(),
        pid: server.pid(),
        args: match server {
            Server::Spawned(_) => serve_args
                .iter()
                .map(|a| a.to_string_lossy().into_owned())
                .collect(),
            Server::Target(_) => Vec::new(),
        },
    };
    let measured = runtime.block_on(measure(args, &pool, &server, &echo, info));
    if let Server::Spawned(s) = server {
        s.stop();
    }
    echo.stop();
    if let Some(dir) = data_dir {
        let _ = std::fs::remove_dir_all(dir);
    }
    let report = measured?;
    let text = if args.json {
        serde_json::to_string_pretty(&report).map_err(|e| BenchError::Io(e.to_string()))?
    } else {
        report.render()
    };
    {
        use std::io::Write as _;
        let mut out = std::io::stdout().lock();
        writeln!(out, "{text}").map_err(|e| BenchError::Io(format!("writing the report: {e}")))?;
    }
    if report.errors > 0 {
        return Err(BenchError::Failed {
            errors: report.errors,
            first: report.error_samples.first().cloned().unwrap_or_default(),
        });
    }
    Ok(())
}

/// The compactd server driven.
enum Server {
    Spawned(Spawned),
    Target(std::net::SocketAddr),
}

impl Server {
    fn addr(&self) -> std::net::SocketAddr {
        match self {
            Server::Spawned(s) => s.addr,
            Server::Target(a) => *a,
        }
    }

    fn pid(&self) -> Option<u32> {
        match self {
            Server::Spawned(s) => Some(s.pid()),
            Server::Target(_) => None,
        }
    }
}

/// Refuses flags that cannot make a run.
fn check(args: &BenchArgs) -> Result<(), BenchError> {
    let flag = |flag, message: &str| {
        Err(BenchError::Flag {
            flag,
            message: message.into(),
        })
    };
    if args.part_sizes.is_empty() || args.part_sizes.contains(&0) {
        return flag("part-sizes", "sizes are bytes above 0");
    }
    if args.streams.is_empty() || args.streams.contains(&0) {
        return flag("streams", "stream counts are above 0");
    }
    if args.updates == 0 {
        return flag("updates", "must be above 0");
    }
    if args.window == 0 {
        return flag("window", "must be above 0");
    }
    if !(1..=MAX_ROUNDS).contains(&args.rounds) {
        return flag("rounds", &format!("must be 1 to {MAX_ROUNDS}"));
    }
    Ok(())
}

/// The started server's flags: the bench's fixed ones, then the pass-through ones.
fn serve_args(args: &BenchArgs, data_dir: Option<&PathBuf>) -> Vec<OsString> {
    let mut out: Vec<OsString> = vec![
        "--durability".into(),
        args.durability.to_string().into(),
        "--tokenizer".into(),
        args.tokenizer.as_str().into(),
    ];
    if let Some(dir) = data_dir {
        out.push("--data-dir".into());
        out.push(dir.into());
    }
    out.extend(args.serve_args.iter().map(OsString::from));
    out
}

/// Failures over the run.
#[derive(Debug, Default)]
struct Tally {
    errors: u64,
    samples: Vec<String>,
}

impl Tally {
    fn driven(&mut self, what: &str, d: &Driven) {
        self.errors += d.errors;
        if let Some(e) = &d.first_error {
            self.note(format!("{what}: {e}"));
        }
    }

    fn failed(&mut self, what: &str, why: impl std::fmt::Display) {
        self.errors += 1;
        self.note(format!("{what}: {why}"));
    }

    fn note(&mut self, s: String) {
        if self.samples.len() < FAILURES_KEPT {
            self.samples.push(s);
        }
    }
}

/// Everything the run measures, over the two servers' connections.
struct Bench<'a> {
    args: &'a BenchArgs,
    pool: &'a Arc<Pool>,
    compactd: Channel,
    echo: Channel,
    bpe: &'static Bpe,
    bpe_name: &'static str,
    cores: usize,
    run: String,
    tally: Tally,
    /// The compactd server's pid (None with `--target`) and the echo's, whose CPU time
    /// each ingest case reads.
    server_pid: Option<u32>,
    echo_pid: u32,
}

async fn measure(
    args: &BenchArgs,
    pool: &Arc<Pool>,
    server: &Server,
    echo: &Spawned,
    info: ServerInfo,
) -> Result<Report, BenchError> {
    let counting = args.tokenizer.resolve("");
    let (bpe, bpe_name) = match counting {
        Counting::Cl100k => (&CL100K, "cl100k"),
        _ => (&O200K, "o200k"),
    };
    // The tables load once (a fraction of a second), never inside a timed case.
    let _ = tokio::task::spawn_blocking(move || bpe.warm_up()).await;
    let mut b = Bench {
        args,
        pool,
        compactd: connect("compactd", server.addr()).await?,
        echo: connect("the echo server", echo.addr).await?,
        bpe,
        bpe_name,
        cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
        run: format!("bench{}", std::process::id()),
        tally: Tally::default(),
        server_pid: server.pid(),
        echo_pid: echo.pid(),
    };
    // Warm both servers up (connections, first sessions, the server's BPE tables).
    b.ping_pong(
        "warm-up-chars4",
        Compactd::new(b.compactd.clone()),
        4096,
        "chars4",
        50,
    )
    .await;
    b.ping_pong(
        "warm-up-bpe",
        Compactd::new(b.compactd.clone()),
        4096,
        b.bpe_name,
        50,
    )
    .await;
    b.ping_pong("warm-up-echo", Echo::new(b.echo.clone()), 4096, "", 50)
        .await;
    let pid = b.server_pid;
    // "Start": ready and warmed up (its BPE tables loaded), before any measured case.
    let start = pid.and_then(stats::rss).map(|r| r.0);
    let mut ingest = Vec::new();
    for &size in &args.part_sizes {
        for &streams in &args.streams {
            ingest.extend(b.ingest_rows(size, streams).await);
        }
    }
    let mut latency = Vec::new();
    for &size in &args.part_sizes {
        latency.extend(b.latency_rows(size).await);
    }
    let get_context = b.context_rows().await;
    // jemalloc gives freed pages back within a quarter of a second.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let now = pid.and_then(stats::rss);
    let mut report = Report {
        cores: b.cores,
        server: info,
        echo_pid: b.echo_pid,
        workload: WorkloadInfo {
            traces: pool.traces(),
            tool_calls: pool.calls(),
            window: args.window,
            rounds: args.rounds,
            updates_per_case: args.updates,
            seconds_per_case: args.duration.as_secs_f64(),
        },
        ingest,
        latency,
        get_context,
        rss: Rss {
            start,
            peak: now.map(|r| r.1),
            end: now.map(|r| r.0),
        },
        errors: b.tally.errors,
        error_samples: b.tally.samples,
        misses: 0,
    };
    report.count_misses();
    Ok(report)
}

async fn connect(what: &'static str, addr: std::net::SocketAddr) -> Result<Channel, BenchError> {
    let fail = |message: String| BenchError::Connect {
        what,
        addr: addr.to_string(),
        message,
    };
    Endpoint::from_shared(format!("http://{addr}"))
        .map_err(|e| fail(e.to_string()))?
        .tcp_nodelay(true)
        .connect_timeout(Duration::from_secs(10))
        .connect()
        .await
        .map_err(|e| fail(format!("{e:?}")))
}

impl Bench<'_> {
    fn plan(&self, case: &str, sizing: Sizing, tokenizer: &str, stream: usize) -> Plan {
        Plan {
            prefix: format!("{}-{case}-s{stream}", self.run),
            sizing,
            tokenizer: tokenizer.into(),
            keep_everything: false,
            first_trace: stream,
        }
    }

    /// The ingest rows of one part size and stream count: chars4 against the echo, and
    /// BPE against the raw counting rate of min(streams, cores) threads; each row is the
    /// median of `--rounds` rounds.
    async fn ingest_rows(&mut self, size: usize, streams: usize) -> Vec<IngestRow> {
        let mut rounds: Vec<Vec<IngestRow>> = Vec::new();
        for round in 0..self.args.rounds {
            for (k, row) in self
                .ingest_round(size, streams, round)
                .await
                .into_iter()
                .enumerate()
            {
                match rounds.get_mut(k) {
                    Some(rows) => rows.push(row),
                    None => rounds.push(vec![row]),
                }
            }
        }
        rounds.into_iter().filter_map(median_round).collect()
    }

    /// One round of [`Self::ingest_rows`]: the echo, then each tokenizer's case.
    async fn ingest_round(&mut self, size: usize, streams: usize, round: usize) -> Vec<IngestRow> {
        let case = match round {
            0 => format!("{size}B-{streams}"),
            r => format!("{size}B-{streams}-r{r}"),
        };
        progress(&format!("ingest: {case}, echo"));
        let (echo, _) = self
            .ingest(
                &format!("{case}-echo"),
                Echo::new(self.echo.clone()),
                size,
                streams,
                "",
            )
            .await;
        let mut rows = Vec::new();
        for tokenizer in ["chars4", self.bpe_name] {
            progress(&format!("ingest: {case}, compactd {tokenizer}"));
            let label = format!("{case}-{tokenizer}");
            let (rate, acked) = self
                .ingest(
                    &label,
                    Compactd::new(self.compactd.clone()),
                    size,
                    streams,
                    tokenizer,
                )
                .await;
            let (reference, reference_rate, target) = if tokenizer == "chars4" {
                ("echo".to_string(), echo.clone(), INGEST_TARGET)
            } else {
                let threads = streams.min(self.cores);
                progress(&format!(
                    "ingest: {case}, raw {tokenizer} on {threads} threads"
                ));
                // The very updates compactd acknowledged, counted again on the client.
                let work: Vec<(Plan, usize)> = acked
                    .iter()
                    .enumerate()
                    .map(|(s, n)| (self.plan(&label, Sizing::Exact(size), tokenizer, s), *n))
                    .collect();
                let (pool, bpe, budget) = (self.pool.clone(), self.bpe, self.args.duration * 4);
                let counted = tokio::task::spawn_blocking(move || {
                    stats::raw_bpe(&pool, bpe, &work, threads, budget)
                })
                .await
                .unwrap_or_default();
                let rate = Rate::new(
                    counted.updates,
                    counted.bytes,
                    counted.elapsed.as_secs_f64(),
                )
                .with_cpu(None, counted.cpu_seconds);
                let what = format!("{tokenizer} raw, {threads} thread{}", plural(threads));
                (what, rate, BPE_INGEST_TARGET)
            };
            let exchange = echo.exchange_cpu_us().filter(|_| tokenizer != "chars4");
            let bound = bpe_bound(
                self.cores,
                reference_rate.count_cpu_us,
                exchange,
                reference_rate.updates_per_s,
            );
            let r = ratio(rate.updates_per_s, reference_rate.updates_per_s);
            rows.push(IngestRow {
                part_bytes: size,
                streams,
                tokenizer: tokenizer.into(),
                compactd: rate,
                reference,
                reference_rate,
                ratio: r,
                ratio_range: (r, r),
                bound,
                bound_exchange_us: exchange,
                target,
                miss: !target.met(r),
            });
        }
        rows
    }

    /// One ingest case: `streams` streams of `wire` at once, each sending its own
    /// sessions; the case's sessions are deleted afterwards. Also returns how many updates
    /// each stream had acknowledged.
    async fn ingest<W: Wire + Clone>(
        &mut self,
        label: &str,
        wire: W,
        size: usize,
        streams: usize,
        tokenizer: &str,
    ) -> (Rate, Vec<usize>) {
        let per = self.args.updates.div_ceil(streams).max(1);
        let window = self.args.window;
        let pid = if W::HOLDS_SESSIONS {
            self.server_pid
        } else {
            Some(self.echo_pid)
        };
        // Every stream's updates are built before the clock starts (see `prepared.rs`).
        let budget = prepared::BUDGET / streams.max(1);
        let prepared: Vec<Prepared> = (0..streams)
            .map(|s| {
                let plan = self.plan(label, Sizing::Exact(size), tokenizer, s);
                Prepared::new(self.pool.updates(plan), per, budget)
            })
            .collect();
        // The counting threads are compactd's alone (the echo has none).
        let counting =
            |pid: u32| stats::thread_times(pid, Some(crate::server::COUNT_THREAD_PREFIX));
        let all = |pid: u32| stats::thread_times(pid, None);
        let count_pid = pid.filter(|_| W::HOLDS_SESSIONS);
        let count_before = count_pid.and_then(counting);
        let cpu_before = pid.and_then(all);
        let client_before = all(std::process::id());
        let began = Instant::now();
        let deadline = began + self.args.duration;
        let tasks: Vec<_> = prepared
            .into_iter()
            .map(|mut updates| {
                let wire = wire.clone();
                tokio::spawn(async move {
                    let d = drive(wire, &mut updates, per, window, deadline).await;
                    (d, updates.sessions().to_vec())
                })
            })
            .collect();
        let (mut acked, mut bytes, mut sessions) = (0u64, 0u64, Vec::new());
        let mut per_stream = Vec::with_capacity(streams);
        for t in tasks {
            match t.await {
                Ok((d, s)) => {
                    self.tally.driven(&format!("ingest {label}"), &d);
                    per_stream.push(usize::try_from(d.acked).unwrap_or(usize::MAX));
                    acked += d.acked;
                    bytes += d.bytes;
                    sessions.extend(s);
                }
                Err(e) => {
                    self.tally.failed(&format!("ingest {label}"), e);
                    per_stream.push(0);
                }
            }
        }
        let elapsed = began.elapsed().as_secs_f64();
        let client = stats::spent(client_before, all(std::process::id()));
        let cpu = stats::spent(cpu_before, pid.and_then(all));
        let count = stats::spent(count_before, count_pid.and_then(counting));
        let rate = Rate::new(acked, bytes, elapsed)
            .with_cpu(cpu, count)
            .with_client_cpu(client);
        if W::HOLDS_SESSIONS {
            self.delete(&sessions).await;
        }
        (rate, per_stream)
    }

    /// The latency rows of one part size: chars4 against the echo, BPE against the echo
    /// with the same texts counted on the client before each send; every round times the
    /// references and then compactd, and the percentiles are over all rounds' samples.
    async fn latency_rows(&mut self, size: usize) -> Vec<LatencyRow> {
        progress(&format!("ack latency: {size} B"));
        let tokenizers = ["chars4", self.bpe_name];
        let updates = self.args.updates;
        let (mut echo, mut counted) = (Vec::new(), Vec::new());
        let mut own: [Vec<Duration>; 2] = Default::default();
        for round in 0..self.args.rounds {
            let wire = Echo::new(self.echo.clone());
            echo.extend(
                self.ping_pong(&format!("echo-r{round}"), wire, size, "", updates)
                    .await,
            );
            let wire = Echo::new(self.echo.clone()).counting(self.bpe);
            counted.extend(
                self.ping_pong(&format!("echo+count-r{round}"), wire, size, "", updates)
                    .await,
            );
            for (samples, tokenizer) in own.iter_mut().zip(tokenizers) {
                let wire = Compactd::new(self.compactd.clone());
                let label = format!("{tokenizer}-r{round}");
                samples.extend(self.ping_pong(&label, wire, size, tokenizer, updates).await);
            }
        }
        let (echo, counted) = (latency(echo), latency(counted));
        let mut rows = Vec::new();
        for (samples, tokenizer) in own.into_iter().zip(tokenizers) {
            let compactd = latency(samples);
            let (reference, reference_latency) = if tokenizer == "chars4" {
                ("echo".to_string(), echo.clone())
            } else {
                (format!("echo + {tokenizer} count"), counted.clone())
            };
            let ratio_p50 = ratio(compactd.p50_us, reference_latency.p50_us);
            let ratio_p99 = ratio(compactd.p99_us, reference_latency.p99_us);
            rows.push(LatencyRow {
                part_bytes: size,
                tokenizer: tokenizer.into(),
                compactd,
                reference,
                reference_latency,
                ratio_p50,
                ratio_p99,
                target: LATENCY_TARGET,
                miss: !(LATENCY_TARGET.met(ratio_p50) && LATENCY_TARGET.met(ratio_p99)),
            });
        }
        rows
    }

    /// One stream, one update in flight: the send-to-answer times of the updates that
    /// carry a tool output (the other updates of the sequence are sent and answered, but
    /// their times are not the part size's).
    async fn ping_pong<W: Wire>(
        &mut self,
        label: &str,
        wire: W,
        size: usize,
        tokenizer: &str,
        limit: usize,
    ) -> Vec<Duration> {
        let case = format!("pp-{size}B-{label}");
        let mut updates = self
            .pool
            .updates(self.plan(&case, Sizing::Exact(size), tokenizer, 0));
        let deadline = Instant::now() + self.args.duration;
        let d = drive(wire, &mut updates, limit, 1, deadline).await;
        self.tally.driven(&format!("latency {case}"), &d);
        if W::HOLDS_SESSIONS {
            self.delete(updates.sessions()).await;
        }
        d.tool_latencies
    }

    /// Builds the large session, then times GetContext on it in both OpenAI shapes (a
    /// protobuf `ListValue` and one JSON text) and the native one, each against a unary
    /// echo whose reply has as many bytes.
    async fn context_rows(&mut self) -> Vec<ContextRow> {
        progress(&format!(
            "GetContext: building a {}-token session",
            self.args.context_tokens
        ));
        let mut updates = self.pool.updates(Plan {
            prefix: format!("{}-context", self.run),
            sizing: Sizing::Natural(CONTEXT_OUTPUT_CAP),
            tokenizer: self.args.tokenizer.as_str().into(),
            keep_everything: true,
            first_trace: 0,
        });
        let mut client = drive::client(self.compactd.clone());
        let mut sent = 0u64;
        let mut next = 10usize;
        let mut sid = String::new();
        // Bounded: at most this many rounds of updates, each followed by one GetContext.
        for _ in 0..200 {
            let deadline = Instant::now() + Duration::from_secs(60);
            let d = drive(
                Compactd::new(self.compactd.clone()),
                &mut updates,
                next,
                self.args.window,
                deadline,
            )
            .await;
            self.tally.driven("GetContext session", &d);
            sent += d.acked;
            sid = updates.sessions().first().cloned().unwrap_or_default();
            let tokens = match client
                .get_context(context_request(&sid, pb::ContextFormat::Openai))
                .await
            {
                Ok(r) => r.into_inner().estimated_tokens,
                Err(status) => {
                    self.tally.failed("GetContext", status);
                    break;
                }
            };
            if tokens >= self.args.context_tokens || d.acked == 0 {
                break;
            }
            // Aim the next round at half the tokens still missing, so that outputs larger
            // than the average so far overshoot the size little.
            let per_update = (tokens / sent.max(1)).max(1);
            let missing = self.args.context_tokens - tokens;
            next = usize::try_from(missing / per_update / 2 + 1)
                .unwrap_or(usize::MAX)
                .clamp(1, 5_000);
        }
        let mut rows = Vec::new();
        // The native shape is what OpenCode's plugin asks for.
        let formats = [
            pb::ContextFormat::Openai,
            pb::ContextFormat::OpenaiJson,
            pb::ContextFormat::Native,
        ];
        for format in formats {
            rows.push(self.time_context(&sid, format).await);
        }
        self.delete(std::slice::from_ref(&sid)).await;
        rows
    }

    /// Times GetContext of `sid` in `format`, then a unary echo whose reply has as many
    /// bytes, `--rounds` times; the percentiles are over every round's samples. Each call
    /// follows a change to the session, as a host's does (it asks for the context after
    /// streaming the turn): the user's next prompt, rewritten before every call and not
    /// timed. The echo gets an untimed request of the same size before each call too.
    async fn time_context(&mut self, sid: &str, format: pb::ContextFormat) -> ContextRow {
        progress(&format!("GetContext: timing {}", format.as_str_name()));
        // The reply is taken as bytes, as the echo's client takes the echo's, and decoded
        // after the call is timed (see `raw`).
        let mut client = raw::RawClient::new(self.compactd.clone());
        let mut updates = drive::client(self.compactd.clone());
        let prompt = workload::prompt_message(&format!("{}-prompt", self.run));
        let opened = updates
            .upsert_message(pb::UpsertMessageRequest {
                session_id: sid.into(),
                message: Some(prompt.clone()),
            })
            .await;
        if let Err(status) = opened {
            self.tally.failed("UpsertMessage (the prompt)", status);
        }
        let (mut own, mut echo, mut decode) = (Vec::new(), Vec::new(), Vec::new());
        let (mut reply_bytes, mut tokens) = (0u64, 0u64);
        let mut echo_client = drive::echo_client(self.echo.clone());
        let request_bytes = context_request(sid, format).encoded_len();
        let mut prompts = 0u64;
        'rounds: for _ in 0..self.args.rounds {
            let deadline = Instant::now() + self.args.duration;
            let mut n = 0;
            while n < self.args.updates && Instant::now() < deadline {
                prompts += 1;
                let request = pb::UpsertPartRequest {
                    session_id: sid.into(),
                    part: Some(workload::prompt_text(&prompt.id, prompts)),
                };
                if let Err(status) = updates.upsert_part(request).await {
                    self.tally.failed("UpsertPart (the prompt)", status);
                    break 'rounds;
                }
                let at = Instant::now();
                match client.get_context(context_request(sid, format)).await {
                    Ok(bytes) => {
                        own.push(at.elapsed());
                        n += 1;
                        reply_bytes = bytes.len() as u64;
                        let at = Instant::now();
                        match pb::Context::decode(bytes) {
                            Ok(r) => {
                                decode.push(at.elapsed());
                                tokens = r.estimated_tokens;
                            }
                            Err(e) => {
                                let status = tonic::Status::internal(format!(
                                    "the reply does not decode as a Context: {e}"
                                ));
                                self.tally.failed("GetContext", status);
                                break 'rounds;
                            }
                        }
                    }
                    Err(status) => {
                        self.tally.failed("GetContext", status);
                        break 'rounds;
                    }
                }
            }
            let (deadline, mut n) = (Instant::now() + self.args.duration, 0);
            let prompt_bytes = pb::UpsertPartRequest {
                session_id: sid.into(),
                part: Some(workload::prompt_text(&prompt.id, prompts)),
            }
            .encoded_len();
            while n < self.args.updates && Instant::now() < deadline {
                let request = echo::pb::EchoRequest {
                    seq: n as u64,
                    payload: vec![0u8; prompt_bytes].into(),
                    reply_bytes: 8,
                };
                if let Err(status) = echo_client.unary(request).await {
                    self.tally.failed("echo unary", status);
                    break 'rounds;
                }
                let request = echo::pb::EchoRequest {
                    seq: n as u64,
                    payload: vec![0u8; request_bytes].into(),
                    reply_bytes,
                };
                let at = Instant::now();
                match echo_client.unary(request).await {
                    Ok(_) => {
                        echo.push(at.elapsed());
                        n += 1;
                    }
                    Err(status) => {
                        self.tally.failed("echo unary", status);
                        break 'rounds;
                    }
                }
            }
        }
        let compactd = latency(own);
        let echo = latency(echo);
        let ratio_p50 = ratio(compactd.p50_us, echo.p50_us);
        let ratio_p99 = ratio(compactd.p99_us, echo.p99_us);
        let format = match format {
            pb::ContextFormat::OpenaiJson => "openai_json",
            pb::ContextFormat::Native => "native",
            _ => "openai",
        };
        ContextRow {
            tokens,
            reply_bytes,
            format: format.into(),
            compactd,
            echo,
            client_decode: latency(decode),
            ratio_p50,
            ratio_p99,
            target: LATENCY_TARGET,
            miss: !(LATENCY_TARGET.met(ratio_p50) && LATENCY_TARGET.met(ratio_p99)),
        }
    }

    /// Deletes the bench's sessions, so each case starts from an empty server.
    async fn delete(&mut self, sessions: &[String]) {
        let mut client = drive::client(self.compactd.clone());
        for sid in sessions.iter().filter(|s| !s.is_empty()) {
            let request = pb::DeleteSessionRequest {
                session_id: sid.clone(),
            };
            if let Err(status) = client.delete_session(request).await {
                self.tally.failed(&format!("DeleteSession {sid}"), status);
            }
        }
    }
}

fn context_request(sid: &str, format: pb::ContextFormat) -> pb::GetContextRequest {
    pb::GetContextRequest {
        session_id: sid.into(),
        format: format.into(),
    }
}

fn plural(n: usize) -> &'static str {
    if n == 1 { "" } else { "s" }
}

fn progress(what: &str) {
    eprintln!("compactd bench: {what}");
}

fn parse_seconds(s: &str) -> Result<Duration, String> {
    let secs: f64 = s
        .parse()
        .map_err(|e| format!("{s:?} is not a number of seconds ({e})"))?;
    if !(secs > 0.0 && secs <= 3600.0) {
        return Err(format!("{s} is not in (0, 3600] seconds"));
    }
    Ok(Duration::from_secs_f64(secs))
}

fn parse_bpe(s: &str) -> Result<Tokenizer, String> {
    let t: Tokenizer = s
        .parse()
        .map_err(|e: crate::tokens::UnknownTokenizer| e.to_string())?;
    if t == Tokenizer::Chars4 {
        return Err(
            "the chars4 rows always run; --tokenizer picks the BPE (auto, o200k, cl100k)".into(),
        );
    }
    Ok(t)
}
