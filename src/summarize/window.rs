//! The compaction model's context window, per endpoint and model: what the operator said
//! (`--llm-context-tokens`, which always wins), what the endpoint tells when asked
//! (`discover.rs`: llama.cpp's `/props`, `/v1/models`), and what its refusals for length
//! teach. [`Windows`] keeps it for the process's life: one small map behind a mutex in the
//! summarizer. A window compactd only guessed (below what a signal without numbers
//! refused, [`WindowSource::Shrunk`]) is kept for [`SHRUNK_ANSWERS`] answered requests,
//! then tested again.
//!
//! Also kept per endpoint and model: how many of the endpoint's tokens one token compactd
//! counts is (the ratio), learned from the endpoint's own numbers (a refusal, a usage
//! report), since a local model's tokenizer may cut the same text much finer than o200k.
//!
//! No I/O here: the parsers read what the endpoint sent; the requests are in `discover.rs`
//! and `llm.rs`.

use std::collections::HashMap;
use std::sync::Mutex;

use serde_json::Value;

use super::output_cap::OutputCap;

/// Smallest window figure believed: a server reporting less is misreporting (no chat model
/// worth compacting with holds fewer tokens).
pub const MIN_PLAUSIBLE_WINDOW: u64 = 256;
/// Largest window figure believed (the largest windows offered are a few million tokens).
pub const MAX_PLAUSIBLE_WINDOW: u64 = 100_000_000;
/// A window lowered by a signal without numbers (an empty stream, a bare refusal) never
/// goes below this: one odd answer to a short request must not leave every later
/// compaction with no room (the chunk budget still halves per refusal).
pub const MIN_SHRUNK_WINDOW: u64 = 2_048;
/// Requests answered while a guessed window ([`WindowSource::Shrunk`]) is kept, after which
/// it is forgotten and what was known before it (the window the endpoint told or a refusal
/// named, or none) sizes the requests again. A guess is no word of the endpoint's: the
/// answers under it say nothing of a larger window, so it is tested again every so often.
/// When it was right, the first request sized past it is refused once more and the window
/// is learned again, at the cost of that one request (and its probe) per this many
/// answers; when it was wrong (an odd answer taken for "too long"), it does not shrink
/// every later compaction for the process's life.
pub const SHRUNK_ANSWERS: u32 = 16;
/// Bounds of the learned ratio of endpoint tokens per counted token: no public tokenizer
/// cuts text four times finer than o200k, and below 1.0 compactd keeps its own count.
pub const RATIO_BOUNDS: (f64, f64) = (1.0, 4.0);

/// Where a window figure came from (said in logs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WindowSource {
    /// `--llm-context-tokens`: the operator's word, never overridden by the endpoint.
    Configured,
    /// llama.cpp server's `GET /props` (`default_generation_settings.n_ctx`).
    Props,
    /// `GET /v1/models` (vLLM's `max_model_len`, or what a gateway lists).
    Models,
    /// A refusal for length that named the window.
    Refusal,
    /// An empty stream or a refusal without numbers: the window is smaller than that request.
    Shrunk,
}

impl WindowSource {
    /// Its name in logs and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            WindowSource::Configured => "configured",
            WindowSource::Props => "props",
            WindowSource::Models => "models",
            WindowSource::Refusal => "refusal",
            WindowSource::Shrunk => "shrunk",
        }
    }
}

/// What compactd knows of one endpoint and model: its window, and how its tokenizer
/// compares with compactd's count.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Window {
    /// Tokens of prompt plus answer the model holds, as the endpoint counts them.
    pub tokens: u64,
    /// Where `tokens` came from.
    pub source: WindowSource,
    /// Endpoint tokens per token compactd counts (1.0 until the endpoint's numbers say more).
    pub ratio: f64,
}

/// What a refusal for length says in numbers, when it says them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Refusal {
    /// The model's window.
    pub window: Option<u64>,
    /// The endpoint's count of the refused prompt.
    pub prompt_tokens: Option<u64>,
    /// A figure no request may pass that is no window of the model's (a rate limit's
    /// tokens per minute, [`rate_limit_ceiling`]): what is guessed stays at or below it,
    /// and is forgotten as any guess is, so it never stands for the model's window.
    pub ceiling: Option<u64>,
}

