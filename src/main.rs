//! The `compactd` binary: parses the command line, sets up logging, and runs `serve`,
//! `replay`, `config`, `bench` or `recall-tool`. Bad configuration stops the start with one clear line before any port is bound.

use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use compactd::cli::{self, Command, ReplayArgs, ServeArgs};
use compactd::server::{self, ServerOptions};
use compactd::store::{Durability, Sqlite, Store};
use compactd::trace;

// The allocator: jemalloc, with background threads that give freed pages back to the OS
// within a quarter of a second (issue 13). Measured by tests/grpc/rss_load.rs (release,
// 2 cores; README "Memory use"): with glibc's malloc, RSS stayed at its peak after every
// session was deleted (1,149-1,162 MB after deleting 1,046 MB of sessions), and sessions
// churning through a 100 MiB budget took RSS to 2.5-3.0 x the held bytes (262-315 MB
// for 104 MB); MALLOC_ARENA_MAX=2 and lower trim/mmap thresholds still left 146-1,157 MB
// after the deletes. With this setting RSS falls to 38-48 MB after the deletes and
// settles at ~147 MB for the same churn (peak 195-197 MB), for no more CPU than glibc.
// mimalloc, even with MIMALLOC_PURGE_DELAY=0, kept 120-182 MB after the deletes. The
// library crate stays allocator-neutral: only the binary sets it.
#[cfg(not(target_env = "msvc"))]
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

/// jemalloc's options (`cli::JEMALLOC_CONF` says what each is for).
#[cfg(not(target_env = "msvc"))]
#[unsafe(export_name = "_rjem_malloc_conf")]
static MALLOC_CONF: &[u8; 69] = cli::JEMALLOC_CONF;

fn main() -> ExitCode {
    let layered = match cli::parse_layered(std::env::args_os().collect()) {
        Ok(l) => l,
        Err(cli::LayerError::Clap(e)) => e.exit(),
        Err(e) => {
            eprintln!("compactd: {e}");
            return ExitCode::from(2);
        }
    };
    if let Some(text) = layered.config_output() {
        // What `serve` would refuse, `config print` refuses too (no file is read but the
        // engine settings; TLS, key and token files are checked at start).
        if let Command::Config(cli::ConfigCommand::Print(args)) = &layered.cli.command
            && let Err(e) = args.engine.to_config().and_then(|_| args.inline_token())
        {
            eprintln!("compactd: {:#}", with_source(e, &layered));
            return ExitCode::from(2);
        }
        print!("{text}");
        return ExitCode::SUCCESS;
    }
    let result = match &layered.cli.command {
        Command::Serve(args) => serve(args.clone(), &layered),
        Command::Replay(args) => replay(args.clone()),
        Command::Config(_) => Ok(()),
        Command::RecallTool => recall_tool(),
        Command::Bench(args) => cli::bench::run(args).map_err(Into::into),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("compactd: {e:#}");
            ExitCode::from(2)
        }
    }
}

/// A bad setting, named with its flag and the layer it came from.
fn with_source(e: cli::ConfigError, layered: &cli::Layered) -> anyhow::Error {
    anyhow::anyhow!(
        "--{} ({}): {}",
        e.flag,
        layered.source_of(e.flag),
        e.message
    )
}

