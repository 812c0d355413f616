//! Real BPE counting with OpenAI's vocabularies, shipped inside the binary (`bpe-openai`:
//! no download, ~40–45 MB/s per core on agent output). Every text but the shortest goes through the
//! process-wide count cache: a large output counted once on a counting thread (see
//! [`super::precount`]) costs a hash and a lookup when the engine counts it again, and so
//! do the short texts the engine counts over and over (tool inputs, a marked part's
//! rendering).

use std::sync::LazyLock;

use super::TokenCounter;
use super::cache::{self, Vocabulary};
use super::split::{self, Splitter};

/// Texts this long or longer are counted ahead off the async runtime (see
/// [`super::precount`]); shorter ones are cheap enough to count where they are needed.
pub const CACHED_MIN: usize = cache::LONG_MIN;

/// Texts shorter than this are counted directly: a few tokens, cheaper than a lookup.
const UNCACHED_MAX: usize = 16;

/// A BPE counter over one vocabulary.
#[derive(Debug, Clone, Copy)]
pub struct Bpe {
    vocabulary: Vocabulary,
}

/// o200k_base.
pub static O200K: Bpe = Bpe {
    vocabulary: Vocabulary::O200k,
};

/// cl100k_base.
pub static CL100K: Bpe = Bpe {
    vocabulary: Vocabulary::Cl100k,
};

static O200K_TABLES: LazyLock<&'static bpe_openai::Tokenizer> =
    LazyLock::new(bpe_openai::o200k_base);
static CL100K_TABLES: LazyLock<&'static bpe_openai::Tokenizer> =
    LazyLock::new(bpe_openai::cl100k_base);

impl Bpe {
    fn tables(&self) -> &'static bpe_openai::Tokenizer {
        match self.vocabulary {
            Vocabulary::O200k => *O200K_TABLES,
            Vocabulary::Cl100k => *CL100K_TABLES,
        }
    }

    fn splitter(&self) -> &'static Splitter {
        match self.vocabulary {
            Vocabulary::O200k => &split::O200K,
            Vocabulary::Cl100k => &split::CL100K,
        }
    }

    /// Counts without the cache.
    pub fn count_uncached(&self, text: &str) -> u64 {
        self.splitter().count(&self.tables().bpe, text) as u64
    }
}

impl TokenCounter for Bpe {
    fn count(&self, text: &str) -> u64 {
        if text.len() < UNCACHED_MAX {
            return self.count_uncached(text);
        }
        cache::get_or_count(self.vocabulary, text, |t| self.count_uncached(t))
    }

    fn name(&self) -> &'static str {
        match self.vocabulary {
            Vocabulary::O200k => "o200k",
            Vocabulary::Cl100k => "cl100k",
        }
    }

    fn is_cached(&self, text: &str) -> bool {
        text.len() < CACHED_MIN || cache::contains(self.vocabulary, text)
    }
}

impl Bpe {
    /// Loads this vocabulary's tables (a fraction of a second, and tens of MB resident
    /// for as long as the process runs), so the first session to count does not wait for
    /// them. Call from a blocking thread.
    pub fn warm_up(&self) {
        // A first count also builds this thread's pretokenizer search cache.
        self.count_uncached("warm up: 42 tokens, /a/path.rs and code(x);\n");
        cache::warm_up();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_match_tiktoken_figures() {
        // Figures from OpenAI's tiktoken for these strings.
        assert_eq!(O200K.count("Hello, world!"), 4);
        assert_eq!(CL100K.count("Hello, world!"), 4);
        assert_eq!(O200K.count(""), 0);
    }

    #[test]
    fn counts_equal_bpe_openai_over_every_trace_text() {
        let mut texts: Vec<String> = [
            "",
            " ",
            "  \n\n  x",
            "trailing spaces   ",
            "tabs\t\tand\r\nCRLF\r\n",
            "I'M DONE, you'll SEE it's fine'd",
            "日本語のテキストと emoji 🦀🦀 and combining e\u{301}",
            "1234567 numbers 3.14159 and /paths/to/file.rs:12:5",
            "    indented code() {\n        return x;\n    }\n",
        ]
        .map(String::from)
        .to_vec();
        crate::tokens::test_traces::each_value(|v| {
            if let serde_json::Value::String(s) = v {
                texts.push(s.clone());
            }
        });
        assert!(texts.len() > 1000, "{} texts", texts.len());
        for (bpe, tables) in [
            (O200K, bpe_openai::o200k_base()),
            (CL100K, bpe_openai::cl100k_base()),
        ] {
            for t in &texts {
                assert_eq!(
                    bpe.count_uncached(t),
                    tables.count(t.as_str()) as u64,
                    "{}: {t:?}",
                    bpe.name()
                );
            }
        }
    }

    #[test]
    fn short_texts_are_cached_apart_from_long_ones() {
        let input = r#"{"command":"cargo test --workspace -- --nocapture","timeout":120000}"#;
        let direct = O200K.count_uncached(input);
        assert!(!cache::contains(Vocabulary::O200k, input));
        assert_eq!(O200K.count(input), direct);
        assert!(cache::contains(Vocabulary::O200k, input));
        assert!(!cache::contains(Vocabulary::Cl100k, input));
        assert_eq!(O200K.count(input), direct);
        // The shortest are counted every time.
        assert_eq!(O200K.count("ok"), 1);
        assert!(!cache::contains(Vocabulary::O200k, "ok"));
    }

    #[test]
    fn large_texts_count_the_same_through_the_cache() {
        let log = "[INFO] Compiling module-42 (42 of 97) ... 0.213 s\n".repeat(200);
        let direct = O200K.count_uncached(&log);
        assert!(!O200K.is_cached(&log) || cache::contains(Vocabulary::O200k, &log));
        assert_eq!(O200K.count(&log), direct);
        assert!(O200K.is_cached(&log));
        assert_eq!(O200K.count(&log), direct);
        // Shell output is where chars ÷ 4 falls short.
        assert!(
            direct > log.len() as u64 / 4,
            "{direct} vs {}",
            log.len() / 4
        );
    }
}
