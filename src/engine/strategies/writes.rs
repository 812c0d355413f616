//! `supersedeWrites` (compactd; seed 03's "write→read supersede", which ACP keeps when
//! `aggressiveFilePrune` is off): a write, edit or patch is stale once every file it
//! changed has been read whole after it, since the read shows what the change left. Only
//! the change is superseded (its input then keeps only metadata, under `pruneToolInputs`;
//! its output reads as the supersede note, or keeps its text before the note when that is
//! shorter); the read the agent works from stays, so unlike `aggressiveFilePrune` an edit
//! never hides the file it was made against. A read with a range (`offset`, `limit`,
//! `view_range`, in any case), or one cut short (OpenCode's `metadata.truncated`, or the
//! note OpenCode or OpenHands end it with), shows part of the file and supersedes nothing.
//!
//! The state is, per path (its hash), the newest whole read and the changes not yet read
//! after, in position order; so each call costs O(paths it names × log changes waiting)
//! plus the changes a read releases. "After" is by position, as every supersede (a change
//! arriving after a newer read is superseded at once), and in a later message: a host
//! runs one step's calls together, so a read beside the change may show the file before
//! it. A change naming more than
//! [`MAX_CHANGE_PATHS`] files is left alone: each path costs an entry.

use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::files::file_paths;
use super::retries::text_hash;
use super::{PartRef, input_field, str_field, tool_is};
use crate::domain::FastMap;

/// Tools that change the files their input names.
const CHANGE_TOOLS: &[&str] = &[
    "write",
    "edit",
    "multiedit",
    "notebookedit",
    "apply_patch",
    "patch",
];

/// Tools that read the file their input names.
const READ_TOOLS: &[&str] = &["read", "view", "notebookread"];

/// Input fields that make a read show part of a file, lowercase without `_` (an input's
/// key is compared so: `view_range`, `viewRange`).
const RANGE_FIELDS: &[&str] = &[
    "offset",
    "limit",
    "viewrange",
    "linerange",
    "startline",
    "endline",
];

/// How reads end an output they cut short: OpenCode's older and newer notes, OpenHands'.
const CUT_SHORT: &[&str] = &[
    "Use 'offset' parameter to read beyond line",
    "Use offset=",
    "<response clipped>",
];

/// Bytes at the end of a read's output searched for [`CUT_SHORT`].
const CUT_SHORT_TAIL: usize = 512;

/// Most files a change may name and still be superseded by reads.
pub const MAX_CHANGE_PATHS: usize = 8;

/// What a call does to the files it names, for this strategy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileUse {
    /// Changes them.
    Change,
    /// Reads the one file whole.
    WholeRead,
    /// Neither (or a ranged read).
    Other,
}

/// Bytes this strategy may hold per file a waiting change names (its entry in `waiting`
/// and in `left`), counted with the part ([`change_bytes`]).
const CHANGE_PATH_BYTES: usize = 160;

/// What a call's input says it does to files, before its output is looked at.
fn kind(tool: &str, input: &Value) -> FileUse {
    if tool.eq_ignore_ascii_case("str_replace_editor") {
        return match str_field(input, "command") {
            Some("view") => FileUse::WholeRead,
            _ => FileUse::Change,
        };
    }
    if tool_is(tool, READ_TOOLS) {
        FileUse::WholeRead
    } else if tool_is(tool, CHANGE_TOOLS) {
        FileUse::Change
    } else {
        FileUse::Other
    }
}

/// Bytes the strategy's state may hold for a part until the files it changed are read
/// (0 for any other part): the memory limits count them with the part.
pub(crate) fn change_bytes(tool: &str, input: &Value) -> usize {
    if kind(tool, input) != FileUse::Change {
        return 0;
    }
    match file_paths(tool, input).len() {
        n if n > MAX_CHANGE_PATHS => 0,
        n => n * CHANGE_PATH_BYTES,
    }
}

