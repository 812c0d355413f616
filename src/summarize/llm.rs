//! [`OpenAiSummarizer`]: streaming chat completions through async-openai against any
//! OpenAI-compatible base URL, with retries (429, 5xx, connection errors) before the first
//! token (waiting as long as a 429/503's `Retry-After` asks), a deadline for the whole summary, and cancellation that drops the HTTP request.
//!
//! Responses are read as raw JSON (async-openai's "bring your own types") so servers that
//! omit optional fields still work; a stream counts as complete only when a choice reports
//! a `finish_reason`.

use std::time::{Duration, Instant};

use async_openai::Client;
use async_openai::config::OpenAIConfig;
use async_openai::error::OpenAIError;
use futures::StreamExt;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::{LlmConfig, Progress, SummarizeError, Summarizer, SummaryRequest, retry_after};
use crate::domain::{ModelRef, TokenUsage};
use crate::engine::SummaryOutcome;

/// Longest wait between retries.
const MAX_RETRY_DELAY: Duration = Duration::from_secs(8);

/// Longest wait compactd accepts from a server's `Retry-After`.
const MAX_HINTED_DELAY: Duration = Duration::from_secs(60);

/// Summarizer for OpenAI-compatible chat-completions endpoints.
pub struct OpenAiSummarizer {
    client: Client<OpenAIConfig>,
    config: LlmConfig,
}

/// Written by hand so no dependency's `Debug` can ever print the key.
impl std::fmt::Debug for OpenAiSummarizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenAiSummarizer")
            .field("base_url", &self.config.base_url)
            .field("model", &self.config.model)
            .field(
                "api_key",
                &self.config.api_key.as_ref().map(|_| "[redacted]"),
            )
            .finish()
    }
}

impl OpenAiSummarizer {
    /// A summarizer for `config`.
    pub fn new(config: LlmConfig) -> OpenAiSummarizer {
        let mut oc = OpenAIConfig::new().with_api_base(config.base_url.trim_end_matches('/'));
        // async-openai sends a bearer header only when a key is set; local servers need none.
        oc = oc.with_api_key(config.api_key.as_ref().map_or("", |k| k.expose()));
        let client = retry_after::client(oc);
        OpenAiSummarizer { client, config }
    }

    /// Some providers echo the key in error text; it never leaves this type.
    fn scrub(&self, e: SummarizeError) -> SummarizeError {
        let Some(key) = self
            .config
            .api_key
            .as_ref()
            .map(|k| k.expose())
            .filter(|k| !k.is_empty())
        else {
            return e;
        };
        let clean = |m: String| crate::config::redact::text(&m, key);
        match e {
            SummarizeError::Request {
                status,
                message,
                retryable,
            } => SummarizeError::Request {
                status,
                message: clean(message),
                retryable,
            },
            SummarizeError::Broken(m) => SummarizeError::Broken(clean(m)),
            SummarizeError::Malformed(m) => SummarizeError::Malformed(clean(m)),
            SummarizeError::TooLong(m) => SummarizeError::TooLong(clean(m)),
            other => other,
        }
    }

