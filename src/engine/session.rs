//! The [`Session`] value: messages and parts in arrival order, plus the running figures
//! (token totals, usage since the last report, prune window, compaction boundary) that
//! keep every per-update decision independent of session length.
//!
//! `apply` is the only way to change a session from outside the engine. It validates
//! first and mutates after, so a rejected update leaves the session exactly as it was.

use std::collections::HashMap;
use std::sync::Arc;

use super::error::ApplyError;
use super::estimate::{PartEstimate, estimate};
use super::memory::{
    ByteLimit, message_bytes, part_bytes, part_slot_growth, part_slots_bytes, session_bytes,
};
use super::prune::PruneIndex;
use super::render::{is_compacted, is_reduced, render_as};
use super::strategies::Tracker;
use crate::config::{EngineConfig, Settings};
use crate::domain::{MessageInfo, Part, PartKind, Role, SessionInfo, TokenUsage};
use crate::tokens::TokenCounter;

/// One change to a session, already validated for shape by the boundary that decoded it.
#[derive(Debug, Clone, PartialEq)]
pub enum Update {
    /// Open the session or change its title, model, limits, overrides and todos.
    Configure(SessionInfo),
    /// Insert a message, or update it in place (position of first arrival is kept).
    UpsertMessage(MessageInfo),
    /// Insert a part at the end of its message, or update it in place.
    UpsertPart(Part),
    /// Remove a part.
    DeletePart {
        /// Owning message.
        message_id: String,
        /// Part to remove.
        part_id: String,
    },
    /// Provider usage of the latest request; optionally stored on an assistant message.
    ReportUsage {
        /// Assistant message to store the usage on.
        message_id: Option<String>,
        /// The usage.
        tokens: TokenUsage,
    },
}

impl Update {
    /// Short name for logs, acks and metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Update::Configure(_) => "open",
            Update::UpsertMessage(_) => "upsert_message",
            Update::UpsertPart(_) => "upsert_part",
            Update::DeletePart { .. } => "delete_part",
            Update::ReportUsage { .. } => "report_usage",
        }
    }
}

/// What an applied update did, so the caller knows which checks to run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Applied {
    /// A new session, message or part was created.
    pub created: bool,
    /// An assistant message became finished (triggers overflow check and auto prune).
    pub finished: bool,
    /// New provider usage was recorded (triggers an overflow check).
    pub usage_reported: bool,
    /// The finished message is a compaction summary (never triggers another compaction).
    pub summary: bool,
}

/// A message and its parts, as held by the session.
#[derive(Debug, Clone, PartialEq)]
pub struct Message {
    /// Message info.
    pub info: MessageInfo,
    /// Parts in arrival order, each with its cached estimate.
    pub parts: Vec<StoredPart>,
}

/// A part with the token estimate computed when it was written.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredPart {
    /// The part.
    pub part: Part,
    /// Cached estimate of the part as stored.
    pub est: PartEstimate,
    /// Context tokens of the part as rendered, when prune or a strategy reduced it
    /// (computed once, when the mark is set).
    pub reduced: Option<u64>,
    /// Bytes the part holds (computed when written; see `memory.rs`).
    pub bytes: u64,
}

impl StoredPart {
    /// True when prune has cleared this part's output from the context.
    /// Only a completed output can be cleared: a stamp on a pending, running or failed
    /// call (which OpenCode never writes) changes nothing in the context.
    pub fn is_compacted(&self) -> bool {
        is_compacted(&self.part)
    }
}

/// The last completed compaction: the user message that opened it (with the compaction
/// part) and its summary. The context starts here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Boundary {
    /// The compaction's user message.
    pub start: usize,
    /// Its completed summary (assistant, `summary: true`).
    pub summary: usize,
}

/// Loop protection of automatic compaction: a cooldown after a compaction that did not
/// bring the context under the threshold, and a circuit breaker after repeated failures.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AutoState {
    /// Finished assistant messages to wait before compacting automatically again.
    pub cooldown_left: u32,
    /// Consecutive failed automatic compactions.
    pub failures: u32,
}

/// Usage bookkeeping behind the overflow check.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct UsageState {
    /// Last reported usage.
    pub last: Option<TokenUsage>,
    /// Context tokens added (positive) or removed (negative) since that report.
    pub delta: i64,
    /// Context tokens the model did not write (tool results, user text, ...) added since
    /// the current request started (a `step-start`, a new assistant message, or a report).
    /// A report does not cover them: tool results of a step arrive before its
    /// `step-finish` but are input to the next request.
    pub since_request: i64,
    /// Context tokens prune cleared since that report: when non-zero the report describes
    /// a request bigger than the next one will be.
    pub pruned: u64,
}

