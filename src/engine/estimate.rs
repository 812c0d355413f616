//! Per-part token estimates, computed once when a part is written and cached beside it,
//! so no step ever re-counts old outputs.

use crate::config::{COMPACTION_PROMPT_TEXT, INTERRUPTED};
use crate::session::{Part, PartKind, ToolStatus};
use crate::tokens::TokenCounter;

/// Cached token figures of one part.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PartEstimate {
    /// Tokens the part adds to the context apart from a tool output (text, tool input,
    /// error text, the interrupted marker).
    pub base: u64,
    /// Tokens of a completed tool's `state.output` (what prune weighs and may clear).
    pub output: u64,
}

impl PartEstimate {
    /// Tokens in the context view: the output counts only while not compacted.
    pub fn in_context(&self, compacted: bool, placeholder: u64) -> u64 {
        self.base + if compacted { placeholder } else { self.output }
    }
}

/// Counts a part the way it will be rendered into the model context.
pub fn estimate(part: &Part, counter: &dyn TokenCounter) -> PartEstimate {
    match &part.kind {
        PartKind::Text(t) if t.ignored => PartEstimate::default(),
        PartKind::Text(t) => PartEstimate {
            base: counter.count(&t.text),
            output: 0,
        },
        PartKind::Reasoning(r) => PartEstimate {
            base: counter.count(&r.text),
            output: 0,
        },
        PartKind::Tool(tool) => {
            let input = counter.count(&tool.state.input.to_string());
            match tool.state.status {
                ToolStatus::Completed => PartEstimate {
                    base: input,
                    output: counter.count(&tool.state.output),
                },
                ToolStatus::Error => PartEstimate {
                    base: input + counter.count(&tool.state.error),
                    output: 0,
                },
                ToolStatus::Pending | ToolStatus::Running => PartEstimate {
                    base: input + counter.count(INTERRUPTED),
                    output: 0,
                },
            }
        }
        PartKind::File(f) => {
            // A data: URL carries the file itself; anything else is a reference.
            let body = if f.url.starts_with("data:") {
                f.url.as_str()
            } else {
                f.filename.as_str()
            };
            PartEstimate {
                base: counter.count(body),
                output: 0,
            }
        }
        PartKind::Subtask(s) => PartEstimate {
            base: counter.count(&s.prompt) + counter.count(&s.description),
            output: 0,
        },
        PartKind::Compaction(_) => PartEstimate {
            base: counter.count(COMPACTION_PROMPT_TEXT),
            output: 0,
        },
        PartKind::StepStart { .. }
        | PartKind::StepFinish(_)
        | PartKind::Snapshot { .. }
        | PartKind::Patch(_)
        | PartKind::Agent(_)
        | PartKind::Retry(_) => PartEstimate::default(),
    }
}
