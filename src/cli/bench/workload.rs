//! The bench's sessions, built from real traces (`tests/data/traces/*.json`, OpenCode's
//! export format): each session replays one trace's turns (user prompt, assistant steps
//! with their text and tool calls, the step's finish) as `Stream` updates, with each tool
//! output taken from the trace and sized to the part size under test.
//!
//! Every text carries a prefix naming its session and update, so no two updates of a run
//! share a text and compactd's token count cache (`tokens/cache.rs`) never answers for one:
//! every count the server makes is a real one. This file builds updates; it sends nothing.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::domain::{PartKind, Role, ToolStatus};
use crate::server::pb;
use crate::server::pb::client_update::Update;

/// Longest user prompt or assistant text sent (traces hold pasted files in prompts; the
/// bench is about tool outputs).
const TEXT_CAP: usize = 1024;
/// Tool calls one session holds at most before the stream opens its next session.
const CALLS_PER_SESSION: usize = 256;

/// The tool calls and texts of every trace, ready to be replayed at any part size.
#[derive(Debug)]
pub struct Pool {
    traces: Vec<Trace>,
    /// Every tool output of every trace, concatenated: what lengthens a short output.
    filler: String,
    calls: usize,
}

/// Why the traces could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum WorkloadError {
    /// The directory is missing or unreadable.
    #[error("--traces {}: {message} (the bench replays OpenCode exports; point --traces at a directory of them, e.g. tests/data/traces in the repository)", path.display())]
    Dir {
        /// The directory named.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// A trace file could not be read or parsed.
    #[error("{}: {message}", path.display())]
    Trace {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
}

/// One trace: its turns in order.
#[derive(Debug)]
struct Trace {
    turns: Vec<Turn>,
}

/// A user prompt and the assistant steps answering it.
#[derive(Debug)]
struct Turn {
    prompt: String,
    steps: Vec<Step>,
}

/// One assistant message: its texts and tool calls.
#[derive(Debug)]
struct Step {
    texts: Vec<String>,
    calls: Vec<Call>,
}

/// A completed tool call as the trace recorded it.
#[derive(Debug)]
struct Call {
    tool: String,
    title: String,
    input: Option<prost_types::Struct>,
    output: String,
}

/// How long each tool output is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sizing {
    /// Exactly this many bytes: the trace's output, continued with other outputs of the
    /// traces when shorter, cut when longer.
    Exact(usize),
    /// The trace's own output, cut at this many bytes.
    Natural(usize),
}

/// What sessions a stream sends.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Session ids are `<prefix>-<n>`; the prefix also starts every text, so it must be
    /// unique in the run.
    pub prefix: String,
    /// Tool output sizes.
    pub sizing: Sizing,
    /// The session's `tokenizer` setting (empty: the server's default).
    pub tokenizer: String,
    /// One session for everything (cycling through the traces), with automatic prune and
    /// the strategies off so its context keeps everything sent: the `GetContext` session.
    pub keep_everything: bool,
    /// Which trace the first session replays (streams start at different ones).
    pub first_trace: usize,
}

impl Pool {
    /// Loads every `*.json` trace of `dir` (in name order). Traces without a completed
    /// tool call are skipped; none at all is an error.
    pub fn load(dir: &Path) -> Result<Pool, WorkloadError> {
        let dir_err = |message: String| WorkloadError::Dir {
            path: dir.to_path_buf(),
            message,
        };
        let entries = std::fs::read_dir(dir).map_err(|e| dir_err(e.to_string()))?;
        let mut files: Vec<PathBuf> = entries
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "json"))
            .collect();
        files.sort();
        let mut pool = Pool {
            traces: Vec::new(),
            filler: String::new(),
            calls: 0,
        };
        for path in files {
            let trace_err = |message: String| WorkloadError::Trace {
                path: path.clone(),
                message,
            };
            let json = std::fs::read_to_string(&path).map_err(|e| trace_err(e.to_string()))?;
            let export = crate::trace::parse_export(&json).map_err(|e| trace_err(e.to_string()))?;
            let trace = trace_of(export);
            let calls: Vec<&Call> = trace
                .turns
                .iter()
                .flat_map(|t| &t.steps)
                .flat_map(|s| &s.calls)
                .collect();
            if calls.is_empty() {
                continue;
            }
            pool.calls += calls.len();
            for c in calls {
                pool.filler.push_str(&c.output);
                pool.filler.push('\n');
            }
            pool.traces.push(trace);
        }
        if pool.traces.is_empty() {
            return Err(dir_err("no trace with a completed tool call".into()));
        }
        Ok(pool)
    }

    /// Traces loaded.
    pub fn traces(&self) -> usize {
        self.traces.len()
    }

    /// Completed tool calls in them.
    pub fn calls(&self) -> usize {
        self.calls
    }

    /// The endless sequence of updates `plan` describes.
    pub fn updates(self: &Arc<Self>, plan: Plan) -> Updates {
        Updates {
            trace: plan.first_trace % self.traces.len(),
            pool: self.clone(),
            plan,
            queue: std::collections::VecDeque::new(),
            sessions: Vec::new(),
            seq: 0,
            filler_at: 0,
        }
    }
}

