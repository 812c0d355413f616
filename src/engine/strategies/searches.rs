//! Base layer, `supersedeSearches`: a `glob` keyed by path + pattern, a `grep` by path +
//! pattern + include, and by any other field the call names (Claude Code's `Grep` takes
//! `glob`, `type`, `-i`, `output_mode`...); the newest search of the same key supersedes
//! the earlier ones.

use serde_json::Value;

use super::files::normalize;
use super::{other_fields, str_field, tool_is};

/// The supersede key of a search call (`None`: not one).
pub fn search_key(tool: &str, input: &Value) -> Option<String> {
    let glob = tool_is(tool, &["glob"]);
    if !glob && !tool_is(tool, &["grep"]) {
        return None; // most calls: nothing looked up, nothing normalized
    }
    let field = |k: &str| str_field(input, k).unwrap_or_default();
    let path = normalize(field("path"));
    // Joined in one allocation: `format!` cost more than the rest of the call's keys.
    if glob {
        let rest = other_fields(input, &["path", "pattern"]);
        return Some(["glob:", &path, "\u{0}", field("pattern"), &rest].concat());
    }
    let include = field("include");
    let rest = other_fields(input, &["path", "pattern", "include"]);
    Some(
        [
            "grep:",
            &path,
            "\u{0}",
            field("pattern"),
            "\u{0}",
            include,
            &rest,
        ]
        .concat(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn globs_and_greps_key_by_their_query() {
        let a = search_key(
            "grep",
            &json!({"path": "./src", "pattern": "fn main", "include": "*.rs"}),
        );
        let b = search_key(
            "grep",
            &json!({"path": "src", "pattern": "fn main", "include": "*.rs"}),
        );
        let c = search_key("grep", &json!({"path": "src", "pattern": "fn main"}));
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert_ne!(
            search_key("glob", &json!({"pattern": "*.rs"})),
            search_key("glob", &json!({"pattern": "*.ts"}))
        );
        assert_eq!(search_key("read", &json!({})), None);
        // Claude Code's Grep: other fields change what it finds.
        let rs = search_key(
            "Grep",
            &json!({"pattern": "TODO", "path": "src", "glob": "*.rs", "output_mode": "content"}),
        );
        let py = search_key(
            "Grep",
            &json!({"pattern": "TODO", "path": "src", "glob": "*.py", "output_mode": "content"}),
        );
        assert_ne!(rs, py);
        assert_eq!(
            rs.as_deref(),
            Some("grep:src\u{0}TODO\u{0}\u{0}glob=\"*.rs\"\u{0}output_mode=\"content\"")
        );
        // Keys are kept in snapshots: their text must not change.
        assert_eq!(a.as_deref(), Some("grep:src\u{0}fn main\u{0}*.rs"));
        assert_eq!(
            search_key("glob", &json!({"pattern": "*.rs", "path": "a/./b"})).as_deref(),
            Some("glob:a/b\u{0}*.rs")
        );
    }
}
