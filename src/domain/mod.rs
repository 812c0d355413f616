//! Domain types of a session, mirroring OpenCode's message model: session info, message
//! `info` and `parts`. They are plain values: no wire format (prost types stop in
//! `server/`), no I/O and no behaviour beyond small accessors. The behaviour lives in
//! `engine/`.

mod hash;
mod info;
mod message;
mod part;
mod size;
mod validate;

pub use hash::{FastMap, FastSet, FastState};
pub use info::{ModelLimits, ModelRef, SessionInfo, Todo};
pub use message::{MessageError, MessageInfo, MessageTime, Role, TokenUsage};
pub use part::{
    AgentPart, CompactionPart, FilePart, Part, PartKind, PartTime, PatchPart, ReasoningPart,
    RetryPart, StepFinishPart, StrategyMark, SubtaskPart, TextPart, ToolPart, ToolState,
    ToolStatus, ToolTime,
};
pub use size::HeapSize;
pub(crate) use size::{hash_capacity_after_insert, hash_table_bytes, vec_capacity_after_push};
pub use validate::{
    InvalidField, MAX_ID_BYTES, MAX_JSON_DEPTH, MAX_TITLE_BYTES, check_id, check_optional_id,
    clip_title,
};

/// JSON object holding fields compactd does not model, kept so nothing a host sent is lost.
pub type Extra = serde_json::Map<String, serde_json::Value>;
