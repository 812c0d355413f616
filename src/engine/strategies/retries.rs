//! Strategy 6, `pruneRetryParts`, and the base layer's identical-call supersede: both key
//! a call by a hash of its tool and canonical input (object keys sorted, so `{a,b}` and
//! `{b,a}` are one call). A failed call followed by a successful one with the same hash
//! is a retry; two successful ones are duplicates.

use std::hash::{Hash, Hasher};

use siphasher::sip::SipHasher13;

use serde_json::Value;

/// 128-bit hash of tool + canonical input (two independent 64-bit halves).
pub fn call_hash(tool: &str, input: &Value) -> u128 {
    let mut canonical = Vec::with_capacity(128);
    canonical.extend(tool.bytes().map(|b| b.to_ascii_lowercase()));
    canonical.push(0);
    write_canonical(input, &mut canonical);
    // Hashed as the text it is (`str`'s hashing), so hashes kept in snapshots stay valid.
    let canonical = String::from_utf8_lossy(&canonical);
    // SipHash-1-3 with zero keys: what std's `DefaultHasher` computed when snapshots first
    // kept these hashes, from a crate that cannot change it under a new toolchain.
    let half = |salt: u8| {
        let mut h = SipHasher13::new();
        salt.hash(&mut h);
        canonical.hash(&mut h);
        h.finish()
    };
    (u128::from(half(1)) << 64) | u128::from(half(2))
}

/// Compact JSON with object keys sorted, written straight into `out` (no string per key).
fn write_canonical(v: &Value, out: &mut Vec<u8>) {
    match v {
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            out.push(b'{');
            for k in keys {
                json_into(k, out);
                out.push(b':');
                write_canonical(&map[k], out);
                out.push(b',');
            }
            out.push(b'}');
        }
        Value::Array(items) => {
            out.push(b'[');
            for item in items {
                write_canonical(item, out);
                out.push(b',');
            }
            out.push(b']');
        }
        scalar => json_into(scalar, out),
    }
}

/// Appends `v` as compact JSON (writing into a `Vec` cannot fail).
fn json_into<T: serde::Serialize + ?Sized>(v: &T, out: &mut Vec<u8>) {
    let _ = serde_json::to_writer(out, v);
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