/// A session: the unit the store owns and the engine computes on.
#[derive(Debug)]
pub struct Session {
    pub(crate) info: SessionInfo,
    pub(crate) settings: Settings,
    pub(crate) counter: Arc<dyn TokenCounter>,
    /// Tokens of the placeholder that replaces a cleared output.
    pub(crate) placeholder_tokens: u64,
    pub(crate) messages: Vec<Message>,
    pub(crate) by_id: HashMap<String, usize>,
    /// Positions of user messages, ascending (turn counting without a scan).
    pub(crate) users: Vec<usize>,
    /// Position of the user message that opens the context (last completed compaction).
    pub(crate) boundary: Option<Boundary>,
    /// Parent id → position of its newest completed summary (so a late compaction part
    /// finds its summary).
    completed_parents: HashMap<String, usize>,
    pub(crate) usage: UsageState,
    /// Loop protection of automatic compaction.
    pub(crate) auto: AutoState,
    pub(crate) prune: PruneIndex,
    /// Incremental state of the aggressive strategies.
    pub(crate) tracker: Tracker,
    /// Context-view tokens of all messages.
    pub(crate) tokens: u64,
    parts: usize,
    pub(crate) compacted: usize,
    /// Heap bytes of the content (see `memory.rs`).
    pub(crate) bytes: u64,
    /// Slots allocated in all part vectors (their capacities summed).
    pub(crate) part_slots: usize,
    /// The most bytes the session may hold after the next update.
    pub(crate) byte_limit: ByteLimit,
}

impl Clone for Session {
    /// A copy whose byte figure describes the copy: cloned vectors hold exactly their
    /// length, so the part slots are recounted. Every field is named (no `..`), so a new
    /// field cannot be forgotten here.
    fn clone(&self) -> Self {
        let Session {
            info,
            settings,
            counter,
            placeholder_tokens,
            messages,
            by_id,
            users,
            boundary,
            completed_parents,
            usage,
            auto,
            prune,
            tracker,
            tokens,
            parts,
            compacted,
            bytes,
            part_slots: _,
            byte_limit,
        } = self;
        let messages = messages.clone();
        let part_slots = messages.iter().map(|m| m.parts.capacity()).sum();
        Session {
            info: info.clone(),
            settings: settings.clone(),
            counter: counter.clone(),
            placeholder_tokens: *placeholder_tokens,
            messages,
            by_id: by_id.clone(),
            users: users.clone(),
            boundary: *boundary,
            completed_parents: completed_parents.clone(),
            usage: *usage,
            auto: *auto,
            prune: prune.clone(),
            tracker: tracker.clone(),
            tokens: *tokens,
            parts: *parts,
            compacted: *compacted,
            bytes: *bytes,
            part_slots,
            byte_limit: *byte_limit,
        }
    }
}

impl Session {
    /// A new, empty session with settings resolved from `config` and the info's overrides.
    pub fn new(info: SessionInfo, config: &EngineConfig, counter: Arc<dyn TokenCounter>) -> Self {
        let settings = config.resolve(&info.config);
        let placeholder_tokens = counter.count(&settings.placeholder);
        let tracker = Tracker::new(&settings);
        let bytes = session_bytes(&info, &settings);
        Session {
            info,
            settings,
            counter,
            placeholder_tokens,
            messages: Vec::new(),
            by_id: HashMap::new(),
            users: Vec::new(),
            boundary: None,
            completed_parents: HashMap::new(),
            usage: UsageState::default(),
            auto: AutoState::default(),
            prune: PruneIndex::default(),
            tracker,
            tokens: 0,
            parts: 0,
            compacted: 0,
            bytes,
            part_slots: 0,
            byte_limit: ByteLimit::NONE,
        }
    }

    /// Session info (id, model, limits, overrides, todos).
    pub fn info(&self) -> &SessionInfo {
        &self.info
    }

    /// The settings the session runs with.
    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    /// Messages in arrival order.
    pub fn messages(&self) -> &[Message] {
        &self.messages
    }

    /// Number of parts held.
    pub fn part_count(&self) -> usize {
        self.parts
    }

    /// Number of tool parts whose output prune has cleared.
    pub fn compacted_count(&self) -> usize {
        self.compacted
    }

