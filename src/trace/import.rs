//! `opencode export` JSON → domain types.
//!
//! The document is `{"info": Session.Info, "messages": [{"info": Message, "parts": [..]}],
//! "todos"?: [..]}` (field list in `tests/data/traces/README.md`). Each object is taken apart
//! field by field: known fields are typed, every other field is kept in `extra`, so a newer
//! OpenCode build's additions survive a round trip instead of being rejected. These nested
//! values keep what is left of them under their own key: a `time`'s unknown keys (or a
//! `time` that is not an object), the entries of `files` and `attachments` that are not of
//! their type, a `model` that is not an object (or its unknown keys). The document's own
//! fields beside `info` and `messages` go in the session's `extra`, a message's beside
//! `info` and `parts` in its info's (one its info also has is refused: one would be lost).
//!
//! A user message's `summary` is OpenCode's UI summary object and lands in `extra`; only an
//! assistant's boolean `summary` is the compaction flag.

use std::mem::size_of;

use serde_json::{Map, Value};
use thiserror::Error;

use super::bounded_value::{Bounded, Budget};
use crate::config::shown::clipped;
use crate::domain::HeapSize;
use crate::engine::ByteLimit;

use crate::domain::{
    AgentPart, CompactionPart, Extra, FastSet, FilePart, InvalidField, MessageError, MessageInfo,
    MessageTime, ModelRef, Part, PartKind, PartTime, PatchPart, ReasoningPart, RetryPart, Role,
    SessionInfo, StepFinishPart, SubtaskPart, TextPart, Todo, TokenUsage, ToolPart, ToolState,
    ToolStatus, ToolTime,
};

/// A parsed export: session info and messages with their parts, in document order.
#[derive(Debug, Clone, PartialEq)]
pub struct Export {
    /// Session info (limits are not in exports; the caller supplies them).
    pub info: SessionInfo,
    /// Messages in order, each with its parts.
    pub messages: Vec<(MessageInfo, Vec<Part>)>,
}

/// Why an export could not be read. `path` names the offending JSON location.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{path}: {message}")]
pub struct ImportError {
    /// JSON path, e.g. `messages[3].parts[1].state.status`.
    pub path: String,
    /// What is wrong.
    pub message: String,
}

fn err(path: &str, message: impl Into<String>) -> ImportError {
    ImportError {
        path: path.to_string(),
        message: message.into(),
    }
}

/// The domain's own rules (ids bounded, call ids present, JSON depth), applied to what an
/// import built exactly as to what a Stream update carries; the error names the JSON path
/// ([`json_field`]).
fn checked(r: Result<(), InvalidField>, path: &str, part: bool) -> Result<(), ImportError> {
    r.map_err(|e| {
        let field = json_field(&e.field, part);
        let at = if field.is_empty() {
            path.to_string()
        } else {
            format!("{path}.{field}")
        };
        err(&at, e.message)
    })
}

/// A domain field name (`tool.call_id`, the protobuf's) as the export spells it: a part's
/// fields sit beside its `type`, not under its kind (`callID`, `state.input`), ids are
/// spelled `…ID`, and `extra` is the object's own unknown fields.
pub(super) fn json_field(field: &str, part: bool) -> String {
    let mut segments: Vec<&str> = field.split('.').collect();
    if part && segments.len() > 1 {
        segments.remove(0);
    }
    segments
        .into_iter()
        .filter(|s| *s != "extra")
        .map(|s| match s.strip_suffix("_id") {
            Some(stem) => {
                let mut camel = String::new();
                for (i, word) in stem.split('_').enumerate() {
                    let mut chars = word.chars();
                    match (i, chars.next()) {
                        (0, Some(c)) => camel.push(c),
                        (_, Some(c)) => camel.push(c.to_ascii_uppercase()),
                        (_, None) => {}
                    }
                    camel.push_str(chars.as_str());
                }
                camel + "ID"
            }
            None => s.to_string(),
        })
        .collect::<Vec<_>>()
        .join(".")
}

