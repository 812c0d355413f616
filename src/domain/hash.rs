//! The hash tables of a session's indexes. Their keys are ids, call ids and file paths a
//! client chose, hashed on every update: std's SipHash-1-3 was a fifth of the
//! instructions of a strategy turn. foldhash (already the token count cache's hash) is
//! several times faster on short keys and seeded at random per process and per table, so
//! a client cannot aim collisions at a table it cannot see the seed of.

/// The hasher of every engine table.
pub type FastState = foldhash::quality::RandomState;

/// A `HashMap` with [`FastState`].
pub type FastMap<K, V> = std::collections::HashMap<K, V, FastState>;

/// A `HashSet` with [`FastState`].
pub type FastSet<T> = std::collections::HashSet<T, FastState>;
