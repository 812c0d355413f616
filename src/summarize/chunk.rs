//! How a head becomes one summary: count its transcript with a real tokenizer, send it in
//! one request when it fits the compaction model's window (or no window is known), else cut
//! it at message boundaries into chunks the window holds and fold them oldest first into a
//! running summary. A "too long" answer (a refusal, an empty stream) re-cuts what is left
//! at once: to what the endpoint's numbers allow, else to half the refused chunk, so the
//! same request is never sent twice. A previous summary rides along as the running summary
//! while it leaves room for the transcript; one too long for that is summarized as the
//! head's oldest text instead, chunked like the rest.
//!
//! Policy only: the caller sends each request through a [`Requester`] (the server streams
//! the last one to its clients; the replay just waits), so the server and `compactd replay`
//! summarize a head the same way. The arithmetic of one request is in `budget.rs`.

use std::future::Future;
use std::sync::Arc;

use serde_json::Value;

use super::budget::{Budget, MIN_CHUNK_TOKENS};
use super::window::{Window, WindowSource};
use super::{PromptConfig, SummarizeError, SummaryRequest, prompt};
use crate::domain::TokenUsage;
use crate::engine::{ContextView, SummaryOutcome};
use crate::tokens::TokenCounter;

/// Times the head may be re-cut after the endpoint answers "too long".
pub const MAX_SPLITS: usize = 4;

/// Sends the requests of one summary; the chunking policy decides what they hold.
pub trait Requester {
    /// Sends one request. `last` marks the request whose answer is the summary that gets
    /// committed (earlier answers only carry the running summary forward).
    fn request(
        &mut self,
        request: SummaryRequest,
        last: bool,
    ) -> impl Future<Output = Result<SummaryOutcome, SummarizeError>> + Send;

    /// The compaction model's window as known now (asked before the first request, and
    /// again after a "too long" answer, which may have taught a smaller one).
    fn window(&mut self) -> impl Future<Output = Option<Window>> + Send;

    /// Told when the endpoint answered "too long" and the rest of the head is cut into
    /// chunks of at most `room_tokens` counted tokens (for the caller's logs).
    fn splitting(&mut self, room_tokens: u64, reason: &str) {
        let _ = (room_tokens, reason);
    }
}

/// How to ask for a head's summary.
#[derive(Debug, Clone, Copy)]
pub struct Options<'a> {
    /// The summary of an earlier compaction, folded in instead of summarized again; one too
    /// long to leave the transcript room beside it is summarized as the head's oldest text.
    pub previous_summary: Option<&'a str>,
    /// The prompts (already merged with any per-session or per-request overrides).
    pub prompts: &'a PromptConfig,
    /// Extra instructions, appended to the last request only.
    pub instructions: &'a str,
    /// Counts the transcript for the compaction model (its family's tokenizer).
    pub counter: &'static dyn TokenCounter,
}

/// A head's summary and what it took.
#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    /// The summary (usage and cost summed over every request when there were several).
    pub outcome: SummaryOutcome,
    /// Requests the summary took (answered ones).
    pub chunks: u32,
    /// Characters dropped from messages too long for any chunk (the last resort).
    pub dropped_chars: u64,
}

/// Summarizes `head`: in one request when it fits the window (or no window is known),
/// else chunk by chunk into a running summary, re-cutting the rest after a "too long"
/// answer at most [`MAX_SPLITS`] times.
pub async fn summarize_head(
    head: &ContextView,
    options: Options<'_>,
    requester: &mut impl Requester,
) -> Result<Summary, SummarizeError> {
    let blocks = Arc::new(prompt::transcript_blocks(head));
    let counter = options.counter;
    // Counting is CPU work in proportion to the head (tens of MB/s): off the async workers.
    let shared = blocks.clone();
    let tokens = match tokio::task::spawn_blocking(move || count_all(counter, &shared)).await {
        Ok(tokens) => tokens,
        // The counting thread could not run (shutting down): count here.
        Err(_) => count_all(counter, &blocks),
    };
    summarize_blocks(&blocks, &tokens, options, requester).await
}

