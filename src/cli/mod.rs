//! Command-line interface: flags, their `COMPACTD_*` environment twins, and the mapping
//! into [`EngineConfig`] and server options. Only this file reads the environment
//! (through clap), so the rest of the crate takes configuration as values.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

mod allocator;
pub mod bench;
mod layers;
pub mod logging;
mod secret;
mod tls;

pub use allocator::JEMALLOC_CONF;
pub use layers::{LayerError, Layered, Source, parse_layered, print_config};
pub use secret::{Secret, SecretUrl};

use crate::config::{
    CacheCounting, CacheModel, EngineConfig, OverflowPreset, Reserved, SessionOverrides,
    StrategyPreset, StrategySet,
};
use crate::domain::ModelLimits;
use crate::server::{CompactionConfig, DEFAULT_MAX_UPDATE_BYTES};
use crate::store::{DEFAULT_MAX_SESSION_BYTES, DEFAULT_MEMORY_BUDGET, Durability, Limits};
use crate::summarize::{ApiKey, LlmConfig, OpenAiSummarizer, PromptConfig, Summarizer};
use crate::tokens::Tokenizer;

/// Environment variable that turns automatic compaction (and overflow reports) off.
pub const ENV_DISABLE_AUTOCOMPACT: &str = "COMPACTD_DISABLE_AUTOCOMPACT";
/// Environment variable that turns automatic prune off.
pub const ENV_DISABLE_PRUNE: &str = "COMPACTD_DISABLE_PRUNE";

/// compactd: keeps LLM agent conversations inside their context window.
#[derive(Debug, Parser)]
#[command(name = "compactd", version, about, long_about = None)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the gRPC sidecar.
    Serve(ServeArgs),
    /// Feed an `opencode export` file through the engine and print what compactd would do.
    Replay(ReplayArgs),
    /// Inspect the configuration.
    #[command(subcommand)]
    Config(ConfigCommand),
    /// Measure compactd against a raw tonic echo on this machine (ingest, ack latency,
    /// GetContext, memory) and print each figure with its target.
    Bench(bench::BenchArgs),
    // ---- recall ----
    /// Print the `compactd_recall` tool definition (OpenAI function-calling JSON) to give
    /// a model, so it can ask for a cleared tool output back (answered by `Recall`).
    RecallTool,
}

/// `compactd config ...`.
#[derive(Debug, Subcommand)]
pub enum ConfigCommand {
    /// Print the effective `serve` configuration as TOML, each value with its source
    /// (default, file, env, flag); secrets redacted. Takes the same flags as `serve`.
    Print(ServeArgs),
}

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Pretty,
    /// One JSON object per line.
    Json,
}

/// Overflow presets selectable from the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PresetArg {
    /// Ratio 0.92, reserved 0.
    Compactd,
    /// OpenCode today: ratio 1.0, reserved min(20000, limit.output).
    Opencode,
}

/// Cache counting rules selectable from the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum CacheArg {
    /// `input` excludes cache reads: used = input + cache.read + output.
    Separate,
    /// `input` includes cache reads: used = input + output.
    Included,
}

