//! Prometheus metrics: every name compactd exports, the one place each is recorded, and
//! the `/metrics` endpoint on its own port (`--metrics-listen`).
//!
//! The recorder is process-global (the `metrics` crate's design); it is installed once.
//! Recording without it does nothing, but still builds each metric's labelled key; the
//! per-update figures ([`update`]) check `recording` first, so a server without
//! `--metrics-listen` neither builds keys nor reads the clock for them, and a server with
//! it records through handles each thread registered once per update kind.

mod bounded;

use std::sync::OnceLock;
use std::time::Duration;

use metrics::{counter, gauge, histogram};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

use crate::engine::{Crossed, OverflowCheck, PruneReport};

/// Seconds buckets of the update latency histogram (engine work per update is µs).
const UPDATE_BUCKETS: &[f64] = &[
    0.000_01, 0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025,
    0.1,
];
/// Seconds buckets of the compaction duration histogram (LLM calls take seconds).
const COMPACTION_BUCKETS: &[f64] = &[0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0];
/// Seconds buckets of the store's commit and cold-load histograms (an fsync or a
/// decode: sub-millisecond to seconds on a slow disk).
const STORE_BUCKETS: &[f64] = &[
    0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    10.0,
];
/// Every histogram and its buckets: one without buckets would be exported as a summary
/// (quantiles that cannot be summed across replicas).
const HISTOGRAMS: &[(&str, &[f64])] = &[
    ("compactd_update_duration_seconds", UPDATE_BUCKETS),
    ("compactd_compaction_duration_seconds", COMPACTION_BUCKETS),
    ("compactd_store_commit_seconds", STORE_BUCKETS),
    ("compactd_session_load_seconds", STORE_BUCKETS),
];

/// How often the recorder's recent histogram samples are folded into their buckets. The
/// recorder keeps every sample until then (about 16 bytes each, one per update), and
/// only a scrape folds them otherwise: a server no one scrapes would grow without end.
pub const UPKEEP_EVERY: Duration = Duration::from_secs(5);

/// What the metrics endpoint allows itself: its upkeep period and its connections.
#[derive(Debug, Clone, Copy)]
pub struct EndpointLimits {
    /// How often histogram samples are folded ([`UPKEEP_EVERY`]).
    pub upkeep_every: Duration,
    /// Connections open at once; more wait to be accepted.
    pub max_connections: usize,
    /// How long a connection may move no byte before it is closed (a scraper sends its
    /// request at once, and reconnects for the next scrape).
    pub connection_idle: Duration,
    /// How long a connection lives at most.
    pub connection_lifetime: Duration,
    /// How long a request may take from its first byte to the first byte of its
    /// answer (a scraper sends its request in one packet; one sent a byte at a time is
    /// closed rather than hold a place).
    pub answer_within: Duration,
}

impl Default for EndpointLimits {
    /// Upkeep every 5 s; 64 connections, each closed after 5 s without a byte moved, 2 s
    /// after a request's first byte unanswered, or 60 s in all (a scrape takes milliseconds; Prometheus scrapes every 15 to 60 s).
    fn default() -> EndpointLimits {
        EndpointLimits {
            upkeep_every: UPKEEP_EVERY,
            max_connections: 64,
            connection_idle: Duration::from_secs(5),
            connection_lifetime: Duration::from_secs(60),
            answer_within: Duration::from_secs(2),
        }
    }
}

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// Installs the global recorder (once; later calls return the same handle).
pub fn install() -> Result<PrometheusHandle, String> {
    if let Some(h) = HANDLE.get() {
        return Ok(h.clone());
    }
    let mut builder = PrometheusBuilder::new();
    for (name, buckets) in HISTOGRAMS {
        builder = builder
            .set_buckets_for_metric(Matcher::Full((*name).into()), buckets)
            .map_err(|e| e.to_string())?;
    }
    let recorder = builder.build_recorder();
    let handle = recorder.handle();
    // Another thread may have won the race: then its recorder is the global one.
    if metrics::set_global_recorder(recorder).is_ok() {
        let _ = HANDLE.set(handle);
    }
    describe();
    HANDLE
        .get()
        .cloned()
        .ok_or_else(|| "a metrics recorder was installed outside compactd".to_string())
}

fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram};
    describe_gauge!("compactd_sessions", "Sessions held in memory.");
    describe_gauge!(
        "compactd_bytes_held",
        metrics::Unit::Bytes,
        "Bytes all sessions hold (--memory-budget counts these plus compactd_bytes_journaled and compactd_bytes_in_flight)."
    );
    describe_gauge!(
        "compactd_bytes_journaled",
        metrics::Unit::Bytes,
        "Bytes of durable sessions' acknowledged changes not yet on disk, encoded beside the sessions that hold them (counted against --memory-budget)."
    );
    describe_gauge!(
        "compactd_bytes_in_flight",
        metrics::Unit::Bytes,
        "Bytes reserved in flight: updates read and not answered, buffered events, imports, compaction prompts (at most an eighth of --memory-budget)."
    );
    describe_gauge!(
        "compactd_bytes_cached",
        metrics::Unit::Bytes,
        "Of compactd_bytes_held, the sessions' rendered contexts kept between GetContext calls (at most an eighth of --memory-budget)."
    );
    describe_gauge!(
        "compactd_memory_budget_bytes",
        metrics::Unit::Bytes,
        "The configured --memory-budget (0: no limit)."
    );
    describe_counter!(
        "compactd_updates_total",
        "Session updates applied, by kind and result."
    );
    describe_histogram!(
        "compactd_update_duration_seconds",
        metrics::Unit::Seconds,
        "Engine time per update (apply, overflow check, prune), by kind."
    );
    describe_counter!(
        "compactd_overflow_detections_total",
        "Overflow detections, by what crossed the threshold (used or predicted)."
    );
    describe_counter!(
        "compactd_prune_runs_total",
        "Prune runs that changed a session, by trigger."
    );
    describe_counter!(
        "compactd_tokens_saved_total",
        "Context tokens removed, by layer (prune, or the strategy's name)."
    );
    describe_counter!(
        "compactd_compactions_total",
        "Compactions finished, by outcome (compacted or the failure kind) and auto."
    );
    describe_histogram!(
        "compactd_compaction_duration_seconds",
        metrics::Unit::Seconds,
        "Wall time of a compaction, by outcome."
    );
    describe_counter!(
        "compactd_compaction_llm_tokens_total",
        "Tokens the compaction model reported, by direction (input, output)."
    );
    describe_counter!(
        "compactd_compaction_llm_requests_total",
        "Summary requests sent to the compaction model, by result (answered, or the failure kind: too_long is a refusal for length or an empty stream)."
    );
    describe_counter!(
        "compactd_compaction_splits_total",
        "Times a compaction cut the rest of its head smaller after a too_long answer."
    );
    describe_counter!(
        "compactd_sessions_evicted_total",
        "Sessions removed from memory, by reason (idle, memory)."
    );
    describe_counter!(
        "compactd_replies_abandoned_total",
        "GetContext, GetSession or Recall replies dropped (their streams reset) because the client read none of them for --slow-reader-grace-secs."
    );
    describe_gauge!(
        "compactd_watchers",
        "Subscribe watchers open (each one task and one place on the event bus)."
    );
    describe_gauge!(
        "compactd_sessions_cold",
        "Sessions only on disk (loaded back on their next use)."
    );
    describe_counter!(
        "compactd_session_loads_total",
        "Cold sessions loaded from disk, by result (ok, failed)."
    );
    describe_histogram!(
        "compactd_session_load_seconds",
        metrics::Unit::Seconds,
        "Time to load a cold session from disk (read, decode, log replay)."
    );
    describe_counter!(
        "compactd_store_commits_total",
        "Durable store commits (each one fsync, shared by every write queued), by result."
    );
    describe_histogram!(
        "compactd_store_commit_seconds",
        metrics::Unit::Seconds,
        "Time of one durable store commit, fsync included."
    );
    describe_counter!(
        "compactd_store_written_bytes_total",
        "Bytes of snapshots and log entries committed."
    );
    describe_gauge!(
        "compactd_store_disk_bytes",
        "Bytes the durable store's files take on disk."
    );
    describe_gauge!(
        "compactd_store_failing",
        "1 while the durable store's last commit failed, else 0."
    );
    describe_counter!(
        "compactd_rejected_requests_total",
        "Requests and updates refused, by gRPC code."
    );
}

/// One open `Subscribe` watcher, counted in `compactd_watchers` while it lives: a
/// watcher whose client hung up must end, and this gauge shows it does.
#[derive(Debug)]
pub struct Watching(());

impl Watching {
    /// Counts a watcher that starts now.
    pub fn start() -> Watching {
        gauge!("compactd_watchers").increment(1.0);
        Watching(())
    }
}

