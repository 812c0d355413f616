//! Strategy 1, `pruneToolInputs`: a superseded or compacted call keeps only the metadata
//! of its input (paths, urls, commands, patterns, small scalars), never file contents or
//! other large strings, so hiding an output no longer leaves its payload in the input.

use serde_json::{Map, Value};

/// Strings up to this long (on one line) are metadata and stay as they are.
const KEEP_CHARS: usize = 200;

/// Keys whose values identify what a call touched; long ones keep their first line.
const METADATA_KEYS: &[&str] = &[
    "path", "url", "command", "cmd", "query", "pattern", "include",
];

/// The input reduced to its metadata.
pub fn strip_input(input: &Value) -> Value {
    match input {
        Value::Object(map) => Value::Object(strip_object(map)),
        other if small(other) => other.clone(),
        _ => Value::Object(Map::new()),
    }
}

fn strip_object(map: &Map<String, Value>) -> Map<String, Value> {
    let mut out = Map::new();
    for (key, value) in map {
        let kept = match value {
            Value::String(s) if short(s) => Some(value.clone()),
            Value::String(s) if is_metadata_key(key) => Some(Value::String(first_line(s))),
            Value::String(_) => None,
            Value::Object(inner) => {
                let inner = strip_object(inner);
                (!inner.is_empty()).then_some(Value::Object(inner))
            }
            Value::Array(_) => small(value).then(|| value.clone()),
            scalar => Some(scalar.clone()),
        };
        if let Some(v) = kept {
            out.insert(key.clone(), v);
        }
    }
    out
}

fn is_metadata_key(key: &str) -> bool {
    let key = key.to_ascii_lowercase();
    METADATA_KEYS.iter().any(|m| key.contains(m))
}

fn short(s: &str) -> bool {
    s.len() <= KEEP_CHARS && !s.contains('\n')
}

fn small(v: &Value) -> bool {
    v.to_string().len() <= KEEP_CHARS
}

/// The first line, cut at `KEEP_CHARS` characters, with an ellipsis when anything went.
fn first_line(s: &str) -> String {
    let line = s.lines().next().unwrap_or_default();
    let cut: String = line.chars().take(KEEP_CHARS).collect();
    if cut.len() < s.len() {
        format!("{cut}…")
    } else {
        cut
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_write_keeps_its_path_and_loses_its_content() {
        // Seed 03's example.
        let input = json!({"filePath": "test.txt", "content": "A".repeat(5000)});
        assert_eq!(strip_input(&input), json!({"filePath": "test.txt"}));
    }

    #[test]
    fn edits_lose_both_strings_and_keep_flags() {
        let input = json!({"filePath": "src/a.rs", "oldString": "x\n".repeat(300),
            "newString": "y\n".repeat(300), "replaceAll": true});
        assert_eq!(
            strip_input(&input),
            json!({"filePath": "src/a.rs", "replaceAll": true})
        );
    }

    #[test]
    fn long_commands_keep_their_first_line() {
        let cmd = format!("cat <<'EOF' > big.txt\n{}\nEOF", "data ".repeat(500));
        let out = strip_input(&json!({"command": cmd, "description": "write a file"}));
        assert_eq!(out["command"], "cat <<'EOF' > big.txt…");
        assert_eq!(out["description"], "write a file");
    }

    #[test]
    fn small_inputs_are_unchanged_and_stripping_is_idempotent() {
        let input = json!({"filePath": "a", "offset": 10, "limit": 20});
        assert_eq!(strip_input(&input), input);
        let big =
            json!({"filePath": "a", "content": "z".repeat(999), "nested": {"k": "v".repeat(500)}});
        let once = strip_input(&big);
        assert_eq!(strip_input(&once), once);
        assert_eq!(once, json!({"filePath": "a"}));
    }
}
