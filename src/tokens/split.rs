//! Pretokenization for the BPE counts, with one regex search cache per thread.
//!
//! `bpe_openai::Tokenizer::count` splits through its regex's shared pool of search
//! caches: every piece (a word, about 5 bytes) takes a cache from the pool and puts it
//! back, and on any thread but the pool's first user that is a mutex round trip. On the
//! server's counting threads that was a tenth of the CPU of BPE ingest (perf:
//! `Pool::get_slow` + `Pool::put_value`). Here each thread keeps its own cache and the
//! pieces go to the same `BytePairEncoding::count` (through the thread's memory of recent
//! pieces, `memo.rs`), so the counts are the crate's own (a test checks them against
//! `bpe_openai` over every text of the shared traces).
//!
//! The patterns are `bpe-openai` 0.3's (`BPE_O200K_BASE`, `BPE_CL100K_BASE`), which
//! rewrite tiktoken's negative look-ahead `\s+(?!\S)` as a second pattern whose last
//! character is dropped from the match.

use std::cell::RefCell;
use std::sync::LazyLock;

use bpe_openai::byte_pair_encoding::BytePairEncoding;
use regex_automata::meta::{Cache, Regex};
use regex_automata::{Anchored, Input};

use super::memo::Memo;

/// A vocabulary's split: its patterns as one regex, and which of them end in a
/// look-ahead character.
#[derive(Debug)]
pub(super) struct Splitter {
    regex: Regex,
    lookahead: [bool; 3],
    /// Which of the thread's caches is this regex's.
    slot: usize,
}

const SHARED: &str = r"\s*[\r\n]+|\s+$";

/// o200k_base's split.
pub(super) static O200K: LazyLock<Splitter> = LazyLock::new(|| {
    let words = [
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
        SHARED,
    ]
    .join("|");
    Splitter::new(&words, 0)
});

/// cl100k_base's split.
pub(super) static CL100K: LazyLock<Splitter> = LazyLock::new(|| {
    let words = [
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*",
        SHARED,
    ]
    .join("|");
    Splitter::new(&words, 1)
});

thread_local! {
    /// This thread's search cache and piece memory, one per vocabulary (built on first
    /// use).
    static CACHES: RefCell<[Option<(Cache, Memo)>; 2]> = const { RefCell::new([None, None]) };
}

impl Splitter {
    fn new(words: &str, slot: usize) -> Splitter {
        // Fixed patterns, compiled once per process: a failure is a bug in this file,
        // and the unit tests build both.
        #[allow(clippy::expect_used)]
        let regex = Regex::new_many(&[words, r"\s+\s", r"\s+"]).expect("valid split patterns");
        Splitter {
            regex,
            lookahead: [false, true, false],
            slot,
        }
    }

    /// Tokens of `text`: the BPE count of each piece of the split, summed.
    pub(super) fn count(&self, bpe: &BytePairEncoding, text: &str) -> usize {
        let counted = CACHES.try_with(|caches| {
            let mut caches = caches.try_borrow_mut().ok()?;
            let (cache, memo) = caches
                .get_mut(self.slot)?
                .get_or_insert_with(|| (self.regex.create_cache(), Memo::new()));
            Some(self.count_with(cache, memo, bpe, text))
        });
        // A thread being torn down (or a count inside a count) gets a cache of its own.
        counted.ok().flatten().unwrap_or_else(|| {
            self.count_with(
                &mut self.regex.create_cache(),
                &mut Memo::small(),
                bpe,
                text,
            )
        })
    }

    fn count_with(
        &self,
        cache: &mut Cache,
        memo: &mut Memo,
        bpe: &BytePairEncoding,
        text: &str,
    ) -> usize {
        let (mut at, mut tokens) = (0, 0);
        while at < text.len() {
            let input = Input::new(&text[at..]).anchored(Anchored::Yes);
            let Some(m) = self.regex.search_with(cache, &input) else {
                break;
            };
            let mut end = at + m.end();
            if self.lookahead[m.pattern().as_usize()] {
                end -= text[at..end].chars().next_back().map_or(0, char::len_utf8);
            }
            if end <= at {
                // Never happens with these patterns (each consumes a character beyond
                // its look-ahead); stop rather than loop.
                break;
            }
            tokens += memo.count(bpe, &text.as_bytes()[at..end]);
            at = end;
        }
        tokens
    }
}