impl Drop for Watching {
    fn drop(&mut self) {
        gauge!("compactd_watchers").decrement(1.0);
    }
}

/// The number of sessions held (sampled at each scrape).
pub fn sessions(n: usize) {
    gauge!("compactd_sessions").set(n as f64);
}

/// The store's memory figures, read at each scrape (they move with every update, so
/// they are sampled rather than pushed).
pub fn memory(held: u64, journaled: u64, in_flight: u64, cached: u64, budget: u64) {
    gauge!("compactd_bytes_held").set(held as f64);
    gauge!("compactd_bytes_journaled").set(journaled as f64);
    gauge!("compactd_bytes_in_flight").set(in_flight as f64);
    gauge!("compactd_bytes_cached").set(cached as f64);
    gauge!("compactd_memory_budget_bytes").set(budget as f64);
}

/// The store's own events: commits, cold loads and evictions.
pub fn store_event(e: &crate::store::StoreEvent) {
    use crate::store::StoreEvent;
    match e {
        StoreEvent::Commit {
            requests: _,
            bytes,
            took,
            ok,
        } => {
            let result = if *ok { "ok" } else { "failed" };
            counter!("compactd_store_commits_total", "result" => result).increment(1);
            histogram!("compactd_store_commit_seconds").record(took.as_secs_f64());
            if *ok {
                counter!("compactd_store_written_bytes_total").increment(*bytes);
            }
        }
        StoreEvent::Loaded { took, ok } => {
            let result = if *ok { "ok" } else { "failed" };
            counter!("compactd_session_loads_total", "result" => result).increment(1);
            histogram!("compactd_session_load_seconds").record(took.as_secs_f64());
        }
        StoreEvent::Evicted { reason } => {
            counter!("compactd_sessions_evicted_total", "reason" => *reason).increment(1);
        }
    }
}

/// The durable store's figures, sampled at each scrape.
pub fn store(cold: usize, disk_bytes: u64, failing: bool) {
    gauge!("compactd_sessions_cold").set(cold as f64);
    gauge!("compactd_store_disk_bytes").set(disk_bytes as f64);
    gauge!("compactd_store_failing").set(if failing { 1.0 } else { 0.0 });
}

/// True once compactd's recorder is installed ([`install`]).
fn recording() -> bool {
    HANDLE.get().is_some()
}

/// Runs one update through the engine (`apply`) and records it: its count by result and
/// its duration. Timed only while `recording`: otherwise two clock reads and two
/// labelled keys per update would be spent on nothing.
pub fn update<T, E>(kind: &'static str, apply: impl FnOnce() -> Result<T, E>) -> Result<T, E> {
    if !recording() {
        return apply();
    }
    let began = std::time::Instant::now();
    let result = apply();
    record_update(kind, result.is_ok(), began.elapsed());
    result
}

fn record_update(kind: &'static str, ok: bool, took: Duration) {
    UPDATE_HANDLES.with_borrow_mut(|handles| {
        if !handles.iter().any(|h| h.kind == kind) {
            handles.push(UpdateHandles::register(kind));
        }
        if let Some(h) = handles.iter().find(|h| h.kind == kind) {
            if ok { &h.ok } else { &h.rejected }.increment(1);
            h.took.record(took.as_secs_f64());
        }
    });
}

/// One update kind's metric handles. Building a labelled key and looking it up in the
/// recorder's registry on every update is a few hundred nanoseconds per metric; each
/// thread registers a kind's handles once and keeps them.
struct UpdateHandles {
    kind: &'static str,
    ok: metrics::Counter,
    rejected: metrics::Counter,
    took: metrics::Histogram,
}

impl UpdateHandles {
    fn register(kind: &'static str) -> UpdateHandles {
        UpdateHandles {
            kind,
            ok: counter!("compactd_updates_total", "kind" => kind, "result" => "ok"),
            rejected: counter!("compactd_updates_total", "kind" => kind, "result" => "rejected"),
            took: histogram!("compactd_update_duration_seconds", "kind" => kind),
        }
    }
}

