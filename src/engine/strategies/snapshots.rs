//! Strategy 5, `pruneSnapshots`: snapshot tools (browser accessibility snapshots,
//! screenshots) describe the whole current state, so the newest makes every earlier one
//! stale. Which tools are snapshot tools is configurable; names match exactly or after an
//! MCP server prefix (`playwright_browser_snapshot`).

/// The supersede key shared by every snapshot tool (`None`: not a snapshot tool).
pub fn snapshot_key(tool: &str, snapshot_tools: &[String]) -> Option<String> {
    snapshot_tools
        .iter()
        .any(|t| names_tool(tool, t))
        .then(|| "snapshot".to_string())
}

/// `tool` is `name`, alone or after a server prefix (`playwright_browser_snapshot`), in
/// any ASCII case; compared in place, with no lowercased copies.
fn names_tool(tool: &str, name: &str) -> bool {
    let (tool, name) = (tool.as_bytes(), name.as_bytes());
    if tool.eq_ignore_ascii_case(name) {
        return true;
    }
    let Some(start) = tool.len().checked_sub(name.len()) else {
        return false;
    };
    start > 0
        && tool[start - 1] == b'_'
        && tool
            .get(start..)
            .is_some_and(|end| end.eq_ignore_ascii_case(name))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshot_tools_match_with_or_without_a_server_prefix() {
        let tools: Vec<String> = crate::config::DEFAULT_SNAPSHOT_TOOLS
            .iter()
            .map(|s| s.to_string())
            .collect();
        assert!(snapshot_key("browser_snapshot", &tools).is_some());
        assert!(snapshot_key("playwright_browser_snapshot", &tools).is_some());
        assert!(snapshot_key("Screenshot", &tools).is_some());
        assert!(snapshot_key("read", &tools).is_none());
        assert!(snapshot_key("snapshotter", &tools).is_none());
    }
}
