//! Strategy 6, `pruneRetryParts`, and the base layer's identical-call supersede: both key
//! a call by a hash of its tool and canonical input (object keys sorted, so `{a,b}` and
//! `{b,a}` are one call). A failed call followed by a successful one with the same hash
//! is a retry; two successful ones are duplicates.

use std::hash::{Hash, Hasher};
use std::io::Write;

use siphasher::sip::SipHasher13;

use serde_json::Value;

use crate::engine::json_str::{Sink, write_str, write_value};

/// A 128-bit hash of `text`, stable across processes and toolchains (the call hash's):
/// what the tracker holds in place of a key too long to keep as text.
pub(crate) fn text_hash(text: &str) -> u128 {
    let mut hashed = Buffered::default();
    hashed.put(text.as_bytes());
    hashed.finish()
}

/// 128-bit hash of tool + canonical input (two independent 64-bit halves).
pub fn call_hash(tool: &str, input: &Value) -> u128 {
    let mut hashed = Buffered::default();
    for &b in tool.as_bytes() {
        hashed.push(b.to_ascii_lowercase());
    }
    hashed.push(0);
    write_canonical(input, &mut hashed);
    hashed.finish()
}

/// Compact JSON with object keys sorted, written straight into `out` (no string per key).
/// Strings and scalars are serde_json's text (`json_str` escapes long strings with SIMD,
/// the same bytes): the text the stored hashes were taken from.
fn write_canonical(v: &Value, out: &mut Buffered) {
    match v {
        Value::Object(map) => {
            // Keys are unique: an unstable sort orders them as a stable one would.
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            entries.sort_unstable_by_key(|&(k, _)| k);
            out.put(b"{");
            for (k, v) in entries {
                write_str(k, out);
                out.put(b":");
                write_canonical(v, out);
                out.put(b",");
            }
            out.put(b"}");
        }
        Value::Array(items) => {
            out.put(b"[");
            for item in items {
                write_canonical(item, out);
                out.put(b",");
            }
            out.put(b"]");
        }
        scalar => write_value(scalar, out),
    }
}

/// The hashers behind a buffer on the stack: one hash call per [`BUFFERED`] bytes rather
/// than per JSON fragment, and nothing allocated for it (a heap buffer, the lowered tool
/// name and a lookup of each key again were a quarter of hashing a short call's time).
struct Buffered {
    buf: [u8; BUFFERED],
    len: usize,
    halves: Halves,
    /// Where sonic-rs escapes long strings (allocated for the first, kept for the call).
    scratch: Vec<u8>,
}

/// Bytes [`Buffered`] collects before it hashes them.
const BUFFERED: usize = 256;

impl Default for Buffered {
    fn default() -> Buffered {
        Buffered {
            buf: [0; BUFFERED],
            len: 0,
            halves: Halves::default(),
            scratch: Vec::new(),
        }
    }
}

impl Buffered {
    /// Appends one byte.
    fn push(&mut self, b: u8) {
        if self.len >= BUFFERED {
            self.drain();
        }
        if let Some(slot) = self.buf.get_mut(self.len) {
            *slot = b;
            self.len += 1;
        }
    }

    /// Hashes what the buffer holds.
    fn drain(&mut self) {
        let held = self.buf.get(..self.len).unwrap_or_default();
        let _ = self.halves.write(held);
        self.len = 0;
    }

    fn finish(mut self) -> u128 {
        self.drain();
        self.halves.finish()
    }
}

impl Sink for Buffered {
    fn put(&mut self, bytes: &[u8]) {
        if bytes.len() > BUFFERED.saturating_sub(self.len) {
            self.drain();
            if bytes.len() >= BUFFERED {
                let _ = self.halves.write(bytes);
                return;
            }
        }
        let end = self.len.saturating_add(bytes.len());
        if let Some(free) = self.buf.get_mut(self.len..end) {
            free.copy_from_slice(bytes);
            self.len = end;
        }
    }

    fn scratch(&mut self) -> &mut Vec<u8> {
        &mut self.scratch
    }
}

/// The two halves, fed the canonical text as it is written: both see it as one `str`
/// (its bytes, then `str`'s 0xff terminator), which is what snapshots kept since the text
/// was first built whole; SipHash reads a stream, so the pieces it arrives in do not
/// matter. A large input (a file written whole) is never held as a second copy.
struct Halves([SipHasher13; 2]);