/// One endpoint and model (the base URL as configured, the model name as sent).
type Key = (String, String);

/// Most endpoint + model pairs kept: far more than a deployment's compaction models
/// (the model a request names is the client's choice unless `--compaction-allowed-models`
/// lists them; names are at most `config::MAX_MODEL_NAME` bytes).
pub const MAX_KNOWN: usize = 256;

/// Ratios kept per endpoint and model: the one used is the largest of the latest
/// [`RATIO_KEPT`], so that the count stays on the safe side of what the endpoint said of
/// late, and one report that was wrong (a misreporting gateway) ages out instead of
/// shrinking every later compaction's room for the process's life.
pub const RATIO_KEPT: usize = 8;

/// What is known per endpoint and model.
#[derive(Debug, Clone, Copy)]
struct Known {
    /// The window the endpoint told or a refusal named (never [`WindowSource::Shrunk`]).
    window: Option<(u64, WindowSource)>,
    /// A window guessed below it (or below nothing known), and the answers left before it
    /// is forgotten ([`SHRUNK_ANSWERS`]).
    guess: Option<(u64, u32)>,
    /// The latest ratios the endpoint's numbers taught, oldest overwritten first (0.0:
    /// none yet).
    ratios: [f64; RATIO_KEPT],
    /// Where the next ratio goes in `ratios`.
    next_ratio: usize,
    /// The endpoint answered the discovery requests (told its window or had nothing to say):
    /// not asked again. An unreachable endpoint is asked again next time.
    asked: bool,
    /// What a refusal of `max_tokens` taught (`output_cap.rs`).
    output: Option<OutputCap>,
    /// A refusal named this model's window: what is learned from then on is below the
    /// endpoint's own word, and wins over a larger configured window.
    named: bool,
    /// The last answer stopped for length that read as the window running out: its
    /// prompt and answer tokens ([`Windows::cut_again`]).
    last_cut: Option<(u64, u64)>,
}

impl Known {
    /// The window in use: the guess when one is kept below what is known.
    fn window(&self) -> Option<(u64, WindowSource)> {
        match (self.window, self.guess) {
            (Some((known, source)), Some((guess, _))) if known <= guess => Some((known, source)),
            (_, Some((guess, _))) => Some((guess, WindowSource::Shrunk)),
            (known, None) => known,
        }
    }

    /// Endpoint tokens per counted token: the largest of the latest ratios learned.
    fn ratio(&self) -> f64 {
        self.ratios.iter().copied().fold(RATIO_BOUNDS.0, f64::max)
    }

    /// Keeps `ratio` (within bounds) in place of the oldest kept.
    fn learn_ratio(&mut self, ratio: f64) {
        let at = self.next_ratio % RATIO_KEPT;
        self.ratios[at] = ratio.clamp(RATIO_BOUNDS.0, RATIO_BOUNDS.1);
        self.next_ratio = (at + 1) % RATIO_KEPT;
    }
}

impl Default for Known {
    fn default() -> Self {
        Known {
            window: None,
            guess: None,
            ratios: [0.0; RATIO_KEPT],
            next_ratio: 0,
            asked: false,
            output: None,
            named: false,
            last_cut: None,
        }
    }
}

/// The windows compactd knows, per endpoint and model, for the process's life. Its
/// `Debug` shows how many: the keys are raw base URLs, which may carry credentials.
pub struct Windows {
    configured: Option<u64>,
    /// A std mutex: held for a map lookup or insert, never across an `.await`.
    known: Mutex<HashMap<Key, Known>>,
}

impl std::fmt::Debug for Windows {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let known = self.known.lock().map_or(0, |k| k.len());
        f.debug_struct("Windows")
            .field("configured", &self.configured)
            .field("known", &known)
            .finish()
    }
}

impl Windows {
    /// A cache where `configured` (`--llm-context-tokens`), when set, is every model's window,
    /// unless a refusal names a smaller one for a model.
    pub fn new(configured: Option<u64>) -> Windows {
        Windows {
            configured,
            known: Mutex::new(HashMap::new()),
        }
    }

