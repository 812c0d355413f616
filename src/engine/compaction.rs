//! The pure half of compaction: deciding what the summarizer sees, and recording its
//! summary exactly as OpenCode does. The LLM call itself lives in `summarize/`.
//!
//! - [`Session::plan_compaction`] splits the context into the *head* (summarized) and the
//!   *verbatim tail* (the last `tail_turns` user turns, at most `preserve_recent_tokens`; a
//!   turn too large for what is left keeps its newest messages that fit),
//!   and picks up the previous summary so it is folded in rather than summarized again.
//! - [`Session::commit_compaction`] appends, through the ordinary `apply` path, the user
//!   message with a `compaction` part (recording `tail_start_id`), the summary assistant
//!   message (`summary: true`, mode/agent `compaction`, finished) with compactd's
//!   deterministic anchors (todos, protected tool outputs) after the model's text, and on
//!   auto compaction the synthetic `Continue if you have next steps`. From then on the
//!   context starts at that boundary and prune stops at the summary.
//! - Pinned parts of the head are summarized with it and also carried verbatim after the
//!   summary (`context.rs`): they are not what the summary replaces, so the summary must
//!   be smaller than the head without them. A pinned protected output is carried that
//!   way alone, not in the summary's text too, so it is sent and subtracted once.
//!
//! Nothing here reads a clock or makes ids: both come in as arguments.

use serde::{Deserialize, Serialize};

use super::anchors;
use super::context::Keep;
use super::error::ApplyError;
use super::footprint::ByteLimit;
use super::prune::PruneReport;
use super::request_log::Scope;
use super::session::{Generation, Session};
use super::update::Update;
use crate::config::EngineConfig;
use crate::domain::{
    CompactionPart, MessageInfo, MessageTime, ModelRef, Part, PartKind, Role, TextPart, TokenUsage,
};

/// Text of the synthetic user message after an automatic compaction (seed 02).
pub const AUTO_CONTINUE: &str = crate::config::AUTO_CONTINUE_TEXT;
/// Mode and agent of a summary message (seed 02).
pub const COMPACTION_AGENT: &str = "compaction";

/// How a compaction was asked for, decided when it begins.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CompactionRequest {
    /// What to keep verbatim.
    pub tail: TailOptions,
    /// Started automatically (vs `/compact`): adds the auto-continue message.
    pub auto: bool,
    /// Started because the context overflowed.
    pub overflow: bool,
}

/// What to keep verbatim.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TailOptions {
    /// User turns kept after the summary (0: none).
    pub turns: u32,
    /// Most tokens the tail may hold; older turns are summarized instead.
    pub max_tokens: u64,
}

/// OpenCode's verbatim-tail budget: 25% of usable input, clamped to 2,000–15,000.
pub fn default_tail_tokens(usable_input: u64) -> u64 {
    (usable_input / 4).clamp(2_000, 15_000)
}

/// What a compaction summarizes and keeps, decided when it begins.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompactionPlan {
    /// Positions of the messages summarized, in context order.
    pub head: Vec<usize>,
    /// Position of the first message kept verbatim.
    pub tail_start: Option<usize>,
    /// Messages held when the compaction began; later ones stay after the summary.
    pub covers: usize,
    /// Text of the summary the context currently starts with, folded into the new one
    /// (without the protected outputs it carries: `carried_outputs` holds them).
    pub previous_summary: Option<String>,
    /// Protected tool outputs the previous summary carried, carried on verbatim ahead of
    /// the head's own (empty in a plan logged before they were carried on).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub carried_outputs: String,
    /// True when the previous summary's text is pinned, so the context keeps carrying it
    /// with its outputs: `carried_outputs` are then only kept from being carried twice.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub carried_by_pin: bool,
    /// Estimated tokens of the head (what the model summarizes).
    pub head_tokens: u64,
    /// Estimated tokens the summary replaces: the head without its pinned parts (they
    /// stay), plus the previous compaction's two messages when a summary is folded in
    /// (without their pinned parts either), less the protected outputs the summary
    /// message carries on verbatim.
    pub replaced_tokens: u64,
    /// Estimated tokens of the whole context when the compaction began.
    pub tokens_before: u64,
    /// How it was asked for.
    pub request: CompactionRequest,
    /// The session value the plan was made on and who `head` and `tail_start` named
    /// there, so the commit can tell the session is still that value and holds them
    /// there. `None` in a plan read back from the log: a logged commit was checked when
    /// performed, and replaying it meets the same state.
    #[serde(skip)]
    held: Option<HeldIds>,
}

