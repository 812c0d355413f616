//! JSON strings written for hashing tool inputs (`retries::call_hash`): the bytes
//! serde_json writes, escaped by whichever writer is cheaper for the string's length.
//! (Measuring an input's length needs no text: `json_len`.)
//!
//! sonic-rs escapes with SIMD into its writer's buffer, far faster per byte than
//! serde_json's byte-at-a-time loop, but its buffer is allocated on first use: for the
//! short strings most inputs hold (a path, a command) that allocation costs more than
//! serde_json's whole escape. Tests compare the bytes with serde_json's for any string.

use std::io::Write;

use serde_json::Value;
use sonic_rs::writer::BufferedWriter;

use super::json_len::escapes;

/// Strings that need escaping and are at least this long are escaped by sonic-rs (below
/// it serde_json is cheaper than sonic-rs's first buffer allocation).
const SIMD_FROM: usize = 64;

/// Where the JSON text goes: sonic-rs's writer in front of `W` (its buffer is allocated
/// once, for the first long string, and reused for every later one).
pub(crate) type JsonOut<W> = BufferedWriter<W>;

/// A writer for `inner`.
pub(crate) fn json_out<W: Write>(inner: W) -> JsonOut<W> {
    BufferedWriter::new(inner)
}

/// Appends `s` as a JSON string, quotes included.
pub(crate) fn write_str<W: Write>(s: &str, out: &mut JsonOut<W>) -> std::io::Result<()> {
    if !needs_escape(s) {
        // Most strings of a tool input (paths, commands, code without quotes) escape to
        // themselves: written as they are, as serde_json writes them.
        out.write_all(b"\"")?;
        out.write_all(s.as_bytes())?;
        return out.write_all(b"\"");
    }
    if s.len() < SIMD_FROM {
        serde_json::to_writer(out, s).map_err(std::io::Error::other)
    } else {
        sonic_rs::to_writer(out, s).map_err(std::io::Error::other)
    }
}

/// True when JSON escapes a byte of `s` (`json_len::escapes`, the one list of them).
/// Tested 16 bytes at a time without branches, which the compiler turns into a few vector
/// instructions per block.
fn needs_escape(s: &str) -> bool {
    let mut blocks = s.as_bytes().chunks_exact(16);
    let any = |block: &[u8]| block.iter().fold(0u8, |any, &b| any | escapes(b)) != 0;
    blocks.by_ref().any(any) || any(blocks.remainder())
}

/// Appends `v` as compact JSON, in the map's own key order: serde_json's text.
pub(crate) fn write_value<W: Write>(v: &Value, out: &mut JsonOut<W>) -> std::io::Result<()> {
    match v {
        Value::Object(map) => {
            out.write_all(b"{")?;
            for (i, (k, v)) in map.iter().enumerate() {
                if i > 0 {
                    out.write_all(b",")?;
                }
                write_str(k, out)?;
                out.write_all(b":")?;
                write_value(v, out)?;
            }
            out.write_all(b"}")
        }
        Value::Array(items) => {
            out.write_all(b"[")?;
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.write_all(b",")?;
                }
                write_value(item, out)?;
            }
            out.write_all(b"]")
        }
        Value::String(s) => write_str(s, out),
        scalar => serde_json::to_writer(out, scalar).map_err(std::io::Error::other),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn written(v: &Value) -> String {
        let mut bytes = Vec::new();
        let mut out = json_out(&mut bytes);
        write_value(v, &mut out).expect("a Vec takes any bytes");
        drop(out);
        String::from_utf8(bytes).expect("JSON text is UTF-8")
    }

    #[test]
    fn values_are_written_as_serde_json_writes_them() {
        let long = "line \"one\"\n\ttab \\ é 日本 🦀 \u{1} ".repeat(20);
        let v = serde_json::json!({
            "z": [0.1, -0.0, 1e21, u64::MAX, i64::MIN, null, true, false],
            "a": {"empty": {}, "list": [], "long": long, "short": "x\u{7f}\u{0}"},
            long.clone(): [long, "", {"k": "v"}],
        });
        assert_eq!(written(&v), serde_json::to_string(&v).unwrap_or_default());
    }

    /// Every ASCII character at every position of a short and a long string, and
    /// non-ASCII text around it: plain strings are written as they are, the others
    /// escaped, each as serde_json writes it.
    #[test]
    fn every_character_anywhere_is_written_as_serde_json_writes_it() {
        for c in (0u8..0x80).map(char::from).chain(['é', '🦀', '\u{2028}']) {
            for len in [20, 70] {
                for at in 0..len {
                    let mut text: String = "aé".chars().cycle().take(len).collect();
                    text.insert(text.char_indices().nth(at).map_or(0, |(i, _)| i), c);
                    let v = Value::String(text);
                    assert_eq!(written(&v), serde_json::to_string(&v).unwrap_or_default());
                }
            }
        }
    }

    proptest::proptest! {
        /// Any text, short or long, in keys and values.
        #[test]
        fn any_strings_are_written_as_serde_json_writes_them(
            key in ".{0,80}",
            text in ".{0,300}",
        ) {
            let v = serde_json::json!({ key.clone(): text, "list": [key, 1, null] });
            proptest::prop_assert_eq!(written(&v), serde_json::to_string(&v).unwrap_or_default());
        }
    }
}
