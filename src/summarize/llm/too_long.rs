//! "Too long" answers and what they teach. A refusal for length names the window and the
//! endpoint's count of the prompt in most servers' wording; an empty stream says nothing, so
//! compactd asks once more without streaming and for one token, which llama.cpp's Python
//! server (the one that answers with empty streams) refuses with those numbers at once,
//! before evaluating anything. Either way the summarizer learns the window (or one below
//! what was sent) and the ratio of the endpoint's tokens to its own count, and answers
//! [`SummarizeError::TooLong`]: the chunker then cuts the request smaller, and the same
//! request is never sent again. A probe that is answered shows the prompt fits: when the
//! prompt and the answer's room also fit the window the endpoint told (or a refusal named,
//! or the operator set), the empty stream was a stream that failed on the way, retried as
//! such, and teaches no window; with none known, it is how llama.cpp's servers refuse a
//! prompt that fits without the answer's room, and a guess below it is learned. A probe
//! that fails for a reason worth a retry (a 429, a 5xx) is that failure, retried after its
//! `Retry-After`, and teaches nothing either.
//!
//! Usage reports of answered requests teach the ratio too, and tell a prompt the endpoint
//! truncated to fit its window without saying so (Ollama), or an answer it stopped for
//! length short of its `max_tokens` because the window ran out (llama.cpp): "too long" as
//! well, teaching a guess. Stopped well within the window, the answer met an output cap of
//! the endpoint's own instead (llama.cpp's `-n`, a gateway's), which is learned.

use serde_json::Value;
use tokio::sync::mpsc;

use super::errors::{request_error, unanswered};
use super::{OpenAiSummarizer, log_learned};
use crate::domain::TokenUsage;
use crate::engine::SummaryOutcome;
use crate::summarize::bounded;
use crate::summarize::budget::{
    MESSAGES_PER_REQUEST, TEMPLATE_TOKENS_PER_MESSAGE, TEMPLATE_TOKENS_PER_REQUEST,
};
use crate::summarize::output_cap::{self, OutputCap};
use crate::summarize::retry_after::{self, Seen};
use crate::summarize::window::{self, Refusal, WindowSource};
use crate::summarize::{Progress, SummarizeError, SummaryRequest};

/// An answer with nothing in it: what it was, for the reason shown.
#[derive(Debug, Clone, Copy)]
pub(super) struct Silence {
    /// What came ("an empty stream").
    pub what: &'static str,
    /// The endpoint said it stopped for length (a finish for length before any text): a
    /// sign of length even when the prompt alone fits; an empty stream is none then.
    pub length: bool,
}

/// What the probe of a silent answer made of it.
#[derive(Debug)]
pub(super) enum Probed {
    /// "Too long": the chunker cuts the head smaller; never sent again as it was.
    TooLong(SummarizeError),
    /// The request failed as this error says (retried when it is worth it, as any
    /// attempt's failure), with what the HTTP layer saw of the probe (its `Retry-After`).
    Failed(SummarizeError, Seen),
}

/// Answer tokens short of the `max_tokens` asked that still read as a cut at
/// `max_tokens` (an endpoint may count the end of the answer apart).
const MAX_TOKENS_SLACK: u64 = 4;

/// An answer stopped for length ran out of the window known only if prompt and answer filled
/// it to within this part of it (1/16): a window that runs out is filled to its last token,
/// template and counting aside. One stopped farther below met an output cap of the
/// endpoint's own (llama.cpp's `-n`, a gateway's limit), which no smaller prompt avoids.
const RAN_OUT_MARGIN_DIVISOR: u64 = 16;

/// Whether a request failed before any response came (`errors::unanswered`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Unanswered(bool);

/// Requests compactd counted at fewer tokens than this teach no ratio: the chat template's
/// own tokens would weigh too much in the endpoint's count.
pub const MIN_OBSERVED_TOKENS: u64 = 1_000;

