//! How one part reads in the model context, given the marks on it and the settings: the
//! single place where prune's placeholder, the strategies' rewrites and OpenCode's
//! interrupted-tool rule are applied. The context view, the token figures of reduced
//! parts and the summarizer's input all come from here, so they cannot disagree.

use std::borrow::Cow;

use super::estimate::{PartEstimate, count_stripped};
use super::openai::{PartRead, ToolRead};
use super::strategies::{
    Strategy, capped_text, file_breadcrumb, inlined_breadcrumb, is_inlined_file, is_step_marker,
    masked_text, strip_input, superseded_text, truncate_code_blocks, truncate_error,
};
use crate::config::{INTERRUPTED, Settings};
use crate::domain::{Part, PartKind, StrategyMark, TextPart, ToolPart, ToolState, ToolStatus};
use crate::tokens::TokenCounter;

/// The strategy a part's mark names, when that strategy is on.
pub(crate) fn active_mark(part: &Part, s: &Settings) -> Option<Strategy> {
    let st = part.mark.as_ref()?.strategy;
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

/// The part as the model sees it (an owned copy of [`render_reading`]'s), or `None` when
/// it is not sent at all.
#[cfg(test)]
pub(crate) fn render(part: &Part, s: &Settings) -> Option<Part> {
    render_reading(part, s, Copying::Whole).map(Reading::into_owned)
}

/// Renders `part` as if it carried `mark` and prune's stamp as `compacted` says, without
/// copying content the rendering replaces (a superseded 100 KB output is never cloned).
#[cfg(test)]
pub(crate) fn render_as(
    part: &Part,
    mark: Option<&StrategyMark>,
    compacted: bool,
    s: &Settings,
    strip_inputs: bool,
) -> Option<Part> {
    rewritten(
        part,
        rewrite(part, mark, compacted, s, strip_inputs),
        Copying::Whole,
    )
}

/// What a copy of a rewritten part keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Copying {
    /// Every field: the context view hands whole parts to hosts.
    Whole,
    /// What the OpenAI messages read (ids, kinds, texts, a tool's name, call id, input,
    /// status, output and error, a file's mime, url and name). Metadata, raw fields,
    /// titles, attachments and extra fields stay behind: cloning OpenCode's metadata
    /// (diffs, file snapshots) was most of copying a reduced part.
    Sent,
}

/// The part as the context sends it, or `None` when it is not sent at all: borrowed when
/// it reads as stored (most parts). For the OpenAI messages (`Copying::Sent`) a reduced
/// tool call is read in place too, with only its replacements held; rebuilding those
/// calls (a stripped input's new map, clones of ids and outputs, then dropping it all)
/// was most of building a context with the strategies on.
pub(crate) fn render_reading<'a>(
    part: &'a Part,
    s: &'a Settings,
    copying: Copying,
) -> Option<Reading<'a>> {
    let strip_inputs = s.strategies.has(Strategy::PruneToolInputs);
    match rewrite(
        part,
        part.mark.as_ref(),
        is_compacted(part),
        s,
        strip_inputs,
    ) {
        Rewrite::Kept => Some(Reading::Stored(part)),
        // Most tool parts: copying one that reads as stored cloned its whole output (half
        // of building a large context).
        Rewrite::Tool(tool, r) if r.changes_nothing(tool) => Some(Reading::Stored(part)),
        Rewrite::Tool(tool, r) if copying == Copying::Sent => Some(Reading::Tool(part, tool, r)),
        other => rewritten(part, other, copying).map(|p| Reading::Rewritten(Box::new(p))),
    }
}