/// Engine settings shared by `serve` and `replay`.
#[derive(Debug, Clone, Args)]
pub struct EngineArgs {
    /// Overflow threshold as a ratio of usable input, in (0, 1] [default: 0.92, or the
    /// preset's].
    #[arg(long, env = "COMPACTD_THRESHOLD")]
    pub threshold: Option<f64>,
    /// Tokens reserved below usable input before the ratio applies [default: 0, or the
    /// preset's].
    #[arg(long, env = "COMPACTD_RESERVED")]
    pub reserved: Option<u64>,
    /// Overflow preset; applied before --threshold/--reserved given explicitly.
    #[arg(long, env = "COMPACTD_PRESET", value_enum)]
    pub preset: Option<PresetArg>,
    /// How cached prompt tokens are counted.
    #[arg(long, env = "COMPACTD_CACHE_COUNTING", value_enum, default_value_t = CacheArg::Separate)]
    pub cache_counting: CacheArg,
    /// Parts one message may hold; one more is RESOURCE_EXHAUSTED (0: no limit).
    #[arg(long, env = "COMPACTD_MAX_PARTS_PER_MESSAGE", default_value_t = crate::config::MAX_PARTS_PER_MESSAGE)]
    pub max_parts_per_message: usize,
    /// PRUNE_PROTECT: newest tool-output tokens never pruned.
    #[arg(long, env = "COMPACTD_PRUNE_PROTECT", default_value_t = crate::config::PRUNE_PROTECT)]
    pub prune_protect: u64,
    /// PRUNE_MINIMUM: prune commits only when it saves more than this.
    #[arg(long, env = "COMPACTD_PRUNE_MINIMUM", default_value_t = crate::config::PRUNE_MINIMUM)]
    pub prune_minimum: u64,
    /// Tools whose output is never pruned (comma separated).
    #[arg(
        long,
        env = "COMPACTD_PROTECTED_TOOLS",
        value_delimiter = ',',
        default_value = "skill"
    )]
    pub protected_tools: Vec<String>,
    /// User turns at the end prune never touches.
    #[arg(long, env = "COMPACTD_PROTECT_TURNS", default_value_t = crate::config::PROTECT_TURNS)]
    pub protect_turns: u32,
    /// Turn automatic compaction and overflow reports off.
    #[arg(long, env = ENV_DISABLE_AUTOCOMPACT)]
    pub disable_autocompact: bool,
    /// Turn automatic prune off (explicit Prune calls still run).
    #[arg(long, env = ENV_DISABLE_PRUNE)]
    pub disable_prune: bool,
    /// What a cleared tool output reads as in the context.
    #[arg(long, env = "COMPACTD_PLACEHOLDER", default_value = crate::config::PLACEHOLDER)]
    pub placeholder: String,
    /// The synthetic user message after an automatic compaction.
    #[arg(long, env = "COMPACTD_AUTO_CONTINUE_TEXT", default_value = crate::config::AUTO_CONTINUE_TEXT)]
    pub auto_continue_text: String,
    /// Strategy preset: compactd (every strategy but aggressiveFilePrune), compact (ACP's thirteen), balanced
    /// (ACP's but user code and error truncation), verbose (none).
    #[arg(long, env = "COMPACTD_STRATEGY_PRESET", default_value = "compactd")]
    pub strategy_preset: String,
    /// Exactly these strategies on (comma separated, camelCase or snake_case names);
    /// overrides the preset.
    // Not a clap `conflicts_with`: clap counts COMPACTD_NO_STRATEGIES=false as present.
    // `strategy_set` refuses the pair; the config layers let a higher layer's one win.
    #[arg(long, env = "COMPACTD_STRATEGIES")]
    pub strategies: Option<String>,
    /// No aggressive strategy (OpenCode's prune alone).
    #[arg(long, env = "COMPACTD_NO_STRATEGIES")]
    pub no_strategies: bool,
    /// Tools the strategies never clear for age or size (comma separated).
    #[arg(
        long,
        env = "COMPACTD_STRATEGY_PROTECTED_TOOLS",
        value_delimiter = ',',
        default_value = "task,todowrite,todoread,skill,batch,plan_enter,plan_exit"
    )]
    pub strategy_protected_tools: Vec<String>,
    /// Globs of files whose operations are never superseded (comma separated).
    #[arg(long, env = "COMPACTD_PROTECTED_FILE_GLOBS", value_delimiter = ',')]
    pub protected_file_globs: Vec<String>,
    /// Tools whose outputs are snapshots of the whole state (comma separated).
    #[arg(
        long,
        env = "COMPACTD_SNAPSHOT_TOOLS",
        value_delimiter = ',',
        default_value = "browser_snapshot,browser_take_screenshot,take_snapshot,take_screenshot,screenshot,snapshot"
    )]
    pub snapshot_tools: Vec<String>,
    /// maskObservations: the newest tool results that always read in full (and the newest
    /// message's results, which no request has sent yet).
    #[arg(long, env = "COMPACTD_MASK_KEEP", default_value_t = crate::config::MASK_KEEP)]
    pub mask_keep: u32,
    /// capLargeOutputs: the share of usable input one tool output may fill, in (0, 1].
    #[arg(long, env = "COMPACTD_OUTPUT_CAP", default_value_t = crate::config::OUTPUT_CAP)]
    pub output_cap: f64,
    /// The provider's prompt-cache prices, which every rewrite of the prompt's past is
    /// weighed against (and `replay` prices requests with): anthropic, openai, none
    /// (apply at once) or custom:READ:WRITE:TTL_SECONDS [default: anthropic, or the
    /// preset's].
    #[arg(long, env = "COMPACTD_CACHE_MODEL", value_parser = parse_cache_model)]
    pub cache_model: Option<CacheModel>,
    /// What counts session text: auto (by model family: cl100k for GPT-3.5/GPT-4, o200k
    /// otherwise), o200k, cl100k or chars4 (OpenCode's length / 4) [default: auto, or the
    /// preset's: chars4 for opencode].
    #[arg(long, env = "COMPACTD_TOKENIZER", value_parser = parse_tokenizer)]
    pub tokenizer: Option<Tokenizer>,
}

/// Where `serve` listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListenAddr {
    /// A TCP address.
    Tcp(SocketAddr),
    /// A Unix domain socket path.
    Unix(PathBuf),
}

impl std::str::FromStr for ListenAddr {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if let Some(path) = s.strip_prefix("unix:") {
            if path.is_empty() {
                return Err("unix: needs a socket path".into());
            }
            return Ok(ListenAddr::Unix(PathBuf::from(path)));
        }
        s.parse()
            .map(ListenAddr::Tcp)
            .map_err(|e| format!("{s:?} is neither host:port nor unix:/path ({e})"))
    }
}

impl std::fmt::Display for ListenAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ListenAddr::Tcp(a) => write!(f, "{a}"),
            ListenAddr::Unix(p) => write!(f, "unix:{}", p.display()),
        }
    }
}

/// The default `--data-dir`: the platform's data directory, or `./compactd-data` where
/// there is none.
pub fn default_data_dir() -> PathBuf {
    dirs::data_dir().map_or_else(|| PathBuf::from("compactd-data"), |d| d.join("compactd"))
}

impl ServeArgs {
    /// The store's limits.
    pub fn limits(&self) -> Limits {
        Limits {
            max_sessions: self.max_sessions,
            max_session_bytes: self.max_session_bytes,
            memory_budget: self.memory_budget,
        }
    }

    /// The token given inline (`--auth-token`, `COMPACTD_AUTH_TOKEN`), checked without
    /// reading a file, so `config print` refuses it as `serve` does. Blank is a mistake
    /// (`--auth-token "$TOKEN"` with the variable unset), not a wish to serve without
    /// authentication.
    /// A token file, when given, is what `serve` reads (`auth`): the inline one is not
    /// checked then.
    pub fn inline_token(&self) -> Result<Option<crate::server::BearerToken>, ConfigError> {
        let Some(t) = self
            .auth_token
            .as_ref()
            .map(Secret::expose)
            .filter(|_| self.auth_token_file.is_none())
        else {
            return Ok(None);
        };
        crate::server::BearerToken::new(t)
            .map(Some)
            .map_err(|why| ConfigError {
                flag: "auth-token",
                message: if t.trim().is_empty() {
                    "is empty: give the token, or leave --auth-token (COMPACTD_AUTH_TOKEN) unset to serve without authentication".into()
                } else {
                    why
                },
            })
    }

