//! Strategy 9, `truncateOldErrors`: errored tool outputs older than 3 user turns keep
//! their first line plus `[Error output truncated - N chars total]`.

/// The truncated error, or `None` when that would not shorten it.
pub fn truncate_error(error: &str) -> Option<String> {
    let mut lines = error.lines();
    let first = lines.next().unwrap_or_default();
    if lines
        .next()
        .is_some_and(|l| l.starts_with("[Error output truncated - "))
    {
        return None; // already truncated
    }
    let total = error.chars().count();
    let out = format!("{first}\n[Error output truncated - {total} chars total]");
    (out.len() < error.len()).then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stack_trace_keeps_its_first_line() {
        let error = format!(
            "Error: Something failed\nStack trace:\n{}",
            "  at /path/file.ts:123\n".repeat(20)
        );
        let total = error.chars().count();
        assert_eq!(
            truncate_error(&error),
            Some(format!(
                "Error: Something failed\n[Error output truncated - {total} chars total]"
            ))
        );
    }

    #[test]
    fn short_errors_are_left_alone_and_truncation_is_idempotent() {
        assert_eq!(truncate_error("Error: file not found"), None);
        let long = format!("boom\n{}", "x".repeat(500));
        let once = truncate_error(&long).expect("truncated");
        assert_eq!(truncate_error(&once), None);
    }
}