    /// Context-view tokens of every message held (before the boundary too).
    pub fn total_tokens(&self) -> u64 {
        self.tokens
    }

    /// Position of a message by id.
    pub fn position(&self, message_id: &str) -> Option<usize> {
        self.by_id.get(message_id).copied()
    }

    /// The token counter every figure of this session comes from.
    pub fn counter(&self) -> &dyn TokenCounter {
        self.counter.as_ref()
    }

    /// Applies one update. On error nothing changed.
    pub fn apply(&mut self, update: Update, config: &EngineConfig) -> Result<Applied, ApplyError> {
        match update {
            Update::Configure(info) => self.configure(info, config),
            Update::UpsertMessage(info) => self.upsert_message(info),
            Update::UpsertPart(part) => self.upsert_part(part),
            Update::DeletePart {
                message_id,
                part_id,
            } => self.delete_part(&message_id, &part_id),
            Update::ReportUsage { message_id, tokens } => {
                self.report_usage(message_id.as_deref(), tokens)
            }
        }
    }

    fn configure(
        &mut self,
        info: SessionInfo,
        config: &EngineConfig,
    ) -> Result<Applied, ApplyError> {
        // Built aside (configure is rare) so a refused update changes nothing.
        let mut next = self.info.clone();
        if !info.title.is_empty() {
            next.title = info.title;
        }
        if info.model.is_some() {
            next.model = info.model;
        }
        if info.limits != Default::default() {
            next.limits = info.limits;
        }
        if !info.todos.is_empty() {
            next.todos = info.todos;
        }
        next.extra.extend(info.extra);
        next.config.merge(&info.config);
        let settings = config.resolve(&next.config);
        let old = session_bytes(&self.info, &self.settings);
        let new = session_bytes(&next, &settings);
        self.check_growth("", old, new)?;
        self.adjust_bytes(old, new);
        self.info = next;
        if settings != self.settings {
            self.settings = settings;
            self.placeholder_tokens = self.counter.count(&self.settings.placeholder);
            self.recount_all();
            self.prune.invalidate();
            self.tracker.invalidate();
        }
        Ok(Applied::default())
    }

    fn upsert_message(&mut self, info: MessageInfo) -> Result<Applied, ApplyError> {
        let Some(idx) = self.position(&info.id) else {
            let bytes = message_bytes(&info);
            let slots = self.message_slot_growth(info.role == Role::User);
            self.check_growth("", 0, bytes + slots)?;
            self.adjust_bytes(0, bytes);
            return Ok(self.insert_message(info));
        };
        let old = &self.messages[idx].info;
        if old.role != info.role {
            return Err(ApplyError::precondition(
                "role",
                format!(
                    "message {} is a {} message; its role cannot change to {}",
                    info.id,
                    old.role.as_str(),
                    info.role.as_str()
                ),
            ));
        }
        let finished = info.is_finished() && !old.is_finished();
        let summary = info.is_summary();
        let usage = info.role == Role::Assistant
            && info.tokens.is_some_and(|t| !t.is_empty())
            && info.tokens != old.tokens;
        // Only summary messages move the boundary or stop prune; ordinary messages finishing
        // must not cost a scan.
        let summary_changed = old.is_summary() != info.is_summary();
        let was_completed = old.is_completed_summary().then(|| old.parent_id.clone());
        let now_completed = info.is_completed_summary().then(|| info.parent_id.clone());
        let tokens = info.tokens;
        let (old_bytes, new_bytes) = (message_bytes(old), message_bytes(&info));
        self.check_growth("", old_bytes, new_bytes)?;
        self.adjust_bytes(old_bytes, new_bytes);
        self.messages[idx].info = info;
        if summary_changed {
            self.prune.touch(idx);
        }
        match (was_completed, now_completed) {
            (None, Some(parent)) => self.summary_completed(parent, idx),
            (Some(a), Some(b)) if a == b => {}
            (Some(_), _) => self.recompute_boundary(),
            (None, None) => {}
        }
        if usage {
            self.record_usage(tokens.unwrap_or_default());
        }
        Ok(Applied {
            created: false,
            finished,
            usage_reported: usage,
            summary,
        })
    }

