//! Strategy 8, `pruneUserCodeBlocks`: fenced code blocks in user messages older than 5
//! user turns become `[Code block: lang, N lines - truncated to save context]`
//! (seed 03's ```` ```(\w+)?\n([\s\S]*?)``` ```` pattern).

/// The text with its code blocks truncated, or `None` when that would not shorten it.
pub fn truncate_code_blocks(text: &str) -> Option<String> {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    let mut changed = false;
    while let Some(open) = rest.find("```") {
        let after_fence = &rest[open + 3..];
        let lang_len = after_fence
            .find(|c: char| !(c.is_alphanumeric() || c == '_'))
            .unwrap_or(after_fence.len());
        let (lang, tail) = after_fence.split_at(lang_len);
        let Some(body_and_rest) = tail.strip_prefix('\n') else {
            // Not a fence opening (```inline``` or a language with other characters).
            out.push_str(&rest[..open + 3]);
            rest = after_fence;
            continue;
        };
        let Some(close) = body_and_rest.find("```") else {
            break;
        };
        let body = &body_and_rest[..close];
        let lines = body.lines().count();
        out.push_str(&rest[..open]);
        out.push_str(&format!(
            "[Code block: {}, {lines} lines - truncated to save context]",
            if lang.is_empty() { "text" } else { lang }
        ));
        changed = true;
        rest = &body_and_rest[close + 3..];
    }
    out.push_str(rest);
    (changed && out.len() < text.len()).then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fenced_blocks_become_one_line_notes() {
        let text = format!(
            "Why does this fail?\n```typescript\n{}```\nand this:\n```\nplain\nlines\n```\nthanks",
            "const x = 1;\n".repeat(15)
        );
        assert_eq!(
            truncate_code_blocks(&text).as_deref(),
            Some(
                "Why does this fail?\n[Code block: typescript, 15 lines - truncated to save context]\nand this:\n[Code block: text, 2 lines - truncated to save context]\nthanks"
            )
        );
    }

    #[test]
    fn text_without_a_complete_block_or_not_shortened_is_left_alone() {
        assert_eq!(truncate_code_blocks("no code here"), None);
        assert_eq!(truncate_code_blocks("```rust\nunterminated"), None);
        assert_eq!(truncate_code_blocks("use ```x``` inline"), None);
        assert_eq!(
            truncate_code_blocks("```\na\n```"),
            None,
            "longer than the block"
        );
    }

    #[test]
    fn truncating_twice_changes_nothing() {
        let text = format!("```py\n{}```", "print(1)\n".repeat(20));
        let once = truncate_code_blocks(&text).expect("truncated");
        assert_eq!(truncate_code_blocks(&once), None);
    }
}
