//! Serde helpers that write a `HashMap` or `HashSet` as a list sorted by key: JSON object
//! keys must be strings (the engine's keys are tuples, positions and hashes), and a hash
//! table's iteration order changes from run to run, so sorting makes a snapshot of the
//! same session the same bytes. Reading refuses a repeated key (a map written by
//! [`map::serialize`] never holds one).

use std::hash::Hash;

use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::domain::{FastMap, FastSet};

/// `FastMap<K, V>` as `[[key, value], ...]`, ascending by key.
pub(crate) mod map {
    use super::*;

    /// Writes the entries sorted by key.
    pub(crate) fn serialize<K, V, S>(m: &FastMap<K, V>, s: S) -> Result<S::Ok, S::Error>
    where
        K: Serialize + Ord,
        V: Serialize,
        S: Serializer,
    {
        let mut entries: Vec<(&K, &V)> = m.iter().collect();
        entries.sort_unstable_by(|a, b| a.0.cmp(b.0));
        s.collect_seq(entries)
    }

    /// Reads the entries back; a repeated key is an error.
    pub(crate) fn deserialize<'de, K, V, D>(d: D) -> Result<FastMap<K, V>, D::Error>
    where
        K: Deserialize<'de> + Eq + Hash,
        V: Deserialize<'de>,
        D: Deserializer<'de>,
    {
        let entries = Vec::<(K, V)>::deserialize(d)?;
        let n = entries.len();
        let m: FastMap<K, V> = entries.into_iter().collect();
        if m.len() != n {
            return Err(D::Error::custom("a map holds a key twice"));
        }
        Ok(m)
    }
}

/// `FastSet<T>` as `[item, ...]`, ascending.
pub(crate) mod set {
    use super::*;

    /// Writes the items sorted.
    pub(crate) fn serialize<T, S>(set: &FastSet<T>, s: S) -> Result<S::Ok, S::Error>
    where
        T: Serialize + Ord,
        S: Serializer,
    {
        let mut items: Vec<&T> = set.iter().collect();
        items.sort_unstable();
        s.collect_seq(items)
    }

    /// Reads the items back; a repeated item is an error.
    pub(crate) fn deserialize<'de, T, D>(d: D) -> Result<FastSet<T>, D::Error>
    where
        T: Deserialize<'de> + Eq + Hash,
        D: Deserializer<'de>,
    {
        let items = Vec::<T>::deserialize(d)?;
        let n = items.len();
        let set: FastSet<T> = items.into_iter().collect();
        if set.len() != n {
            return Err(D::Error::custom("a set holds an item twice"));
        }
        Ok(set)
    }
}

/// `FastMap<u128, V>` (call hashes) as `[["<32 hex digits>", value], ...]`, ascending:
/// a JSON number that large does not survive `serde_json::Value` (it becomes an `f64`),
/// which a migration reads documents through.
pub(crate) mod hashes {
    use super::*;

    /// Writes the entries sorted by hash, each hash as 32 hex digits.
    pub(crate) fn serialize<V, S>(m: &FastMap<u128, V>, s: S) -> Result<S::Ok, S::Error>
    where
        V: Serialize,
        S: Serializer,
    {
        let mut entries: Vec<(u128, &V)> = m.iter().map(|(k, v)| (*k, v)).collect();
        entries.sort_unstable_by_key(|e| e.0);
        s.collect_seq(entries.into_iter().map(|(k, v)| (format!("{k:032x}"), v)))
    }

    /// Reads the entries back; a malformed or repeated hash is an error.
    pub(crate) fn deserialize<'de, V, D>(d: D) -> Result<FastMap<u128, V>, D::Error>
    where
        V: Deserialize<'de>,
        D: Deserializer<'de>,
    {
        let entries = Vec::<(String, V)>::deserialize(d)?;
        let n = entries.len();
        let m = entries
            .into_iter()
            .map(|(k, v)| {
                let hash = (k.len() == 32)
                    .then(|| u128::from_str_radix(&k, 16).ok())
                    .flatten()
                    .ok_or_else(|| D::Error::custom(format!("{k:?} is not a call hash")))?;
                Ok((hash, v))
            })
            .collect::<Result<FastMap<u128, V>, D::Error>>()?;
        if m.len() != n {
            return Err(D::Error::custom("a map holds a key twice"));
        }
        Ok(m)
    }
}
