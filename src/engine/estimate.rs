//! Per-part token estimates, computed once when a part is written and cached beside it,
//! so no step ever re-counts old outputs.

use serde::{Deserialize, Serialize};

use super::strategies::{Stripped, stripped_units};
use crate::config::{COMPACTION_PROMPT_TEXT, INTERRUPTED};
use crate::domain::{Part, PartKind, ToolStatus};
use crate::tokens::TokenCounter;

/// Cached token figures of one part.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PartEstimate {
    /// Tokens the part adds to the context apart from a tool output (text, tool input,
    /// error text, the interrupted marker).
    pub base: u64,
    /// Tokens of a completed tool's `state.output` (what prune weighs and may clear).
    pub output: u64,
    /// The part of `base` a model writes when the part is in an assistant message (text,
    /// reasoning, tool call input): the provider's `output` usage already counts it.
    pub generated: u64,
}

impl PartEstimate {
    /// Tokens in the context view: the output counts only while not compacted.
    pub fn in_context(&self, compacted: bool, placeholder: u64) -> u64 {
        self.base + if compacted { placeholder } else { self.output }
    }
}

/// Counts a part the way it will be rendered into the model context.
pub fn estimate(part: &Part, counter: &dyn TokenCounter) -> PartEstimate {
    estimate_over(part, None, counter)
}

/// [`estimate`] of a part replacing `old` (the same part as stored, with its estimate):
/// a tool call whose input is unchanged keeps its input's count. Hosts resend a tool part
/// as it runs (pending, running, completed), and a real tokenizer would otherwise
/// serialize, hash and look up (or count) the same input at each.
pub fn estimate_over(
    part: &Part,
    old: Option<(&Part, &PartEstimate)>,
    counter: &dyn TokenCounter,
) -> PartEstimate {
    match &part.kind {
        PartKind::Text(t) if t.ignored => PartEstimate::default(),
        PartKind::Text(t) => generated(counter.count(&t.text)),
        PartKind::Reasoning(r) => generated(counter.count(&r.text)),
        PartKind::Tool(tool) => {
            let input = match old {
                Some((
                    Part {
                        kind: PartKind::Tool(was),
                        ..
                    },
                    est,
                )) if was.state.input == tool.state.input => est.generated,
                _ => count_input(&tool.state.input, counter),
            };
            let (extra, output) = match tool.state.status {
                ToolStatus::Completed => (0, counter.count(&tool.state.output)),
                ToolStatus::Error => (counter.count(&tool.state.error), 0),
                ToolStatus::Pending | ToolStatus::Running => (counter.count(INTERRUPTED), 0),
            };
            PartEstimate {
                base: input + extra,
                output,
                generated: input,
            }
        }
        PartKind::File(f) => PartEstimate {
            base: match sent_as(f) {
                FileSent::Nothing => 0,
                FileSent::Image => IMAGE_TOKENS,
                FileSent::Data => counter.count(&f.url),
                FileSent::Name => counter.count(&f.filename),
            },
            ..PartEstimate::default()
        },
        PartKind::Subtask(s) => {
            let base = counter.count(&s.prompt) + counter.count(&s.description);
            PartEstimate {
                base,
                ..PartEstimate::default()
            }
        }
        PartKind::Compaction(_) => PartEstimate {
            base: counter.count(COMPACTION_PROMPT_TEXT),
            ..PartEstimate::default()
        },
        PartKind::StepStart { .. }
        | PartKind::StepFinish(_)
        | PartKind::Snapshot { .. }
        | PartKind::Patch(_)
        | PartKind::Agent(_)
        | PartKind::Retry(_) => PartEstimate::default(),
    }
}

/// Tokens one image is counted at: about the most a provider charges for one at the sizes
/// it takes (Anthropic, width × height / 750 up to 1.15 megapixels: ~1,600; OpenAI's high
/// detail up to ~1,100; Gemini 258). Its base64 text would count as hundreds of thousands.
pub(crate) const IMAGE_TOKENS: u64 = 1_600;

/// What a request carries for a file part (OpenCode's `toModelMessages`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FileSent {
    /// A text file or a directory: its content arrives as a synthetic text part.
    Nothing,
    /// An image, read as an image.
    Image,
    /// Another file, inline (`data:`): counted as its text, which over-counts a binary.
    Data,
    /// Another file by reference: its name.
    Name,
}

fn sent_as(f: &crate::domain::FilePart) -> FileSent {
    if f.mime == "text/plain" || f.mime == "application/x-directory" {
        FileSent::Nothing
    } else if f.mime.starts_with("image/") {
        FileSent::Image
    } else if f.url.starts_with("data:") {
        FileSent::Data
    } else {
        FileSent::Name
    }
}

