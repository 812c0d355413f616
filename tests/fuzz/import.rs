//! Fuzzing of the `opencode export` import: `trace::parse_export` (text), `trace::from_value`
//! (an already parsed document, as `ImportSession`'s `export` field carries it) and
//! `trace::load` (the session built from it).
//!
//! Inputs: arbitrary strings and JSON-ish text, export-shaped documents whose every field
//! may be missing, of the wrong type or hostile, and the shared real traces mutated (bytes
//! flipped, inserted, deleted, truncated; nodes of the parsed document replaced or removed).
//!
//! Asserted: no panic; text and value give the same verdict; a refusal names a JSON path
//! that starts at the document's root and whose indexes exist in the document; what is
//! accepted is within the domain's bounds and loads into a session or is refused with a
//! field and a message.
//!
//! The bug it found (a deep unknown field in the session's own info, accepted and then
//! unreadable) is fixed; its regression test is at the end of this file.

use std::sync::LazyLock;

use compactd::config::{EngineConfig, SessionOverrides};
use compactd::domain::{MAX_ID_BYTES, MAX_JSON_DEPTH, ModelLimits};
use compactd::engine::ErrorKind;
use compactd::trace::{self, Export, ImportError};
use proptest::collection::{btree_map, vec};
use proptest::option;
use proptest::prelude::*;
use proptest::sample::select;
use proptest::test_runner::TestCaseError;
use serde_json::{Map, Number, Value};

use super::{Tally, fuzz, text};

// ---- the checks ------------------------------------------------------------------------

/// One step of an import error's path.
#[derive(Debug, PartialEq)]
enum Step<'a> {
    Key(&'a str),
    Index(usize),
}

/// `messages[3].parts[1].state.status` → keys and indexes; `None` if it is not of that
/// shape (a key, then `.key` or `[n]` steps).
fn steps(path: &str) -> Option<Vec<Step<'_>>> {
    let mut out = Vec::new();
    let mut rest = path;
    let mut first = true;
    while !rest.is_empty() {
        if let Some(r) = rest.strip_prefix('[') {
            let end = r.find(']')?;
            out.push(Step::Index(r[..end].parse().ok()?));
            rest = &r[end + 1..];
        } else {
            let r = if first { rest } else { rest.strip_prefix('.')? };
            let end = r.find(['.', '[']).unwrap_or(r.len());
            let key = &r[..end];
            if key.is_empty() || !key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                return None;
            }
            out.push(Step::Key(key));
            rest = &r[end..];
        }
        first = false;
    }
    Some(out)
}

/// A refused document: a message, and a path from the root (`$` for the whole document)
/// whose every index names an element the document has.
fn check_error(e: &ImportError, doc: Option<&Value>) -> Result<(), TestCaseError> {
    prop_assert!(!e.message.trim().is_empty(), "no message in {e:?}");
    if e.path == "$" {
        return Ok(());
    }
    let Some(steps) = steps(&e.path) else {
        return Err(TestCaseError::fail(format!("malformed path in {e:?}")));
    };
    prop_assert!(
        matches!(
            steps.first(),
            Some(Step::Key("info" | "messages" | "todos"))
        ),
        "path from an unknown root in {e:?}"
    );
    let Some(doc) = doc else { return Ok(()) };
    // Follow the path while it resolves: an index must resolve (keys after the last
    // resolved step may name a field that is missing, or the domain's name for it).
    let mut at = Some(doc);
    for step in &steps {
        match step {
            Step::Key(k) => at = at.and_then(|v| v.get(*k)),
            Step::Index(i) => {
                let element = at.and_then(|v| v.as_array()).and_then(|a| a.get(*i));
                prop_assert!(element.is_some(), "{e:?}: no element [{i}] in the document");
                at = element;
            }
        }
    }
    Ok(())
}

fn engine_config() -> &'static EngineConfig {
    static CONFIG: LazyLock<EngineConfig> = LazyLock::new(EngineConfig::default);
    &CONFIG
}