/// [`summarize_head`] on the head's transcript, one block per message, and each block's
/// counted tokens.
async fn summarize_blocks(
    head_blocks: &[String],
    head_tokens: &[u64],
    head: Options<'_>,
    requester: &mut impl Requester,
) -> Result<Summary, SummarizeError> {
    let counter = head.counter;
    let fixed = count_messages(
        counter,
        &prompt::build_messages_for("", Some(""), head.prompts, Some(head.instructions)),
    );
    let mut fold = Fold::new(head.previous_summary, counter);
    let mut window = requester.window().await;
    let mut cap = u64::MAX;
    let mut splits = 0;
    let mut next = 0;
    // The previous summary's pieces before the head's blocks, once it became transcript.
    let mut joined: Option<(Vec<String>, Vec<u64>)> = None;
    loop {
        let (blocks, tokens) = match &joined {
            Some((blocks, tokens)) => (blocks.as_slice(), tokens.as_slice()),
            None => (head_blocks, head_tokens),
        };
        let remaining: u64 = tokens[next..].iter().fold(0, |a, t| a.saturating_add(*t));
        let fits = match room(window, fixed, fold.running_tokens, remaining, cap) {
            Ok(fits) => fits,
            // Nothing answered yet, and the previous summary is what leaves no room: it
            // becomes the transcript's oldest text, folded like any other (the window is
            // checked again without it).
            Err(e) => match fold.demote() {
                Some(previous) => {
                    let (mut pieces, mut counted) = previous_blocks(&previous, counter);
                    pieces.extend_from_slice(&blocks[next..]);
                    counted.extend_from_slice(&tokens[next..]);
                    joined = Some((pieces, counted));
                    next = 0;
                    continue;
                }
                None => return Err(e),
            },
        };
        let chunk = take_chunk(&blocks[next..], &tokens[next..], fits, counter);
        let last = next + chunk.blocks == blocks.len();
        let messages = prompt::build_messages_for(
            &chunk.text,
            fold.running.as_deref(),
            head.prompts,
            last.then_some(head.instructions),
        );
        let counted = fixed
            .saturating_add(chunk.tokens)
            .saturating_add(fold.running_tokens);
        let request = SummaryRequest {
            messages,
            model: None,
            max_tokens: window.map(|w| Budget::new(w).max_tokens(counted)),
            counted_tokens: Some(counted),
        };
        match requester.request(request, last).await {
            // Folded as the running summary, nothing would carry the chunks answered so
            // far into the summary that gets committed (the last answer is checked when
            // it is committed).
            Ok(outcome) if !last && outcome.text.trim().is_empty() => {
                return Err(SummarizeError::Malformed(format!(
                    "the model answered a chunk of {} tokens with nothing: the conversation \
                     up to it would be missing from the summary",
                    chunk.tokens
                )));
            }
            Ok(outcome) => {
                next += chunk.blocks;
                fold.add(outcome, chunk.dropped);
                if last {
                    return fold.finish();
                }
            }
            Err(SummarizeError::TooLong(why)) if splits < MAX_SPLITS => {
                if chunk.tokens <= MIN_CHUNK_TOKENS {
                    return Err(SummarizeError::TooLong(format!(
                        "{why} (a chunk of {} tokens is the smallest compactd sends)",
                        chunk.tokens
                    )));
                }
                splits += 1;
                window = requester.window().await;
                // What the endpoint's numbers allow when that is smaller, else half: either
                // way the next request is smaller than the refused one. A window compactd
                // guessed (one below what a refusal without numbers was sent) still
                // leaves most of the refused chunk: at most half, as without one.
                let taught = window
                    .and_then(|w| {
                        room(Some(w), fixed, fold.running_tokens, u64::MAX, u64::MAX).ok()
                    })
                    .filter(|r| *r < chunk.tokens);
                let half = chunk.tokens / 2;
                let guessed = window.is_some_and(|w| w.source == WindowSource::Shrunk);
                cap = match taught {
                    Some(t) if guessed => t.min(half),
                    Some(t) => t,
                    None => half,
                };
                requester.splitting(cap, &why);
            }
            Err(SummarizeError::TooLong(why)) => {
                return Err(SummarizeError::TooLong(format!(
                    "{why} (still too long after cutting the head {MAX_SPLITS} times, chunks of {} tokens)",
                    chunk.tokens
                )));
            }
            Err(e) => return Err(e),
        }
    }
}

