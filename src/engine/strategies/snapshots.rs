//! Strategy 5, `pruneSnapshots`: snapshot tools (browser accessibility snapshots,
//! screenshots) describe the whole current state, so the newest makes every earlier one
//! stale. Which tools are snapshot tools is configurable; names match exactly or after an
//! MCP server prefix (`playwright_browser_snapshot`).

/// The supersede key shared by every snapshot tool (`None`: not a snapshot tool).
pub fn snapshot_key(tool: &str, snapshot_tools: &[String]) -> Option<String> {
    let tool = tool.to_ascii_lowercase();
    snapshot_tools
        .iter()
        .map(|t| t.to_ascii_lowercase())
        .any(|t| tool == t || tool.ends_with(&format!("_{t}")))
        .then(|| "snapshot".to_string())
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
