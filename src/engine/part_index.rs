//! Where each part sits in its message, by id, so an upsert or a delete finds its part in
//! O(1) instead of scanning the message. A message may hold `max_parts_per_message`
//! parts; with a scan, importing 50 messages of 10,000 parts took over 90 s in a debug
//! build (0.26 s per 10,000-part message in release), and every new part of a long
//! message cost a full scan.
//!
//! Keys are a keyed hash of the id (foldhash seeded at random, see
//! [`crate::domain::FastState`], so a client cannot choose colliding ids), never a copy of it: an entry is 16 bytes plus the table's control
//! byte. A hit is checked against the stored part; were two ids of one message ever to
//! collide, the index says so and lookups of that message fall back to the scan.

use std::hash::BuildHasher;
use std::mem::size_of;

use super::stored::StoredPart;
use crate::domain::{FastMap, FastSet, FastState, hash_capacity_after_insert, hash_table_bytes};

/// One entry: (message position, id hash) → part position.
type Entry = ((u32, u64), u32);

/// The part positions of every message, by id.
#[derive(Debug, Clone, Default)]
pub(crate) struct PartIndex {
    map: FastMap<(u32, u64), u32>,
    hasher: FastState,
    /// Messages where two ids collided (or a position did not fit): scanned instead.
    scanned: FastSet<u32>,
}

impl PartIndex {
    fn key(&self, msg: usize, id: &str) -> Option<(u32, u64)> {
        Some((u32::try_from(msg).ok()?, self.hasher.hash_one(id)))
    }

    /// Position of part `id` in `parts`, the parts of message `msg`.
    pub(crate) fn find(&self, msg: usize, id: &str, parts: &[StoredPart]) -> Option<usize> {
        let scan = || parts.iter().position(|p| p.part.id == id);
        let Some(key) = self.key(msg, id) else {
            return scan();
        };
        if let Some(&at) = self.map.get(&key)
            && let Some(p) = parts.get(at as usize)
            && p.part.id == id
        {
            return Some(at as usize);
        }
        if self.scanned.contains(&key.0) {
            return scan();
        }
        None
    }

    /// Records that part `id` was appended at `at` in message `msg`.
    pub(crate) fn inserted(&mut self, msg: usize, id: &str, at: usize) {
        let (Some(key), Ok(at)) = (self.key(msg, id), u32::try_from(at)) else {
            self.scan(msg);
            return;
        };
        if self.map.insert(key, at).is_some() {
            // Another id of this message had the same hash: it stays findable by scan.
            self.scan(msg);
        }
    }

    /// Records that the part at `at` of message `msg` was removed; `parts` are the
    /// message's parts after the removal (the ones from `at` on moved down by one).
    pub(crate) fn removed(&mut self, msg: usize, id: &str, at: usize, parts: &[StoredPart]) {
        if let Some(key) = self.key(msg, id)
            && self.map.get(&key) == u32::try_from(at).ok().as_ref()
        {
            self.map.remove(&key);
        }
        for (i, p) in parts.iter().enumerate().skip(at) {
            if let (Some(key), Ok(i)) = (self.key(msg, &p.part.id), u32::try_from(i)) {
                self.map.insert(key, i);
            }
        }
    }

    fn scan(&mut self, msg: usize) {
        self.scanned.insert(u32::try_from(msg).unwrap_or(u32::MAX));
    }

    /// Bytes the index holds.
    pub(crate) fn capacity_bytes(&self) -> u64 {
        let entries = hash_table_bytes(self.map.capacity(), size_of::<Entry>());
        let scanned = hash_table_bytes(self.scanned.capacity(), size_of::<u32>());
        (entries + scanned) as u64
    }

    /// Bytes the index grows by when `n` more parts are inserted.
    pub(crate) fn growth(&self, n: usize) -> u64 {
        let mut cap = self.map.capacity();
        for k in 0..n {
            cap = hash_capacity_after_insert(self.map.len() + k, cap);
        }
        let slot = size_of::<Entry>();
        (hash_table_bytes(cap, slot) - hash_table_bytes(self.map.capacity(), slot)) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::{Part, PartKind, TextPart};

    fn part(id: &str) -> StoredPart {
        StoredPart {
            part: Part {
                id: id.into(),
                message_id: "m".into(),
                kind: PartKind::Text(TextPart::default()),
                mark: None,
                extra: Default::default(),
            },
            est: Default::default(),
            reduced: None,
            bytes: 0,
        }
    }

    #[test]
    fn finds_appended_parts_and_follows_removals() {
        let mut index = PartIndex::default();
        let mut parts: Vec<StoredPart> = (0..100).map(|i| part(&format!("p{i}"))).collect();
        for (i, p) in parts.iter().enumerate() {
            index.inserted(3, &p.part.id, i);
        }
        assert_eq!(index.find(3, "p42", &parts), Some(42));
        assert_eq!(index.find(3, "nope", &parts), None);
        assert_eq!(index.find(4, "p42", &parts), None, "another message");
        let gone = parts.remove(10);
        index.removed(3, &gone.part.id, 10, &parts);
        assert_eq!(index.find(3, "p10", &parts), None);
        assert_eq!(index.find(3, "p42", &parts), Some(41));
        assert_eq!(index.find(3, "p99", &parts), Some(98));
        assert!(index.capacity_bytes() > 0);
    }

    #[test]
    fn a_collision_falls_back_to_the_scan() {
        let mut index = PartIndex::default();
        let parts = vec![part("a"), part("b")];
        index.inserted(0, "a", 0);
        // As if "b" hashed like "a": its insert finds the key taken.
        let key = index.key(0, "a").expect("key");
        index.map.insert(key, 0);
        index.scan(0);
        assert_eq!(index.find(0, "b", &parts), Some(1), "found by the scan");
    }
}