/// Parses an export document.
pub fn parse_export(json: &str) -> Result<Export, ImportError> {
    parse_export_limited(json, ByteLimit::NONE, "").map_err(LimitedError::into_import_error)
}

/// Maps an already parsed export document.
pub fn from_value(doc: Value) -> Result<Export, ImportError> {
    from_value_limited(doc, ByteLimit::NONE, "").map_err(LimitedError::into_import_error)
}

/// Why a limited import stopped.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum LimitedError {
    /// The document is not a valid export.
    #[error(transparent)]
    Invalid(#[from] ImportError),
    /// What was built so far already passes the limit.
    #[error(
        "{path}: the import would hold over {bytes} bytes, past the {} limit of {} bytes; import fewer messages or raise the limit",
        limit.name,
        limit.value
    )]
    TooLarge {
        /// Where the document passed the limit (`messages[12]`).
        path: String,
        /// Bytes built when it did.
        bytes: u64,
        /// The limit passed.
        limit: ByteLimit,
    },
}

impl LimitedError {
    /// The error as an [`ImportError`] (for callers without a limit, where it never
    /// passes one).
    fn into_import_error(self) -> ImportError {
        match self {
            LimitedError::Invalid(e) => e,
            LimitedError::TooLarge { ref path, .. } => err(path, self.to_string()),
        }
    }
}

/// Maps an already parsed export document, refusing at the first message that takes what
/// it built past `limit` (the domain values' bytes, a lower bound of the session's).
/// A `session_id` that is not empty is the session's id in place of the document's
/// `info.id`, which is then neither required nor checked: the given id is checked in its
/// place (under `info.id`; a caller that names it otherwise checks it first).
pub fn from_value_limited(
    doc: Value,
    limit: ByteLimit,
    session_id: &str,
) -> Result<Export, LimitedError> {
    let Value::Object(doc) = doc else {
        return Err(err("$", "expected an object with `info` and `messages`").into());
    };
    // Field by field in document order, exactly as the text is read
    // (`parse_export_limited`), so both forms give the same verdict.
    let (mut info, mut todos, mut messages, mut rest) = (None, None, None, Map::new());
    for (key, value) in doc {
        match key.as_str() {
            "info" => match value {
                Value::Object(o) => info = Some(o),
                _ => return Err(err("info", "missing or not an object").into()),
            },
            "todos" => todos = Some(value),
            "messages" => {
                let Value::Array(items) = value else {
                    return Err(not_an_array().into());
                };
                let mut builder = Builder::new(limit);
                for m in items {
                    builder.message(m)?;
                }
                messages = Some(builder);
            }
            _ => {
                rest.insert(key, value);
            }
        }
    }
    finish(info, todos, messages, rest, session_id)
}

/// The refusal of a document whose JSON at `path` took what is read past `limit`.
fn past(path: &str, limit: ByteLimit) -> LimitedError {
    LimitedError::TooLarge {
        path: path.to_string(),
        bytes: limit.bytes.saturating_add(1),
        limit,
    }
}

/// The refusal of a `messages` that is not an array.
fn not_an_array() -> ImportError {
    err("messages", "missing or not an array")
}

/// The export from its top-level fields, once the document is read (`session_id`, when
/// not empty, in place of the document's own id).
fn finish(
    info: Option<Map<String, Value>>,
    todos: Option<Value>,
    messages: Option<Builder>,
    rest: Map<String, Value>,
    session_id: &str,
) -> Result<Export, LimitedError> {
    let Some(info) = info else {
        return Err(err("info", "missing or not an object").into());
    };
    let Some(builder) = messages else {
        return Err(not_an_array().into());
    };
    builder.finish(info, todos, rest, session_id)
}

