//! The replay's fidelity proxy. A *reference* is an identifier-like string (at least 6
//! characters, at least one letter, and a digit, `_`, `.`, `/`, `:` or an inner capital:
//! file paths, function names, error codes, hashes) that the agent writes in a request's
//! output (text or tool input) and that occurs in the original output of a tool part from
//! an earlier message: information the agent may have taken from a tool. It *dangles* in a
//! lane when it occurs nowhere in that lane's prompt for the request (placeholders,
//! stripped inputs and summaries included): the agent used something the lane had hidden
//! from it.
//!
//! Occurrence is a plain substring match. Every candidate of a trace is searched for in
//! every original part once (one Aho-Corasick pass per part); a lane's prompt then only
//! needs its reduced parts' renderings searched.

use std::collections::{HashMap, HashSet};

use aho_corasick::AhoCorasick;
use serde_json::Value;

use crate::domain::{Part, PartKind, Role};

use super::Export;

/// Minimum length of a reference.
pub const MIN_LEN: usize = 6;

fn ident_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '/' | ':' | '-')
}

/// True when `token` is identifier-like.
pub fn is_identifier_like(token: &str) -> bool {
    token.len() >= MIN_LEN
        && token.chars().any(|c| c.is_ascii_alphabetic())
        && token.char_indices().any(|(i, c)| {
            c.is_ascii_digit()
                || matches!(c, '_' | '.' | '/' | ':')
                || (i > 0 && c.is_ascii_uppercase())
        })
}

/// The identifier-like strings of `text`, in order of appearance (repeats included).
pub fn identifiers(text: &str) -> impl Iterator<Item = &str> {
    text.split(|c: char| !ident_char(c))
        .map(|t| t.trim_matches(|c| matches!(c, '.' | ':' | '-')))
        .filter(|t| is_identifier_like(t))
}

/// Everything of a part the model reads: text, reasoning, tool input (string values),
/// output and error, file names and sources.
pub fn part_text(part: &Part) -> String {
    let mut out = String::new();
    match &part.kind {
        PartKind::Text(t) => out.push_str(&t.text),
        PartKind::Reasoning(r) => out.push_str(&r.text),
        PartKind::Tool(t) => {
            out.push_str(&t.tool);
            out.push('\n');
            json_strings(&t.state.input, &mut out);
            out.push_str(&t.state.output);
            out.push('\n');
            out.push_str(&t.state.error);
        }
        PartKind::File(f) => {
            out.push_str(&f.filename);
            out.push('\n');
            out.push_str(&f.url);
        }
        _ => {}
    }
    out
}

/// What the agent wrote in a message: its text and its tool inputs.
fn output_text(parts: &[Part]) -> String {
    let mut out = String::new();
    for p in parts {
        match &p.kind {
            PartKind::Text(t) if !t.synthetic => {
                out.push_str(&t.text);
                out.push('\n');
            }
            PartKind::Tool(t) => json_strings(&t.state.input, &mut out),
            _ => {}
        }
    }
    out
}

/// String values (and keys) of a JSON value, one per line.
fn json_strings(v: &Value, out: &mut String) {
    match v {
        Value::String(s) => {
            out.push_str(s);
            out.push('\n');
        }
        Value::Array(a) => a.iter().for_each(|x| json_strings(x, out)),
        Value::Object(o) => o.values().for_each(|x| json_strings(x, out)),
        _ => {}
    }
}

/// The references of one trace, found once and checked against each lane's prompts.
#[derive(Debug, Default)]
pub struct ReferenceIndex {
    /// Per assistant message position: the ids of its references.
    by_request: HashMap<usize, Vec<usize>>,
    /// Reference strings by id.
    strings: Vec<String>,
    /// Per reference id: the original parts (by id) whose text contains it.
    holders: Vec<Vec<String>>,
}

