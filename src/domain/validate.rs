//! What a well-formed session, message and part is, checked in one place for every way
//! one enters (a Stream update, its unary twin, an import): ids are present and bounded,
//! a tool call has its call id, JSON a client sent is not nested deeper than every
//! standard protobuf client can read back.
//!
//! Errors name the field relative to the value checked (`tool.call_id`); the boundary
//! that received it prefixes its own path (`upsert_part.part.`, `messages[3].parts[1].`).

use serde_json::Value;
use thiserror::Error;

use super::{Extra, MessageInfo, ModelLimits, Part, PartKind, SessionInfo};

/// Longest id accepted (session, message, part, tool call): ids are keys, not payloads
/// (a call id is also copied onto every part a newer call supersedes).
pub const MAX_ID_BYTES: usize = 256;

/// Longest session title accepted: a label, copied into every `ListSessions` reply (a
/// 16 MiB title on a few sessions made every listing too large to send).
pub const MAX_TITLE_BYTES: usize = 1024;

/// `title` cut to [`MAX_TITLE_BYTES`] at a character boundary (ending in `…`): how an
/// import takes a document's longer title, a label another tool let grow, rather than
/// refusing the whole document.
pub fn clip_title(title: String) -> String {
    crate::config::shown::cut_to(title, MAX_TITLE_BYTES)
}

/// Deepest JSON nesting accepted in a tool input, metadata or unmodelled field (`{}` is
/// depth 1). Each JSON object level costs three protobuf message levels
/// (`Value` → `Struct` → map entry), and a part sits about ten levels deep in a
/// `GetSession` reply: 28 levels stay within the default recursion limit of 100 of
/// prost and of Python's protobuf, so whatever is accepted reads back (a request 33 levels
/// deep no longer decodes at all: `tests/grpc/validation.rs`).
pub const MAX_JSON_DEPTH: usize = 28;

/// A field of a domain value that is missing, too long or too deep.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{field}: {message}")]
pub struct InvalidField {
    /// The field, dotted, relative to the value checked.
    pub field: String,
    /// What is wrong with it.
    pub message: String,
}

fn invalid(field: impl Into<String>, message: impl Into<String>) -> InvalidField {
    InvalidField {
        field: field.into(),
        message: message.into(),
    }
}

/// A required id: present and at most [`MAX_ID_BYTES`] bytes.
pub fn check_id(field: &str, id: &str) -> Result<(), InvalidField> {
    if id.is_empty() {
        return Err(invalid(field, "required"));
    }
    check_optional_id(field, id)
}

/// An id that may be empty, bounded like every id.
pub fn check_optional_id(field: &str, id: &str) -> Result<(), InvalidField> {
    if id.len() > MAX_ID_BYTES {
        return Err(invalid(
            field,
            format!(
                "{} bytes long; ids are at most {MAX_ID_BYTES} bytes",
                id.len()
            ),
        ));
    }
    Ok(())
}

/// Nesting depth of a JSON value: 0 for a scalar, 1 for a flat object or array. Stops
/// counting past `limit` (so a hostile value costs no more than the limit to check).
fn depth_over(v: &Value, limit: usize) -> bool {
    match v {
        Value::Object(o) => limit == 0 || o.values().any(|c| depth_over(c, limit - 1)),
        Value::Array(a) => limit == 0 || a.iter().any(|c| depth_over(c, limit - 1)),
        _ => false,
    }
}

fn check_json(field: &str, v: &Value) -> Result<(), InvalidField> {
    if depth_over(v, MAX_JSON_DEPTH) {
        return Err(invalid(
            field,
            format!("JSON nested deeper than {MAX_JSON_DEPTH} levels"),
        ));
    }
    Ok(())
}

fn check_opt_json(field: &str, v: &Option<Value>) -> Result<(), InvalidField> {
    v.as_ref().map_or(Ok(()), |v| check_json(field, v))
}

fn check_extra(field: &str, extra: &Extra) -> Result<(), InvalidField> {
    // An object of depth d holds values of depth at most d - 1.
    match extra.values().any(|v| depth_over(v, MAX_JSON_DEPTH - 1)) {
        true => Err(invalid(
            field,
            format!("JSON nested deeper than {MAX_JSON_DEPTH} levels"),
        )),
        false => Ok(()),
    }
}