fn serve(args: ServeArgs, layered: &cli::Layered) -> anyhow::Result<()> {
    let config = args
        .engine
        .to_config()
        .map_err(|e| with_source(e, layered))?;
    let compaction = args.llm.to_config().map_err(|e| with_source(e, layered))?;
    if args.max_update_bytes == 0 {
        anyhow::bail!("--max-update-bytes: must be above 0");
    }
    cli::logging::init(args.log_format);
    for flag in layered.secrets_on_command_line() {
        tracing::warn!(
            flag,
            "--{flag} was given on the command line, where every local user can read it (ps); \
             give it in the environment or in --{flag}-file instead"
        );
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let auth = args.auth().map_err(|e| with_source(e, layered))?;
    let uds_mode = args.uds_mode().map_err(|e| with_source(e, layered))?;
    let tls = args.tls().map_err(|e| with_source(e, layered))?;
    runtime.block_on(async move {
        // A BPE vocabulary loads on first use; load the one sessions count with by default
        // now, off the workers (each other one loads when a session first needs it).
        let counting = config.tokenizer.resolve("");
        tokio::task::spawn_blocking(move || compactd::tokens::warm_up(counting));
        let mut store = Store::new(config.clone()).with_limits(args.limits());
        let observer: compactd::store::Observer = Arc::new(compactd::telemetry::store_event);
        if args.durability != Durability::Memory {
            let backend = Sqlite::open(
                &args.data_dir,
                args.durability,
                Some(observer.clone()),
                args.max_disk_bytes,
            )
                .map_err(|e| anyhow::anyhow!("--data-dir {}: {e}", args.data_dir.display()))?;
            store = store
                .with_backend(Arc::new(backend))
                .map_err(|e| anyhow::anyhow!("--data-dir {}: {e}", args.data_dir.display()))?;
        }
        store.observe_with(observer);
        let store = Arc::new(store);
        let closing = store.clone();
        let authenticated = auth.token.is_some();
        let options = ServerOptions {
            max_update_bytes: args.max_update_bytes,
            compaction: compaction.clone(),
            drain_timeout: std::time::Duration::from_secs(args.drain_timeout_secs),
            auth,
            idle_ttl: (args.session_idle_ttl_secs > 0)
                .then(|| std::time::Duration::from_secs(args.session_idle_ttl_secs)),
            slow_reader_grace: std::time::Duration::from_secs(args.slow_reader_grace_secs.max(1)),
            tls,
        };
        let metrics_stop = tokio_util::sync::CancellationToken::new();
        let mut metrics_addr = String::new();
        if let Some(addr) = args.metrics_listen {
            let handle = compactd::telemetry::install().map_err(|e| anyhow::anyhow!("--metrics-listen: {e}"))?;
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("--metrics-listen {addr}: cannot bind"))?;
            metrics_addr = listener.local_addr()?.to_string();
            let stop = metrics_stop.clone();
            let sampled = store.clone();
            let sample = move || {
                compactd::telemetry::sessions(sampled.hot_len());
                if let Some(b) = sampled.backend() {
                    compactd::telemetry::store(
                        sampled.len().saturating_sub(sampled.hot_len()),
                        b.disk_bytes(),
                        b.state() != compactd::store::BackendState::Ok,
                    );
                }
                compactd::telemetry::memory(
                    sampled.held_bytes(),
                    sampled.ledger().journaled(),
                    sampled.ledger().in_flight(),
                    sampled.ledger().cached(),
                    sampled.limits().memory_budget,
                );
            };
            tokio::spawn(async move {
                if let Err(e) = compactd::telemetry::serve(listener, handle, sample, stop.cancelled_owned(), compactd::telemetry::EndpointLimits::default()).await {
                    tracing::error!(error = %e, "metrics endpoint stopped");
                }
            });
        }
        let started = |listen: String| {
            tracing::info!(
                listen = %listen,
                metrics_listen = %metrics_addr,
                threshold = config.threshold,
                prune = config.prune,
                auto_compact = config.auto_compact,
                authenticated,
                llm = compaction.summarizer.as_ref().map_or("not configured", |s| s.model()),
                llm_base_url = %args.llm.llm_base_url.as_ref().map(|u| compactd::config::redact::url(u.expose())).unwrap_or_default(),
                durability = %args.durability,
                data_dir = %if args.durability == Durability::Memory { String::new() } else { args.data_dir.display().to_string() },
                sessions_on_disk = closing.len(),
                "starting compactd {}",
                env!("CARGO_PKG_VERSION")
            );
        };
        // The signals are caught from here on, before the start line says the server is
        // up: a SIGTERM right after it drains, where the default action would kill.
        let shutdown = shutdown_signal(args.exit_on_stdin_eof);
        match &args.listen {
            cli::ListenAddr::Tcp(addr) => {
                let listener = tokio::net::TcpListener::bind(addr)
                    .await
                    .with_context(|| format!("--listen {addr}: cannot bind"))?;
                started(listener.local_addr()?.to_string());
                server::serve(listener, store, options, shutdown).await?;
            }
            #[cfg(unix)]
            cli::ListenAddr::Unix(path) => {
                let (listener, ours) = bind_unix(path, uds_mode)?;
                started(format!("unix:{}", path.display()));
                server::serve_unix(listener, store, options, shutdown).await?;
                // Only our own socket: another server may have bound the path since.
                if socket_id(path) == Some(ours) {
                    let _ = std::fs::remove_file(path);
                }
            }
            #[cfg(not(unix))]
            cli::ListenAddr::Unix(_) => anyhow::bail!("--listen unix: needs a Unix system"),
        }
        // Under `interval`, what actors still hold is written before the process exits.
        closing.close().await;
        metrics_stop.cancel();
        tracing::info!("compactd stopped");
        Ok(())
    })
}

