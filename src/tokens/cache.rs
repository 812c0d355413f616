//! The process-wide count cache: text hash → token count, per vocabulary. Bounded in
//! entries (each a few dozen bytes, whatever the text's size), so it caps its own memory.
//!
//! Two tables: long texts (what the server counts ahead on its counting threads, which
//! must stay until the session's actor asks) and short ones (tool inputs, the texts a
//! marked part is rendered with), so the many short texts never evict a long one.
//! Counting 100 bytes with real BPE costs a few µs; hashing and looking them up, tens
//! of ns.

use std::hash::{BuildHasher, Hasher};
use std::sync::LazyLock;

use foldhash::quality::RandomState;
use quick_cache::sync::Cache;

/// Entries kept (a few MB at most).
const ENTRIES: usize = 65_536;

/// Which vocabulary a count is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum Vocabulary {
    O200k,
    Cl100k,
}

/// A text's identity: vocabulary, length and a 64-bit hash seeded at random per process
/// (so no client can aim a collision at another's text).
type Key = (Vocabulary, usize, u64);

/// Texts this long or longer go to the long table.
pub(super) const LONG_MIN: usize = 1024;

static SEED: LazyLock<RandomState> = LazyLock::new(RandomState::default);
static LONG: LazyLock<Cache<Key, u64>> = LazyLock::new(|| Cache::new(ENTRIES));
static SHORT: LazyLock<Cache<Key, u64>> = LazyLock::new(|| Cache::new(ENTRIES));

fn table(text: &str) -> &'static Cache<Key, u64> {
    if text.len() >= LONG_MIN {
        &LONG
    } else {
        &SHORT
    }
}

fn key(vocabulary: Vocabulary, text: &str) -> Key {
    let mut h = SEED.build_hasher();
    h.write(text.as_bytes());
    (vocabulary, text.len(), h.finish())
}

/// The cached count of `text`, or `count(text)` (then cached).
pub(super) fn get_or_count(
    vocabulary: Vocabulary,
    text: &str,
    count: impl FnOnce(&str) -> u64,
) -> u64 {
    let (k, table) = (key(vocabulary, text), table(text));
    if let Some(n) = table.get(&k) {
        return n;
    }
    let n = count(text);
    table.insert(k, n);
    n
}

/// Creates the caches (their tables are allocated once, up front).
pub(super) fn warm_up() {
    LazyLock::force(&LONG);
    LazyLock::force(&SHORT);
}

/// True when `text`'s count is cached.
pub(super) fn contains(vocabulary: Vocabulary, text: &str) -> bool {
    table(text).get(&key(vocabulary, text)).is_some()
}