impl SessionInfo {
    /// Checks the id, the title's length, the model's names, the unmodelled fields and
    /// the per-session overrides.
    pub fn validate(&self) -> Result<(), InvalidField> {
        check_id("id", &self.id)?;
        if self.title.len() > MAX_TITLE_BYTES {
            return Err(invalid(
                "title",
                format!(
                    "{} bytes long; titles are at most {MAX_TITLE_BYTES} bytes",
                    self.title.len()
                ),
            ));
        }
        if let Some(m) = &self.model {
            for (field, name) in [
                ("model.provider_id", &m.provider_id),
                ("model.model_id", &m.model_id),
            ] {
                crate::config::model_name("model", name).map_err(|e| invalid(field, e.message))?;
            }
        }
        check_extra("extra", &self.extra)?;
        self.limits.validate()?;
        self.config
            .validate()
            .map_err(|e| invalid(format!("config.{}", e.key), e.message))
    }
}

impl ModelLimits {
    /// Refuses a window with no input left once the output is reserved (`context` at or
    /// under min(`output`, 32000), 32000 when `output` is 0, with no `input`): every count
    /// would be over the threshold, and every finished message would ask for a compaction
    /// that cannot help. `context` 0 is no window (never overflows) and passes.
    pub fn validate(&self) -> Result<(), InvalidField> {
        if self.context == 0 || self.usable_input() > 0 {
            return Ok(());
        }
        let field = if self.output == 0 {
            "limits.context"
        } else {
            "limits.output"
        };
        Err(invalid(
            field,
            format!(
                "a context of {} tokens leaves no input once {} are reserved for the answer \
                 (limits.output {}; {} when 0): give limits.output as the most the model \
                 answers, or limits.input",
                self.context,
                self.max_output(),
                self.output,
                crate::config::OUTPUT_TOKEN_MAX
            ),
        ))
    }
}

impl MessageInfo {
    /// Checks the ids and the JSON the message carries.
    pub fn validate(&self) -> Result<(), InvalidField> {
        check_id("id", &self.id)?;
        check_optional_id("parent_id", &self.parent_id)?;
        if let Some(e) = &self.error {
            check_json("error.data", &e.data)?;
        }
        check_extra("extra", &self.extra)
    }
}