impl ReferenceIndex {
    /// Finds the references of every finished assistant message of `export`.
    pub fn build(export: &Export) -> ReferenceIndex {
        // Candidates: what each assistant message wrote.
        let mut ids: HashMap<String, usize> = HashMap::new();
        let mut strings: Vec<String> = Vec::new();
        let mut written: Vec<(usize, Vec<usize>)> = Vec::new();
        for (i, (info, parts)) in export.messages.iter().enumerate() {
            if info.role != Role::Assistant {
                continue;
            }
            let text = output_text(parts);
            // In order of first appearance, each once: the set keeps the check O(1) where
            // a message repeats its identifiers (a long output holds thousands).
            let mut mine: Vec<usize> = Vec::new();
            let mut seen: HashSet<usize> = HashSet::new();
            for t in identifiers(&text) {
                let next = strings.len();
                let id = *ids.entry(t.to_string()).or_insert_with(|| {
                    strings.push(t.to_string());
                    next
                });
                if seen.insert(id) {
                    mine.push(id);
                }
            }
            written.push((i, mine));
        }
        let mut index = ReferenceIndex {
            strings,
            holders: Vec::new(),
            by_request: HashMap::new(),
        };
        if index.strings.is_empty() {
            return index;
        }
        let Ok(ac) = AhoCorasick::new(&index.strings) else {
            return index;
        };
        index.holders = vec![Vec::new(); index.strings.len()];
        // First message position whose tool output holds each candidate.
        let mut first_tool: Vec<usize> = vec![usize::MAX; index.strings.len()];
        for (i, (_, parts)) in export.messages.iter().enumerate() {
            for p in parts {
                let text = part_text(p);
                let mut found: HashSet<usize> = HashSet::new();
                for m in ac.find_overlapping_iter(&text) {
                    found.insert(m.pattern().as_usize());
                }
                if found.is_empty() {
                    continue;
                }
                let tool_output = match &p.kind {
                    PartKind::Tool(t) => Some(format!("{}\n{}", t.state.output, t.state.error)),
                    _ => None,
                };
                for id in found {
                    index.holders[id].push(p.id.clone());
                    if let Some(out) = &tool_output
                        && first_tool[id] == usize::MAX
                        && out.contains(index.strings[id].as_str())
                    {
                        first_tool[id] = i;
                    }
                }
            }
        }
        for (msg, mine) in written {
            let refs: Vec<usize> = mine
                .into_iter()
                .filter(|&id| first_tool[id] < msg)
                .collect();
            if !refs.is_empty() {
                index.by_request.insert(msg, refs);
            }
        }
        index
    }

    /// The references the assistant message at `msg` makes.
    pub fn of_request(&self, msg: usize) -> &[usize] {
        self.by_request.get(&msg).map_or(&[], Vec::as_slice)
    }

    /// A reference's text.
    pub fn text(&self, id: usize) -> &str {
        &self.strings[id]
    }

