//! The compaction agent's LLM side: a [`Summarizer`] streams a summary for prepared
//! `messages`, reporting deltas as they arrive. The pure parts (what to ask) are in
//! `prompt.rs`; `chunk.rs` decides how a head too long for one request is split and
//! folded (the server and the replay both go through it), with the token arithmetic of one
//! request in `budget.rs`; `window.rs` keeps what is known of each endpoint's window (told
//! by `discover.rs`, or taught by refusals and empty streams); `llm.rs` only talks HTTP
//! (async-openai) and never sees session state.
//!
//! Architecture invariant: nothing here touches a `Session`; the store prepares the request
//! inside the session actor and commits the result there.

mod bounded;
pub mod budget;
pub mod chunk;
mod discover;
#[cfg(test)]
mod fake_endpoint;
mod llm;
pub mod output_cap;
pub mod prompt;
mod retry_after;
pub mod window;

use std::fmt;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

pub use llm::OpenAiSummarizer;
pub use prompt::PromptConfig;
pub use window::{Window, WindowSource};

use crate::engine::SummaryOutcome;

/// An API key. `Debug` and `Display` never show it, so it cannot reach logs, errors or
/// events by accident.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKey(String);

impl ApiKey {
    /// Wraps a key (a key file's trailing newline and surrounding spaces are trimmed).
    /// Refused when nothing is left of it (it would go out as `Bearer `, the header of no
    /// key), or when it cannot be sent as a header value (a control character: a key file
    /// of two lines): the error says where, never what.
    pub fn new(key: impl Into<String>) -> Result<ApiKey, String> {
        let key = key.into().trim().to_string();
        if key.is_empty() {
            return Err("the API key is empty (or only white space)".into());
        }
        // What `http::HeaderValue` takes: tab, and every byte from space up but DEL.
        match key
            .bytes()
            .position(|b| (b < b' ' && b != b'\t') || b == 0x7f)
        {
            Some(at) => Err(format!(
                "the API key holds a control character at byte {at} (a second line?): a key \
                 is one line of visible characters"
            )),
            None => Ok(ApiKey(key)),
        }
    }

    /// The key itself, for the one place that sends it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ApiKey([redacted])")
    }
}

impl fmt::Display for ApiKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[redacted]")
    }
}

/// Where and how to reach the compaction model. Its `Debug` redacts credentials in the
/// base URL (`user:key@`, `?api-key=`), as the key's own does.
#[derive(Clone, PartialEq)]
pub struct LlmConfig {
    /// OpenAI-compatible base URL, e.g. `https://api.openai.com/v1` or
    /// `http://127.0.0.1:8080/v1`.
    pub base_url: String,
    /// Model name sent in the request.
    pub model: String,
    /// API key (sent as a bearer token), when the endpoint needs one.
    pub api_key: Option<ApiKey>,
    /// Deadline of one summary request, its retries included (a head summarized in
    /// chunks has it per chunk: a slow local model may need many).
    pub timeout: Duration,
    /// Retries for 429/5xx/connection errors before the first token.
    pub max_retries: u32,
    /// First retry delay; doubles each time (capped at 8 s).
    pub retry_base: Duration,
    /// Price per million input / output tokens, to report cost (0: no cost).
    pub price_per_mtok: (f64, f64),
    /// The compaction model's context window in tokens (`--llm-context-tokens`): when set it
    /// wins over what the endpoint tells; when unset compactd asks the endpoint and learns
    /// from its refusals.
    pub context_tokens: Option<u64>,
}

impl fmt::Debug for LlmConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LlmConfig")
            .field("base_url", &crate::config::redact::url(&self.base_url))
            .field("model", &self.model)
            .field("api_key", &self.api_key)
            .field("timeout", &self.timeout)
            .field("max_retries", &self.max_retries)
            .field("retry_base", &self.retry_base)
            .field("price_per_mtok", &self.price_per_mtok)
            .field("context_tokens", &self.context_tokens)
            .finish()
    }
}