/// What an accepted document holds is within the domain's bounds, and loads.
fn check_export(export: Export, t: &Tally) -> Result<(), TestCaseError> {
    t.hit("imported");
    for (i, (info, parts)) in export.messages.iter().enumerate() {
        prop_assert!(info.validate().is_ok(), "messages[{i}].info: {info:?}");
        for p in parts {
            prop_assert!(p.validate().is_ok(), "messages[{i}] part {p:?}");
        }
    }
    prop_assert!(!export.info.id.is_empty());
    // The session's own fields are bounded like a Stream open's (`ImportSession` checks the
    // id itself, and may replace it).
    let mut info = export.info.clone();
    info.id = "ses_import".into();
    match info.validate() {
        Ok(()) => {}
        Err(e) => {
            return Err(TestCaseError::fail(format!(
                "info accepted beyond the domain's bounds: {e}"
            )));
        }
    }
    let messages = export.messages.len();
    let limits = ModelLimits {
        context: 200_000,
        input: 0,
        output: 32_000,
    };
    match trace::load(export, limits, SessionOverrides::default(), engine_config()) {
        Ok(session) => {
            t.hit("loaded");
            prop_assert!(session.messages().len() <= messages);
        }
        Err(e) => {
            t.hit("refused by load");
            prop_assert!(!e.message.trim().is_empty(), "no message in {e:?}");
            prop_assert!(
                !e.field.is_empty() || e.kind == ErrorKind::ResourceExhausted,
                "no field in {e:?}"
            );
        }
    }
    Ok(())
}

/// The whole pipeline on a document: as a value and as text, same verdict.
fn check_document(doc: Value, t: &Tally) -> Result<(), TestCaseError> {
    let text = doc.to_string();
    let from_text = trace::parse_export(&text);
    let from_value = trace::from_value(doc.clone());
    match (&from_text, &from_value) {
        (Ok(_), Ok(_)) => {}
        (Err(a), Err(b)) => prop_assert_eq!(&a.path, &b.path, "text and value disagree"),
        _ => {
            return Err(TestCaseError::fail(format!(
                "text and value disagree: {from_text:?} vs {from_value:?}"
            )));
        }
    }
    match from_value {
        Ok(export) => check_export(export, t),
        Err(e) => {
            t.hit("refused by the import");
            check_error(&e, Some(&doc))
        }
    }
}

/// The pipeline on text that may not be JSON at all.
fn check_text(text: &str, t: &Tally) -> Result<(), TestCaseError> {
    match trace::parse_export(text) {
        Ok(export) => check_export(export, t),
        Err(e) => {
            t.hit(if e.path == "$" {
                "not an export"
            } else {
                "refused by the import"
            });
            let doc: Option<Value> = serde_json::from_str(text).ok();
            check_error(&e, doc.as_ref())
        }
    }
}

// ---- generated documents ---------------------------------------------------------------

/// Every key the import reads, and a few it does not.
const KEYS: [&str; 44] = [
    "id",
    "title",
    "info",
    "messages",
    "parts",
    "todos",
    "role",
    "parentID",
    "time",
    "created",
    "completed",
    "summary",
    "mode",
    "agent",
    "finish",
    "tokens",
    "total",
    "input",
    "output",
    "cache",
    "read",
    "cost",
    "error",
    "name",
    "data",
    "model",
    "providerID",
    "sessionID",
    "messageID",
    "type",
    "text",
    "metadata",
    "callID",
    "tool",
    "state",
    "status",
    "start",
    "end",
    "compacted",
    "attachments",
    "source",
    "size",
    "files",
    "unknownField",
];

fn key() -> BoxedStrategy<String> {
    prop_oneof![4 => select(KEYS.to_vec()).prop_map(String::from), 1 => text()].boxed()
}

fn number() -> BoxedStrategy<Value> {
    prop_oneof![
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        select(vec![0i64, -1, i64::MIN, i64::MAX]).prop_map(Value::from),
        any::<f64>().prop_map(|f| Number::from_f64(f).map_or(Value::Null, Value::Number)),
        select(vec![1e300, -1e300, 9.3e18, -9.3e18, 1.5, -0.0])
            .prop_map(|f| Number::from_f64(f).map_or(Value::Null, Value::Number)),
    ]
    .boxed()
}

