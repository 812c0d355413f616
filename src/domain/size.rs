//! Heap bytes of the session values, for the memory limits (`max_session_bytes`,
//! `memory_budget`) and the `compactd_bytes_held` metric.
//!
//! [`HeapSize::heap_bytes`] is what a value owns behind pointers: string and vector
//! capacities, boxed structs, JSON trees. The inline size of the value itself is the
//! owner's to add (`size_of`), so a struct is never counted twice. JSON objects count
//! their entries plus the hash index of the `preserve_order` map; allocator rounding is
//! not modelled (the memory test compares the figure against a counting allocator).

use std::mem::size_of;

use serde_json::Value;

use super::{
    AgentPart, CompactionPart, FilePart, MessageError, MessageInfo, ModelRef, Part, PartKind,
    PatchPart, ReasoningPart, RetryPart, SessionInfo, StepFinishPart, SubtaskPart, TextPart, Todo,
    ToolPart, ToolState,
};

/// Bytes a value owns on the heap (not counting its own inline size).
pub trait HeapSize {
    /// Heap bytes owned by `self`.
    fn heap_bytes(&self) -> usize;
}

impl HeapSize for String {
    fn heap_bytes(&self) -> usize {
        self.capacity()
    }
}

impl<T: HeapSize> HeapSize for Vec<T> {
    fn heap_bytes(&self) -> usize {
        self.capacity() * size_of::<T>() + self.iter().map(HeapSize::heap_bytes).sum::<usize>()
    }
}

impl<T: HeapSize> HeapSize for Option<T> {
    fn heap_bytes(&self) -> usize {
        self.as_ref().map_or(0, HeapSize::heap_bytes)
    }
}

impl<T: HeapSize> HeapSize for Box<T> {
    fn heap_bytes(&self) -> usize {
        size_of::<T>() + (**self).heap_bytes()
    }
}

impl HeapSize for Value {
    fn heap_bytes(&self) -> usize {
        match self {
            Value::Null | Value::Bool(_) | Value::Number(_) => 0,
            Value::String(s) => s.heap_bytes(),
            Value::Array(a) => a.heap_bytes(),
            Value::Object(m) => m.heap_bytes(),
        }
    }
}

/// An `IndexMap` entry: the hash, the key and the value.
const MAP_ENTRY: usize = size_of::<u64>() + size_of::<String>() + size_of::<Value>();

/// Bytes of the two tables of an `IndexMap` (serde_json's `preserve_order` map) of `n`
/// entries: hashbrown's index (a power-of-two of buckets, 7/8 full at most, one `usize`
/// and one control byte each, plus a group of control bytes) and the entry vector, which
/// indexmap grows to the index's capacity.
fn index_map_bytes(n: usize) -> usize {
    if n == 0 {
        return 0;
    }
    let capacity = hash_capacity(hash_buckets(n));
    hash_table_bytes(capacity, size_of::<usize>()) + capacity * MAP_ENTRY
}

/// hashbrown's bucket count for `n` items (a power of two, at most 7/8 full).
fn hash_buckets(n: usize) -> usize {
    if n < 4 {
        4
    } else if n < 8 {
        8
    } else {
        (n * 8 / 7).next_power_of_two()
    }
}

/// Items a hashbrown table of `buckets` holds before it grows.
fn hash_capacity(buckets: usize) -> usize {
    if buckets < 8 {
        buckets - 1
    } else {
        buckets / 8 * 7
    }
}

/// Bytes of a hashbrown table whose `capacity()` is `capacity`, with `slot`-byte entries:
/// a slot and a control byte per bucket plus one group of control bytes.
pub(crate) fn hash_table_bytes(capacity: usize, slot: usize) -> usize {
    if capacity == 0 {
        return 0;
    }
    let buckets = if capacity < 7 {
        capacity + 1
    } else {
        capacity * 8 / 7
    };
    buckets * (slot + 1) + 16
}

/// The `capacity()` of a hashbrown table holding `len` items in `capacity` after one more
/// insert.
pub(crate) fn hash_capacity_after_insert(len: usize, capacity: usize) -> usize {
    if len < capacity {
        capacity
    } else {
        hash_capacity(hash_buckets(len + 1))
    }
}