/// A part as the context sends it ([`render_reading`]).
pub(crate) enum Reading<'a> {
    /// Reads as stored.
    Stored(&'a Part),
    /// A rewritten copy (a placeholder text, a strategy's reduction; a whole tool call
    /// for the context view).
    Rewritten(Box<Part>),
    /// A tool call (the stored part) read with these replacements.
    Tool(&'a Part, &'a ToolPart, ToolRewrite<'a>),
}

impl Reading<'_> {
    /// The part as the model reads it, owned (the context view's parts).
    pub(crate) fn into_owned(self) -> Part {
        match self {
            Reading::Stored(p) => p.clone(),
            Reading::Rewritten(p) => *p,
            Reading::Tool(p, tool, r) => whole_call(p, tool, r),
        }
    }

    /// Calls `f` with the part as the model reads it, whole (a call read in place is
    /// copied whole for it; the view never reads one in place).
    pub(crate) fn with_whole<R>(&self, f: impl FnOnce(&Part) -> R) -> R {
        match self {
            Reading::Stored(p) => f(p),
            Reading::Rewritten(p) => f(p),
            Reading::Tool(p, tool, r) => f(&whole_call(p, tool, r.clone())),
        }
    }

    /// The part's kind as the model reads it (a reduced call is still a call).
    pub(crate) fn kind(&self) -> &PartKind {
        match self {
            Reading::Stored(p) | Reading::Tool(p, _, _) => &p.kind,
            Reading::Rewritten(p) => &p.kind,
        }
    }

    /// What the OpenAI messages read of it.
    pub(crate) fn read(&self) -> PartRead<'_> {
        match self {
            Reading::Stored(p) => PartRead::Part(p),
            Reading::Rewritten(p) => PartRead::Part(p),
            Reading::Tool(p, tool, r) => PartRead::Tool(
                p,
                ToolRead::with_status(
                    tool,
                    r.status,
                    r.output.as_deref(),
                    r.error.as_deref(),
                    r.strip_input,
                ),
            ),
        }
    }
}

/// A call read in place, copied whole (a tool rewrite always yields a part).
fn whole_call(part: &Part, tool: &ToolPart, r: ToolRewrite<'_>) -> Part {
    rewritten(part, Rewrite::Tool(tool, r), Copying::Whole).unwrap_or_else(|| part.clone())
}

/// The part `rewrite` made of `part`, with the fields `copying` keeps.
fn rewritten(part: &Part, rewrite: Rewrite<'_>, copying: Copying) -> Option<Part> {
    let whole = copying == Copying::Whole;
    // A field `Copying::Sent` leaves behind.
    fn kept<T: Clone + Default>(whole: bool, v: &T) -> T {
        if whole { v.clone() } else { T::default() }
    }
    let with_kind = |kind: PartKind| Part {
        id: part.id.clone(),
        message_id: part.message_id.clone(),
        kind,
        mark: part.mark.clone(),
        extra: kept(whole, &part.extra),
    };
    match rewrite {
        Rewrite::Dropped => None,
        Rewrite::Kept => Some(part.clone()),
        Rewrite::Text(text) => Some(match &part.kind {
            PartKind::Text(t) => with_kind(PartKind::Text(TextPart {
                text,
                synthetic: t.synthetic,
                ignored: t.ignored,
                time: t.time,
                metadata: kept(whole, &t.metadata),
            })),
            // A file reads as a breadcrumb the model can follow.
            _ => with_kind(PartKind::Text(TextPart {
                text,
                synthetic: true,
                ..TextPart::default()
            })),
        }),
        Rewrite::Tool(tool, r) => {
            let st = &tool.state;
            let replaced = r.output.is_some();
            let input = if r.strip_input {
                strip_input(&st.input)
            } else {
                st.input.clone()
            };
            let state = ToolState {
                status: r.status,
                input,
                output: r
                    .output
                    .map(Cow::into_owned)
                    .unwrap_or_else(|| st.output.clone()),
                error: r
                    .error
                    .map(Cow::into_owned)
                    .unwrap_or_else(|| st.error.clone()),
                title: kept(whole, &st.title),
                metadata: kept(whole, &st.metadata),
                time: st.time,
                attachments: if replaced {
                    Vec::new()
                } else {
                    kept(whole, &st.attachments)
                },
                raw: kept(whole, &st.raw),
            };
            Some(with_kind(PartKind::Tool(Box::new(ToolPart {
                call_id: tool.call_id.clone(),
                tool: tool.tool.clone(),
                state,
                metadata: kept(whole, &tool.metadata),
            }))))
        }
    }
}

