//! [`OpenAiSummarizer`]: streaming chat completions through async-openai against any
//! OpenAI-compatible base URL, with retries (429, 5xx, connection errors) before the first
//! token (waiting as long as a 429/503's `Retry-After` asks), a deadline for the whole
//! summary, and cancellation that drops the HTTP request.
//!
//! Responses are read as raw JSON (async-openai's "bring your own types") so servers that
//! omit optional fields still work; a stream counts as complete only when a choice reports
//! a `finish_reason`. A refusal for length, and a stream with no answer at all whose
//! one-token probe says so, are "too long" (`too_long.rs`): never retried as they were,
//! they teach the window instead (an empty stream whose probe fails for a reason worth a
//! retry, or is answered while prompt and answer fit a window the endpoint or the
//! operator gave, is retried as any failed attempt).
//! Client errors are mapped in `errors.rs`. One request may bring only so much text
//! ([`summary_cap`]); past it compactd stops reading and fails the request.

#[cfg(test)]
mod bounds_tests;
mod errors;
mod finish;
#[cfg(test)]
mod refusals_tests;
mod too_long;

use std::time::{Duration, Instant};

use async_openai::Client;
use async_openai::config::OpenAIConfig;
use futures::StreamExt;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::output_cap::{self, OutputCap};
use super::window::{Window, WindowSource, Windows};
use super::{
    LlmConfig, Progress, SummarizeError, Summarizer, SummaryRequest, discover, retry_after,
};
use crate::config::redact;
use crate::domain::{ModelRef, TokenUsage};
use crate::engine::SummaryOutcome;
use errors::{request_error, stream_error};
use finish::{Finish, stopped};
use too_long::{Probed, Silence};

/// Longest wait between retries.
const MAX_RETRY_DELAY: Duration = Duration::from_secs(8);

/// Longest wait compactd accepts from a server's `Retry-After`.
const MAX_HINTED_DELAY: Duration = Duration::from_secs(60);

/// Summary text one request may bring per token it asked for (`max_tokens`). A token is
/// about 4 bytes of English (3 of CJK), and rarely over 16 even in code's runs of spaces; 32
/// leaves room for a server that counts loosely, and an answer past it is not the one asked
/// for.
const SUMMARY_BYTES_PER_TOKEN: usize = 32;

/// The least a request may bring, however few tokens it asked for: some servers ignore
/// `max_tokens`, and 64 KiB costs nothing.
const MIN_SUMMARY_BYTES: usize = 64 * 1024;

/// The most a request may bring, whatever it asked for (and when it asked for no limit, the
/// window being unknown): about a million tokens, eight times the longest answer any model
/// writes today (128k tokens, about 512 KiB), and as much as a client decodes of a whole
/// `GetContext` under gRPC's default 4 MiB message limit.
const MAX_SUMMARY_BYTES: usize = 4 * 1024 * 1024;

/// Summarizer for OpenAI-compatible chat-completions endpoints.
pub struct OpenAiSummarizer {
    client: Client<OpenAIConfig>,
    /// For the window discovery requests (`GET /props`, `GET /models`), which async-openai
    /// does not make.
    http: reqwest::Client,
    config: LlmConfig,
    /// What is known of each model's window at this endpoint.
    windows: Windows,
    /// The API key and the base URL's credentials ([`redact::url_secrets`]), longest
    /// first: removed from every text an endpoint's words reach.
    secrets: Vec<String>,
}

/// Written by hand so no dependency's `Debug` can ever print the key.
impl std::fmt::Debug for OpenAiSummarizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OpenAiSummarizer")
            .field("base_url", &redact::url(&self.config.base_url))
            .field("model", &self.config.model)
            .field(
                "api_key",
                &self.config.api_key.as_ref().map(|_| "[redacted]"),
            )
            .finish()
    }
}

/// Hands the deltas in `unsent` on as one, when the caller has room for it; else keeps
/// them for the next. The stream is read on meanwhile: waiting for a slow caller would
/// leave async-openai's reader task queueing what the endpoint sends, parsed, without
/// bound. A closed receiver means the caller stopped listening; the summary can still be
/// committed.
fn hand_on(progress: &mpsc::Sender<Progress>, unsent: &mut String) {
    let handed = progress.try_send(Progress::Delta(std::mem::take(unsent)));
    if let Err(mpsc::error::TrySendError::Full(Progress::Delta(back))) = handed {
        *unsent = back;
    }
}

/// How one attempt failed.
enum Failed {
    /// As the caller sees it.
    Error(SummarizeError),
    /// HTTP 200 with no answer: no content and no finish reason, or a finish for length
    /// with no content. llama.cpp's Python server answers a prompt longer than its context
    /// with an empty stream.
    Silent(Silence),
}