impl OpenAiSummarizer {
    /// Learns from a refusal for length (`why`, the endpoint's message) and returns the
    /// error the chunker acts on.
    pub(super) fn refused(
        &self,
        request: &SummaryRequest,
        body: &Value,
        why: String,
    ) -> SummarizeError {
        self.learn(request, body, window::refusal(&why));
        let why = self.scrub_text(why);
        tracing::info!(model = self.model_of(request.model.as_deref()), counted_tokens = request.counted_tokens, max_tokens = request.max_tokens, reason = %why, "compaction request refused for length; it will be cut smaller");
        SummarizeError::TooLong(why)
    }

    /// An answer with nothing in it (`what`; `length`: the endpoint said it stopped for
    /// length): asks the same messages once without streaming and for one token, and says
    /// what that answer makes of it. Only a refusal of the probe for length, or a stop for
    /// length whose prompt alone fits, is "too long" and teaches a window; an empty stream
    /// whose prompt fits is a stream that failed on the way, and a probe that failed for a
    /// reason worth a retry is that failure: both retried as such, teaching no window.
    /// `retried_fitting`: whether an empty stream whose prompt fits the known window was
    /// already retried once for this request (set when it is): a second one is "too long"
    /// after all, as the known window may be wrong (a configured 32k on an 8k server).
    pub(super) async fn silent(
        &self,
        request: &SummaryRequest,
        body: &Value,
        silence: Silence,
        progress: &mpsc::Sender<Progress>,
        retried_fitting: &mut bool,
    ) -> Probed {
        let what = silence.what;
        let mut probe = body.clone();
        probe["stream"] = Value::Bool(false);
        // One token, in the field the model takes (one that refused `max_tokens` takes
        // `max_completion_tokens`, OpenAI's reasoning models).
        let model = self.model_of(request.model.as_deref());
        let omit = self.windows.output_cap(&self.config.base_url, model) == Some(OutputCap::Omit);
        if let Some(fields) = probe.as_object_mut() {
            fields.remove("max_tokens");
        }
        let field = if omit {
            "max_completion_tokens"
        } else {
            "max_tokens"
        };
        probe[field] = Value::from(1);
        if let Some(fields) = probe.as_object_mut() {
            fields.remove("stream_options");
        }
        // Scoped as an attempt is: a 429/503's `Retry-After` is the retry loop's to honour.
        // Its answer is one JSON body parsed whole: bounded far below a stream's.
        let limit = bounded::PROBE_ANSWER_BYTES
            .saturating_add(serde_json::to_vec(&probe).map_or(0, |p| p.len()));
        let (mut asked, mut seen) = retry_after::scoped_within(limit, self.ask(&probe)).await;
        if matches!(&asked, Err((_, Unanswered(true)))) {
            // llama-cpp-python closes the connection its empty answer came on, and the
            // pooled connection may be taken before that is seen: the probe got no
            // response. Once more, on a new connection. Never after a response, whose
            // body broke or ran too long: the endpoint read the probe.
            (asked, seen) = retry_after::scoped_within(limit, self.ask(&probe)).await;
        }
        let asked = asked.map_err(|(e, _)| e);
        // What the HTTP layer cut short says more than the error async-openai made of it.
        let asked = match (asked, seen.cut.take()) {
            (Err(_), Some(cut)) => Err(SummarizeError::Request {
                status: None,
                message: cut,
                retryable: false,
            }),
            (asked, _) => asked,
        };
        let why = match asked {
            Err(SummarizeError::TooLong(message)) => {
                // The probe itself was refused: it asked for one token.
                self.learn(request, &probe, window::refusal(&message));
                format!("{what}; asked again without streaming, it refused: {message}")
            }
            Err(e) if e.retryable() => {
                // Nothing said of length: the request failed as the probe did.
                let e = e.map_text(|m| format!("{what}; asked again without streaming: {m}"));
                return Probed::Failed(e, seen);
            }
            Err(e) => {
                // Unexplained: cut smaller, as for "too long", but nothing learned.
                format!("{what} (asked again without streaming: {e})")
            }
            Ok(answer) if !answer["choices"].is_array() => {
                // A 200 that is no completion (a gateway's `{"error": …}` for an outage or
                // a spent balance): the endpoint's own words, nothing of a window. Learning
                // one from it would outlive the outage.
                let said = answer["error"]["message"]
                    .as_str()
                    .or_else(|| answer["error"].as_str())
                    .or_else(|| answer["message"].as_str())
                    .unwrap_or("no `choices` in its answer");
                let e = SummarizeError::Request {
                    status: None,
                    message: format!(
                        "{what}; asked again without streaming, the endpoint answered with no completion: {said}"
                    ),
                    retryable: false,
                };
                return Probed::Failed(e, seen);
            }
            Ok(answer) => {
                // The probe read the whole prompt: paid for.
                let usage = &answer["usage"];
                let spent = usage["prompt_tokens"].as_u64().map(|input| TokenUsage {
                    input,
                    output: usage["completion_tokens"].as_u64().unwrap_or(0),
                    total: usage["total_tokens"].as_u64(),
                    ..Default::default()
                });
                self.void(progress, spent).await;
                let prompt_tokens = answer["usage"]["prompt_tokens"].as_u64();
                if !silence.length
                    && !*retried_fitting
                    && self.fits_what_is_known(request, body, prompt_tokens)
                {
                    *retried_fitting = true;
                    // Nothing said "length", and the prompt with the answer's room fits the
                    // window the endpoint told (or a refusal named, or the operator set):
                    // the empty stream failed on the way. Only the ratio is learned. (With
                    // no such window, an empty stream whose probe is answered is how
                    // llama.cpp's servers refuse a prompt that fits without the answer's
                    // room: a guess below it is learned, as below.)
                    if let (Some(counted), Some(prompt)) = (request.counted_tokens, prompt_tokens) {
                        self.ratio_from(request, counted, prompt);
                    }
                    let e = SummarizeError::Request {
                        status: None,
                        message: format!(
                            "{what}, though the prompt fits (asked again without streaming, \
                             it was answered)"
                        ),
                        retryable: true,
                    };
                    return Probed::Failed(e, Seen::default());
                }
                // Stopped for length, though the prompt fits without the answer's room: a
                // window below prompt plus answer, when an answer was asked for (a guess);
                // the ratio either way.
                if sent_max_tokens(body).is_some() {
                    self.learn(
                        request,
                        body,
                        Refusal {
                            window: None,
                            prompt_tokens,
                            ceiling: None,
                        },
                    );
                } else if let (Some(counted), Some(prompt)) =
                    (request.counted_tokens, prompt_tokens)
                {
                    self.ratio_from(request, counted, prompt);
                }
                format!("{what}, though the prompt alone fits (asked again without streaming)")
            }
        };
        let why = self.scrub_text(why);
        tracing::warn!(model = self.model_of(request.model.as_deref()), counted_tokens = request.counted_tokens, max_tokens = request.max_tokens, reason = %why, "compaction request answered with nothing; it will be cut smaller");
        Probed::TooLong(SummarizeError::TooLong(why))
    }