/// A stream's updates, generated a session at a time; remembers the sessions it opened.
#[derive(Debug)]
pub struct Updates {
    pool: Arc<Pool>,
    plan: Plan,
    trace: usize,
    queue: std::collections::VecDeque<pb::ClientUpdate>,
    sessions: Vec<String>,
    seq: u64,
    filler_at: usize,
}

impl Updates {
    /// Ids of the sessions opened so far (to delete after the case).
    pub fn sessions(&self) -> &[String] {
        &self.sessions
    }

    /// Queues the next session's updates (or, keeping everything, the next trace's turns
    /// in the one session).
    fn refill(&mut self) {
        let now = now_ms();
        let pool = self.pool.clone();
        let trace = &pool.traces[self.trace];
        self.trace = (self.trace + 1) % pool.traces.len();
        if self.sessions.is_empty() || !self.plan.keep_everything {
            let sid = format!("{}-{}", self.plan.prefix, self.sessions.len());
            self.sessions.push(sid.clone());
            self.push(Update::Open(pb::SessionInfo {
                id: sid,
                title: "compactd bench".into(),
                config: Some(self.session_config()),
                ..Default::default()
            }));
        }
        let Some(sid) = self.sessions.last().cloned() else {
            return;
        };
        let mut calls = 0usize;
        for turn in &trace.turns {
            if calls >= CALLS_PER_SESSION && !self.plan.keep_everything {
                break;
            }
            let user = self.next_id("m");
            self.push(Update::UpsertMessage(message(&user, "user", "", now, "")));
            let text = self.text(&sid, &turn.prompt);
            let part = self.next_id("p");
            self.push(Update::UpsertPart(text_part(&part, &user, text)));
            for step in &turn.steps {
                let asst = self.next_id("m");
                self.push(Update::UpsertMessage(message(
                    &asst,
                    "assistant",
                    &user,
                    now,
                    "",
                )));
                for t in &step.texts {
                    let text = self.text(&sid, t);
                    let part = self.next_id("p");
                    self.push(Update::UpsertPart(text_part(&part, &asst, text)));
                }
                for call in &step.calls {
                    let part = self.next_id("p");
                    let output = self.output(&sid, &call.output);
                    self.push(Update::UpsertPart(tool_part(
                        &part, &asst, call, output, now,
                    )));
                    calls += 1;
                }
                let finish = if step.calls.is_empty() {
                    "stop"
                } else {
                    "tool-calls"
                };
                self.push(Update::UpsertMessage(message(
                    &asst,
                    "assistant",
                    &user,
                    now,
                    finish,
                )));
            }
        }
    }

    fn session_config(&self) -> pb::SessionConfig {
        let mut config = pb::SessionConfig {
            tokenizer: self.plan.tokenizer.clone(),
            ..Default::default()
        };
        if self.plan.keep_everything {
            config.prune = Some(false);
            config.auto_compact = Some(false);
            config.strategy_preset = "verbose".into();
        }
        config
    }

    fn push(&mut self, update: Update) {
        self.seq += 1;
        let session_id = self.sessions.last().cloned().unwrap_or_default();
        self.queue.push_back(pb::ClientUpdate {
            seq: self.seq,
            session_id,
            update: Some(update),
        });
    }

    /// A fresh id (unique in the stream, so in each of its sessions).
    fn next_id(&self, kind: &str) -> String {
        format!("{kind}{}", self.seq + 1)
    }

    /// `text` cut to [`TEXT_CAP`], behind this update's unique prefix.
    fn text(&self, sid: &str, text: &str) -> String {
        let mut s = format!("[{sid} {}] ", self.seq + 1);
        s.push_str(&text[..floor_boundary(text, TEXT_CAP)]);
        s
    }

