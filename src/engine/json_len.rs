//! The length of a JSON value's compact text as serde_json writes it, in UTF-16 code
//! units (what chars ÷ 4 counts), worked out from the value without writing the text.
//!
//! Measuring through a writer paid a call for every fragment serde_json writes (a brace,
//! a quote, a key), each measured on its own, and a stripped input is counted for every
//! output the strategies or prune clear. Tests compare every figure with serde_json's own
//! text.

use serde_json::Value;

/// Bytes weighed together: one vector register's worth (SSE2), so the compiler weighs a
/// block in a few instructions whatever the string's length.
const BLOCK: usize = 16;

/// Units of `v`'s compact JSON text.
pub(crate) fn value_units(v: &Value) -> u64 {
    match v {
        Value::Null => 4,
        Value::Bool(true) => 4,
        Value::Bool(false) => 5,
        Value::Number(n) => number_units(n),
        Value::String(s) => string_units(s),
        Value::Array(items) => enclosed(
            items.len(),
            items.iter().map(value_units).fold(0, u64::saturating_add),
        ),
        Value::Object(map) => enclosed(
            map.len(),
            map.iter()
                .map(|(k, v)| entry_units(k, value_units(v)))
                .fold(0, u64::saturating_add),
        ),
    }
}

/// Units of an object entry `"key":value`, its value's units given.
pub(crate) fn entry_units(key: &str, value: u64) -> u64 {
    string_units(key).saturating_add(1).saturating_add(value)
}

/// Units of an array or object of `n` items whose own units add up to `inner`: the
/// brackets and the commas between items.
pub(crate) fn enclosed(n: usize, inner: u64) -> u64 {
    let commas = n.saturating_sub(1) as u64;
    inner.saturating_add(commas).saturating_add(2)
}

/// Units of a number as serde_json writes it (rare in tool inputs, and short: written
/// into a counter).
fn number_units(n: &serde_json::Number) -> u64 {
    struct Len(u64);
    impl std::io::Write for Len {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0 = self.0.saturating_add(bytes.len() as u64);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut len = Len(0);
    // Writing a number into a counter cannot fail; its text is ASCII.
    let _ = serde_json::to_writer(&mut len, n);
    len.0
}

/// Units of `s` as a JSON string, quotes included, escaped as serde_json escapes it.
pub(crate) fn string_units(s: &str) -> u64 {
    let mut blocks = s.as_bytes().chunks_exact(BLOCK);
    let mut units = 2u64;
    for block in blocks.by_ref() {
        units = units.saturating_add(u64::from(block_weight(block)));
    }
    // The rest, padded with spaces (one unit each, taken off again) to a whole block: a
    // byte-at-a-time loop over it cost more than the blocks for a short string.
    let rest = blocks.remainder();
    let mut padded = [b' '; BLOCK];
    if let Some(head) = padded.get_mut(..rest.len()) {
        head.copy_from_slice(rest);
    }
    let padding = (BLOCK - rest.len()) as u64;
    units
        .saturating_add(u64::from(block_weight(&padded)))
        .saturating_sub(padding)
}

/// The weights of up to [`BLOCK`] bytes added up (at most 6 each: the sum fits in u8).
#[inline(always)]
fn block_weight(block: &[u8]) -> u8 {
    block
        .iter()
        .fold(0u8, |sum, &b| sum.wrapping_add(weight(b)))
}

/// What one byte of a string adds to its JSON text's units. Written without branches, so
/// the compiler sums whole vectors of bytes at once:
/// - a byte that starts a character (not a UTF-8 continuation byte) is one unit, and the
///   lead byte of a 4-byte character one more (a surrogate pair);
/// - `"` and `\` are escaped with a backslash: one more;
/// - a control character is `\b`, `\t`, `\n`, `\f` or `\r` (one more) or `\u00XX` (five).
#[inline(always)]
fn weight(b: u8) -> u8 {
    let starts = u8::from(b as i8 >= -0x40);
    let pair = u8::from(b >= 0xF0);
    let control = u8::from(b < 0x20);
    let short = u8::from(b == 8) | u8::from(b == 9) | u8::from(b == 10);
    let short = short | u8::from(b == 12) | u8::from(b == 13);
    // An escaped byte adds one (the backslash); a control character without a short
    // escape four more (`\u00XX`). `short` implies `control`: never below zero.
    starts + pair + escapes(b) + 4 * (control - short)
}

/// 1 when JSON escapes `b` (a control character, `"` or `\\`), else 0: serde_json writes
/// every other byte, non-ASCII included, as it is. Without branches, for vectorized loops.
#[inline(always)]
pub(crate) fn escapes(b: u8) -> u8 {
    u8::from(b < 0x20) | u8::from(b == b'"') | u8::from(b == b'\\')
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::tokens::utf16_len;
    use proptest::prelude::*;

    fn want(v: &Value) -> u64 {
        utf16_len(&serde_json::to_string(v).unwrap_or_default())
    }

    #[test]
    fn every_byte_weighs_what_serde_json_writes_for_it() {
        // Every ASCII character on its own, every escape included.
        for c in 0u8..0x80 {
            let s = char::from(c).to_string();
            assert_eq!(string_units(&s), want(&Value::String(s.clone())), "{c:#x}");
        }
        for s in ["é", "日本", "🦀", "\u{7f}", "\u{2028}", "a\u{10FFFF}b", ""] {
            assert_eq!(string_units(s), want(&Value::String(s.into())), "{s:?}");
        }
    }

    #[test]
    fn values_measure_as_serde_json_writes_them() {
        let long = "line \"one\"\n\ttab \\ é 日本 🦀 \u{1} ".repeat(500);
        let v = serde_json::json!({
            "z": [0.1, -0.0, 1e21, 1.5e-7, f64::MAX, u64::MAX, i64::MIN, null, true, false],
            "a": {"empty": {}, "list": [], "long": long, "short": "x\u{7f}\u{0}"},
            long.clone(): [long, "", {"k": "v"}],
        });
        assert_eq!(value_units(&v), want(&v));
        let mut inputs = 0;
        crate::tokens::test_traces::each_value(|v| {
            if let Some(input) = v.get("input") {
                assert_eq!(value_units(input), want(input), "{input}");
                inputs += 1;
            }
        });
        assert!(inputs > 400, "{inputs} inputs");
    }

    /// Any JSON value, nested a few levels, with any text in keys and strings.
    pub(crate) fn any_value() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            any::<f64>().prop_map(Value::from),
            ".{0,80}".prop_map(Value::String),
            "[a-z\n\"\\\\]{150,260}".prop_map(Value::String),
        ];
        leaf.prop_recursive(3, 24, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                prop::collection::vec((".{0,12}", inner), 0..6)
                    .prop_map(|kv| Value::Object(kv.into_iter().collect())),
            ]
        })
    }

    proptest! {
        #[test]
        fn any_value_measures_as_serde_json_writes_it(v in any_value()) {
            prop_assert_eq!(value_units(&v), want(&v));
        }

        #[test]
        fn any_string_measures_as_serde_json_writes_it(s in any::<String>()) {
            prop_assert_eq!(string_units(&s), want(&Value::String(s.clone())));
        }
    }
}
