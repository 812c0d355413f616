//! What a compaction carries verbatim after the model's summary: the session's todo list
//! and the outputs of protected tools. Deterministic, so the model cannot drop or garble
//! them; and carried on by the next compaction, which finds the previous summary's
//! protected outputs under their heading ([`split_carried`]).

use super::session::Session;
use crate::domain::{FastSet, PartKind};

/// Heading of the todo list in a summary's text.
const TODO_HEADING: &str = "## Todo list (carried verbatim by compactd)\n";
/// Heading of the protected outputs in a summary's text; they are the text's last section.
const PROTECTED_HEADING: &str = "## Protected tool outputs (carried verbatim by compactd)\n";

/// Whether `carried` (a summary's protected entries) holds `output` as the whole output of
/// an entry of `tool`: right after a `### <tool> (<call id>)` line, up to the next entry
/// or the end. A line of a carried output that merely looks like a heading (a skill's own
/// `### Verify (required)`) never counts: a false match would drop an output, a missed one
/// only carries it twice.
pub(super) fn carries(carried: &str, tool: &str, output: &str) -> bool {
    let whole = format!(")\n{output}\n");
    let heading = format!("### {tool} (");
    carried.match_indices(&whole).any(|(at, _)| {
        let line = carried[..at].rfind('\n').map_or(0, |n| n + 1);
        let end = at + whole.len();
        carried[line..].starts_with(&heading)
            && (end == carried.len() || carried[end..].starts_with("### "))
    })
}

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
    /// The protected outputs a summary carries on: those the previous summary carried
    /// (`carried`), then those of the messages summarized (`head`, positions), each output
    /// once (a skill loaded again is carried once; the copy is replaced like any part).
    /// Left out: a message the context does not send (its output never reached the
    /// model), and a pinned part, which the context carries after the summary already.
    /// Without `carry_on`, `carried` stays in the context in its own summary (pinned):
    /// its outputs are not carried on, only not carried a second time.
    pub(super) fn protected_section(
        &self,
        head: &[usize],
        carried: &str,
        carry_on: bool,
    ) -> String {
        let mut section = if carry_on {
            carried.to_string()
        } else {
            String::new()
        };
        let mut seen: FastSet<&str> = FastSet::default();
        let sent = head
            .iter()
            .filter_map(|&i| self.messages().get(i).map(|m| (i, m)))
            .filter(|(_, m)| m.is_sent());
        for (i, m) in sent {
            for p in &m.parts {
                let PartKind::Tool(t) = &p.part.kind else {
                    continue;
                };
                let output = t.state.output.as_str();
                if !self.settings().is_protected_tool(&t.tool)
                    || output.is_empty()
                    || self.is_pinned(i, &p.part.id)
                    || !seen.insert(output)
                    || carries(carried, &t.tool, output)
                {
                    continue;
                }
                section.push_str(&format!("### {} ({})\n{output}\n", t.tool, t.call_id));
            }
        }
        section
    }

    /// True when the context carries summary `i`'s text whole after the next compaction
    /// too: the message is sent and a pin holds each of its text parts (a pinned earlier
    /// summary is carried after the later one, `context.rs`).
    pub(super) fn text_pinned(&self, i: usize) -> bool {
        let Some(m) = self.messages().get(i) else {
            return false;
        };
        let mut texts = m.parts.iter().filter(|p| match &p.part.kind {
            PartKind::Text(t) => !t.ignored,
            _ => false,
        });
        m.is_sent() && texts.all(|p| self.is_pinned(i, &p.part.id))
    }

    /// Text compactd appends after the model's summary, verbatim: the session's todo list,
    /// then the protected outputs ([`Self::protected_section`]; `carry_on` false when a
    /// pin keeps the previous summary, `carried`'s source, in the context).
    pub fn anchors(&self, head: &[usize], carried: &str, carry_on: bool) -> String {
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
        let protected = self.protected_section(head, carried, carry_on);
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