/// Parses an export document as it is read, refusing at the first message that takes
/// what it built past `limit`: neither the whole JSON tree nor an over-limit session is
/// ever built. Only one message's JSON tree is held at a time. A `session_id` that is not
/// empty stands in for the document's `info.id`, as in [`from_value_limited`].
pub fn parse_export_limited(
    json: &str,
    limit: ByteLimit,
    session_id: &str,
) -> Result<Export, LimitedError> {
    let stop = std::cell::RefCell::new(None);
    let budget = Budget::new(limit.bytes);
    let mut de = serde_json::Deserializer::from_str(json);
    let visitor = DocVisitor {
        limit,
        stop: &stop,
        budget: &budget,
    };
    let parsed = serde::de::Deserializer::deserialize_map(&mut de, visitor)
        .and_then(|doc| de.end().map(|()| doc));
    if let Some(e) = stop.into_inner() {
        return Err(e);
    }
    let (info, todos, messages, rest) =
        parsed.map_err(|e| LimitedError::from(err("$", format!("not JSON: {e}"))))?;
    finish(info, todos, messages, rest, session_id)
}

/// The top-level fields of a document being read: `info`, `todos`, the messages (already
/// converted) and every other field.
type Doc = (
    Option<Map<String, Value>>,
    Option<Value>,
    Option<Builder>,
    Map<String, Value>,
);

/// Reads the top-level object field by field.
struct DocVisitor<'a> {
    limit: ByteLimit,
    /// The typed error that stopped the parse (serde's own error type carries text only).
    stop: &'a std::cell::RefCell<Option<LimitedError>>,
    /// What the document may still build: the limit less the top-level fields' values
    /// read so far and the messages built.
    budget: &'a Budget,
}

impl<'de> serde::de::Visitor<'de> for DocVisitor<'_> {
    type Value = Doc;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("an object with `info` and `messages`")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Doc, A::Error> {
        let (mut info, mut todos, mut messages, mut rest) = (None, None, None, Map::new());
        while let Some(key) = map.next_key::<String>()? {
            // A field given twice: JSON parsers keep one of the two (serde_json the last),
            // so part of the document would be dropped without a word.
            let twice = match key.as_str() {
                "info" => info.is_some(),
                "todos" => todos.is_some(),
                "messages" => messages.is_some(),
                other => rest.contains_key(other),
            };
            if twice {
                return Err(self.fail(err(&clipped(&key), "given twice in the document").into()));
            }
            match key.as_str() {
                "info" => match self.value(&mut map, "info")? {
                    Value::Object(o) => info = Some(o),
                    _ => return Err(self.fail(err("info", "missing or not an object").into())),
                },
                "todos" => todos = Some(self.value(&mut map, "todos")?),
                "messages" => {
                    let entered = std::cell::Cell::new(false);
                    let seed = MessagesSeed {
                        limit: self.limit,
                        stop: self.stop,
                        entered: &entered,
                        budget: self.budget,
                    };
                    match map.next_value_seed(seed) {
                        Ok(builder) => messages = Some(builder),
                        // Not an array (not a syntax error inside one).
                        Err(_) if !entered.get() && self.stop.borrow().is_none() => {
                            return Err(self.fail(not_an_array().into()));
                        }
                        Err(e) => return Err(e),
                    }
                }
                _ => {
                    let value = self.value(&mut map, &key)?;
                    rest.insert(key, value);
                }
            }
        }
        Ok((info, todos, messages, rest))
    }
}

impl DocVisitor<'_> {
    /// The value of the top-level field `key`, read within the budget (it is held until
    /// the document is read).
    fn value<'de, A: serde::de::MapAccess<'de>>(
        &self,
        map: &mut A,
        key: &str,
    ) -> Result<Value, A::Error> {
        map.next_value_seed(Bounded(self.budget)).map_err(|e| {
            if self.budget.passed() {
                self.fail(past(&clipped(key), self.limit))
            } else {
                e
            }
        })
    }

    /// Keeps the typed error and stops serde with a placeholder.
    fn fail<E: serde::de::Error>(&self, e: LimitedError) -> E {
        *self.stop.borrow_mut() = Some(e);
        E::custom("import stopped")
    }
}

/// Reads the `messages` array one element at a time into a [`Builder`].
struct MessagesSeed<'a> {
    limit: ByteLimit,
    stop: &'a std::cell::RefCell<Option<LimitedError>>,
    /// Set once the value turned out to be an array.
    entered: &'a std::cell::Cell<bool>,
    /// The document's budget: each message's JSON is read within what the top-level
    /// fields read before `messages` left of the limit (what is built is checked against
    /// the limit apart).
    budget: &'a Budget,
}