    fn body(&self, request: &SummaryRequest) -> Value {
        let mut body = json!({
            "model": request.model.as_deref().unwrap_or(&self.config.model),
            "messages": request.messages,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        // With a known window, cap the answer at the quarter the chunk budget keeps for it
        // (small models otherwise write until their context is full).
        if let Some(window) = self.config.context_tokens {
            body["max_tokens"] = json!(window / 4);
        }
        body
    }

    /// One attempt: open the stream, forward deltas, collect text, usage and finish reason.
    async fn attempt(
        &self,
        body: &Value,
        progress: &mpsc::Sender<Progress>,
        started: &mut bool,
    ) -> Result<SummaryOutcome, SummarizeError> {
        let mut stream = self
            .client
            .chat()
            .create_stream_byot::<&Value, Value>(body)
            .await
            .map_err(|e| request_error(e, false))?;
        let mut text = String::new();
        let mut usage = None;
        let mut finished = false;
        let mut chunks = 0usize;
        while let Some(item) = stream.next().await {
            let chunk = item.map_err(|e| request_error(e, *started))?;
            chunks += 1;
            if let Some(u) = chunk.get("usage").filter(|u| u.is_object()) {
                usage = Some(TokenUsage {
                    input: u["prompt_tokens"].as_u64().unwrap_or(0),
                    output: u["completion_tokens"].as_u64().unwrap_or(0),
                    total: u["total_tokens"].as_u64(),
                    ..Default::default()
                });
            }
            let Some(choices) = chunk.get("choices").and_then(Value::as_array) else {
                return Err(SummarizeError::Malformed(
                    "a chunk without `choices`".into(),
                ));
            };
            for choice in choices {
                if let Some(delta) = choice["delta"]["content"]
                    .as_str()
                    .filter(|d| !d.is_empty())
                {
                    *started = true;
                    text.push_str(delta);
                    // A closed receiver means the caller stopped listening; keep going so
                    // the summary can still be committed.
                    let _ = progress.send(Progress::Delta(delta.to_string())).await;
                }
                if choice["finish_reason"].is_string() {
                    finished = true;
                }
            }
        }
        if chunks == 0 {
            // llama.cpp's Python server answers a prompt longer than its context this way.
            return Err(SummarizeError::Request {
                status: None,
                message: "the endpoint answered with an empty stream (llama.cpp servers do this when the prompt exceeds their context: set --llm-context-tokens below the server's window)".into(),
                retryable: true,
            });
        }
        if !finished {
            let what = "the stream ended before the model finished".to_string();
            return Err(if *started {
                SummarizeError::Broken(what)
            } else {
                SummarizeError::Request {
                    status: None,
                    message: what,
                    retryable: true,
                }
            });
        }
        let (pin, pout) = self.config.price_per_mtok;
        let cost = usage.map_or(0.0, |u| {
            (u.input as f64 * pin + u.output as f64 * pout) / 1e6
        });
        Ok(SummaryOutcome {
            text,
            usage,
            cost,
            model: Some(ModelRef {
                provider_id: "openai-compatible".into(),
                model_id: body["model"].as_str().unwrap_or_default().to_string(),
            }),
        })
    }

    async fn with_retries(
        &self,
        request: SummaryRequest,
        progress: mpsc::Sender<Progress>,
    ) -> Result<SummaryOutcome, SummarizeError> {
        let body = self.body(&request);
        let mut attempt = 1;
        loop {
            let mut started = false;
            let (result, hint) =
                retry_after::scoped(self.attempt(&body, &progress, &mut started)).await;
            // Scrubbed where it comes out: the retry log and the `retrying` event carry it.
            let result = result.map_err(|e| self.scrub(e));
            match result {
                Ok(outcome) => return Ok(outcome),
                Err(e) if !started && e.retryable() && attempt <= self.config.max_retries => {
                    let backoff = self
                        .config
                        .retry_base
                        .saturating_mul(1 << (attempt - 1).min(16))
                        .min(MAX_RETRY_DELAY);
                    // The server's own hint wins when it asks for longer; the deadline
                    // still bounds the whole compaction.
                    let delay = hint
                        .map_or(backoff, |h| h.max(backoff))
                        .min(MAX_HINTED_DELAY);
                    attempt += 1;
                    tracing::warn!(attempt, delay_ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX), error = %e, "compaction request failed; retrying");
                    let _ = progress
                        .send(Progress::Retrying {
                            attempt,
                            reason: e.to_string(),
                            delay,
                        })
                        .await;
                    tokio::time::sleep(delay).await;
                }
                Err(e) => return Err(e),
            }
        }
    }
}

#[tonic::async_trait]
impl Summarizer for OpenAiSummarizer {
    async fn summarize(
        &self,
        request: SummaryRequest,
        progress: mpsc::Sender<Progress>,
        cancel: CancellationToken,
    ) -> Result<SummaryOutcome, SummarizeError> {
        let started = Instant::now();
        let timeout = self.config.timeout;
        // Dropping the future drops the HTTP response, which closes the connection.
        let result = tokio::select! {
            _ = cancel.cancelled() => Err(SummarizeError::Cancelled),
            r = tokio::time::timeout(timeout, self.with_retries(request, progress)) => {
                r.unwrap_or_else(|_| {
                    tracing::warn!(elapsed_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX), "compaction timed out");
                    Err(SummarizeError::Timeout(timeout))
                })
            }
        };
        result.map_err(|e| self.scrub(e))
    }

    fn model(&self) -> &str {
        &self.config.model
    }

    fn context_tokens(&self) -> Option<u64> {
        self.config.context_tokens
    }
}

/// Maps a client error; `started` tells whether summary text had arrived.
fn request_error(e: OpenAIError, started: bool) -> SummarizeError {
    match e {
        OpenAIError::ApiError(r) if too_long(r.status_code.as_u16(), &r.api_error) => {
            SummarizeError::TooLong(r.api_error.message)
        }
        OpenAIError::ApiError(r) => {
            let status = r.status_code.as_u16();
            SummarizeError::Request {
                status: Some(status),
                message: format!("{status}: {}", r.api_error.message),
                retryable: status == 429 || status >= 500,
            }
        }
        OpenAIError::Reqwest(e) if started => SummarizeError::Broken(chain(e.without_url())),
        OpenAIError::Reqwest(e) => SummarizeError::Request {
            status: e.status().map(|s| s.as_u16()),
            retryable: e.is_connect()
                || e.is_timeout()
                || e.is_request()
                || e.status()
                    .is_some_and(|s| s.as_u16() == 429 || s.is_server_error()),
            message: chain(e.without_url()),
        },
        OpenAIError::StreamError(e) if started => SummarizeError::Broken(e.to_string()),
        OpenAIError::StreamError(e) => SummarizeError::Request {
            status: None,
            message: e.to_string(),
            retryable: true,
        },
        OpenAIError::JSONDeserialize(e, _) => SummarizeError::Malformed(e.to_string()),
        other => SummarizeError::Request {
            status: None,
            message: other.to_string(),
            retryable: false,
        },
    }
}

/// A refusal because the request does not fit the model's window (OpenAI's
/// `context_length_exceeded`, or the wording other servers use).
fn too_long(status: u16, e: &async_openai::error::ApiError) -> bool {
    let message = e.message.to_ascii_lowercase();
    (status == 400 || status == 413)
        && (e.code.as_deref() == Some("context_length_exceeded")
            || message.contains("context length")
            || message.contains("context window")
            || message.contains("too many tokens"))
}

/// An error with its causes ("error sending request: connection refused"), so the event
/// says what actually failed.
fn chain(e: impl std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        out.push_str(": ");
        out.push_str(&cause.to_string());
        source = cause.source();
    }
    out
}
