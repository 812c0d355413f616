//! What `compactd bench` found, as values (serialized whole for `--json`) and as the
//! tables it prints. Each compared figure carries its target and whether it missed it;
//! nothing here measures.

use std::fmt::Write as _;

use serde::Serialize;

/// The whole run.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// CPUs this process may use (`available_parallelism`).
    pub cores: usize,
    /// The compactd server driven.
    pub server: ServerInfo,
    /// The echo server's process id.
    pub echo_pid: u32,
    /// What the sessions are made of and each case's bounds.
    pub workload: WorkloadInfo,
    /// Ingest throughput, per part size, stream count and tokenizer.
    pub ingest: Vec<IngestRow>,
    /// Ping-pong ack latency on one stream, per part size and tokenizer.
    pub latency: Vec<LatencyRow>,
    /// `GetContext` latency of the large session.
    pub get_context: Vec<ContextRow>,
    /// The server's resident memory.
    pub rss: Rss,
    /// Failed RPCs and refused or unanswered updates, over the whole run.
    pub errors: u64,
    /// The first few failures.
    pub error_samples: Vec<String>,
    /// Figures that missed their target.
    pub misses: usize,
}

/// The compactd server driven.
#[derive(Debug, Clone, Serialize)]
pub struct ServerInfo {
    /// Where it listens.
    pub addr: String,
    /// Its process id, when the bench started it.
    pub pid: Option<u32>,
    /// The `serve` flags it was started with (empty for `--target`).
    pub args: Vec<String>,
}

/// The workload and its bounds.
#[derive(Debug, Clone, Serialize)]
pub struct WorkloadInfo {
    /// Traces the sessions replay.
    pub traces: usize,
    /// Completed tool calls in them.
    pub tool_calls: usize,
    /// Updates each stream keeps in flight in the ingest cases.
    pub window: usize,
    /// Rounds of every case, each right after its reference.
    pub rounds: usize,
    /// Most updates (or calls) per measured case.
    pub updates_per_case: usize,
    /// Longest a measured case sends for, in seconds.
    pub seconds_per_case: f64,
}

/// A ratio's target.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Target {
    /// The ratio must be at least this.
    Min(f64),
    /// The ratio must be at most this.
    Max(f64),
}

impl Target {
    /// Whether `ratio` meets the target (a ratio that could not be computed does not).
    pub fn met(self, ratio: f64) -> bool {
        match self {
            _ if !ratio.is_finite() => false,
            Target::Min(t) => ratio >= t,
            Target::Max(t) => ratio <= t,
        }
    }

    fn label(self) -> String {
        match self {
            Target::Min(t) => format!(">= {:.0}%", t * 100.0),
            Target::Max(t) => format!("<= {t}x"),
        }
    }

    /// A ratio as the tables print it: rounded, except that a miss never reads as its
    /// target (79.6% of an 80% target is "79%", 2.001× of a 2× one "2.01x"); a row
    /// marked `MISS` would otherwise show the very figure it missed.
    fn ratio(self, r: f64) -> String {
        let missed = !self.met(r);
        let hundredths = (r * 100.0).round();
        match self {
            _ if !r.is_finite() => "n/a".into(),
            Target::Min(t) if missed => {
                format!("{:.0}%", hundredths.min((t * 100.0).round() - 1.0))
            }
            Target::Min(_) => format!("{hundredths:.0}%"),
            Target::Max(t) if missed => {
                format!("{:.2}x", hundredths.max((t * 100.0).round() + 1.0) / 100.0)
            }
            Target::Max(_) => format!("{:.2}x", hundredths / 100.0),
        }
    }
}