impl<'de> serde::de::DeserializeSeed<'de> for MessagesSeed<'_> {
    type Value = Builder;

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Builder, D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> serde::de::Visitor<'de> for MessagesSeed<'_> {
    type Value = Builder;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("an array of messages")
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Builder, A::Error> {
        self.entered.set(true);
        let mut builder = Builder::new(self.limit);
        loop {
            // One message's JSON is held at a time, beside what was built: at most what the
            // top-level fields left of the limit (so the parse holds at most twice the
            // limit, and a message whose JSON fits the limit gets the verdict its built form
            // gets, as in `from_value_limited`).
            let room = Budget::new(self.budget.left());
            let m = match seq.next_element_seed(Bounded(&room)) {
                Ok(Some(m)) => m,
                Ok(None) => break,
                Err(e) if room.passed() => {
                    let at = format!("messages[{}]", builder.messages.len());
                    *self.stop.borrow_mut() = Some(past(&at, self.limit));
                    return Err(e);
                }
                Err(e) => return Err(e),
            };
            if let Err(e) = builder.message(m) {
                *self.stop.borrow_mut() = Some(e);
                return Err(serde::de::Error::custom("import stopped"));
            }
        }
        // Fields after `messages` are read within what the fields before it left, whatever
        // the messages built: what is built is checked apart, with what the fields
        // become, once the document is read.
        Ok(builder)
    }
}

/// Messages converted so far, and the bytes they hold against the limit.
#[derive(Debug)]
struct Builder {
    limit: ByteLimit,
    bytes: u64,
    messages: Vec<(MessageInfo, Vec<Part>)>,
    /// Ids taken so far: a second message or part with one would be merged into the
    /// first when loaded (the history reordered, a part replaced).
    ids: FastSet<(String, String)>,
}

impl Builder {
    fn new(limit: ByteLimit) -> Builder {
        Builder {
            limit,
            bytes: 0,
            messages: Vec::new(),
            ids: FastSet::default(),
        }
    }

    /// Converts and checks the next message; refuses once the total passes the limit.
    fn message(&mut self, m: Value) -> Result<(), LimitedError> {
        let i = self.messages.len();
        let (minfo, parts) = message(m, i)?;
        // One set: a message as (id, ""), a part as (message id, part id), part ids being
        // never empty; its entries count against the limit below.
        if !self.ids.insert((minfo.id.clone(), String::new())) {
            return Err(err(
                &format!("messages[{i}].info.id"),
                "an earlier message has this id",
            )
            .into());
        }
        // A part id is unique within its message (the engine keys parts per message).
        for (j, p) in parts.iter().enumerate() {
            if !self.ids.insert((minfo.id.clone(), p.id.clone())) {
                return Err(err(
                    &format!("messages[{i}].parts[{j}].id"),
                    "an earlier part has this id",
                )
                .into());
            }
        }
        // Each entry of the set: a pair of strings and their bytes.
        let entry = 2 * size_of::<String>();
        let ids: usize = parts
            .iter()
            .map(|p| entry + p.id.len() + minfo.id.len())
            .sum::<usize>()
            + entry
            + minfo.id.len();
        let own =
            size_of::<(MessageInfo, Vec<Part>)>() + minfo.heap_bytes() + parts.heap_bytes() + ids;
        self.bytes = self
            .bytes
            .saturating_add(u64::try_from(own).unwrap_or(u64::MAX));
        if self.bytes > self.limit.bytes {
            return Err(LimitedError::TooLarge {
                path: format!("messages[{i}]"),
                bytes: self.bytes,
                limit: self.limit,
            });
        }
        self.messages.push((minfo, parts));
        Ok(())
    }

