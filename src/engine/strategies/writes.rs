//! `supersedeWrites` (compactd; seed 03's "write→read supersede", which ACP keeps when
//! `aggressiveFilePrune` is off): a write, edit or patch is stale once every file it
//! changed has been read whole after it, since the read shows what the change left. Only
//! the change is superseded (its input then keeps only metadata, under `pruneToolInputs`);
//! the read the agent works from stays, so unlike `aggressiveFilePrune` an edit never
//! hides the file it was made against. A read with a range (`offset`, `limit`,
//! `view_range`), or one OpenCode cut at its line limit, shows part of the file and
//! supersedes nothing.
//!
//! The state is, per path (its hash), the newest whole read and the changes not yet read
//! after; so each call costs O(paths it names) plus the changes a read releases. "After"
//! is by position, as every supersede: a change arriving after a newer read is superseded
//! at once.

use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_json::Value;

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

/// Input fields that make a read show part of a file.
const RANGE_FIELDS: &[&str] = &[
    "offset",
    "limit",
    "view_range",
    "line_range",
    "start_line",
    "end_line",
];

/// How OpenCode's `read` ends an output it cut at its line limit.
const CUT_SHORT: &str = "Use 'offset' parameter to read beyond line";

/// Bytes at the end of a read's output searched for [`CUT_SHORT`].
const CUT_SHORT_TAIL: usize = 256;

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

/// How `tool` with `input` and `output` uses its files. OpenHands' `str_replace_editor`
/// reads with `command: view` and changes with every other command.
pub fn file_use(tool: &str, input: &Value, output: &str) -> FileUse {
    let editor = tool.eq_ignore_ascii_case("str_replace_editor");
    let reads = if editor {
        str_field(input, "command") == Some("view")
    } else if tool_is(tool, READ_TOOLS) {
        true
    } else if tool_is(tool, CHANGE_TOOLS) {
        return FileUse::Change;
    } else {
        return FileUse::Other;
    };
    if !reads {
        return FileUse::Change;
    }
    let ranged = RANGE_FIELDS
        .iter()
        .any(|f| input_field(input, f).is_some_and(|v| !v.is_null()));
    if ranged || tail(output).contains(CUT_SHORT) {
        FileUse::Other
    } else {
        FileUse::WholeRead
    }
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
    /// the newest read when every path has been read whole after it already.
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
            match self.read.get(&hash).filter(|r| r.order > order) {
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
            let list = self.waiting.entry(*hash).or_default();
            if !list.iter().any(|c| c.at == at) {
                list.push(Change {
                    at: at.clone(),
                    order,
                });
            }
        }
        if paths.len() > 1 {
            // A change sent again keeps what reads already covered.
            self.left.entry(at).or_insert(left);
        }
    }

    /// A completed whole read of `path` at position `order` by `call`; calls `stale` with
    /// each change before it that has now been read whole on every path it named.
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
        let (older, newer): (Vec<Change>, Vec<Change>) =
            list.drain(..).partition(|c| c.order < order);
        if newer.is_empty() {
            self.waiting.remove(&hash);
        } else {
            self.waiting.insert(hash, newer);
        }
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

    #[test]
    fn reads_with_a_range_are_not_whole() {
        assert_eq!(
            file_use(
                "read",
                &json!({"filePath": "a"}),
                "1| x\n(End of file - total 1 lines)"
            ),
            FileUse::WholeRead
        );
        assert_eq!(
            file_use("Read", &json!({"file_path": "a", "offset": null}), ""),
            FileUse::WholeRead
        );
        assert_eq!(
            file_use("read", &json!({"filePath": "a", "offset": 40}), ""),
            FileUse::Other
        );
        assert_eq!(
            file_use(
                "str_replace_editor",
                &json!({"command": "view", "path": "a", "view_range": [1, 9]}),
                ""
            ),
            FileUse::Other
        );
        assert_eq!(
            file_use(
                "str_replace_editor",
                &json!({"command": "view", "path": "a"}),
                ""
            ),
            FileUse::WholeRead
        );
        assert_eq!(
            file_use(
                "str_replace_editor",
                &json!({"command": "create", "path": "a"}),
                ""
            ),
            FileUse::Change
        );
        let cut = "1| x\n\n(File has more lines. Use 'offset' parameter to read beyond line 2000)";
        assert_eq!(
            file_use("read", &json!({"filePath": "a"}), cut),
            FileUse::Other
        );
        // The tail starts on a character boundary, whatever the output's characters.
        for pad in 0..4 {
            let long = format!("{}{}{cut}", "x".repeat(pad), "é".repeat(300));
            assert_eq!(
                file_use("read", &json!({"filePath": "a"}), &long),
                FileUse::Other
            );
            let whole = format!("{}{}", "x".repeat(pad), "é".repeat(300));
            assert_eq!(
                file_use("read", &json!({"filePath": "a"}), &whole),
                FileUse::WholeRead
            );
        }
        assert_eq!(file_use("apply_patch", &json!({}), ""), FileUse::Change);
        assert_eq!(
            file_use("bash", &json!({"command": "cat a"}), ""),
            FileUse::Other
        );
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

        // A read before the change covers nothing.
        let mut w = Writes::default();
        let mut stale = Vec::new();
        w.on_read("a", (0, 0), &r1, |a, by| stale.push((a, by)));
        w.on_change(at(1), (1, 0), &paths[..1], |a, by| stale.push((a, by)));
        assert!(stale.is_empty());
        assert_eq!(w.waiting.len(), 1);
    }
}
