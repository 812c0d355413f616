//! Protobuf ↔ domain conversion.
//!
//! `*_from_pb` functions refuse what does not convert (an unknown enum value, a missing
//! oneof) and then run the domain's and the config's own `validate()` (the one home of
//! every rule), returning a [`Rejection`] naming the field (relative to the message
//! converted; callers prefix it). `*_to_pb` functions are total. JSON travels as `google.protobuf.Struct`; numbers become doubles,
//! as in protobuf's own JSON mapping.

use std::collections::BTreeMap;

use prost_types::value::Kind;
use serde_json::{Map, Number, Value};

use super::pb;
use super::status::Rejection;
use crate::config::shown::clipped;
use crate::config::{
    CacheCounting, CacheModel, InvalidSetting, OverflowPreset, SessionOverrides, Strategy,
    StrategyPreset, compaction_text_given,
};
use crate::domain::{
    AgentPart, CompactionPart, FilePart, InvalidField, MessageError, MessageInfo, MessageTime,
    ModelLimits, ModelRef, Part, PartKind, PartTime, PatchPart, ReasoningPart, RetryPart, Role,
    SessionInfo, StepFinishPart, SubtaskPart, TextPart, Todo, TokenUsage, ToolPart, ToolState,
    ToolStatus, ToolTime,
};
use crate::engine::{
    Crossed, Message, OverflowCheck, PruneReport, Reading, Recalled, RecalledContent, Session,
    StoredPart,
};
use crate::tokens::Tokenizer;

impl From<InvalidField> for Rejection {
    fn from(e: InvalidField) -> Self {
        Rejection::invalid(e.field, e.message)
    }
}

impl From<InvalidSetting> for Rejection {
    fn from(e: InvalidSetting) -> Self {
        Rejection::invalid(e.key, e.message)
    }
}

// ---- JSON ↔ Struct ----

/// `google.protobuf.Value` → JSON.
pub fn value_from_pb(v: prost_types::Value) -> Value {
    match v.kind {
        None | Some(Kind::NullValue(_)) => Value::Null,
        Some(Kind::BoolValue(b)) => Value::Bool(b),
        Some(Kind::NumberValue(n)) => number(n),
        Some(Kind::StringValue(s)) => Value::String(s),
        Some(Kind::StructValue(s)) => Value::Object(struct_from_pb(s)),
        Some(Kind::ListValue(l)) => Value::Array(l.values.into_iter().map(value_from_pb).collect()),
    }
}

/// Whole doubles become JSON integers, so `{"limit": 10}` round-trips as written.
fn number(n: f64) -> Value {
    if n.fract() == 0.0 && n.abs() < 9.0e15 {
        Value::Number(Number::from(n as i64))
    } else {
        Number::from_f64(n).map_or(Value::Null, Value::Number)
    }
}

/// `google.protobuf.Struct` → JSON object.
pub fn struct_from_pb(s: prost_types::Struct) -> Map<String, Value> {
    s.fields
        .into_iter()
        .map(|(k, v)| (k, value_from_pb(v)))
        .collect()
}

/// JSON → `google.protobuf.Value`.
pub fn value_to_pb(v: &Value) -> prost_types::Value {
    let kind = match v {
        Value::String(s) => Kind::StringValue(s.clone()),
        Value::Array(a) => Kind::ListValue(prost_types::ListValue {
            values: a.iter().map(value_to_pb).collect(),
        }),
        Value::Object(o) => Kind::StructValue(struct_to_pb(o)),
        scalar => scalar_to_pb(scalar),
    };
    prost_types::Value { kind: Some(kind) }
}

/// A JSON scalar's kind (null, bool, number; anything else reads as null).
fn scalar_to_pb(v: &Value) -> Kind {
    match v {
        Value::Bool(b) => Kind::BoolValue(*b),
        Value::Number(n) => Kind::NumberValue(n.as_f64().unwrap_or(0.0)),
        _ => Kind::NullValue(0),
    }
}

/// JSON object → `google.protobuf.Struct`.
pub fn struct_to_pb(o: &Map<String, Value>) -> prost_types::Struct {
    prost_types::Struct {
        fields: o
            .iter()
            .map(|(k, v)| (k.clone(), value_to_pb(v)))
            .collect::<BTreeMap<_, _>>(),
    }
}