    fn finish(
        self,
        info: Map<String, Value>,
        todos: Option<Value>,
        rest: Map<String, Value>,
        session_id: &str,
    ) -> Result<Export, LimitedError> {
        let mut info = session_info(info, session_id)?;
        if let Some(todos) = todos {
            info.todos = todo_list(todos, "todos")?;
        }
        info.extra.extend(rest);
        // What the session itself holds (its todos above all) counts with its messages.
        let bytes = self
            .bytes
            .saturating_add(u64::try_from(info.heap_bytes()).unwrap_or(u64::MAX));
        if bytes > self.limit.bytes {
            return Err(LimitedError::TooLarge {
                path: "info".into(),
                bytes,
                limit: self.limit,
            });
        }
        // The domain's own rules on what the session itself carries (its unknown fields'
        // depth above all), as for a Stream `open`.
        checked(info.validate(), "info", false)?;
        Ok(Export {
            info,
            messages: self.messages,
        })
    }
}

/// One element of `messages`: its info and parts, each checked by the domain's rules.
fn message(m: Value, i: usize) -> Result<(MessageInfo, Vec<Part>), ImportError> {
    let path = format!("messages[{i}]");
    let Value::Object(mut m) = m else {
        return Err(err(&path, "not an object"));
    };
    let Some(Value::Object(minfo)) = m.remove("info") else {
        return Err(err(&format!("{path}.info"), "missing or not an object"));
    };
    let mut minfo = message_info(minfo, &format!("{path}.info"))?;
    let parts = m.remove("parts");
    // The message's own fields beside `info` and `parts` are kept in its info's `extra`
    // (as the document's own fields are in the session's), never over one of the info's.
    for (key, value) in m {
        if minfo.extra.contains_key(&key) {
            return Err(err(
                &format!("{path}.{}", clipped(&key)),
                "also a field of the message's info, unknown to the import: one of the two would be lost",
            ));
        }
        minfo.extra.insert(key, value);
    }
    checked(minfo.validate(), &format!("{path}.info"), false)?;
    let parts = match parts {
        Some(Value::Array(a)) => a,
        None => Vec::new(),
        Some(_) => return Err(err(&format!("{path}.parts"), "not an array")),
    };
    let mut ps = Vec::with_capacity(parts.len());
    for (j, p) in parts.into_iter().enumerate() {
        let ppath = format!("{path}.parts[{j}]");
        let Value::Object(p) = p else {
            return Err(err(&ppath, "not an object"));
        };
        let p = part(p, &minfo.id, &ppath)?;
        checked(p.validate(), &ppath, true)?;
        ps.push(p);
    }
    Ok((minfo, ps))
}

/// The session's info; its id is `session_id` when that is not empty (the document's own
/// then neither required nor kept), else the document's `info.id`.
fn session_info(mut o: Map<String, Value>, session_id: &str) -> Result<SessionInfo, ImportError> {
    let own = string(&mut o, "id");
    let id = match session_id {
        "" if own.is_empty() => return Err(err("info.id", "missing")),
        "" => own,
        given => given.to_string(),
    };
    // A label another tool let grow is clipped rather than the document refused.
    let title = crate::domain::clip_title(string(&mut o, "title"));
    Ok(SessionInfo {
        id,
        title,
        extra: compact(o),
        ..SessionInfo::default()
    })
}

fn todo_list(v: Value, path: &str) -> Result<Vec<Todo>, ImportError> {
    let Value::Array(items) = v else {
        return Err(err(path, "not an array"));
    };
    Ok(items
        .into_iter()
        .map(|t| {
            let mut o = match t {
                Value::Object(o) => o,
                _ => Map::new(),
            };
            Todo {
                id: string(&mut o, "id"),
                content: string(&mut o, "content"),
                status: string(&mut o, "status"),
                priority: string(&mut o, "priority"),
            }
        })
        .collect())
}