impl CompactionPlan {
    /// Id of the first message kept verbatim, as planned (for the `started` event).
    pub fn tail_start_id(&self) -> Option<&str> {
        self.held.as_ref().and_then(|h| h.tail_start.as_deref())
    }

    /// The session value the plan was made on (`None` in a plan read back from the log).
    pub fn generation(&self) -> Option<Generation> {
        self.held.as_ref().map(|h| h.generation)
    }
}

/// What a plan's positions named: the session value (its [`Generation`]), the ids of
/// the summarized head, in the plan's order, and of the first message kept verbatim.
/// Messages are never removed from a session, so only a session replaced under the same
/// id (an import, a delete and re-create) holds other messages there; and a replacement
/// holding the same ids (the same export imported again) is another generation.
#[derive(Debug, Clone, PartialEq, Eq)]
struct HeldIds {
    generation: Generation,
    head: Vec<String>,
    /// What the host had last changed of each head message ([`super::stored::Message::edit`]).
    edits: Vec<u64>,
    /// The session's edit clock when planned: every later edit's stamp is larger.
    edit_clock: u64,
    tail_start: Option<String>,
}

/// Why a compaction cannot start or cannot be recorded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CompactionError {
    /// Everything in the context is the verbatim tail (or the context is empty).
    #[error("nothing to compact: the context holds only the verbatim tail")]
    NothingToCompact,
    /// The model returned no text.
    #[error("the summary is empty")]
    EmptySummary,
    /// The summary would not make the context smaller.
    #[error("the summary ({summary} tokens) is not smaller than what it replaces ({head} tokens)")]
    NotSmaller {
        /// Summary tokens.
        summary: u64,
        /// Head tokens.
        head: u64,
    },
    /// Recording the messages failed (an id collided).
    #[error("recording the summary failed: {0}")]
    Apply(#[from] ApplyError),
    /// The session no longer holds the messages the plan summarized where it found them,
    /// or is another session value holding the same ids: it was replaced (imported over,
    /// deleted and re-created) while the summary was written.
    /// Nothing is recorded; a new compaction plans what the session holds now.
    #[error("the session changed while the summary was written: {0}")]
    Stale(String),
}

/// Ids for the messages a commit creates; the caller makes them unique.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CommitIds {
    /// Prefix every created id starts with (e.g. `cmp_<n>`).
    pub prefix: String,
}

impl CommitIds {
    fn id(&self, what: &str) -> String {
        format!("{}_{what}", self.prefix)
    }
}

/// Which message of a commit a message is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CommitMessage {
    /// The user message holding the compaction part.
    Request,
    /// The summary answering it (finished, not failed).
    Summary,
    /// The auto-continue after an automatic compaction's summary.
    Continue,
}

/// The commit `m` is a message of, by the ids [`Session::commit_compaction`] gave it and
/// its first part (`<prefix>_user` holding `<prefix>_compaction`, ...): compactd's own
/// messages, which a host's history never holds, told apart from a host's compaction of
/// the same shape. Returns the kind and the commit's prefix.
pub(crate) fn commit_message(m: &super::stored::Message) -> Option<(CommitMessage, &str)> {
    let id = m.info.id.as_str();
    let first = m.parts.first().map(|p| (p.part.id.as_str(), &p.part.kind));
    let named = |prefix: &str, what: &str| {
        first.is_some_and(|(part, _)| {
            part.strip_prefix(prefix)
                .and_then(|rest| rest.strip_prefix('_'))
                == Some(what)
        })
    };
    if let Some(p) = id.strip_suffix("_user") {
        let compaction = matches!(first, Some((_, PartKind::Compaction(_))));
        return (m.info.role == Role::User && compaction && named(p, "compaction"))
            .then_some((CommitMessage::Request, p));
    }
    if let Some(p) = id.strip_suffix("_summary") {
        let answers = m.info.parent_id.strip_suffix("_user") == Some(p);
        return (m.info.role == Role::Assistant
            && m.info.is_completed_summary()
            && answers
            && named(p, "summary_text"))
        .then_some((CommitMessage::Summary, p));
    }
    if let Some(p) = id.strip_suffix("_continue") {
        let synthetic = matches!(first, Some((_, PartKind::Text(t))) if t.synthetic);
        return (m.info.role == Role::User && synthetic && named(p, "continue_text"))
            .then_some((CommitMessage::Continue, p));
    }
    None
}