/// The capacity of a `Vec` of `elem`-byte items holding `len` in `capacity` after one
/// more push (std's amortized doubling, with its minimum first allocation).
pub(crate) fn vec_capacity_after_push(len: usize, capacity: usize, elem: usize) -> usize {
    if len < capacity {
        return capacity;
    }
    let min = match elem {
        1 => 8,
        2..=1024 => 4,
        _ => 1,
    };
    (capacity * 2).max(len + 1).max(min)
}

impl HeapSize for serde_json::Map<String, Value> {
    fn heap_bytes(&self) -> usize {
        index_map_bytes(self.len())
            + self
                .iter()
                .map(|(k, v)| k.heap_bytes() + v.heap_bytes())
                .sum::<usize>()
    }
}

impl HeapSize for Part {
    /// The strategy mark is compactd's own bookkeeping (a strategy name and a call id) and
    /// is counted inline only, so a part's figure does not change when a strategy marks it.
    fn heap_bytes(&self) -> usize {
        self.id.heap_bytes()
            + self.message_id.heap_bytes()
            + self.kind.heap_bytes()
            + self.extra.heap_bytes()
    }
}

impl HeapSize for PartKind {
    fn heap_bytes(&self) -> usize {
        match self {
            PartKind::Text(p) => p.heap_bytes(),
            PartKind::Reasoning(p) => p.heap_bytes(),
            PartKind::Tool(p) => p.heap_bytes(),
            PartKind::StepStart { snapshot } | PartKind::Snapshot { snapshot } => {
                snapshot.heap_bytes()
            }
            PartKind::StepFinish(p) => p.heap_bytes(),
            PartKind::File(p) => p.heap_bytes(),
            PartKind::Patch(p) => p.heap_bytes(),
            PartKind::Agent(p) => p.heap_bytes(),
            PartKind::Subtask(p) => p.heap_bytes(),
            PartKind::Retry(p) => p.heap_bytes(),
            PartKind::Compaction(p) => p.heap_bytes(),
        }
    }
}

impl HeapSize for TextPart {
    fn heap_bytes(&self) -> usize {
        self.text.heap_bytes() + self.metadata.heap_bytes()
    }
}

impl HeapSize for ReasoningPart {
    fn heap_bytes(&self) -> usize {
        self.text.heap_bytes() + self.metadata.heap_bytes()
    }
}

impl HeapSize for ToolPart {
    fn heap_bytes(&self) -> usize {
        self.call_id.heap_bytes()
            + self.tool.heap_bytes()
            + self.state.heap_bytes()
            + self.metadata.heap_bytes()
    }
}

impl HeapSize for ToolState {
    fn heap_bytes(&self) -> usize {
        self.input.heap_bytes()
            + self.output.heap_bytes()
            + self.error.heap_bytes()
            + self.title.heap_bytes()
            + self.metadata.heap_bytes()
            + self.attachments.heap_bytes()
            + self.raw.heap_bytes()
    }
}

impl HeapSize for StepFinishPart {
    fn heap_bytes(&self) -> usize {
        self.reason.heap_bytes() + self.snapshot.heap_bytes()
    }
}

impl HeapSize for FilePart {
    fn heap_bytes(&self) -> usize {
        self.mime.heap_bytes()
            + self.filename.heap_bytes()
            + self.url.heap_bytes()
            + self.source.heap_bytes()
    }
}

impl HeapSize for PatchPart {
    fn heap_bytes(&self) -> usize {
        self.hash.heap_bytes() + self.files.heap_bytes()
    }
}

impl HeapSize for AgentPart {
    fn heap_bytes(&self) -> usize {
        self.name.heap_bytes() + self.source.heap_bytes()
    }
}

impl HeapSize for SubtaskPart {
    fn heap_bytes(&self) -> usize {
        self.prompt.heap_bytes()
            + self.description.heap_bytes()
            + self.agent.heap_bytes()
            + self.model.heap_bytes()
            + self.command.heap_bytes()
    }
}

impl HeapSize for RetryPart {
    fn heap_bytes(&self) -> usize {
        self.error.heap_bytes()
    }
}

impl HeapSize for CompactionPart {
    fn heap_bytes(&self) -> usize {
        self.tail_start_id.heap_bytes()
    }
}

