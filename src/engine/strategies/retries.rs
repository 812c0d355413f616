//! Strategy 6, `pruneRetryParts`, and the base layer's identical-call supersede: both key
//! a call by a hash of its tool and canonical input (object keys sorted, so `{a,b}` and
//! `{b,a}` are one call). A failed call followed by a successful one with the same hash
//! is a retry; two successful ones are duplicates.

use std::hash::{DefaultHasher, Hash, Hasher};

use serde_json::Value;

/// 128-bit hash of tool + canonical input (two independent 64-bit halves).
pub fn call_hash(tool: &str, input: &Value) -> u128 {
    let mut canonical = String::new();
    canonical.push_str(&tool.to_ascii_lowercase());
    canonical.push('\u{0}');
    write_canonical(input, &mut canonical);
    let half = |salt: u8| {
        let mut h = DefaultHasher::new();
        salt.hash(&mut h);
        canonical.hash(&mut h);
        h.finish()
    };
    (u128::from(half(1)) << 64) | u128::from(half(2))
}

fn write_canonical(v: &Value, out: &mut String) {
    match v {
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            out.push('{');
            for k in keys {
                out.push_str(&Value::String(k.clone()).to_string());
                out.push(':');
                write_canonical(&map[k], out);
                out.push(',');
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for item in items {
                write_canonical(item, out);
                out.push(',');
            }
            out.push(']');
        }
        scalar => out.push_str(&scalar.to_string()),
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
}
