//! The process-wide count cache: text hash → token count, per vocabulary. Bounded in
//! entries (each a few dozen bytes, whatever the text's size), so it caps its own memory.

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

static SEED: LazyLock<RandomState> = LazyLock::new(RandomState::default);
static COUNTS: LazyLock<Cache<Key, u64>> = LazyLock::new(|| Cache::new(ENTRIES));

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
    let k = key(vocabulary, text);
    if let Some(n) = COUNTS.get(&k) {
        return n;
    }
    let n = count(text);
    COUNTS.insert(k, n);
    n
}

/// Creates the cache (its table is allocated once, up front).
pub(super) fn warm_up() {
    LazyLock::force(&COUNTS);
}

/// True when `text`'s count is cached.
pub(super) fn contains(vocabulary: Vocabulary, text: &str) -> bool {
    COUNTS.get(&key(vocabulary, text)).is_some()
}