impl HeapSize for ModelRef {
    fn heap_bytes(&self) -> usize {
        self.provider_id.heap_bytes() + self.model_id.heap_bytes()
    }
}

impl HeapSize for MessageError {
    fn heap_bytes(&self) -> usize {
        self.name.heap_bytes() + self.data.heap_bytes()
    }
}

impl HeapSize for MessageInfo {
    fn heap_bytes(&self) -> usize {
        self.id.heap_bytes()
            + self.parent_id.heap_bytes()
            + self.mode.heap_bytes()
            + self.agent.heap_bytes()
            + self.finish.heap_bytes()
            + self.error.heap_bytes()
            + self.model.heap_bytes()
            + self.extra.heap_bytes()
    }
}

impl HeapSize for Todo {
    fn heap_bytes(&self) -> usize {
        self.id.heap_bytes()
            + self.content.heap_bytes()
            + self.status.heap_bytes()
            + self.priority.heap_bytes()
    }
}

impl HeapSize for SessionInfo {
    /// Overrides are small and bounded by validation; their lists are counted, the rest is
    /// inline.
    fn heap_bytes(&self) -> usize {
        let c = &self.config;
        self.id.heap_bytes()
            + self.title.heap_bytes()
            + self.model.heap_bytes()
            + self.todos.heap_bytes()
            + self.extra.heap_bytes()
            + c.compaction_model.heap_bytes()
            + c.placeholder.heap_bytes()
            + c.auto_continue.heap_bytes()
            + c.compaction_system.heap_bytes()
            + c.compaction_prompt.heap_bytes()
            + c.compaction_template.heap_bytes()
            + c.protected_tools.heap_bytes()
            + c.strategy_protected_tools.heap_bytes()
            + c.protected_file_globs.heap_bytes()
            + c.snapshot_tools.heap_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::{ToolStatus, ToolTime};

    #[test]
    fn strings_count_their_capacity() {
        let mut s = String::with_capacity(100);
        s.push('x');
        assert_eq!(s.heap_bytes(), 100);
    }

    #[test]
    fn a_tool_part_counts_its_box_and_every_text() {
        let mut state = ToolState::new(ToolStatus::Completed);
        state.output = "o".repeat(1000);
        state.title = "t".repeat(10);
        state.time = ToolTime::default();
        let part = Part {
            id: "p".repeat(20),
            message_id: "m".repeat(30),
            kind: PartKind::Tool(Box::new(ToolPart {
                call_id: "c".repeat(5),
                tool: "read".into(),
                state,
                metadata: None,
            })),
            mark: None,
            extra: Default::default(),
        };
        let bytes = part.heap_bytes();
        assert!(bytes >= 20 + 30 + 1000 + 10 + 5 + 4 + size_of::<ToolPart>());
        assert!(bytes < 20 + 30 + 1000 + 10 + 5 + 4 + size_of::<ToolPart>() + 64);
    }

    #[test]
    fn json_trees_count_keys_values_and_entries() {
        let v: Value = serde_json::json!({"path": "src/main.rs", "lines": [1, 2, 3]});
        let bytes = v.heap_bytes();
        let strings = "path".len() + "src/main.rs".len() + "lines".len();
        let array = 3 * size_of::<Value>();
        assert!(bytes >= strings + array + 2 * MAP_ENTRY, "{bytes}");
        // Two entries take a table of four buckets with room for three entries.
        assert_eq!(index_map_bytes(2), 4 * 9 + 16 + 3 * MAP_ENTRY);
        assert_eq!(index_map_bytes(0), 0);
    }

    #[test]
    fn growth_predictions_match_std() {
        let mut v: Vec<[u8; 376]> = Vec::new();
        let mut m: std::collections::HashMap<String, usize> = Default::default();
        for i in 0..200 {
            let (cap, mcap) = (v.capacity(), m.capacity());
            let (want, mwant) = (
                vec_capacity_after_push(v.len(), cap, 376),
                hash_capacity_after_insert(m.len(), mcap),
            );
            v.push([0; 376]);
            m.insert(i.to_string(), i);
            assert_eq!(v.capacity(), want, "vec at {i}");
            assert_eq!(m.capacity(), mwant, "map at {i}");
        }
    }
}