    /// The authentication settings (reads the token file).
    pub fn auth(&self) -> Result<crate::server::AuthConfig, ConfigError> {
        let token = match (&self.auth_token_file, &self.auth_token) {
            (Some(path), _) => {
                let text = read_text("auth-token-file", path)?;
                Some(
                    crate::server::BearerToken::new(&text).map_err(|why| ConfigError {
                        flag: "auth-token-file",
                        message: format!("{}: the token {why}", path.display()),
                    })?,
                )
            }
            (None, Some(_)) => self.inline_token()?,
            (None, None) => None,
        };
        Ok(crate::server::AuthConfig {
            token,
            protect_health: self.auth_protect_health,
            open_reflection: self.auth_open_reflection,
        })
    }

    /// The TLS settings (reads and checks the PEM files), or None for plaintext. Checked
    /// here, before the server says it is up: each refusal names its flag and file.
    pub fn tls(&self) -> Result<Option<tonic::transport::ServerTlsConfig>, ConfigError> {
        let (Some(cert), Some(key)) = (&self.tls_cert, &self.tls_key) else {
            return Ok(None);
        };
        let identity = tls::identity(cert, key)?;
        let tls = tonic::transport::ServerTlsConfig::new().identity(identity);
        match &self.tls_client_ca {
            Some(ca) => tls::with_client_ca(tls, ca).map(Some),
            None => Ok(Some(tls)),
        }
    }

    /// The Unix socket's file mode.
    pub fn uds_mode(&self) -> Result<u32, ConfigError> {
        u32::from_str_radix(self.uds_mode.trim_start_matches("0o"), 8)
            .ok()
            .filter(|m| *m <= 0o777)
            .ok_or(ConfigError {
                flag: "uds-mode",
                message: format!("{:?} is not an octal file mode such as 600", self.uds_mode),
            })
    }
}

/// `compactd serve`.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// TOML file with settings (keys are the flag names); env and flags override it.
    #[arg(long, env = "COMPACTD_CONFIG", value_name = "PATH")]
    pub config: Option<PathBuf>,
    /// Address to listen on: `host:port`, or `unix:/path/to.sock` for a Unix socket.
    #[arg(long, env = "COMPACTD_LISTEN", default_value = "127.0.0.1:50051")]
    pub listen: ListenAddr,
    /// File mode of the Unix socket (octal).
    #[arg(long, env = "COMPACTD_UDS_MODE", default_value = "600")]
    pub uds_mode: String,
    /// File holding the bearer token every client must send (`authorization: Bearer
    /// <token>`); without it (or COMPACTD_AUTH_TOKEN) there is no authentication.
    #[arg(long, env = "COMPACTD_AUTH_TOKEN_FILE", value_name = "PATH")]
    pub auth_token_file: Option<PathBuf>,
    /// The bearer token. Never logged; its value is hidden from --help.
    #[arg(
        long = "auth-token",
        env = "COMPACTD_AUTH_TOKEN",
        hide_env_values = true,
        hide = true
    )]
    pub auth_token: Option<Secret>,
    /// With a token: health checks need it too (by default they stay open for probes).
    #[arg(long, env = "COMPACTD_AUTH_PROTECT_HEALTH")]
    pub auth_protect_health: bool,
    /// With a token: leave server reflection open (by default it needs the token).
    #[arg(long, env = "COMPACTD_AUTH_OPEN_REFLECTION")]
    pub auth_open_reflection: bool,
    /// Log format.
    #[arg(long, env = "COMPACTD_LOG_FORMAT", value_enum, default_value_t = LogFormat::Pretty)]
    pub log_format: LogFormat,
    /// PEM certificate chain for TLS (with --tls-key); plaintext without it.
    #[arg(
        long,
        env = "COMPACTD_TLS_CERT",
        value_name = "PATH",
        requires = "tls_key"
    )]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key for TLS.
    #[arg(
        long,
        env = "COMPACTD_TLS_KEY",
        value_name = "PATH",
        requires = "tls_cert"
    )]
    pub tls_key: Option<PathBuf>,
    /// PEM CA bundle: clients must present a certificate it signed (mutual TLS).
    #[arg(
        long,
        env = "COMPACTD_TLS_CLIENT_CA",
        value_name = "PATH",
        requires = "tls_cert"
    )]
    pub tls_client_ca: Option<PathBuf>,
    /// Sessions held at most; opening one more is RESOURCE_EXHAUSTED (0: no limit).
    #[arg(long, env = "COMPACTD_MAX_SESSIONS", default_value_t = 10_000)]
    pub max_sessions: usize,
    /// Bytes one session may hold (messages, parts, indexes); an update beyond it is
    /// RESOURCE_EXHAUSTED naming the limit (0: no limit).
    #[arg(long, env = "COMPACTD_MAX_SESSION_BYTES", default_value_t = DEFAULT_MAX_SESSION_BYTES, value_name = "BYTES")]
    pub max_session_bytes: u64,
    /// Bytes all sessions may hold together; updates and new sessions beyond it are
    /// RESOURCE_EXHAUSTED naming the limit (0: no limit). Keep it below the container's
    /// memory limit.
    #[arg(long, env = "COMPACTD_MEMORY_BUDGET", default_value_t = DEFAULT_MEMORY_BUDGET, value_name = "BYTES")]
    pub memory_budget: u64,
    /// Where sessions are stored (SQLite, `compactd.db`): they survive restarts and
    /// crashes, and sessions evicted from memory stay there. Default: the platform's data
    /// directory (`~/.local/share/compactd` on Linux).
    #[arg(long, env = "COMPACTD_DATA_DIR", value_name = "PATH", default_value_os_t = default_data_dir())]
    pub data_dir: PathBuf,
    /// When an update is acknowledged: `sync` (once on disk; concurrent updates of all
    /// sessions share one fsync), `interval=<ms>` (at once, on disk within the interval:
    /// a crash loses at most that window), `memory` (nothing on disk; a restart loses
    /// every session).
    #[arg(long, env = "COMPACTD_DURABILITY", default_value = "sync", value_parser = Durability::parse)]
    pub durability: Durability,
    /// Bytes the session database may take (0: no limit). Past it, updates are
    /// RESOURCE_EXHAUSTED as on a full disk; keep it below the volume's own limit.
    #[arg(
        long,
        env = "COMPACTD_MAX_DISK_BYTES",
        default_value_t = 0,
        value_name = "BYTES"
    )]
    pub max_disk_bytes: u64,
    /// Evict sessions no update or request touched for this many seconds (0: never).
    /// With a data dir they stay on disk and are loaded back on their next use.
    #[arg(long, env = "COMPACTD_SESSION_IDLE_TTL_SECS", default_value_t = 86_400)]
    pub session_idle_ttl_secs: u64,
    /// A Stream client that leaves its event buffer (1024 events) full this many seconds
    /// is disconnected with RESOURCE_EXHAUSTED; its sessions are kept. A unary reply the
    /// client reads none of this long is dropped and its stream reset.
    #[arg(long, env = "COMPACTD_SLOW_READER_GRACE_SECS", default_value_t = 10)]
    pub slow_reader_grace_secs: u64,
    /// Serve Prometheus metrics on this address (`GET /metrics`); off when unset.
    #[arg(long, env = "COMPACTD_METRICS_LISTEN", value_name = "HOST:PORT")]
    pub metrics_listen: Option<SocketAddr>,
    /// On SIGTERM/SIGINT, seconds running compactions get to finish before the streams
    /// close (health turns NOT_SERVING at once); connections then get what is left of it
    /// (at least 3 s) to take the answers they are owed.
    #[arg(long, env = "COMPACTD_DRAIN_TIMEOUT_SECS", default_value_t = 20)]
    pub drain_timeout_secs: u64,
    /// Shut down, as on SIGTERM, when stdin reaches its end: a parent that starts compactd
    /// with a pipe on its stdin (a host's sidecar) takes it down when it exits, killed
    /// included (SIGKILL, the OOM killer), where no signal reaches compactd.
    #[arg(long, env = "COMPACTD_EXIT_ON_STDIN_EOF")]
    pub exit_on_stdin_eof: bool,
    /// Largest update accepted, in bytes (RESOURCE_EXHAUSTED beyond it).
    #[arg(long, env = "COMPACTD_MAX_UPDATE_BYTES", default_value_t = DEFAULT_MAX_UPDATE_BYTES)]
    pub max_update_bytes: usize,
    /// Engine settings.
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Compaction model settings.
    #[command(flatten)]
    pub llm: LlmArgs,
}