/// Binds a Unix socket at `path` with file mode `mode`, replacing a stale socket file
/// (one nothing answers on), but never a live one (a second server would take the path
/// from the first, which then keeps its sessions out of reach) nor another kind of
/// file. The socket is bound in a private directory beside `path` ([`Staging`]), given
/// its mode there, and only then linked at `path`: bound at `path` itself it would be
/// connectable there with the umask's mode (0777 under umask 000) until the chmod, a
/// connection made meanwhile staying served, and the chmod would follow a symlink put in
/// its place. Linked rather than renamed, so a socket another server bound at `path`
/// meanwhile stops this start, as `bind` would, instead of being replaced. Returns the
/// listener and the socket file's identity, to remove only our own.
#[cfg(unix)]
fn bind_unix(
    path: &std::path::Path,
    mode: u32,
) -> anyhow::Result<(tokio::net::UnixListener, (u64, u64))> {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    let flag = || format!("--listen unix:{}", path.display());
    // Bound elsewhere and linked, a path too long for a socket address would be taken,
    // and no client could connect to it.
    std::os::unix::net::SocketAddr::from_pathname(path)
        .with_context(|| format!("{}: cannot bind", flag()))?;
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        anyhow::ensure!(
            meta.file_type().is_socket(),
            "{}: exists and is not a socket",
            flag()
        );
        match std::os::unix::net::UnixStream::connect(path) {
            Ok(_) => anyhow::bail!(
                "{}: another process is listening on it (a compactd already running?); \
                 stop it or choose another path",
                flag()
            ),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {}
            Err(e) => {
                return Err(e)
                    .with_context(|| format!("{}: cannot tell whether it is in use", flag()));
            }
        }
        std::fs::remove_file(path)
            .with_context(|| format!("{}: removing the stale socket", flag()))?;
    }
    let staging = Staging::beside(path).with_context(|| {
        format!(
            "{}: cannot make a private directory beside it to bind in",
            flag()
        )
    })?;
    let staged = staging.socket();
    let listener = tokio::net::UnixListener::bind(&staged)
        .with_context(|| format!("{}: cannot bind (at {})", flag(), staged.display()))?;
    std::fs::set_permissions(&staged, std::fs::Permissions::from_mode(mode))
        .with_context(|| format!("{}: setting mode {mode:o} on the socket", flag()))?;
    std::fs::hard_link(&staged, path).map_err(|e| match e.kind() {
        std::io::ErrorKind::AlreadyExists => anyhow::anyhow!(
            "{}: another process bound it meanwhile (a compactd starting beside this one?); \
             stop it or choose another path",
            flag()
        ),
        _ => anyhow::Error::new(e).context(format!("{}: cannot put the socket in place", flag())),
    })?;
    if let Err(e) = staging.remove() {
        tracing::warn!(error = %e, "cannot remove the directory the Unix socket was bound in");
    }
    let ours = socket_id(path).with_context(|| format!("{}: the socket is gone", flag()))?;
    Ok((listener, ours))
}