/// A throughput: what was sent, how fast.
#[derive(Debug, Clone, Serialize)]
pub struct Rate {
    /// Updates acknowledged (or counted, for the raw BPE reference).
    pub updates: u64,
    /// Wall time of the case.
    pub seconds: f64,
    /// Updates per second.
    pub updates_per_s: f64,
    /// Protobuf megabytes (10^6 bytes) of those updates per second.
    pub mb_per_s: f64,
    /// CPU time the serving process spent per update, in microseconds (all its threads;
    /// None when its pid is unknown, e.g. `--target`, or for the raw BPE reference). It
    /// shows why a ratio is what it is: each side's cost, apart from the shared client.
    pub server_cpu_us: Option<f64>,
    /// Of that, what its counting threads spent per update (the BPE counts of long texts
    /// off the async runtime), in microseconds; None for the echo and with `--target`.
    /// It splits a BPE row's cost into the counting and the rest. For the raw BPE
    /// reference, the CPU its counting threads (in this process) spent: all its work.
    pub count_cpu_us: Option<f64>,
    /// CPU time the load generator (this process, all its threads) spent per update
    /// driving the server, in microseconds; None for the raw BPE reference, which has no
    /// client. It is the client's share of the cores the server runs on.
    pub client_cpu_us: Option<f64>,
}

impl Rate {
    /// `updates` of `bytes` in `seconds`.
    pub fn new(updates: u64, bytes: u64, seconds: f64) -> Rate {
        let per_s = |n: f64| if seconds > 0.0 { n / seconds } else { 0.0 };
        Rate {
            updates,
            seconds,
            updates_per_s: per_s(updates as f64),
            mb_per_s: per_s(bytes as f64) / 1e6,
            server_cpu_us: None,
            count_cpu_us: None,
            client_cpu_us: None,
        }
    }

    /// The same, with `cpu_seconds` of the serving process, and `count_seconds` of its
    /// counting threads, spread over its updates.
    pub fn with_cpu(mut self, cpu_seconds: Option<f64>, count_seconds: Option<f64>) -> Rate {
        self.server_cpu_us = self.per_update_us(cpu_seconds);
        self.count_cpu_us = self.per_update_us(count_seconds);
        self
    }

    /// The same, with `seconds` of the load generator's CPU spread over its updates.
    pub fn with_client_cpu(mut self, seconds: Option<f64>) -> Rate {
        self.client_cpu_us = self.per_update_us(seconds);
        self
    }

    /// `seconds` of CPU per update, in microseconds; None when unknown or no update was
    /// sent.
    fn per_update_us(&self, seconds: Option<f64>) -> Option<f64> {
        seconds
            .filter(|_| self.updates > 0)
            .map(|s| s * 1e6 / self.updates as f64)
    }

    /// The CPU per update of the whole exchange on this machine: the server's and its
    /// client's, in microseconds; None unless both are known.
    pub fn exchange_cpu_us(&self) -> Option<f64> {
        Some(self.server_cpu_us? + self.client_cpu_us?)
    }
}

/// The highest ratio to `reference_per_s` (the raw BPE rate of its threads, which share
/// the cores with nothing) that `cores` allow a server that counts each update in
/// `count_us` of CPU and otherwise costs what the echo's exchange costs (`exchange_us`:
/// its server and the client driving it, per update). The bench's client shares the
/// cores, so once they are full no server can do better. None when a figure is unknown.
pub fn bpe_bound(
    cores: usize,
    count_us: Option<f64>,
    exchange_us: Option<f64>,
    reference_per_s: f64,
) -> Option<f64> {
    let per_update_us = count_us? + exchange_us?;
    let bound = cores as f64 * 1e6 / (per_update_us * reference_per_s);
    bound.is_finite().then_some(bound)
}