/// The texts [`estimate`] counts of `part` that may be long (tool input and output, text,
/// reasoning, a file's data or name, a subtask's prompt and description): the server counts those of a new part on a blocking thread
/// first, so the count [`estimate`] takes on the session's actor is a cache hit.
pub fn counted_texts(part: &Part) -> Vec<std::borrow::Cow<'_, str>> {
    use std::borrow::Cow;
    match &part.kind {
        PartKind::Text(t) if t.ignored => Vec::new(),
        PartKind::Text(t) => vec![Cow::Borrowed(t.text.as_str())],
        PartKind::Reasoning(r) => vec![Cow::Borrowed(r.text.as_str())],
        PartKind::Tool(tool) => {
            let mut out = vec![Cow::Owned(json_text(&tool.state.input))];
            match tool.state.status {
                ToolStatus::Completed => out.push(Cow::Borrowed(tool.state.output.as_str())),
                ToolStatus::Error => out.push(Cow::Borrowed(tool.state.error.as_str())),
                ToolStatus::Pending | ToolStatus::Running => {}
            }
            out
        }
        PartKind::File(f) => match sent_as(f) {
            FileSent::Data => vec![Cow::Borrowed(f.url.as_str())],
            FileSent::Name => vec![Cow::Borrowed(f.filename.as_str())],
            FileSent::Nothing | FileSent::Image => Vec::new(),
        },
        PartKind::Subtask(s) => vec![
            Cow::Borrowed(s.prompt.as_str()),
            Cow::Borrowed(s.description.as_str()),
        ],
        _ => Vec::new(),
    }
}

/// A tool input as the model reads it (compact JSON), written straight into a byte buffer
/// rather than through `Display`: it is counted on every tool part written.
pub(crate) fn json_text<T: serde::Serialize + ?Sized>(input: &T) -> String {
    // sonic-rs: SIMD string escaping behind serde's `Serialize`, the same bytes as
    // serde_json (a test checks every tool input of the shared traces and edge values).
    // Serializing tool inputs was a fifth of building a large context.
    sonic_rs::to_string(input).unwrap_or_default()
}

/// Tokens of a tool input as the model reads it. A counter that needs only the length
/// (chars ÷ 4) gets the JSON text's length, worked out from the value (`json_len`), not
/// the text: every tool part written was a fresh buffer grown to the input's size, a
/// large input (a whole file) many pages of it.
fn count_input(input: &serde_json::Value, counter: &dyn TokenCounter) -> u64 {
    count_measured(input, counter, super::json_len::value_units)
}

/// Tokens of a tool input as `pruneToolInputs` reduces it ([`Stripped`]): counted for
/// every output the strategies or prune clear, from its length alone when that is all the
/// counter needs.
pub(crate) fn count_stripped(input: &serde_json::Value, counter: &dyn TokenCounter) -> u64 {
    count_measured(&Stripped(input), counter, |s| stripped_units(s.0))
}

/// `input`'s tokens: from its length as `units` measures it when that is all the counter
/// needs, else from its text.
fn count_measured<T: serde::Serialize + ?Sized>(
    input: &T,
    counter: &dyn TokenCounter,
    units: fn(&T) -> u64,
) -> u64 {
    match counter.per_length() {
        Some(of_length) => of_length(units(input)),
        None => counter.count(&json_text(input)),
    }
}

/// A part whose tokens are all model-written when it sits in an assistant message.
fn generated(tokens: u64) -> PartEstimate {
    PartEstimate {
        base: tokens,
        output: 0,
        generated: tokens,
    }
}

#[cfg(test)]
mod json_text_tests {
    use super::{count_input, count_stripped, json_text};
    use crate::engine::strategies::Stripped;
    use crate::tokens::{CharsPerToken, TokenCounter};

    #[test]
    fn tool_inputs_serialize_as_serde_json_does() {
        let mut inputs = vec![serde_json::json!({
            "floats": [0.1, -0.0, 1e21, 1.5e-7, 123456789.125, f64::MAX, f64::MIN_POSITIVE],
            "ints": [0, -1, u64::MAX, i64::MIN],
            "text": "quote \" backslash \\ tab \t nl \n cr \r nul \u{0} bell \u{7} del \u{7f} é 日本 🦀 \u{2028}",
            "nested": {"empty": {}, "list": [], "null": null, "t": true, "f": false},
        })];
        crate::tokens::test_traces::each_value(|v| {
            if let Some(input) = v.get("input") {
                inputs.push(input.clone());
            }
        });
        assert!(inputs.len() > 400, "{} inputs", inputs.len());
        for input in &inputs {
            let want = serde_json::to_string(input).unwrap_or_default();
            assert_eq!(json_text(input), want);
            // Worked out from the value, the length is the text's, so chars ÷ 4 counts
            // the same.
            assert_eq!(
                count_input(input, &CharsPerToken),
                CharsPerToken.count(&want)
            );
            let stripped = json_text(&Stripped(input));
            assert_eq!(
                count_stripped(input, &CharsPerToken),
                CharsPerToken.count(&stripped)
            );
        }
    }

    proptest::proptest! {
        /// Any text in keys and values, escapes and surrogate pairs included: the length
        /// measured is serde_json's text's.
        #[test]
        fn any_strings_measure_as_serde_json_writes_them(key in ".{0,40}", text in ".{0,200}") {
            let input = serde_json::json!({ key.clone(): text, "list": [key] });
            let want = serde_json::to_string(&input).unwrap_or_default();
            proptest::prop_assert_eq!(
                count_input(&input, &CharsPerToken),
                CharsPerToken.count(&want)
            );
        }
    }
}