/// Any JSON as a Struct: objects as they are, anything else under `"value"`.
fn any_to_struct(v: &Value) -> prost_types::Struct {
    match v {
        Value::Object(o) => struct_to_pb(o),
        other => {
            let mut m = Map::new();
            m.insert("value".into(), other.clone());
            struct_to_pb(&m)
        }
    }
}

fn opt_struct(v: Option<prost_types::Struct>) -> Option<Value> {
    v.map(|s| Value::Object(struct_from_pb(s)))
}

fn opt_struct_to_pb(v: &Option<Value>) -> Option<prost_types::Struct> {
    v.as_ref().map(any_to_struct)
}

fn extra_to_pb(o: &Map<String, Value>) -> Option<prost_types::Struct> {
    (!o.is_empty()).then(|| struct_to_pb(o))
}

// ---- session info ----

/// Session info from the wire. `fallback_id` is used when `info.id` is empty (the stream
/// carries the id beside the update).
pub fn session_from_pb(s: pb::SessionInfo, fallback_id: &str) -> Result<SessionInfo, Rejection> {
    let id = if s.id.is_empty() {
        fallback_id.to_string()
    } else {
        s.id
    };
    if !fallback_id.is_empty() && id != fallback_id {
        return Err(Rejection::invalid(
            "id",
            format!(
                "{:?} differs from the update's session_id {:?}",
                clipped(&id),
                clipped(fallback_id)
            ),
        ));
    }
    let config = match s.config {
        Some(c) => convert_overrides(c).map_err(|r| r.within("config"))?,
        None => SessionOverrides::default(),
    };
    let info = SessionInfo {
        id,
        title: s.title,
        model: s.model.map(model_from_pb),
        limits: s.limits.map(limits_from_pb).unwrap_or_default(),
        config,
        todos: s
            .todos
            .into_iter()
            .map(|t| Todo {
                id: t.id,
                content: t.content,
                status: t.status,
                priority: t.priority,
            })
            .collect(),
        extra: s.extra.map(struct_from_pb).unwrap_or_default(),
    };
    info.validate()?;
    Ok(info)
}

/// Per-session overrides from the wire, validated.
pub fn overrides_from_pb(c: pb::SessionConfig) -> Result<SessionOverrides, Rejection> {
    let o = convert_overrides(c)?;
    o.validate()?;
    Ok(o)
}

/// Per-session overrides from the wire, converted but not yet validated.
fn convert_overrides(c: pb::SessionConfig) -> Result<SessionOverrides, Rejection> {
    let cache_counting = match pb::CacheCounting::try_from(c.cache_counting) {
        Ok(pb::CacheCounting::Unspecified) => None,
        Ok(pb::CacheCounting::Separate) => Some(CacheCounting::Separate),
        Ok(pb::CacheCounting::Included) => Some(CacheCounting::Included),
        Err(_) => {
            return Err(Rejection::invalid(
                "cache_counting",
                format!("unknown value {}", c.cache_counting),
            ));
        }
    };
    let strategy_preset = match c.strategy_preset.trim() {
        "" => None,
        name => Some(
            name.parse::<StrategyPreset>()
                .map_err(|e| Rejection::invalid("strategy_preset", e))?,
        ),
    };
    // Each strategy by one key: the map arrives in no order, so of two spellings of one
    // strategy (`maskObservations`, `mask_observations`) neither may win by chance. Two
    // are refused even with the same value: one rule, and a host's mistake shown.
    let mut strategies: BTreeMap<Strategy, (&str, bool)> = BTreeMap::new();
    for (name, on) in &c.strategies {
        let st = name
            .parse::<Strategy>()
            .map_err(|e| Rejection::invalid("strategies", e.to_string()))?;
        if let Some((other, _)) = strategies.insert(st, (name, *on)) {
            let (a, b) = if other < name.as_str() {
                (other, name.as_str())
            } else {
                (name.as_str(), other)
            };
            return Err(Rejection::invalid(
                "strategies",
                format!(
                    "{:?} and {:?} both name strategy {}; send one key per strategy",
                    clipped(a),
                    clipped(b),
                    st.name()
                ),
            ));
        }
    }
    let strategies = strategies
        .into_iter()
        .map(|(st, (_, on))| (st, on))
        .collect();
    let protected_file_globs = c.protected_file_globs.map(|l| l.values);
    let cache_model = match c.cache_model.trim() {
        "" => None,
        name => Some(
            name.parse::<CacheModel>()
                .map_err(|e| Rejection::invalid("cache_model", e))?,
        ),
    };
    let tokenizer =
        match c.tokenizer.trim() {
            "" => None,
            name => Some(name.parse::<Tokenizer>().map_err(|e| {
                Rejection::invalid("tokenizer", format!("{:?}: {e}", clipped(name)))
            })?),
        };
    let preset = match pb::OverflowPreset::try_from(c.preset) {
        Ok(pb::OverflowPreset::Unspecified) => None,
        Ok(pb::OverflowPreset::Compactd) => Some(OverflowPreset::Compactd),
        Ok(pb::OverflowPreset::Opencode) => Some(OverflowPreset::OpenCode),
        Err(_) => {
            return Err(Rejection::invalid(
                "preset",
                format!("unknown value {}", c.preset),
            ));
        }
    };
    Ok(SessionOverrides {
        preset,
        auto_compact: c.auto_compact,
        prune: c.prune,
        threshold: c.threshold,
        reserved: c.reserved,
        cache_counting,
        prune_protect: c.prune_protect,
        prune_minimum: c.prune_minimum,
        protected_tools: c.protected_tools.map(|l| l.values),
        protect_turns: c.protect_turns,
        compaction_model: c.compaction_model.filter(|m| !m.is_empty()),
        strategy_preset,
        strategies,
        strategy_protected_tools: c.strategy_protected_tools.map(|l| l.values),
        protected_file_globs,
        snapshot_tools: c.snapshot_tools.map(|l| l.values),
        placeholder: c.placeholder,
        auto_continue: c.auto_continue,
        // A blank prompt on the wire means "inherit".
        compaction_system: c.compaction_system.filter(|v| compaction_text_given(v)),
        compaction_prompt: c.compaction_prompt.filter(|v| compaction_text_given(v)),
        compaction_template: c.compaction_template.filter(|v| compaction_text_given(v)),
        mask_keep: c.mask_keep,
        output_cap: c.output_cap,
        cache_model,
        tokenizer,
    })
}

