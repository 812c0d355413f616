//! What one value costs in bytes, computed once when it is written: a part, a message's
//! info, a session's info and settings, part vector slots. The running figure and the
//! limit checks are in `memory.rs`; these are the pure sizes it adds up.
//!
//! The figure is the values' heap ([`HeapSize`]) plus their inline size plus a per-entry
//! allowance for the indexes built over them (the message id map, the prune window, the
//! strategies' tracker). `tests/memory.rs` checks it against a counting allocator.

use std::mem::size_of;

use super::stored::StoredPart;
use super::strategies::change_bytes;
use crate::config::EngineConfig;
use crate::domain::{HeapSize, MessageInfo, Part, PartKind, SessionInfo, vec_capacity_after_push};

/// Index bytes per part: the prune window entry and the strategies' tracker entries (a
/// key per file path, call hash or query, and the holders' positions).
const PART_INDEX_BYTES: usize = 96;

/// Bytes per pin beyond its part id: its slot in the pin sets and their share of a
/// per-message set (an allowance, like [`PART_INDEX_BYTES`]).
const PIN_ENTRY_BYTES: usize = 64;

/// The most bytes a session may hold after an update, and the limit that says so.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ByteLimit {
    /// Bytes the session may hold.
    pub bytes: u64,
    /// The limit's config key (`max_session_bytes`, `memory_budget`), for the error.
    pub name: &'static str,
    /// The limit's configured value, for the error.
    pub value: u64,
}

impl ByteLimit {
    /// No limit.
    pub const NONE: ByteLimit = ByteLimit {
        bytes: u64::MAX,
        name: "",
        value: 0,
    };
}

impl Default for ByteLimit {
    fn default() -> Self {
        ByteLimit::NONE
    }
}

/// Heap bytes one stored part holds (its slot in the message's part vector is counted by
/// the vector's capacity), with what the strategies may hold for it beyond
/// [`PART_INDEX_BYTES`]: a change's entry per file it names (`supersedeWrites`).
pub(crate) fn part_bytes(part: &Part) -> u64 {
    let tracked = match &part.kind {
        PartKind::Tool(t) => change_bytes(&t.tool, &t.state.input),
        _ => 0,
    };
    (part.heap_bytes() + PART_INDEX_BYTES + tracked) as u64
}

/// Heap bytes one message's info holds, with the copy of its id in the id map (its slot
/// in the message vector and the map's table are counted by capacity).
pub(crate) fn message_bytes(info: &MessageInfo) -> u64 {
    (info.heap_bytes() + info.id.len()) as u64
}

/// Bytes one pin holds: a message's (`None`) or a part's, with its copy of the part id.
pub(crate) fn pin_bytes(part_id: Option<&str>) -> u64 {
    (PIN_ENTRY_BYTES + part_id.map_or(0, str::len)) as u64
}

/// Bytes of `slots` parts in message part vectors.
pub(crate) fn part_slots_bytes(slots: usize) -> u64 {
    (slots * size_of::<StoredPart>()) as u64
}

/// Part slots a message's vector gains when one more part is pushed.
pub(crate) fn part_slot_growth(parts: &[StoredPart], capacity: usize) -> usize {
    vec_capacity_after_push(parts.len(), capacity, size_of::<StoredPart>()) - capacity
}

/// Heap bytes of a session's info and resolved settings (the session adds its own size).
pub(crate) fn info_bytes(info: &SessionInfo, settings: &EngineConfig) -> u64 {
    (info.heap_bytes() + settings_heap(settings)) as u64
}

fn settings_heap(s: &EngineConfig) -> usize {
    s.protected_tools.heap_bytes()
        + s.placeholder.heap_bytes()
        + s.auto_continue.heap_bytes()
        + s.strategy_protected_tools.heap_bytes()
        + s.protected_file_globs.heap_bytes()
        + s.snapshot_tools.heap_bytes()
}