/// The tokens of a part as rendered, and how many of the tokens it no longer sends are
/// its tool input's (the input-leak fix's share of a reduction).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Rendered {
    /// Tokens the rendered part counts.
    pub tokens: u64,
    /// Tokens of the tool input the rendering leaves out (0 unless the input is stripped).
    pub input_saved: u64,
}

/// The tokens [`render_as`]'s part would count, from the part's cached estimate `est` plus
/// a count of only the text the rendering replaces: nothing is cloned or serialized again
/// on the hot path (re-rendering a marked 4 KB output cost more than the whole update).
pub(crate) fn rendered_tokens_as(
    part: &Part,
    est: &PartEstimate,
    mark: Option<&StrategyMark>,
    compacted: bool,
    s: &Settings,
    strip_inputs: bool,
    counter: &dyn TokenCounter,
) -> Rendered {
    let whole = |tokens: u64| Rendered {
        tokens,
        input_saved: 0,
    };
    match rewrite(part, mark, compacted, s, strip_inputs) {
        Rewrite::Dropped => whole(0),
        Rewrite::Kept => whole(est.base.saturating_add(est.output)),
        Rewrite::Text(text) => whole(counter.count(&text)),
        Rewrite::Tool(tool, r) => {
            // A tool's estimate: `generated` is its input, the rest of `base` its error
            // text (or the interrupted marker), `output` its completed output.
            let input = if r.strip_input {
                count_stripped(&tool.state.input, counter)
            } else {
                est.generated
            };
            let rest = match r.status {
                ToolStatus::Completed => r
                    .output
                    .as_deref()
                    .map_or(est.output, |text| counter.count(text)),
                _ => r
                    .error
                    .as_deref()
                    .map_or(est.base.saturating_sub(est.generated), |text| {
                        counter.count(text)
                    }),
            };
            Rendered {
                tokens: input.saturating_add(rest),
                input_saved: est.generated.saturating_sub(input),
            }
        }
    }
}

/// How the rendering changes a part: the one decision both the rendered part and its
/// token figure follow, so they cannot disagree.
enum Rewrite<'a> {
    /// Not sent at all.
    Dropped,
    /// Sent as stored.
    Kept,
    /// A text or file part sent as this text.
    Text(String),
    /// A tool part with these replacements.
    Tool(&'a ToolPart, ToolRewrite<'a>),
}

/// What replaces a tool part's content; `None` keeps what is stored. Fixed texts (prune's
/// placeholder, the interrupted marker) are borrowed, not copied for every rendering.
#[derive(Clone)]
pub(crate) struct ToolRewrite<'a> {
    status: ToolStatus,
    output: Option<Cow<'a, str>>,
    error: Option<Cow<'a, str>>,
    /// The input-leak fix applies: only the input's short fields are sent.
    strip_input: bool,
}

impl ToolRewrite<'_> {
    /// True when the part it rewrites reads exactly as stored.
    fn changes_nothing(&self, tool: &ToolPart) -> bool {
        self.status == tool.state.status
            && self.output.is_none()
            && self.error.is_none()
            && !self.strip_input
    }
}