/// One ingest case against its reference.
#[derive(Debug, Clone, Serialize)]
pub struct IngestRow {
    /// Bytes of each tool output.
    pub part_bytes: usize,
    /// Concurrent streams, each with its own sessions.
    pub streams: usize,
    /// What the sessions counted with.
    pub tokenizer: String,
    /// compactd's figures.
    pub compactd: Rate,
    /// What the reference is: `echo`, or `o200k raw, N threads`.
    pub reference: String,
    /// The reference's figures.
    pub reference_rate: Rate,
    /// compactd's updates/s over the reference's (the median round's: every figure of
    /// the row is that round's).
    pub ratio: f64,
    /// The lowest and highest ratio of the rounds.
    pub ratio_range: (f64, f64),
    /// For a BPE row, the highest ratio this machine allows ([`bpe_bound`]): counting at
    /// the raw rate, plus the echo's server and client CPU per update of the same round,
    /// on all the cores. None for a chars4 row (it counts nothing: its reference is the
    /// echo itself) and when a figure is unknown.
    pub bound: Option<f64>,
    /// The echo's server and client CPU per update the bound counted on (that round's echo
    /// case, the same part size and streams); None for a chars4 row.
    pub bound_exchange_us: Option<f64>,
    /// The ratio's target.
    pub target: Target,
    /// True when the ratio misses the target.
    pub miss: bool,
}

/// The round of one ingest row whose ratio is the median (the lower middle of an even
/// count), with the range of all rounds' ratios; None for no rounds. A ratio that could
/// not be computed sorts last.
pub fn median_round(mut rounds: Vec<IngestRow>) -> Option<IngestRow> {
    let key = |r: &IngestRow| {
        if r.ratio.is_finite() {
            r.ratio
        } else {
            f64::INFINITY
        }
    };
    rounds.sort_by(|a, b| key(a).total_cmp(&key(b)));
    let finite = || rounds.iter().map(|r| r.ratio).filter(|r| r.is_finite());
    let range = (
        finite().fold(f64::NAN, f64::min),
        finite().fold(f64::NAN, f64::max),
    );
    let middle = rounds.len().checked_sub(1)? / 2;
    let mut row = rounds.swap_remove(middle);
    row.ratio_range = range;
    Some(row)
}

/// Latency percentiles, in microseconds.
#[derive(Debug, Clone, Serialize)]
pub struct Latency {
    /// Samples taken.
    pub samples: usize,
    /// Median.
    pub p50_us: f64,
    /// 99th percentile.
    pub p99_us: f64,
}

/// One ping-pong case against its reference.
#[derive(Debug, Clone, Serialize)]
pub struct LatencyRow {
    /// Bytes of each tool output.
    pub part_bytes: usize,
    /// What the session counted with.
    pub tokenizer: String,
    /// compactd's send-to-ack latency.
    pub compactd: Latency,
    /// What the reference is: `echo`, or `echo + o200k count`.
    pub reference: String,
    /// The reference's latency.
    pub reference_latency: Latency,
    /// compactd's p50 over the reference's.
    pub ratio_p50: f64,
    /// compactd's p99 over the reference's.
    pub ratio_p99: f64,
    /// The target of both ratios.
    pub target: Target,
    /// True when either ratio misses the target.
    pub miss: bool,
}

/// `GetContext` of the large session against a unary echo of as many reply bytes.
#[derive(Debug, Clone, Serialize)]
pub struct ContextRow {
    /// The context's estimated tokens, as GetContext reports them.
    pub tokens: u64,
    /// Protobuf bytes of one reply.
    pub reply_bytes: u64,
    /// The format asked for.
    pub format: String,
    /// compactd's call latency.
    pub compactd: Latency,
    /// The unary echo's.
    pub echo: Latency,
    /// Decoding one of compactd's replies into the generated `Context` on the client (prost,
    /// after the call was timed; not in `compactd`, as the echo's client decodes nothing).
    pub client_decode: Latency,
    /// compactd's p50 over the echo's.
    pub ratio_p50: f64,
    /// compactd's p99 over the echo's.
    pub ratio_p99: f64,
    /// The target of both ratios.
    pub target: Target,
    /// True when either ratio misses the target.
    pub miss: bool,
}

/// The server's resident memory in bytes (None: not measurable, e.g. `--target` or not
/// Linux).
#[derive(Debug, Clone, Default, Serialize)]
pub struct Rss {
    /// Once it was ready, before any load.
    pub start: Option<u64>,
    /// Its peak over the run (`VmHWM`).
    pub peak: Option<u64>,
    /// After the last case, its sessions deleted.
    pub end: Option<u64>,
}