impl LlmConfig {
    /// A config with compactd's defaults for everything but the endpoint and model.
    pub fn new(base_url: impl Into<String>, model: impl Into<String>) -> LlmConfig {
        LlmConfig {
            base_url: base_url.into(),
            model: model.into(),
            api_key: None,
            timeout: Duration::from_secs(120),
            max_retries: 3,
            retry_base: Duration::from_millis(500),
            price_per_mtok: (0.0, 0.0),
            context_tokens: None,
        }
    }
}

/// One compaction request, ready to send.
#[derive(Debug, Clone, PartialEq)]
pub struct SummaryRequest {
    /// Chat-completions messages (see `prompt::build_messages`).
    pub messages: Vec<serde_json::Value>,
    /// Model to ask for instead of the configured one (per session or per request).
    pub model: Option<String>,
    /// The answer's limit (`max_tokens`), sized so prompt and answer fit a known window.
    pub max_tokens: Option<u64>,
    /// compactd's count of the messages' tokens, to compare with the endpoint's own numbers.
    pub counted_tokens: Option<u64>,
}

/// Progress while a summary streams.
#[derive(Debug, Clone, PartialEq)]
pub enum Progress {
    /// Summary text, in order; the deltas concatenate to the summary. Pieces the caller
    /// has no room for yet are joined into one delta.
    Delta(String),
    /// A retryable failure before the first token; retrying after `delay`.
    Retrying {
        /// Attempt about to start (2 for the first retry).
        attempt: u32,
        /// What failed.
        reason: String,
        /// Wait before it.
        delay: Duration,
    },
    /// An answer paid for and dropped (a prompt the endpoint truncated, a stream stopped
    /// by a filter or cut short, a model that reasoned its room away, the one-token
    /// probe of an empty stream): its usage and cost (no text), so that what a compaction
    /// reports it cost includes it.
    Voided(SummaryOutcome),
}

/// Why a summary could not be produced. Messages never contain the API key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SummarizeError {
    /// No endpoint configured. The caller should configure one; nothing else is affected.
    #[error(
        "no LLM endpoint is configured: start compactd with --llm-base-url and --llm-model (COMPACTD_LLM_BASE_URL, COMPACTD_LLM_MODEL), and an API key in COMPACTD_LLM_API_KEY or --llm-api-key-file if the endpoint needs one"
    )]
    NotConfigured,
    /// The endpoint refused or failed the request (after retries when retryable).
    #[error("LLM request failed: {message}")]
    Request {
        /// HTTP status, when there was a response.
        status: Option<u16>,
        /// What went wrong.
        message: String,
        /// Worth trying again later.
        retryable: bool,
    },
    /// The stream broke after text arrived; nothing is committed.
    #[error("the LLM stream broke after the summary started: {0}")]
    Broken(String),
    /// The endpoint sent something that is not a chat-completions stream.
    #[error("malformed LLM stream: {0}")]
    Malformed(String),
    /// The request is longer than the model's context window (a refusal for length, or an
    /// empty stream whose one-token probe says so); compactd cuts the head into smaller chunks and never sends the same
    /// request again.
    #[error("the request exceeds the model's context window: {0}")]
    TooLong(String),
    /// The whole summary took longer than the configured timeout.
    #[error("the summary took longer than {0:?}")]
    Timeout(Duration),
    /// The client cancelled the compaction.
    #[error("cancelled")]
    Cancelled,
}

impl SummarizeError {
    /// The same error with its text (the endpoint's words, a reason) mapped by `f`: to
    /// scrub it of secrets, or to say where it came from.
    pub fn map_text(self, f: impl FnOnce(String) -> String) -> SummarizeError {
        match self {
            SummarizeError::Request {
                status,
                message,
                retryable,
            } => SummarizeError::Request {
                status,
                message: f(message),
                retryable,
            },
            SummarizeError::Broken(m) => SummarizeError::Broken(f(m)),
            SummarizeError::Malformed(m) => SummarizeError::Malformed(f(m)),
            SummarizeError::TooLong(m) => SummarizeError::TooLong(f(m)),
            other => other,
        }
    }

    /// Whether trying the same compaction again later may succeed.
    pub fn retryable(&self) -> bool {
        match self {
            SummarizeError::Request { retryable, .. } => *retryable,
            SummarizeError::Broken(_) | SummarizeError::Timeout(_) | SummarizeError::TooLong(_) => {
                true
            }
            SummarizeError::NotConfigured
            | SummarizeError::Malformed(_)
            | SummarizeError::Cancelled => false,
        }
    }
}

