//! What the compaction model is asked: pure functions from the head of the context (as the
//! engine renders it) to chat-completions `messages`. No I/O; unit-tested directly.
//!
//! The head travels as a plain-text transcript inside one user message, not as structured
//! tool-call messages: the compaction model may differ from the session's, many providers
//! reject tool-call history without the matching tool definitions, and small local servers
//! often cannot render tool roles at all. A transcript works with every endpoint.

use serde_json::{Value, json};

use crate::domain::{PartKind, Role, ToolStatus};
use crate::engine::ContextView;

/// Seed 02's compaction agent directive (the system prompt).
pub const COMPACTION_AGENT_PROMPT: &str =
    "Provide a detailed but concise summary of the conversation.

Capture:
- Completed actions and current work in progress
- Modified files and technical decisions with rationale
- Upcoming tasks and user-specific requirements or constraints
- Persistent preferences affecting the conversation

Balance: Comprehensive enough to provide context but concise enough to be quickly understood.";

/// Seed 02's default summary prompt (the final user message).
pub const DEFAULT_SUMMARY_PROMPT: &str = "Provide a detailed prompt for continuing our conversation above.
Focus on information that would be helpful for continuing the conversation, including what we did, what we're doing, which files we're working on, and what we're going to do next considering new session will not have access to our conversation.";

/// The structured template OpenCode's users asked for; exact strings survive.
pub const SUMMARY_TEMPLATE: &str = "Write the summary in this structure:

## Objective
What the user wants, in their words where possible.

## Important details
Constraints, preferences, decisions and their reasons.

## Work state
- Completed:
- Active:
- Blocked:

## Next move
The very next step.

## Relevant files
One per line with what was done or found there.

Preserve exact file paths, symbols, commands and error strings verbatim.";

/// How the previous summary is folded in instead of being summarized again.
pub const FOLD_INSTRUCTION: &str = "The transcript starts with the summary of an earlier part of the conversation. Write one summary that combines it with the newer conversation; where they conflict, the newer conversation wins.";

/// The prompts a compaction uses; every one is overridable (server config, per request).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromptConfig {
    /// System prompt (compaction agent directive).
    pub system: String,
    /// Final instruction.
    pub prompt: String,
    /// Structure of the summary (empty: none).
    pub template: String,
}

impl Default for PromptConfig {
    fn default() -> Self {
        PromptConfig {
            system: COMPACTION_AGENT_PROMPT.into(),
            prompt: DEFAULT_SUMMARY_PROMPT.into(),
            template: SUMMARY_TEMPLATE.into(),
        }
    }
}

/// Builds the chat-completions `messages` for one compaction request.
pub fn build_messages(
    head: &ContextView,
    previous_summary: Option<&str>,
    cfg: &PromptConfig,
    instructions: Option<&str>,
) -> Vec<Value> {
    build_messages_for(
        &transcript_blocks(head).concat(),
        previous_summary,
        cfg,
        instructions,
    )
}

/// Builds the request for a transcript (the whole head, or one chunk of it).
pub fn build_messages_for(
    transcript: &str,
    previous_summary: Option<&str>,
    cfg: &PromptConfig,
    instructions: Option<&str>,
) -> Vec<Value> {
    let mut system = cfg.system.clone();
    if !cfg.template.is_empty() {
        system.push_str("\n\n");
        system.push_str(&cfg.template);
    }
    let mut text = String::new();
    if let Some(prev) = previous_summary {
        text.push_str("=== Summary of the earlier conversation ===\n");
        text.push_str(prev);
        text.push_str("\n\n=== Newer conversation ===\n");
    }
    text.push_str(transcript);
    let mut ask = cfg.prompt.clone();
    if previous_summary.is_some() {
        ask.push_str("\n\n");
        ask.push_str(FOLD_INSTRUCTION);
    }
    if let Some(extra) = instructions.map(str::trim).filter(|s| !s.is_empty()) {
        ask.push_str("\n\nAdditional instructions: ");
        ask.push_str(extra);
    }
    vec![
        json!({"role": "system", "content": system}),
        json!({"role": "user", "content": text}),
        json!({"role": "user", "content": ask}),
    ]
}

/// Characters of the request apart from the transcript (system, prompt, previous summary).
pub fn overhead_chars(
    previous_summary: Option<&str>,
    cfg: &PromptConfig,
    instructions: Option<&str>,
) -> usize {
    build_messages_for("", previous_summary, cfg, instructions)
        .iter()
        .map(|m| m["content"].as_str().map_or(0, str::len))
        .sum()
}

/// The head cut into chunks of at most `max_chars` characters, at message boundaries.
/// A single message longer than that keeps its newest `max_chars` characters (the last
/// resort: the oldest text is dropped, and counted).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chunks {
    /// Transcript chunks, oldest first.
    pub chunks: Vec<String>,
    /// Characters dropped from messages too long for any chunk.
    pub dropped_chars: usize,
}