/// The private directory (mode 0700, `.compactd-<pid>-<n>` beside the socket's path)
/// where [`bind_unix`] binds the socket and sets its mode, out of anyone else's reach.
/// Removed with the socket's name in it when dropped, so every way out of `bind_unix`
/// leaves nothing behind.
#[cfg(unix)]
struct Staging {
    dir: std::path::PathBuf,
    /// Whether it is gone already.
    removed: bool,
}

#[cfg(unix)]
impl Staging {
    /// Makes the directory in `path`'s own directory (a name already taken, a leftover of
    /// a killed process whose id this one has now, is skipped).
    fn beside(path: &std::path::Path) -> std::io::Result<Staging> {
        use std::os::unix::fs::DirBuilderExt;
        let parent = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => std::path::Path::new("."),
        };
        for n in 0..16 {
            let dir = parent.join(format!(".compactd-{}-{n}", std::process::id()));
            match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
                Ok(()) => {
                    return Ok(Staging {
                        dir,
                        removed: false,
                    });
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(e),
            }
        }
        Err(std::io::Error::new(
            std::io::ErrorKind::AlreadyExists,
            "every name tried is taken (.compactd-<pid>-0 to -15)",
        ))
    }

    /// Where the socket is bound: a short name, so the path stays within a socket address.
    fn socket(&self) -> std::path::PathBuf {
        self.dir.join("s")
    }

    /// Removes the socket's name in the directory (the socket stays where it was linked)
    /// and the directory.
    fn remove(mut self) -> std::io::Result<()> {
        self.clean()
    }

    fn clean(&mut self) -> std::io::Result<()> {
        if std::mem::replace(&mut self.removed, true) {
            return Ok(());
        }
        match std::fs::remove_file(self.socket()) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        std::fs::remove_dir(&self.dir)
    }
}

#[cfg(unix)]
impl Drop for Staging {
    fn drop(&mut self) {
        let _ = self.clean();
    }
}

/// The device and inode of the file at `path`, if any.
#[cfg(unix)]
fn socket_id(path: &std::path::Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(path)
        .ok()
        .map(|m| (m.dev(), m.ino()))
}

/// Resolves on SIGINT or SIGTERM (Kubernetes sends SIGTERM), or with `stdin_eof` when
/// stdin reaches its end (the parent holding its pipe exited), logging which it was.
fn shutdown_signal(stdin_eof: bool) -> impl std::future::Future<Output = ()> {
    // Registered now, not when first polled: from this call on, SIGINT and SIGTERM are
    // caught (the serve future that polls this starts after the start line).
    #[cfg(unix)]
    let (int, term) = {
        use tokio::signal::unix::{SignalKind, signal};
        let caught = |kind: SignalKind, name: &'static str| {
            let registered = signal(kind).ok();
            async move {
                match registered {
                    Some(mut s) => {
                        s.recv().await;
                        tracing::info!(signal = name, "shutting down");
                    }
                    None => std::future::pending::<()>().await,
                }
            }
        };
        (
            caught(SignalKind::interrupt(), "SIGINT"),
            caught(SignalKind::terminate(), "SIGTERM"),
        )
    };
    #[cfg(not(unix))]
    let (int, term) = (
        async {
            if tokio::signal::ctrl_c().await.is_ok() {
                tracing::info!(signal = "SIGINT", "shutting down");
            }
        },
        std::future::pending::<()>(),
    );
    shutdown_on(stdin_eof, int, term)
}

