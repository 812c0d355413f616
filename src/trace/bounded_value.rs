//! A JSON value read within a byte budget. A `serde_json::Value` holds many times the
//! text it is read from when that text is many small values (`[0,0,0,…]`: two bytes of
//! text, a `Value` of tens of bytes and its slot), so an import reads each message and
//! each top-level field through [`Bounded`], which charges what it builds to a budget and
//! stops the parse the moment it passes: the document's limit then bounds the memory of
//! its parse too (what is held parsing: the built messages and one message's JSON, each
//! within the limit, about twice it at most).

use std::cell::Cell;
use std::fmt;
use std::mem::size_of;

use serde::de::{DeserializeSeed, Error as _, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Number, Value};

use crate::config::shown::clipped;

/// What building one map entry costs beyond its key's text and its value's own node: the
/// crate's maps keep insertion order (an `IndexMap`: an entry of hash, key and value, and
/// an index slot in a table kept at most 7/8 full), about twice the key's `String`.
const ENTRY_BYTES: u64 = (2 * size_of::<String>() + size_of::<Value>()) as u64;
/// What a map costs before its first entry is counted: its first table and entries
/// (room for a few entries at once; measured at ~450 bytes for a one-entry map).
const MAP_BYTES: u64 = 384;

/// Bytes a value being read may still take; every [`Bounded`] read charges it.
#[derive(Debug)]
pub struct Budget {
    left: Cell<u64>,
    /// Set once a read passed the budget (serde's error carries text only).
    passed: Cell<bool>,
}

impl Budget {
    /// A budget of `bytes`.
    pub fn new(bytes: u64) -> Budget {
        Budget {
            left: Cell::new(bytes),
            passed: Cell::new(false),
        }
    }

    /// Bytes left.
    pub fn left(&self) -> u64 {
        self.left.get()
    }

    /// Whether a read stopped because it passed the budget.
    pub fn passed(&self) -> bool {
        self.passed.get()
    }

    fn charge<E: serde::de::Error>(&self, bytes: u64) -> Result<(), E> {
        match self.left.get().checked_sub(bytes) {
            Some(left) => {
                self.left.set(left);
                Ok(())
            }
            None => {
                self.passed.set(true);
                Err(E::custom("past the import's byte limit"))
            }
        }
    }
}

/// Reads one JSON value as `serde_json::Value` does, charging `budget` for each node.
#[derive(Debug, Clone, Copy)]
pub struct Bounded<'a>(pub &'a Budget);

fn len(s: &str) -> u64 {
    u64::try_from(s.len()).unwrap_or(u64::MAX)
}

const NODE: u64 = size_of::<Value>() as u64;

impl<'de> DeserializeSeed<'de> for Bounded<'_> {
    type Value = Value;

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for Bounded<'_> {
    type Value = Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<Value, E> {
        self.0.charge(NODE)?;
        Ok(Value::Bool(v))
    }

    fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Value, E> {
        self.0.charge(NODE)?;
        Ok(Value::Number(v.into()))
    }

    fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Value, E> {
        self.0.charge(NODE)?;
        Ok(Value::Number(v.into()))
    }

    fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Value, E> {
        self.0.charge(NODE)?;
        Ok(Number::from_f64(v).map_or(Value::Null, Value::Number))
    }

    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Value, E> {
        self.0.charge(NODE.saturating_add(len(v)))?;
        Ok(Value::String(v.to_string()))
    }

    fn visit_string<E: serde::de::Error>(self, v: String) -> Result<Value, E> {
        self.0.charge(NODE.saturating_add(len(&v)))?;
        Ok(Value::String(v))
    }

    fn visit_unit<E: serde::de::Error>(self) -> Result<Value, E> {
        self.0.charge(NODE)?;
        Ok(Value::Null)
    }

    fn visit_none<E: serde::de::Error>(self) -> Result<Value, E> {
        self.visit_unit()
    }

    fn visit_some<D: serde::Deserializer<'de>>(self, d: D) -> Result<Value, D::Error> {
        d.deserialize_any(self)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        self.0.charge(NODE)?;
        let mut items = Vec::new();
        while let Some(v) = seq.next_element_seed(self)? {
            // The vector's room: it doubles as it grows, so up to a node more per item.
            self.0.charge(NODE)?;
            items.push(v);
        }
        Ok(Value::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        self.0.charge(NODE.saturating_add(MAP_BYTES))?;
        let mut out = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            self.0.charge(ENTRY_BYTES.saturating_add(len(&key)))?;
            // Kept, the last of two would replace the first without a word.
            if out.contains_key(&key) {
                return Err(A::Error::custom(format!(
                    "key {:?} given twice",
                    clipped(&key)
                )));
            }
            let value = map.next_value_seed(self)?;
            out.insert(key, value);
        }
        Ok(out.into())
    }
}

/// Reads `text` as one JSON value within `bytes` (for tests and callers holding text).
#[cfg(test)]
fn read(text: &str, bytes: u64) -> Result<Value, serde_json::Error> {
    let budget = Budget::new(bytes);
    let mut de = serde_json::Deserializer::from_str(text);
    let v = Bounded(&budget).deserialize(&mut de)?;
    de.end()?;
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_value_within_its_budget_reads_as_serde_json_reads_it() {
        let text = r#"{"a":[1,-2,3.5,true,null,"x"],"b":{"c":"déjà"},"n":18446744073709551615}"#;
        let expected: Value = serde_json::from_str(text).expect("json");
        assert_eq!(read(text, 1 << 20).expect("within"), expected);
    }

    /// Many small values: the text is 2 bytes each, what they become tens. A budget of
    /// ten times the text stops the read; before, such a document built 16-48 times its
    /// size before any limit was looked at.
    #[test]
    fn many_small_values_pass_a_budget_the_text_fits() {
        let text = format!("[{}0]", "0,".repeat(100_000));
        let text_bytes = text.len() as u64;
        let budget = Budget::new(text_bytes * 10);
        let mut de = serde_json::Deserializer::from_str(&text);
        let refused = Bounded(&budget).deserialize(&mut de);
        assert!(refused.is_err());
        assert!(budget.passed());
        // Small objects cost more than their text too (`{"a":0}`: 7 bytes of text, over
        // 500 of map, entry and value).
        let text = format!("[{}{{\"a\":0}}]", "{\"a\":0},".repeat(10_000));
        let budget = Budget::new(text.len() as u64 * 10);
        let mut de = serde_json::Deserializer::from_str(&text);
        assert!(Bounded(&budget).deserialize(&mut de).is_err());
        assert!(budget.passed());
        // Malformed text is a syntax error, not a budget one.
        let budget = Budget::new(1 << 20);
        let mut de = serde_json::Deserializer::from_str("[1,");
        assert!(Bounded(&budget).deserialize(&mut de).is_err());
        assert!(!budget.passed());
    }
}