/// Splits transcript blocks (one per message) into chunks of at most `max_chars`.
pub fn split(blocks: &[String], max_chars: usize) -> Chunks {
    let max_chars = max_chars.max(1);
    let mut chunks = Vec::new();
    let mut current = String::new();
    let mut dropped = 0;
    for block in blocks {
        let block = if block.len() > max_chars {
            let (kept, cut) = keep_newest(block, max_chars);
            dropped += cut;
            kept
        } else {
            block.clone()
        };
        if !current.is_empty() && current.len() + block.len() > max_chars {
            chunks.push(std::mem::take(&mut current));
        }
        current.push_str(&block);
    }
    if !current.is_empty() || chunks.is_empty() {
        chunks.push(current);
    }
    Chunks {
        chunks,
        dropped_chars: dropped,
    }
}

/// The newest text of a message too long for any chunk, at most `max_chars` long with a
/// marker saying how much was dropped; and the number of characters dropped (the last
/// resort: the oldest text goes).
pub fn keep_newest(block: &str, max_chars: usize) -> (String, usize) {
    if block.len() <= max_chars {
        return (block.to_string(), 0);
    }
    let marker = format!(
        "[... {} earlier characters dropped by compactd]\n",
        block.len() - max_chars
    );
    let keep = max_chars.saturating_sub(marker.len());
    let mut cut = block.len() - keep;
    while !block.is_char_boundary(cut) {
        cut += 1;
    }
    (format!("{marker}{}", &block[cut..]), cut)
}

/// The head as a readable transcript, one block per message: tool calls with their
/// (possibly cleared) results.
pub fn transcript_blocks(view: &ContextView) -> Vec<String> {
    let mut blocks = Vec::with_capacity(view.messages.len());
    for msg in &view.messages {
        let mut out = String::new();
        out.push_str(match msg.info.role {
            Role::User => "--- user ---\n",
            Role::Assistant if msg.info.summary => "--- summary ---\n",
            Role::Assistant => "--- assistant ---\n",
        });
        for stored in &msg.parts {
            match &stored.part.kind {
                PartKind::Text(t) => {
                    out.push_str(&t.text);
                    out.push('\n');
                }
                PartKind::Compaction(_) => out.push_str("(the conversation was compacted here)\n"),
                PartKind::File(f) => {
                    out.push_str(&format!("[file: {} ({})]\n", f.filename, f.mime))
                }
                PartKind::Tool(t) => {
                    out.push_str(&format!("[tool {} {}]\n", t.tool, t.state.input));
                    let result = match t.state.status {
                        ToolStatus::Completed => &t.state.output,
                        ToolStatus::Error | ToolStatus::Pending | ToolStatus::Running => {
                            &t.state.error
                        }
                    };
                    out.push_str(result);
                    out.push('\n');
                }
                _ => {}
            }
        }
        out.push('\n');
        blocks.push(out);
    }
    blocks
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blocks(sizes: &[usize]) -> Vec<String> {
        sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| format!("{}", (b'a' + i as u8) as char).repeat(n))
            .collect()
    }

    #[test]
    fn packs_whole_messages_up_to_the_limit() {
        let c = split(&blocks(&[40, 40, 40, 10]), 100);
        assert_eq!(
            c.chunks.iter().map(String::len).collect::<Vec<_>>(),
            [80, 50]
        );
        assert_eq!(c.dropped_chars, 0);
        assert_eq!(
            c.chunks.concat(),
            blocks(&[40, 40, 40, 10]).concat(),
            "nothing lost or reordered"
        );
    }

    #[test]
    fn an_oversized_message_keeps_its_newest_text_and_counts_the_rest() {
        let mut big = "old ".repeat(100);
        big.push_str("NEWEST");
        let c = split(&[big.clone()], 120);
        assert_eq!(c.chunks.len(), 1);
        assert!(c.chunks[0].len() <= 120, "{}", c.chunks[0].len());
        assert!(c.chunks[0].ends_with("NEWEST"));
        assert!(c.chunks[0].starts_with("[... "));
        let kept = &c.chunks[0][c.chunks[0].find('\n').map_or(0, |n| n + 1)..];
        assert_eq!(
            c.dropped_chars + kept.len(),
            big.len(),
            "kept + dropped = the original"
        );
        assert!(big.ends_with(kept));
    }

    #[test]
    fn the_fold_request_carries_the_running_summary_and_instructions() {
        let m = build_messages_for(
            "--- user ---\nhi\n",
            Some("earlier"),
            &PromptConfig::default(),
            Some("keep paths"),
        );
        let body = m[1]["content"].as_str().unwrap_or_default();
        assert!(body.starts_with("=== Summary of the earlier conversation ===\nearlier"));
        let ask = m[2]["content"].as_str().unwrap_or_default();
        assert!(ask.contains(FOLD_INSTRUCTION));
        assert!(ask.ends_with("Additional instructions: keep paths"));
    }
}