    /// What is known of `base_url` + `model` now, without asking anyone.
    pub fn get(&self, base_url: &str, model: &str) -> Option<Window> {
        let known = self.read(base_url, model);
        let ratio = known.ratio();
        match (self.configured, known.window()) {
            // The configured window is a ceiling: a refusal naming a smaller one is the
            // endpoint's own word for this model, and so is what was learned below it
            // since.
            (Some(tokens), Some((learned, source))) if known.named && learned < tokens => {
                Some(Window {
                    tokens: learned,
                    source,
                    ratio,
                })
            }
            (Some(tokens), _) => Some(Window {
                tokens,
                source: WindowSource::Configured,
                ratio,
            }),
            (None, Some((tokens, source))) => Some(Window {
                tokens,
                source,
                ratio,
            }),
            (None, None) => None,
        }
    }

    /// Whether the endpoint should be asked for its window (nothing configured, not asked
    /// with an answer yet).
    pub fn should_ask(&self, base_url: &str, model: &str) -> bool {
        self.configured.is_none() && !self.read(base_url, model).asked
    }

    /// Records the answer to the discovery requests (`told`: the window it told, if any).
    pub fn told(&self, base_url: &str, model: &str, told: Option<(u64, WindowSource)>) {
        self.with(base_url, model, |k| {
            k.asked = true;
            // A window learned meanwhile from a refusal is the better figure (a guess is
            // kept beside the one told, and used while it is the lower).
            if k.window.is_none() {
                k.window = told;
            }
        });
    }

    /// Learns from a refusal for length (or an empty stream) of a request compactd counted
    /// at `counted` tokens and that asked for `max_tokens`: the window it names, else one
    /// below what was sent and at most its ceiling (a guess, kept for [`SHRUNK_ANSWERS`]
    /// answers); and the ratio when it names its count of the prompt. Returns what is known
    /// afterwards.
    pub fn refused(
        &self,
        base_url: &str,
        model: &str,
        refusal: Refusal,
        counted: u64,
        max_tokens: Option<u64>,
    ) -> Option<Window> {
        self.with(base_url, model, |k| {
            if let Some(prompt) = refusal.prompt_tokens {
                k.learn_ratio(ratio(prompt, counted));
            }
            match refusal.window.filter(|w| plausible(*w)) {
                Some(w) => {
                    k.window = Some((w, WindowSource::Refusal));
                    k.guess = None;
                    k.named = true;
                }
                None => {
                    let sent = refusal
                        .prompt_tokens
                        .unwrap_or_else(|| scale(counted, k.ratio()))
                        .saturating_add(max_tokens.unwrap_or(0));
                    let below = sent
                        .saturating_sub(1)
                        .min(refusal.ceiling.unwrap_or(u64::MAX))
                        .max(MIN_SHRUNK_WINDOW);
                    let lower = k.window().is_none_or(|(w, _)| below < w);
                    if lower {
                        k.guess = Some((below, SHRUNK_ANSWERS));
                    }
                }
            }
        });
        self.get(base_url, model)
    }

    /// Learns the ratio from a usage report: the endpoint counted `prompt_tokens` for a
    /// request compactd counted at `counted`.
    pub fn observed(&self, base_url: &str, model: &str, counted: u64, prompt_tokens: u64) {
        if counted == 0 || prompt_tokens == 0 {
            return;
        }
        self.with(base_url, model, |k| {
            k.learn_ratio(ratio(prompt_tokens, counted));
        });
    }

    /// Counts one request `base_url` + `model` answered: a guessed window is forgotten
    /// after [`SHRUNK_ANSWERS`] of them. Keeps no entry for a pair nothing is known of.
    pub fn answered(&self, base_url: &str, model: &str) {
        let mut map = self.known.lock().unwrap_or_else(|p| p.into_inner());
        let Some(k) = map.get_mut(&(base_url.to_string(), model.to_string())) else {
            return;
        };
        if let Some((tokens, left)) = k.guess {
            let left = left.saturating_sub(1);
            k.guess = (left > 0).then_some((tokens, left));
        }
    }

    /// Notes an answer stopped for length after `answer` tokens of a `prompt`-token request,
    /// read as the window running out; true when the one before stopped at the same
    /// answer length (within `slack`) after a prompt of another size. A window that runs
    /// out leaves a smaller prompt a longer answer; a length the answer reaches whatever
    /// the prompt is the endpoint's own output cap.
    pub fn cut_again(
        &self,
        base_url: &str,
        model: &str,
        (prompt, answer): (u64, u64),
        slack: u64,
    ) -> bool {
        self.with(base_url, model, |k| {
            let again = k
                .last_cut
                .is_some_and(|(p, a)| a.abs_diff(answer) <= slack && p.abs_diff(prompt) > slack);
            k.last_cut = Some((prompt, answer));
            again
        })
    }