/// The model's answer, as the summarizer received it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SummaryOutcome {
    /// The summary text.
    pub text: String,
    /// Usage the provider reported for the compaction request, if any.
    pub usage: Option<TokenUsage>,
    /// Cost, when a price is configured.
    #[serde(with = "crate::config::float")]
    pub cost: f64,
    /// The model that wrote it.
    pub model: Option<ModelRef>,
}

impl SummaryOutcome {
    /// Adds what `other` cost (its usage and cost, not its text) to this one's: the
    /// spend of a compaction is every answer paid for, dropped ones included. Sums
    /// saturate (the numbers come from the endpoint).
    pub fn add_spend(&mut self, other: &SummaryOutcome) {
        if let Some(u) = &other.usage {
            let sum = self.usage.get_or_insert_with(Default::default);
            sum.input = sum.input.saturating_add(u.input);
            sum.output = sum.output.saturating_add(u.output);
            sum.total = Some(sum.input.saturating_add(sum.output));
        }
        self.cost += other.cost;
    }
}

/// What a commit recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Committed {
    /// The compaction's user message.
    pub user_message_id: String,
    /// The summary message.
    pub summary_message_id: String,
    /// Context tokens before and after.
    pub tokens_before: u64,
    /// Context tokens after the commit.
    pub tokens_after: u64,
    /// Tokens of the summary message (model text plus anchors).
    pub summary_tokens: u64,
    /// What the commit applied of the decisions the cache-aware scheduler held (none
    /// when it changed nothing), for the host to hear of as an automatic prune.
    pub pruned: Option<PruneReport>,
}

impl Session {
    /// Decides what a compaction beginning now would summarize and keep.
    pub fn plan_compaction(
        &self,
        request: CompactionRequest,
    ) -> Result<CompactionPlan, CompactionError> {
        let mut order = self.context_order();
        let tokens_before = self.context_tokens();
        let mut previous_summary = None;
        let mut carried_outputs = String::new();
        let mut carried_by_pin = false;
        let mut previous_tokens = 0;
        if let Some(b) = self.boundary() {
            let text = self.text_of(b.summary);
            // Only compactd's own summary carries outputs on; a host's is text only.
            let own = commit_message(&self.messages()[b.summary])
                .is_some_and(|(kind, _)| kind == CommitMessage::Summary);
            let (summary, carried) = if own {
                anchors::split_carried(&text)
            } else {
                (text.as_str(), "")
            };
            carried_outputs = carried.to_string();
            carried_by_pin = !carried.is_empty() && self.text_pinned(b.summary);
            previous_summary = Some(summary.to_string());
            // A pinned part of the pair stays in the context after the commit.
            previous_tokens = self
                .unpinned_tokens(b.start)
                .saturating_add(self.unpinned_tokens(b.summary));
            order.retain(|&i| i != b.start && i != b.summary);
        }
        let tail_start = self.tail_start(&order, request.tail);
        let head: Vec<usize> = match tail_start {
            Some(t) => order.iter().copied().take_while(|&i| i != t).collect(),
            None => order,
        };
        if head.is_empty() {
            return Err(CompactionError::NothingToCompact);
        }
        let head_tokens: u64 = head.iter().map(|&i| self.message_tokens(i)).sum();
        let pinned_tokens: u64 = head.iter().map(|&i| self.pinned_tokens(i)).sum();
        // What the summary message carries verbatim (todos, protected outputs, their
        // headings) is not replaced by the model's text.
        let anchors = self.anchors(&head, &carried_outputs, !carried_by_pin);
        let kept_tokens = self.counter().count(&anchors);
        let held = HeldIds {
            generation: self.generation(),
            head: head.iter().filter_map(|&i| self.id_at(i)).collect(),
            edits: head.iter().map(|&i| self.edit_of(i)).collect(),
            edit_clock: self.edit_clock(),
            tail_start: tail_start.and_then(|i| self.id_at(i)),
        };
        Ok(CompactionPlan {
            replaced_tokens: head_tokens
                .saturating_sub(pinned_tokens)
                .saturating_add(previous_tokens)
                .saturating_sub(kept_tokens),
            head,
            tail_start,
            covers: self.messages().len(),
            previous_summary,
            carried_outputs,
            carried_by_pin,
            head_tokens,
            tokens_before,
            request,
            held: Some(held),
        })
    }