fn overrides_to_pb(o: &SessionOverrides) -> pb::SessionConfig {
    pb::SessionConfig {
        auto_compact: o.auto_compact,
        prune: o.prune,
        threshold: o.threshold,
        reserved: o.reserved,
        cache_counting: match o.cache_counting {
            None => pb::CacheCounting::Unspecified,
            Some(CacheCounting::Separate) => pb::CacheCounting::Separate,
            Some(CacheCounting::Included) => pb::CacheCounting::Included,
        } as i32,
        prune_protect: o.prune_protect,
        prune_minimum: o.prune_minimum,
        protected_tools: o
            .protected_tools
            .clone()
            .map(|values| pb::StringList { values }),
        protect_turns: o.protect_turns,
        compaction_model: o.compaction_model.clone(),
        placeholder: o.placeholder.clone(),
        auto_continue: o.auto_continue.clone(),
        compaction_system: o.compaction_system.clone(),
        compaction_prompt: o.compaction_prompt.clone(),
        compaction_template: o.compaction_template.clone(),
        strategy_preset: match o.strategy_preset {
            None => String::new(),
            Some(StrategyPreset::Compactd) => "compactd".into(),
            Some(StrategyPreset::Compact) => "compact".into(),
            Some(StrategyPreset::Balanced) => "balanced".into(),
            Some(StrategyPreset::Verbose) => "verbose".into(),
        },
        strategies: o
            .strategies
            .iter()
            .map(|(k, v)| (k.name().to_string(), *v))
            .collect(),
        strategy_protected_tools: o
            .strategy_protected_tools
            .clone()
            .map(|values| pb::StringList { values }),
        protected_file_globs: o
            .protected_file_globs
            .clone()
            .map(|values| pb::StringList { values }),
        snapshot_tools: o
            .snapshot_tools
            .clone()
            .map(|values| pb::StringList { values }),
        preset: match o.preset {
            None => pb::OverflowPreset::Unspecified,
            Some(OverflowPreset::Compactd) => pb::OverflowPreset::Compactd,
            Some(OverflowPreset::OpenCode) => pb::OverflowPreset::Opencode,
        } as i32,
        mask_keep: o.mask_keep,
        output_cap: o.output_cap,
        cache_model: o.cache_model.map(|m| m.to_string()).unwrap_or_default(),
        tokenizer: o.tokenizer.map(|t| t.to_string()).unwrap_or_default(),
    }
}