    /// The answer-token cap a refusal taught for `base_url` + `model`, if any.
    pub fn output_cap(&self, base_url: &str, model: &str) -> Option<OutputCap> {
        self.read(base_url, model).output
    }

    /// Keeps the cap a refusal of `max_tokens` taught (a lower figure wins; once the field
    /// is refused it stays omitted).
    pub fn cap_output(&self, base_url: &str, model: &str, cap: OutputCap) {
        self.with(base_url, model, |k| {
            k.output = Some(match (k.output, cap) {
                (Some(OutputCap::At(old)), OutputCap::At(new)) => OutputCap::At(old.min(new)),
                (Some(OutputCap::Omit), _) => OutputCap::Omit,
                _ => cap,
            });
        });
    }

    /// What is known of `base_url` + `model`, without keeping an entry for it.
    fn read(&self, base_url: &str, model: &str) -> Known {
        let map = self.known.lock().unwrap_or_else(|p| p.into_inner());
        map.get(&(base_url.to_string(), model.to_string()))
            .copied()
            .unwrap_or_default()
    }

    /// Runs `f` on what is known of `base_url` + `model`, kept for later. Past
    /// [`MAX_KNOWN`] pairs a new one is not kept: `f` sees a fresh value that is then
    /// dropped (a client naming a new compaction model on each call cannot grow the map).
    fn with<T>(&self, base_url: &str, model: &str, f: impl FnOnce(&mut Known) -> T) -> T {
        // A panic while holding the lock leaves a consistent map (every change is one
        // assignment), so a poisoned lock is used as it is.
        let mut map = self.known.lock().unwrap_or_else(|p| p.into_inner());
        let key = (base_url.to_string(), model.to_string());
        if map.len() >= MAX_KNOWN && !map.contains_key(&key) {
            return f(&mut Known::default());
        }
        f(map.entry(key).or_default())
    }
}

/// `counted` compactd tokens in the endpoint's tokens at `ratio`, rounded up (saturating).
pub fn scale(counted: u64, ratio: f64) -> u64 {
    // Float-to-int casts saturate; the ratio is bounded, so the product is finite.
    (counted as f64 * ratio).ceil() as u64
}

/// The window llama.cpp's server tells in `GET /props`.
pub fn from_props(body: &Value) -> Option<u64> {
    [
        &body["default_generation_settings"]["n_ctx"],
        &body["n_ctx"],
    ]
    .into_iter()
    .find_map(Value::as_u64)
    .filter(|w| plausible(*w))
}

/// The window `GET /v1/models` lists for `model`: the entry with that id, or the only entry
/// (llama.cpp names its one model after the file, whatever the client calls it).
pub fn from_models(body: &Value, model: &str) -> Option<u64> {
    let entries = body["data"].as_array()?;
    let entry = entries
        .iter()
        .find(|e| e["id"].as_str() == Some(model))
        .or(match entries.as_slice() {
            [only] => Some(only),
            _ => None,
        })?;
    // vLLM, OpenRouter, gateways; llama.cpp's training context comes last because its
    // server may run with a smaller one (its `/props` is asked first).
    [
        &entry["max_model_len"],
        &entry["context_length"],
        &entry["context_window"],
        &entry["max_context_length"],
        &entry["meta"]["n_ctx"],
        &entry["meta"]["n_ctx_train"],
    ]
    .into_iter()
    .find_map(Value::as_u64)
    .filter(|w| plausible(*w))
}