fn message_info(mut o: Map<String, Value>, path: &str) -> Result<MessageInfo, ImportError> {
    let id = string(&mut o, "id");
    if id.is_empty() {
        return Err(err(&format!("{path}.id"), "missing"));
    }
    let role_s = string(&mut o, "role");
    let role = Role::parse(&role_s).ok_or_else(|| {
        err(
            &format!("{path}.role"),
            format!("unknown role {:?} (user|assistant)", clipped(&role_s)),
        )
    })?;
    let mut info = MessageInfo::new(id, role);
    info.parent_id = string(&mut o, "parentID");
    if let Some(time) = object_at(&mut o, "time", |t| MessageTime {
        created: int(t, "created"),
        completed: opt_int(t, "completed"),
    }) {
        info.time = time;
    }
    match o.remove("summary") {
        Some(Value::Bool(b)) => info.summary = b,
        Some(other) => {
            o.insert("summary".into(), other);
        }
        None => {}
    }
    info.mode = string(&mut o, "mode");
    info.agent = string(&mut o, "agent");
    info.finish = string(&mut o, "finish");
    info.tokens = usage_at(&mut o, path)?;
    info.cost = o.remove("cost").and_then(|v| v.as_f64()).unwrap_or(0.0);
    info.error = match o.remove("error") {
        Some(Value::Object(mut e)) => {
            let name = string(&mut e, "name");
            let data = e.remove("data").unwrap_or(Value::Null);
            Some(MessageError { name, data })
        }
        Some(Value::Null) | None => None,
        Some(other) => Some(MessageError {
            name: "UnknownError".into(),
            data: other,
        }),
    };
    // User messages carry `model {providerID, modelID}`; assistants carry them flat. A
    // `model` that is not an object, or its other keys, are kept in `extra`; without a
    // `model` object the flat fields are read.
    info.model = match object_at(&mut o, "model", |m| ModelRef {
        provider_id: string(m, "providerID"),
        model_id: string(m, "modelID"),
    }) {
        Some(model) => Some(model),
        None => {
            let provider_id = string(&mut o, "providerID");
            let model_id = string(&mut o, "modelID");
            (!provider_id.is_empty() || !model_id.is_empty()).then_some(ModelRef {
                provider_id,
                model_id,
            })
        }
    };
    o.remove("sessionID");
    info.extra = compact(o);
    Ok(info)
}

/// The usage report under `tokens` of the object at `path`: absent or null is none; any
/// other non-object is refused (dropped, the report would be lost without a word, and
/// with it what the session's overflow detection learns from it).
fn usage_at(o: &mut Map<String, Value>, path: &str) -> Result<Option<TokenUsage>, ImportError> {
    match o.remove("tokens") {
        None | Some(Value::Null) => Ok(None),
        Some(v @ Value::Object(_)) => Ok(token_usage(v)),
        Some(_) => Err(err(&format!("{path}.tokens"), "not an object")),
    }
}

fn token_usage(v: Value) -> Option<TokenUsage> {
    let Value::Object(mut t) = v else { return None };
    let (read, write) = match t.remove("cache") {
        Some(Value::Object(mut c)) => (uint(&mut c, "read"), uint(&mut c, "write")),
        _ => (0, 0),
    };
    let total = t
        .remove("total")
        .and_then(|v| v.as_f64())
        .map(|f| f.max(0.0) as u64);
    let (input, output, reasoning) = (
        uint(&mut t, "input"),
        uint(&mut t, "output"),
        uint(&mut t, "reasoning"),
    );
    // compactd counts reasoning within the output. OpenCode 1.18 writes the output less
    // the reasoning, with the provider's total (reasoning within): a total that holds
    // both says so. OpenCode 1.2's total holds input, cache and output only.
    let apart = reasoning > 0
        && total.is_some_and(|total| {
            [input, read, write, output, reasoning]
                .into_iter()
                .try_fold(0u64, u64::checked_add)
                .is_some_and(|sum| total >= sum)
        });
    Some(TokenUsage {
        total,
        input,
        output: if apart {
            output.saturating_add(reasoning)
        } else {
            output
        },
        reasoning,
        cache_read: read,
        cache_write: write,
    })
}