/// Limits from the wire.
pub fn limits_from_pb(l: pb::ModelLimits) -> ModelLimits {
    ModelLimits {
        context: l.context,
        input: l.input,
        output: l.output,
    }
}

fn limits_to_pb(l: &ModelLimits) -> pb::ModelLimits {
    pb::ModelLimits {
        context: l.context,
        input: l.input,
        output: l.output,
    }
}

fn model_from_pb(m: pb::ModelRef) -> ModelRef {
    ModelRef {
        provider_id: m.provider_id,
        model_id: m.model_id,
    }
}

fn model_to_pb(m: &ModelRef) -> pb::ModelRef {
    pb::ModelRef {
        provider_id: m.provider_id.clone(),
        model_id: m.model_id.clone(),
    }
}

/// Session info to the wire.
pub fn session_to_pb(s: &SessionInfo) -> pb::SessionInfo {
    pb::SessionInfo {
        id: s.id.clone(),
        title: s.title.clone(),
        model: s.model.as_ref().map(model_to_pb),
        limits: Some(limits_to_pb(&s.limits)),
        config: Some(overrides_to_pb(&s.config)),
        todos: s
            .todos
            .iter()
            .map(|t| pb::Todo {
                id: t.id.clone(),
                content: t.content.clone(),
                status: t.status.clone(),
                priority: t.priority.clone(),
            })
            .collect(),
        extra: extra_to_pb(&s.extra),
    }
}

// ---- messages ----

/// Message info from the wire.
pub fn message_from_pb(m: pb::MessageInfo) -> Result<MessageInfo, Rejection> {
    let role = Role::parse(&m.role).ok_or_else(|| {
        Rejection::invalid(
            "role",
            format!(
                "unknown role {:?}; expected user or assistant",
                clipped(&m.role)
            ),
        )
    })?;
    let time = m.time.unwrap_or_default();
    let info = MessageInfo {
        id: m.id,
        role,
        parent_id: m.parent_id,
        time: MessageTime {
            created: time.created,
            completed: time.completed,
        },
        summary: m.summary,
        mode: m.mode,
        agent: m.agent,
        finish: m.finish,
        tokens: m.tokens.map(usage_from_pb),
        cost: m.cost,
        error: m.error.map(|e| MessageError {
            name: e.name,
            data: opt_struct(e.data).unwrap_or(Value::Null),
        }),
        model: m.model.map(model_from_pb),
        extra: m.extra.map(struct_from_pb).unwrap_or_default(),
    };
    info.validate()?;
    Ok(info)
}

/// Message info to the wire.
pub fn message_info_to_pb(m: &MessageInfo) -> pb::MessageInfo {
    pb::MessageInfo {
        id: m.id.clone(),
        role: m.role.as_str().to_string(),
        parent_id: m.parent_id.clone(),
        time: Some(pb::MessageTime {
            created: m.time.created,
            completed: m.time.completed,
        }),
        summary: m.summary,
        mode: m.mode.clone(),
        agent: m.agent.clone(),
        finish: m.finish.clone(),
        tokens: m.tokens.as_ref().map(usage_to_pb),
        cost: m.cost,
        error: m.error.as_ref().map(|e| pb::MessageError {
            name: e.name.clone(),
            data: (!e.data.is_null()).then(|| any_to_struct(&e.data)),
        }),
        model: m.model.as_ref().map(model_to_pb),
        extra: extra_to_pb(&m.extra),
    }
}

/// A stored message (info + parts) to the wire.
pub fn message_to_pb(m: &Message) -> pb::Message {
    pb::Message {
        info: Some(message_info_to_pb(&m.info)),
        parts: m.parts.iter().map(|p| part_to_pb(&p.part)).collect(),
    }
}

/// Usage from the wire.
pub fn usage_from_pb(t: pb::TokenUsage) -> TokenUsage {
    let cache = t.cache.unwrap_or_default();
    TokenUsage {
        total: t.total,
        input: t.input,
        output: t.output,
        reasoning: t.reasoning,
        cache_read: cache.read,
        cache_write: cache.write,
    }
}

/// Usage to the wire.
pub fn usage_to_pb(t: &TokenUsage) -> pb::TokenUsage {
    pb::TokenUsage {
        total: t.total,
        input: t.input,
        output: t.output,
        reasoning: t.reasoning,
        cache: Some(pb::CacheTokens {
            read: t.cache_read,
            write: t.cache_write,
        }),
    }
}