    /// An answer to a prompt the endpoint read under half of: it dropped what did not fit
    /// its window (Ollama drops the messages between the first and the last, the
    /// transcript) and answered the rest, so the summary would hide a conversation the
    /// model never read. Learns a window below what it read and returns the "too long"
    /// the chunker cuts the head smaller on. No endpoint's tokenizer counts a text at
    /// half of compactd's (`window::RATIO_BOUNDS`).
    pub(super) fn truncated(
        &self,
        request: &SummaryRequest,
        body: &Value,
        outcome: &SummaryOutcome,
    ) -> Option<SummarizeError> {
        let counted = request.counted_tokens?;
        let reported = outcome.usage?.input;
        let read = without_template(reported);
        if counted < MIN_OBSERVED_TOKENS || read == 0 || read.saturating_mul(2) >= counted {
            return None;
        }
        let why = format!(
            "the endpoint read {read} tokens of a prompt compactd counts at {counted}: it cut \
             the conversation to fit its window"
        );
        self.learn(
            request,
            body,
            Refusal {
                window: None,
                prompt_tokens: Some(reported),
                ceiling: None,
            },
        );
        tracing::warn!(model = self.model_of(request.model.as_deref()), counted_tokens = counted, max_tokens = request.max_tokens, reason = %why, "compaction request truncated by the endpoint; its answer is dropped and the head cut smaller");
        Some(SummarizeError::TooLong(why))
    }