    /// A tool output of the plan's size, behind this update's unique prefix.
    fn output(&mut self, sid: &str, original: &str) -> String {
        let mut s = format!("[{sid} {}] ", self.seq + 1);
        match self.plan.sizing {
            Sizing::Natural(cap) => {
                s.push_str(original);
                s.truncate(floor_boundary(&s, cap));
            }
            Sizing::Exact(size) => {
                s.reserve(size.saturating_sub(s.len()));
                s.push_str(&original[..floor_boundary(original, size)]);
                let filler = &self.pool.filler;
                while s.len() < size && !filler.is_empty() {
                    let at = ceil_boundary(filler, self.filler_at % filler.len());
                    let end = floor_boundary(filler, at + (size - s.len())).max(at);
                    if end == at {
                        self.filler_at = 0;
                        s.push(' ');
                        continue;
                    }
                    s.push_str(&filler[at..end]);
                    self.filler_at = end;
                }
                s.truncate(floor_boundary(&s, size));
                while s.len() < size {
                    s.push(' ');
                }
            }
        }
        s
    }
}

impl Iterator for Updates {
    type Item = pb::ClientUpdate;

    fn next(&mut self) -> Option<pb::ClientUpdate> {
        while self.queue.is_empty() {
            self.refill();
        }
        self.queue.pop_front()
    }
}

/// The texts an update makes the server count with its tokenizer (tool outputs, text
/// parts): what the raw BPE reference counts.
pub fn counted_texts(update: &pb::ClientUpdate) -> impl Iterator<Item = &str> {
    let text = match &update.update {
        Some(Update::UpsertPart(p)) => match &p.kind {
            Some(pb::part::Kind::Tool(t)) => t.state.as_ref().map(|s| s.output.as_str()),
            Some(pb::part::Kind::Text(t)) => Some(t.text.as_str()),
            _ => None,
        },
        _ => None,
    };
    text.into_iter()
}

/// True when `update` writes a tool part (whose output has the part size under test).
pub fn is_tool_output(update: &pb::ClientUpdate) -> bool {
    matches!(
        &update.update,
        Some(Update::UpsertPart(pb::Part {
            kind: Some(pb::part::Kind::Tool(_)),
            ..
        }))
    )
}

/// The kind name compactd's ack carries for `update` (so the echo answers as many bytes).
pub fn kind(update: &pb::ClientUpdate) -> &'static str {
    match &update.update {
        Some(Update::Open(_)) => "open",
        Some(Update::UpsertMessage(_)) => "upsert_message",
        Some(Update::UpsertPart(_)) => "upsert_part",
        _ => "other",
    }
}

fn trace_of(export: crate::trace::Export) -> Trace {
    let mut turns: Vec<Turn> = Vec::new();
    for (info, parts) in export.messages {
        match info.role {
            Role::User => {
                let prompt = parts
                    .iter()
                    .filter_map(|p| match &p.kind {
                        PartKind::Text(t) if !t.synthetic => Some(t.text.as_str()),
                        _ => None,
                    })
                    .collect::<Vec<_>>()
                    .join("\n");
                turns.push(Turn {
                    prompt,
                    steps: Vec::new(),
                });
            }
            _ => {
                let mut step = Step {
                    texts: Vec::new(),
                    calls: Vec::new(),
                };
                for p in parts {
                    match p.kind {
                        PartKind::Text(t) if !t.text.is_empty() => step.texts.push(t.text),
                        PartKind::Tool(t) if t.state.status == ToolStatus::Completed => {
                            step.calls.push(Call {
                                input: struct_of(&t.state.input),
                                title: t.state.title,
                                tool: t.tool,
                                output: t.state.output,
                            });
                        }
                        _ => {}
                    }
                }
                if turns.is_empty() {
                    // A sidechain without a user prompt: open the turn it answers.
                    turns.push(Turn {
                        prompt: String::from("continue"),
                        steps: Vec::new(),
                    });
                }
                if let Some(turn) = turns.last_mut() {
                    turn.steps.push(step);
                }
            }
        }
    }
    Trace { turns }
}

/// The user message a GetContext timing rewrites before each call (see `time_context`).
pub fn prompt_message(id: &str) -> pb::MessageInfo {
    message(id, "user", "", now_ms(), "")
}

/// The `n`th text of the prompt message `message_id`: the same part, the same size, new
/// words each time.
pub fn prompt_text(message_id: &str, n: u64) -> pb::Part {
    let text = format!("Prompt {n:010}: now run the tests again and fix what fails. ");
    text_part(&format!("{message_id}-text"), message_id, text.repeat(4))
}

/// The wall clock in epoch ms, as a host stamps its messages.
fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

fn message(id: &str, role: &str, parent: &str, now: i64, finish: &str) -> pb::MessageInfo {
    pb::MessageInfo {
        id: id.into(),
        role: role.into(),
        parent_id: parent.into(),
        time: Some(pb::MessageTime {
            created: now,
            completed: (!finish.is_empty()).then_some(now),
        }),
        agent: "build".into(),
        mode: if role == "assistant" {
            "build".into()
        } else {
            String::new()
        },
        finish: finish.into(),
        ..Default::default()
    }
}

