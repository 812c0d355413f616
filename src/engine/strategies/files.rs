//! Strategy 10, `aggressiveFilePrune` (one file, one view): the paths a file operation
//! touches. Any read, write, edit or patch of a path supersedes every earlier operation on
//! the same path; a call touching several paths is superseded once all of them are.

use serde_json::Value;

use super::{str_field, tool_is};

/// Tools that read or change one file named in their input.
const SINGLE_FILE_TOOLS: &[&str] = &[
    "read",
    "write",
    "edit",
    "multiedit",
    "view",
    "str_replace_editor",
    "notebookedit",
    "notebookread",
];

/// Tools whose input is a patch naming the files it changes.
const PATCH_TOOLS: &[&str] = &["apply_patch", "patch"];

/// Normalized paths a call operates on (empty: not a file operation).
pub fn file_paths(tool: &str, input: &Value) -> Vec<String> {
    if tool_is(tool, SINGLE_FILE_TOOLS) {
        let path = ["filePath", "file_path", "path", "notebook_path"]
            .iter()
            .find_map(|k| str_field(input, k));
        return path
            .map(normalize)
            .filter(|p| !p.is_empty())
            .into_iter()
            .collect();
    }
    if tool_is(tool, PATCH_TOOLS) {
        let text = ["patchText", "patch", "input", "diff"]
            .iter()
            .find_map(|k| str_field(input, k))
            .unwrap_or_default();
        let mut paths: Vec<String> = patch_paths(text).map(normalize).collect();
        paths.sort();
        paths.dedup();
        paths.retain(|p| !p.is_empty());
        return paths;
    }
    Vec::new()
}

/// Paths named by an OpenCode/Codex patch (`*** Update File: p`) or a unified diff
/// (`+++ b/p`).
fn patch_paths(text: &str) -> impl Iterator<Item = &str> {
    text.lines().filter_map(|line| {
        for prefix in [
            "*** Update File:",
            "*** Add File:",
            "*** Delete File:",
            "*** Move to:",
        ] {
            if let Some(p) = line.strip_prefix(prefix) {
                return Some(p.trim());
            }
        }
        let p = line.strip_prefix("+++ ")?.trim();
        (p != "/dev/null").then(|| p.strip_prefix("b/").unwrap_or(p))
    })
}

/// Lexical normalization: `./a//b/../c` → `a/c`; a leading `/` is kept.
pub fn normalize(path: &str) -> String {
    let path = path.trim();
    // Most paths are normal already (no empty, `.` or `..` segment past a leading `/`):
    // they are their own normal form, with no vector of segments to join.
    // Split as bytes: `/` is one byte, and a byte loop is cheaper than `str::split`'s
    // searcher on paths this short.
    let normal = path
        .as_bytes()
        .split(|&b| b == b'/')
        .enumerate()
        .all(|(i, seg)| !matches!(seg, b"." | b"..") && (i == 0 || !seg.is_empty()));
    if normal {
        return path.to_string();
    }
    walk(path)
}

/// The segment walk: drops empty and `.` segments, resolves `..` against the segment
/// before it (a leading `..` of a relative path stays).
fn walk(path: &str) -> String {
    let absolute = path.starts_with('/');
    let mut out: Vec<&str> = Vec::new();
    for seg in path.split('/') {
        match seg {
            "" | "." => {}
            ".." if out.last().is_some_and(|s| *s != "..") => {
                out.pop();
            }
            ".." if absolute => {}
            s => out.push(s),
        }
    }
    let joined = out.join("/");
    if absolute {
        format!("/{joined}")
    } else {
        joined
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn single_file_tools_name_their_path() {
        assert_eq!(
            file_paths("read", &json!({"filePath": "./src//a/../b.rs"})),
            ["src/b.rs"]
        );
        assert_eq!(
            file_paths("Edit", &json!({"file_path": "/x/y.rs"})),
            ["/x/y.rs"]
        );
        assert!(file_paths("bash", &json!({"command": "cat a"})).is_empty());
        assert!(file_paths("read", &json!({})).is_empty());
    }

    #[test]
    fn patches_name_every_file() {
        let patch = "*** Begin Patch\n*** Update File: src/a.rs\n@@\n-x\n+y\n*** Add File: src/b.rs\n+z\n*** End Patch";
        assert_eq!(
            file_paths("apply_patch", &json!({"patchText": patch})),
            ["src/a.rs", "src/b.rs"]
        );
        let diff = "--- a/x.txt\n+++ b/x.txt\n@@ -1 +1 @@\n-a\n+b\n";
        assert_eq!(file_paths("patch", &json!({"patch": diff})), ["x.txt"]);
    }

    proptest::proptest! {
        /// Every path normalizes the way the segment walk does it (a normal one comes
        /// back as it is, without the walk).
        #[test]
        fn normal_paths_are_their_own_normal_form(path in "[a./ ]{0,12}") {
            proptest::prop_assert_eq!(normalize(&path), walk(path.trim()));
        }
    }

    #[test]
    fn normalization_is_lexical() {
        assert_eq!(normalize("/a/./b/../../c"), "/c");
        assert_eq!(normalize("../a"), "../a");
        assert_eq!(normalize("/../a"), "/a");
    }
}
