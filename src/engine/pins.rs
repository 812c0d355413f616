//! Pins: parts a host wants kept verbatim. A pinned part is never cleared by prune (the
//! window skips it like a protected tool's output, `prune_index.rs`), never marked by a
//! strategy (`strategies/commit.rs`), and is carried verbatim into the context after a
//! compaction (`context.rs`). Pinning a message pins every part it holds, now and later.
//! `pinning.rs` applies the pin updates.
//!
//! Pins are keyed by message position (positions never change) and part id, so the check
//! prune and the strategies make per part is one hash lookup, and none when nothing is
//! pinned.

use serde::{Deserialize, Serialize};

use crate::domain::{FastMap, FastSet};

/// The pinned messages and parts of one session.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(into = "PinsRepr", try_from = "PinsRepr")]
pub(crate) struct Pins {
    /// Positions of pinned messages: every part they hold is pinned.
    messages: FastSet<usize>,
    /// Pinned part ids, by the position of their message.
    parts: FastMap<usize, FastSet<String>>,
}

/// How pins are stored: sorted lists (the sets' order is not stable).
#[derive(Serialize, Deserialize)]
struct PinsRepr {
    messages: Vec<usize>,
    parts: Vec<(usize, Vec<String>)>,
}

impl From<Pins> for PinsRepr {
    fn from(p: Pins) -> PinsRepr {
        let mut messages: Vec<usize> = p.messages.into_iter().collect();
        messages.sort_unstable();
        let mut parts: Vec<(usize, Vec<String>)> = p
            .parts
            .into_iter()
            .map(|(m, ids)| {
                let mut ids: Vec<String> = ids.into_iter().collect();
                ids.sort_unstable();
                (m, ids)
            })
            .collect();
        parts.sort_unstable();
        PinsRepr { messages, parts }
    }
}

impl TryFrom<PinsRepr> for Pins {
    type Error = &'static str;

    /// Refuses what no session holds: a message twice, an empty part set.
    fn try_from(r: PinsRepr) -> Result<Pins, Self::Error> {
        let mut pins = Pins::default();
        for m in r.messages {
            if !pins.insert(m, None) {
                return Err("a pinned message is listed twice");
            }
        }
        for (m, ids) in r.parts {
            if ids.is_empty() || pins.parts.contains_key(&m) {
                return Err("a message's pinned parts are empty or listed twice");
            }
            for id in ids {
                if !pins.insert(m, Some(&id)) {
                    return Err("a pinned part is listed twice");
                }
            }
        }
        Ok(pins)
    }
}

impl Pins {
    /// The positions of the messages holding a pin (to check them against the session).
    pub(crate) fn positions(&self) -> impl Iterator<Item = usize> + '_ {
        self.messages.iter().chain(self.parts.keys()).copied()
    }

    /// Every pin: the message's position, and the part's id (`None`: the whole message).
    pub(crate) fn each(&self) -> impl Iterator<Item = (usize, Option<&str>)> + '_ {
        let messages = self.messages.iter().map(|&m| (m, None));
        let parts = self
            .parts
            .iter()
            .flat_map(|(&m, ids)| ids.iter().map(move |id| (m, Some(id.as_str()))));
        messages.chain(parts)
    }

    /// True when nothing is pinned.
    pub(crate) fn is_empty(&self) -> bool {
        self.messages.is_empty() && self.parts.is_empty()
    }

    /// True when the part is pinned, by itself or through its message.
    pub(crate) fn covers(&self, msg: usize, part_id: &str) -> bool {
        !self.is_empty()
            && (self.messages.contains(&msg)
                || self.parts.get(&msg).is_some_and(|p| p.contains(part_id)))
    }

    /// True when exactly this pin (the message's with `None`, else the part's) is set.
    pub(crate) fn holds(&self, msg: usize, part_id: Option<&str>) -> bool {
        match part_id {
            None => self.messages.contains(&msg),
            Some(id) => self.parts.get(&msg).is_some_and(|p| p.contains(id)),
        }
    }

    /// Sets the pin; false when it was set already.
    pub(crate) fn insert(&mut self, msg: usize, part_id: Option<&str>) -> bool {
        match part_id {
            None => self.messages.insert(msg),
            Some(id) => self.parts.entry(msg).or_default().insert(id.to_string()),
        }
    }

    /// Clears the pin; false when it was not set.
    pub(crate) fn remove(&mut self, msg: usize, part_id: Option<&str>) -> bool {
        match part_id {
            None => self.messages.remove(&msg),
            Some(id) => {
                let Some(ids) = self.parts.get_mut(&msg) else {
                    return false;
                };
                let removed = ids.remove(id);
                if ids.is_empty() {
                    self.parts.remove(&msg);
                }
                removed
            }
        }
    }

    /// Positions below `end` of the messages holding a pin, ascending. O(pins).
    pub(crate) fn holders_below(&self, end: usize) -> Vec<usize> {
        let mut out: Vec<usize> = self
            .messages
            .iter()
            .chain(self.parts.keys())
            .copied()
            .filter(|&m| m < end)
            .collect();
        out.sort_unstable();
        out.dedup();
        out
    }

    /// Bytes the pins hold, recounted (the session keeps it as a running figure; a
    /// restored session starts from this).
    pub(crate) fn bytes(&self) -> u64 {
        use super::footprint::pin_bytes;
        let messages = (self.messages.len() as u64).saturating_mul(pin_bytes(None));
        self.parts
            .values()
            .flatten()
            .map(|id| pin_bytes(Some(id)))
            .fold(messages, u64::saturating_add)
    }
}