/// A ratio of two figures; NaN when the reference is zero.
pub fn ratio(value: f64, reference: f64) -> f64 {
    if reference > 0.0 {
        value / reference
    } else {
        f64::NAN
    }
}

impl Report {
    /// Counts the rows that missed their target.
    pub fn count_misses(&mut self) {
        self.misses = self.ingest.iter().filter(|r| r.miss).count()
            + self.latency.iter().filter(|r| r.miss).count()
            + self.get_context.iter().filter(|r| r.miss).count();
    }

    /// The report as tables, for people.
    pub fn render(&self) -> String {
        let mut o = String::new();
        let server = match self.server.pid {
            Some(pid) => format!(
                "{} (pid {pid}, started: serve {})",
                self.server.addr,
                self.server.args.join(" ")
            ),
            None => format!("{} (--target)", self.server.addr),
        };
        let w = &self.workload;
        let _ = writeln!(
            o,
            "compactd bench: server {server}; echo pid {}; {} cores\n\
             workload: {} traces, {} tool calls; each session replays one trace with every tool \
             output at the part size; {} updates in flight per stream; each case at most {} \
             updates or {} s, run {} time{} (each round right after its reference: an ingest row \
             is the median round, the rounds' range beside it; latencies are percentiles of all \
             rounds' samples)",
            self.echo_pid,
            self.cores,
            w.traces,
            w.tool_calls,
            w.window,
            w.updates_per_case,
            w.seconds_per_case,
            w.rounds,
            if w.rounds == 1 { "" } else { "s" }
        );
        let _ = writeln!(
            o,
            "\nINGEST (MB/s: protobuf bytes of the updates; CPU: the serving process's CPU µs per update (for a raw reference, its counting threads'); count: the part compactd's counting threads took; client: the load generator's CPU µs per update; bound: the most a BPE row can reach here, counting at the raw rate and otherwise costing the CPU of the echo case of its own round, client included, which may not be the round shown on the chars4 row; --json has it as bound_exchange_us)\n{:<6} {:>7} {:<9} {:>11} {:>8} {:>6} {:>6} {:>6}   {:<22} {:>11} {:>8} {:>6} {:>6} {:>7} {:>6} {:>11}  {:<8}",
            "part",
            "streams",
            "tokenizer",
            "updates/s",
            "MB/s",
            "CPU",
            "count",
            "client",
            "reference",
            "updates/s",
            "MB/s",
            "CPU",
            "client",
            "ratio",
            "bound",
            "rounds",
            "target"
        );
        for r in &self.ingest {
            let range = format!(
                "{}-{}",
                r.target.ratio(r.ratio_range.0),
                r.target.ratio(r.ratio_range.1)
            );
            // A raw reference's CPU is its counting.
            let reference = &r.reference_rate;
            let reference_cpu = reference.server_cpu_us.or(reference.count_cpu_us);
            let _ = writeln!(
                o,
                "{:<6} {:>7} {:<9} {:>11.0} {:>8.1} {:>6} {:>6} {:>6}   {:<22} {:>11.0} {:>8.1} {:>6} {:>6} {:>7} {:>6} {:>11}  {:<8}{}",
                size(r.part_bytes),
                r.streams,
                r.tokenizer,
                r.compactd.updates_per_s,
                r.compactd.mb_per_s,
                cpu(r.compactd.server_cpu_us),
                cpu(r.compactd.count_cpu_us),
                cpu(r.compactd.client_cpu_us),
                r.reference,
                r.reference_rate.updates_per_s,
                r.reference_rate.mb_per_s,
                cpu(reference_cpu),
                cpu(r.reference_rate.client_cpu_us),
                r.target.ratio(r.ratio),
                r.bound.map_or_else(|| "-".into(), |b| r.target.ratio(b)),
                range,
                r.target.label(),
                miss(r.miss)
            );
        }
        let _ = writeln!(
            o,
            "\nACK LATENCY of tool-output updates, one stream, one update in flight (µs)\n{:<6} {:<9} {:>8} {:>8}   {:<20} {:>8} {:>8} {:>7} {:>7}  {:<8}",
            "part",
            "tokenizer",
            "p50",
            "p99",
            "reference",
            "p50",
            "p99",
            "p50 x",
            "p99 x",
            "target"
        );
        for r in &self.latency {
            let _ = writeln!(
                o,
                "{:<6} {:<9} {:>8} {:>8}   {:<20} {:>8} {:>8} {:>7} {:>7}  {:<8}{}",
                size(r.part_bytes),
                r.tokenizer,
                us(r.compactd.p50_us),
                us(r.compactd.p99_us),
                r.reference,
                us(r.reference_latency.p50_us),
                us(r.reference_latency.p99_us),
                r.target.ratio(r.ratio_p50),
                r.target.ratio(r.ratio_p99),
                r.target.label(),
                miss(r.miss)
            );
        }
        for c in &self.get_context {
            let _ = writeln!(
                o,
                "\nGETCONTEXT of a {}-token session ({} format, reply {:.2} MB; µs; both replies taken as bytes)\n{:<22} {:>8} {:>8}\n{:<22} {:>8} {:>8}\n{:<22} {:>8} {:>8}\n{:<22} {:>8} {:>8}  {:<8}{}\n{:<22} {:>8} {:>8}  (prost, on the client; not in the ratio)",
                c.tokens,
                c.format,
                c.reply_bytes as f64 / 1e6,
                "",
                "p50",
                "p99",
                "compactd GetContext",
                us(c.compactd.p50_us),
                us(c.compactd.p99_us),
                "echo, unary, same size",
                us(c.echo.p50_us),
                us(c.echo.p99_us),
                "ratio",
                c.target.ratio(c.ratio_p50),
                c.target.ratio(c.ratio_p99),
                c.target.label(),
                miss(c.miss),
                "decoding the reply",
                us(c.client_decode.p50_us),
                us(c.client_decode.p99_us),
            );
        }
        let mb = |b: Option<u64>| b.map_or("n/a".into(), |b| format!("{:.1} MB", b as f64 / 1e6));
        let _ = writeln!(
            o,
            "\nSERVER RSS: start {}, peak {}, end {}",
            mb(self.rss.start),
            mb(self.rss.peak),
            mb(self.rss.end)
        );
        let _ = writeln!(o, "targets missed: {}", self.misses);
        let _ = write!(o, "errors: {}", self.errors);
        for e in &self.error_samples {
            let _ = write!(o, "\n  {e}");
        }
        o
    }
}