/// Waits for the first of `int`, `term` and (with `stdin_eof`) stdin's end.
async fn shutdown_on(
    stdin_eof: bool,
    int: impl std::future::Future<Output = ()>,
    term: impl std::future::Future<Output = ()>,
) {
    let parent = async {
        if !stdin_eof {
            return std::future::pending::<()>().await;
        }
        // On a thread of its own, not tokio's blocking pool: a read still blocked there
        // would hold the runtime's shutdown until stdin closed.
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let spawned = std::thread::Builder::new()
            .name("compactd-stdin".into())
            .spawn(move || {
                let _ = std::io::copy(&mut std::io::stdin().lock(), &mut std::io::sink());
                let _ = tx.send(());
            });
        match spawned {
            Ok(_) => {
                if rx.await.is_ok() {
                    tracing::info!("stdin closed (the parent exited): shutting down");
                }
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot watch stdin; --exit-on-stdin-eof is off");
                std::future::pending::<()>().await
            }
        }
    };
    tokio::select! {
        _ = int => {},
        _ = term => {},
        _ = parent => {},
    }
}

/// `compactd recall-tool`: the definition `GetRecallTool` returns, on stdout.
fn recall_tool() -> anyhow::Result<()> {
    use std::io::Write;
    let json = compactd::engine::recall_tool_json();
    match writeln!(std::io::stdout().lock(), "{json}") {
        // A closed pipe is the reader's choice, not a failure.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Ok(()),
        other => other.map_err(Into::into),
    }
}

fn replay(args: ReplayArgs) -> anyhow::Result<()> {
    // What the engine refused while replaying (an update skipped) reaches stderr.
    cli::logging::init_with(cli::LogFormat::Pretty, "warn");
    match write_replay(&args, &mut std::io::stdout().lock()) {
        // A closed pipe (`compactd replay … | head`) is the reader's choice, not a failure.
        Err(e)
            if e.downcast_ref::<std::io::Error>().map(|e| e.kind())
                == Some(std::io::ErrorKind::BrokenPipe) =>
        {
            Ok(())
        }
        other => other,
    }
}

fn write_replay(args: &ReplayArgs, out: &mut impl std::io::Write) -> anyhow::Result<()> {
    let config = args.engine.to_config()?;
    if let Some(url) = &args.summarize_with {
        cli::check_llm_base_url("summarize-with", url, "COMPACTD_LLM_API_KEY")?;
    }
    let mut reports = Vec::new();
    // What each model's sessions taught, carried from file to file as the server carries
    // it from session to session.
    let mut priors = compactd::engine::calibration::ModelPriors::default();
    for path in &args.files {
        // Each warning names its file.
        let _file = tracing::warn_span!("replay", file = %path.display()).entered();
        let json =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let mut export =
            trace::parse_export(&json).with_context(|| format!("parsing {}", path.display()))?;
        // Measured on the export as recorded: its prune stamps say where the original run
        // pruned, which the comparison leaves out.
        let prediction = trace::prediction::measure(&export, &config, &mut priors);
        let stripped = if args.keep_compacted {
            0
        } else {
            trace::strip_compacted(&mut export)
        };
        if !args.json {
            writeln!(out, "== {}", path.display())?;
        }
        if stripped > 0 && !args.json {
            writeln!(
                out,
                "(removed {stripped} time.compacted marks from the file; compactd prunes afresh)"
            )?;
        }
        let mut report = match &args.summarize_with {
            None => trace::replay::replay(&export, args.limits(), &config),
            Some(url) => {
                let mut compactor = llm_compactor(url, &args.summarize_model)?;
                trace::replay::replay_with(&export, args.limits(), &config, Some(&mut compactor))
            }
        };
        report.prediction = prediction;
        if !args.json {
            writeln!(out, "{report}")?;
        }
        let name = path.file_stem().map_or_else(
            || report.session_id.clone(),
            |s| s.to_string_lossy().into_owned(),
        );
        if let Some(chart) = &args.chart {
            let target = chart_path(chart, &name, args.files.len() > 1);
            let title = format!(
                "{name}: context tokens and cost per step (window {}, threshold {})",
                report.limits.context, report.threshold
            );
            let body = if target.extension().is_some_and(|e| e == "html") {
                trace::chart::html(&report, &title, config.cache_model)
            } else {
                trace::chart::svg(&report, &title, config.cache_model)
            };
            std::fs::write(&target, body)
                .with_context(|| format!("writing {}", target.display()))?;
            if !args.json {
                writeln!(out, "chart: {}", target.display())?;
            }
        }
        reports.push((name, report));
    }
    if args.json {
        let doc = trace::replay::json_document(&reports, config.cache_model);
        writeln!(out, "{}", serde_json::to_string_pretty(&doc)?)?;
        return Ok(());
    }
    if reports.len() > 1 {
        writeln!(out, "{}", trace::replay::summary_table(&reports))?;
    }
    writeln!(
        out,
        "{}",
        trace::replay::lanes_table(&reports, config.cache_model)
    )?;
    writeln!(out, "{}", trace::replay::prediction_table(&reports))?;
    Ok(())
}