    /// The head as the summarizer sees it: rendered like the context (placeholders for
    /// cleared outputs, interrupted tools as errors).
    pub fn head_view(&self, plan: &CompactionPlan) -> super::ContextView {
        let len = self.messages().len();
        self.view_of(
            plan.head
                .iter()
                .filter(|&&i| i < len)
                .map(|&i| (i, Keep::All)),
        )
    }

    /// Id of the message at position `i`, if there is one.
    fn id_at(&self, i: usize) -> Option<String> {
        self.messages().get(i).map(|m| m.info.id.clone())
    }

    /// Checks the session still holds, where the plan found them, the messages it
    /// summarizes and the first one it keeps, and is the session value the plan was made
    /// on: a plan outlives the actor job that made it (the summary is written outside),
    /// and the session may be replaced meanwhile.
    fn check_still_holds(&self, plan: &CompactionPlan) -> Result<(), CompactionError> {
        let messages = self.messages();
        let held = plan.held.as_ref();
        if held.is_some_and(|h| {
            h.head.len() != plan.head.len() || h.tail_start.is_some() != plan.tail_start.is_some()
        }) {
            return Err(CompactionError::Stale(
                "the plan's ids do not match its positions".into(),
            ));
        }
        let head =
            (plan.head.iter().enumerate()).map(|(k, &i)| (i, held.and_then(|h| h.head.get(k))));
        let tail = (plan.tail_start).map(|i| (i, held.and_then(|h| h.tail_start.as_ref())));
        for (i, id) in head.chain(tail) {
            let Some(m) = messages.get(i) else {
                return Err(CompactionError::Stale(format!(
                    "position {i} of the plan is past the session's {} messages",
                    messages.len()
                )));
            };
            if let Some(id) = id
                && m.info.id != *id
            {
                return Err(CompactionError::Stale(format!(
                    "message {id} is no longer at position {i} ({} is)",
                    m.info.id
                )));
            }
        }
        // The same ids where the plan found them, in another session value: the same
        // conversation imported again, or re-created with the same ids. Its messages may
        // hold other content than the summary was written from.
        if held.is_some_and(|h| h.generation != self.generation()) {
            return Err(CompactionError::Stale(
                "it was replaced under the same id".into(),
            ));
        }
        // A summarized message the host wrote to meanwhile: the summary holds it as it
        // was, and the commit would send the change to no later request. A session the
        // store loaded back as the same value (sent cold, rebuilt by its actor) was given
        // back what it knew of its edits, and one whose stamp that forgot counts as
        // changed unless nothing forgotten came after the plan.
        if let Some(h) = held
            && let Some((_, &i)) = (h.edits.iter().zip(&plan.head))
                .find(|&(&edit, &i)| self.changed_since(i, edit, h.edit_clock))
        {
            return Err(CompactionError::Stale(format!(
                "message {} changed after the summary began",
                self.id_at(i).unwrap_or_default()
            )));
        }
        Ok(())
    }

    /// The earliest of the last `turns` user messages whose suffix fits the budget. A turn
    /// too large for what is left keeps its newest messages that fit and ends the tail
    /// (OpenCode's `splitTurn`): an agent deep in one long turn keeps its latest steps.
    fn tail_start(&self, order: &[usize], tail: TailOptions) -> Option<usize> {
        if tail.turns == 0 {
            return None;
        }
        let mut suffix = 0u64;
        let mut turns = 0;
        let mut start = None;
        // The oldest message that fits so far: where a split turn starts.
        let mut fits: Option<usize> = None;
        for &i in order.iter().rev() {
            suffix = suffix.saturating_add(self.message_tokens(i));
            if suffix > tail.max_tokens {
                // A message that fits after a user message is part of this turn.
                if let Some(j) = fits.filter(|&j| self.messages()[j].info.role != Role::User) {
                    start = Some(j);
                }
                break;
            }
            fits = Some(i);
            if self.messages()[i].info.role == Role::User {
                start = Some(i);
                turns += 1;
                if turns == tail.turns {
                    break;
                }
            }
        }
        start
    }

    /// Context tokens message `i` sends: none for one the context does not send (an
    /// errored assistant message).
    fn message_tokens(&self, i: usize) -> u64 {
        let m = &self.messages()[i];
        if !m.is_sent() {
            return 0;
        }
        m.parts.iter().map(|p| p.context_tokens()).sum()
    }

