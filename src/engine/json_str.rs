//! JSON strings written for hashing tool inputs (`retries::call_hash`): the bytes
//! serde_json writes, escaped by whichever writer is cheaper for the string's length.
//! (Measuring an input's length needs no text: `json_len`.)
//!
//! The text goes into a [`Sink`], which takes bytes and cannot fail: most of an input's
//! strings (paths, commands, code without quotes) need no escaping and are copied in as
//! they are, with no writer call per fragment. sonic-rs escapes with SIMD, far faster per
//! byte than serde_json's byte-at-a-time loop, but into a buffer of its own: for the short
//! strings most inputs hold that buffer costs more than serde_json's whole escape, so it
//! is the sink's, kept for every long string of one input. Tests compare the bytes with
//! serde_json's for any string.

use serde_json::Value;

use super::json_len::escapes;

/// Strings that need escaping and are at least this long are escaped by sonic-rs (below
/// it serde_json is cheaper than sonic-rs's first buffer allocation).
const SIMD_FROM: usize = 64;

/// Where the JSON text goes.
pub(crate) trait Sink {
    /// Appends `bytes`.
    fn put(&mut self, bytes: &[u8]);
    /// A buffer for sonic-rs to escape long strings into (allocated once, reused).
    fn scratch(&mut self) -> &mut Vec<u8>;
}

/// A [`Sink`] as an `io::Write`, for serde_json's writer.
struct Put<'a, S>(&'a mut S);

impl<S: Sink> std::io::Write for Put<'_, S> {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.put(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Appends `s` as a JSON string, quotes included.
pub(crate) fn write_str(s: &str, out: &mut impl Sink) {
    if !needs_escape(s) {
        out.put(b"\"");
        out.put(s.as_bytes());
        out.put(b"\"");
    } else if s.len() < SIMD_FROM {
        // Writing a `str` into a sink that cannot fail cannot fail.
        let _ = serde_json::to_writer(Put(out), s);
    } else {
        let mut escaped = std::mem::take(out.scratch());
        escaped.clear();
        let _ = sonic_rs::to_writer(&mut escaped, s);
        out.put(&escaped);
        *out.scratch() = escaped;
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
pub(crate) fn write_value(v: &Value, out: &mut impl Sink) {
    match v {
        Value::Object(map) => {
            out.put(b"{");
            for (i, (k, v)) in map.iter().enumerate() {
                if i > 0 {
                    out.put(b",");
                }
                write_str(k, out);
                out.put(b":");
                write_value(v, out);
            }
            out.put(b"}");
        }
        Value::Array(items) => {
            out.put(b"[");
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.put(b",");
                }
                write_value(item, out);
            }
            out.put(b"]");
        }
        Value::String(s) => write_str(s, out),
        scalar => {
            let _ = serde_json::to_writer(Put(out), scalar);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Text collected in a vector, with its own scratch buffer.
    #[derive(Default)]
    struct Text {
        bytes: Vec<u8>,
        scratch: Vec<u8>,
    }

    impl Sink for Text {
        fn put(&mut self, bytes: &[u8]) {
            self.bytes.extend_from_slice(bytes);
        }

        fn scratch(&mut self) -> &mut Vec<u8> {
            &mut self.scratch
        }
    }

    fn written(v: &Value) -> String {
        let mut out = Text::default();
        write_value(v, &mut out);
        String::from_utf8(out.bytes).expect("JSON text is UTF-8")
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
