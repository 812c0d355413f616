//! What a compaction carries verbatim after the model's summary: the session's todo list
//! and the outputs of protected tools. Deterministic, so the model cannot drop or garble
//! them; and carried on by the next compaction, which finds the previous summary's
//! protected outputs under their heading ([`split_carried`]).

use super::session::Session;
use crate::domain::PartKind;

/// Heading of the todo list in a summary's text.
const TODO_HEADING: &str = "## Todo list (carried verbatim by compactd)\n";
/// Heading of the protected outputs in a summary's text; they are the text's last section.
const PROTECTED_HEADING: &str = "## Protected tool outputs (carried verbatim by compactd)\n";

/// Splits a summary's text (compactd's own) into what the model is shown again (its text
/// and todo list) and the protected outputs it carries (their entries, without the
/// heading). compactd's section is the last one: a copy of the heading the model wrote
/// (it was shown the section before outputs were carried on) stays in the text.
pub(super) fn split_carried(summary: &str) -> (&str, &str) {
    let separator = format!("\n\n{PROTECTED_HEADING}");
    match summary.rfind(&separator) {
        Some(at) => (&summary[..at], &summary[at + separator.len()..]),
        None => (summary, ""),
    }
}

impl Session {
    /// Context tokens of the protected outputs among `head`'s parts: carried on verbatim
    /// after the summary, so not replaced by it.
    pub(super) fn protected_tokens(&self, head: &[usize]) -> u64 {
        head.iter()
            .filter_map(|&i| self.messages().get(i))
            .flat_map(|m| &m.parts)
            .filter(|p| {
                matches!(&p.part.kind, PartKind::Tool(t)
                    if self.settings().is_protected_tool(&t.tool) && !t.state.output.is_empty())
            })
            .map(|p| p.context_tokens())
            .fold(0u64, u64::saturating_add)
    }

    /// Text compactd appends after the model's summary, verbatim: the session's todo list,
    /// then the protected outputs the previous summary carried (`carried`) and those of
    /// the messages summarized (`head`, positions).
    pub fn anchors(&self, head: &[usize], carried: &str) -> String {
        let mut out = String::new();
        if !self.info().todos.is_empty() {
            out.push_str(TODO_HEADING);
            for t in &self.info().todos {
                out.push_str(&format!("- [{}] {}", t.status, t.content));
                if !t.priority.is_empty() {
                    out.push_str(&format!(" ({})", t.priority));
                }
                out.push('\n');
            }
        }
        let mut protected = carried.to_string();
        for m in head.iter().filter_map(|&i| self.messages().get(i)) {
            for p in &m.parts {
                if let PartKind::Tool(t) = &p.part.kind
                    && self.settings().is_protected_tool(&t.tool)
                    && !t.state.output.is_empty()
                    // The same output loaded again (a skill read twice) is carried once.
                    && !protected.contains(&format!(")\n{}\n", t.state.output))
                {
                    protected.push_str(&format!(
                        "### {} ({})\n{}\n",
                        t.tool, t.call_id, t.state.output
                    ));
                }
            }
        }
        if !protected.is_empty() {
            if !out.is_empty() {
                out.push('\n');
            }
            out.push_str(PROTECTED_HEADING);
            out.push_str(&protected);
        }
        out
    }
}