    fn insert_message(&mut self, info: MessageInfo) -> Applied {
        let idx = self.messages.len();
        let finished = info.is_finished();
        let summary = info.is_summary();
        let usage = info.role == Role::Assistant && info.tokens.is_some_and(|t| !t.is_empty());
        let tokens = info.tokens;
        let completed = info.is_completed_summary().then(|| info.parent_id.clone());
        if info.role == Role::User {
            self.users.push(idx);
        } else {
            self.usage.since_request = 0; // a new assistant message is a new request
        }
        self.by_id.insert(info.id.clone(), idx);
        let user = info.role == Role::User;
        self.messages.push(Message {
            info,
            parts: Vec::new(),
        });
        if user {
            self.tracker
                .on_user_message(&self.messages, &self.users, &self.settings);
        }
        if let Some(parent) = completed {
            self.summary_completed(parent, idx);
        }
        if usage {
            self.record_usage(tokens.unwrap_or_default());
        }
        Applied {
            created: true,
            finished,
            usage_reported: usage,
            summary,
        }
    }

    fn upsert_part(&mut self, part: Part) -> Result<Applied, ApplyError> {
        let Some(idx) = self.position(&part.message_id) else {
            return Err(ApplyError::precondition(
                "message_id",
                format!(
                    "message {} does not exist; upsert the message first",
                    part.message_id
                ),
            ));
        };
        let mut part = part;
        let est = estimate(&part, self.counter.as_ref());
        let is_tool = matches!(part.kind, PartKind::Tool(_));
        let is_compaction = matches!(part.kind, PartKind::Compaction(_));
        let step_usage = match &part.kind {
            PartKind::StepFinish(s) => s.tokens.filter(|t| !t.is_empty()),
            _ => None,
        };
        let is_step_start = matches!(part.kind, PartKind::StepStart { .. });
        let assistant = self.messages[idx].info.role == Role::Assistant;
        let parts = &self.messages[idx].parts;
        let existing = parts.iter().position(|p| p.part.id == part.id);
        // A strategy's mark is compactd's decision: a host re-sending the part (which
        // knows nothing of marks) keeps it.
        if let Some(i) = existing
            && part.mark.is_none()
        {
            part.mark = parts[i].part.mark.clone();
        }
        let reduced = self.reduced_tokens(&part);
        let bytes = part_bytes(&part);
        let new = StoredPart {
            part,
            est,
            reduced,
            bytes,
        };
        let old_bytes = existing.map_or(0, |i| parts[i].bytes);
        let slots = match existing {
            Some(_) => 0,
            None => part_slots_bytes(part_slot_growth(parts, parts.capacity())),
        };
        self.check_growth("", old_bytes, bytes + slots)?;
        let new_tokens = self.context_tokens_of(&new);
        let new_unwritten = self.unwritten_tokens(&new, assistant);
        let new_compacted = new.is_compacted();
        let (old_tokens, old_compacted, was_tool, was_compaction) = match existing {
            Some(i) => {
                let old = &parts[i];
                self.usage.since_request -= self.unwritten_tokens(old, assistant) as i64;
                (
                    self.context_tokens_of(old),
                    old.is_compacted(),
                    matches!(old.part.kind, PartKind::Tool(_)),
                    matches!(old.part.kind, PartKind::Compaction(_)),
                )
            }
            None => (0, false, false, false),
        };
        let created = existing.is_none();
        let max = self.settings.max_parts_per_message;
        if created && max > 0 && self.messages[idx].parts.len() >= max {
            return Err(ApplyError::exhausted(
                "id",
                format!(
                    "message {} already holds {max} parts (max_parts_per_message)",
                    self.messages[idx].info.id
                ),
            ));
        }
        if created && is_step_start {
            self.usage.since_request = 0; // the model is being called again
        }
        self.usage.since_request += new_unwritten as i64;
        let at = match existing {
            Some(i) => {
                self.messages[idx].parts[i] = new;
                i
            }
            None => {
                let parts = &mut self.messages[idx].parts;
                let before = parts.capacity();
                parts.push(new);
                self.part_slots += parts.capacity() - before;
                parts.len() - 1
            }
        };
        self.tracker
            .on_part(&self.messages, idx, at, &self.settings);
        self.parts += usize::from(created);
        self.adjust_tokens(old_tokens, new_tokens);
        self.adjust_bytes(old_bytes, bytes);
        self.compacted = self.compacted - usize::from(old_compacted) + usize::from(new_compacted);
        if is_tool || was_tool {
            self.prune.touch(idx);
        }
        if was_compaction && !is_compaction {
            self.recompute_boundary();
        } else if is_compaction && !was_compaction {
            self.compaction_part_added(idx);
        }
        if let Some(tokens) = step_usage {
            self.record_usage(tokens);
        }
        Ok(Applied {
            created,
            usage_reported: step_usage.is_some(),
            ..Applied::default()
        })
    }