/// Counted tokens of transcript the next request may carry beside the prompt, the running
/// summary it folds (as long as it is) and the answer; never more than `cap` (set by "too
/// long" answers). Without a window: `cap`. A head that needs several requests is refused
/// before any is sent when a later one, folding a running summary as long as an answer
/// may be, would leave less than the smallest chunk.
fn room(
    window: Option<Window>,
    fixed: u64,
    running_tokens: u64,
    remaining: u64,
    cap: u64,
) -> Result<u64, SummarizeError> {
    let Some(window) = window else {
        return Ok(cap);
    };
    let budget = Budget::new(window);
    let running = budget.running(running_tokens);
    let room = budget.room(fixed, running).min(cap);
    let worst = budget.room(fixed, running.max(budget.answer()));
    if remaining > room && worst < MIN_CHUNK_TOKENS {
        return Err(SummarizeError::TooLong(format!(
            "the compaction model's window ({} tokens, {}) leaves no room for the conversation",
            window.tokens,
            window.source.as_str()
        )));
    }
    Ok(room)
}

/// The next chunk: whole blocks while they fit `room`, or the newest part of one block too
/// long for any chunk.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Chunk {
    text: String,
    tokens: u64,
    /// Blocks it covers.
    blocks: usize,
    /// Characters dropped from an oversized block.
    dropped: usize,
}

fn take_chunk(blocks: &[String], tokens: &[u64], room: u64, counter: &dyn TokenCounter) -> Chunk {
    let mut chunk = Chunk {
        text: String::new(),
        tokens: 0,
        blocks: 0,
        dropped: 0,
    };
    for (block, &t) in blocks.iter().zip(tokens) {
        if chunk.blocks == 0 && t > room {
            let (text, dropped, tokens) = newest_part(block, t, room, counter);
            return Chunk {
                text,
                tokens,
                blocks: 1,
                dropped,
            };
        }
        if chunk.tokens.saturating_add(t) > room {
            break;
        }
        chunk.text.push_str(block);
        chunk.tokens = chunk.tokens.saturating_add(t);
        chunk.blocks += 1;
    }
    chunk
}

/// The newest part of `block` (counted at `tokens`) that fits `room`: cut by characters in
/// proportion, then recounted, shrinking until it fits. Always fits (at worst only the
/// marker of what was dropped is left): a part over `room` would be refused again as it
/// was. Each cut keeps at most three quarters of the last, so the counts cost at most
/// four times the first.
fn newest_part(
    block: &str,
    tokens: u64,
    room: u64,
    counter: &dyn TokenCounter,
) -> (String, usize, u64) {
    let share = u128::from(room) * 9 / 10;
    let mut max_chars =
        usize::try_from((block.len() as u128).saturating_mul(share) / u128::from(tokens.max(1)))
            .unwrap_or(usize::MAX);
    loop {
        let (text, dropped) = prompt::keep_newest(block, max_chars);
        let counted = counter.count(&text);
        if counted <= room || max_chars == 0 {
            return (text, dropped, counted);
        }
        // In proportion to what this count says, and by a quarter at least.
        let proportional =
            usize::try_from((max_chars as u128).saturating_mul(share) / u128::from(counted.max(1)))
                .unwrap_or(usize::MAX);
        max_chars = proportional.min(max_chars / 4 * 3);
    }
}

/// Target size of one piece of a previous summary summarized as transcript, in counted
/// tokens: half the smallest chunk, so whole pieces fill any chunk though text tokenizes
/// unevenly.
const PREVIOUS_PIECE_TOKENS: u64 = MIN_CHUNK_TOKENS / 2;

