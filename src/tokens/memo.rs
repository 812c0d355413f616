//! A thread's memory of the short pieces it counted lately. Agent output repeats itself
//! (the same words, paths, punctuation and indentation, line after line), and the BPE
//! count of one piece (an encoder with two buffers, a leftmost-longest search, perhaps
//! backtracking) costs several times a hash and a compare of its bytes. On the shared
//! traces about 84% of pieces are found here; on the server's counting threads it also
//! spares the allocator two buffers per piece, which the threads contend for.
//!
//! Exact by construction: a slot holds a piece's bytes and the count the BPE gave them,
//! and answers only for those very bytes. Direct-mapped: a piece takes its hash's slot
//! from whatever held it, so a hash collision costs a count, never a wrong one.

use std::hash::BuildHasher;

use bpe_openai::byte_pair_encoding::BytePairEncoding;
use foldhash::fast::RandomState;

/// Slots per table (a power of two): 112 KiB per thread and vocabulary.
const SLOTS: usize = 4096;
/// Pieces up to this many bytes are remembered; longer ones are rare and counted.
const LONGEST: usize = 23;

/// One remembered piece.
#[derive(Clone, Copy)]
struct Slot {
    /// The piece's length; 0 marks an empty slot (no piece is empty).
    len: u8,
    bytes: [u8; LONGEST],
    tokens: u32,
}

const EMPTY: Slot = Slot {
    len: 0,
    bytes: [0; LONGEST],
    tokens: 0,
};

/// Counts of recently seen pieces, for one vocabulary on one thread.
pub(super) struct Memo {
    slots: Box<[Slot]>,
    /// Seeded at random: the pieces are a client's text.
    state: RandomState,
}

impl Memo {
    /// An empty memory.
    pub(super) fn new() -> Memo {
        Memo::with_slots(SLOTS)
    }

    /// A small memory, for a count that cannot use its thread's (a thread being torn
    /// down, or a count inside a count): not worth a full table for one text.
    pub(super) fn small() -> Memo {
        Memo::with_slots(64)
    }

    /// `slots` is rounded up to a power of two, so a hash masks to a slot.
    fn with_slots(slots: usize) -> Memo {
        Memo {
            slots: vec![EMPTY; slots.max(1).next_power_of_two()].into_boxed_slice(),
            state: RandomState::default(),
        }
    }

    /// Tokens of `piece` under `bpe`: remembered, or counted and remembered.
    pub(super) fn count(&mut self, bpe: &BytePairEncoding, piece: &[u8]) -> usize {
        let len = match u8::try_from(piece.len()) {
            Ok(len @ 1..) if piece.len() <= LONGEST => len,
            _ => return bpe.count(piece),
        };
        let mask = self.slots.len().saturating_sub(1);
        let at = usize::try_from(self.state.hash_one(piece)).unwrap_or_default() & mask;
        let Some(slot) = self.slots.get_mut(at) else {
            return bpe.count(piece);
        };
        let held = slot.bytes.get(..piece.len());
        if slot.len == len && held == Some(piece) {
            return slot.tokens as usize;
        }
        let tokens = bpe.count(piece);
        if let (Ok(t), Some(bytes)) = (u32::try_from(tokens), slot.bytes.get_mut(..piece.len())) {
            bytes.copy_from_slice(piece);
            slot.len = len;
            slot.tokens = t;
        }
        tokens
    }
}

impl std::fmt::Debug for Memo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let held = self.slots.iter().filter(|s| s.len > 0).count();
        f.debug_struct("Memo").field("held", &held).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_only_for_the_same_bytes() {
        let bpe = &bpe_openai::o200k_base().bpe;
        let mut memo = Memo::new();
        for piece in [
            " the",
            " the",
            "1234",
            " tokenization",
            "\n\n",
            " the",
            "é",
            "",
        ] {
            let b = piece.as_bytes();
            assert_eq!(memo.count(bpe, b), bpe.count(b), "{piece:?}");
        }
        // A tiny table: every piece shares one of two slots, so pieces keep evicting each
        // other and a stale slot must never answer for another piece.
        let mut small = Memo::with_slots(2);
        assert_eq!(small.slots.len(), 2);
        let pieces: Vec<String> = (0..500).map(|i| format!(" w{i}x")).collect();
        for round in 0..2 {
            for p in &pieces {
                let b = p.as_bytes();
                assert_eq!(small.count(bpe, b), bpe.count(b), "round {round}: {p:?}");
                // Each piece is remembered in one of the two slots after its count.
                assert!(
                    small
                        .slots
                        .iter()
                        .any(|s| &s.bytes[..usize::from(s.len)] == b)
                );
            }
        }
        // Longer than a slot holds: counted every time, the same.
        let long = " an_identifier_longer_than_twenty_three_bytes";
        assert_eq!(memo.count(bpe, long.as_bytes()), bpe.count(long.as_bytes()));
    }
}
