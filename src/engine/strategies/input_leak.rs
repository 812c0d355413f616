//! Strategy 1, `pruneToolInputs`: a superseded or compacted call keeps only the metadata
//! of its input (paths, urls, commands, patterns, small scalars), never file contents or
//! other large strings, so hiding an output no longer leaves its payload in the input.

use serde::ser::{Serialize, SerializeMap, Serializer};
use serde_json::{Map, Value};

use crate::engine::json_len;

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
        let kept = match keeps(key, value) {
            Keep::Gone => None,
            Keep::Same => Some(value.clone()),
            Keep::FirstLine(s) => Some(Value::String(first_line(s))),
            Keep::Stripped(inner) => Some(Value::Object(strip_object(inner))),
        };
        if let Some(v) = kept {
            out.insert(key.clone(), v);
        }
    }
    out
}

/// The input as [`strip_input`] reduces it, serialized without building the reduced
/// value: the same JSON text, for the context's `arguments` and the rendered part's
/// count. Rendering a stripped call used to clone its input's kept fields into a new map
/// on every context and count, then drop it.
pub struct Stripped<'a>(pub &'a Value);

impl Serialize for Stripped<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self.0 {
            Value::Object(map) => StrippedMap(map).serialize(s),
            other if small(other) => other.serialize(s),
            _ => s.serialize_map(Some(0))?.end(),
        }
    }
}

/// An object as [`strip_object`] reduces it.
struct StrippedMap<'a>(&'a Map<String, Value>);

impl Serialize for StrippedMap<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut out = s.serialize_map(None)?;
        for (key, value) in self.0 {
            match keeps(key, value) {
                Keep::Gone => {}
                Keep::Same => out.serialize_entry(key, value)?,
                Keep::FirstLine(text) => out.serialize_entry(key, &first_line(text))?,
                Keep::Stripped(inner) => out.serialize_entry(key, &StrippedMap(inner))?,
            }
        }
        out.end()
    }
}

/// UTF-16 units of [`Stripped`]'s JSON text, worked out from the input without writing it
/// (`json_len`): what chars ÷ 4 counts of a stripped call, for every output the strategies
/// or prune clear.
pub fn stripped_units(input: &Value) -> u64 {
    match input {
        Value::Object(map) => stripped_map_units(map),
        other if small(other) => json_len::value_units(other),
        _ => json_len::enclosed(0, 0),
    }
}

/// [`stripped_units`] of an object, as [`StrippedMap`] writes it.
fn stripped_map_units(map: &Map<String, Value>) -> u64 {
    let mut kept = 0usize;
    let mut inner = 0u64;
    for (key, value) in map {
        let units = match keeps(key, value) {
            Keep::Gone => continue,
            Keep::Same => json_len::value_units(value),
            Keep::FirstLine(text) => json_len::string_units(&first_line(text)),
            Keep::Stripped(inner) => stripped_map_units(inner),
        };
        kept += 1;
        inner = inner.saturating_add(json_len::entry_units(key, units));
    }
    json_len::enclosed(kept, inner)
}

/// True when [`strip_input`] leaves anything of `input` out: a call whose input is all
/// metadata (a short edit) loses nothing to this strategy.
pub fn strips_something(input: &Value) -> bool {
    match input {
        Value::Object(map) => map_strips_something(map),
        other => !small(other),
    }
}

fn map_strips_something(map: &Map<String, Value>) -> bool {
    map.iter().any(|(key, value)| match keeps(key, value) {
        Keep::Same => false,
        Keep::Stripped(inner) => map_strips_something(inner),
        Keep::Gone | Keep::FirstLine(_) => true,
    })
}

/// What the reduced input keeps of one entry: the one decision behind both the reduced
/// value and its serialization.
enum Keep<'a> {
    /// Nothing.
    Gone,
    /// The value as it is.
    Same,
    /// The first line of a long metadata string.
    FirstLine(&'a str),
    /// A nested object, itself reduced (never empty).
    Stripped(&'a Map<String, Value>),
}

fn keeps<'a>(key: &str, value: &'a Value) -> Keep<'a> {
    match value {
        Value::String(s) if short(s) => Keep::Same,
        Value::String(s) if is_metadata_key(key) => Keep::FirstLine(s),
        Value::String(_) => Keep::Gone,
        Value::Object(inner) if keeps_any(inner) => Keep::Stripped(inner),
        Value::Object(_) => Keep::Gone,
        Value::Array(_) if small(value) => Keep::Same,
        Value::Array(_) => Keep::Gone,
        _ => Keep::Same,
    }
}

/// True when the reduced object keeps any entry.
fn keeps_any(map: &Map<String, Value>) -> bool {
    map.iter().any(|(k, v)| !matches!(keeps(k, v), Keep::Gone))
}

/// True when `key` names metadata (ASCII case ignored; nothing allocated, as this runs
/// for every key of every stripped input a context renders).
fn is_metadata_key(key: &str) -> bool {
    METADATA_KEYS.iter().any(|m| {
        key.as_bytes()
            .windows(m.len())
            .any(|w| w.eq_ignore_ascii_case(m.as_bytes()))
    })
}

