//! `capLargeOutputs` (compactd): a single tool output larger than `output_cap` of usable
//! input reads as its head and tail with a marker naming what was left out and the call
//! id, so one 900K-character build log cannot fill a window by itself. The decision
//! records how many characters it keeps (`StrategyMark::keep`), so the rendering does not
//! depend on limits that may change later.

use super::masking::size;

/// Characters of an output a session keeps: `share` of usable input, at about four
/// characters per token (at least one: a share too small to keep a character keeps
/// only the marker, not no cap); 0 (no cap) when the window is unknown.
pub fn cap_chars(share: f64, usable_input_tokens: u64) -> u64 {
    if usable_input_tokens == 0 || share.is_nan() || share <= 0.0 {
        return 0;
    }
    (((usable_input_tokens as f64) * share.min(1.0) * 4.0) as u64).max(1)
}

/// The output as head + marker + tail keeping about `keep` characters, or `None` when it
/// already fits, or when the marker would make it no shorter (a cap of a few characters).
pub fn capped_text(output: &str, keep: u64, call_id: &str) -> Option<String> {
    let keep = usize::try_from(keep).unwrap_or(usize::MAX);
    if keep == 0 || output.len() <= keep {
        return None;
    }
    let head_end = floor_char(output, keep / 2);
    let tail_start = ceil_char(output, output.len() - keep / 2);
    let omitted = tail_start.saturating_sub(head_end);
    let text = format!(
        "{}\n[… {} omitted from the middle of this output; call {} with call_id \"{call_id}\" to see all of it …]\n{}",
        &output[..head_end],
        size(omitted),
        crate::engine::recall::RECALL_TOOL,
        &output[tail_start..]
    );
    (text.len() < output.len()).then_some(text)
}

fn floor_char(s: &str, mut i: usize) -> usize {
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

fn ceil_char(s: &str, mut i: usize) -> usize {
    while !s.is_char_boundary(i) {
        i += 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_large_output_keeps_head_and_tail() {
        let out = format!(
            "{}{}{}",
            "h".repeat(100),
            "m".repeat(10_000),
            "t".repeat(100)
        );
        let c = capped_text(&out, 200, "call_1").expect("capped");
        assert!(
            c.starts_with(&"h".repeat(100)) && c.ends_with(&"t".repeat(100)),
            "{c}"
        );
        assert!(c.contains("10.0 KB omitted") && c.contains("call_1"), "{c}");
        assert!(c.len() < out.len());
        assert_eq!(capped_text("short", 200, "c"), None);
    }

    #[test]
    fn cuts_fall_on_char_boundaries() {
        let out = "é".repeat(1000);
        let c = capped_text(&out, 101, "c").expect("capped");
        assert!(c.starts_with('é') && c.ends_with('é'));
    }

    #[test]
    fn the_cap_follows_the_window() {
        assert_eq!(cap_chars(0.1, 96_000), 38_400);
        assert_eq!(cap_chars(0.1, 0), 0);
        assert_eq!(cap_chars(f64::NAN, 1000), 0);
    }

    #[test]
    fn a_tiny_cap_still_caps_and_never_makes_an_output_longer() {
        assert_eq!(
            cap_chars(1e-9, 168_000),
            1,
            "a share too small for a character"
        );
        assert_eq!(cap_chars(0.0, 168_000), 0, "no share, no cap");
        let keep = cap_chars(1e-4, 168_000);
        assert_eq!(keep, 67);
        let short = "x".repeat(120);
        assert_eq!(
            capped_text(&short, keep, "call_1"),
            None,
            "the marker is longer"
        );
        let long = "x".repeat(5_000);
        let capped = capped_text(&long, 1, "call_1").expect("capped");
        assert!(capped.len() < 200 && capped.contains("call_1"), "{capped}");
    }
}