/// A previous summary as transcript blocks (the transcript's `--- summary ---` block, cut
/// into pieces of about [`PREVIOUS_PIECE_TOKENS`] at line ends or spaces where it can be)
/// and each piece's counted tokens. A piece is cut by characters in proportion to the
/// summary's tokens, and cut again shorter where the text is denser than that, so none is
/// longer than the smallest chunk: whole pieces fill any chunk, and nothing is dropped.
fn previous_blocks(previous: &str, counter: &dyn TokenCounter) -> (Vec<String>, Vec<u64>) {
    let text = format!("--- summary ---\n{previous}\n\n");
    let total = counter.count(&text).max(1);
    let per_piece = u128::from(PREVIOUS_PIECE_TOKENS);
    let usual = usize::try_from((text.len() as u128).saturating_mul(per_piece) / u128::from(total))
        .unwrap_or(usize::MAX)
        .max(1);
    let mut max_chars = usual;
    let mut pieces = Vec::new();
    let mut tokens = Vec::new();
    let mut rest = text.as_str();
    while !rest.is_empty() {
        let piece = rest.get(..cut_at(rest, max_chars)).unwrap_or(rest);
        let counted = counter.count(piece);
        // Denser text than the summary's average: the same stretch in a shorter piece (each
        // retry halves it, so this ends).
        if counted > MIN_CHUNK_TOKENS && max_chars > 1 {
            max_chars /= 2;
            continue;
        }
        pieces.push(piece.to_string());
        tokens.push(counted);
        rest = rest.get(piece.len()..).unwrap_or_default();
        // Sparser again: back towards the usual length.
        if counted < PREVIOUS_PIECE_TOKENS / 2 {
            max_chars = max_chars.saturating_mul(2).min(usual);
        }
    }
    (pieces, tokens)
}

/// Bytes of `text` its next piece takes, at most about `max_chars`: after the last line end
/// in that span, else the last space, when one is in its second half; else at a character
/// boundary. Never zero for a non-empty `text`.
fn cut_at(text: &str, max_chars: usize) -> usize {
    if text.len() <= max_chars {
        return text.len();
    }
    let mut end = max_chars;
    while !text.is_char_boundary(end) {
        end = end.saturating_add(1);
    }
    let span = &text[..end];
    let half = end / 2;
    span.rfind('\n')
        .filter(|&i| i >= half)
        .or_else(|| span.rfind(' ').filter(|&i| i >= half))
        .map_or(end, |i| i.saturating_add(1))
}

/// The running summary and the sums over every answered request.
struct Fold {
    running: Option<String>,
    running_tokens: u64,
    counter: &'static dyn TokenCounter,
    usage: TokenUsage,
    cost: f64,
    requests: u32,
    dropped: usize,
    last: Option<SummaryOutcome>,
}

impl Fold {
    fn new(previous: Option<&str>, counter: &'static dyn TokenCounter) -> Fold {
        Fold {
            running: previous.map(str::to_string),
            running_tokens: previous.map_or(0, |p| counter.count(p)),
            counter,
            usage: TokenUsage::default(),
            cost: 0.0,
            requests: 0,
            dropped: 0,
            last: None,
        }
    }

    /// The previous summary, taken out of the running summary, while no request has been
    /// answered (after one, the running summary is an answer).
    fn demote(&mut self) -> Option<String> {
        if self.requests > 0 {
            return None;
        }
        self.running_tokens = 0;
        self.running.take()
    }

    /// One answered request; its answer is the running summary from now on. Usage sums
    /// saturate: the numbers come from the endpoint.
    fn add(&mut self, outcome: SummaryOutcome, dropped: usize) {
        if let Some(u) = outcome.usage {
            self.usage.input = self.usage.input.saturating_add(u.input);
            self.usage.output = self.usage.output.saturating_add(u.output);
        }
        self.cost += outcome.cost;
        self.requests = self.requests.saturating_add(1);
        self.dropped = self.dropped.saturating_add(dropped);
        self.running_tokens = self.counter.count(&outcome.text);
        self.running = Some(outcome.text.clone());
        self.last = Some(outcome);
    }

    fn finish(self) -> Result<Summary, SummarizeError> {
        let mut outcome = self
            .last
            .ok_or_else(|| SummarizeError::Malformed("nothing to summarize".into()))?;
        if self.requests > 1 {
            let mut usage = self.usage;
            usage.total = Some(usage.input.saturating_add(usage.output));
            outcome.usage = Some(usage);
            outcome.cost = self.cost;
        }
        Ok(Summary {
            outcome,
            chunks: self.requests,
            dropped_chars: u64::try_from(self.dropped).unwrap_or(u64::MAX),
        })
    }
}

fn count_all(counter: &dyn TokenCounter, blocks: &[String]) -> Vec<u64> {
    blocks.iter().map(|b| counter.count(b)).collect()
}

/// Counted tokens of the messages' contents.
fn count_messages(counter: &dyn TokenCounter, messages: &[Value]) -> u64 {
    messages
        .iter()
        .filter_map(|m| m["content"].as_str())
        .fold(0, |a, c| a.saturating_add(counter.count(c)))
}

#[cfg(test)]
mod tests;