    /// An answer the endpoint stopped for length (`cut`) well before the `max_tokens` asked,
    /// or with none asked.
    /// When prompt and answer filled the window known (to within
    /// [`RAN_OUT_MARGIN_DIVISOR`]), or the endpoint told none, the window ran out, the prompt counting
    /// more to it than compactd planned for (llama.cpp's server answers until prompt and
    /// answer fill the window): the summary is cut mid-way, so it is dropped, the chunker
    /// cuts the head smaller, and what they filled is learned as a guess (forgotten after
    /// `window::SHRUNK_ANSWERS` answers, never over a configured window: the cut may have
    /// been an output cap after all). Well within a window the endpoint told (`/props`, a
    /// refusal naming it), the endpoint capped the answer itself
    /// (llama.cpp's `-n`, a gateway's limit): the answer stays a summary, as one cut at
    /// `max_tokens` does, and later requests ask within that cap. So too, whatever the
    /// window, when the answer stops at the same length as the last one cut after a prompt
    /// of another size (`Windows::cut_again`): a window running out would have left the
    /// smaller prompt a longer answer.
    pub(super) fn ran_out(
        &self,
        request: &SummaryRequest,
        body: &Value,
        outcome: &SummaryOutcome,
        cut: bool,
    ) -> Option<SummarizeError> {
        // With no `max_tokens` sent (the window unknown, or the model's cap learned as
        // one to omit), a stop for length is never the answer reaching what was asked.
        let asked = sent_max_tokens(body);
        let usage = outcome.usage?;
        if !cut || usage.input == 0 || usage.output == 0 {
            return None;
        }
        if asked.is_some_and(|asked| usage.output.saturating_add(MAX_TOKENS_SLACK) >= asked) {
            return None;
        }
        let filled = usage.input.saturating_add(usage.output);
        let model = self.model_of(request.model.as_deref());
        let base = &self.config.base_url;
        let known = self.windows.get(base, model);
        // Only a window the endpoint told for one request (its `/props`, or a refusal
        // naming it) says the stop was not the window: a configured one may be the whole
        // server's (`--parallel` slots share it), a listed one a gateway's figure, and a
        // cut summary taken for an output cap would be committed.
        let within = known.is_some_and(|w| {
            matches!(w.source, WindowSource::Props | WindowSource::Refusal)
                && filled < w.tokens.saturating_sub(w.tokens / RAN_OUT_MARGIN_DIVISOR)
        });
        // Or, whatever the window, the answer stopped at the same length as the last one
        // cut, after a prompt of another size: the endpoint's output cap (a gateway's
        // default), which cutting the head smaller can never get under.
        let capped = within
            || self
                .windows
                .cut_again(base, model, (usage.input, usage.output), MAX_TOKENS_SLACK);
        if capped && usage.output >= output_cap::MIN_CAP {
            self.windows
                .cap_output(base, model, OutputCap::At(usage.output));
            tracing::info!(
                model,
                answer_tokens = usage.output,
                max_tokens = asked,
                window = known.map(|w| w.tokens),
                "the endpoint stopped the summary for length within its window, or twice at the same length: an output cap of its own, asked within from now on"
            );
            return None;
        }
        let of_asked = match asked {
            Some(asked) => format!("of the {asked} asked"),
            None => "with no max_tokens sent".to_string(),
        };
        let why = format!(
            "the endpoint stopped for length after {} answer tokens {of_asked}: \
             its window ran out at {filled} tokens ({} of them the prompt)",
            usage.output, usage.input
        );
        self.learn(
            request,
            body,
            Refusal {
                window: None,
                prompt_tokens: Some(usage.input),
                ceiling: Some(filled),
            },
        );
        tracing::warn!(model = self.model_of(request.model.as_deref()), counted_tokens = request.counted_tokens, max_tokens = asked, reason = %why, "compaction answer cut by the endpoint's window; it is dropped and the head cut smaller");
        Some(SummarizeError::TooLong(why))
    }