/// The compaction model: any OpenAI-compatible chat-completions endpoint.
#[derive(Debug, Clone, Args)]
pub struct LlmArgs {
    // A bare URL in `--help`'s text, which rustdoc would rather see linked.
    #[allow(rustdoc::bare_urls)]
    /// Base URL, e.g. https://api.openai.com/v1 or http://127.0.0.1:8080/v1. Without it,
    /// compaction reports FAILED_PRECONDITION and everything else works. (Its value is
    /// hidden from --help: a URL may carry credentials.)
    #[arg(long, env = "COMPACTD_LLM_BASE_URL", hide_env_values = true)]
    pub llm_base_url: Option<SecretUrl>,
    /// Model name sent to the endpoint.
    #[arg(long, env = "COMPACTD_LLM_MODEL")]
    pub llm_model: Option<String>,
    /// File holding the API key (preferred over the environment variable).
    #[arg(long, env = "COMPACTD_LLM_API_KEY_FILE")]
    pub llm_api_key_file: Option<PathBuf>,
    /// API key. Never logged; its value is hidden from --help.
    #[arg(
        long = "llm-api-key",
        env = "COMPACTD_LLM_API_KEY",
        hide_env_values = true,
        hide = true
    )]
    pub llm_api_key: Option<Secret>,
    /// Deadline of one summary request, its retries included, in seconds (per chunk when
    /// a head is summarized in chunks).
    #[arg(long, env = "COMPACTD_LLM_TIMEOUT_SECS", default_value_t = 120)]
    pub llm_timeout_secs: u64,
    /// Retries for 429/5xx/connection errors before the first token.
    #[arg(long, env = "COMPACTD_LLM_MAX_RETRIES", default_value_t = 3)]
    pub llm_max_retries: u32,
    /// The compaction model's context window in tokens; longer histories are summarized in
    /// chunks. Wins over what the endpoint says; without it, compactd asks the endpoint
    /// (llama.cpp's /props, /v1/models) and learns from its refusals.
    #[arg(long, env = "COMPACTD_LLM_CONTEXT_TOKENS")]
    pub llm_context_tokens: Option<u64>,
    /// Price per million input tokens, to report compaction cost.
    #[arg(long, env = "COMPACTD_LLM_PRICE_INPUT", default_value_t = 0.0)]
    pub llm_price_input: f64,
    /// Price per million output tokens, to report compaction cost.
    #[arg(long, env = "COMPACTD_LLM_PRICE_OUTPUT", default_value_t = 0.0)]
    pub llm_price_output: f64,
    /// User turns kept verbatim after a summary.
    #[arg(long, env = "COMPACTD_TAIL_TURNS", default_value_t = 2)]
    pub tail_turns: u32,
    /// Token budget of the verbatim tail (default: 25% of usable input, 2000–15000).
    #[arg(long, env = "COMPACTD_TAIL_TOKENS")]
    pub tail_tokens: Option<u64>,
    /// File replacing the compaction agent's system prompt (seed 02's directive).
    #[arg(long, env = "COMPACTD_COMPACTION_SYSTEM_FILE")]
    pub compaction_system_file: Option<PathBuf>,
    /// File replacing the summary prompt (seed 02's default summary prompt).
    #[arg(long, env = "COMPACTD_COMPACTION_PROMPT_FILE")]
    pub compaction_prompt_file: Option<PathBuf>,
    /// File replacing the summary template (Objective / Important details / …); an empty
    /// file means no template.
    #[arg(long, env = "COMPACTD_COMPACTION_TEMPLATE_FILE")]
    pub compaction_template_file: Option<PathBuf>,
    /// Models a session's `compaction_model` or a request's `model` may name (comma
    /// separated); others are PERMISSION_DENIED. Empty: any model the endpoint serves.
    #[arg(
        long,
        env = "COMPACTD_COMPACTION_ALLOWED_MODELS",
        value_delimiter = ','
    )]
    pub compaction_allowed_models: Vec<String>,
}

