//! The [`Session`] value: messages and parts in arrival order, plus the running figures
//! (token totals, usage since the last report, prune window, compaction boundary) that
//! keep every per-update decision independent of session length.
//!
//! `apply` is the only way to change a session from outside the engine. It validates
//! first and mutates after, so a rejected update leaves the session exactly as it was.
//!
//! Invariant: the fields are private to this file. The other engine files read through
//! accessors and change a part's rendering only through [`Session::rerender`], so the
//! running figures ([`Totals`]) have one writer and always equal a recount.

use std::mem::size_of;

use serde::{Deserialize, Serialize};

use super::auto::AutoState;
use super::calibration::{
    Anchor, Calibration, Class, Factors, PredictionSample, prompt_tokens, tool_class,
};
use super::edits::Edits;
use super::error::ApplyError;
use super::estimate::{PartEstimate, estimate, estimate_over};
use super::footprint::{
    ByteLimit, info_bytes, message_bytes, part_bytes, part_slot_growth, part_slots_bytes, pin_bytes,
};
use super::part_index::PartIndex;
use super::pins::Pins;
use super::prune_index::{PruneIndex, PrunePlan};
use super::render::{Rendered, is_compacted, is_reduced, rendered_tokens_as};
use super::request_log::RequestLog;
use super::stored::{Message, Revision, StoredPart};
use super::strategies::{FileUse, Pending, Tracker, cap_chars, file_use};
use super::token_index::TokenIndex;
use super::totals::{PartFigures, Totals, UsageState};
use super::update::{Applied, Update};
use crate::config::{EngineConfig, Settings, Strategy};
use crate::domain::{
    FastMap, FastSet, MessageInfo, Part, PartKind, Role, SessionInfo, StrategyMark, TokenUsage,
    ToolStatus,
};
use crate::tokens::{Counting, TokenCounter};

/// The last completed compaction: the user message that opened it (with the compaction
/// part) and its summary. The context starts here.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Boundary {
    /// The compaction's user message.
    pub start: usize,
    /// Its completed summary (assistant, `summary: true`).
    pub summary: usize,
}

/// How [`Session::rerender`] changes a part's rendering.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Rendering {
    /// A strategy's mark is set (`Some`) or removed (`None`).
    Mark(Option<StrategyMark>),
    /// Prune clears the output at this time (`time.compacted`).
    Cleared(i64),
    /// Prune's stamp is removed: the output reads verbatim again (a pin restores it).
    Restored,
}

/// Undo log of a trial run (a prune dry run): the prior rendering of every part
/// [`Session::rerender`] changed, and the figures before the first change.
#[derive(Debug, Clone)]
struct Journal {
    totals: Totals,
    parts: Vec<PriorRendering>,
}

/// What a trial run changed among the parts a request has already sent (the cache
/// scheduler's rewrite cost), from [`Session::sent_changes`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SentChanges {
    /// The earliest changed part (message, part).
    pub(crate) first: (usize, usize),
    /// Context tokens the changed parts lost (those that shrank).
    pub(crate) saved: u64,
    /// Context tokens the changed parts gained (those that grew: a prune placeholder
    /// longer than a short output).
    pub(crate) grown: u64,
}

/// A part's rendering fields at one moment (mark, prune stamp, reduced size): what a
/// trial rolls back to.
#[derive(Debug, Clone)]
struct RenderingAt {
    msg: usize,
    pi: usize,
    mark: Option<StrategyMark>,
    compacted_at: Option<i64>,
    reduced: Option<u64>,
}

impl RenderingAt {
    /// The rendering fields of `stored`, at (`msg`, `pi`).
    fn of(stored: &StoredPart, msg: usize, pi: usize) -> RenderingAt {
        RenderingAt {
            msg,
            pi,
            mark: stored.part.mark.clone(),
            compacted_at: match &stored.part.kind {
                PartKind::Tool(t) => t.state.time.compacted,
                _ => None,
            },
            reduced: stored.reduced,
        }
    }
}

/// A part's rendering before a trial changed it.
#[derive(Debug, Clone)]
struct PriorRendering {
    rendering: RenderingAt,
    /// Its context tokens before the change.
    tokens: u64,
    /// Its message's revision before the change: rolled back, the message reads as it did
    /// under it again, so a rendering cached under it stays good.
    rev: u64,
}

/// A session: the unit the store owns and the engine computes on.
#[derive(Debug)]
pub struct Session {
    info: SessionInfo,
    settings: Settings,
    /// What counts this session's text: its `tokenizer` setting resolved for its model.
    counting: Counting,
    messages: Vec<Message>,
    by_id: FastMap<String, usize>,
    /// Positions of user messages, ascending (turn counting without a scan).
    users: Vec<usize>,
    /// Position of the user message that opens the context (last completed compaction).
    boundary: Option<Boundary>,
    /// Parent id → position of its newest completed summary (so a late compaction part
    /// finds its summary).
    completed_parents: FastMap<String, usize>,
    /// Token, part and byte totals and the usage bookkeeping.
    totals: Totals,
    /// Loop protection of automatic compaction.
    auto: AutoState,
    prune: PruneIndex,
    /// Incremental state of the aggressive strategies.
    tracker: Tracker,
    /// Parts and messages the host pinned (never reduced, carried through compaction).
    pins: Pins,
    /// The most bytes the session may hold after the next update.
    byte_limit: ByteLimit,
    /// Set during a trial run, which is rolled back at its end.
    journal: Option<Journal>,
    /// Context tokens per message (where a cached prefix ends, in O(log n)).
    by_msg: TokenIndex,
    /// The requests so far, for the cache-aware scheduler.
    requests: RequestLog,
    /// Each part's position in its message, by id.
    part_index: PartIndex,
    /// Which session value this is (kept by a copy and by a copy its store restores as
    /// the same value; new for a session created, imported or loaded anew): a compaction
    /// planned on another value is stale.
    generation: Generation,
    /// The host's edits beyond each message's stamp: the edit clock, the latest edited
    /// messages (`edits.rs`). Not stored (nor is `Message::edit`): kept by a copy, and
    /// by a session the store loads back as the same value ([`Session::resume`],
    /// [`Session::resume_from`]), so a compaction planned before still sees a change.
    edits: Edits,
    /// True while [`Session::replay`] performs a logged change: what was admitted once is
    /// not refused again by an admission limit the server's flags have lowered since.
    pub(super) replaying: bool,
}

/// Which session value a [`Session`] is: one process-wide counter hands a new one to
/// every session created, imported (built anew) or loaded from disk, and a copy keeps its
/// original's (so does a session the store sent cold and loads back in the same process,
/// or rebuilds from the disk after a refused commit or a panicking job:
/// [`Session::resume`], [`Session::resume_from`]). A session replaced under the same id (an import over it, a delete and
/// re-create) is therefore another generation even when it holds the same message ids.
/// Not stored: it names a value in this process only.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Generation(u64);

impl Generation {
    /// A generation never handed out before in this process.
    fn next() -> Generation {
        use std::sync::atomic::{AtomicU64, Ordering};
        static NEXT: AtomicU64 = AtomicU64::new(1);
        Generation(NEXT.fetch_add(1, Ordering::Relaxed))
    }
}

/// What the store keeps of a session it sends cold, so that loading it back gives the
/// same value ([`Session::to_resume`], [`Session::resume`]): its [`Generation`] and,
/// bounded, the host's edits of its messages (a compaction planned before sees them).
/// Small and `Copy`: kept for every cold session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resume {
    generation: Generation,
    edits: Edits,
}

