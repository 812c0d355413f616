//! Strategy 4, `stateQuerySupersede`: commands that only report the current state
//! (`ls`, `find`, `pwd`, `git status|branch|log`, `tree`: seed 03's patterns, matched on
//! the trimmed bash command) keep only their newest run of the same command in the same
//! directory. OpenCode's `list` tool is the same query by another name.

use serde_json::Value;

use super::{input_field, str_field, tool_is};

/// The supersede key of a state query (`None`: not one).
pub fn query_key(tool: &str, input: &Value) -> Option<String> {
    if tool_is(tool, &["list", "ls"]) {
        let path = str_field(input, "path").unwrap_or(".");
        return Some(["state:ls ", path.trim()].concat());
    }
    if !tool_is(
        tool,
        &["bash", "shell", "execute_bash", "run_shell_command"],
    ) {
        return None;
    }
    let command = input_field(input, "command")
        .or_else(|| input_field(input, "cmd"))
        .and_then(Value::as_str)?;
    // Decided by the first two words; only a state query's key is built (this runs for
    // every shell call, most of them not queries, some of them long scripts).
    let mut words = command.split_whitespace();
    if !is_state_query(words.next(), words.next()) {
        return None;
    }
    // Run in another directory it reports another state (OpenCode's bash takes a
    // `workdir`, Codex's shell too, Gemini CLI's a `directory`): the directory is part of
    // the key, before the command. Without one the key reads as it always has.
    let dir = ["workdir", "cwd", "directory"]
        .iter()
        .find_map(|field| str_field(input, field))
        .map(str::trim)
        .filter(|d| !d.is_empty());
    // One command, whitespace collapsed ("git  status" and "git status" are one query).
    let dir_len = dir.map_or(0, |d| d.len().saturating_add(1));
    let mut key = String::with_capacity(
        "state:"
            .len()
            .saturating_add(dir_len)
            .saturating_add(command.len()),
    );
    key.push_str("state:");
    if let Some(dir) = dir {
        key.push_str(dir);
        key.push('\0');
    }
    for (i, word) in command.split_whitespace().enumerate() {
        if i > 0 {
            key.push(' ');
        }
        key.push_str(word);
    }
    Some(key)
}

/// Seed 03's patterns: `^ls\s`, `^ls$`, `^find\s`, `^pwd$`, `^git\s+status`,
/// `^git\s+branch`, `^git\s+log`, `^tree\s`, `^tree$`, on a command's first two words.
fn is_state_query(first: Option<&str>, second: Option<&str>) -> bool {
    match (first, second) {
        (Some("ls" | "tree"), _) => true,
        (Some("find"), Some(_)) => true,
        (Some("pwd"), None) => true,
        (Some("git"), Some(sub)) => {
            sub.starts_with("status") || sub.starts_with("branch") || sub.starts_with("log")
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn key(cmd: &str) -> Option<String> {
        query_key("bash", &json!({"command": cmd}))
    }

    #[test]
    fn the_seed_patterns_match() {
        for cmd in [
            "ls",
            "ls -la src",
            "find . -name '*.rs'",
            "pwd",
            "git status",
            "git  status -s",
            "git branch -a",
            "git log --oneline -5",
            "tree",
            "tree src",
        ] {
            assert!(key(cmd).is_some(), "{cmd}");
        }
        assert_eq!(key("  git   status  "), key("git status"));
    }

    /// Keys are kept in snapshots (the tracker's newest holder of each): their text must
    /// not change.
    #[test]
    fn keys_read_as_they_always_have() {
        assert_eq!(
            key("  git   status  -s "),
            Some("state:git status -s".into())
        );
        assert_eq!(key("pwd"), Some("state:pwd".into()));
        assert_eq!(key("pwd -P"), None);
        assert_eq!(key("find"), None);
        assert_eq!(key("find\t."), Some("state:find .".into()));
        assert_eq!(
            query_key("list", &json!({"path": " src "})),
            Some("state:ls src".into())
        );
    }

    #[test]
    fn the_same_query_in_another_directory_is_another_query() {
        let core = query_key("bash", &json!({"command": "ls", "workdir": "/repo/core"}));
        let web = query_key("bash", &json!({"command": "ls", "workdir": "/repo/web"}));
        assert_eq!(core, Some("state:/repo/core\0ls".into()));
        assert_ne!(core, web);
        assert_ne!(core, key("ls"), "no directory: the host's own");
        assert_eq!(
            query_key("bash", &json!({"command": "ls", "workdir": " "})),
            key("ls"),
            "a blank directory is none"
        );
        assert_eq!(
            query_key(
                "run_shell_command",
                &json!({"command": "git status", "directory": "a"})
            ),
            Some("state:a\0git status".into())
        );
    }

    #[test]
    fn other_commands_do_not() {
        for cmd in [
            "cargo test",
            "lsof -i",
            "find",
            "pwd && ls",
            "git diff",
            "echo ls",
            "treesize",
        ] {
            assert_eq!(key(cmd), None, "{cmd}");
        }
        assert_eq!(query_key("read", &json!({"command": "ls"})), None);
    }

    #[test]
    fn the_list_tool_is_a_state_query_of_its_path() {
        assert_eq!(
            query_key("list", &json!({"path": "src"})),
            Some("state:ls src".into())
        );
    }
}