impl LlmArgs {
    /// Validates the flags and builds the compaction settings (reads the key file).
    pub fn to_config(&self) -> Result<CompactionConfig, ConfigError> {
        if self.llm_context_tokens == Some(0) {
            return Err(ConfigError {
                flag: "llm-context-tokens",
                message: "0 tokens is no window (every compaction would be too long): give \
                          the compaction model's context window, or leave it unset for \
                          compactd to ask the endpoint"
                    .into(),
            });
        }
        let summarizer: Option<Arc<dyn Summarizer>> = match self
            .llm_base_url
            .as_ref()
            .map(SecretUrl::expose)
        {
            None => None,
            Some(url) => {
                check_llm_base_url(
                    "llm-base-url",
                    url,
                    "--llm-api-key-file, COMPACTD_LLM_API_KEY or --llm-api-key",
                )?;
                let Some(model) = self.llm_model.clone().filter(|m| !m.is_empty()) else {
                    return Err(ConfigError {
                        flag: "llm-model",
                        message: "required with --llm-base-url".into(),
                    });
                };
                let mut cfg = LlmConfig::new(url.to_string(), model);
                cfg.api_key = match (&self.llm_api_key_file, &self.llm_api_key) {
                    (Some(path), _) => Some(
                        api_key("llm-api-key-file", read_text("llm-api-key-file", path)?).map_err(
                            |e| ConfigError {
                                message: format!("{}: {}", path.display(), e.message),
                                ..e
                            },
                        )?,
                    ),
                    (None, Some(k)) if !k.expose().is_empty() => {
                        Some(api_key("llm-api-key", k.expose().to_string())?)
                    }
                    _ => None,
                };
                cfg.timeout = Duration::from_secs(self.llm_timeout_secs.max(1));
                cfg.max_retries = self.llm_max_retries;
                cfg.context_tokens = self.llm_context_tokens;
                for (flag, price) in [
                    ("llm-price-input", self.llm_price_input),
                    ("llm-price-output", self.llm_price_output),
                ] {
                    // `!(p >= 0)` also refuses NaN, which no comparison would catch.
                    if !(price >= 0.0 && price.is_finite()) {
                        return Err(ConfigError {
                            flag,
                            message: format!(
                                "a price is a finite number of dollars per million tokens, 0 or more (got {price})"
                            ),
                        });
                    }
                }
                cfg.price_per_mtok = (self.llm_price_input, self.llm_price_output);
                Some(Arc::new(OpenAiSummarizer::new(cfg)))
            }
        };
        let mut prompts = PromptConfig::default();
        for (flag, path, field) in [
            (
                "compaction-system-file",
                &self.compaction_system_file,
                &mut prompts.system,
            ),
            (
                "compaction-prompt-file",
                &self.compaction_prompt_file,
                &mut prompts.prompt,
            ),
            (
                "compaction-template-file",
                &self.compaction_template_file,
                &mut prompts.template,
            ),
        ] {
            if let Some(path) = path {
                *field = read_text(flag, path)?.trim().to_string();
            }
        }
        if prompts.prompt.is_empty() {
            return Err(ConfigError {
                flag: "compaction-prompt-file",
                message: "the summary prompt cannot be empty".into(),
            });
        }
        Ok(CompactionConfig {
            summarizer,
            tail_turns: self.tail_turns,
            tail_tokens: self.tail_tokens,
            prompts,
            allowed_models: non_empty(&self.compaction_allowed_models),
        })
    }
}

/// `compactd replay`.
#[derive(Debug, Clone, Args)]
pub struct ReplayArgs {
    /// `opencode export` JSON files.
    #[arg(required = true)]
    pub files: Vec<PathBuf>,
    /// Model context window in tokens.
    #[arg(long, default_value_t = 128_000)]
    pub context: u64,
    /// Model input limit (0: derive from context and output).
    #[arg(long, default_value_t = 0)]
    pub input: u64,
    /// Model output limit.
    #[arg(long, default_value_t = 32_000)]
    pub output: u64,
    /// Keep the `time.compacted` marks in the file instead of starting unpruned.
    #[arg(long)]
    pub keep_compacted: bool,
    /// Run full compactions against this OpenAI-compatible base URL when prune cannot fix
    /// an overflow (key from COMPACTD_LLM_API_KEY).
    #[arg(long, value_name = "BASE_URL")]
    pub summarize_with: Option<String>,
    /// Model name for --summarize-with.
    #[arg(long, default_value = "local")]
    pub summarize_model: String,
    /// Print one JSON document (per trace and in total, per lane: prompt_tokens, cost,
    /// cache_breaks, references, dangling_references, compactions) instead of tables.
    #[arg(long)]
    pub json: bool,
    /// Write a chart of context tokens and cost per step, every lane, to this file (.svg, or
    /// .html for a page); with several files, each chart gets the trace's name as a suffix.
    #[arg(long, value_name = "PATH")]
    pub chart: Option<PathBuf>,
    /// Engine settings.
    #[command(flatten)]
    pub engine: EngineArgs,
}

impl ReplayArgs {
    /// The model limits to replay with.
    pub fn limits(&self) -> ModelLimits {
        ModelLimits {
            context: self.context,
            input: self.input,
            output: self.output,
        }
    }
}

fn parse_cache_model(s: &str) -> Result<CacheModel, String> {
    s.parse()
}

fn parse_tokenizer(s: &str) -> Result<Tokenizer, String> {
    s.parse()
        .map_err(|e: crate::tokens::UnknownTokenizer| e.to_string())
}

/// A flag value that cannot work, named with the flag.
#[derive(Debug, thiserror::Error)]
#[error("--{flag}: {message}")]
pub struct ConfigError {
    /// Flag name (its env twin is listed in `--help`).
    pub flag: &'static str,
    /// What is wrong.
    pub message: String,
}

