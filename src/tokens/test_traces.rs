//! Test support: every JSON value of the shared traces (`tests/data/traces`), for tests
//! that check a text function against a reference over real agent output.

/// Calls `f` on every value (objects, arrays and their members, recursively) of every
/// trace file.
pub(crate) fn each_value(mut f: impl FnMut(&serde_json::Value)) {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/traces");
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        if let Ok(text) = std::fs::read_to_string(entry.path()) {
            let json: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
            walk(&json, &mut f);
        }
    }
}

fn walk(v: &serde_json::Value, f: &mut impl FnMut(&serde_json::Value)) {
    f(v);
    match v {
        serde_json::Value::Array(a) => a.iter().for_each(|v| walk(v, f)),
        serde_json::Value::Object(o) => o.values().for_each(|v| walk(v, f)),
        _ => {}
    }
}
