//! Bytes a session holds, kept as a running figure so the memory limits cost O(1) per
//! update: each part's figure is computed once when it is written (like its token
//! estimate) and subtracted exactly when it is replaced or deleted.
//!
//! The figure is the values' heap ([`HeapSize`]) plus their inline size plus a per-entry
//! allowance for the indexes built over them (the message id map, the prune window, the
//! strategies' tracker). `tests/memory.rs` checks it against a counting allocator.

use std::mem::size_of;

use super::error::ApplyError;
use super::session::Update;
use super::session::{Message, Session, StoredPart};
use crate::config::EngineConfig;
use crate::domain::{
    HeapSize, MessageInfo, Part, SessionInfo, hash_capacity_after_insert, hash_table_bytes,
    vec_capacity_after_push,
};

/// Index bytes per part: the prune window entry and the strategies' tracker entries (a
/// key per file path, call hash or query, and the holders' positions).
const PART_INDEX_BYTES: usize = 96;

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
/// the vector's capacity).
pub(crate) fn part_bytes(part: &Part) -> u64 {
    (part.heap_bytes() + PART_INDEX_BYTES) as u64
}

/// Heap bytes one message's info holds, with the copy of its id in the id map (its slot
/// in the message vector and the map's table are counted by capacity).
pub(crate) fn message_bytes(info: &MessageInfo) -> u64 {
    (info.heap_bytes() + info.id.len()) as u64
}

/// Bytes of `slots` parts in message part vectors.
pub(crate) fn part_slots_bytes(slots: usize) -> u64 {
    (slots * size_of::<StoredPart>()) as u64
}

/// Part slots a message's vector gains when one more part is pushed.
pub(crate) fn part_slot_growth(parts: &[StoredPart], capacity: usize) -> usize {
    vec_capacity_after_push(parts.len(), capacity, size_of::<StoredPart>()) - capacity
}

/// Bytes an empty session holds: the value, its info and its resolved settings.
pub(crate) fn session_bytes(info: &SessionInfo, settings: &EngineConfig) -> u64 {
    (size_of::<Session>() + info.heap_bytes() + settings_heap(settings)) as u64
}

fn settings_heap(s: &EngineConfig) -> usize {
    s.protected_tools.heap_bytes()
        + s.placeholder.heap_bytes()
        + s.auto_continue.heap_bytes()
        + s.strategy_protected_tools.heap_bytes()
        + s.protected_file_globs.heap_bytes()
        + s.snapshot_tools.heap_bytes()
}

impl Session {
    /// Bytes this session holds (messages, parts, indexes), kept up to date by `apply`.
    /// O(1): the content is a running figure, the containers are read off their capacity.
    pub fn held_bytes(&self) -> u64 {
        self.bytes + self.container_bytes()
    }

    /// The top-level vectors and maps, by capacity (what is really allocated), with
    /// `part_slots` slots in the part vectors.
    fn container_bytes_with(&self, part_slots: usize) -> u64 {
        let messages = self.messages.capacity() * size_of::<Message>();
        let by_id = hash_table_bytes(self.by_id.capacity(), size_of::<(String, usize)>());
        let users = self.users.capacity() * size_of::<usize>();
        (messages + by_id + users) as u64 + part_slots_bytes(part_slots)
    }

    fn container_bytes(&self) -> u64 {
        self.container_bytes_with(self.part_slots)
    }

    /// Bytes the top-level containers grow by when one more message (a user message if
    /// `user`) is inserted: the limits check it before the insert.
    pub(crate) fn message_slot_growth(&self, user: bool) -> u64 {
        self.containers_growth(1, usize::from(user))
    }