fn size(bytes: usize) -> String {
    if bytes.is_multiple_of(1024) {
        format!("{} KB", bytes / 1024)
    } else {
        format!("{bytes} B")
    }
}

/// A CPU figure of the ingest table (µs per update), `-` when unknown.
fn cpu(us: Option<f64>) -> String {
    us.map_or_else(|| "-".into(), |us| format!("{us:.1}"))
}

/// A latency in whole µs, `n/a` when none was measured (NaN).
fn us(us: f64) -> String {
    if us.is_finite() {
        format!("{us:.0}")
    } else {
        "n/a".into()
    }
}

fn miss(missed: bool) -> &'static str {
    if missed { "MISS" } else { "" }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_and_ratios() {
        assert!(Target::Min(0.5).met(0.5));
        assert!(!Target::Min(0.5).met(0.49));
        assert!(Target::Max(2.0).met(1.9));
        assert!(!Target::Max(2.0).met(f64::NAN));
        assert!(ratio(1.0, 0.0).is_nan());
        assert_eq!(Target::Min(0.8).ratio(0.853), "85%");
        assert_eq!(Target::Max(2.0).ratio(1.5), "1.50x");
        // A miss never prints as its target.
        assert!(!Target::Min(0.8).met(0.7961));
        assert_eq!(Target::Min(0.8).ratio(0.7961), "79%");
        assert!(!Target::Max(2.0).met(2.001));
        assert_eq!(Target::Max(2.0).ratio(2.001), "2.01x");
        assert_eq!(Target::Max(2.0).ratio(f64::INFINITY), "n/a");
        assert_eq!(Target::Max(2.0).ratio(110.0 / 100.0), "1.10x");
        assert_eq!(Target::Min(0.5).ratio(0.29), "29%");
        assert_eq!(Target::Min(0.8).ratio(0.8 - 1e-12), "79%");
        assert_eq!(Target::Max(2.0).ratio(2.0 + 1e-12), "2.01x");
        assert_eq!(Target::Min(0.8).ratio(0.8), "80%");
        assert_eq!(Target::Max(2.0).ratio(2.0), "2.00x");
        assert_eq!(us(12.6), "13");
        assert_eq!(us(f64::NAN), "n/a");
    }

    /// A round whose compactd sent `updates` (so each round is recognisable) at `ratio`.
    fn round(updates: u64, ratio: f64) -> IngestRow {
        IngestRow {
            part_bytes: 4096,
            streams: 1,
            tokenizer: "chars4".into(),
            compactd: Rate::new(updates, 0, 1.0),
            reference: "echo".into(),
            reference_rate: Rate::new(1, 0, 1.0),
            ratio,
            ratio_range: (ratio, ratio),
            bound: None,
            bound_exchange_us: None,
            target: Target::Min(0.5),
            miss: false,
        }
    }

    #[test]
    fn an_ingest_row_is_its_median_round_with_the_range_of_all() {
        let row = median_round(vec![round(1, 0.9), round(2, 0.1), round(3, 0.5)]);
        let row = row.expect("three rounds");
        assert_eq!((row.compactd.updates, row.ratio), (3, 0.5));
        assert_eq!(row.ratio_range, (0.1, 0.9));
        // An even count takes the lower middle; a ratio that could not be computed sorts
        // last and stays out of the range.
        let row = median_round(vec![
            round(1, 0.5),
            round(2, f64::NAN),
            round(3, 0.3),
            round(4, 0.4),
        ]);
        let row = row.expect("four rounds");
        assert_eq!((row.compactd.updates, row.ratio), (4, 0.4));
        assert_eq!(row.ratio_range, (0.3, 0.5));
        assert!(median_round(Vec::new()).is_none());
    }

    #[test]
    fn the_bpe_bound_is_the_cores_over_counting_and_the_echos_exchange() {
        // Two cores; counting 30 µs an update and the echo's exchange 10 µs: at most
        // 50,000 updates/s, 80% of a raw rate of 62,500/s (two threads of 32 µs).
        let bound = bpe_bound(2, Some(30.0), Some(10.0), 62_500.0);
        assert!(bound.is_some_and(|b| (b - 0.8).abs() < 1e-12), "{bound:?}");
        // The exchange's CPU is its server's and its client's.
        let echo = Rate::new(1_000, 0, 1.0)
            .with_cpu(Some(0.004), None)
            .with_client_cpu(Some(0.006));
        assert_eq!(echo.exchange_cpu_us(), Some(10.0));
        assert_eq!(Rate::new(1_000, 0, 1.0).exchange_cpu_us(), None);
        // Unknown figures, or none to spread CPU over, give no bound.
        assert_eq!(bpe_bound(2, None, Some(10.0), 62_500.0), None);
        assert_eq!(bpe_bound(2, Some(30.0), None, 62_500.0), None);
        assert_eq!(bpe_bound(2, Some(0.0), Some(0.0), 62_500.0), None);
        assert_eq!(
            Rate::new(0, 0, 1.0)
                .with_client_cpu(Some(1.0))
                .client_cpu_us,
            None
        );
    }
}