fn rewrite<'a>(
    part: &'a Part,
    mark: Option<&StrategyMark>,
    compacted: bool,
    s: &'a Settings,
    strip_inputs: bool,
) -> Rewrite<'a> {
    if s.strategies.has(Strategy::PruneStepMarkers) && is_step_marker(&part.kind) {
        return Rewrite::Dropped;
    }
    let active = mark.map(|m| m.strategy).filter(|st| s.strategies.has(*st));
    match &part.kind {
        PartKind::Text(t) if t.ignored => Rewrite::Dropped,
        PartKind::Text(t) => {
            let rewritten = match active {
                Some(Strategy::PruneUserCodeBlocks) => truncate_code_blocks(&t.text),
                Some(Strategy::PruneFiles) => inlined_breadcrumb(t),
                _ => None,
            };
            rewritten.map_or(Rewrite::Kept, Rewrite::Text)
        }
        PartKind::File(f) if active == Some(Strategy::PruneFiles) && !is_inlined_file(&f.mime) => {
            Rewrite::Text(file_breadcrumb(f))
        }
        PartKind::Tool(tool) => Rewrite::Tool(
            tool,
            tool_rewrite(tool, mark, active, compacted, s, strip_inputs),
        ),
        _ => Rewrite::Kept,
    }
}

fn tool_rewrite<'a>(
    tool: &ToolPart,
    mark: Option<&StrategyMark>,
    active: Option<Strategy>,
    compacted: bool,
    s: &'a Settings,
    strip_inputs: bool,
) -> ToolRewrite<'a> {
    let st = &tool.state;
    let superseded = active
        .filter(|a| a.supersedes())
        .and(mark)
        .map(|m| superseded_text(&m.superseded_by));
    let compacted = compacted && st.status == ToolStatus::Completed;
    let strip_input = strip_inputs && (superseded.is_some() || compacted);
    let placeholder = || Some(Cow::Borrowed(s.placeholder.as_str()));
    let mut status = st.status;
    let mut output = None;
    let mut error = None;
    match st.status {
        // (Under `pruneToolInputs` as the settings have it, not `strip_inputs`: the output
        // reads the same whichever way the input is counted.)
        ToolStatus::Completed
            if active == Some(Strategy::SupersedeWrites)
                && s.strategies.has(Strategy::PruneToolInputs)
                && !compacted =>
        {
            // What goes is the change's content, its input. An output longer than the
            // note reads as the note, as every superseded output does (so never longer
            // than masking or the cap would leave it); a shorter one (a write's
            // confirmation) keeps its text with the note after it, so the model knows
            // where the content went.
            if let Some(note) = superseded {
                output = Some(Cow::Owned(
                    if note.len() < st.output.len() || st.output.is_empty() {
                        note
                    } else {
                        format!("{}\n\n{note}", st.output)
                    },
                ));
            }
        }
        ToolStatus::Completed => {
            // A supersede note never makes a tiny output longer, and a superseded
            // part reads as its strategy made it even once prune clears it too; a tiny
            // one prune cleared reads as cleared, as every cleared output does.
            if let Some(text) = superseded {
                if text.len() < st.output.len() {
                    output = Some(Cow::Owned(text));
                } else if compacted {
                    output = placeholder();
                }
            } else if active == Some(Strategy::MaskObservations) {
                // Names the call, so the model can ask for it back (prune's
                // placeholder does not).
                let text = masked_text(&tool.tool, &tool.call_id, st.output.len());
                if text.len() < st.output.len() {
                    output = Some(Cow::Owned(text));
                } else if compacted {
                    output = placeholder();
                }
            } else if compacted {
                output = placeholder();
            } else if active == Some(Strategy::CapLargeOutputs) {
                output = mark
                    .and_then(|m| capped_text(&st.output, m.keep, &tool.call_id))
                    .map(Cow::Owned);
            }
        }
        ToolStatus::Error => {
            if let Some(text) = superseded.filter(|t| t.len() < st.error.len()) {
                error = Some(Cow::Owned(text));
            } else if active == Some(Strategy::TruncateOldErrors) {
                error = truncate_error(&st.error).map(Cow::Owned);
            }
        }
        ToolStatus::Pending | ToolStatus::Running => {
            status = ToolStatus::Error;
            error = Some(Cow::Borrowed(INTERRUPTED));
        }
    }
    ToolRewrite {
        status,
        output,
        error,
        strip_input,
    }
}