    /// Bytes the top-level containers grow by when `messages` more messages, `users` of
    /// them user messages, are inserted.
    fn containers_growth(&self, messages: usize, users: usize) -> u64 {
        let grow = |len: usize, cap: usize, n: usize, elem: usize| {
            let mut c = cap;
            for k in 0..n {
                c = vec_capacity_after_push(len + k, c, elem);
            }
            (c - cap) * elem
        };
        let (m, u) = (&self.messages, &self.users);
        let vectors = grow(m.len(), m.capacity(), messages, size_of::<Message>())
            + grow(u.len(), u.capacity(), users, size_of::<usize>());
        let slot = size_of::<(String, usize)>();
        let mut cap = self.by_id.capacity();
        for k in 0..messages {
            cap = hash_capacity_after_insert(self.by_id.len() + k, cap);
        }
        let by_id = hash_table_bytes(cap, slot) - hash_table_bytes(self.by_id.capacity(), slot);
        (vectors + by_id) as u64
    }

    /// Sets the most bytes the session may hold after the next updates. The store sets it
    /// before each job from `max_session_bytes` and what is left of `memory_budget`.
    pub fn set_byte_limit(&mut self, limit: ByteLimit) {
        self.byte_limit = limit;
    }

    /// Refuses an update that would replace `old` held bytes with `new` beyond the limit.
    /// Shrinking is always allowed, so a session over its limit can still be cleaned up.
    pub(crate) fn check_growth(&self, field: &str, old: u64, new: u64) -> Result<(), ApplyError> {
        if new <= old {
            return Ok(());
        }
        let held = self.held_bytes();
        let after = held.saturating_sub(old).saturating_add(new);
        let limit = self.byte_limit;
        if after <= limit.bytes {
            return Ok(());
        }
        let hint = match limit.name {
            "memory_budget" => "delete sessions or raise --memory-budget",
            // Compaction keeps the history (it adds a summary), so it frees nothing here.
            _ => "delete parts or the session, or raise --max-session-bytes",
        };
        Err(ApplyError::exhausted(
            field,
            format!(
                "{} ({} bytes) reached: this update adds {} bytes to a session holding {}; {hint}",
                limit.name,
                limit.value,
                new - old,
                held,
            ),
        ))
    }

    /// [`Self::held_bytes`] recounted over every message and part (tests check the
    /// running figure against it).
    #[cfg(test)]
    pub(crate) fn held_bytes_from_scratch(&self) -> u64 {
        let content: u64 = self
            .messages
            .iter()
            .map(|m| {
                message_bytes(&m.info) + m.parts.iter().map(|p| part_bytes(&p.part)).sum::<u64>()
            })
            .sum();
        let slots: usize = self.messages.iter().map(|m| m.parts.capacity()).sum();
        session_bytes(&self.info, &self.settings) + content + self.container_bytes_with(slots)
    }

    /// At most the bytes `updates` add to this session when applied in order (new messages
    /// and parts only; replacing an info counts it again): the containers' growth for the
    /// new messages included.
    pub(crate) fn growth_of(&self, updates: &[Update]) -> u64 {
        let mut content = 0u64;
        let (mut messages, mut users) = (0usize, 0usize);
        let mut fresh = std::collections::HashMap::new();
        for u in updates {
            match u {
                Update::UpsertMessage(info) => {
                    content += message_bytes(info);
                    if self.position(&info.id).is_none()
                        && fresh.insert(info.id.as_str(), (0usize, 0usize)).is_none()
                    {
                        messages += 1;
                        users += usize::from(info.role == crate::domain::Role::User);
                    }
                }
                Update::UpsertPart(p) => {
                    content += part_bytes(p);
                    if let Some((len, cap)) = fresh.get_mut(p.message_id.as_str()) {
                        // A new message's part vector (length, capacity) as the pushes grow it.
                        let grown = vec_capacity_after_push(*len, *cap, size_of::<StoredPart>());
                        content += part_slots_bytes(grown - *cap);
                        (*len, *cap) = (*len + 1, grown);
                    } else if let Some(i) = self.position(&p.message_id) {
                        let parts = &self.messages[i].parts;
                        content += part_slots_bytes(part_slot_growth(parts, parts.capacity()));
                    }
                }
                _ => {}
            }
        }
        content + self.containers_growth(messages, users)
    }

    /// Moves the held-bytes figure from `old` to `new`.
    pub(crate) fn adjust_bytes(&mut self, old: u64, new: u64) {
        self.bytes = self.bytes.saturating_sub(old).saturating_add(new);
    }
}