/// `n` levels of `{"a": ...}` (or `[...]`): the depth limit's edge.
fn nested(n: usize, lists: bool) -> Value {
    let mut v = Value::from("leaf");
    for level in 0..n {
        v = if lists && level % 2 == 1 {
            Value::Array(vec![v])
        } else {
            let mut m = Map::new();
            m.insert("a".into(), v);
            Value::Object(m)
        };
    }
    v
}

/// A JSON scalar.
fn scalar() -> BoxedStrategy<Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        number(),
        text().prop_map(Value::String),
    ]
    .boxed()
}

/// Any JSON, small, with the keys the import reads; sometimes nested around the limit.
fn junk() -> BoxedStrategy<Value> {
    let tree = scalar().prop_recursive(4, 24, 4, |inner| {
        prop_oneof![
            vec(inner.clone(), 0..4).prop_map(Value::Array),
            btree_map(key(), inner, 0..4).prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    });
    prop_oneof![
        30 => tree,
        1 => ((MAX_JSON_DEPTH - 3)..(MAX_JSON_DEPTH + 4), any::<bool>())
            .prop_map(|(n, lists)| nested(n, lists)),
    ]
    .boxed()
}

/// A field: usually its right shape, sometimes anything, sometimes missing (`odds` in
/// 100 each). Fields the import requires go wrong less often, so documents get past them.
fn field(right: BoxedStrategy<Value>, odds: u32) -> BoxedStrategy<Option<Value>> {
    prop_oneof![
        100 - 2 * odds => right.prop_map(Some),
        odds => junk().prop_map(Some),
        odds => Just(None),
    ]
    .boxed()
}

/// A field the import requires (or takes apart into fields it requires).
const REQUIRED: u32 = 2;
/// Any other field.
const OPTIONAL: u32 = 7;

/// An object of the given fields (each per [`field`]: `required` ones first), plus maybe
/// an unknown one.
fn object(
    required: Vec<(&'static str, BoxedStrategy<Value>)>,
    optional: Vec<(&'static str, BoxedStrategy<Value>)>,
) -> BoxedStrategy<Value> {
    let odds = std::iter::repeat_n(REQUIRED, required.len())
        .chain(std::iter::repeat_n(OPTIONAL, optional.len()));
    let (names, values): (Vec<&'static str>, Vec<BoxedStrategy<Option<Value>>>) = required
        .into_iter()
        .chain(optional)
        .zip(odds)
        .map(|((n, s), odds)| (n, field(s, odds)))
        .unzip();
    (values, option::weighted(0.1, (key(), scalar())))
        .prop_map(move |(values, extra)| {
            let mut m = Map::new();
            for (name, v) in names.iter().zip(values) {
                if let Some(v) = v {
                    m.insert((*name).to_string(), v);
                }
            }
            if let Some((k, v)) = extra {
                m.insert(k, v);
            }
            Value::Object(m)
        })
        .boxed()
}

/// One of `choices`, or (one time in `1 + odds`) a hostile string.
fn one_of(choices: &[&'static str], odds: u32) -> BoxedStrategy<Value> {
    prop_oneof![
        odds => select(choices.to_vec()).prop_map(Value::from),
        1 => text().prop_map(Value::from),
    ]
    .boxed()
}

fn string(choices: &[&'static str]) -> BoxedStrategy<Value> {
    one_of(choices, 4)
}

/// A tag the import matches on (role, part type, tool status).
fn tag(choices: &[&'static str]) -> BoxedStrategy<Value> {
    one_of(choices, 30)
}

fn id(choices: &[&'static str]) -> BoxedStrategy<Value> {
    prop_oneof![
        30 => select(choices.to_vec()).prop_map(Value::from),
        1 => text().prop_map(Value::from),
        1 => select(vec![MAX_ID_BYTES, MAX_ID_BYTES + 1]).prop_map(|n| Value::from("d".repeat(n))),
    ]
    .boxed()
}

fn int() -> BoxedStrategy<Value> {
    prop_oneof![4 => (0i64..2_000_000_000_000).prop_map(Value::from), 1 => number()].boxed()
}

fn boolean() -> BoxedStrategy<Value> {
    any::<bool>().prop_map(Value::Bool).boxed()
}

fn tokens() -> BoxedStrategy<Value> {
    object(
        vec![],
        vec![
            ("total", number()),
            ("input", int()),
            ("output", int()),
            ("reasoning", int()),
            (
                "cache",
                object(vec![], vec![("read", int()), ("write", int())]),
            ),
        ],
    )
}

fn time(keys: &'static [&'static str]) -> BoxedStrategy<Value> {
    object(vec![], keys.iter().map(|k| (*k, int())).collect())
}

fn model() -> BoxedStrategy<Value> {
    object(
        vec![],
        vec![
            ("providerID", string(&["anthropic"])),
            ("modelID", string(&["claude"])),
        ],
    )
}

fn message_info() -> BoxedStrategy<Value> {
    object(
        vec![
            ("id", id(&["m1", "m2", "m3"])),
            ("role", tag(&["user", "assistant"])),
        ],
        vec![
            ("parentID", string(&["m1", "m2", ""])),
            ("time", time(&["created", "completed"])),
            ("summary", prop_oneof![boolean(), junk()].boxed()),
            ("mode", string(&["build", "compaction"])),
            ("agent", string(&["build", "compaction"])),
            ("finish", string(&["stop", "tool-calls", ""])),
            ("tokens", tokens()),
            ("cost", number()),
            (
                "error",
                object(
                    vec![],
                    vec![("name", string(&["APIError"])), ("data", junk())],
                ),
            ),
            ("model", model()),
            ("providerID", string(&["openai"])),
            ("sessionID", string(&["ses_1"])),
        ],
    )
}

fn tool_state() -> BoxedStrategy<Value> {
    let attachment = object(
        vec![],
        vec![
            ("mime", string(&["text/plain"])),
            ("url", string(&["file:///a"])),
            ("size", int()),
        ],
    );
    object(
        vec![("status", tag(&["pending", "running", "completed", "error"]))],
        vec![
            ("input", junk()),
            ("output", string(&["ok", ""])),
            ("error", string(&["failed"])),
            ("title", string(&["t"])),
            ("raw", string(&["r"])),
            ("metadata", junk()),
            ("time", time(&["start", "end", "compacted"])),
            (
                "attachments",
                vec(attachment, 0..2).prop_map(Value::Array).boxed(),
            ),
        ],
    )
}

/// A part of type `ty` with that type's fields.
fn part_of(
    ty: &'static str,
    fields: Vec<(&'static str, BoxedStrategy<Value>)>,
) -> BoxedStrategy<Value> {
    let mut optional = vec![
        ("messageID", string(&["m1", "m2", ""])),
        ("sessionID", string(&["ses_1"])),
    ];
    optional.extend(fields);
    object(
        vec![("id", id(&["p1", "p2", "p3", "p4"])), ("type", tag(&[ty]))],
        optional,
    )
}

/// A part of any type OpenCode exports, tool calls the most.
fn part() -> BoxedStrategy<Value> {
    let time = || time(&["start", "end"]);
    prop_oneof![
        3 => part_of("text", vec![
            ("text", string(&["hello"])),
            ("synthetic", boolean()),
            ("ignored", boolean()),
            ("time", time()),
            ("metadata", junk()),
        ]),
        1 => part_of("reasoning", vec![
            ("text", string(&["hmm"])),
            ("time", time()),
            ("metadata", junk()),
        ]),
        6 => part_of("tool", vec![
            ("callID", id(&["call_1", "call_2"])),
            ("tool", string(&["read", "bash", "skill"])),
            ("state", tool_state()),
            ("metadata", junk()),
        ]),
        1 => part_of("step-start", vec![("snapshot", string(&["abc"]))]),
        1 => part_of("step-finish", vec![
            ("reason", string(&["stop"])),
            ("snapshot", string(&["abc"])),
            ("cost", number()),
            ("tokens", tokens()),
        ]),
        1 => part_of("file", vec![
            ("mime", string(&["text/plain"])),
            ("filename", string(&["a.txt"])),
            ("url", string(&["file:///a"])),
            ("source", junk()),
            ("size", int()),
        ]),
        1 => part_of("snapshot", vec![("snapshot", string(&["abc"]))]),
        1 => part_of("patch", vec![
            ("hash", string(&["h"])),
            ("files", vec(prop_oneof![string(&["a.rs"]), junk()], 0..3).prop_map(Value::Array).boxed()),
        ]),
        1 => part_of("agent", vec![("name", string(&["build"])), ("source", junk())]),
        1 => part_of("subtask", vec![
            ("prompt", string(&["do it"])),
            ("description", string(&["d"])),
            ("agent", string(&["general"])),
            ("model", model()),
            ("command", string(&["/c"])),
        ]),
        1 => part_of("retry", vec![
            ("attempt", int()),
            ("error", junk()),
            ("time", time_created()),
        ]),
        1 => part_of("compaction", vec![
            ("auto", boolean()),
            ("overflow", boolean()),
            ("tail_start_id", string(&["m2"])),
        ]),
    ]
    .boxed()
}

fn time_created() -> BoxedStrategy<Value> {
    time(&["created"])
}

fn message() -> BoxedStrategy<Value> {
    object(
        vec![("info", message_info())],
        vec![("parts", vec(part(), 0..4).prop_map(Value::Array).boxed())],
    )
}

/// An export-shaped document: every field may be missing, mistyped or hostile.
fn document() -> BoxedStrategy<Value> {
    let todo = object(
        vec![],
        vec![
            ("id", string(&["1"])),
            ("content", string(&["write tests"])),
            ("status", string(&["pending"])),
            ("priority", string(&["high"])),
        ],
    );
    object(
        vec![
            (
                "info",
                object(
                    vec![("id", id(&["ses_1"]))],
                    vec![
                        ("title", string(&["a session"])),
                        ("version", string(&["1.2.5"])),
                        ("extra", junk()),
                    ],
                ),
            ),
            (
                "messages",
                vec(message(), 0..5).prop_map(Value::Array).boxed(),
            ),
        ],
        vec![("todos", vec(todo, 0..2).prop_map(Value::Array).boxed())],
    )
}

#[test]
fn fuzz_import_documents() {
    fuzz("import_documents", 600, document(), check_document);
}

#[test]
fn fuzz_import_any_json() {
    fuzz("import_any_json", 300, junk(), check_document);
}

/// Text that is rarely JSON: any string, JSON-ish character soup, unbalanced nesting.
fn soup() -> BoxedStrategy<String> {
    prop_oneof![
        3 => any::<String>(),
        3 => "[\\[\\]{}\":,0-9a-z .eE+\\-\\\\]{0,64}",
        1 => (1usize..200_000, any::<bool>()).prop_map(|(n, obj)| {
            if obj {
                format!("{{\"info\":{{\"id\":\"s\"}},\"messages\":{}", "[".repeat(n))
            } else {
                "[".repeat(n)
            }
        }),
        1 => select(vec![
            "", "null", "{}", "[]", "\"x\"", "{\"info\":{}}", "{\"info\":{\"id\":\"s\"}}",
            "{\"info\":{\"id\":\"s\"},\"messages\":{}}", "{\"info\":{\"id\":\"s\"},\"messages\":[1]}",
            "{\"info\":{\"id\":\"s\"},\"messages\":[],\"todos\":7}", "\u{feff}{}", "{\"info\":1e999}",
        ])
        .prop_map(String::from),
    ]
    .boxed()
}

#[test]
fn fuzz_import_text() {
    fuzz("import_text", 1000, soup(), |s, t| check_text(&s, t));
}

// ---- mutated real traces ---------------------------------------------------------------

/// The three smallest shared traces, one from each source format family.
const TRACES: [&str; 3] = [
    "opencode-jolly-eagle.json",
    "opencode-nimble-pixel.json",
    "openhands-ponyc-4595.json",
];

struct Trace {
    text: String,
    doc: Value,
    /// Nodes of the document, counted in pre-order.
    nodes: usize,
}

fn count(v: &Value) -> usize {
    1 + match v {
        Value::Array(a) => a.iter().map(count).sum(),
        Value::Object(o) => o.values().map(count).sum(),
        _ => 0,
    }
}

fn traces() -> &'static [Trace] {
    static TRACES_: LazyLock<Vec<Trace>> = LazyLock::new(|| {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/traces");
        TRACES
            .iter()
            .map(|name| {
                let text = std::fs::read_to_string(dir.join(name)).expect("trace readable");
                let doc: Value = serde_json::from_str(&text).expect("trace is JSON");
                let nodes = count(&doc);
                Trace { text, doc, nodes }
            })
            .collect()
    });
    &TRACES_
}

/// One edit of a trace's text (positions modulo its length, moved to a char boundary).
#[derive(Debug, Clone)]
enum ByteEdit {
    Flip { at: usize, bit: u8 },
    Insert { at: usize, text: String },
    Delete { at: usize, len: usize },
    Truncate { at: usize },
}

fn byte_edit() -> impl Strategy<Value = ByteEdit> {
    prop_oneof![
        3 => (any::<usize>(), 0u8..7).prop_map(|(at, bit)| ByteEdit::Flip { at, bit }),
        2 => (any::<usize>(), prop_oneof![text(), select(vec!["\"", "{", "}", "[", "]", ",", ":", "\\", "null", "1e999", "-"]).prop_map(String::from)])
            .prop_map(|(at, text)| ByteEdit::Insert { at, text }),
        2 => (any::<usize>(), 1usize..64).prop_map(|(at, len)| ByteEdit::Delete { at, len }),
        1 => any::<usize>().prop_map(|at| ByteEdit::Truncate { at }),
    ]
}

fn edit_text(mut s: String, edits: &[ByteEdit]) -> String {
    let boundary = |s: &str, at: usize| {
        let mut at = at % (s.len() + 1);
        while !s.is_char_boundary(at) {
            at -= 1;
        }
        at
    };
    for e in edits {
        match e {
            ByteEdit::Flip { at, bit } => {
                // ASCII bytes only, flipped within ASCII, so the text stays UTF-8.
                let at = boundary(&s, *at);
                if let Some(b) = s.as_bytes().get(at).copied().filter(u8::is_ascii) {
                    let flipped = char::from((b ^ (1 << bit)) & 0x7f);
                    s.replace_range(at..at + 1, flipped.encode_utf8(&mut [0; 4]));
                }
            }
            ByteEdit::Insert { at, text } => {
                let at = boundary(&s, *at);
                s.insert_str(at, text);
            }
            ByteEdit::Delete { at, len } => {
                let from = boundary(&s, *at);
                let to = boundary(&s, from.saturating_add(*len).min(s.len()));
                s.replace_range(from..to.max(from), "");
            }
            ByteEdit::Truncate { at } => {
                let at = boundary(&s, *at);
                s.truncate(at);
            }
        }
    }
    s
}

/// One edit of a trace's parsed document: the node at a pre-order position replaced by
/// another value, or removed from its parent.
#[derive(Debug, Clone)]
enum NodeEdit {
    Replace { at: usize, with: Value },
    Remove { at: usize },
}

fn node_edit() -> impl Strategy<Value = NodeEdit> {
    prop_oneof![
        3 => (any::<usize>(), junk()).prop_map(|(at, with)| NodeEdit::Replace { at, with }),
        1 => any::<usize>().prop_map(|at| NodeEdit::Remove { at }),
    ]
}

/// Applies `edit` to the node at pre-order position `*at` under `v` (the root is 0 and
/// is never removed); counts `*at` down as it walks.
fn edit_node(v: &mut Value, at: &mut usize, edit: &NodeEdit) -> bool {
    match v {
        Value::Array(a) => {
            for i in 0..a.len() {
                *at -= 1;
                if *at == 0 {
                    match edit {
                        NodeEdit::Replace { with, .. } => a[i] = with.clone(),
                        NodeEdit::Remove { .. } => {
                            a.remove(i);
                        }
                    }
                    return true;
                }
                if edit_node(&mut a[i], at, edit) {
                    return true;
                }
            }
        }
        Value::Object(o) => {
            let keys: Vec<String> = o.keys().cloned().collect();
            for k in keys {
                *at -= 1;
                if *at == 0 {
                    match edit {
                        NodeEdit::Replace { with, .. } => {
                            o.insert(k, with.clone());
                        }
                        NodeEdit::Remove { .. } => {
                            o.shift_remove(&k);
                        }
                    }
                    return true;
                }
                if edit_node(o.get_mut(&k).expect("key present"), at, edit) {
                    return true;
                }
            }
        }
        _ => {}
    }
    false
}

#[test]
fn fuzz_import_mutated_text() {
    fuzz(
        "import_mutated_text",
        300,
        (0..TRACES.len(), vec(byte_edit(), 1..5)),
        |(i, edits), t| check_text(&edit_text(traces()[i].text.clone(), &edits), t),
    );
}

#[test]
fn fuzz_import_mutated_documents() {
    fuzz(
        "import_mutated_documents",
        250,
        (0..TRACES.len(), vec(node_edit(), 1..4)),
        |(i, edits), t| {
            let trace = &traces()[i];
            let mut doc = trace.doc.clone();
            for e in &edits {
                let (NodeEdit::Replace { at, .. } | NodeEdit::Remove { at }) = e;
                let mut at = 1 + at % (trace.nodes - 1).max(1);
                edit_node(&mut doc, &mut at, e);
            }
            check_document(doc, t)
        },
    );
}

/// Every shared trace imports as it is (so the mutations start from accepted documents).
#[test]
fn fuzz_import_seeds_are_accepted() {
    for t in traces() {
        let export = trace::parse_export(&t.text).expect("a shared trace imports");
        let tally = Tally::default();
        check_export(export, &tally).expect("a shared trace loads");
        assert_eq!(tally.summary(), "imported 1, loaded 1");
        assert!(t.nodes > 100);
    }
    assert_eq!(
        steps("messages[3].parts[1].state.status"),
        Some(vec![
            Step::Key("messages"),
            Step::Index(3),
            Step::Key("parts"),
            Step::Index(1),
            Step::Key("state"),
            Step::Key("status"),
        ])
    );
    assert_eq!(steps("messages[x]"), None);
    assert_eq!(steps("messages..id"), None);
}

// ---- regressions -----------------------------------------------------------------------

/// Found by `fuzz_import_documents`: the import bounds the JSON depth of every message and
/// part, but not of the session's own unknown fields (`info`'s, and the document's
/// top-level ones, kept in `info.extra`), so a document a Stream open would refuse is
/// imported, and its `GetSession` reply is deeper than a protobuf client can decode
/// (`src/server/fuzz_tests.rs`, `fuzz_regression_imported_session_reads_back`).
#[test]
fn fuzz_regression_deep_session_fields_are_refused() {
    let deep = nested(MAX_JSON_DEPTH + 1, false);
    let info_field = serde_json::json!({"info": {"id": "s", "x": deep}, "messages": []});
    let top_level = serde_json::json!({"info": {"id": "s"}, "messages": [], "x": deep});
    for doc in [info_field, top_level] {
        match trace::from_value(doc.clone()) {
            Err(e) => assert!(!e.message.is_empty(), "{e:?}"),
            Ok(export) => {
                let mut info = export.info;
                info.id = "ses_import".into();
                assert_eq!(info.validate(), Ok(()), "{doc}");
            }
        }
    }
}