thread_local! {
    /// This thread's handles, one entry per update kind seen (a handful), registered only
    /// while `recording` (a handle taken before the recorder is installed records
    /// nowhere).
    static UPDATE_HANDLES: std::cell::RefCell<Vec<UpdateHandles>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// An overflow was detected.
pub fn overflow(check: &OverflowCheck) {
    let crossed = match check.crossed {
        Some(Crossed::Used) => "used",
        Some(Crossed::Predicted) => "predicted",
        None => "none",
    };
    counter!("compactd_overflow_detections_total", "crossed" => crossed).increment(1);
}

/// A prune run changed the session (`trigger`: `auto` or `request`).
pub fn pruned(report: &PruneReport, trigger: &'static str) {
    if !report.changed() {
        return;
    }
    counter!("compactd_prune_runs_total", "trigger" => trigger).increment(1);
    if report.committed {
        counter!("compactd_tokens_saved_total", "layer" => "prune")
            .increment(report.context_tokens_saved.max(0).unsigned_abs());
    }
    for s in &report.strategies.savings {
        counter!("compactd_tokens_saved_total", "layer" => s.strategy.name()).increment(s.tokens);
    }
}

/// A compaction finished (`outcome`: `compacted`, or the failure kind).
pub fn compaction(outcome: &str, auto: bool, took: Duration, llm: Option<(u64, u64)>) {
    let auto = if auto { "true" } else { "false" };
    counter!("compactd_compactions_total", "outcome" => outcome.to_string(), "auto" => auto)
        .increment(1);
    histogram!("compactd_compaction_duration_seconds", "outcome" => outcome.to_string())
        .record(took.as_secs_f64());
    if let Some((input, output)) = llm {
        counter!("compactd_compaction_llm_tokens_total", "direction" => "input").increment(input);
        counter!("compactd_compaction_llm_tokens_total", "direction" => "output").increment(output);
    }
}

/// One summary request to the compaction model ended (`result`: `answered`, or the
/// failure kind).
pub fn compaction_request(result: &'static str) {
    counter!("compactd_compaction_llm_requests_total", "result" => result).increment(1);
}

/// A unary reply was dropped because its client read none of it for the grace.
pub fn reply_abandoned() {
    counter!("compactd_replies_abandoned_total").increment(1);
}

/// A compaction cut the rest of its head smaller after a "too long" answer.
pub fn compaction_split() {
    counter!("compactd_compaction_splits_total").increment(1);
}

/// A request or update was refused with `code`.
pub fn rejected(code: tonic::Code) {
    counter!("compactd_rejected_requests_total", "code" => code_name(code)).increment(1);
}

/// The canonical upper-snake name of a status code (`RESOURCE_EXHAUSTED`).
pub fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code as C;
    match code {
        C::Ok => "OK",
        C::Cancelled => "CANCELLED",
        C::Unknown => "UNKNOWN",
        C::InvalidArgument => "INVALID_ARGUMENT",
        C::DeadlineExceeded => "DEADLINE_EXCEEDED",
        C::NotFound => "NOT_FOUND",
        C::AlreadyExists => "ALREADY_EXISTS",
        C::PermissionDenied => "PERMISSION_DENIED",
        C::ResourceExhausted => "RESOURCE_EXHAUSTED",
        C::FailedPrecondition => "FAILED_PRECONDITION",
        C::Aborted => "ABORTED",
        C::OutOfRange => "OUT_OF_RANGE",
        C::Unimplemented => "UNIMPLEMENTED",
        C::Internal => "INTERNAL",
        C::Unavailable => "UNAVAILABLE",
        C::DataLoss => "DATA_LOSS",
        C::Unauthenticated => "UNAUTHENTICATED",
    }
}

/// Serves `GET /metrics` (Prometheus text format) on `listener` until `shutdown`;
/// `sample` runs before each render to set the gauges that are read, not pushed. Folds
/// the recent histogram samples every `limits.upkeep_every` meanwhile, scraped or not,
/// and bounds its connections (`bounded.rs`).
pub async fn serve(
    listener: tokio::net::TcpListener,
    handle: PrometheusHandle,
    sample: impl Fn() + Clone + Send + Sync + 'static,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    limits: EndpointLimits,
) -> std::io::Result<()> {
    let kept = handle.clone();
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let handle = handle.clone();
            sample();
            async move {
                (
                    [("content-type", "text/plain; version=0.0.4")],
                    handle.render(),
                )
            }
        }),
    );
    let listener = bounded::Bounded::new(
        listener,
        limits.max_connections,
        limits.connection_idle,
        limits.connection_lifetime,
        limits.answer_within,
    );
    let upkeep = async move {
        let mut every = tokio::time::interval(limits.upkeep_every);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            every.tick().await;
            kept.run_upkeep();
        }
    };
    tokio::select! {
        served = axum::serve(listener, app).with_graceful_shutdown(shutdown) => served,
        () = upkeep => Ok(()),
    }
}