/// The numbers in a refusal for length (its message, or its whole body), in the wordings
/// of OpenAI, vLLM, llama-cpp-python, llama.cpp's server, Anthropic's and Gemini's
/// OpenAI-compatible APIs and Hugging Face's TGI.
pub fn refusal(text: &str) -> Refusal {
    let lower = text.to_ascii_lowercase();
    let window = [
        "maximum context length is",
        "available context size (",
        "\"n_ctx\":",
        // Gemini: "... exceeds the maximum number of tokens allowed (1048576)".
        "tokens allowed",
        // TGI: "`inputs` tokens + `max_new_tokens` must be <= 4096. Given: ...".
        "must be <=",
    ]
    .into_iter()
    .find_map(|needle| number_after(&lower, needle))
    // Anthropic: "prompt is too long: 213462 tokens > 200000 maximum".
    .or_else(|| number_before(&lower, " maximum"))
    // Anthropic: "input length and `max_tokens` exceed context limit: 188059 + 20000 >
    // 200000".
    .or_else(|| {
        let after = lower.find("context limit:")?;
        let rest = &lower[after..];
        number_after(rest, ">")
    });
    let prompt_tokens = number_before(&lower, " in the messages").or_else(|| {
        [
            "your messages resulted in",
            "your request has",
            "request (",
            "\"n_prompt_tokens\":",
            "prompt is too long:",
            "context limit:",
            "input token count",
            "given:",
        ]
        .into_iter()
        .find_map(|needle| number_after(&lower, needle))
    });
    Refusal {
        window,
        prompt_tokens,
        ceiling: rate_limit_ceiling(text),
    }
}

/// The tokens per minute a rate limit allows, when it refuses a request larger than that
/// alone (OpenAI's 429: "Request too large for gpt-4o in organization org-x on tokens per
/// min (TPM): Limit 30000, Requested 36278. The input or output tokens must be reduced in
/// order to run successfully."): no wait lets it pass, a smaller request does. None for a
/// plain rate limit ("Rate limit reached ... Limit 30000, Used 29000, Requested 2000"), which
/// a wait lets pass.
pub fn rate_limit_ceiling(text: &str) -> Option<u64> {
    let lower = text.to_ascii_lowercase();
    if !lower.contains("too large") && !lower.contains("must be reduced") {
        return None;
    }
    let limit = first_number_after(&lower, "limit")?;
    let requested = first_number_after(&lower, "requested")?;
    (requested > limit).then_some(limit)
}

/// Whether an error text reads as a refusal for length.
pub fn reads_too_long(text: &str) -> bool {
    let lower = text.to_ascii_lowercase();
    [
        "context_length_exceeded",
        "context length",
        "context window",
        "context size",
        "context limit",
        "exceed_context_size",
        "too many tokens",
        "prompt is too long",
        "maximum number of tokens allowed",
        "`inputs` tokens + `max_new_tokens`",
    ]
    .iter()
    .any(|n| lower.contains(n))
}

/// The endpoint's tokens per counted token, within [`RATIO_BOUNDS`].
fn ratio(endpoint: u64, counted: u64) -> f64 {
    if counted == 0 {
        return RATIO_BOUNDS.0;
    }
    (endpoint as f64 / counted as f64).clamp(RATIO_BOUNDS.0, RATIO_BOUNDS.1)
}

fn plausible(window: u64) -> bool {
    (MIN_PLAUSIBLE_WINDOW..=MAX_PLAUSIBLE_WINDOW).contains(&window)
}

/// The number right after `needle` (spaces, quotes and an opening parenthesis skipped),
/// at most 12 digits.
fn number_after(text: &str, needle: &str) -> Option<u64> {
    let start = text.find(needle)? + needle.len();
    let rest = text[start..].trim_start_matches([' ', '"', '(']);
    let digits = &rest[..rest
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(rest.len())];
    (digits.len() <= 12).then(|| digits.parse().ok()).flatten()
}

/// The number right after the first `needle` followed by one ("rate limit reached ...:
/// limit 30000" is 30000).
fn first_number_after(text: &str, needle: &str) -> Option<u64> {
    text.match_indices(needle)
        .find_map(|(at, _)| number_after(&text[at..], needle))
}

/// The number right before `needle` ("(10031 in the messages"), at most 12 digits.
fn number_before(text: &str, needle: &str) -> Option<u64> {
    let end = text.find(needle)?;
    let head = &text[..end];
    let start = head
        .char_indices()
        .rev()
        .take_while(|(_, c)| c.is_ascii_digit())
        .last()
        .map_or(head.len(), |(i, _)| i);
    let digits = &head[start..];
    (digits.len() <= 12).then(|| digits.parse().ok()).flatten()
}

#[cfg(test)]
mod tests;
