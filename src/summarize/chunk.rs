//! How a head too long for one request becomes one summary: cut the transcript into chunks
//! the compaction model's window holds, then fold them oldest first into a rolling summary.
//! A refusal for length halves the chunk size and starts over.
//!
//! Policy only: the caller sends each request through a [`Requester`] (the server streams
//! the last one to its clients; the replay just waits), so the server and `compactd replay`
//! summarize a head the same way.

use std::future::Future;

use serde_json::Value;

use super::{PromptConfig, SummarizeError, prompt};
use crate::domain::TokenUsage;
use crate::engine::{ContextView, SummaryOutcome};

/// Times the chunk size may halve after the endpoint refuses a request for length.
pub const MAX_SPLITS: usize = 4;
/// Smallest chunk worth sending.
pub const MIN_CHUNK_CHARS: usize = 1_000;

/// Sends the requests of one summary; the chunking policy decides what they hold.
pub trait Requester {
    /// Sends one request. `last` marks the request whose answer is the summary that gets
    /// committed (earlier answers only carry the rolling summary forward).
    fn request(
        &mut self,
        messages: Vec<Value>,
        last: bool,
    ) -> impl Future<Output = Result<SummaryOutcome, SummarizeError>> + Send;

    /// Told when the endpoint refused a request for length and the head is cut into
    /// chunks of `max_chars` instead (for the caller's logs).
    fn splitting(&mut self, max_chars: usize, reason: &str) {
        let _ = (max_chars, reason);
    }
}

/// How to ask for a head's summary.
#[derive(Debug, Clone, Copy)]
pub struct Options<'a> {
    /// The summary of an earlier compaction, folded in instead of summarized again.
    pub previous_summary: Option<&'a str>,
    /// The prompts (already merged with any per-session or per-request overrides).
    pub prompts: &'a PromptConfig,
    /// Extra instructions, appended to the last request only.
    pub instructions: &'a str,
    /// The compaction model's context window in tokens, when known.
    pub window: Option<u64>,
}

/// A head's summary and what it took.
#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    /// The summary (usage and cost summed over every request when there were several).
    pub outcome: SummaryOutcome,
    /// Requests the summary took.
    pub chunks: u32,
    /// Characters dropped from messages too long for any chunk (the last resort).
    pub dropped_chars: u64,
}

/// Summarizes `head`: in one request when it fits the window (or no window is known),
/// else chunk by chunk into a rolling summary. A refusal for length halves the chunk size
/// and starts over, at most [`MAX_SPLITS`] times.
pub async fn summarize_head(
    head: &ContextView,
    options: Options<'_>,
    requester: &mut impl Requester,
) -> Result<Summary, SummarizeError> {
    summarize_blocks(&prompt::transcript_blocks(head), options, requester).await
}

/// [`summarize_head`] on the head's transcript, one block per message.
async fn summarize_blocks(
    blocks: &[String],
    head: Options<'_>,
    requester: &mut impl Requester,
) -> Result<Summary, SummarizeError> {
    let total: usize = blocks.iter().map(String::len).sum();
    let overhead =
        prompt::overhead_chars(head.previous_summary, head.prompts, Some(head.instructions));
    let mut max_chars = match head.window {
        Some(window) => chunk_chars(window, overhead)?,
        None => total.max(1),
    };
    for _ in 0..MAX_SPLITS {
        let chunks = prompt::split(blocks, max_chars);
        match fold(&chunks.chunks, head, requester).await {
            Err(SummarizeError::TooLong(why)) if max_chars > MIN_CHUNK_CHARS => {
                max_chars /= 2;
                requester.splitting(max_chars, &why);
            }
            Ok(outcome) => {
                return Ok(Summary {
                    outcome,
                    chunks: u32::try_from(chunks.chunks.len()).unwrap_or(u32::MAX),
                    dropped_chars: u64::try_from(chunks.dropped_chars).unwrap_or(u64::MAX),
                });
            }
            Err(e) => return Err(e),
        }
    }
    Err(SummarizeError::TooLong(format!(
        "still too long after splitting the head {MAX_SPLITS} times (chunks of {max_chars} characters)"
    )))
}

/// Folds the chunks into one summary, oldest first; the last request is the one that
/// counts. Several requests report their usage and cost summed (saturating: the numbers
/// come from the endpoint).
async fn fold(
    chunks: &[String],
    head: Options<'_>,
    requester: &mut impl Requester,
) -> Result<SummaryOutcome, SummarizeError> {
    let mut running = head.previous_summary.map(str::to_string);
    let mut usage = TokenUsage::default();
    let mut cost = 0.0;
    let mut last_outcome = None;
    for (i, chunk) in chunks.iter().enumerate() {
        let last = i + 1 == chunks.len();
        let messages = prompt::build_messages_for(
            chunk,
            running.as_deref(),
            head.prompts,
            last.then_some(head.instructions),
        );
        let outcome = requester.request(messages, last).await?;
        if let Some(u) = outcome.usage {
            usage.input = usage.input.saturating_add(u.input);
            usage.output = usage.output.saturating_add(u.output);
        }
        cost += outcome.cost;
        running = Some(outcome.text.clone());
        last_outcome = Some(outcome);
    }
    let mut outcome =
        last_outcome.ok_or_else(|| SummarizeError::Malformed("nothing to summarize".into()))?;
    if chunks.len() > 1 {
        usage.total = Some(usage.input.saturating_add(usage.output));
        outcome.usage = Some(usage);
        outcome.cost = cost;
    }
    Ok(outcome)
}

/// Characters of transcript per request for a model with `window` tokens: a quarter kept
/// for the answer (`max_tokens`), a quarter for the rolling summary (an earlier answer),
/// the rest minus the prompt's own size, at 2 characters per token. Pessimistic on
/// purpose: logs, JSON and code tokenize far denser than prose, and small local models
/// have small vocabularies (SmolLM2 went over its window at 3 characters per token).
pub fn chunk_chars(window: u64, overhead_chars: usize) -> Result<usize, SummarizeError> {
    let half_window = usize::try_from(window / 2).unwrap_or(usize::MAX);
    let room = half_window.saturating_sub(overhead_chars / 2);
    let chars = room.saturating_mul(2);
    if chars < MIN_CHUNK_CHARS {
        return Err(SummarizeError::TooLong(format!(
            "the compaction model's window ({window} tokens) leaves no room for the conversation"
        )));
    }
    Ok(chars)
}

#[cfg(test)]
mod tests;