    /// Whether a request the endpoint counted at `prompt_tokens` (its probe's report),
    /// with the answer's room `body` asked for, fits the window known for it from the
    /// endpoint's or the operator's word (not a guess).
    fn fits_what_is_known(
        &self,
        request: &SummaryRequest,
        body: &Value,
        prompt_tokens: Option<u64>,
    ) -> bool {
        let model = self.model_of(request.model.as_deref());
        let Some(known) = self.windows.get(&self.config.base_url, model) else {
            return false;
        };
        let Some(prompt) = prompt_tokens else {
            return false;
        };
        known.source != window::WindowSource::Shrunk
            && prompt.saturating_add(sent_max_tokens(body).unwrap_or(0)) <= known.tokens
    }

    /// One request that is not streamed; errors mapped, as they came (the caller reads
    /// them, then scrubs what it shows), with whether it got no response at all.
    async fn ask(&self, body: &Value) -> Result<Value, (SummarizeError, Unanswered)> {
        self.client
            .chat()
            .create_byot::<&Value, Value>(body)
            .await
            .map_err(|e| {
                let never = Unanswered(unanswered(&e));
                (request_error(e, false), never)
            })
    }

    /// Learns the ratio from an answered request's usage report, and counts the answer
    /// towards forgetting a guessed window (`window::SHRUNK_ANSWERS`).
    pub(super) fn observe(&self, request: &SummaryRequest, outcome: &SummaryOutcome) {
        let model = self.model_of(request.model.as_deref());
        let base = &self.config.base_url;
        let before = self.windows.get(base, model);
        self.windows.answered(base, model);
        log_learned(base, model, before, self.windows.get(base, model));
        if let (Some(counted), Some(usage)) = (request.counted_tokens, outcome.usage) {
            self.ratio_from(request, counted, usage.input);
        }
    }

    fn ratio_from(&self, request: &SummaryRequest, counted: u64, endpoint: u64) {
        if counted < MIN_OBSERVED_TOKENS {
            return;
        }
        let model = self.model_of(request.model.as_deref());
        let base = &self.config.base_url;
        let before = self.windows.get(base, model);
        self.windows
            .observed(base, model, counted, without_template(endpoint));
        log_learned(base, model, before, self.windows.get(base, model));
    }

    /// Learns from a refusal of `request`, sent as `body` (its answer's room is what the
    /// body asked for, within the output cap, not what the chunker wanted).
    fn learn(&self, request: &SummaryRequest, body: &Value, mut refusal: Refusal) {
        let model = self.model_of(request.model.as_deref());
        let base = &self.config.base_url;
        let counted = request.counted_tokens.unwrap_or(0);
        if counted < MIN_OBSERVED_TOKENS {
            // Too small to say anything about the tokenizer.
            refusal.prompt_tokens = None;
        }
        refusal.prompt_tokens = refusal.prompt_tokens.map(without_template);
        let before = self.windows.get(base, model);
        let after = self
            .windows
            .refused(base, model, refusal, counted, sent_max_tokens(body));
        log_learned(base, model, before, after);
    }
}

/// The answer's room a request body asked for (`max_tokens`, or `max_completion_tokens`,
/// which the probe of a model that refused the first sends; none when it asked for none).
fn sent_max_tokens(body: &Value) -> Option<u64> {
    body["max_tokens"]
        .as_u64()
        .or_else(|| body["max_completion_tokens"].as_u64())
}

/// The endpoint's count of a prompt less what its chat template adds, so the ratio compares
/// text with text.
fn without_template(endpoint: u64) -> u64 {
    endpoint
        .saturating_sub(TEMPLATE_TOKENS_PER_MESSAGE.saturating_mul(MESSAGES_PER_REQUEST))
        .saturating_sub(TEMPLATE_TOKENS_PER_REQUEST)
}