fn part(mut o: Map<String, Value>, message_id: &str, path: &str) -> Result<Part, ImportError> {
    let id = string(&mut o, "id");
    if id.is_empty() {
        return Err(err(&format!("{path}.id"), "missing"));
    }
    // A part belongs to the message it is listed under; a `messageID` naming another
    // would file it elsewhere (or nowhere) behind the document's back.
    let mid = string(&mut o, "messageID");
    if !mid.is_empty() && mid != message_id {
        return Err(err(
            &format!("{path}.messageID"),
            format!(
                "names another message than {:?}, which the part is listed under",
                clipped(message_id)
            ),
        ));
    }
    let message_id = message_id.to_string();
    o.remove("sessionID");
    let ty = string(&mut o, "type");
    let kind = match ty.as_str() {
        "text" => PartKind::Text(TextPart {
            text: string(&mut o, "text"),
            synthetic: boolean(&mut o, "synthetic"),
            ignored: boolean(&mut o, "ignored"),
            time: part_time(&mut o),
            metadata: o.remove("metadata"),
        }),
        "reasoning" => PartKind::Reasoning(ReasoningPart {
            text: string(&mut o, "text"),
            time: part_time(&mut o),
            metadata: o.remove("metadata"),
        }),
        "tool" => PartKind::Tool(Box::new(tool_part(&mut o, path)?)),
        "step-start" => PartKind::StepStart {
            snapshot: string(&mut o, "snapshot"),
        },
        "step-finish" => PartKind::StepFinish(StepFinishPart {
            reason: string(&mut o, "reason"),
            snapshot: string(&mut o, "snapshot"),
            cost: o.remove("cost").and_then(|v| v.as_f64()).unwrap_or(0.0),
            tokens: usage_at(&mut o, path)?,
        }),
        "file" => PartKind::File(file_part(&mut o)),
        "snapshot" => PartKind::Snapshot {
            snapshot: string(&mut o, "snapshot"),
        },
        "patch" => PartKind::Patch(PatchPart {
            hash: string(&mut o, "hash"),
            files: entries_at(&mut o, "files", |v| match v {
                Value::String(s) => Ok(s),
                other => Err(other),
            }),
        }),
        "agent" => PartKind::Agent(AgentPart {
            name: string(&mut o, "name"),
            source: o.remove("source"),
        }),
        "subtask" => PartKind::Subtask(SubtaskPart {
            prompt: string(&mut o, "prompt"),
            description: string(&mut o, "description"),
            agent: string(&mut o, "agent"),
            model: match o.remove("model") {
                Some(Value::Object(mut m)) => Some(ModelRef {
                    provider_id: string(&mut m, "providerID"),
                    model_id: string(&mut m, "modelID"),
                }),
                _ => None,
            },
            command: string(&mut o, "command"),
        }),
        "retry" => PartKind::Retry(RetryPart {
            // Held within its type, as every number here is (not cut to its low bits).
            attempt: u32::try_from(uint(&mut o, "attempt")).unwrap_or(u32::MAX),
            error: o.remove("error"),
            created: object_at(&mut o, "time", |t| int(t, "created")).unwrap_or(0),
        }),
        "compaction" => PartKind::Compaction(CompactionPart {
            auto: boolean(&mut o, "auto"),
            overflow: boolean(&mut o, "overflow"),
            tail_start_id: string(&mut o, "tail_start_id"),
        }),
        other => {
            return Err(err(
                &format!("{path}.type"),
                format!("unknown part type {:?}", clipped(other)),
            ));
        }
    };
    Ok(Part {
        id,
        message_id,
        kind,
        mark: None,
        extra: compact(o),
    })
}

/// The fields left after the known ones were taken out, in a map of their own size (the
/// parsed object keeps the capacity of every field it had).
fn compact(o: Extra) -> Extra {
    if o.is_empty() {
        Extra::new()
    } else {
        o.into_iter().collect()
    }
}