fn text_part(id: &str, message_id: &str, text: String) -> pb::Part {
    pb::Part {
        id: id.into(),
        message_id: message_id.into(),
        kind: Some(pb::part::Kind::Text(pb::TextPart {
            text,
            ..Default::default()
        })),
        ..Default::default()
    }
}

fn tool_part(id: &str, message_id: &str, call: &Call, output: String, now: i64) -> pb::Part {
    pb::Part {
        id: id.into(),
        message_id: message_id.into(),
        kind: Some(pb::part::Kind::Tool(pb::ToolPart {
            call_id: format!("call-{id}"),
            tool: call.tool.clone(),
            state: Some(pb::ToolState {
                status: "completed".into(),
                input: call.input.clone(),
                output,
                title: call.title.clone(),
                time: Some(pb::ToolTime {
                    start: now,
                    end: Some(now),
                    compacted: None,
                }),
                ..Default::default()
            }),
            metadata: None,
        })),
        ..Default::default()
    }
}

/// A tool input (a JSON object) as protobuf's `Struct`; None for anything else.
fn struct_of(v: &serde_json::Value) -> Option<prost_types::Struct> {
    match v {
        serde_json::Value::Object(map) => Some(prost_types::Struct {
            fields: map.iter().map(|(k, v)| (k.clone(), value_of(v))).collect(),
        }),
        _ => None,
    }
}

fn value_of(v: &serde_json::Value) -> prost_types::Value {
    use prost_types::value::Kind;
    let kind = match v {
        serde_json::Value::Null => Kind::NullValue(0),
        serde_json::Value::Bool(b) => Kind::BoolValue(*b),
        serde_json::Value::Number(n) => Kind::NumberValue(n.as_f64().unwrap_or(0.0)),
        serde_json::Value::String(s) => Kind::StringValue(s.clone()),
        serde_json::Value::Array(a) => Kind::ListValue(prost_types::ListValue {
            values: a.iter().map(value_of).collect(),
        }),
        serde_json::Value::Object(_) => Kind::StructValue(struct_of(v).unwrap_or_default()),
    };
    prost_types::Value { kind: Some(kind) }
}

/// The largest char boundary of `s` at or below `at`.
fn floor_boundary(s: &str, at: usize) -> usize {
    let mut at = at.min(s.len());
    while !s.is_char_boundary(at) {
        at -= 1;
    }
    at
}

/// The smallest char boundary of `s` at or above `at`.
fn ceil_boundary(s: &str, at: usize) -> usize {
    let mut at = at.min(s.len());
    while !s.is_char_boundary(at) {
        at += 1;
    }
    at
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool() -> Arc<Pool> {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/traces");
        Arc::new(Pool::load(&dir).expect("the traces load"))
    }

    fn plan(sizing: Sizing) -> Plan {
        Plan {
            prefix: "t".into(),
            sizing,
            tokenizer: String::new(),
            keep_everything: false,
            first_trace: 0,
        }
    }

    #[test]
    fn tool_outputs_have_the_exact_size_and_every_text_is_unique() {
        let pool = pool();
        for size in [4096, 20 * 1024] {
            let mut seen = std::collections::HashSet::new();
            let mut outputs = 0;
            for u in pool.updates(plan(Sizing::Exact(size))).take(3000) {
                if let Some(Update::UpsertPart(pb::Part {
                    kind: Some(pb::part::Kind::Tool(t)),
                    ..
                })) = &u.update
                {
                    let out = &t.state.as_ref().expect("a state").output;
                    assert_eq!(out.len(), size);
                    outputs += 1;
                }
                for t in counted_texts(&u) {
                    assert!(seen.insert(t.to_string()), "a repeated text: {t:.80}");
                }
            }
            assert!(outputs > 500, "{outputs}");
        }
    }

    #[test]
    fn sessions_rotate_unless_everything_is_kept() {
        let pool = pool();
        let mut u = pool.updates(plan(Sizing::Exact(100)));
        u.by_ref().take(5000).for_each(drop);
        assert!(u.sessions().len() > 1);
        let mut one = pool.updates(Plan {
            keep_everything: true,
            ..plan(Sizing::Natural(1000))
        });
        one.by_ref().take(5000).for_each(drop);
        assert_eq!(one.sessions(), ["t-0"]);
    }

    #[test]
    fn a_missing_directory_is_named() {
        let e = Pool::load(Path::new("/nonexistent/traces")).expect_err("no dir");
        assert!(
            e.to_string().contains("--traces /nonexistent/traces"),
            "{e}"
        );
    }
}
