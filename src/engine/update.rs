//! The updates a session accepts and what applying one did. Plain values shared by the
//! session, the memory limits (which size an update before it is applied) and every
//! caller of [`crate::engine::step`].

use serde::{Deserialize, Serialize};

use crate::domain::{MessageInfo, Part, SessionInfo, TokenUsage};

/// One change to a session, already validated for shape by the boundary that decoded it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Update {
    /// Open the session or change its title, model, limits, overrides and todos.
    Configure(SessionInfo),
    /// Insert a message, or update it in place (position of first arrival is kept).
    UpsertMessage(MessageInfo),
    /// Insert a part at the end of its message, or update it in place.
    UpsertPart(Part),
    /// Remove a part.
    DeletePart {
        /// Owning message.
        message_id: String,
        /// Part to remove.
        part_id: String,
    },
    /// Provider usage of the latest request; optionally stored on an assistant message.
    ReportUsage {
        /// Assistant message to store the usage on.
        message_id: Option<String>,
        /// The usage.
        tokens: TokenUsage,
    },
    /// Pin (or unpin) a part, or a whole message: a pinned part is never pruned or
    /// marked by a strategy and is carried verbatim through compaction.
    Pin {
        /// The message pinned, or the one holding the part.
        message_id: String,
        /// The part; `None` pins the whole message (every part, now and later).
        part_id: Option<String>,
        /// True pins, false unpins.
        pinned: bool,
    },
}

impl Update {
    /// Short name for logs, acks and metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Update::Configure(_) => "open",
            Update::UpsertMessage(_) => "upsert_message",
            Update::UpsertPart(_) => "upsert_part",
            Update::DeletePart { .. } => "delete_part",
            Update::ReportUsage { .. } => "report_usage",
            Update::Pin { .. } => "pin",
        }
    }
}

/// What an applied update did, so the caller knows which checks to run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Applied {
    /// A new session, message or part was created.
    pub created: bool,
    /// An assistant message became finished (triggers overflow check and auto prune).
    pub finished: bool,
    /// New provider usage was recorded (triggers an overflow check).
    pub usage_reported: bool,
    /// The finished message is a compaction summary (never triggers another compaction).
    pub summary: bool,
    /// A new user message arrived, written at this host time (the scheduler checks
    /// whether the prompt cache has expired since the last request).
    pub user_at: Option<i64>,
}