impl From<SummarizeError> for Failed {
    fn from(e: SummarizeError) -> Self {
        Failed::Error(e)
    }
}

impl OpenAiSummarizer {
    /// A summarizer for `config`.
    pub fn new(config: LlmConfig) -> OpenAiSummarizer {
        // Without a key, async-openai sends an empty bearer (`Bearer `), which servers run
        // without keys ignore. Its own environment variables (OPENAI_API_KEY,
        // OPENAI_ORG_ID, OPENAI_PROJECT_ID) are not compactd's settings: none is sent to
        // the endpoint configured here (and a value that is no header value would panic
        // every request).
        let oc = OpenAIConfig::new()
            .with_api_base(config.base_url.trim_end_matches('/'))
            .with_api_key(config.api_key.as_ref().map_or("", |k| k.expose()))
            .with_org_id("")
            .with_project_id("");
        let client = retry_after::client(oc);
        OpenAiSummarizer {
            client,
            http: reqwest::Client::new(),
            windows: Windows::new(config.context_tokens),
            secrets: secrets(&config),
            config,
        }
    }

    /// The model a request names (its own, or the configured one).
    fn model_of<'a>(&'a self, request_model: Option<&'a str>) -> &'a str {
        request_model.unwrap_or(&self.config.model)
    }

    /// The one place an error's text is made fit to show: some providers echo the key in
    /// error text (it never leaves this type), and an endpoint's error text may be any size
    /// (cut to [`errors::MAX_MESSAGE_BYTES`], after the key is redacted so no cut can leave
    /// part of it behind).
    fn scrub(&self, e: SummarizeError) -> SummarizeError {
        e.map_text(|m| self.scrub_text(m))
    }

    /// [`Self::scrub`] for one text: the key and the base URL's credentials removed (in
    /// every form, the longest first), then cut to size. What is parsed of an endpoint's
    /// words (a refusal's numbers) is read before this, on the text as it came.
    fn scrub_text(&self, m: String) -> String {
        let mut m = m;
        for secret in &self.secrets {
            m = redact::text(&m, secret);
        }
        errors::bounded(m)
    }