    /// Context tokens of the pinned parts of message `i` (carried past a compaction):
    /// none for one the context does not send, as [`Self::message_tokens`] counts it.
    fn pinned_tokens(&self, i: usize) -> u64 {
        if self.pins().is_empty() || !self.messages()[i].is_sent() {
            return 0;
        }
        self.messages()[i]
            .parts
            .iter()
            .filter(|p| self.is_pinned(i, &p.part.id))
            .map(|p| p.context_tokens())
            .sum()
    }

    /// Context tokens of message `i` less its pinned parts: what leaves the context when
    /// a compaction summarizes it.
    fn unpinned_tokens(&self, i: usize) -> u64 {
        self.message_tokens(i).saturating_sub(self.pinned_tokens(i))
    }

    /// Text parts of a message, joined (the summary text of a summary message).
    pub(super) fn text_of(&self, i: usize) -> String {
        let texts: Vec<&str> = self.messages()[i]
            .parts
            .iter()
            .filter_map(|p| match &p.part.kind {
                PartKind::Text(t) if !t.ignored => Some(t.text.as_str()),
                _ => None,
            })
            .collect();
        texts.join("\n\n")
    }

    /// Records a finished compaction. Checks first that the session still holds what the
    /// plan summarized (else [`CompactionError::Stale`]), then the summary (non-empty,
    /// smaller than what it replaces: the head and any previous summary); on error the
    /// session is unchanged.
    pub fn commit_compaction(
        &mut self,
        plan: &CompactionPlan,
        outcome: &SummaryOutcome,
        ids: &CommitIds,
        now_ms: i64,
        config: &EngineConfig,
    ) -> Result<Committed, CompactionError> {
        self.check_still_holds(plan)?;
        let model_text = outcome.text.trim();
        if model_text.is_empty() {
            return Err(CompactionError::EmptySummary);
        }
        let model_tokens = self.counter().count(model_text);
        // Replayed, the summary is counted by the tokenizer the session resolves now,
        // which need not be the one that admitted it.
        if model_tokens >= plan.replaced_tokens && !self.replaying {
            return Err(CompactionError::NotSmaller {
                summary: model_tokens,
                head: plan.replaced_tokens,
            });
        }
        let (auto, overflow) = (plan.request.auto, plan.request.overflow);
        // Outputs a pin unset meanwhile would carry no longer: carried on after all.
        let still_pinned = self.boundary().is_some_and(|b| self.text_pinned(b.summary));
        let carry_on = !(plan.carried_by_pin && still_pinned);
        let anchors = self.anchors(&plan.head, &plan.carried_outputs, carry_on);
        let text = if anchors.is_empty() {
            model_text.to_string()
        } else {
            format!("{model_text}\n\n{anchors}")
        };
        // The first message not summarized: the tail, or whatever arrived meanwhile.
        let tail_start_id = plan
            .tail_start
            .or((plan.covers < self.messages().len()).then_some(plan.covers))
            .and_then(|i| self.id_at(i))
            .unwrap_or_default();

        let user_id = ids.id("user");
        let summary_id = ids.id("summary");
        let mut updates = Vec::new();
        let mut user = MessageInfo::new(user_id.clone(), Role::User);
        user.time = MessageTime {
            created: now_ms,
            completed: None,
        };
        user.agent = self.last_user_agent();
        user.model = self.info().model.clone();
        updates.push(Update::UpsertMessage(user));
        updates.push(Update::UpsertPart(Part {
            id: ids.id("compaction"),
            message_id: user_id.clone(),
            kind: PartKind::Compaction(CompactionPart {
                auto,
                overflow,
                tail_start_id,
            }),
            mark: None,
            extra: Default::default(),
        }));
        let mut summary = MessageInfo::new(summary_id.clone(), Role::Assistant);
        summary.parent_id = user_id.clone();
        summary.summary = true;
        summary.mode = COMPACTION_AGENT.into();
        summary.agent = COMPACTION_AGENT.into();
        summary.time = MessageTime {
            created: now_ms,
            completed: Some(now_ms),
        };
        summary.tokens = outcome.usage;
        summary.cost = outcome.cost;
        summary.model = outcome.model.clone();
        // Unfinished first, text, then finished: the order a live host uses, so the
        // boundary moves only once the summary is complete.
        updates.push(Update::UpsertMessage(MessageInfo {
            finish: String::new(),
            ..summary.clone()
        }));
        updates.push(Update::UpsertPart(Part {
            id: ids.id("summary_text"),
            message_id: summary_id.clone(),
            kind: PartKind::Text(TextPart {
                text,
                ..Default::default()
            }),
            mark: None,
            extra: Default::default(),
        }));
        updates.push(Update::UpsertMessage(MessageInfo {
            finish: "stop".into(),
            ..summary
        }));
        if auto {
            let cont_id = ids.id("continue");
            let mut cont = MessageInfo::new(cont_id.clone(), Role::User);
            cont.time = MessageTime {
                created: now_ms,
                completed: None,
            };
            cont.agent = self.last_user_agent();
            updates.push(Update::UpsertMessage(cont));
            updates.push(Update::UpsertPart(Part {
                id: ids.id("continue_text"),
                message_id: cont_id,
                kind: PartKind::Text(TextPart {
                    text: self.settings().auto_continue.clone(),
                    synthetic: true,
                    ..Default::default()
                }),
                mark: None,
                extra: Default::default(),
            }));
        }
        // Ids are fresh, so nothing below can collide with the session's messages; check
        // anyway so a reused prefix fails cleanly before anything changes.
        // The continue message too: taken, it would be updated in place (or, an assistant
        // message, refused half way through the commit).
        let continue_taken = auto && self.position(&ids.id("continue")).is_some();
        if self.position(&user_id).is_some()
            || self.position(&summary_id).is_some()
            || continue_taken
        {
            return Err(ApplyError::precondition(
                "compaction_id",
                format!("ids {} are taken", ids.prefix),
            )
            .into());
        }
        // All or nothing: the byte limits are checked once for the whole commit (an upper
        // bound of what it adds), so no update in the middle can be refused and leave a
        // compaction without its summary.
        self.check_growth("", 0, self.growth_of(&updates))?;
        let limit = self.byte_limit();
        self.set_byte_limit(ByteLimit::NONE);
        let applied = updates
            .into_iter()
            .try_for_each(|u| self.apply(u, config).map(drop));
        self.set_byte_limit(limit);
        applied?;
        // Nothing of the reordered context is cached: what the scheduler held to spare
        // the cache applies free of cost now. After an automatic compaction no host
        // message follows to apply it (the cold-cache rule) before the request that
        // continues. Under a flat cache model nothing is held.
        let pruned = (self.settings().prune && !self.settings().cache_model.is_flat())
            .then(|| self.prune_scoped(now_ms, Scope::All))
            .filter(PruneReport::changed);
        let tokens_after = self.context_tokens();
        // The last report described the old context: the next request is the new one.
        self.compaction_committed(tokens_after);
        let summary_tokens = self
            .position(&summary_id)
            .map_or(0, |i| self.message_tokens(i));
        Ok(Committed {
            user_message_id: user_id,
            summary_message_id: summary_id,
            tokens_before: plan.tokens_before,
            tokens_after,
            summary_tokens,
            pruned,
        })
    }