fn tool_part(o: &mut Map<String, Value>, path: &str) -> Result<ToolPart, ImportError> {
    let call_id = string(o, "callID");
    let tool = string(o, "tool");
    let Some(Value::Object(mut st)) = o.remove("state") else {
        return Err(err(&format!("{path}.state"), "missing or not an object"));
    };
    let status_s = string(&mut st, "status");
    let status = ToolStatus::parse(&status_s).ok_or_else(|| {
        err(
            &format!("{path}.state.status"),
            format!(
                "unknown status {:?} (pending|running|completed|error)",
                clipped(&status_s)
            ),
        )
    })?;
    let mut state = ToolState::new(status);
    if let Some(input) = st.remove("input") {
        state.input = input;
    }
    state.output = string(&mut st, "output");
    state.error = string(&mut st, "error");
    state.title = string(&mut st, "title");
    state.raw = string(&mut st, "raw");
    state.metadata = st.remove("metadata");
    if let Some(time) = object_at(&mut st, "time", |t| ToolTime {
        start: int(t, "start"),
        end: opt_int(t, "end"),
        compacted: opt_int(t, "compacted"),
    }) {
        state.time = time;
    }
    state.attachments = entries_at(&mut st, "attachments", |v| match v {
        Value::Object(mut f) => Ok(file_part(&mut f)),
        other => Err(other),
    });
    if !st.is_empty() {
        o.insert("state".into(), Value::Object(st));
    }
    Ok(ToolPart {
        call_id,
        tool,
        state,
        metadata: o.remove("metadata"),
    })
}

fn file_part(o: &mut Map<String, Value>) -> FilePart {
    FilePart {
        mime: string(o, "mime"),
        filename: string(o, "filename"),
        url: string(o, "url"),
        source: o.remove("source"),
        size: uint(o, "size"),
    }
}

fn part_time(o: &mut Map<String, Value>) -> Option<PartTime> {
    object_at(o, "time", |t| PartTime {
        start: int(t, "start"),
        end: opt_int(t, "end"),
    })
}

/// The object under `key`, read by `read` (which takes the fields it knows out of it);
/// `None` when there is none or it is not an object. What `read` leaves, or a value that
/// is not an object, goes back under `key`, so it is kept in `extra`.
fn object_at<T>(o: &mut Extra, key: &str, read: impl FnOnce(&mut Extra) -> T) -> Option<T> {
    match o.remove(key)? {
        Value::Object(mut fields) => {
            let typed = read(&mut fields);
            if !fields.is_empty() {
                o.insert(key.to_string(), Value::Object(fields));
            }
            Some(typed)
        }
        other => {
            o.insert(key.to_string(), other);
            None
        }
    }
}

/// The entries of the array under `key` that `read` takes (`Err` hands an entry back);
/// the others, in order, or a value that is not an array, go back under `key`, so they
/// are kept in `extra`.
fn entries_at<T>(
    o: &mut Extra,
    key: &str,
    mut read: impl FnMut(Value) -> Result<T, Value>,
) -> Vec<T> {
    let entries = match o.remove(key) {
        Some(Value::Array(entries)) => entries,
        Some(other) => {
            o.insert(key.to_string(), other);
            return Vec::new();
        }
        None => return Vec::new(),
    };
    let mut typed = Vec::with_capacity(entries.len());
    let mut rest = Vec::new();
    for entry in entries {
        match read(entry) {
            Ok(t) => typed.push(t),
            Err(other) => rest.push(other),
        }
    }
    if !rest.is_empty() {
        o.insert(key.to_string(), Value::Array(rest));
    }
    typed
}

fn string(o: &mut Extra, key: &str) -> String {
    match o.remove(key) {
        Some(Value::String(s)) => s,
        Some(Value::Null) | None => String::new(),
        Some(other) => other.to_string(),
    }
}

fn boolean(o: &mut Extra, key: &str) -> bool {
    matches!(o.remove(key), Some(Value::Bool(true)))
}

fn uint(o: &mut Extra, key: &str) -> u64 {
    o.remove(key)
        .and_then(|v| v.as_f64())
        .map_or(0, |f| f.max(0.0) as u64)
}

fn int(o: &mut Extra, key: &str) -> i64 {
    opt_int(o, key).unwrap_or(0)
}

fn opt_int(o: &mut Extra, key: &str) -> Option<i64> {
    o.remove(key).and_then(|v| v.as_f64()).map(|f| f as i64)
}

#[cfg(test)]
#[path = "import_tests.rs"]
mod tests;
