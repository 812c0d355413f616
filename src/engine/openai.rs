//! The context as OpenAI chat-completions `messages`, typed and borrowing the parts' text:
//! the same messages serialize straight to JSON text (GetContext's JSON shape, no
//! intermediate values) or to `serde_json` values (the protobuf shape). Rendering follows
//! OpenCode's `toModelMessages`: user text, images and file notes; each assistant step one
//! assistant message with its `tool_calls`, then one `tool` message per call.

use std::borrow::Cow;

use serde::Serialize;

use super::estimate::json_text;
use super::strategies::Stripped;
use crate::config::{COMPACTION_PROMPT_TEXT, INTERRUPTED};
use crate::domain::{Part, PartKind, Role, ToolPart, ToolStatus};

/// Text a user `subtask` part reads as (OpenCode `toModelMessages`).
const SUBTASK_TEXT: &str = "The following tool was executed by the user";

/// One chat-completions message.
#[derive(Debug, Serialize)]
#[serde(tag = "role", rename_all = "lowercase")]
pub(crate) enum ChatMessage<'a> {
    /// What the user sent.
    User {
        /// One text, or several content parts.
        content: UserContent<'a>,
    },
    /// One model step: its text (`null` when it only called tools) and its calls.
    Assistant {
        /// The step's texts, joined by a blank line.
        content: Option<String>,
        /// The step's calls (absent when none).
        #[serde(skip_serializing_if = "Vec::is_empty")]
        tool_calls: Vec<ToolCall<'a>>,
    },
    /// A call's result.
    Tool {
        /// The call answered.
        tool_call_id: &'a str,
        /// Its output, its error, or the interrupted-tool text.
        content: &'a str,
    },
}

/// A user message's content: a lone text is sent as a string.
#[derive(Debug, Serialize)]
#[serde(untagged)]
pub(crate) enum UserContent<'a> {
    /// A single text.
    Text(Cow<'a, str>),
    /// Several parts, or an image.
    Parts(Vec<UserPart<'a>>),
}

/// One content part of a user message.
#[derive(Debug, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub(crate) enum UserPart<'a> {
    /// Text.
    Text {
        /// The text.
        text: Cow<'a, str>,
    },
    /// An image, by URL (data URLs included).
    ImageUrl {
        /// Where it is.
        image_url: ImageUrl<'a>,
    },
}

/// An image reference.
#[derive(Debug, Serialize)]
pub(crate) struct ImageUrl<'a> {
    /// The URL.
    url: &'a str,
}

/// One call in an assistant message's `tool_calls`.
#[derive(Debug, Serialize)]
pub(crate) struct ToolCall<'a> {
    id: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
    function: Function<'a>,
}

/// The function a call names, with its arguments as JSON text.
#[derive(Debug, Serialize)]
struct Function<'a> {
    name: &'a str,
    arguments: String,
}

/// About how long the messages' JSON text is: their texts, an eighth more for escapes,
/// and room for keys. The text is then written into one buffer of that size instead of
/// one doubled a dozen times (each time copied, and fresh pages touched).
pub(crate) fn json_len_hint(messages: &[ChatMessage<'_>]) -> usize {
    let text = |s: &str| s.len().saturating_add(s.len() / 8).saturating_add(16);
    let call = |c: &ToolCall<'_>| {
        text(c.id)
            .saturating_add(text(c.function.name))
            .saturating_add(text(&c.function.arguments))
            .saturating_add(48)
    };
    let message = |m: &ChatMessage<'_>| match m {
        ChatMessage::User {
            content: UserContent::Text(t),
        } => text(t),
        ChatMessage::User {
            content: UserContent::Parts(parts),
        } => parts
            .iter()
            .map(|p| match p {
                UserPart::Text { text: t } => text(t),
                UserPart::ImageUrl { image_url } => text(image_url.url),
            })
            .fold(0usize, usize::saturating_add),
        ChatMessage::Assistant {
            content,
            tool_calls,
        } => tool_calls
            .iter()
            .map(call)
            .fold(content.as_deref().map_or(0, text), usize::saturating_add),
        ChatMessage::Tool {
            tool_call_id,
            content,
        } => text(tool_call_id).saturating_add(text(content)),
    };
    messages
        .iter()
        .map(|m| message(m).saturating_add(32))
        .fold(2usize, usize::saturating_add)
}

/// Appends the chat messages one context message (`role`, its rendered `parts`) reads as.
pub(crate) fn chat_messages<'a>(
    role: Role,
    parts: impl Iterator<Item = PartRead<'a>>,
    out: &mut Vec<ChatMessage<'a>>,
) {
    match role {
        Role::User => out.extend(user_message(parts)),
        Role::Assistant => assistant_messages(parts, out),
    }
}