fn short(s: &str) -> bool {
    s.len() <= KEEP_CHARS && !s.contains('\n')
}

/// True when the value's JSON text is at most `KEEP_CHARS` bytes; stops writing once it
/// is longer (a large array is not written out to be measured).
fn small(v: &Value) -> bool {
    /// Counts bytes, refusing any past the limit.
    struct Upto(usize);
    impl std::io::Write for Upto {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0 = self.0.saturating_add(bytes.len());
            if self.0 > KEEP_CHARS {
                return Err(std::io::ErrorKind::WriteZero.into());
            }
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    serde_json::to_writer(&mut Upto(0), v).is_ok()
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
    use crate::tokens::utf16_len;
    use serde_json::json;

    #[test]
    fn a_write_keeps_its_path_and_loses_its_content() {
        // Seed 03's example.
        let input = json!({"filePath": "test.txt", "content": "A".repeat(5000)});
        assert_eq!(strip_input(&input), json!({"filePath": "test.txt"}));
        assert!(strips_something(&input));
    }

    /// `strips_something` says exactly whether the stripped input differs.
    #[test]
    fn strips_something_is_whether_the_input_changes() {
        let long = "x".repeat(300);
        for input in [
            json!({"filePath": "a.rs", "oldString": "a", "newString": "b"}),
            json!({"filePath": "a.rs", "oldString": "a\nb"}),
            json!({"command": long}),
            json!({"nested": {"path": "p", "content": long}}),
            json!({"nested": {"path": "p"}}),
            json!({"list": [long]}),
            json!([1, 2]),
            json!(long),
            json!(null),
        ] {
            assert_eq!(
                strips_something(&input),
                strip_input(&input) != input,
                "{input}"
            );
        }
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

    /// `Stripped` writes exactly the reduced value's JSON text, through serde_json and
    /// through sonic-rs (what the context and the counts use), for every tool input of
    /// the shared traces and inputs built around each rule's edge.
    #[test]
    fn stripped_serializes_as_the_reduced_value() {
        let long_line = "x".repeat(KEEP_CHARS + 1);
        let at_limit = "y".repeat(KEEP_CHARS);
        let mut inputs = vec![
            json!({"filePath": "a", "content": "z".repeat(999), "nested": {"k": "v".repeat(500)}}),
            json!({"FilePATH": long_line, "Url": format!("{at_limit}\nmore"), "body": at_limit}),
            json!({"outer": {"inner": {"gone": "a\nb"}}, "kept": {"deep": {"n": 1}}}),
            json!({"list": (0..40).collect::<Vec<_>>(), "short": [1, 2], "empty": {}}),
            json!({"emoji": "🦀".repeat(60), "quote": "\"q\"", "nul": null, "f": 1.5}),
            json!([1, 2, 3]),
            json!((0..200).collect::<Vec<_>>()),
            json!("a lone string"),
            json!(long_line.clone() + &long_line),
            json!(42),
            json!(null),
        ];
        crate::tokens::test_traces::each_value(|v| {
            if let Some(input) = v.get("input") {
                inputs.push(input.clone());
            }
        });
        assert!(inputs.len() > 400, "{} inputs", inputs.len());
        for input in &inputs {
            let want = serde_json::to_string(&strip_input(input)).unwrap_or_default();
            assert_eq!(
                serde_json::to_string(&Stripped(input)).ok(),
                Some(want.clone())
            );
            assert_eq!(
                sonic_rs::to_string(&Stripped(input)).ok(),
                Some(want.clone())
            );
            assert_eq!(stripped_units(input), utf16_len(&want), "{want}");
        }
    }

    proptest::proptest! {
        /// Any input: the units worked out are those of the text `Stripped` writes.
        #[test]
        fn stripped_units_measure_the_written_text(
            input in crate::engine::json_len::tests::any_value()
        ) {
            let text = serde_json::to_string(&Stripped(&input)).unwrap_or_default();
            proptest::prop_assert_eq!(stripped_units(&input), utf16_len(&text));
        }
    }

    #[test]
    fn metadata_keys_match_in_any_case_and_small_measures_the_text() {
        for key in [
            "path",
            "filePath",
            "FILEPATH",
            "baseUrl",
            "CMD",
            "search_query",
        ] {
            assert!(is_metadata_key(key), "{key}");
        }
        for key in ["content", "pat", "ur", "", "pαth"] {
            assert!(!is_metadata_key(key), "{key}");
        }
        for v in [
            json!("y".repeat(KEEP_CHARS - 2)),
            json!((0..60).collect::<Vec<_>>()),
        ] {
            assert_eq!(small(&v), v.to_string().len() <= KEEP_CHARS, "{v}");
        }
        assert!(small(&json!("y".repeat(KEEP_CHARS - 2))));
        assert!(!small(&json!("y".repeat(KEEP_CHARS - 1))));
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