// ---- parts ----

/// A part from the wire.
pub fn part_from_pb(p: pb::Part) -> Result<Part, Rejection> {
    use pb::part::Kind as K;
    let Some(kind) = p.kind else {
        return Err(Rejection::invalid(
            "kind",
            "required: one of text, reasoning, tool, step_start, step_finish, file, snapshot, patch, agent, subtask, retry, compaction",
        ));
    };
    let kind = match kind {
        K::Text(t) => PartKind::Text(TextPart {
            text: t.text,
            synthetic: t.synthetic,
            ignored: t.ignored,
            time: t.time.map(time_from_pb),
            metadata: opt_struct(t.metadata),
        }),
        K::Reasoning(r) => PartKind::Reasoning(ReasoningPart {
            text: r.text,
            time: r.time.map(time_from_pb),
            metadata: opt_struct(r.metadata),
        }),
        K::Tool(t) => PartKind::Tool(Box::new(tool_from_pb(t).map_err(|r| r.within("tool"))?)),
        K::StepStart(s) => PartKind::StepStart {
            snapshot: s.snapshot,
        },
        K::StepFinish(s) => PartKind::StepFinish(StepFinishPart {
            reason: s.reason,
            snapshot: s.snapshot,
            cost: s.cost,
            tokens: s.tokens.map(usage_from_pb),
        }),
        K::File(f) => PartKind::File(file_from_pb(f)),
        K::Snapshot(s) => PartKind::Snapshot {
            snapshot: s.snapshot,
        },
        K::Patch(p) => PartKind::Patch(PatchPart {
            hash: p.hash,
            files: p.files,
        }),
        K::Agent(a) => PartKind::Agent(AgentPart {
            name: a.name,
            source: opt_struct(a.source),
        }),
        K::Subtask(s) => PartKind::Subtask(SubtaskPart {
            prompt: s.prompt,
            description: s.description,
            agent: s.agent,
            model: s.model.map(model_from_pb),
            command: s.command,
        }),
        K::Retry(r) => PartKind::Retry(RetryPart {
            attempt: r.attempt,
            error: opt_struct(r.error),
            created: r.created,
        }),
        K::Compaction(c) => PartKind::Compaction(CompactionPart {
            auto: c.auto,
            overflow: c.overflow,
            tail_start_id: c.tail_start_id,
        }),
    };
    // Marks are compactd's own decisions: one sent by a client is ignored (a part sent
    // back from GetSession keeps its mark, which the session already holds).
    let part = Part {
        id: p.id,
        message_id: p.message_id,
        kind,
        mark: None,
        extra: p.extra.map(struct_from_pb).unwrap_or_default(),
    };
    part.validate()?;
    Ok(part)
}

fn tool_from_pb(t: pb::ToolPart) -> Result<ToolPart, Rejection> {
    let Some(st) = t.state else {
        return Err(Rejection::invalid("state", "required"));
    };
    let status = ToolStatus::parse(&st.status).ok_or_else(|| {
        Rejection::invalid(
            "state.status",
            format!(
                "unknown status {:?}; expected pending, running, completed or error",
                clipped(&st.status)
            ),
        )
    })?;
    let time = st.time.unwrap_or_default();
    Ok(ToolPart {
        call_id: t.call_id,
        tool: t.tool,
        state: ToolState {
            status,
            input: Value::Object(st.input.map(struct_from_pb).unwrap_or_default()),
            output: st.output,
            error: st.error,
            title: st.title,
            metadata: opt_struct(st.metadata),
            time: ToolTime {
                start: time.start,
                end: time.end,
                compacted: time.compacted,
            },
            attachments: st.attachments.into_iter().map(file_from_pb).collect(),
            raw: st.raw,
        },
        metadata: opt_struct(t.metadata),
    })
}

fn file_from_pb(f: pb::FilePart) -> FilePart {
    FilePart {
        mime: f.mime,
        filename: f.filename,
        url: f.url,
        source: opt_struct(f.source),
        size: f.size,
    }
}

fn file_to_pb(f: &FilePart) -> pb::FilePart {
    pb::FilePart {
        mime: f.mime.clone(),
        filename: f.filename.clone(),
        url: f.url.clone(),
        source: opt_struct_to_pb(&f.source),
        size: f.size,
    }
}

