//! Bytes a session holds, kept as a running figure so the memory limits cost O(1) per
//! update: each part's figure is computed once when it is written (like its token
//! estimate, see `footprint.rs`) and subtracted exactly when it is replaced or deleted.
//! Here: the figure with the containers read off their capacity, and the limit checks.

use std::mem::size_of;

use super::error::ApplyError;
use super::footprint::{message_bytes, part_bytes, part_slot_growth, part_slots_bytes};
use super::session::Session;
use super::stored::{Message, StoredPart};
use super::update::Update;
use crate::domain::{
    FastMap, hash_capacity_after_insert, hash_table_bytes, vec_capacity_after_push,
};

impl Session {
    /// Bytes this session holds (messages, parts, indexes), kept up to date by `apply`.
    /// O(1): the content is a running figure, the containers are read off their capacity.
    pub fn held_bytes(&self) -> u64 {
        self.totals().bytes().saturating_add(self.container_bytes())
    }

    /// The top-level vectors and maps, by capacity (what is really allocated), with
    /// `part_slots` slots in the part vectors.
    fn container_bytes_with(&self, part_slots: usize) -> u64 {
        let (messages, users) = self.capacities();
        let messages = messages * size_of::<Message>();
        let by_id = hash_table_bytes(self.ids().capacity(), size_of::<(String, usize)>());
        let users = users * size_of::<usize>();
        (messages + by_id + users) as u64 + part_slots_bytes(part_slots) + self.index_bytes()
    }

    fn container_bytes(&self) -> u64 {
        self.container_bytes_with(self.totals().part_slots())
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
        let (m_cap, u_cap) = self.capacities();
        let (i_len, i_cap) = self.index_len_capacity();
        let vectors = grow(self.messages().len(), m_cap, messages, size_of::<Message>())
            + grow(self.users().len(), u_cap, users, size_of::<usize>())
            + grow(i_len, i_cap, messages, size_of::<i64>());
        let slot = size_of::<(String, usize)>();
        let mut cap = self.ids().capacity();
        for k in 0..messages {
            cap = hash_capacity_after_insert(self.ids().len() + k, cap);
        }
        let by_id = hash_table_bytes(cap, slot) - hash_table_bytes(self.ids().capacity(), slot);
        (vectors + by_id) as u64
    }

    /// Refuses an update that would replace `old` held bytes with `new` beyond the limit.
    /// Shrinking is always allowed, so a session over its limit can still be cleaned up.
    pub(crate) fn check_growth(&self, field: &str, old: u64, new: u64) -> Result<(), ApplyError> {
        if new <= old {
            return Ok(());
        }
        let held = self.held_bytes();
        let after = held.saturating_sub(old).saturating_add(new);
        let limit = self.byte_limit();
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
            .messages()
            .iter()
            .map(|m| {
                message_bytes(&m.info) + m.parts.iter().map(|p| part_bytes(&p.part)).sum::<u64>()
            })
            .sum();
        let slots: usize = self.messages().iter().map(|m| m.parts.capacity()).sum();
        let empty = size_of::<Session>() as u64
            + super::footprint::info_bytes(self.info(), self.settings());
        empty + content + self.pins().bytes() + self.container_bytes_with(slots)
    }

    /// At most the bytes `updates` add to this session when applied in order (new messages
    /// and parts only; replacing an info counts it again): the containers' growth for the
    /// new messages included.
    pub(crate) fn growth_of(&self, updates: &[Update]) -> u64 {
        let mut content = 0u64;
        let (mut messages, mut users) = (0usize, 0usize);
        let mut fresh = FastMap::default();
        // Parts that may be new (an upper bound: replacements are counted too).
        let mut new_parts = 0usize;
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
                    new_parts += 1;
                    if let Some((len, cap)) = fresh.get_mut(p.message_id.as_str()) {
                        // A new message's part vector (length, capacity) as the pushes grow it.
                        let grown = vec_capacity_after_push(*len, *cap, size_of::<StoredPart>());
                        content += part_slots_bytes(grown - *cap);
                        (*len, *cap) = (*len + 1, grown);
                    } else if let Some(i) = self.position(&p.message_id) {
                        let parts = &self.messages()[i].parts;
                        content += part_slots_bytes(part_slot_growth(parts, parts.capacity()));
                    }
                }
                _ => {}
            }
        }
        content
            .saturating_add(self.containers_growth(messages, users))
            .saturating_add(self.part_index_growth(new_parts))
    }
}