/// How `tool` with `input`, `output` and `metadata` uses its files. OpenHands'
/// `str_replace_editor` reads with `command: view` and changes with every other command.
pub fn file_use(tool: &str, input: &Value, output: &str, metadata: Option<&Value>) -> FileUse {
    let kind = kind(tool, input);
    if kind != FileUse::WholeRead {
        return kind;
    }
    let ranged = input.as_object().is_some_and(|map| {
        map.iter()
            .any(|(k, v)| !v.is_null() && RANGE_FIELDS.iter().any(|f| same_key(k, f)))
    });
    let truncated = metadata
        .and_then(|m| input_field(m, "truncated"))
        .and_then(Value::as_bool)
        == Some(true);
    let tail = tail(output);
    if ranged || truncated || CUT_SHORT.iter().any(|note| tail.contains(note)) {
        FileUse::Other
    } else {
        FileUse::WholeRead
    }
}

/// True when `key` is `wanted` (lowercase, no `_`) in any case, with any `_`.
fn same_key(key: &str, wanted: &str) -> bool {
    let mut kept = key.bytes().filter(|&b| b != b'_');
    wanted
        .bytes()
        .all(|w| kept.next().is_some_and(|k| k.to_ascii_lowercase() == w))
        && kept.next().is_none()
}

/// The last [`CUT_SHORT_TAIL`] bytes of `text` or a few more (from a character boundary).
fn tail(text: &str) -> &str {
    let mut from = text.len().saturating_sub(CUT_SHORT_TAIL);
    while !text.is_char_boundary(from) {
        from -= 1;
    }
    text.get(from..).unwrap_or_default()
}

/// A change not yet read after, by position.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Change {
    at: PartRef,
    order: (usize, usize),
}

/// The newest whole read of a path.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Read {
    order: (usize, usize),
    call: Arc<str>,
}

/// The strategy's state: changes waiting for a read, the newest read of each path.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Writes {
    /// Per path hash: changes not yet followed by a whole read.
    #[serde(with = "crate::engine::sorted::hashes")]
    waiting: FastMap<u128, Vec<Change>>,
    /// Per path hash: the newest whole read.
    #[serde(with = "crate::engine::sorted::hashes")]
    read: FastMap<u128, Read>,
    /// Changes naming several paths: the hashes of those not yet read after.
    #[serde(with = "crate::engine::sorted::map")]
    left: FastMap<PartRef, Vec<u128>>,
}

impl Writes {
    /// True when nothing is held (a snapshot then leaves the state out, as snapshots
    /// written before this strategy did).
    pub(crate) fn is_empty(&self) -> bool {
        self.waiting.is_empty() && self.read.is_empty() && self.left.is_empty()
    }

    /// True when every position held is below message `len`.
    pub(crate) fn fits(&self, len: usize) -> bool {
        self.waiting
            .values()
            .flatten()
            .all(|c| c.at.msg < len && c.order.0 < len)
            && self.read.values().all(|r| r.order.0 < len)
            && self.left.keys().all(|at| at.msg < len)
    }

    /// A completed change at `at` (position `order`) of `paths`; calls `stale` with it and
    /// the newest read when every path has been read whole in a later message already.
    pub fn on_change(
        &mut self,
        at: PartRef,
        order: (usize, usize),
        paths: &[String],
        mut stale: impl FnMut(PartRef, String),
    ) {
        let mut left = Vec::new();
        let mut by: Option<&Read> = None;
        for p in paths {
            let hash = text_hash(p);
            match self.read.get(&hash).filter(|r| r.order.0 > order.0) {
                Some(r) => by = Some(by.map_or(r, |b| if r.order > b.order { r } else { b })),
                None => left.push(hash),
            }
        }
        left.sort_unstable();
        left.dedup();
        if left.is_empty() {
            if let Some(r) = by {
                stale(at, String::from(&*r.call));
            }
            return;
        }
        for hash in &left {
            // In position order, so a change sent again is found, not added twice.
            let list = self
                .waiting
                .entry(*hash)
                .or_insert_with(|| Vec::with_capacity(1));
            if let Err(i) = list.binary_search_by(|c| (c.order, &c.at).cmp(&(order, &at))) {
                list.insert(
                    i,
                    Change {
                        at: at.clone(),
                        order,
                    },
                );
            }
        }
        if paths.len() > 1 {
            // A change sent again keeps what reads already covered.
            self.left.entry(at).or_insert(left);
        }
    }

