//! ACP's aggressive pruning strategies (seed 03) and the supersede layer they build on.
//!
//! Every strategy is a pure function of the session: it decides which parts to mark
//! (lazily: a [`StrategyMark`] on the part, the original kept) and how a marked part reads
//! in the context. Decisions are found incrementally as parts arrive ([`Tracker`]) and
//! committed together with OpenCode's prune after a finished assistant message, so one
//! `pruned` event reports every layer and the context changes at most once per step.
//!
//! Two kinds of strategy:
//! - **supersede**: a newer call makes an older one stale (same file, url, state query,
//!   snapshot, todo list, search, identical input, or a successful retry of a failed call).
//!   The older output reads `[Superseded by a newer call: <id>]`. May touch any turn: it is
//!   about the staleness of older content.
//! - **age**: content older than N user turns is shortened (file attachments after 2,
//!   errors after 3, user code blocks after 5). The last 2 user turns are never touched.
//!
//! Two are rendering rules rather than marks: `pruneStepMarkers` drops step markers from
//! the context, and `pruneToolInputs` strips the input of every superseded or compacted
//! call to its metadata.
//!
//! [`StrategyMark`]: crate::domain::StrategyMark

use serde_json::Value;

mod code_blocks;
mod commit;
mod errors;
mod file_masking;
mod files;
mod input_leak;
mod masking;
mod output_cap;
mod retries;
mod searches;
mod snapshots;
mod source_urls;
mod state_queries;
mod step_markers;
mod todos;
mod tracker;
mod writes;

pub use code_blocks::truncate_code_blocks;
pub use commit::{MarkedPart, StrategyRun, StrategySaving};
pub use errors::truncate_error;
pub use file_masking::{breadcrumb, file_breadcrumb, inlined_breadcrumb, is_inlined_file};
pub use files::file_paths;
pub use input_leak::{Stripped, strip_input, stripped_units, strips_something};
pub use masking::{Masking, masked_text};
pub use output_cap::{cap_chars, capped_text};
pub use step_markers::is_step_marker;
pub use tracker::{PartRef, Pending, Tracker};
pub(crate) use writes::{FileUse, change_bytes, file_use};

pub use crate::config::{Strategy, StrategyPreset, StrategySet, UnknownStrategy};

/// Text a superseded output (or error) reads as in the context.
pub fn superseded_text(by_call: &str) -> String {
    format!("[Superseded by a newer call: {by_call}]")
}

/// Tool names compared the way hosts spell them (`Read`, `read`, `mcp_server_read`).
pub(crate) fn tool_is(tool: &str, names: &[&str]) -> bool {
    names.iter().any(|n| tool.eq_ignore_ascii_case(n))
}

/// Inputs with at most this many fields are searched by comparing keys.
const SCANNED_FIELDS: usize = 8;

/// The field `key` of a tool input, as `Value::get` finds it. Looked up for every call by
/// several strategies; an input holds a handful of fields, and comparing their keys costs
/// less than hashing the key wanted (serde_json's map hashes with SipHash).
pub(crate) fn input_field<'a>(input: &'a Value, key: &str) -> Option<&'a Value> {
    let map = input.as_object()?;
    if map.len() <= SCANNED_FIELDS {
        map.iter().find_map(|(k, v)| (k == key).then_some(v))
    } else {
        map.get(key)
    }
}

/// The fields of a tool input other than `known`, for a supersede key: "" when there are
/// none (so a key reads as it always has for the hosts whose inputs hold only `known`),
/// else each `\0name=value` (value as compact JSON), sorted by name. Two calls that
/// differ in a field a key does not name (Claude Code's `Grep` `glob`, `-i`,
/// `output_mode`; its `WebFetch` `prompt`) are then two queries, not one.
pub(crate) fn other_fields(input: &Value, known: &[&str]) -> String {
    let Some(map) = input.as_object() else {
        return String::new();
    };
    let mut extra: Vec<(&String, &Value)> = map
        .iter()
        .filter(|(k, _)| !known.contains(&k.as_str()))
        .collect();
    if extra.is_empty() {
        return String::new();
    }
    extra.sort_unstable_by(|a, b| a.0.cmp(b.0));
    let mut out = String::new();
    for (k, v) in extra {
        out.push('\0');
        out.push_str(k);
        out.push('=');
        out.push_str(&v.to_string());
    }
    out
}

/// The string field `key` of a tool input (`None`: absent or not a string).
pub(crate) fn str_field<'a>(input: &'a Value, key: &str) -> Option<&'a str> {
    input_field(input, key).and_then(Value::as_str)
}
