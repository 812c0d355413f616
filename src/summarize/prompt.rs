//! What the compaction model is asked: pure functions from the head of the context (as the
//! engine renders it) to chat-completions `messages`. No I/O; unit-tested directly.
//!
//! The head travels as a plain-text transcript inside one user message, not as structured
//! tool-call messages: the compaction model may differ from the session's, many providers
//! reject tool-call history without the matching tool definitions, and small local servers
//! often cannot render tool roles at all. A transcript works with every endpoint.

use serde_json::{Value, json};

use crate::engine::ContextView;
use crate::session::{PartKind, Role, ToolStatus};

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
    let mut system = cfg.system.clone();
    if !cfg.template.is_empty() {
        system.push_str("\n\n");
        system.push_str(&cfg.template);
    }
    let mut transcript = String::new();
    if let Some(prev) = previous_summary {
        transcript.push_str("=== Summary of the earlier conversation ===\n");
        transcript.push_str(prev);
        transcript.push_str("\n\n=== Newer conversation ===\n");
    }
    render_transcript(head, &mut transcript);
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
        json!({"role": "user", "content": transcript}),
        json!({"role": "user", "content": ask}),
    ]
}

/// The head as a readable transcript: one block per message, tool calls with their
/// (possibly cleared) results.
pub fn render_transcript(view: &ContextView, out: &mut String) {
    for msg in &view.messages {
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
    }
}