impl Default for Halves {
    /// SipHash-1-3 with zero keys, salted 1 and 2: what std's `DefaultHasher` computed
    /// when snapshots first kept these hashes, from a crate that cannot change it under a
    /// new toolchain.
    fn default() -> Halves {
        let salted = |salt: u8| {
            let mut h = SipHasher13::new();
            salt.hash(&mut h);
            h
        };
        Halves([salted(1), salted(2)])
    }
}

impl Halves {
    fn finish(self) -> u128 {
        let [mut high, mut low] = self.0;
        high.write_u8(0xff);
        low.write_u8(0xff);
        (u128::from(high.finish()) << 64) | u128::from(low.finish())
    }
}

impl Write for Halves {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        for h in &mut self.0 {
            h.write(bytes);
        }
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn key_order_does_not_matter_but_values_and_tools_do() {
        let a = call_hash("bash", &json!({"command": "cargo test", "timeout": 60}));
        let b = call_hash("bash", &json!({"timeout": 60, "command": "cargo test"}));
        assert_eq!(a, b);
        assert_ne!(
            a,
            call_hash("bash", &json!({"command": "cargo test", "timeout": 61}))
        );
        assert_ne!(
            a,
            call_hash("shell", &json!({"command": "cargo test", "timeout": 60}))
        );
        assert_ne!(
            call_hash("t", &json!({"a": [1, 2]})),
            call_hash("t", &json!({"a": [2, 1]}))
        );
    }

    /// The text built whole and hashed as one `str`, as `call_hash` did before it
    /// hashed the text as it was written.
    fn hashed_whole(tool: &str, input: &Value) -> u128 {
        fn canonical(v: &Value, out: &mut String) {
            match v {
                Value::Object(map) => {
                    let mut keys: Vec<&String> = map.keys().collect();
                    keys.sort();
                    out.push('{');
                    for k in keys {
                        out.push_str(&serde_json::to_string(k).unwrap_or_default());
                        out.push(':');
                        canonical(&map[k], out);
                        out.push(',');
                    }
                    out.push('}');
                }
                Value::Array(items) => {
                    out.push('[');
                    for item in items {
                        canonical(item, out);
                        out.push(',');
                    }
                    out.push(']');
                }
                scalar => out.push_str(&serde_json::to_string(scalar).unwrap_or_default()),
            }
        }
        let mut text = tool.to_ascii_lowercase();
        text.push('\0');
        canonical(input, &mut text);
        let half = |salt: u8| {
            let mut h = SipHasher13::new();
            salt.hash(&mut h);
            text.hash(&mut h);
            h.finish()
        };
        (u128::from(half(1)) << 64) | u128::from(half(2))
    }

    #[test]
    fn hashing_as_written_equals_hashing_the_whole_text() {
        let big = "x".repeat(5000);
        let mut inputs = vec![
            json!({}),
            json!(null),
            json!({"content": big, "path": "/a/b.rs"}),
            json!({"a": ["é", 1.5, {"k": "\"quoted\"\n"}], "b": "y".repeat(511)}),
            json!("z".repeat(512)),
            json!("w".repeat(1023)),
        ];
        let mut n = 0;
        crate::tokens::test_traces::each_value(|v| {
            if let Some(input) = v.pointer("/state/input") {
                inputs.push(input.clone());
                n += 1;
            }
        });
        assert!(n > 100, "{n} tool inputs in the traces");
        for input in &inputs {
            assert_eq!(
                call_hash("Bash", input),
                hashed_whole("Bash", input),
                "{input}"
            );
        }
    }

    proptest::proptest! {
        /// Any text in keys and values (escapes, control characters, surrogate pairs):
        /// the strings written by sonic-rs hash as serde_json's text did.
        #[test]
        fn any_strings_hash_as_their_serde_json_text(key in ".{0,40}", text in ".{0,300}") {
            let input = json!({ key.clone(): text, "list": [key, 1, null] });
            proptest::prop_assert_eq!(call_hash("t", &input), hashed_whole("t", &input));
        }
    }

    /// Hashes are kept in snapshots (the tracker's keys): the same call must hash the same
    /// across versions, or a restored session stops recognizing its earlier calls.
    #[test]
    fn the_hash_of_a_call_does_not_change() {
        let input = json!({
            "command": "grep -rn \"fn main\" src/ | head",
            "timeout": 60.5,
            "flags": [true, null, -3, "é\u{1}"],
            "nested": {"z": 1, "a": {"b": "c"}},
        });
        assert_eq!(
            format!("{:032x}", call_hash("Bash", &input)),
            "f73e89dda746116d310596bc740a6558"
        );
    }
}
