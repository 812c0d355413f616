//! Message info (OpenCode's `MessageV2.Info`) and token usage.

use serde::{Deserialize, Serialize};

use super::Extra;
use super::info::ModelRef;

/// Message author. OpenCode has exactly two; anything else is rejected at the boundary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// A user turn (prune counts these as turns).
    User,
    /// A model response (carries usage, may be a compaction summary).
    Assistant,
}

impl Role {
    /// Parses OpenCode's role string.
    pub fn parse(s: &str) -> Option<Role> {
        match s {
            "user" => Some(Role::User),
            "assistant" => Some(Role::Assistant),
            _ => None,
        }
    }

    /// OpenCode's role string.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::User => "user",
            Role::Assistant => "assistant",
        }
    }
}

/// Token usage a provider reported for one request, as OpenCode stores it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenUsage {
    /// Provider total when given; preferred over the sum.
    pub total: Option<u64>,
    /// Prompt tokens (with or without cache reads, see `CacheCounting`).
    pub input: u64,
    /// Completion tokens.
    pub output: u64,
    /// Reasoning tokens (part of output for most providers).
    pub reasoning: u64,
    /// Prompt tokens served from cache.
    pub cache_read: u64,
    /// Prompt tokens written to cache.
    pub cache_write: u64,
}

impl TokenUsage {
    /// The cache reads to add to `input` under `rule`: all of them when `input` leaves
    /// them out (`Separate`), none when it includes them (`Included`), unless the report
    /// says otherwise: reads above `input` cannot be part of it (a host on Anthropic's
    /// counts with a session left on OpenAI's rule), so they are added whatever the rule,
    /// rather than a 180,000-token prompt read as its 50 uncached tokens.
    pub fn cache_read_apart(&self, rule: crate::config::CacheCounting) -> u64 {
        match rule {
            crate::config::CacheCounting::Included if self.cache_read <= self.input => 0,
            _ => self.cache_read,
        }
    }

    /// True when the provider reported nothing at all (all zero, no total).
    pub fn is_empty(&self) -> bool {
        self.total.unwrap_or(0) == 0
            && self.input == 0
            && self.output == 0
            && self.cache_read == 0
            && self.cache_write == 0
    }
}

/// Creation and completion times (epoch ms).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MessageTime {
    /// When the message was created.
    pub created: i64,
    /// When an assistant message finished.
    pub completed: Option<i64>,
}

/// A failed assistant message's error (`{name, data}`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct MessageError {
    /// Error class, e.g. `MessageAbortedError`.
    pub name: String,
    /// Provider-specific details.
    pub data: serde_json::Value,
}

/// Message metadata; the parts live beside it in the engine's session.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MessageInfo {
    /// Message id (required).
    pub id: String,
    /// Author.
    pub role: Role,
    /// The user message an assistant message answers.
    pub parent_id: String,
    /// Timestamps.
    pub time: MessageTime,
    /// True on a compaction summary (assistant only).
    pub summary: bool,
    /// Deprecated OpenCode mode, kept for round trips.
    pub mode: String,
    /// Agent name (`build`, `plan`, `compaction`, ...).
    pub agent: String,
    /// Finish reason; non-empty on a finished assistant message.
    pub finish: String,
    /// Usage of the message's last request.
    pub tokens: Option<TokenUsage>,
    /// Cost in the provider's currency.
    #[serde(with = "crate::config::float")]
    pub cost: f64,
    /// Set when the message failed.
    pub error: Option<MessageError>,
    /// Model used.
    pub model: Option<ModelRef>,
    /// Unmodelled fields.
    pub extra: Extra,
}

impl MessageInfo {
    /// A bare message of the given role, for builders and tests.
    pub fn new(id: impl Into<String>, role: Role) -> MessageInfo {
        MessageInfo {
            id: id.into(),
            role,
            parent_id: String::new(),
            time: MessageTime::default(),
            summary: false,
            mode: String::new(),
            agent: String::new(),
            finish: String::new(),
            tokens: None,
            cost: 0.0,
            error: None,
            model: None,
            extra: Extra::new(),
        }
    }

    /// An assistant message is finished once it has a completion time or a finish reason.
    pub fn is_finished(&self) -> bool {
        self.role == Role::Assistant && (self.time.completed.is_some() || !self.finish.is_empty())
    }

    /// The summary flag only means "compaction summary" on assistant messages.
    pub fn is_summary(&self) -> bool {
        self.role == Role::Assistant && self.summary
    }

    /// A completed summary closes a compaction (seed 02 `filterCompacted`).
    pub fn is_completed_summary(&self) -> bool {
        self.is_summary() && !self.finish.is_empty() && self.error.is_none()
    }
}