fn time_from_pb(t: pb::PartTime) -> PartTime {
    PartTime {
        start: t.start,
        end: t.end,
    }
}

fn time_to_pb(t: &PartTime) -> pb::PartTime {
    pb::PartTime {
        start: t.start,
        end: t.end,
    }
}

/// A part to the wire.
pub fn part_to_pb(p: &Part) -> pb::Part {
    use pb::part::Kind as K;
    let kind = match &p.kind {
        PartKind::Text(t) => K::Text(pb::TextPart {
            text: t.text.clone(),
            synthetic: t.synthetic,
            ignored: t.ignored,
            time: t.time.as_ref().map(time_to_pb),
            metadata: opt_struct_to_pb(&t.metadata),
        }),
        PartKind::Reasoning(r) => K::Reasoning(pb::ReasoningPart {
            text: r.text.clone(),
            time: r.time.as_ref().map(time_to_pb),
            metadata: opt_struct_to_pb(&r.metadata),
        }),
        PartKind::Tool(t) => K::Tool(pb::ToolPart {
            call_id: t.call_id.clone(),
            tool: t.tool.clone(),
            state: Some(pb::ToolState {
                status: t.state.status.as_str().to_string(),
                input: Some(any_to_struct(&t.state.input)),
                output: t.state.output.clone(),
                error: t.state.error.clone(),
                title: t.state.title.clone(),
                metadata: opt_struct_to_pb(&t.state.metadata),
                time: Some(pb::ToolTime {
                    start: t.state.time.start,
                    end: t.state.time.end,
                    compacted: t.state.time.compacted,
                }),
                attachments: t.state.attachments.iter().map(file_to_pb).collect(),
                raw: t.state.raw.clone(),
            }),
            metadata: opt_struct_to_pb(&t.metadata),
        }),
        PartKind::StepStart { snapshot } => K::StepStart(pb::StepStartPart {
            snapshot: snapshot.clone(),
        }),
        PartKind::StepFinish(s) => K::StepFinish(pb::StepFinishPart {
            reason: s.reason.clone(),
            snapshot: s.snapshot.clone(),
            cost: s.cost,
            tokens: s.tokens.as_ref().map(usage_to_pb),
        }),
        PartKind::File(f) => K::File(file_to_pb(f)),
        PartKind::Snapshot { snapshot } => K::Snapshot(pb::SnapshotPart {
            snapshot: snapshot.clone(),
        }),
        PartKind::Patch(p) => K::Patch(pb::PatchPart {
            hash: p.hash.clone(),
            files: p.files.clone(),
        }),
        PartKind::Agent(a) => K::Agent(pb::AgentPart {
            name: a.name.clone(),
            source: opt_struct_to_pb(&a.source),
        }),
        PartKind::Subtask(s) => K::Subtask(pb::SubtaskPart {
            prompt: s.prompt.clone(),
            description: s.description.clone(),
            agent: s.agent.clone(),
            model: s.model.as_ref().map(model_to_pb),
            command: s.command.clone(),
        }),
        PartKind::Retry(r) => K::Retry(pb::RetryPart {
            attempt: r.attempt,
            error: opt_struct_to_pb(&r.error),
            created: r.created,
        }),
        PartKind::Compaction(c) => K::Compaction(pb::CompactionPart {
            auto: c.auto,
            overflow: c.overflow,
            tail_start_id: c.tail_start_id.clone(),
        }),
    };
    pb::Part {
        id: p.id.clone(),
        message_id: p.message_id.clone(),
        kind: Some(kind),
        extra: extra_to_pb(&p.extra),
        mark: p.mark.as_ref().map(|m| pb::StrategyMark {
            strategy: m.strategy.name().to_string(),
            superseded_by: m.superseded_by.clone(),
            time: m.time,
            keep_chars: m.keep,
        }),
    }
}

// ---- reports ----

/// Overflow check to the wire.
pub fn overflow_to_pb(c: &OverflowCheck) -> pb::OverflowCheck {
    pb::OverflowCheck {
        overflow: c.overflow,
        used: c.used,
        predicted: c.predicted,
        usable: c.usable,
        reserved: c.reserved,
        ratio: c.ratio,
        threshold: c.threshold,
        counting: c.counting.to_string(),
        crossed: match c.crossed {
            Some(Crossed::Used) => "used",
            Some(Crossed::Predicted) => "predicted",
            None => "",
        }
        .to_string(),
        reason: c.reason.unwrap_or_default().to_string(),
        trigger: c.trigger.as_str().to_string(),
    }
}

