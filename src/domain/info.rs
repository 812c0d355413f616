//! Session-level info: identity, model, limits, todo list.

use serde::{Deserialize, Serialize};

use super::Extra;
use crate::config::SessionOverrides;

/// Who a session talks to, so reports and (later) the compaction model can name it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ModelRef {
    /// Provider, e.g. `openai`.
    pub provider_id: String,
    /// Model, e.g. `gpt-5.3-codex`.
    pub model_id: String,
}

/// The model's token limits; overflow is measured against them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelLimits {
    /// Whole window; 0 means unlimited (overflow never reported).
    pub context: u64,
    /// Input limit; when non-zero it is the usable input.
    pub input: u64,
    /// Output limit, reserved out of the window when `input` is 0.
    pub output: u64,
}

/// The window as OpenCode reads it from the limits, the one home of that arithmetic: the
/// overflow check, the output cap, compaction's tail and validation all size from it.
impl ModelLimits {
    /// Max output tokens as OpenCode's `maxOutputTokens`: min(limit.output, 32000), or
    /// 32000 when 0. Reserved out of the window when `input` is 0.
    pub fn max_output(&self) -> u64 {
        match self.output {
            0 => crate::config::OUTPUT_TOKEN_MAX,
            n => n.min(crate::config::OUTPUT_TOKEN_MAX),
        }
    }

    /// Usable input: `limit.input`, else `context − max_output` (0 when the output
    /// reserve takes the whole window, or with no window: see `context`).
    pub fn usable_input(&self) -> u64 {
        if self.input > 0 {
            self.input
        } else {
            self.context.saturating_sub(self.max_output())
        }
    }
}

/// One todo item, carried verbatim (OpenCode's `todowrite` state).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Todo {
    /// Item id.
    pub id: String,
    /// What to do.
    pub content: String,
    /// `pending`, `in_progress`, `completed`, ...
    pub status: String,
    /// `high`, `medium`, `low`.
    pub priority: String,
}

/// Session info as the host describes it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SessionInfo {
    /// Session id (required, non-empty).
    pub id: String,
    /// Human title.
    pub title: String,
    /// Model the session uses.
    pub model: Option<ModelRef>,
    /// Model limits for overflow detection.
    pub limits: ModelLimits,
    /// Per-session overrides of the server config.
    pub config: SessionOverrides,
    /// The session's todo list.
    pub todos: Vec<Todo>,
    /// Unmodelled fields (from imports).
    pub extra: Extra,
}
