//! Strategy 5, `pruneSnapshots`: snapshot tools (browser accessibility snapshots,
//! screenshots) describe the whole current state, so the newest makes every earlier one
//! of its kind stale (a screenshot does not replace the element refs of a snapshot). Which tools are snapshot tools is configurable; names match exactly or after an
//! MCP server prefix (`playwright_browser_snapshot`).

/// The supersede key of a snapshot tool (`None`: not a snapshot tool): one for the
/// screenshots, one for the other snapshots. A screenshot shows the page, but the agent
/// acts on an accessibility snapshot's element refs (`browser_click` takes `ref=e12`):
/// a screenshot taken after a snapshot must not clear the snapshot. (The key of the other
/// snapshots reads as it always has: keys are kept in snapshots.)
pub fn snapshot_key(tool: &str, snapshot_tools: &[String]) -> Option<String> {
    if !snapshot_tools.iter().any(|t| names_tool(tool, t)) {
        return None;
    }
    let screenshot = tool
        .as_bytes()
        .windows(SCREENSHOT.len())
        .any(|w| w.eq_ignore_ascii_case(SCREENSHOT));
    Some(
        if screenshot {
            "snapshot:screenshot"
        } else {
            "snapshot"
        }
        .to_string(),
    )
}

/// What a screenshot tool's name holds, in any ASCII case.
const SCREENSHOT: &[u8] = b"screenshot";

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

    #[test]
    fn a_screenshot_and_an_accessibility_snapshot_are_two_kinds() {
        let tools: Vec<String> = crate::config::DEFAULT_SNAPSHOT_TOOLS
            .iter()
            .map(|s| s.to_string())
            .collect();
        let tree = snapshot_key("playwright_browser_snapshot", &tools);
        assert_eq!(tree.as_deref(), Some("snapshot"));
        assert_eq!(snapshot_key("take_snapshot", &tools), tree);
        let shot = snapshot_key("playwright_browser_take_screenshot", &tools);
        assert_eq!(shot.as_deref(), Some("snapshot:screenshot"));
        assert_eq!(snapshot_key("Screenshot", &tools), shot);
    }
}