/// Prune report to the wire.
pub fn prune_to_pb(r: &PruneReport) -> pb::PruneReport {
    pb::PruneReport {
        committed: r.committed,
        dry_run: r.dry_run,
        tokens_saved: r.tokens_saved,
        context_tokens_saved: r.context_tokens_saved,
        tokens_scanned: r.tokens_scanned,
        parts: r
            .parts
            .iter()
            .map(|p| pb::PrunedPart {
                message_id: p.message_id.clone(),
                part_id: p.part_id.clone(),
                call_id: p.call_id.clone(),
                tool: p.tool.clone(),
                tokens: p.tokens,
            })
            .collect(),
        reason: r.reason_text().unwrap_or_default(),
        prune_protect: r.prune_protect,
        prune_minimum: r.prune_minimum,
        strategies: r
            .strategies
            .savings
            .iter()
            .map(|s| pb::StrategySaving {
                strategy: s.strategy.name().to_string(),
                parts: s.parts,
                tokens: s.tokens,
            })
            .collect(),
        strategy_tokens_saved: r.strategies.tokens(),
        marked: r
            .strategies
            .parts
            .iter()
            .map(|m| pb::MarkedPart {
                message_id: m.message_id.clone(),
                part_id: m.part_id.clone(),
                part_type: m.part_type.to_string(),
                tool: m.tool.clone(),
                call_id: m.call_id.clone(),
                strategy: m.strategy.name().to_string(),
                superseded_by: m.superseded_by.clone(),
                tokens: m.tokens,
            })
            .collect(),
    }
}

/// One native context message in protobuf, from its info and its parts as the context
/// reads them (borrowed from the session: each string is copied once, into the reply).
pub(crate) fn sent_message_to_pb(
    info: &MessageInfo,
    parts: &[(&StoredPart, Reading<'_>)],
) -> pb::Message {
    pb::Message {
        info: Some(message_info_to_pb(info)),
        parts: parts
            .iter()
            .map(|(_, r)| r.with_whole(part_to_pb))
            .collect(),
    }
}

/// A session's summary line.
pub fn summary_to_pb(s: &Session, created: bool) -> pb::SessionSummary {
    let info = s.info();
    pb::SessionSummary {
        id: info.id.clone(),
        title: info.title.clone(),
        model: info.model.as_ref().map(model_to_pb),
        limits: Some(limits_to_pb(&info.limits)),
        messages: s.messages().len() as u32,
        parts: s.part_count() as u32,
        estimated_tokens: s.total_tokens(),
        context_tokens: s.context_tokens(),
        compacted_parts: s.compacted_count() as u32,
        held_bytes: s.held_bytes(),
        cold: false,
        overflow: Some(overflow_to_pb(
            &s.check_overflow(crate::engine::Trigger::Request),
        )),
        created,
    }
}

#[cfg(test)]
#[path = "convert_tests.rs"]
mod tests;

// ---- recall ----

/// A recalled part on the wire.
pub fn recalled_to_pb(r: &Recalled) -> pb::Recalled {
    use pb::recalled::Content;
    let content = match &r.content {
        RecalledContent::Call(c) => Some(Content::Call(pb::RecalledCall {
            tool: c.tool.clone(),
            call_id: c.call_id.clone(),
            status: c.status.as_str().to_string(),
            input: Some(any_to_struct(&c.input)),
            output: c.output.clone(),
            error: c.error.clone(),
        })),
        RecalledContent::Text(t) => Some(Content::Text(t.clone())),
        RecalledContent::File {
            filename,
            mime,
            url,
        } => Some(Content::File(pb::FilePart {
            mime: mime.clone(),
            filename: filename.clone(),
            url: url.clone(),
            ..Default::default()
        })),
        RecalledContent::Empty => None,
    };
    pb::Recalled {
        message_id: r.message_id.clone(),
        part_id: r.part_id.clone(),
        part_type: r.part_type.to_string(),
        content,
        reduction: r.reduction.map_or("", |x| x.as_str()).to_string(),
        pinned: r.pinned,
        tokens: r.tokens,
        context_tokens: r.context_tokens,
    }
}
