//! Token counting. Every count in compactd (overflow prediction, prune, context totals,
//! reports) goes through one [`TokenCounter`], so the numbers always agree with each other.
//!
//! Each session counts with the tokenizer its `tokenizer` setting resolves to
//! ([`Tokenizer`], [`Counting`]): real BPE (`o200k`, `cl100k`, [`bpe`]) or OpenCode's
//! heuristic `round(len / 4)` where `len` is the string's length in UTF-16 code units
//! (JavaScript's `String.length`), which the OpenCode preset keeps so prune decisions
//! match OpenCode's exactly.

use std::fmt::Debug;

pub mod bpe;
mod cache;
mod choice;
mod memo;
mod split;
#[cfg(test)]
pub(crate) mod test_traces;

pub use choice::{Counting, Tokenizer, UnknownTokenizer};

/// Counts tokens of a text. Implementations must be pure and cheap to share.
pub trait TokenCounter: Debug + Send + Sync {
    /// Estimated tokens of `text`.
    fn count(&self, text: &str) -> u64;
    /// Name shown in reports (`chars/4`, `o200k`, ...).
    fn name(&self) -> &'static str;
    /// True when counting `text` is cheap now (short, or its count is cached): callers on
    /// an async runtime count the rest on a blocking thread first ([`precount`]).
    fn is_cached(&self, _text: &str) -> bool {
        true
    }
    /// The count as a function of the text's length in UTF-16 code units, when that is
    /// all it depends on (chars ÷ 4); None for a counter that reads the text (BPE). A
    /// caller with a text it would build only to count it (a tool input's JSON) can then
    /// measure it instead.
    fn per_length(&self) -> Option<fn(u64) -> u64> {
        None
    }
}

/// Loads the tables `counting` needs (nothing for chars ÷ 4). Slow: call from a blocking
/// thread.
pub fn warm_up(counting: Counting) {
    match counting {
        Counting::O200k => bpe::O200K.warm_up(),
        Counting::Cl100k => bpe::CL100K.warm_up(),
        Counting::Chars4 => {}
    }
}

/// Counts every text of `texts` that is not cheap to count yet, so the counter's cache
/// holds them. Slow (~40 MB/s): run it on a blocking thread, not on the async runtime.
pub fn precount<'a>(counter: &dyn TokenCounter, texts: impl IntoIterator<Item = &'a str>) {
    for t in texts {
        if !counter.is_cached(t) {
            counter.count(t);
        }
    }
}

/// OpenCode's `Token.estimate`: `max(0, round(len / 4))` with JavaScript string lengths.
#[derive(Debug, Clone, Copy, Default)]
pub struct CharsPerToken;

/// Characters per token of the heuristic (seed 01 `CHARS_PER_TOKEN`).
pub const CHARS_PER_TOKEN: u64 = 4;

impl TokenCounter for CharsPerToken {
    fn count(&self, text: &str) -> u64 {
        chars4_of_len(utf16_len(text))
    }

    fn name(&self) -> &'static str {
        "chars/4"
    }

    fn per_length(&self) -> Option<fn(u64) -> u64> {
        Some(chars4_of_len)
    }
}

/// `round(len / 4)`: Math.round on a non-negative x.25/x.5/x.75 rounds half up.
fn chars4_of_len(len: u64) -> u64 {
    (len + CHARS_PER_TOKEN / 2) / CHARS_PER_TOKEN
}

/// Length in UTF-16 code units, as JavaScript's `String.length` reports it.
pub fn utf16_len(text: &str) -> u64 {
    if text.is_ascii() {
        return text.len() as u64;
    }
    utf8_units(text.as_bytes())
}

/// UTF-16 code units of valid UTF-8 `bytes`, which may be any run of a text's bytes cut
/// anywhere: each byte adds what it contributes (so the runs of a text add up to it).
pub fn utf8_units(bytes: &[u8]) -> u64 {
    // Byte-wise, which the compiler vectorizes: every byte but a UTF-8 continuation byte
    // (0x80..=0xBF) starts a character, one unit; a 4-byte character (lead byte 0xF0 or
    // above) is a surrogate pair, one unit more. Walking `chars()` was 3% of the server's
    // CPU at chars4 ingest of non-ASCII tool output.
    bytes
        .chunks(4096)
        .map(|chunk| {
            // At most 2 per byte: a chunk's sum fits in u32.
            chunk
                .iter()
                .map(|&b| u32::from(b as i8 >= -0x40) + u32::from(b >= 0xF0))
                .sum::<u32>() as u64
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_like_math_round() {
        let c = CharsPerToken;
        assert_eq!(c.count(""), 0);
        assert_eq!(c.count("a"), 0); // 0.25
        assert_eq!(c.count("ab"), 1); // 0.5 rounds up
        assert_eq!(c.count("abc"), 1); // 0.75
        assert_eq!(c.count("abcd"), 1);
        assert_eq!(c.count("abcdef"), 2); // 1.5 rounds up
        assert_eq!(c.count(&"x".repeat(80_000)), 20_000);
    }

    #[test]
    fn counts_utf16_units() {
        // "é" is one UTF-16 unit (two UTF-8 bytes); "😀" is two units (four bytes).
        assert_eq!(utf16_len("é"), 1);
        assert_eq!(utf16_len("😀"), 2);
        assert_eq!(CharsPerToken.count("éééé"), 1);
        let mixed = "ascii, é, 日本語, 😀🦀, \u{10FFFF}, ".repeat(500);
        let cut = mixed.char_indices().nth(5001).map_or(0, |(i, _)| i);
        for text in ["", "a", "é", "日", "😀", mixed.as_str(), &mixed[..cut]] {
            let by_chars: u64 = text.chars().map(|c| c.len_utf16() as u64).sum();
            assert_eq!(utf16_len(text), by_chars, "{text:?}");
        }
    }
}