    /// Called after each finished (non-summary) assistant message: counts the cooldown
    /// down and says whether an overflowing session may start an automatic compaction.
    pub fn auto_compaction_allowed(&mut self, overflow: bool) -> bool {
        let cooled_down = self.auto_mut().finished_message();
        cooled_down && overflow && !self.auto_compaction_paused()
    }

    /// True once `breaker_failures` automatic compactions failed in a row.
    pub fn auto_compaction_paused(&self) -> bool {
        self.auto_state().paused(self.settings().breaker_failures)
    }

    /// Records how a compaction ended. A success (or any manual compaction attempt that
    /// succeeds) closes the breaker; a success that leaves the context over the threshold
    /// starts the cooldown; an automatic failure counts toward the breaker. Returns true
    /// when this failure paused auto-compaction.
    pub fn record_compaction(&mut self, auto: bool, ok: bool) -> bool {
        if ok {
            let still_over = self.check_overflow(super::Trigger::Request).overflow;
            let cooldown = if still_over {
                self.settings().auto_cooldown
            } else {
                0
            };
            self.auto_mut().succeeded(cooldown);
            return false;
        }
        if !auto {
            return false;
        }
        let was_paused = self.auto_compaction_paused();
        self.auto_mut().failed();
        !was_paused && self.auto_compaction_paused()
    }

    fn last_user_agent(&self) -> String {
        self.users()
            .last()
            .map(|&i| self.messages()[i].info.agent.clone())
            .unwrap_or_default()
    }
}