impl std::fmt::Display for Generation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl Clone for Session {
    /// A copy whose byte figure describes the copy: cloned vectors hold exactly their
    /// length, so the part slots are recounted. Every field is named (no `..`), so a new
    /// field cannot be forgotten here.
    fn clone(&self) -> Self {
        let Session {
            info,
            settings,
            counting,
            messages,
            by_id,
            users,
            boundary,
            completed_parents,
            totals,
            auto,
            prune,
            tracker,
            pins,
            byte_limit,
            journal: _,
            by_msg,
            requests,
            part_index,
            generation,
            edits,
            replaying: _,
        } = self;
        let mut messages = messages.clone();
        // A copy changes apart from its original: its messages take their own revisions.
        messages.iter_mut().for_each(|m| m.rev = Revision::next());
        let part_slots = messages.iter().map(|m| m.parts.capacity()).sum();
        Session {
            info: info.clone(),
            settings: settings.clone(),
            counting: *counting,
            messages,
            by_id: by_id.clone(),
            users: users.clone(),
            boundary: *boundary,
            completed_parents: completed_parents.clone(),
            totals: totals.with_part_slots(part_slots),
            auto: *auto,
            prune: prune.clone(),
            tracker: tracker.clone(),
            pins: pins.clone(),
            byte_limit: *byte_limit,
            journal: None,
            by_msg: by_msg.clone(),
            requests: *requests,
            part_index: part_index.clone(),
            generation: *generation,
            edits: *edits,
            replaying: false,
        }
    }
}

/// What a snapshot holds of a session (`snapshot.rs` writes it): every field that is
/// state. Not stored: the indexes rebuilt from the messages (`by_id`, `users`,
/// `part_index`), the tokenizer (resolved from the settings), the byte limit (the store sets it
/// before every job) and the journal (only set inside a trial run). The map is written
/// sorted, so the same session gives the same bytes.
#[derive(Serialize)]
struct StateRef<'a> {
    info: &'a SessionInfo,
    settings: &'a Settings,
    messages: &'a [Message],
    boundary: Option<Boundary>,
    completed_parents: Vec<(&'a String, &'a usize)>,
    totals: &'a Totals,
    auto: AutoState,
    prune: &'a PruneIndex,
    tracker: &'a Tracker,
    pins: &'a Pins,
    by_msg: &'a TokenIndex,
    requests: RequestLog,
}

/// A decoded snapshot, before [`Session::from_state`] checks it and rebuilds the indexes.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct SessionState {
    info: SessionInfo,
    settings: Settings,
    messages: Vec<Message>,
    boundary: Option<Boundary>,
    #[serde(with = "super::sorted::map")]
    completed_parents: FastMap<String, usize>,
    totals: Totals,
    auto: AutoState,
    prune: PruneIndex,
    tracker: Tracker,
    pins: Pins,
    by_msg: TokenIndex,
    requests: RequestLog,
}

impl Serialize for Session {
    /// The session's state (see `StateRef`). Every field is named (no `..`), so a new
    /// field cannot be forgotten here.
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        debug_assert!(self.journal.is_none(), "a snapshot inside a trial run");
        let Session {
            info,
            settings,
            counting: _,
            messages,
            by_id: _,
            users: _,
            boundary,
            completed_parents,
            totals,
            auto,
            prune,
            tracker,
            pins,
            byte_limit: _,
            journal: _,
            by_msg,
            requests,
            part_index: _,
            generation: _,
            edits: _,
            replaying: _,
        } = self;
        let mut parents: Vec<(&String, &usize)> = completed_parents.iter().collect();
        parents.sort_unstable();
        StateRef {
            info,
            settings,
            messages,
            boundary: *boundary,
            completed_parents: parents,
            totals,
            auto: *auto,
            prune,
            tracker,
            pins,
            by_msg,
            requests: *requests,
        }
        .serialize(s)
    }
}

/// Bytes an empty session holds: the value, its info and its resolved settings.
fn session_bytes(info: &SessionInfo, settings: &Settings) -> u64 {
    (size_of::<Session>() as u64).saturating_add(info_bytes(info, settings))
}

impl Session {
    /// A new, empty session with settings resolved from `config` and the info's overrides.
    pub fn new(info: SessionInfo, config: &EngineConfig) -> Self {
        let settings = config.resolve(&info.config);
        let counting = counting_for(&info, &settings);
        let mut tracker = Tracker::new(&settings);
        tracker.set_cap_chars(output_cap_chars(&info, &settings));
        let bytes = session_bytes(&info, &settings);
        Session {
            info,
            settings,
            counting,
            messages: Vec::new(),
            by_id: FastMap::default(),
            users: Vec::new(),
            boundary: None,
            completed_parents: FastMap::default(),
            totals: Totals::new(bytes),
            auto: AutoState::default(),
            prune: PruneIndex::default(),
            tracker,
            pins: Pins::default(),
            byte_limit: ByteLimit::NONE,
            journal: None,
            by_msg: TokenIndex::default(),
            requests: RequestLog::default(),
            part_index: PartIndex::default(),
            generation: Generation::next(),
            edits: Edits::default(),
            replaying: false,
        }
    }

    /// A session from its decoded state: checks that every position it holds points into
    /// its messages (so a damaged snapshot is refused here rather than panicking later),
    /// rebuilds the indexes over the messages, and counts the bytes the decoded values
    /// hold (what the live session's figure meant: the decoder's capacities are not the
    /// live ones, so they are not stored) and the part vector slots, as [`Clone`] does.
    /// The byte limit is none until the store sets one.
    pub(crate) fn from_state(state: SessionState) -> Result<Session, String> {
        let SessionState {
            info,
            settings,
            messages,
            boundary,
            completed_parents,
            totals,
            auto,
            prune,
            mut tracker,
            pins,
            by_msg,
            requests,
        } = state;
        let len = messages.len();
        let mut by_id = FastMap::with_capacity_and_hasher(len, Default::default());
        let mut users = Vec::new();
        let mut part_index = PartIndex::default();
        let mut messages = messages;
        let mut bytes = session_bytes(&info, &settings).saturating_add(pins.bytes());
        for (i, m) in messages.iter_mut().enumerate() {
            m.rev = Revision::next();
            bytes = bytes.saturating_add(message_bytes(&m.info));
            if by_id.insert(m.info.id.clone(), i).is_some() {
                return Err(format!("message id {:?} is held twice", m.info.id));
            }
            if m.info.role == Role::User {
                users.push(i);
            }
            let mut ids = FastSet::with_capacity_and_hasher(m.parts.len(), Default::default());
            for (pi, p) in m.parts.iter_mut().enumerate() {
                p.bytes = part_bytes(&p.part);
                bytes = bytes.saturating_add(p.bytes);
                if p.part.message_id != m.info.id || !ids.insert(p.part.id.clone()) {
                    return Err(format!(
                        "part {:?} of message {:?} is held twice or names another message",
                        p.part.id, m.info.id
                    ));
                }
                part_index.inserted(i, &p.part.id, pi);
            }
        }
        let fits = |at: usize| at < len;
        if boundary.is_some_and(|b| !fits(b.start) || !fits(b.summary)) {
            return Err("the compaction boundary is past the messages".into());
        }
        if !completed_parents.values().all(|&i| fits(i)) {
            return Err("a completed summary is past the messages".into());
        }
        if !pins.positions().all(fits) {
            return Err("a pin is past the messages".into());
        }
        if by_msg.len_capacity().0 != len {
            return Err(format!(
                "the token index holds {} messages, the session {len}",
                by_msg.len_capacity().0
            ));
        }
        if !prune.fits(&messages) {
            return Err("the prune window points past the messages".into());
        }
        if !tracker.fits(len) {
            return Err("the strategies' state points past the messages".into());
        }
        tracker.restored(&settings);
        let counting = counting_for(&info, &settings);
        let part_slots = messages.iter().map(|m| m.parts.capacity()).sum();
        Ok(Session {
            info,
            settings,
            counting,
            messages,
            by_id,
            users,
            boundary,
            completed_parents,
            totals: totals.restored(bytes, part_slots),
            auto,
            prune,
            tracker,
            pins,
            byte_limit: ByteLimit::NONE,
            journal: None,
            by_msg,
            requests,
            part_index,
            generation: Generation::next(),
            edits: Edits::default(),
            replaying: false,
        })
    }

    /// Decisions the strategies' queue holds (tests: the scheduler held some).
    #[cfg(test)]
    pub(crate) fn tracker_pending(&self) -> usize {
        self.tracker.pending().len()
    }

    /// The requests so far (for the scheduler).
    pub(crate) fn request_log(&self) -> &RequestLog {
        &self.requests
    }

    /// Context tokens of the messages at positions `from..to` (arrival order). O(log n).
    pub(crate) fn tokens_between(&self, from: usize, to: usize) -> u64 {
        self.by_msg.range(from, to)
    }