/// Writes summaries. One implementation talks to OpenAI-compatible endpoints; tests use
/// the same one against a real local HTTP server.
#[tonic::async_trait]
pub trait Summarizer: Send + Sync + fmt::Debug {
    /// Streams a summary for `request`, sending deltas to `progress` as they arrive. Stops
    /// (and drops the HTTP request) when `cancel` fires.
    async fn summarize(
        &self,
        request: SummaryRequest,
        progress: mpsc::Sender<Progress>,
        cancel: CancellationToken,
    ) -> Result<SummaryOutcome, SummarizeError>;

    /// Model name, for events.
    fn model(&self) -> &str;

    /// The window of `model` (None: the configured model) as known now: the configured one,
    /// else what its endpoint told (asked once per process) or taught by refusing requests.
    async fn window(&self, model: Option<&str>) -> Option<Window>;
}

/// A [`chunk::Requester`] that waits for each answer and discards progress: for callers
/// that only want the summary (the replay), not the stream. It keeps what the answers it
/// dropped cost ([`Quiet::voided`]).
#[derive(Debug, Clone)]
pub struct Quiet<'a> {
    summarizer: &'a dyn Summarizer,
    voided: SummaryOutcome,
}

impl<'a> Quiet<'a> {
    /// Requests through `summarizer`, with its own model.
    pub fn new(summarizer: &'a dyn Summarizer) -> Quiet<'a> {
        Quiet {
            summarizer,
            voided: SummaryOutcome::default(),
        }
    }

    /// What the answers paid for and dropped cost so far (usage and cost, no text): the
    /// summary's own outcome sums only the answers it kept.
    pub fn voided(&self) -> &SummaryOutcome {
        &self.voided
    }
}

impl chunk::Requester for Quiet<'_> {
    async fn request(
        &mut self,
        request: SummaryRequest,
        _last: bool,
    ) -> Result<SummaryOutcome, SummarizeError> {
        let (result, voided) = summarize_quietly(self.summarizer, request).await;
        self.voided.add_spend(&voided);
        result
    }

    fn window(&mut self) -> impl std::future::Future<Output = Option<Window>> + Send {
        self.summarizer.window(None)
    }
}

/// Runs `summarizer` to the end, discarding progress: for callers that only want the
/// summary (the replay), not the stream. Also returns what the answers it dropped cost.
pub async fn summarize_quietly(
    summarizer: &dyn Summarizer,
    request: SummaryRequest,
) -> (Result<SummaryOutcome, SummarizeError>, SummaryOutcome) {
    let (tx, mut rx) = mpsc::channel(64);
    let run = summarizer.summarize(request, tx, CancellationToken::new());
    tokio::pin!(run);
    let mut voided = SummaryOutcome::default();
    let mut keep = |p: Progress| {
        if let Progress::Voided(spent) = p {
            voided.add_spend(&spent);
        }
    };
    let result = loop {
        tokio::select! {
            r = &mut run => break r,
            Some(p) = rx.recv() => keep(p),
        }
    };
    // Sent just before the end: still queued.
    while let Ok(p) = rx.try_recv() {
        keep(p);
    }
    (result, voided)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A config printed with `{:?}` (a log line, a panic message) shows no credential:
    /// neither the key nor what the base URL carries. Before, the URL was printed raw.
    #[test]
    fn a_configs_debug_shows_no_credential() {
        let mut cfg = LlmConfig::new("https://bob:pw-SECRET1@llm.example/v1?api-key=SECRET2", "m");
        cfg.api_key = Some(ApiKey::new(" sk-SECRET3\n").expect("a valid key"));
        assert_eq!(cfg.api_key.as_ref().map(ApiKey::expose), Some("sk-SECRET3"));
        let windows = window::Windows::new(None);
        windows.cap_output(&cfg.base_url, "m", output_cap::OutputCap::Omit);
        let printed = format!("{cfg:?} {windows:?}");
        assert!(printed.contains("llm.example"), "{printed}");
        assert!(!printed.contains("SECRET"), "{printed}");
    }
}