    fn delete_part(&mut self, message_id: &str, part_id: &str) -> Result<Applied, ApplyError> {
        let Some(idx) = self.position(message_id) else {
            return Err(ApplyError::not_found(
                "message_id",
                format!("message {message_id} does not exist"),
            ));
        };
        let Some(i) = self.messages[idx]
            .parts
            .iter()
            .position(|p| p.part.id == part_id)
        else {
            return Err(ApplyError::not_found(
                "part_id",
                format!("part {part_id} does not exist in message {message_id}"),
            ));
        };
        let old = self.messages[idx].parts.remove(i);
        let old_tokens = self.context_tokens_of(&old);
        let assistant = self.messages[idx].info.role == Role::Assistant;
        self.usage.since_request -= self.unwritten_tokens(&old, assistant) as i64;
        self.parts -= 1;
        self.adjust_tokens(old_tokens, 0);
        self.adjust_bytes(old.bytes, 0);
        self.compacted -= usize::from(old.is_compacted());
        // Removing any part shifts the positions of the parts after it, which the prune
        // window may hold: always invalidate it (deletions are rare).
        self.prune.touch(idx);
        // The strategies' state holds part positions (which this shifts) and maybe this
        // call: rebuild it at the next commit (deletions are rare).
        self.tracker.invalidate();
        if let PartKind::Tool(t) = &old.part.kind
            && !t.call_id.is_empty()
        {
            // Give back their content to the calls it superseded (one scan).
            self.unmark_superseded_by(&t.call_id);
        }
        if matches!(old.part.kind, PartKind::Compaction(_)) {
            self.recompute_boundary();
        }
        Ok(Applied::default())
    }

    fn report_usage(
        &mut self,
        message_id: Option<&str>,
        tokens: TokenUsage,
    ) -> Result<Applied, ApplyError> {
        if let Some(id) = message_id.filter(|id| !id.is_empty()) {
            let Some(idx) = self.position(id) else {
                return Err(ApplyError::not_found(
                    "message_id",
                    format!("message {id} does not exist"),
                ));
            };
            let info = &mut self.messages[idx].info;
            if info.role != Role::Assistant {
                return Err(ApplyError::precondition(
                    "message_id",
                    format!("message {id} is a user message; usage belongs to assistant messages"),
                ));
            }
            info.tokens = Some(tokens);
        }
        self.record_usage(tokens);
        Ok(Applied {
            usage_reported: true,
            ..Applied::default()
        })
    }

    /// A provider report is the new baseline of the next request's size; what the model did
    /// not write since that request started is not in it. The same report twice (a
    /// `step-finish` and then its message) is one report.
    fn record_usage(&mut self, tokens: TokenUsage) {
        if self.usage.last == Some(tokens) {
            return;
        }
        let pending = self.usage.since_request;
        self.usage = UsageState {
            last: Some(tokens),
            delta: pending,
            since_request: 0,
            pruned: 0,
        };
    }

    /// Context tokens of a part that no provider usage covers yet: all of it, except what
    /// the model wrote in an assistant message (counted in the report's `output`).
    fn unwritten_tokens(&self, p: &StoredPart, assistant: bool) -> u64 {
        let written = if assistant { p.est.generated } else { 0 };
        self.context_tokens_of(p).saturating_sub(written)
    }

    /// Context-view tokens of one stored part under the current settings.
    pub(crate) fn context_tokens_of(&self, p: &StoredPart) -> u64 {
        p.reduced.unwrap_or(p.est.base + p.est.output)
    }

    /// Tokens of the part as rendered, when prune or a strategy reduced it.
    pub(crate) fn reduced_tokens(&self, part: &Part) -> Option<u64> {
        is_reduced(part, &self.settings).then(|| self.rendered_tokens(part, true))
    }

    /// Tokens of the part as rendered, with the input-leak fix as `strip_inputs` says
    /// (and only if the strategy is on).
    pub(crate) fn rendered_tokens(&self, part: &Part, strip_inputs: bool) -> u64 {
        self.rendered_tokens_as(part, part.mark.as_ref(), is_compacted(part), strip_inputs)
    }