impl Part {
    /// Checks the ids (a tool call must have its call id) and the JSON the part carries.
    pub fn validate(&self) -> Result<(), InvalidField> {
        check_id("id", &self.id)?;
        check_id("message_id", &self.message_id)?;
        match &self.kind {
            PartKind::Text(t) => check_opt_json("text.metadata", &t.metadata)?,
            PartKind::Reasoning(r) => check_opt_json("reasoning.metadata", &r.metadata)?,
            PartKind::Tool(t) => {
                if t.tool.is_empty() {
                    return Err(invalid("tool.tool", "required: the tool name"));
                }
                // A name, not a payload: copied into every report, mark and placeholder
                // that names the call (a dry-run prune lists it once per output).
                if t.tool.len() > MAX_ID_BYTES {
                    return Err(invalid(
                        "tool.tool",
                        format!(
                            "{} bytes long; tool names are at most {MAX_ID_BYTES} bytes",
                            t.tool.len()
                        ),
                    ));
                }
                // The id of the call in the provider's `tool_calls` and in placeholders.
                check_id("tool.call_id", &t.call_id)?;
                check_json("tool.state.input", &t.state.input)?;
                check_opt_json("tool.state.metadata", &t.state.metadata)?;
                check_opt_json("tool.metadata", &t.metadata)?;
                for (i, f) in t.state.attachments.iter().enumerate() {
                    check_opt_json(&format!("tool.state.attachments[{i}].source"), &f.source)?;
                }
            }
            PartKind::File(f) => check_opt_json("file.source", &f.source)?,
            PartKind::Agent(a) => check_opt_json("agent.source", &a.source)?,
            PartKind::Retry(r) => check_opt_json("retry.error", &r.error)?,
            PartKind::StepStart { .. }
            | PartKind::StepFinish(_)
            | PartKind::Snapshot { .. }
            | PartKind::Patch(_)
            | PartKind::Subtask(_)
            | PartKind::Compaction(_) => {}
        }
        check_extra("extra", &self.extra)
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::domain::{ToolPart, ToolState, ToolStatus};

    fn nested(depth: usize) -> Value {
        (0..depth).fold(json!(1), |inner, _| json!({ "a": inner }))
    }

    fn tool(call_id: &str, input: Value) -> Part {
        let mut state = ToolState::new(ToolStatus::Completed);
        state.input = input;
        Part {
            id: "p".into(),
            message_id: "m".into(),
            kind: PartKind::Tool(Box::new(ToolPart {
                call_id: call_id.into(),
                tool: "read".into(),
                state,
                metadata: None,
            })),
            mark: None,
            extra: Extra::new(),
        }
    }

    #[test]
    fn depth_counts_containers() {
        assert!(!depth_over(&json!(1), 0));
        assert!(depth_over(&json!({}), 0));
        assert!(!depth_over(&json!({}), 1));
        assert!(!depth_over(&nested(5), 5));
        assert!(depth_over(&nested(6), 5));
        assert!(depth_over(&json!([[[]]]), 2));
    }

    #[test]
    fn tool_input_at_the_limit_passes_and_one_deeper_is_refused() {
        assert_eq!(tool("c", nested(MAX_JSON_DEPTH)).validate(), Ok(()));
        let err = tool("c", nested(MAX_JSON_DEPTH + 1))
            .validate()
            .expect_err("too deep");
        assert_eq!(err.field, "tool.state.input");
    }

    #[test]
    fn a_tool_call_needs_a_bounded_call_id() {
        assert_eq!(
            tool("", json!({})).validate().map_err(|e| e.field),
            Err("tool.call_id".to_string())
        );
        let long = "c".repeat(MAX_ID_BYTES + 1);
        let err = tool(&long, json!({})).validate().expect_err("too long");
        assert!(err.message.contains("257 bytes"), "{err}");
        assert_eq!(
            tool(&"c".repeat(MAX_ID_BYTES), json!({})).validate(),
            Ok(())
        );
    }

    #[test]
    fn an_imported_title_is_clipped_to_the_bound() {
        assert_eq!(clip_title("short".into()), "short");
        let clipped = clip_title("é".repeat(MAX_TITLE_BYTES));
        assert!(
            clipped.len() <= MAX_TITLE_BYTES && clipped.ends_with("é…"),
            "{clipped}"
        );
    }

    #[test]
    fn a_session_title_is_bounded() {
        let mut info = SessionInfo {
            id: "s".into(),
            title: "t".repeat(MAX_TITLE_BYTES),
            ..Default::default()
        };
        assert_eq!(info.validate(), Ok(()));
        info.title.push('t');
        let err = info.validate().expect_err("too long");
        assert_eq!(err.field, "title");
        assert!(err.message.contains("1025 bytes"), "{err}");
    }

    #[test]
    fn a_tool_name_is_bounded_like_an_id() {
        let mut part = tool("c1", json!({}));
        if let PartKind::Tool(t) = &mut part.kind {
            t.tool = "t".repeat(MAX_ID_BYTES);
        }
        assert_eq!(part.validate(), Ok(()));
        if let PartKind::Tool(t) = &mut part.kind {
            t.tool.push('t');
        }
        let err = part.validate().expect_err("too long");
        assert_eq!(err.field, "tool.tool");
        assert!(err.message.contains("257 bytes"), "{err}");
    }

    #[test]
    fn extra_maps_count_their_own_level() {
        let mut m = MessageInfo::new("m", crate::domain::Role::User);
        m.extra.insert("k".into(), nested(MAX_JSON_DEPTH - 1));
        assert_eq!(m.validate(), Ok(()));
        m.extra.insert("k".into(), nested(MAX_JSON_DEPTH));
        assert_eq!(m.validate().map_err(|e| e.field), Err("extra".to_string()));
    }

    #[test]
    fn limits_must_leave_input_once_the_answer_is_reserved() {
        let l = |context, input, output| ModelLimits {
            context,
            input,
            output,
        };
        let field = |l: ModelLimits| l.validate().map_err(|e| e.field);
        assert_eq!(field(l(32_000, 0, 0)), Err("limits.context".into()));
        assert_eq!(field(l(32_001, 0, 0)), Ok(()), "one token of input");
        assert_eq!(field(l(8_192, 0, 8_192)), Err("limits.output".into()));
        assert_eq!(field(l(8_192, 0, 8_191)), Ok(()));
        assert_eq!(
            field(l(8_192, 4_096, 8_192)),
            Ok(()),
            "input is the usable window"
        );
        assert_eq!(field(l(0, 0, 0)), Ok(()), "no window");
        assert_eq!(field(l(0, 0, u64::MAX)), Ok(()));
        let info = SessionInfo {
            id: "s".into(),
            limits: l(100, 0, 0),
            ..SessionInfo::default()
        };
        assert_eq!(
            info.validate().map_err(|e| e.field),
            Err("limits.context".into())
        );
    }
}
