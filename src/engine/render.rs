//! How one part reads in the model context, given the marks on it and the settings: the
//! single place where prune's placeholder, the strategies' rewrites and OpenCode's
//! interrupted-tool rule are applied. The context view, the token figures of reduced
//! parts and the summarizer's input all come from here, so they cannot disagree.

use super::strategies::{
    Strategy, file_breadcrumb, inlined_breadcrumb, is_step_marker, strip_input, superseded_text,
    truncate_code_blocks, truncate_error,
};
use crate::config::{INTERRUPTED, Settings};
use crate::session::{Part, PartKind, TextPart, ToolStatus};

/// The strategy a part's mark names, when that strategy is on.
pub(crate) fn active_mark(part: &Part, s: &Settings) -> Option<Strategy> {
    let mark = part.mark.as_ref()?;
    let st = mark.strategy.parse::<Strategy>().ok()?;
    s.strategies.has(st).then_some(st)
}

/// True when prune cleared this part's output (only a completed output can be cleared).
pub(crate) fn is_compacted(part: &Part) -> bool {
    matches!(&part.kind, PartKind::Tool(t)
        if t.state.status == ToolStatus::Completed && t.state.time.compacted.is_some())
}

/// True when the part reads differently from its stored content because of prune or a
/// strategy (its tokens are then counted from the rendering, not the cached estimate).
pub(crate) fn is_reduced(part: &Part, s: &Settings) -> bool {
    is_compacted(part) || active_mark(part, s).is_some()
}

/// The part as the model sees it, or `None` when it is not sent at all.
pub(crate) fn render(part: &Part, s: &Settings) -> Option<Part> {
    render_with(part, s, s.strategies.has(Strategy::PruneToolInputs))
}

/// [`render`] with the input-leak fix forced on or off (to attribute its saving).
pub(crate) fn render_with(part: &Part, s: &Settings, strip_inputs: bool) -> Option<Part> {
    if s.strategies.has(Strategy::PruneStepMarkers) && is_step_marker(&part.kind) {
        return None;
    }
    let mark = active_mark(part, s);
    match &part.kind {
        PartKind::Text(t) if t.ignored => None,
        PartKind::Text(t) => {
            let rewritten = match mark {
                Some(Strategy::PruneUserCodeBlocks) => truncate_code_blocks(&t.text),
                Some(Strategy::PruneFiles) => inlined_breadcrumb(t),
                _ => None,
            };
            let mut out = part.clone();
            if let (Some(text), PartKind::Text(t)) = (rewritten, &mut out.kind) {
                t.text = text;
            }
            Some(out)
        }
        PartKind::File(f) if mark == Some(Strategy::PruneFiles) => Some(Part {
            kind: PartKind::Text(TextPart {
                text: file_breadcrumb(f),
                synthetic: true,
                ..TextPart::default()
            }),
            ..part.clone()
        }),
        PartKind::Tool(_) => {
            let compacted = is_compacted(part);
            let mut out = part.clone();
            let PartKind::Tool(t) = &mut out.kind else {
                return None;
            };
            let superseded = mark
                .filter(|st| st.supersedes())
                .and(part.mark.as_ref())
                .map(|m| superseded_text(&m.superseded_by));
            match t.state.status {
                ToolStatus::Completed => {
                    if let Some(text) = &superseded {
                        t.state.output = text.clone();
                        t.state.attachments.clear();
                    } else if compacted {
                        t.state.output = s.placeholder.clone();
                        t.state.attachments.clear();
                    }
                }
                ToolStatus::Error => {
                    if let Some(text) = &superseded {
                        t.state.error = text.clone();
                    } else if mark == Some(Strategy::TruncateOldErrors)
                        && let Some(short) = truncate_error(&t.state.error)
                    {
                        t.state.error = short;
                    }
                }
                ToolStatus::Pending | ToolStatus::Running => {
                    t.state.status = ToolStatus::Error;
                    t.state.error = INTERRUPTED.to_string();
                }
            }
            if strip_inputs && (superseded.is_some() || compacted) {
                t.state.input = strip_input(&t.state.input);
            }
            Some(out)
        }
        _ => Some(part.clone()),
    }
}