    /// What the trial run in progress changed among the parts a request has already sent
    /// (changes to parts no request has sent are free and not counted); `None` outside a
    /// trial or when it changed none of them.
    pub(crate) fn sent_changes(&self) -> Option<SentChanges> {
        let journal = self.journal.as_ref()?;
        let mut first: FastMap<(usize, usize), u64> = FastMap::default();
        for p in &journal.parts {
            let at = (p.rendering.msg, p.rendering.pi);
            if self.requests.is_sent(at.0, at.1) {
                first.entry(at).or_insert(p.tokens);
            }
        }
        // A part whose size did not change reads the same (a prune stamp under a mask
        // that outranks it): the cached prefix survives it.
        first.retain(|&(m, pi), before| self.messages[m].parts[pi].context_tokens() != *before);
        let earliest = *first.keys().min()?;
        let (mut saved, mut grown) = (0u64, 0u64);
        for (&(m, pi), &before) in &first {
            let now = self.messages[m].parts[pi].context_tokens();
            saved = saved.saturating_add(before.saturating_sub(now));
            grown = grown.saturating_add(now.saturating_sub(before));
        }
        Some(SentChanges {
            first: earliest,
            saved,
            grown,
        })
    }

    /// Bytes of the per-message token index (counted with the bytes held).
    pub(crate) fn index_bytes(&self) -> u64 {
        self.by_msg
            .capacity_bytes()
            .saturating_add(self.part_index.capacity_bytes())
    }

    /// Bytes the part index grows by when `n` more parts are inserted.
    pub(crate) fn part_index_growth(&self, n: usize) -> u64 {
        self.part_index.growth(n)
    }

    /// Length and capacity of the per-message token index (its growth is checked like the
    /// message vector's).
    pub(crate) fn index_len_capacity(&self) -> (usize, usize) {
        self.by_msg.len_capacity()
    }

    /// Session info (id, model, limits, overrides, todos).
    pub fn info(&self) -> &SessionInfo {
        &self.info
    }

    /// Which session value this is (see [`Generation`]).
    pub fn generation(&self) -> Generation {
        self.generation
    }

    /// What the store keeps beside a session it sends cold to load it back as this value
    /// ([`Session::resume`]): its generation and, bounded, its edits.
    pub fn to_resume(&self) -> Resume {
        Resume {
            generation: self.generation,
            edits: self.edits.carried(),
        }
    }

    /// Takes back what [`Session::to_resume`] kept of the value this session was loaded
    /// as: its generation, the stamps of its latest edits and a bound on the others', so
    /// a compaction planned before it went cold sees what the host changed meanwhile.
    pub fn resume(&mut self, from: Resume) {
        self.generation = from.generation;
        let messages = &mut self.messages;
        // A message its log changed again as it loaded (none for a session that went
        // cold: it wrote a snapshot first) keeps that newer stamp.
        let carried = from
            .edits
            .retain(|msg| messages.get(msg).is_some_and(|m| m.edit == 0));
        for &(msg, stamp) in carried.recent() {
            if let Some(m) = messages.get_mut(msg) {
                m.edit = stamp;
            }
        }
        self.edits = carried.then(&self.edits);
    }

    /// Takes the place of `old`, the same session in memory, as a copy the store rebuilt
    /// from the disk (after a panicking job or a refused commit): its generation, and
    /// each message's edit stamp where the message holds what `old`'s does (one the
    /// rebuild changed, a change undone, counts as edited). O(the session's content),
    /// as the rebuild.
    pub fn resume_from(&mut self, old: &Session) {
        self.generation = old.generation;
        let mut changed = Vec::new();
        for (i, m) in self.messages.iter_mut().enumerate() {
            match old.messages.get(i) {
                Some(o) if o.same_content(m) => m.edit = o.edit,
                _ => changed.push(i),
            }
        }
        let len = self.messages.len();
        self.edits = old
            .edits
            .retain(|msg| msg < len && changed.binary_search(&msg).is_err());
        for i in changed {
            self.edited(i);
        }
    }

    /// The settings the session runs with.
    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    /// Messages in arrival order.
    pub fn messages(&self) -> &[Message] {
        &self.messages
    }

    /// Position of part `id` in message `msg`, from the part index (no scan of the
    /// message).
    pub(crate) fn part_position(&self, msg: usize, id: &str) -> Option<usize> {
        let parts = &self.messages.get(msg)?.parts;
        self.part_index.find(msg, id, parts)
    }

    /// Positions of the user messages, ascending.
    pub fn users(&self) -> &[usize] {
        &self.users
    }

    /// Number of parts held.
    pub fn part_count(&self) -> usize {
        self.totals.parts()
    }

    /// Number of tool parts whose output prune has cleared.
    pub fn compacted_count(&self) -> usize {
        self.totals.compacted()
    }

    /// Context-view tokens of every message held (before the boundary too).
    pub fn total_tokens(&self) -> u64 {
        self.totals.tokens()
    }

    /// Position of a message by id.
    pub fn position(&self, message_id: &str) -> Option<usize> {
        self.by_id.get(message_id).copied()
    }

    /// True when the part `part_id` of the message at `msg` is pinned, by itself or
    /// through its message. One hash lookup (none when nothing is pinned).
    pub fn is_pinned(&self, msg: usize, part_id: &str) -> bool {
        self.pins.covers(msg, part_id)
    }

    /// What this session counts with (its `tokenizer` setting resolved for its model).
    pub fn counting(&self) -> Counting {
        self.counting
    }

    /// The key its model's shared calibration goes under (None: no model named).
    pub fn prior_key(&self) -> Option<String> {
        super::calibration::ModelPriors::key(&self.info, self.counting())
    }