fn user_message<'a>(parts: impl Iterator<Item = PartRead<'a>>) -> Option<ChatMessage<'a>> {
    let text = |t: &'a str| UserPart::Text {
        text: Cow::Borrowed(t),
    };
    let mut content = Vec::new();
    for part in parts.map(PartRead::part) {
        match &part.kind {
            PartKind::Text(t) => content.push(text(&t.text)),
            PartKind::Compaction(_) => content.push(text(COMPACTION_PROMPT_TEXT)),
            PartKind::Subtask(_) => content.push(text(SUBTASK_TEXT)),
            // Text files and directories arrive as synthetic text parts already (OpenCode).
            PartKind::File(f) if f.mime == "text/plain" || f.mime == "application/x-directory" => {}
            PartKind::File(f) if f.mime.starts_with("image/") => content.push(UserPart::ImageUrl {
                image_url: ImageUrl { url: &f.url },
            }),
            PartKind::File(f) => content.push(UserPart::Text {
                text: Cow::Owned(format!("[File: {} ({})]", f.filename, f.mime)),
            }),
            _ => {}
        }
    }
    let content = match content.len() {
        0 => return None,
        1 if matches!(content[0], UserPart::Text { .. }) => match content.pop() {
            Some(UserPart::Text { text }) => UserContent::Text(text),
            _ => return None,
        },
        _ => UserContent::Parts(content),
    };
    Some(ChatMessage::User { content })
}

/// Splits an assistant message at `step-start` parts: each model step is one assistant
/// message followed by its tool results, as the provider saw it.
fn assistant_messages<'a>(
    parts: impl Iterator<Item = PartRead<'a>>,
    out: &mut Vec<ChatMessage<'a>>,
) {
    let mut text: Vec<&'a str> = Vec::new();
    let mut calls = Vec::new();
    let mut results = Vec::new();
    let flush = |text: &mut Vec<&'a str>,
                 calls: &mut Vec<ToolCall<'a>>,
                 results: &mut Vec<ChatMessage<'a>>,
                 out: &mut Vec<ChatMessage<'a>>| {
        if text.is_empty() && calls.is_empty() {
            return;
        }
        out.push(ChatMessage::Assistant {
            content: (!text.is_empty()).then(|| text.join("\n\n")),
            tool_calls: std::mem::take(calls),
        });
        text.clear();
        out.append(results);
    };
    for read in parts {
        match &read.part().kind {
            PartKind::StepStart { .. } => flush(&mut text, &mut calls, &mut results, out),
            // Text after tool calls starts the next step, with or without a step marker
            // (`pruneStepMarkers` drops them).
            PartKind::Text(t) => {
                if !calls.is_empty() {
                    flush(&mut text, &mut calls, &mut results, out);
                }
                text.push(&t.text)
            }
            PartKind::Tool(t) => {
                let call = match read {
                    PartRead::Tool(_, call) => call,
                    PartRead::Part(_) => ToolRead::as_stored(t),
                };
                calls.push(ToolCall {
                    id: &t.call_id,
                    kind: "function",
                    function: Function {
                        name: &t.tool,
                        arguments: if call.stripped_input {
                            json_text(&Stripped(&t.state.input))
                        } else {
                            json_text(&t.state.input)
                        },
                    },
                });
                results.push(ChatMessage::Tool {
                    tool_call_id: &t.call_id,
                    content: call.content,
                });
            }
            _ => {}
        }
    }
    flush(&mut text, &mut calls, &mut results, out);
}

/// A part as the messages read it: the part itself, or a tool call read with the
/// replacements its rendering makes, borrowing everything else from the stored part.
#[derive(Debug, Clone, Copy)]
pub(crate) enum PartRead<'a> {
    /// Reads as this part says.
    Part(&'a Part),
    /// A tool call (this stored part) read with `ToolRead`'s replacements: a reduced call
    /// is sent without copying it (its input, output and ids stay where they are).
    Tool(&'a Part, ToolRead<'a>),
}

impl<'a> PartRead<'a> {
    /// The part whose kind, ids and texts are read.
    fn part(self) -> &'a Part {
        match self {
            PartRead::Part(p) | PartRead::Tool(p, _) => p,
        }
    }
}

/// What a tool call's messages send besides its ids and name.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ToolRead<'a> {
    /// The `tool` message's content: the output, the error, or the interrupted text.
    pub content: &'a str,
    /// The arguments are the input reduced to its metadata (`pruneToolInputs`).
    pub stripped_input: bool,
}

impl<'a> ToolRead<'a> {
    /// The call as stored.
    fn as_stored(t: &'a ToolPart) -> ToolRead<'a> {
        ToolRead::with_status(t, t.state.status, None, None, false)
    }

    /// The call read with `status`, and `output` or `error` in place of the stored ones.
    pub(crate) fn with_status(
        t: &'a ToolPart,
        status: ToolStatus,
        output: Option<&'a str>,
        error: Option<&'a str>,
        stripped_input: bool,
    ) -> ToolRead<'a> {
        let content = match status {
            ToolStatus::Completed => output.unwrap_or(&t.state.output),
            ToolStatus::Error => error.unwrap_or(&t.state.error),
            ToolStatus::Pending | ToolStatus::Running => INTERRUPTED,
        };
        ToolRead {
            content,
            stripped_input,
        }
    }
}