    /// [`Self::rendered_tokens`] as if the part carried `mark` and prune's stamp as
    /// `compacted` says (nothing is cloned that the rendering replaces).
    pub(crate) fn rendered_tokens_as(
        &self,
        part: &Part,
        mark: Option<&crate::domain::StrategyMark>,
        compacted: bool,
        strip_inputs: bool,
    ) -> u64 {
        let strip = strip_inputs
            && self
                .settings
                .strategies
                .has(super::strategies::Strategy::PruneToolInputs);
        render_as(part, mark, compacted, &self.settings, strip).map_or(0, |r| {
            let e = estimate(&r, self.counter.as_ref());
            e.base + e.output
        })
    }

    /// Moves the running totals from `old` to `new` context tokens.
    pub(crate) fn adjust_tokens(&mut self, old: u64, new: u64) {
        self.tokens = self.tokens - old + new;
        self.usage.delta += new as i64 - old as i64;
    }

    /// Removes the marks naming `call_id` as the newer call (it was deleted).
    fn unmark_superseded_by(&mut self, call_id: &str) {
        for mi in 0..self.messages.len() {
            for pi in 0..self.messages[mi].parts.len() {
                let stored = &self.messages[mi].parts[pi];
                if stored
                    .part
                    .mark
                    .as_ref()
                    .is_none_or(|m| m.superseded_by.is_empty() || m.superseded_by != call_id)
                {
                    continue;
                }
                let old = self.context_tokens_of(stored);
                self.messages[mi].parts[pi].part.mark = None;
                let reduced = self.reduced_tokens(&self.messages[mi].parts[pi].part);
                self.messages[mi].parts[pi].reduced = reduced;
                let new = self.context_tokens_of(&self.messages[mi].parts[pi]);
                self.adjust_tokens(old, new);
            }
        }
    }

    /// Re-derives the context total after the settings changed (placeholder, strategies).
    fn recount_all(&mut self) {
        for mi in 0..self.messages.len() {
            for pi in 0..self.messages[mi].parts.len() {
                let reduced = self.reduced_tokens(&self.messages[mi].parts[pi].part);
                self.messages[mi].parts[pi].reduced = reduced;
            }
        }
        let total: u64 = self
            .messages
            .iter()
            .flat_map(|m| &m.parts)
            .map(|p| self.context_tokens_of(p))
            .sum();
        self.usage.delta += total as i64 - self.tokens as i64;
        self.tokens = total;
    }

    /// A summary (at `summary`) completed: its parent opens the context if it holds a
    /// compaction part and is newer than the current boundary. O(1).
    fn summary_completed(&mut self, parent: String, summary: usize) {
        if let Some(p) = self.position(&parent) {
            self.offer_boundary(p, summary);
        }
        self.completed_parents.insert(parent, summary);
    }

    /// A compaction part arrived on message `idx`: it opens the context if a completed
    /// summary already answers that message. O(1).
    fn compaction_part_added(&mut self, idx: usize) {
        if let Some(&summary) = self.completed_parents.get(&self.messages[idx].info.id) {
            self.offer_boundary(idx, summary);
        }
    }

    fn offer_boundary(&mut self, start: usize, summary: usize) {
        if has_compaction_part(&self.messages[start])
            && self.boundary.is_none_or(|b| start > b.start)
        {
            self.boundary = Some(Boundary { start, summary });
        }
    }

    /// Finds the newest completed compaction, as seed 02's `filterCompacted` walks it:
    /// newest first, a completed summary names its parent; the first user message that is
    /// such a parent and holds a compaction part opens the context. A full scan, run only
    /// when a compaction is undone (a summary loses `finish` or gains an error, a
    /// compaction part is deleted): never on ordinary updates.
    fn recompute_boundary(&mut self) {
        self.boundary = None;
        self.completed_parents.clear();
        for (i, m) in self.messages.iter().enumerate() {
            if m.info.is_completed_summary() {
                self.completed_parents.insert(m.info.parent_id.clone(), i);
            }
        }
        for (i, m) in self.messages.iter().enumerate().rev() {
            if let Some(&summary) = self.completed_parents.get(&m.info.id)
                && has_compaction_part(m)
            {
                self.boundary = Some(Boundary { start: i, summary });
                return;
            }
        }
    }
}

/// True for a user message that opens a compaction.
fn has_compaction_part(m: &Message) -> bool {
    m.info.role == Role::User
        && m.parts
            .iter()
            .any(|p| matches!(p.part.kind, PartKind::Compaction(_)))
}