    /// How many of the references of request `msg` a prompt does not hold. `verbatim`
    /// says whether a part (by id) reads in the prompt exactly as in the original;
    /// `rendered` is the text of every other part of the prompt.
    pub fn dangling(&self, msg: usize, verbatim: &dyn Fn(&str) -> bool, rendered: &str) -> usize {
        self.of_request(msg)
            .iter()
            .filter(|&&id| {
                !self.holders[id].iter().any(|p| verbatim(p))
                    && !rendered.contains(self.strings[id].as_str())
            })
            .count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifier_like_strings_are_found() {
        let got: Vec<&str> = identifiers(
            "Fixed `src/engine/session.rs:42` and renamed parseExport; error TS2345. \
             Also see build_context() and a1b2c3d4, not 'because' or 123456 or Hello.",
        )
        .collect();
        assert_eq!(
            got,
            [
                "src/engine/session.rs:42",
                "parseExport",
                "TS2345",
                "build_context",
                "a1b2c3d4"
            ]
        );
    }

    #[test]
    fn short_or_plain_words_are_not_references() {
        assert!(!is_identifier_like("a_b.c")); // 5 characters
        assert!(!is_identifier_like("plainword"));
        assert!(!is_identifier_like("1234567")); // no letter
        assert!(is_identifier_like("camelCase"));
        assert!(is_identifier_like("v1.2.3x"));
    }

    fn export(messages: serde_json::Value) -> Export {
        super::super::from_value(serde_json::json!({
            "info": {"id": "ses_refs", "title": "", "time": {"created": 1, "updated": 1}},
            "messages": messages,
        }))
        .expect("valid export")
    }

    fn msg(id: &str, role: &str, parts: serde_json::Value) -> serde_json::Value {
        let mut info = serde_json::json!({"id": id, "sessionID": "ses_refs", "role": role,
            "time": {"created": 1}});
        if role == "assistant" {
            info["time"]["completed"] = 2.into();
            info["finish"] = "stop".into();
        }
        serde_json::json!({"info": info, "parts": parts})
    }

    #[test]
    fn a_reference_needs_an_earlier_tool_output_and_dangles_when_hidden() {
        let e = export(serde_json::json!([
            msg(
                "m1",
                "user",
                serde_json::json!([{"id": "p1", "type": "text", "text": "look at parse_export please"}])
            ),
            msg(
                "m2",
                "assistant",
                serde_json::json!([{"id": "p2", "type": "tool", "callID": "c1", "tool": "grep",
                "state": {"status": "completed", "input": {"pattern": "fn "}, "output": "src/trace/import.rs: fn parse_export", "time": {"start": 1, "end": 2}}}])
            ),
            msg(
                "m3",
                "assistant",
                serde_json::json!([{"id": "p3", "type": "text",
                "text": "parse_export lives in src/trace/import.rs; see also from_value"}])
            ),
        ]));
        let index = ReferenceIndex::build(&e);
        let refs: Vec<&str> = index
            .of_request(2)
            .iter()
            .map(|&id| index.text(id))
            .collect();
        // `from_value` is in no tool output; the user's mention does not count as a tool's.
        assert_eq!(refs, ["parse_export", "src/trace/import.rs"]);
        assert!(
            index.of_request(1).is_empty(),
            "nothing before the first tool output"
        );
        let everything = |_: &str| true;
        assert_eq!(index.dangling(2, &everything, ""), 0);
        // The grep output is masked: only the user's text (part p1) still reads verbatim.
        let only_user = |id: &str| id == "p1";
        assert_eq!(index.dangling(2, &only_user, "[grep output hidden]"), 1);
        assert_eq!(index.dangling(2, &|_| false, "[grep output hidden]"), 2);
        assert_eq!(
            index.dangling(
                2,
                &|_| false,
                "summary: parse_export in src/trace/import.rs"
            ),
            0,
            "a summary that names them keeps them"
        );
    }

    /// A message that repeats its references has each once, in order of first
    /// appearance, and another message's use of one is its own.
    #[test]
    fn a_repeated_reference_counts_once_per_request() {
        let tool = serde_json::json!([{"id": "p1", "type": "tool", "callID": "c1", "tool": "grep",
            "state": {"status": "completed", "input": {"pattern": "fn "},
            "output": "src/a.rs: fn parse_export, fn from_value", "time": {"start": 1, "end": 2}}}]);
        let text =
            |id: &str, text: &str| serde_json::json!([{"id": id, "type": "text", "text": text}]);
        let e = export(serde_json::json!([
            msg("m1", "assistant", tool),
            msg(
                "m2",
                "assistant",
                text(
                    "p2",
                    "from_value, parse_export, from_value and from_value again; parse_export"
                )
            ),
            msg("m3", "assistant", text("p3", "parse_export parse_export")),
        ]));
        let index = ReferenceIndex::build(&e);
        let refs = |msg: usize| -> Vec<&str> {
            index
                .of_request(msg)
                .iter()
                .map(|&id| index.text(id))
                .collect()
        };
        assert_eq!(refs(1), ["from_value", "parse_export"]);
        assert_eq!(refs(2), ["parse_export"]);
        assert_eq!(index.dangling(1, &|_| false, ""), 2);
    }
}