/// The flag that sets a config key (the rules name keys; a flag user reads flags).
fn flag_of(key: &'static str) -> &'static str {
    match key {
        "threshold" => "threshold",
        "protect_turns" => "protect-turns",
        "placeholder" => "placeholder",
        "auto_continue" => "auto-continue-text",
        "protected_file_globs" => "protected-file-globs",
        "mask_keep" => "mask-keep",
        "output_cap" => "output-cap",
        "cache_model" => "cache-model",
        "protected_tools" => "protected-tools",
        "strategy_protected_tools" => "strategy-protected-tools",
        "snapshot_tools" => "snapshot-tools",
        other => other,
    }
}

/// Refuses, naming `flag`, a compaction endpoint's base URL the summarizer cannot use as
/// given: not `http://` or `https://` with a host, or with a query, a fragment or
/// credentials (the error says the key goes in `key_from`). async-openai appends each
/// request's path (`/chat/completions`) to the URL's text, so a query or fragment would
/// come before it (`/v1?api-version=X/chat/completions`), and its bearer header (the key,
/// or none) stands in for the URL's `user:password@`. The URL is shown as
/// [`crate::config::redact::url`] shows it: never its credentials, nor a query's or
/// fragment's values.
pub fn check_llm_base_url(
    flag: &'static str,
    url: &str,
    key_from: &str,
) -> Result<(), ConfigError> {
    let refused = |why: &str| ConfigError {
        flag,
        message: format!("{:?} {why}", crate::config::redact::url(url)),
    };
    let key = format!("an API key goes in {key_from}, sent as `Authorization: Bearer <key>`");
    if !(url.starts_with("http://") || url.starts_with("https://")) {
        return Err(refused("is not an http(s) URL"));
    }
    let parsed = match reqwest::Url::parse(url) {
        Ok(u) if u.host().is_some() => u,
        Ok(_) => return Err(refused("is not an http(s) URL")),
        // A password holding `/`, `?` or `#` unencoded ends the authority early.
        Err(e) if url.contains('@') => {
            return Err(refused(&format!(
                "is not an http(s) URL ({e}), and credentials do not belong in it: {key}"
            )));
        }
        Err(e) => return Err(refused(&format!("is not an http(s) URL ({e})"))),
    };
    if !parsed.username().is_empty() || parsed.password().is_some() {
        return Err(refused(&format!(
            "carries credentials (`user:password@`), which compactd would not send: {key}"
        )));
    }
    if parsed.query().is_some() {
        return Err(refused(&format!(
            "has a query (`?...`): the request's path (/chat/completions) is added \
             after the base URL's text, so it would land inside the query; give the base URL \
             alone; {key}"
        )));
    }
    if parsed.fragment().is_some() {
        return Err(refused(&format!(
            "has a fragment (`#...`): the request's path (/chat/completions) is added \
             after the base URL's text, so it would land inside the fragment; give the base URL \
             alone; {key}"
        )));
    }
    Ok(())
}

/// A file a flag names, read whole; the error names the flag and the file.
fn read_text(flag: &'static str, path: &std::path::Path) -> Result<String, ConfigError> {
    std::fs::read_to_string(path).map_err(|e| ConfigError {
        flag,
        message: format!("cannot read {}: {e}", path.display()),
    })
}

/// The key given with `flag`, refused naming the flag (never quoting the key); a blank
/// one is told how to go without a key.
fn api_key(flag: &'static str, key: String) -> Result<ApiKey, ConfigError> {
    let blank = key.trim().is_empty();
    ApiKey::new(key).map_err(|why| ConfigError {
        flag,
        message: if blank {
            format!("{why}: give the key, or leave --{flag} unset for an endpoint without keys")
        } else {
            why
        },
    })
}

fn non_empty(list: &[String]) -> Vec<String> {
    list.iter()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .collect()
}

impl EngineArgs {
    /// The strategies on: `--no-strategies`, else `--strategies`, else the preset.
    pub fn strategy_set(&self) -> Result<StrategySet, ConfigError> {
        if self.no_strategies && self.strategies.is_some() {
            return Err(ConfigError {
                flag: "strategies",
                message: "cannot be used with --no-strategies (pick one)".into(),
            });
        }
        if self.no_strategies {
            return Ok(StrategySet::NONE);
        }
        if let Some(list) = &self.strategies {
            return StrategySet::parse_list(list).map_err(|e| ConfigError {
                flag: "strategies",
                message: e.to_string(),
            });
        }
        let preset = self
            .strategy_preset
            .parse::<StrategyPreset>()
            .map_err(|message| ConfigError {
                flag: "strategy-preset",
                message,
            })?;
        Ok(StrategySet::preset(preset))
    }

    /// Validates the flags and builds the engine config.
    pub fn to_config(&self) -> Result<EngineConfig, ConfigError> {
        let base = EngineConfig {
            auto_compact: !self.disable_autocompact,
            prune: !self.disable_prune,
            threshold: self.threshold.unwrap_or(crate::config::DEFAULT_THRESHOLD),
            reserved: Reserved::Fixed(self.reserved.unwrap_or(0)),
            cache_counting: match self.cache_counting {
                CacheArg::Separate => CacheCounting::Separate,
                CacheArg::Included => CacheCounting::Included,
            },
            prune_protect: self.prune_protect,
            prune_minimum: self.prune_minimum,
            protected_tools: self
                .protected_tools
                .iter()
                .filter(|t| !t.is_empty())
                .cloned()
                .collect(),
            protect_turns: self.protect_turns,
            strategies: self.strategy_set()?,
            placeholder: self.placeholder.clone(),
            max_parts_per_message: self.max_parts_per_message,
            auto_continue: self.auto_continue_text.clone(),
            strategy_protected_tools: non_empty(&self.strategy_protected_tools),
            protected_file_globs: non_empty(&self.protected_file_globs),
            snapshot_tools: non_empty(&self.snapshot_tools),
            mask_keep: self.mask_keep,
            output_cap: self.output_cap,
            cache_model: self.cache_model.unwrap_or(CacheModel::ANTHROPIC),
            tokenizer: self.tokenizer.unwrap_or_default(),
            ..EngineConfig::default()
        };
        base.validate().map_err(|e| ConfigError {
            flag: flag_of(e.key),
            message: e.message,
        })?;
        let preset = match self.preset {
            None => return Ok(base),
            Some(PresetArg::Compactd) => OverflowPreset::Compactd,
            Some(PresetArg::Opencode) => OverflowPreset::OpenCode,
        };
        // The preset, then what was given explicitly over it.
        Ok(base.resolve(&SessionOverrides {
            preset: Some(preset),
            threshold: self.threshold,
            reserved: self.reserved,
            cache_model: self.cache_model,
            tokenizer: self.tokenizer,
            ..Default::default()
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llm_args(extra: &[&str]) -> LlmArgs {
        let mut argv = vec!["compactd", "serve"];
        argv.extend_from_slice(extra);
        match Cli::try_parse_from(argv).expect("flags parse").command {
            Command::Serve(s) => s.llm,
            _ => unreachable!("`serve` was parsed"),
        }
    }

    fn engine(extra: &[&str]) -> EngineConfig {
        let mut argv = vec!["compactd", "serve"];
        argv.extend_from_slice(extra);
        match Cli::try_parse_from(argv).expect("flags parse").command {
            Command::Serve(s) => s.engine.to_config().expect("valid"),
            _ => unreachable!("`serve` was parsed"),
        }
    }

    /// `--threshold` and `--reserved` given explicitly win over the preset's, as their
    /// help says. Before, `--preset opencode --threshold 0.8` ran at 1.0: the preset was
    /// applied over everything.
    #[test]
    fn explicit_values_win_over_the_preset() {
        let c = engine(&["--preset", "opencode", "--threshold", "0.8"]);
        assert_eq!((c.threshold, c.reserved), (0.8, Reserved::OpenCode));
        let c = engine(&["--preset", "opencode"]);
        assert_eq!((c.threshold, c.reserved), (1.0, Reserved::OpenCode));
        let c = engine(&["--preset", "compactd", "--reserved", "5000"]);
        assert_eq!(
            (c.threshold, c.reserved),
            (crate::config::DEFAULT_THRESHOLD, Reserved::Fixed(5000))
        );
        let c = engine(&["--threshold", "0.8"]);
        assert_eq!((c.threshold, c.reserved), (0.8, Reserved::Fixed(0)));
        let c = engine(&[]);
        assert_eq!(
            (c.threshold, c.reserved),
            (crate::config::DEFAULT_THRESHOLD, Reserved::Fixed(0))
        );
        // The tokenizer and the cache model too.
        let c = engine(&[
            "--preset",
            "opencode",
            "--tokenizer",
            "o200k",
            "--cache-model",
            "openai",
        ]);
        assert_eq!(
            (c.tokenizer, c.cache_model),
            (Tokenizer::O200k, CacheModel::OPENAI)
        );
        let c = engine(&["--preset", "opencode"]);
        assert_eq!(
            (c.tokenizer, c.cache_model),
            (Tokenizer::Chars4, CacheModel::NONE)
        );
        let c = engine(&[]);
        assert_eq!(
            (c.tokenizer, c.cache_model),
            (Tokenizer::Auto, CacheModel::ANTHROPIC)
        );
    }

    #[test]
    fn prompt_files_replace_the_defaults() {
        let dir = std::env::temp_dir().join(format!("compactd-cli-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let prompt = dir.join("prompt.txt");
        let template = dir.join("template.txt");
        std::fs::write(&prompt, "Summarize for the on-call engineer.\n").expect("write");
        std::fs::write(&template, "").expect("write");
        let cfg = llm_args(&[
            "--compaction-prompt-file",
            prompt.to_str().expect("utf-8 path"),
            "--compaction-template-file",
            template.to_str().expect("utf-8 path"),
        ])
        .to_config()
        .expect("valid");
        assert_eq!(cfg.prompts.prompt, "Summarize for the on-call engineer.");
        assert_eq!(cfg.prompts.template, "", "an empty file means no template");
        assert_eq!(cfg.prompts.system, PromptConfig::default().system);
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn an_unreadable_or_empty_prompt_names_its_flag() {
        let err = llm_args(&["--compaction-system-file", "/nonexistent/compactd/system"])
            .to_config()
            .expect_err("missing file");
        assert_eq!(err.flag, "compaction-system-file");
        assert!(err.message.contains("/nonexistent/compactd/system"));

        let empty = std::env::temp_dir().join(format!("compactd-empty-{}", std::process::id()));
        std::fs::write(&empty, "  \n").expect("write");
        let err = llm_args(&["--compaction-prompt-file", empty.to_str().expect("utf-8")])
            .to_config()
            .expect_err("empty prompt");
        assert_eq!(err.flag, "compaction-prompt-file");
        std::fs::remove_file(&empty).ok();
    }

    /// A key that cannot be a header value (a key file of two lines, a pasted control
    /// character) is refused at start naming its flag, never quoting it. Before, it was
    /// taken, and every compaction request panicked in async-openai's header building.
    #[test]
    fn an_api_key_with_a_control_character_is_refused_at_start() {
        let base = [
            "--llm-base-url",
            "http://127.0.0.1:1/v1",
            "--llm-model",
            "m",
        ];
        let file = std::env::temp_dir().join(format!("compactd-key2-{}", std::process::id()));
        std::fs::write(&file, "sk-first-SECRET\nsk-second-SECRET\n").expect("write");
        let mut args = base.to_vec();
        args.extend(["--llm-api-key-file", file.to_str().expect("utf-8")]);
        let err = llm_args(&args).to_config().expect_err("two lines");
        std::fs::remove_file(&file).ok();
        assert_eq!(err.flag, "llm-api-key-file");
        assert!(!err.message.contains("SECRET"), "{}", err.message);
        assert!(err.message.contains("control character"), "{}", err.message);

        let mut args = base.to_vec();
        args.extend(["--llm-api-key", "sk-a\u{7f}b-SECRET"]);
        let err = llm_args(&args).to_config().expect_err("DEL");
        assert_eq!(err.flag, "llm-api-key");
        assert!(!err.message.contains("SECRET"), "{}", err.message);

        // One line, with its newline and spaces trimmed, and non-ASCII: taken.
        let mut args = base.to_vec();
        args.extend(["--llm-api-key", " sk-é\tok \n"]);
        llm_args(&args).to_config().expect("valid");
    }

    /// A base URL with a query, a fragment or credentials is refused at start naming
    /// --llm-base-url and saying how to pass a key, its secrets never shown. Before, each
    /// was taken and every compaction failed: async-openai appends `/chat/completions` to
    /// the URL's text (`POST /v1?api-version=2024-10-21/chat/completions`), and sends its
    /// bearer header (`Bearer ` without a key) in place of the URL's credentials.
    #[test]
    fn a_base_url_with_a_query_a_fragment_or_credentials_is_refused() {
        for (url, why) in [
            (
                "https://llm.example/v1?api-version=2024-10-21&api-key=sk-SECRET1",
                "a query",
            ),
            ("https://llm.example/v1?", "a query"),
            ("https://llm.example/v1#sk-SECRET2", "a fragment"),
            ("https://bob:pw-SECRET3@llm.example/v1", "credentials"),
            ("https://sk-SECRET4@llm.example/v1", "credentials"),
            ("https://bob:pw/SECRET5?x@llm.example/v1", "credentials"),
        ] {
            let err = llm_args(&["--llm-base-url", url, "--llm-model", "m"])
                .to_config()
                .expect_err(url);
            let shown = err.to_string();
            assert_eq!(err.flag, "llm-base-url", "{shown}");
            assert!(shown.contains(why), "{url}: {shown}");
            assert!(shown.contains("--llm-api-key"), "{url}: {shown}");
            assert!(!shown.contains("SECRET"), "{url}: {shown}");
        }
        for url in [
            "ftp://llm.example/v1",
            "llm.example/v1",
            "HTTPS://llm.example/v1",
            "http://",
            "http://:8080/v1",
        ] {
            let err = llm_args(&["--llm-base-url", url, "--llm-model", "m"])
                .to_config()
                .expect_err(url);
            assert_eq!(err.flag, "llm-base-url", "{err}");
            assert!(err.message.contains("not an http(s) URL"), "{err}");
        }
        for url in [
            "http://127.0.0.1:8080/v1",
            "https://api.openai.com/v1/",
            "http://[::1]:8000/v1",
            "https://gateway.example/openai/v1",
        ] {
            llm_args(&["--llm-base-url", url, "--llm-model", "m"])
                .to_config()
                .expect(url);
        }
    }

    /// The flags that name the test endpoint, `extra` after them.
    fn with_endpoint<'a>(extra: &[&'a str]) -> Vec<&'a str> {
        let mut args = vec![
            "--llm-base-url",
            "http://127.0.0.1:1/v1",
            "--llm-model",
            "m",
        ];
        args.extend_from_slice(extra);
        args
    }

    /// A key file that holds no key (empty, or only white space: the key is trimmed) is
    /// refused at start naming the flag and the file, as an empty --auth-token-file is.
    /// Before, it was taken and every request went out with `Bearer ` (a Secret mounted
    /// empty, for one).
    #[test]
    fn a_blank_api_key_file_is_refused_at_start() {
        let file = std::env::temp_dir().join(format!("compactd-blank-{}", std::process::id()));
        let path = file.to_str().expect("utf-8").to_string();
        for text in ["", "\n", " \t\r\n"] {
            std::fs::write(&file, text).expect("write");
            let err = llm_args(&with_endpoint(&["--llm-api-key-file", &path]))
                .to_config()
                .expect_err("a blank key file");
            assert_eq!(err.flag, "llm-api-key-file", "{text:?}: {err}");
            assert!(err.message.contains("empty"), "{text:?}: {err}");
            assert!(err.message.contains(&path), "{text:?}: {err}");
        }
        std::fs::remove_file(&file).ok();
    }

    /// A key of only white space is refused at start naming --llm-api-key. Before, it was
    /// taken (trimmed to nothing) and sent as `Bearer `. An empty value stays no key (a
    /// template's `COMPACTD_LLM_API_KEY=`, as layers.rs reads it).
    #[test]
    fn a_blank_api_key_is_refused_at_start_and_an_empty_one_is_none() {
        for key in [" ", "\t\n"] {
            let err = llm_args(&with_endpoint(&["--llm-api-key", key]))
                .to_config()
                .expect_err("a blank key");
            assert_eq!(err.flag, "llm-api-key", "{key:?}: {err}");
            assert!(err.message.contains("empty"), "{key:?}: {err}");
        }
        let cfg = llm_args(&with_endpoint(&["--llm-api-key", ""]))
            .to_config()
            .expect("an empty value: no key");
        assert!(format!("{cfg:?}").contains("api_key: None"), "{cfg:?}");
    }

    /// `--llm-context-tokens 0` is refused at start naming the flag (0 has no meaning: an
    /// unset window is the one asked of the endpoint). Before, it was taken and every
    /// Compact failed `too_long`, retryable.
    #[test]
    fn a_zero_window_is_refused_at_start() {
        for args in [with_endpoint(&[]), Vec::new()] {
            let mut args = args;
            args.extend(["--llm-context-tokens", "0"]);
            let err = llm_args(&args).to_config().expect_err("a window of 0");
            assert_eq!(err.flag, "llm-context-tokens", "{err}");
        }
        llm_args(&with_endpoint(&["--llm-context-tokens", "8192"]))
            .to_config()
            .expect("a window");
    }
}