    /// A completed whole read of `path` at position `order` by `call`; calls `stale` with
    /// each change of an earlier message that has now been read whole on every path it
    /// named.
    pub fn on_read(
        &mut self,
        path: &str,
        order: (usize, usize),
        call: &Arc<str>,
        mut stale: impl FnMut(PartRef, String),
    ) {
        let hash = text_hash(path);
        if self.read.get(&hash).is_none_or(|r| r.order <= order) {
            self.read.insert(
                hash,
                Read {
                    order,
                    call: call.clone(),
                },
            );
        }
        let Some(list) = self.waiting.get_mut(&hash) else {
            return;
        };
        let older: Vec<Change> = match list.partition_point(|c| c.order.0 < order.0) {
            0 => return,
            n if n == list.len() => self.waiting.remove(&hash).unwrap_or_default(),
            n => list.drain(..n).collect(),
        };
        for c in older {
            if let Some(left) = self.left.get_mut(&c.at) {
                left.retain(|h| *h != hash);
                if !left.is_empty() {
                    continue;
                }
                self.left.remove(&c.at);
            }
            stale(c.at, String::from(&**call));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// `file_use` of a call without metadata.
    fn used(tool: &str, input: Value, output: &str) -> FileUse {
        file_use(tool, &input, output, None)
    }

    #[test]
    fn reads_with_a_range_are_not_whole() {
        let end = "1| x\n(End of file - total 1 lines)";
        assert_eq!(
            used("read", json!({"filePath": "a"}), end),
            FileUse::WholeRead
        );
        assert_eq!(
            used("Read", json!({"file_path": "a", "offset": null}), ""),
            FileUse::WholeRead
        );
        assert_eq!(
            used("read", json!({"filePath": "a", "offset": 40}), ""),
            FileUse::Other
        );
        // Range keys in any case, with or without `_` (OpenHands' exports camel-case them).
        for key in [
            "view_range",
            "viewRange",
            "VIEW_RANGE",
            "startLine",
            "line_range",
        ] {
            let input = json!({"command": "view", "path": "a", key: [1, 9]});
            assert_eq!(
                used("str_replace_editor", input, ""),
                FileUse::Other,
                "{key}"
            );
        }
        for key in ["view", "range", "offsets", "view_range_x"] {
            let input = json!({"command": "view", "path": "a", key: [1, 9]});
            assert_eq!(
                used("str_replace_editor", input, ""),
                FileUse::WholeRead,
                "{key}"
            );
        }
        assert_eq!(
            used(
                "str_replace_editor",
                json!({"command": "create", "path": "a"}),
                ""
            ),
            FileUse::Change
        );
        assert_eq!(used("apply_patch", json!({}), ""), FileUse::Change);
        assert_eq!(
            used("bash", json!({"command": "cat a"}), ""),
            FileUse::Other
        );
    }

    /// A read cut short says so in its metadata (OpenCode) or its last lines.
    #[test]
    fn reads_cut_short_are_not_whole() {
        let cut = json!({"truncated": true, "preview": "x"});
        assert_eq!(
            file_use("read", &json!({"filePath": "a"}), "1| x", Some(&cut)),
            FileUse::Other
        );
        let whole = json!({"truncated": false});
        assert_eq!(
            file_use("read", &json!({"filePath": "a"}), "1| x", Some(&whole)),
            FileUse::WholeRead
        );
        for note in [
            "(File has more lines. Use 'offset' parameter to read beyond line 2000)\n</file>",
            "(Showing lines 1-2000 of 3000. Use offset=2001 to continue.)\n</content>",
            "<response clipped><NOTE>only part of this file has been shown</NOTE>",
        ] {
            let output = format!("1| x\n\n{note}");
            assert_eq!(
                used("read", json!({"filePath": "a"}), &output),
                FileUse::Other
            );
            // The tail starts on a character boundary, whatever the output's characters.
            for pad in 0..4 {
                let long = format!("{}{}{output}", "x".repeat(pad), "é".repeat(600));
                assert_eq!(
                    used("read", json!({"filePath": "a"}), &long),
                    FileUse::Other
                );
                let whole = format!("{}{}", "x".repeat(pad), "é".repeat(600));
                assert_eq!(
                    used("read", json!({"filePath": "a"}), &whole),
                    FileUse::WholeRead
                );
            }
        }
    }

    /// A change is counted an entry per file it names, while the strategy may hold one.
    #[test]
    fn changes_count_an_entry_per_file() {
        let patch = |n: usize| {
            let files: String = (0..n).map(|i| format!("*** Delete File: f{i}\n")).collect();
            json!({ "patchText": format!("*** Begin Patch\n{files}*** End Patch") })
        };
        assert_eq!(
            change_bytes("write", &json!({"filePath": "a"})),
            CHANGE_PATH_BYTES
        );
        assert_eq!(
            change_bytes("apply_patch", &patch(3)),
            3 * CHANGE_PATH_BYTES
        );
        assert_eq!(
            change_bytes("apply_patch", &patch(MAX_CHANGE_PATHS)),
            MAX_CHANGE_PATHS * CHANGE_PATH_BYTES
        );
        assert_eq!(change_bytes("apply_patch", &patch(MAX_CHANGE_PATHS + 1)), 0);
        assert_eq!(change_bytes("read", &json!({"filePath": "a"})), 0);
        assert_eq!(change_bytes("bash", &json!({"command": "rm a"})), 0);
    }

    fn at(msg: usize) -> PartRef {
        PartRef {
            msg,
            part: Arc::from(format!("p{msg}").as_str()),
        }
    }

    /// A patch of two files is stale only once both were read after it, whichever order
    /// the reads and the patch arrive in.
    #[test]
    fn a_change_of_several_files_waits_for_every_read() {
        let paths = ["a".to_string(), "b".to_string()];
        let (r1, r2): (Arc<str>, Arc<str>) = (Arc::from("r1"), Arc::from("r2"));
        let mut w = Writes::default();
        let mut stale = Vec::new();
        w.on_change(at(1), (1, 0), &paths, |a, by| stale.push((a, by)));
        w.on_read("a", (2, 0), &r1, |a, by| stale.push((a, by)));
        assert!(stale.is_empty(), "b is not read yet");
        w.on_read("b", (3, 0), &r2, |a, by| stale.push((a, by)));
        assert_eq!(stale, [(at(1), "r2".to_string())]);
        assert!(w.waiting.is_empty() && w.left.is_empty());

        // The same calls, the change arriving last.
        let mut w = Writes::default();
        let mut stale = Vec::new();
        w.on_read("a", (2, 0), &r1, |a, by| stale.push((a, by)));
        w.on_read("b", (3, 0), &r2, |a, by| stale.push((a, by)));
        w.on_change(at(1), (1, 0), &paths, |a, by| stale.push((a, by)));
        assert_eq!(stale, [(at(1), "r2".to_string())]);

        // A read before the change covers nothing, nor one beside it in its message (the
        // host may have run the two at once), in either arrival order.
        let mut w = Writes::default();
        let mut stale = Vec::new();
        w.on_read("a", (0, 0), &r1, |a, by| stale.push((a, by)));
        w.on_change(at(1), (1, 0), &paths[..1], |a, by| stale.push((a, by)));
        w.on_read("a", (1, 1), &r2, |a, by| stale.push((a, by)));
        w.on_change(at(1), (1, 2), &paths[..1], |a, by| stale.push((a, by)));
        assert!(stale.is_empty());
        assert_eq!(w.waiting.values().map(Vec::len).sum::<usize>(), 2);
        // A change sent again is held once.
        w.on_change(at(1), (1, 0), &paths[..1], |a, by| stale.push((a, by)));
        assert_eq!(w.waiting.values().map(Vec::len).sum::<usize>(), 2);
        w.on_read("a", (2, 0), &r1, |a, by| stale.push((a, by)));
        assert_eq!(stale.len(), 2);
        assert!(w.waiting.is_empty());
    }
}