    /// The token counter every figure of this session comes from.
    pub fn counter(&self) -> &'static dyn TokenCounter {
        self.counting.counter()
    }

    /// Loop-protection state of automatic compaction.
    pub fn auto_state(&self) -> AutoState {
        self.auto
    }

    /// The last completed compaction, where the context starts.
    pub(crate) fn boundary(&self) -> Option<Boundary> {
        self.boundary
    }

    /// True when message `i` belongs to a completed compaction's pair (its user message
    /// with the compaction part, or its summary): the newest pair opens the context and
    /// folds the earlier ones' summaries, so no pair is ever sent among the other
    /// messages (a second compaction's tail may start before the first pair). O(1).
    pub(crate) fn is_compaction_pair(&self, i: usize) -> bool {
        let Some(m) = self.messages.get(i) else {
            return false;
        };
        if m.info.is_completed_summary() {
            return self
                .position(&m.info.parent_id)
                .is_some_and(|p| has_compaction_part(&self.messages[p]));
        }
        has_compaction_part(m) && self.completed_parents.contains_key(&m.info.id)
    }

    /// The usage bookkeeping behind the overflow check.
    pub(crate) fn usage(&self) -> &UsageState {
        self.totals.usage()
    }

    /// The running figures (bytes and slots for the memory limits).
    pub(crate) fn totals(&self) -> &Totals {
        &self.totals
    }

    /// Capacities of the message and user-position vectors (they count toward the bytes
    /// held).
    pub(crate) fn capacities(&self) -> (usize, usize) {
        (self.messages.capacity(), self.users.capacity())
    }

    /// The message id map (its capacity counts toward the bytes held).
    pub(crate) fn ids(&self) -> &FastMap<String, usize> {
        &self.by_id
    }

    /// The pinned messages and parts.
    pub(crate) fn pins(&self) -> &Pins {
        &self.pins
    }

    /// Sets or clears a pin (message `msg`, or its part `part_id`), moving the bytes held
    /// and redoing the prune window (and, on an unpin, the strategies); false: no change.
    pub(crate) fn set_pin(
        &mut self,
        msg: usize,
        part_id: Option<&str>,
        pinned: bool,
    ) -> Result<bool, ApplyError> {
        if self.pins.holds(msg, part_id) == pinned {
            return Ok(false);
        }
        let bytes = pin_bytes(part_id);
        if pinned {
            self.check_growth("", 0, bytes)?;
        }
        // Of a summarized message, the parts a pin carries are sent after the summary:
        // those the change starts or stops covering join or leave the next request.
        let summarized = self.messages[msg].is_sent() && !self.in_context(msg);
        let covered_before: Vec<bool> = match summarized {
            true => self.covered_parts(msg),
            false => Vec::new(),
        };
        if pinned {
            self.pins.insert(msg, part_id);
            self.totals.bytes_changed(0, bytes);
        } else {
            self.pins.remove(msg, part_id);
            self.totals.bytes_changed(bytes, 0);
            // The decisions a pin made the last commits skip are queued again.
            self.tracker.invalidate();
        }
        if summarized {
            let assistant = self.messages[msg].info.role == Role::Assistant;
            let moved: Vec<PartFigures> = self.messages[msg]
                .parts
                .iter()
                .zip(covered_before)
                .filter(|(p, before)| self.pins.covers(msg, &p.part.id) != *before)
                .map(|(p, _)| self.figures_of(p, assistant))
                .collect();
            self.totals.sending_changed(moved.into_iter(), pinned);
        }
        self.prune.touch(msg);
        // Which parts a carried message sends follows its pins.
        self.touch(msg);
        Ok(true)
    }

    /// Which parts of message `msg` a pin covers, in order.
    fn covered_parts(&self, msg: usize) -> Vec<bool> {
        self.messages[msg]
            .parts
            .iter()
            .map(|p| self.pins.covers(msg, &p.part.id))
            .collect()
    }

    /// True when the next request holds part `part_id` of message `msg`: its message is
    /// sent, and in the context or (summarized) carried by a pin.
    pub(super) fn sends_part(&self, msg: usize, part_id: &str) -> bool {
        self.messages[msg].is_sent() && (self.in_context(msg) || self.pins.covers(msg, part_id))
    }

    /// The most bytes the session may hold after the next update.
    pub(crate) fn byte_limit(&self) -> ByteLimit {
        self.byte_limit
    }

    /// Sets the most bytes the session may hold after the next updates. The store sets it
    /// before each job from `max_session_bytes` and what is left of `memory_budget`.
    pub fn set_byte_limit(&mut self, limit: ByteLimit) {
        self.byte_limit = limit;
    }

    /// Loop protection of automatic compaction, for the compaction events.
    pub(crate) fn auto_mut(&mut self) -> &mut AutoState {
        &mut self.auto
    }

    /// Brings the prune window up to date and returns its plan.
    pub(crate) fn prune_plan(&mut self) -> PrunePlan {
        self.prune
            .sync(&self.messages, &self.users, &self.settings, &self.pins);
        self.prune.plan()
    }

    /// Tokens a prune would clear right now; the cheap per-update decision (the window is
    /// brought up to date first).
    pub fn prune_pending(&mut self) -> u64 {
        self.prune
            .sync(&self.messages, &self.users, &self.settings, &self.pins);
        self.prune.pending()
    }

    /// The plan's figures without its list (the window brought up to date first): the
    /// tokens to clear, the protected tokens scanned, and how many outputs it clears.
    pub(crate) fn prune_figures(&mut self) -> (u64, u64, usize) {
        self.prune
            .sync(&self.messages, &self.users, &self.settings, &self.pins);
        (
            self.prune.pending(),
            self.prune.protected(),
            self.prune.window_len(),
        )
    }

    /// The plan's outputs were cleared: only the protection window remains.
    pub(crate) fn prune_plan_committed(&mut self) {
        self.prune.committed();
    }

    /// The strategies' decisions waiting for the next commit; `take` empties the queue.
    pub(crate) fn strategy_decisions(&mut self, take: bool) -> Vec<Pending> {
        if self.tracker.is_dirty() {
            self.tracker
                .rebuild(&self.messages, &self.users, &self.settings);
            self.drop_applied_decisions();
        }
        if take {
            self.tracker.take_pending()
        } else {
            self.tracker.pending().to_vec()
        }
    }

    /// Decisions waiting: the strategies' queue and the outputs prune would clear (an
    /// upper bound of what the scheduler holds); none of prune's while their saving is
    /// under PRUNE_MINIMUM, as prune would not commit them. O(1).
    pub(crate) fn held_decisions(&mut self) -> usize {
        self.prune
            .sync(&self.messages, &self.users, &self.settings, &self.pins);
        let prune = if self.prune.pending() > self.settings.prune_minimum {
            self.prune.window_len()
        } else {
            0
        };
        self.tracker.pending().len() + prune
    }

    /// Puts decisions the scheduler held back in the queue for a later commit.
    pub(crate) fn hold_decisions(&mut self, held: Vec<Pending>) {
        self.tracker.hold(held);
    }

    /// A compaction committed: the next request is the new context, in a new order, so
    /// nothing of it is cached (held decisions apply free of cache cost until it is sent).
    pub(crate) fn compaction_committed(&mut self, tokens_after: u64) {
        self.totals.compaction_committed(tokens_after);
        self.requests.context_reordered();
    }

    /// Changes how the part at (`msg`, `pi`) renders and moves the running figures with
    /// it: the one writer of a part's mark, prune stamp and rendered size after the part
    /// was written. A `reduction` (prune or a strategy clearing content) counts toward
    /// what the last report over-states. Returns the part's context tokens before and
    /// after. During a trial run the prior rendering is journaled, to be rolled back.
    pub(crate) fn rerender(
        &mut self,
        msg: usize,
        pi: usize,
        change: Rendering,
        reduction: bool,
    ) -> (u64, u64) {
        self.rerender_known(msg, pi, change, reduction, None)
    }

    /// [`Self::rerender`] when the caller already counted the new rendering (`known`: the
    /// part's tokens once `change` applies), so it is not counted twice.
    pub(crate) fn rerender_known(
        &mut self,
        msg: usize,
        pi: usize,
        change: Rendering,
        reduction: bool,
        known: Option<u64>,
    ) -> (u64, u64) {
        let Some(stored) = self.messages.get(msg).and_then(|m| m.parts.get(pi)) else {
            debug_assert!(false, "rerender of a part that does not exist: {msg}/{pi}");
            return (0, 0);
        };
        let old = stored.context_tokens();
        let was_compacted = stored.is_compacted();
        if let Some(journal) = &mut self.journal {
            journal.parts.push(PriorRendering {
                rendering: RenderingAt::of(stored, msg, pi),
                tokens: old,
                rev: self.messages[msg].rev,
            });
        }
        self.touch(msg);
        let part = &mut self.messages[msg].parts[pi].part;
        match change {
            Rendering::Mark(mark) => part.mark = mark,
            Rendering::Cleared(at) => {
                if let PartKind::Tool(t) = &mut part.kind {
                    t.state.time.compacted = Some(at);
                }
            }
            Rendering::Restored => {
                if let PartKind::Tool(t) = &mut part.kind {
                    t.state.time.compacted = None;
                }
            }
        }
        let stored = &self.messages[msg].parts[pi];
        let reduced = match known {
            Some(tokens) if is_reduced(&stored.part, &self.settings) => Some(tokens),
            _ => self.reduced_tokens(&stored.part, &stored.est),
        };
        let stored = &mut self.messages[msg].parts[pi];
        stored.reduced = reduced;
        let (new, now_compacted) = (stored.context_tokens(), stored.is_compacted());
        let class = class_of(&stored.part);
        // A change of a part no request sends (its message errored, or a compaction
        // summarized it and no pin carries it) changes no request: the session's total
        // moves, the usage figures do not.
        let sent = self.sends_part(msg, &self.messages[msg].parts[pi].part.id);
        self.totals.rendering_changed(
            class,
            (old, new),
            (was_compacted, now_compacted),
            reduction,
            sent,
        );
        self.by_msg.moved(msg, old, new);
        (old, new)
    }

    /// Runs `trial` and then undoes every rendering change it made: a dry run takes the
    /// same path as the commit it previews. `trial` must change the session only through
    /// [`Self::rerender`].
    pub(crate) fn trial<T>(&mut self, trial: impl FnOnce(&mut Session) -> T) -> T {
        self.trial_judged(trial, |_| ((), false)).0
    }

    /// [`Self::trial`], with `judge` looking at the session as the trial left it (its
    /// changes still journaled, for [`Self::sent_changes`]) and saying whether to keep
    /// them: the cache scheduler weighs a run as a trial and, when it decides to apply
    /// everything, keeps that run instead of undoing it and making it again. Returns the
    /// trial's value, the judgement, and whether the changes were kept.
    pub(crate) fn trial_judged<T, D>(
        &mut self,
        trial: impl FnOnce(&mut Session) -> T,
        judge: impl FnOnce(&Session) -> (D, bool),
    ) -> (T, D, bool) {
        self.journal = Some(Journal {
            totals: self.totals,
            parts: Vec::new(),
        });
        let out = trial(self);
        let (judged, keep) = judge(self);
        if let Some(journal) = self.journal.take()
            && !keep
        {
            for prior in journal.parts.into_iter().rev() {
                let msg = prior.rendering.msg;
                self.set_rendering(prior.rendering);
                // Undone in reverse: the message ends with the revision it had before
                // the trial, its content exactly as it was then.
                self.messages[msg].rev = prior.rev;
            }
            self.totals = journal.totals;
        }
        (out, judged, keep)
    }

    /// Sets a part's rendering fields back to `r` (a rollback; the totals are restored
    /// whole by the caller) and moves the per-message index with them.
    fn set_rendering(&mut self, r: RenderingAt) {
        self.touch(r.msg);
        let stored = &mut self.messages[r.msg].parts[r.pi];
        let before = stored.context_tokens();
        stored.part.mark = r.mark;
        if let PartKind::Tool(t) = &mut stored.part.kind {
            t.state.time.compacted = r.compacted_at;
        }
        stored.reduced = r.reduced;
        let after = stored.context_tokens();
        self.by_msg.moved(r.msg, before, after);
    }

    /// Gives message `msg` a new revision: anything the context reads of it (its info,
    /// its parts, how they render, its pins) changed. Every such change passes here, so a
    /// rendering cached under the old revision is never read again.
    fn touch(&mut self, msg: usize) {
        if let Some(m) = self.messages.get_mut(msg) {
            m.rev = Revision::next();
        }
    }

    /// Records that the host changed what message `msg` holds (see [`Message::edit`]).
    fn edited(&mut self, msg: usize) {
        if let Some(m) = self.messages.get_mut(msg) {
            m.edit = Revision::next();
            self.edits.record(msg, m.edit);
        }
    }

    /// What the host last changed of message `msg` (see [`Message::edit`]); 0 past the
    /// messages.
    pub(crate) fn edit_of(&self, msg: usize) -> u64 {
        self.messages.get(msg).map_or(0, |m| m.edit)
    }

    /// The session's edit clock: the stamp of the host's latest edit of any message. A
    /// compaction's plan records it (as its `edit_clock`): every edit after the plan has
    /// a larger stamp.
    pub(crate) fn edit_clock(&self) -> u64 {
        self.edits.clock()
    }

    /// Whether the host changed message `msg` since a plan read it with stamp `stamp`,
    /// the edit clock then `clock`. A message whose stamp a reload forgot (0) changed no
    /// later than a bound: unchanged if that is no later than the plan, changed (for all
    /// that is known) if not.
    pub(crate) fn changed_since(&self, msg: usize, stamp: u64, clock: u64) -> bool {
        match self.edit_of(msg) {
            0 => self.edits.unknown_upto() > clock,
            now => now != stamp,
        }
    }

    /// The revision of message `msg` (see [`Message::rev`]); 0 past the messages.
    pub(crate) fn revision(&self, msg: usize) -> u64 {
        self.messages.get(msg).map_or(0, |m| m.rev)
    }

    /// [`Self::trial`] that also puts back the caches the run brings up to date: the prune
    /// window, and the strategies' state when it was waiting for a rebuild. A dry run a
    /// host asks for is not a logged change (`change.rs`), so it must leave the session
    /// exactly as it found it: a rebuild done early would fold later tool results in by
    /// position instead of by arrival, and a session replayed from the log (which never
    /// saw the dry run) would differ from the live one. The copies are made only here,
    /// never on the per-update path.
    pub(crate) fn dry_run<T>(&mut self, run: impl FnOnce(&mut Session) -> T) -> T {
        let prune = self.prune.clone();
        let tracker = self.tracker.is_dirty().then(|| self.tracker.clone());
        let out = self.trial(run);
        self.prune = prune;
        if let Some(tracker) = tracker {
            self.tracker = tracker;
        }
        out
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
            Update::Pin {
                message_id,
                part_id,
                pinned,
            } => self.pin(&message_id, part_id.as_deref(), pinned),
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
        self.totals.bytes_changed(old, new);
        let key_before = self.prior_key();
        self.info = next;
        self.tracker
            .set_cap_chars(output_cap_chars(&self.info, &settings));
        // A new model can change what `auto` counts with, as can new settings.
        let counting = counting_for(&self.info, &settings);
        let recount = counting != self.counting;
        self.counting = counting;
        let changed = settings != self.settings;
        if recount {
            // Another measure of the same content: the provider counts what it counted,
            // so the prediction stays (the figures since the last report are kept as
            // they were measured), under the settings the content was rendered with.
            self.recount_all(true, false);
        }
        if changed {
            // Other settings render the content differently: the next request sends the
            // context's change.
            self.settings = settings;
            self.recount_all(false, true);
        }
        if recount || changed {
            self.prune.invalidate();
            self.tracker.invalidate();
        }
        if self.prior_key() != key_before {
            // What the reports taught was about the old model's (or tokenizer's) counts:
            // the session learns the new one's from its prior.
            self.totals.reset_calibration();
        }
        // New settings or a new window (another cap): what was marked under the old ones
        // is decided again.
        if self.tracker.is_dirty() {
            self.settle_marks();
        }
        Ok(Applied::default())
    }

    fn upsert_message(&mut self, info: MessageInfo) -> Result<Applied, ApplyError> {
        let Some(idx) = self.position(&info.id) else {
            let bytes = message_bytes(&info);
            let slots = self.message_slot_growth(info.role == Role::User);
            self.check_growth("", 0, bytes.saturating_add(slots))?;
            self.totals.bytes_changed(0, bytes);
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
        self.totals.bytes_changed(old_bytes, new_bytes);
        let was_sent = self.messages[idx].is_sent();
        self.messages[idx].info = info;
        self.touch(idx);
        if was_sent != self.messages[idx].is_sent() {
            self.edited(idx);
        }
        if was_sent != self.messages[idx].is_sent() && !self.sending_changed(idx) {
            self.settle_marks();
        }
        if summary_changed {
            self.prune.touch(idx);
        }
        match (was_completed, now_completed) {
            (None, Some(parent)) => self.summary_completed(parent, idx),
            (Some(a), Some(b)) if a == b => {}
            (Some(_), _) => self.recompute_boundary(),
            (None, None) => {}
        }
        let usage = usage && self.usage_reported(tokens.unwrap_or_default(), summary, Some(idx));
        if finished && self.messages[idx].info.role == Role::Assistant {
            let t = &self.messages[idx].info.time;
            self.requests.finished(t.completed.unwrap_or(t.created));
        }
        Ok(Applied {
            created: false,
            finished,
            usage_reported: usage,
            summary,
            user_at: None,
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
            self.totals.user_turn(); // the provider drops this turn's reasoning
        } else {
            self.request_started(); // a new assistant message is a new request
            self.requests.started(
                idx,
                0,
                Some(info.time.created),
                self.settings.cache_model.ttl_ms,
            );
        }
        if finished && info.role == Role::Assistant {
            self.requests
                .finished(info.time.completed.unwrap_or(info.time.created));
        }
        self.by_msg.push();
        let user_at = (info.role == Role::User).then_some(info.time.created);
        self.by_id.insert(info.id.clone(), idx);
        let user = info.role == Role::User;
        self.messages.push(Message {
            info,
            parts: Vec::new(),
            rev: Revision::next(),
            edit: 0,
        });
        if user {
            self.tracker
                .on_user_message(&self.messages, &self.users, &self.settings);
        }
        if let Some(parent) = completed {
            self.summary_completed(parent, idx);
        }
        let usage = usage && self.usage_reported(tokens.unwrap_or_default(), summary, Some(idx));
        Applied {
            created: true,
            finished,
            usage_reported: usage,
            summary,
            user_at,
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
        // A pinned part reads verbatim: a mark or prune stamp sent with it is dropped.
        let pinned = self.pins.covers(idx, &part.id);
        if pinned {
            part.mark = None;
            if let PartKind::Tool(t) = &mut part.kind {
                t.state.time.compacted = None;
            }
        }
        let parts = &self.messages[idx].parts;
        let existing = self.part_index.find(idx, &part.id, parts);
        let old = existing.map(|i| (&parts[i].part, &parts[i].est));
        let est = estimate_over(&part, old, self.counter());
        let is_tool = matches!(part.kind, PartKind::Tool(_));
        let is_compaction = matches!(part.kind, PartKind::Compaction(_));
        // A report is news only once: the same step-finish sent again (a host re-sending
        // an unchanged part) must not make an older report the newest.
        let old_usage = match old.map(|(p, _)| &p.kind) {
            Some(PartKind::StepFinish(s)) => s.tokens,
            _ => None,
        };
        let step_usage = match &part.kind {
            PartKind::StepFinish(s) => s.tokens.filter(|t| !t.is_empty() && s.tokens != old_usage),
            _ => None,
        };
        let is_step_start = matches!(part.kind, PartKind::StepStart { .. });
        let assistant = self.messages[idx].info.role == Role::Assistant;
        // A finished call sent again as another call (an error after all, another
        // input): what its earlier version decided no longer holds.
        let retracted = existing.and_then(|i| retracted_call(&parts[i].part, &part));
        // A strategy's mark is compactd's decision: a host re-sending the part (which
        // knows nothing of marks) keeps it, unless the call it was made on changed.
        if let Some(i) = existing
            && part.mark.is_none()
            && retracted.is_none()
        {
            part.mark = parts[i].part.mark.clone();
        }
        // So is prune's stamp (OpenCode's own hosts send theirs): an output cleared and
        // sent again as it was first sent stays cleared (another output is another). Prune's scan stops at the newest
        // part it cleared, so it would never clear this one again.
        if let Some(i) = existing
            && retracted.is_none()
            && !pinned
            && let (PartKind::Tool(new), PartKind::Tool(old)) =
                (&mut part.kind, &parts[i].part.kind)
            && old.state.time.compacted.is_some()
            && new.state.time.compacted.is_none()
            && new.state.output == old.state.output
        {
            new.state.time.compacted = old.state.time.compacted;
        }
        let reduced = self.reduced_tokens(&part, &est);
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
            None => part_slots_bytes(part_slot_growth(parts, parts.capacity()))
                .saturating_add(self.part_index.growth(1)),
        };
        self.check_growth("", old_bytes, bytes.saturating_add(slots))?;
        let created = existing.is_none();
        let max = self.settings.max_parts_per_message;
        if created && max > 0 && parts.len() >= max && !self.replaying {
            return Err(ApplyError::exhausted(
                "id",
                format!(
                    "message {} already holds {max} parts (max_parts_per_message)",
                    self.messages[idx].info.id
                ),
            ));
        }
        let old = existing.map(|i| &parts[i]);
        let old_figures = old.map(|o| self.figures_of(o, assistant));
        let (was_tool, was_compaction) = old.map_or((false, false), |o| {
            (
                matches!(o.part.kind, PartKind::Tool(_)),
                matches!(o.part.kind, PartKind::Compaction(_)),
            )
        });
        let new_figures = self.figures_of(&new, assistant);
        let was_sent = self.messages[idx].is_sent();
        // A compaction request that names its tail is no turn of the age strategies: one
        // whose part names it later (OpenCode writes the part, then adds the tail) or no
        // longer was counted as one, and the ages it moved on are decided again below.
        let turn_changed = !assistant
            && old.is_some_and(|o| o.part.kind.names_a_tail()) != new.part.kind.names_a_tail();
        // A part sent again as stored (its mark and prune's stamp carried over above) is
        // no change of what the message holds.
        let content_changed =
            old.is_none_or(|o| o.part.kind != new.part.kind || o.part.extra != new.part.extra);
        // The boundary's own compaction part sent again: its tail may start elsewhere.
        let tail_before =
            (is_compaction && was_compaction && self.boundary.is_some_and(|b| b.start == idx))
                .then(|| self.context_from());
        // A part of a summarized message moves the next request only when a pin carries it.
        let carried = self.in_context(idx) || self.pins.covers(idx, &new.part.id);
        if created && is_step_start {
            self.request_started(); // the model is being called again
        }
        self.touch(idx);
        if content_changed {
            self.edited(idx);
        }
        let at = match existing {
            Some(i) => {
                self.messages[idx].parts[i] = new;
                i
            }
            None => {
                let parts = &mut self.messages[idx].parts;
                let before = parts.capacity();
                self.part_index.inserted(idx, &new.part.id, parts.len());
                parts.push(new);
                self.totals.slots_grew(parts.capacity() - before);
                parts.len() - 1
            }
        };
        if created && is_step_start {
            self.requests
                .step_started(idx, at, self.settings.cache_model.ttl_ms);
        }
        // Whether marks this update may have made stale are decided again at its end.
        let mut settle = retracted.is_some() || turn_changed;
        if let Some(call_id) = retracted {
            // The calls its earlier version superseded get their content back (one scan);
            // the state is rebuilt below (such re-sends are rare).
            self.tracker.invalidate();
            if !call_id.is_empty() {
                self.unmark_superseded_by(&FastSet::from_iter([call_id]));
            }
        }
        self.tracker
            .on_part(&self.messages, idx, at, &self.settings);
        // A user message is a turn once it holds a part (a compaction's request says it
        // keeps a tail only with its part): its first one moves the ages on.
        if created
            && self.messages[idx].parts.len() == 1
            && self.messages[idx].info.role == Role::User
        {
            self.tracker
                .on_user_message(&self.messages, &self.users, &self.settings);
        }
        self.by_msg
            .moved(idx, old_figures.map_or(0, |f| f.tokens), new_figures.tokens);
        self.totals
            .part_changed(old_figures, Some(new_figures), was_sent && carried);
        // An aborted message is sent once it holds content.
        if was_sent != self.messages[idx].is_sent() {
            settle |= !self.sending_changed(idx);
        }
        if is_tool || was_tool {
            self.prune.touch(idx);
        }
        if was_compaction && !is_compaction {
            self.recompute_boundary();
        } else if is_compaction && !was_compaction {
            self.compaction_part_added(idx);
        } else if tail_before.is_some_and(|from| from != self.context_from()) {
            // Messages entered or left the context: the last report no longer describes
            // it, and those entering were left alone by the strategies while summarized.
            let context = self.context_tokens();
            self.compaction_committed(context);
            self.tracker.invalidate();
        }
        let summary = self.messages[idx].info.is_summary();
        // A step-finish sent again (changed) before the newest request's step-start
        // reports an earlier step: stored, no baseline. (Only one sent again: a new part
        // goes last, and a delete of earlier parts moves the request's mark with them.)
        let (newest, from) = self.requests.sent();
        let earlier_step = !created && idx == newest && at < from;
        let reported =
            !earlier_step && step_usage.is_some_and(|t| self.usage_reported(t, summary, Some(idx)));
        if settle {
            self.settle_marks();
        }
        Ok(Applied {
            created,
            usage_reported: reported,
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
        let Some(i) = self
            .part_index
            .find(idx, part_id, &self.messages[idx].parts)
        else {
            return Err(ApplyError::not_found(
                "part_id",
                format!("part {part_id} does not exist in message {message_id}"),
            ));
        };
        self.touch(idx);
        self.edited(idx);
        let was_sent = self.messages[idx].is_sent() && self.sends_part(idx, part_id);
        let message_was_sent = self.messages[idx].is_sent();
        let old = self.messages[idx].parts.remove(i);
        self.requests.part_removed(idx, i);
        self.part_index
            .removed(idx, part_id, i, &self.messages[idx].parts);
        let assistant = self.messages[idx].info.role == Role::Assistant;
        let figures = self.figures_of(&old, assistant);
        self.totals.part_changed(Some(figures), None, was_sent);
        self.by_msg.moved(idx, figures.tokens, 0);
        // A result or a user turn gone can leave a mark no longer decided (a masked
        // output now among the newest, an error no longer old, an inlined text with no
        // attachment): decided again below. Other parts (an assistant's text, a step
        // marker) only shift positions: the state is rebuilt at the next commit.
        let mut settle = matches!(old.part.kind, PartKind::Tool(_))
            || self.messages[idx].info.role == Role::User;
        if message_was_sent != self.messages[idx].is_sent() {
            settle |= !self.sending_changed(idx);
        }
        // The part's own pin goes with it (a message pin stays: it covers later parts).
        if self.pins.remove(idx, Some(part_id)) {
            self.totals.bytes_changed(pin_bytes(Some(part_id)), 0);
        }
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
            self.unmark_superseded_by(&FastSet::from_iter([t.call_id.clone()]));
        }
        if matches!(old.part.kind, PartKind::Compaction(_)) {
            self.recompute_boundary();
        }
        if settle {
            self.settle_marks();
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
            // The same report again (a retried call) is no news: after a compaction it
            // would make the summarized context's size the baseline again. Nor is an
            // empty one (all zero, as an upsert's or a step-finish's is): it would make a
            // prompt of 0 the baseline and forget the whole context. Neither is stored:
            // zeros over the message's usage would make the host's next upsert of the
            // message, with its real tokens, read as a new report.
            if info.tokens == Some(tokens) || tokens.is_empty() {
                return Ok(Applied::default());
            }
            info.tokens = Some(tokens);
            let summary = info.is_summary();
            self.touch(idx);
            let reported = self.usage_reported(tokens, summary, Some(idx));
            return Ok(Applied {
                usage_reported: reported,
                ..Applied::default()
            });
        }
        Ok(Applied {
            usage_reported: !tokens.is_empty() && self.usage_reported(tokens, false, None),
            ..Applied::default()
        })
    }

    /// What a stored part of an `assistant` (or user) message adds to the running
    /// figures: what the model wrote there is covered by the next report's `output`.
    fn figures_of(&self, p: &StoredPart, assistant: bool) -> PartFigures {
        let tokens = p.context_tokens();
        let written = if assistant { p.est.generated } else { 0 };
        PartFigures {
            tokens,
            unwritten: tokens.saturating_sub(written),
            compacted: p.is_compacted(),
            class: class_of(&p.part),
            bytes: p.bytes,
        }
    }

    /// The model is called again: the prediction for this request is recorded, so its
    /// report can check it (and calibrate the next).
    fn request_started(&mut self) {
        let anchor = self
            .totals
            .usage()
            .last()
            .map(|u| Anchor::of(u, self.settings.cache_counting));
        self.totals.request_started(anchor);
    }

    /// A provider report arrived, stored on message `at` (`None`: a report of the latest
    /// request, on no message). Returns whether it is the new baseline of the next
    /// request. It is not when it is on a message older than the newest request's (a
    /// late or retried report of a request the session is past: after a compaction, the
    /// summarized context's size), or on no message while no request has started since
    /// a compaction, nor when it is on a summary message (`of_summary`: a
    /// compaction request's, whose prompt is the summarized head, not the session's; the
    /// baseline stays until the compaction completes and the context starts afresh, so
    /// a compaction that fails leaves the overflow seen).
    fn usage_reported(&mut self, tokens: TokenUsage, of_summary: bool, at: Option<usize>) -> bool {
        if at.is_some_and(|i| i < self.requests.newest_message()) {
            return false;
        }
        // On no message, it reports the latest request; with none since a compaction,
        // that request was the old context's (or the compaction's own).
        if at.is_none() && self.requests.is_reordered() {
            return false;
        }
        if of_summary {
            self.totals.summary_reported();
            return false;
        }
        let prompt = prompt_tokens(&tokens, self.settings.cache_counting);
        let reasoning = Anchor::of(&tokens, self.settings.cache_counting).reasoning;
        self.totals.usage_reported(tokens, prompt, reasoning);
        true
    }

    /// What the usage reports taught about this session's estimates.
    pub fn calibration(&self) -> &Calibration {
        self.totals.calibration()
    }

    /// How many times a new model or tokenizer reset the calibration (the store then
    /// starts it from that key's prior).
    pub fn calibration_resets(&self) -> u32 {
        self.totals.calibration_resets()
    }

    /// Starts the calibration from what other sessions of the same model learned.
    pub fn set_calibration_prior(&mut self, prior: Factors) {
        self.totals.set_calibration_prior(prior);
    }

    /// The latest usage report's check of the prediction made when its request started,
    /// numbered from 1 (a new number is a new check; reports whose request had no earlier
    /// report to build on make none).
    pub fn prediction_sample(&self) -> Option<(u64, PredictionSample)> {
        self.totals.sample()
    }

    /// Tokens of the part as rendered, when prune or a strategy reduced it (`est`: the
    /// part's cached estimate).
    pub(crate) fn reduced_tokens(&self, part: &Part, est: &PartEstimate) -> Option<u64> {
        is_reduced(part, &self.settings).then(|| self.rendered_tokens(part, est, true))
    }

    /// Tokens of the part as rendered, with the input-leak fix as `strip_inputs` says
    /// (and only if the strategy is on).
    pub(crate) fn rendered_tokens(
        &self,
        part: &Part,
        est: &PartEstimate,
        strip_inputs: bool,
    ) -> u64 {
        let (mark, compacted) = (part.mark.as_ref(), is_compacted(part));
        self.rendered_split(part, est, mark, compacted, strip_inputs)
            .tokens
    }

    /// The part's tokens as if it carried `mark` and prune's stamp as `compacted` says
    /// (counted from the cached estimate and the replacing text only), with the input-leak
    /// fix's share of the saving apart.
    pub(crate) fn rendered_split(
        &self,
        part: &Part,
        est: &PartEstimate,
        mark: Option<&StrategyMark>,
        compacted: bool,
        strip_inputs: bool,
    ) -> Rendered {
        let strip = strip_inputs && self.settings.strategies.has(Strategy::PruneToolInputs);
        rendered_tokens_as(
            part,
            est,
            mark,
            compacted,
            &self.settings,
            strip,
            self.counter(),
        )
    }

    /// Message `idx` became sent or not sent (an error set or cleared): its calls
    /// supersede older ones only while the context sends them. The strategies' state is
    /// rebuilt at the next commit, and a message no longer sent gives back what its calls
    /// superseded (one scan; errors are rare). Returns whether the message is sent now:
    /// when it is not, its results count no more, and the caller settles the marks
    /// ([`Self::settle_marks`]).
    fn sending_changed(&mut self, idx: usize) -> bool {
        self.tracker.invalidate();
        let now = self.messages[idx].is_sent();
        let assistant = self.messages[idx].info.role == Role::Assistant;
        // Of a summarized message, only the parts a pin carries are in any request.
        let carried = self.in_context(idx);
        let figures: Vec<PartFigures> = self.messages[idx]
            .parts
            .iter()
            .filter(|p| carried || self.pins.covers(idx, &p.part.id))
            .map(|p| self.figures_of(p, assistant))
            .collect();
        self.totals.sending_changed(figures.into_iter(), now);
        if now {
            return true;
        }
        let calls: FastSet<String> = self.messages[idx]
            .parts
            .iter()
            .filter_map(|p| match &p.part.kind {
                PartKind::Tool(t) if !t.call_id.is_empty() => Some(t.call_id.clone()),
                _ => None,
            })
            .collect();
        self.unmark_superseded_by(&calls);
        false
    }

    /// Rebuilds the strategies' state now and takes back every active mark it no longer
    /// decides, so the marks are what a from-scratch run (an import of the same messages)
    /// decides: after a result or a user turn was deleted, a call sent again changed, a
    /// message stopped being sent, or the settings or the window changed, a masked output
    /// may be among the newest again, an error no longer old, an inlined text without its
    /// attachment, a call protected, a cap of another size. A mark still decided stays as
    /// it is (the requests sent it so: taking it back to mark it again would rewrite the
    /// cached prompt for nothing); one taken back reads whole again through
    /// [`Self::rerender`], so the figures follow, and any lesser decision on its part waits
    /// in the queue for the next commit. O(parts), on those rare updates only.
    /// (Supersede marks naming a call gone are taken back before, by
    /// [`Self::unmark_superseded_by`]: the rebuilt queue may supersede the part by another
    /// call.)
    fn settle_marks(&mut self) {
        if self.settings.strategies.is_empty() {
            return; // no mark is active; a later configure that switches one on settles
        }
        self.tracker
            .rebuild(&self.messages, &self.users, &self.settings);
        let stale: Vec<(usize, usize)> = {
            // The rebuilt queue holds every decision the messages make (the commit skips
            // those already marked).
            let decided: FastMap<(usize, &str, Strategy), u64> = self
                .tracker
                .pending()
                .iter()
                .map(|p| ((p.at.msg, &*p.at.part, p.strategy), p.keep))
                .collect();
            let mut stale = Vec::new();
            for (mi, m) in self.messages.iter().enumerate() {
                for (pi, p) in m.parts.iter().enumerate() {
                    let Some(mark) = &p.part.mark else {
                        continue;
                    };
                    // A mark whose strategy is off stays, unread, until it is switched
                    // on again (a configure, which settles again).
                    if self.settings.strategies.has(mark.strategy)
                        && decided.get(&(mi, p.part.id.as_str(), mark.strategy)) != Some(&mark.keep)
                    {
                        stale.push((mi, pi));
                    }
                }
            }
            stale
        };
        for (mi, pi) in stale {
            self.rerender(mi, pi, Rendering::Mark(None), false);
        }
        self.drop_applied_decisions();
    }

    /// Drops from the strategies' queue, after a rebuild (which queues every decision the
    /// history makes), the decisions already applied (the part holds that mark): they
    /// wait for nothing, and left queued they would count as held and, past MAX_HELD,
    /// force a rewrite of the cached prefix that does not pay.
    fn drop_applied_decisions(&mut self) {
        let (messages, index) = (&self.messages, &self.part_index);
        self.tracker.retain_pending(|p| {
            let applied = messages.get(p.at.msg).and_then(|m| {
                let pi = index.find(p.at.msg, &p.at.part, &m.parts)?;
                m.parts.get(pi)?.part.mark.as_ref()
            });
            !applied.is_some_and(|mark| mark.strategy == p.strategy && mark.keep == p.keep)
        });
    }

    /// Removes the marks naming one of `calls` as the newer call (deleted, or in a message
    /// the context no longer sends). One scan of the session; nothing when `calls` is empty.
    fn unmark_superseded_by(&mut self, calls: &FastSet<String>) {
        if calls.is_empty() {
            return;
        }
        for mi in 0..self.messages.len() {
            for pi in 0..self.messages[mi].parts.len() {
                let by = self.messages[mi].parts[pi].part.mark.as_ref();
                if by.is_some_and(|m| {
                    !m.superseded_by.is_empty() && calls.contains(&m.superseded_by)
                }) {
                    self.rerender(mi, pi, Rendering::Mark(None), false);
                }
            }
        }
    }

    /// Re-derives the context total after the settings changed (placeholder, strategies);
    /// `estimates`: the tokenizer changed, so every part is counted again first.
    /// Counts every part again: `estimates` (the counting changed) or only what the
    /// settings render. With `moves`, what the next request sends moves by the context's
    /// change; without, the same content was only measured again.
    fn recount_all(&mut self, estimates: bool, moves: bool) {
        // What the next request sends moves by the context's change only: messages a
        // compaction summarized (or an errored one) are counted, and sent by no request.
        let context_before = self.context_tokens();
        let mut total = 0u64;
        let mut by_msg = TokenIndex::default();
        for mi in 0..self.messages.len() {
            // The settings or the tokenizer changed: any rendering may read differently.
            self.touch(mi);
            by_msg.push();
            let mut msg_total = 0u64;
            for pi in 0..self.messages[mi].parts.len() {
                if estimates {
                    let est = estimate(&self.messages[mi].parts[pi].part, self.counter());
                    self.messages[mi].parts[pi].est = est;
                }
                let stored = &self.messages[mi].parts[pi];
                let reduced = self.reduced_tokens(&stored.part, &stored.est);
                let stored = &mut self.messages[mi].parts[pi];
                stored.reduced = reduced;
                msg_total = msg_total.saturating_add(stored.context_tokens());
            }
            by_msg.moved(mi, 0, msg_total);
            total = total.saturating_add(msg_total);
        }
        self.by_msg = by_msg;
        let context_after = self.context_tokens();
        self.totals
            .recounted(total, moves.then_some((context_before, context_after)));
    }

    /// A summary (at `summary`) completed: its parent opens the context if it holds a
    /// compaction part and is newer than the current boundary. O(1).
    fn summary_completed(&mut self, parent: String, summary: usize) {
        // Of two summaries of one compaction, the later one answers it (as a recount
        // finds it), whichever completed first.
        if self
            .completed_parents
            .get(&parent)
            .is_some_and(|&known| known > summary)
        {
            return;
        }
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

    /// A compaction completed: when it is the newest, the context starts at it, and the
    /// last report (of the old context, or of the summary's request) is no base for the
    /// next request, estimated whole as after compactd's own commit. O(context), once per
    /// compaction.
    fn offer_boundary(&mut self, start: usize, summary: usize) {
        if has_compaction_part(&self.messages[start])
            && self
                .boundary
                .is_none_or(|b| start > b.start || (start == b.start && summary > b.summary))
        {
            self.boundary = Some(Boundary { start, summary });
            let after = self.context_tokens();
            self.compaction_committed(after);
        }
    }

    /// Finds the newest completed compaction, as seed 02's `filterCompacted` walks it:
    /// newest first, a completed summary names its parent; the first user message that is
    /// such a parent and holds a compaction part opens the context. A full scan, run only
    /// when a compaction is undone (a summary loses `finish` or gains an error, a
    /// compaction part is deleted): never on ordinary updates.
    /// When the context's start moves (a compaction undone), the last report no longer
    /// describes it: the next request is estimated whole, as after a compaction.
    fn recompute_boundary(&mut self) {
        let before = self.boundary.map(|b| (b.start, b.summary));
        self.find_boundary();
        let after = self.boundary.map(|b| (b.start, b.summary));
        if after != before {
            let context = self.context_tokens();
            self.compaction_committed(context);
        }
        // Undone (or moved back): messages the strategies left alone while they were
        // summarized are in the context again. Rebuilt at the next commit (rare).
        if before.is_some_and(|(b, _)| after.is_none_or(|(a, _)| a < b)) {
            self.tracker.invalidate();
        }
    }

    fn find_boundary(&mut self) {
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

/// Characters one tool output may keep in this session's window (`capLargeOutputs`).
/// The content class a part's tokens count under: a tool part by its tool (its output
/// dominates it), anything else as prose.
fn class_of(part: &Part) -> Class {
    match &part.kind {
        PartKind::Tool(t) => tool_class(&t.tool),
        _ => Class::Prose,
    }
}

/// What a session with this info and these settings counts with.
fn counting_for(info: &SessionInfo, settings: &Settings) -> Counting {
    let model = info.model.as_ref().map_or("", |m| m.model_id.as_str());
    settings.tokenizer.resolve(model)
}

fn output_cap_chars(info: &SessionInfo, settings: &Settings) -> u64 {
    cap_chars(settings.output_cap, info.limits.usable_input())
}

/// True for a user message that opens a compaction.
fn has_compaction_part(m: &Message) -> bool {
    m.info.role == Role::User
        && m.parts
            .iter()
            .any(|p| matches!(p.part.kind, PartKind::Compaction(_)))
}

/// True when `t` reads a file whole (`supersedeWrites`: what its changes wait for).
fn reads_whole(t: &crate::domain::ToolPart) -> bool {
    let st = &t.state;
    file_use(&t.tool, &st.input, &st.output, st.metadata.as_ref()) == FileUse::WholeRead
}

/// The call id of `old` when `new` replaces it as another call: `old` was a finished
/// tool call (completed or failed), and `new` is not the same call with the same outcome
/// (its status, input, tool or call id differ, a read now shows the file whole where it
/// did not or the other way round, or it is no tool call). What the strategies decided on
/// `old` (and on the calls it superseded) no longer holds.
fn retracted_call(old: &Part, new: &Part) -> Option<String> {
    let PartKind::Tool(o) = &old.kind else {
        return None;
    };
    if !matches!(o.state.status, ToolStatus::Completed | ToolStatus::Error) {
        return None;
    }
    let same = match &new.kind {
        PartKind::Tool(n) => {
            n.state.status == o.state.status
                && n.call_id == o.call_id
                && n.tool == o.tool
                && n.state.input == o.state.input
                && reads_whole(o) == reads_whole(n)
        }
        _ => false,
    };
    (!same).then(|| o.call_id.clone())
}