/// `chart.svg` for one trace; `chart-<name>.svg` for each of several.
fn chart_path(chart: &std::path::Path, name: &str, several: bool) -> std::path::PathBuf {
    if !several {
        return chart.to_path_buf();
    }
    let stem = chart
        .file_stem()
        .map_or_else(String::new, |s| s.to_string_lossy().into_owned());
    let ext = chart
        .extension()
        .map_or_else(|| "svg".to_string(), |e| e.to_string_lossy().into_owned());
    chart.with_file_name(format!("{stem}-{name}.{ext}"))
}

/// A replay compactor backed by a real OpenAI-compatible endpoint. It summarizes the head
/// as the server does (`summarize::chunk`): in chunks when the model's window is known
/// (COMPACTD_LLM_CONTEXT_TOKENS, or what the endpoint tells) or the endpoint answers that a
/// request is too long.
fn llm_compactor(
    url: &str,
    model: &str,
) -> anyhow::Result<
    impl FnMut(
        &compactd::engine::Session,
        &compactd::engine::CompactionPlan,
        &compactd::engine::ContextView,
    ) -> Result<compactd::engine::SummaryOutcome, String>,
> {
    use compactd::summarize::{
        ApiKey, LlmConfig, OpenAiSummarizer, PromptConfig, Quiet, Summarizer, chunk,
    };
    use compactd::tokens::Tokenizer;
    let mut cfg = LlmConfig::new(url, model);
    cfg.api_key = std::env::var("COMPACTD_LLM_API_KEY")
        .ok()
        .filter(|k| !k.is_empty())
        .map(ApiKey::new)
        .transpose()
        .map_err(|e| anyhow::anyhow!("COMPACTD_LLM_API_KEY: {e}"))?;
    cfg.context_tokens = match std::env::var("COMPACTD_LLM_CONTEXT_TOKENS") {
        Ok(v) if !v.trim().is_empty() => Some(
            v.trim()
                .parse::<std::num::NonZeroU64>()
                .with_context(|| {
                    format!("COMPACTD_LLM_CONTEXT_TOKENS={v:?}: a window, 1 token or more")
                })?
                .get(),
        ),
        _ => None,
    };
    let summarizer = OpenAiSummarizer::new(cfg);
    let prompts = PromptConfig::default();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    Ok(
        move |_: &compactd::engine::Session,
              plan: &compactd::engine::CompactionPlan,
              head: &compactd::engine::ContextView| {
            let options = chunk::Options {
                previous_summary: plan.previous_summary.as_deref(),
                prompts: &prompts,
                instructions: "",
                counter: Tokenizer::Auto.resolve(summarizer.model()).counter(),
            };
            let mut quiet = Quiet::new(&summarizer);
            let summary = runtime.block_on(chunk::summarize_head(head, options, &mut quiet));
            summary
                .map(|summary| {
                    // Every answer paid for, the dropped ones too.
                    let mut outcome = summary.outcome;
                    outcome.add_spend(quiet.voided());
                    outcome
                })
                .map_err(|e| e.to_string())
        },
    )
}