    fn body(&self, request: &SummaryRequest) -> Value {
        let mut body = json!({
            "model": self.model_of(request.model.as_deref()),
            "messages": request.messages,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        // Sized by the chunker so prompt and answer fit a known window, within the cap a
        // refusal of the field taught (`output_cap.rs`).
        let model = self.model_of(request.model.as_deref());
        let cap = self.windows.output_cap(&self.config.base_url, model);
        let max_tokens = match (request.max_tokens, cap) {
            (Some(wanted), Some(cap)) => cap.apply(wanted),
            (wanted, None) => wanted,
            (None, Some(_)) => None,
        };
        if let Some(max_tokens) = max_tokens {
            body["max_tokens"] = json!(max_tokens);
        }
        body
    }

    /// The cap a 400 (`message`, after its status) of `body` teaches when it refuses the
    /// `max_tokens` asked.
    fn output_refused(&self, body: &Value, message: &str) -> Option<OutputCap> {
        let sent = body["max_tokens"].as_u64()?;
        output_cap::refusal(message.strip_prefix("400: ").unwrap_or(message), sent)
    }

    /// One attempt: open the stream, forward deltas, collect text, usage and finish reason
    /// (true: it finished for length, the answer cut). Text past [`summary_cap`] fails the
    /// attempt; returning drops the stream, which closes the connection, so nothing more
    /// is read.
    async fn attempt(
        &self,
        body: &Value,
        progress: &mpsc::Sender<Progress>,
        started: &mut bool,
    ) -> Result<(SummaryOutcome, bool), Failed> {
        let max_tokens = body["max_tokens"].as_u64();
        let cap = summary_cap(max_tokens);
        let mut stream = self
            .client
            .chat()
            .create_stream_byot::<&Value, Value>(body)
            .await
            .map_err(|e| request_error(e, false))?;
        let mut text = String::new();
        // Deltas a slow caller has not taken yet, joined (never more than `text`).
        let mut unsent = String::new();
        let mut usage = None;
        let mut finished = None;
        // A reasoning model's thinking arrives apart from the content (llama.cpp, vLLM and
        // DeepSeek: `reasoning_content`; OpenRouter: `reasoning`).
        let mut reasoned = false;
        while let Some(item) = stream.next().await {
            let chunk = item.map_err(|e| request_error(e, *started))?;
            if let Some(u) = chunk.get("usage").filter(|u| u.is_object()) {
                usage = Some(TokenUsage {
                    input: u["prompt_tokens"].as_u64().unwrap_or(0),
                    output: u["completion_tokens"].as_u64().unwrap_or(0),
                    total: u["total_tokens"].as_u64(),
                    ..Default::default()
                });
            }
            // A stream that fails says so in a chunk of its own (OpenAI, vLLM, SGLang).
            if let Some(error) = chunk.get("error").filter(|e| e.is_object()) {
                return Err(stream_error(error, *started).into());
            }
            let Some(choices) = chunk.get("choices").and_then(Value::as_array) else {
                return Err(SummarizeError::Malformed("a chunk without `choices`".into()).into());
            };
            for choice in choices {
                reasoned = reasoned
                    || ["reasoning_content", "reasoning"]
                        .iter()
                        .any(|k| choice["delta"][*k].as_str().is_some_and(|r| !r.is_empty()));
                if let Some(delta) = choice["delta"]["content"]
                    .as_str()
                    .filter(|d| !d.is_empty())
                {
                    *started = true;
                    if text.len().saturating_add(delta.len()) > cap {
                        return Err(overlong(cap, max_tokens).into());
                    }
                    text.push_str(delta);
                    unsent.push_str(delta);
                    hand_on(progress, &mut unsent);
                }
                if let Some(reason) = choice["finish_reason"].as_str() {
                    finished = Some(Finish::of(reason));
                }
            }
        }
        let cut = finished == Some(Finish::Length);
        let failure = match finished {
            // Thinking, then the stream ended unfinished (a gateway's cut): the prompt was
            // read, so this is a stream failed on the way, no empty answer to probe.
            // Its usage says it thought its whole `max_tokens` away (a gateway that drops
            // the finish reason at the limit): the advice of a `length` finish, no retry.
            None if !*started
                && reasoned
                && usage
                    .zip(max_tokens)
                    .is_some_and(|(u, m)| m > 0 && u.output >= m) =>
            {
                Some(reasoned_away(max_tokens).into())
            }
            None if !*started && reasoned => Some(Failed::from(SummarizeError::Request {
                status: None,
                message: "the stream ended while the model was still reasoning, before the \
                          summary"
                    .into(),
                retryable: true,
            })),
            None if !*started => Some(Failed::Silent(Silence {
                what: "the endpoint answered with an empty stream",
                length: false,
            })),
            // The model wrote tokens, all of them thinking: the prompt fit, so this is no
            // "too long" to learn a window from or to cut the head for.
            Some(Finish::Length)
                if !*started
                    && (reasoned
                        || usage
                            .zip(max_tokens)
                            .is_some_and(|(u, m)| m > 0 && u.output >= m)) =>
            {
                Some(reasoned_away(max_tokens).into())
            }
            Some(Finish::Length) if !*started => Some(Failed::Silent(Silence {
                what: "the endpoint stopped for length before writing anything",
                length: true,
            })),
            None => Some(
                SummarizeError::Broken("the stream ended before the model finished".into()).into(),
            ),
            Some(Finish::Stopped(reason)) => Some(stopped(&reason, *started).into()),
            Some(Finish::Filtered) => Some(Failed::from(SummarizeError::Request {
                status: None,
                message: "the endpoint's content filter stopped the summary (finish_reason \"content_filter\")".into(),
                retryable: false,
            })),
            Some(Finish::Done | Finish::Length) => None,
        };
        if let Some(failure) = failure {
            // Answered and dropped: what it cost is reported all the same.
            self.void(progress, usage).await;
            return Err(failure);
        }
        if !unsent.is_empty() {
            let _ = progress.send(Progress::Delta(unsent)).await;
        }
        let outcome = SummaryOutcome {
            text,
            usage,
            cost: self.cost(usage),
            model: Some(ModelRef {
                provider_id: "openai-compatible".into(),
                model_id: body["model"].as_str().unwrap_or_default().to_string(),
            }),
        };
        Ok((outcome, cut))
    }

    /// What `usage` cost at the configured prices.
    fn cost(&self, usage: Option<TokenUsage>) -> f64 {
        let (pin, pout) = self.config.price_per_mtok;
        usage.map_or(0.0, |u| {
            (u.input as f64 * pin + u.output as f64 * pout) / 1e6
        })
    }

    /// Reports an answer paid for and dropped (its `usage`, if the endpoint told it), so
    /// that what the compaction says it cost includes it.
    pub(super) async fn void(&self, progress: &mpsc::Sender<Progress>, usage: Option<TokenUsage>) {
        if usage.is_none() {
            return;
        }
        let spent = SummaryOutcome {
            text: String::new(),
            usage,
            cost: self.cost(usage),
            model: None,
        };
        let _ = progress.send(Progress::Voided(spent)).await;
    }

    async fn with_retries(
        &self,
        request: SummaryRequest,
        progress: mpsc::Sender<Progress>,
        deadline: Option<Instant>,
    ) -> Result<SummaryOutcome, SummarizeError> {
        let mut body = self.body(&request);
        let mut attempt: u32 = 1;
        let mut capped = false;
        let mut retried_fitting = false;
        loop {
            let mut started = false;
            let (result, mut seen) =
                retry_after::scoped(self.attempt(&body, &progress, &mut started)).await;
            let e = match result {
                Ok((outcome, cut)) => {
                    let too_long = self
                        .truncated(&request, &body, &outcome)
                        .or_else(|| self.ran_out(&request, &body, &outcome, cut));
                    if let Some(too_long) = too_long {
                        // Paid for all the same.
                        self.void(&progress, outcome.usage).await;
                        // Its deltas went out already: say they are void.
                        let _ = progress
                            .send(Progress::Retrying {
                                attempt: attempt.saturating_add(1),
                                reason: too_long.to_string(),
                                delay: Duration::ZERO,
                            })
                            .await;
                        return Err(too_long);
                    }
                    self.observe(&request, &outcome);
                    return Ok(outcome);
                }
                // The HTTP layer cut the answer short; what async-openai made of the cut
                // says less. The same request would be answered the same way.
                Err(_) if seen.cut.is_some() => {
                    return Err(SummarizeError::Request {
                        status: None,
                        message: seen.cut.unwrap_or_default(),
                        retryable: false,
                    });
                }
                // Asked again for one token: "too long", or a failure of the request (its
                // probe's), retried as any other.
                Err(Failed::Silent(silence)) => {
                    let silent =
                        self.silent(&request, &body, silence, &progress, &mut retried_fitting);
                    match silent.await {
                        Probed::TooLong(e) => return Err(e),
                        Probed::Failed(e, probed) => {
                            seen = probed;
                            e
                        }
                    }
                }
                // Read as it came (a refusal's numbers), scrubbed where it comes out: the
                // logs, the `retrying` event, the failure.
                Err(Failed::Error(e)) => e,
            };
            match e {
                // Sending the same request again would be refused again: the chunker cuts
                // it smaller instead.
                SummarizeError::TooLong(why) => return Err(self.refused(&request, &body, why)),
                // `max_tokens` past the model's output cap, or a field the model does not
                // take: sent again at once within what the refusal taught (once; it is
                // another request, not the same one again).
                SummarizeError::Request {
                    status: Some(400),
                    ref message,
                    ..
                } if !capped && let Some(cap) = self.output_refused(&body, message) => {
                    capped = true;
                    let model = self.model_of(request.model.as_deref());
                    self.windows.cap_output(&self.config.base_url, model, cap);
                    let within = self.body(&request);
                    if within == body {
                        // Nothing kept (past `window::MAX_KNOWN` models): the same
                        // request would be refused the same way.
                        return Err(e);
                    }
                    let reason = self.scrub_text(message.clone());
                    tracing::warn!(model, ?cap, %reason, "the endpoint refused max_tokens; asking again within what it allows");
                    body = within;
                }
                e if !started && e.retryable() && attempt <= self.config.max_retries => {
                    let e = self.scrub(e);
                    let backoff = self
                        .config
                        .retry_base
                        .saturating_mul(1 << (attempt - 1).min(16))
                        .min(MAX_RETRY_DELAY);
                    // The server's own hint wins when it asks for longer; the deadline
                    // still bounds the whole compaction.
                    let delay = seen
                        .hint
                        .map_or(backoff, |h| h.max(backoff))
                        .min(MAX_HINTED_DELAY);
                    // A wait that would outlast the compaction's deadline fails now, with
                    // the endpoint's reason (a 429's), not later as a timeout.
                    if deadline.is_some_and(|d| Instant::now() + delay >= d) {
                        tracing::warn!(delay_ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX), error = %e, "compaction request failed; its retry would wait past the deadline");
                        return Err(e.map_text(|m| {
                            format!("{m} (not retried: the wait asked, {:.1} s, is past the request's deadline, --llm-timeout-secs)", delay.as_secs_f64())
                        }));
                    }
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
                e => return Err(e),
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
            r = tokio::time::timeout(timeout, self.with_retries(request, progress, started.checked_add(timeout))) => {
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

    async fn window(&self, model: Option<&str>) -> Option<Window> {
        let model = self.model_of(model);
        let base = &self.config.base_url;
        if self.windows.should_ask(base, model) {
            let key = self.config.api_key.as_ref();
            let told = match discover::ask(&self.http, base, model, key).await {
                discover::Answer::Told(tokens, source) => Some((tokens, source)),
                discover::Answer::Silent => None,
                // Asked again before the next compaction.
                discover::Answer::Unreachable => return self.windows.get(base, model),
            };
            self.windows.told(base, model, told);
            match told {
                Some((tokens, source)) => {
                    tracing::info!(endpoint = %redact::url(base), model, window = tokens, source = source.as_str(), "the compaction model's window, as the endpoint tells it");
                }
                None => {
                    tracing::info!(endpoint = %redact::url(base), model, "the endpoint does not tell the compaction model's window; compactd learns it from the first refusal");
                }
            }
        }
        self.windows.get(base, model)
    }
}

/// The secrets an endpoint may echo: the key and the base URL's credentials, the longest
/// first (removing a shorter one first could break a longer one's encoded form).
fn secrets(config: &LlmConfig) -> Vec<String> {
    let mut secrets = redact::url_secrets(&config.base_url);
    if let Some(key) = config
        .api_key
        .as_ref()
        .map(|k| k.expose())
        .filter(|k| !k.is_empty())
    {
        secrets.push(key.to_string());
    }
    secrets.sort_by_key(|s| std::cmp::Reverse(s.len()));
    secrets.dedup();
    secrets
}

/// The most summary text a request asking for `max_tokens` may bring: per token asked
/// for, within [`MIN_SUMMARY_BYTES`]..=[`MAX_SUMMARY_BYTES`]; the ceiling when it asked for
/// no limit.
fn summary_cap(max_tokens: Option<u64>) -> usize {
    max_tokens.map_or(MAX_SUMMARY_BYTES, |tokens| {
        usize::try_from(tokens)
            .unwrap_or(usize::MAX)
            .saturating_mul(SUMMARY_BYTES_PER_TOKEN)
            .clamp(MIN_SUMMARY_BYTES, MAX_SUMMARY_BYTES)
    })
}

/// The failure of a request whose summary ran past `cap`: not retryable, as the same
/// request would likely ramble the same way, and not "too long" (the prompt fit; cutting
/// it smaller would not help).
fn overlong(cap: usize, max_tokens: Option<u64>) -> SummarizeError {
    let asked = match max_tokens {
        Some(tokens) => format!("more than the {tokens} tokens asked for can hold"),
        None => "the most compactd reads of one summary".to_string(),
    };
    SummarizeError::Request {
        status: None,
        message: format!("the summary exceeded {cap} bytes, {asked}; compactd stopped reading it"),
        retryable: false,
    }
}

/// The failure of a request whose model spent every output token it was given reasoning:
/// not retried (it would likely think as long again) and not "too long" (the prompt fit).
fn reasoned_away(max_tokens: Option<u64>) -> SummarizeError {
    let given = max_tokens.map_or_else(
        || "the output tokens".to_string(),
        |m| format!("all {m} output tokens"),
    );
    SummarizeError::Request {
        status: None,
        message: format!(
            "the model spent {given} it was given reasoning and wrote no summary (its prompt fit); \
             a larger window (--llm-context-tokens) leaves it more room, or use a compaction model that does not reason"
        ),
        retryable: false,
    }
}

/// Says what was learned, once per change.
fn log_learned(base: &str, model: &str, before: Option<Window>, after: Option<Window>) {
    let Some(after) = after else { return };
    if before.map(|b| (b.tokens, b.ratio)) == Some((after.tokens, after.ratio)) {
        return;
    }
    if after.source == WindowSource::Configured {
        tracing::info!(endpoint = %redact::url(base), model, ratio = after.ratio, "the endpoint counts more tokens than compactd; the configured window stays");
        return;
    }
    tracing::info!(endpoint = %redact::url(base), model, window = after.tokens, source = after.source.as_str(), ratio = after.ratio, "learned the compaction model's window");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_summary_cap_follows_max_tokens_within_its_bounds() {
        assert_eq!(summary_cap(None), MAX_SUMMARY_BYTES);
        assert_eq!(summary_cap(Some(1)), MIN_SUMMARY_BYTES);
        assert_eq!(summary_cap(Some(8_192)), 8_192 * SUMMARY_BYTES_PER_TOKEN);
        assert_eq!(summary_cap(Some(1_000_000)), MAX_SUMMARY_BYTES);
        assert_eq!(summary_cap(Some(u64::MAX)), MAX_SUMMARY_BYTES);
    }
}
