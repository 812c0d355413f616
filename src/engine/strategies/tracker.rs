//! The state the strategies keep between updates, so no decision ever rescans the session:
//! the newest holder of every supersede key (file path, url, state query, snapshot, todo,
//! search, identical input), failed calls waiting for a successful retry, the calls that
//! touch several files, changes waiting for a whole read of their files (`writes.rs`), and
//! how far each age strategy has looked. Decisions wait in
//! `pending` until the next prune run commits them.
//!
//! "Newer" is by position in the session (message, then part), not by arrival, so a
//! rebuild from the messages (an import, a settings change) reaches the same decisions as
//! the updates did live.

use std::sync::Arc;

use globset::GlobSet;
use serde::{Deserialize, Serialize};

use super::file_masking::{inlined_breadcrumb, is_inlined_file};
use super::files::file_paths;
use super::masking::Masking;
use super::retries::{call_hash, text_hash};
use super::searches::search_key;
use super::snapshots::snapshot_key;
use super::source_urls::url_key;
use super::state_queries::query_key;
use super::todos::todo_key;
use super::writes::{FileUse, MAX_CHANGE_PATHS, Writes, file_use};
use super::{Strategy, strips_something, truncate_code_blocks};
use crate::config::{CODE_BLOCK_AGE_TURNS, ERROR_AGE_TURNS, FILE_AGE_TURNS, Settings};
use crate::domain::{FastMap, FastSet, Part, PartKind, Role, ToolPart, ToolStatus};
use crate::engine::stored::Message;

/// A part by message position and part id (part positions shift when a part is deleted).
///
/// The id is shared, not copied: one call's reference sits in the holders of each of its
/// keys, the masking list and the queued set. It is stored as a plain string.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct PartRef {
    /// Message position.
    pub msg: usize,
    /// Part id.
    pub part: Arc<str>,
}

/// A decision waiting for the next commit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pending {
    /// The part to mark.
    pub at: PartRef,
    /// The strategy that decided.
    pub strategy: Strategy,
    /// Call id of the newer call (supersede strategies), else empty.
    pub by: String,
    /// Characters kept (`capLargeOutputs`), else 0.
    pub keep: u64,
}

/// The newest call seen for a key.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Holder {
    at: PartRef,
    /// (message, part) position when registered: the order "newer" means.
    order: (usize, usize),
    /// The call's id, shared by the copies of the holder under each of the call's keys.
    call: Arc<str>,
    /// Never cleared for age or size (protected tool or file glob).
    protected: bool,
}

/// Decisions a turn typically queues: up to this many, the queue's set and list keep their
/// capacity from one commit to the next.
const KEPT_QUEUE: usize = 64;

/// Longest key (and file path) the tracker holds as text; a longer one is held as its
/// hash. Keys copy client text (a search's other input fields as JSON, where one control
/// character becomes six bytes; a patch's paths), which the part's byte count does not
/// cover beyond its index allowance.
const MAX_KEY_BYTES: usize = 256;

/// Most paths one call is tracked by for `aggressiveFilePrune`: a call naming more (a
/// patch of thousands of files) is neither superseded by path nor supersedes by path,
/// since each path costs a key and a holder.
const MAX_CALL_PATHS: usize = 64;

/// Age strategies and the user turns a message must be older than.
const AGED: [(Strategy, usize); 3] = [
    (Strategy::PruneFiles, FILE_AGE_TURNS),
    (Strategy::TruncateOldErrors, ERROR_AGE_TURNS),
    (Strategy::PruneUserCodeBlocks, CODE_BLOCK_AGE_TURNS),
];

/// Incremental strategy state of one session.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Tracker {
    #[serde(with = "crate::engine::sorted::map")]
    latest: FastMap<(Strategy, String), Holder>,
    /// Failed calls by call hash, waiting for a successful call with the same input.
    #[serde(with = "crate::engine::sorted::hashes")]
    failed: FastMap<u128, Vec<Holder>>,
    /// Newest successful call by call hash (a failure placed before it is a retry too).
    #[serde(with = "crate::engine::sorted::hashes")]
    succeeded: FastMap<u128, Holder>,
    /// Paths of multi-file calls not yet superseded; the call goes when none is left.
    #[serde(with = "crate::engine::sorted::map")]
    remaining: FastMap<PartRef, Vec<String>>,
    pending: Vec<Pending>,
    /// What `pending` holds, so a part re-sent N times is queued once.
    #[serde(with = "crate::engine::sorted::set")]
    queued: FastSet<(PartRef, Strategy)>,
    /// Per age strategy: messages before this position have been looked at.
    aged: [usize; 3],
    /// Tool results in order, for `maskObservations`.
    masking: Masking,
    /// Changes waiting for a whole read of their files, for `supersedeWrites`: written
    /// only when it holds anything (absent from snapshots written before it existed,
    /// whose settings do not name it).
    #[serde(default, skip_serializing_if = "Writes::is_empty")]
    writes: Writes,
    /// Characters one output may keep (`capLargeOutputs`; 0: no cap). Set by the session
    /// from its window.
    cap_chars: u64,
    /// Compiled from the settings' `protected_file_globs`; not stored, compiled again
    /// when a session is restored ([`Tracker::restored`]).
    #[serde(skip)]
    globs: GlobSet,
    dirty: bool,
}

/// Position of the `turns`-th user turn from the end, as the context sends them. A
/// compaction's request that keeps a verbatim tail is written after that tail but sent
/// before it: it is no newer than the tail's turns, so it is not counted. Nor is a user
/// message with no part yet: a host writes a message, then its parts, and a compaction's
/// request says it keeps a tail only with its part (the session moves the ages on when a
/// user message gets its first part). A few at most are passed over: O(turns).
fn turn_start(messages: &[Message], users: &[usize], turns: usize) -> Option<usize> {
    let mut counted = 0;
    for &u in users.iter().rev() {
        if messages
            .get(u)
            .is_some_and(|m| m.parts.is_empty() || keeps_a_tail(m))
        {
            continue;
        }
        counted += 1;
        if counted == turns {
            return Some(u);
        }
    }
    None
}

/// Whether `m` is a compaction's request that keeps a verbatim tail.
fn keeps_a_tail(m: &Message) -> bool {
    m.parts.iter().any(|p| p.part.kind.names_a_tail())
}

impl Tracker {
    /// Empty state for `s`.
    pub fn new(s: &Settings) -> Tracker {
        Tracker {
            globs: compile_globs(&s.protected_file_globs),
            ..Tracker::default()
        }
    }

    /// Sets the characters one output may keep (from the session's window); a change
    /// rebuilds the state at the next commit.
    pub fn set_cap_chars(&mut self, cap: u64) {
        if cap != self.cap_chars {
            self.cap_chars = cap;
            self.dirty = true;
        }
    }

    /// After decoding: compiles the protected file globs again from `s` (they are not
    /// stored) and rebuilds what masking derives from its list. While the state is clean
    /// the globs are always `s`'s: a settings change marks it dirty, and the rebuild
    /// compiles them.
    pub(crate) fn restored(&mut self, s: &Settings) {
        self.globs = compile_globs(&s.protected_file_globs);
        // A snapshot written before keys were bounded holds long keys as text, which no
        // new call's key (a hash) meets: rebuilt at the next commit, as a settings change.
        // (A file key is `file:` and a path bounded on its own.)
        let long = |k: &String| k.len() > MAX_KEY_BYTES;
        let long_key = |(st, k): &(Strategy, String)| match st {
            Strategy::AggressiveFilePrune => k
                .get("file:".len()..)
                .is_some_and(|p| p.len() > MAX_KEY_BYTES),
            _ => long(k),
        };
        if self.latest.keys().any(long_key)
            || (self.remaining.values()).any(|p| p.len() > MAX_CALL_PATHS || p.iter().any(long))
        {
            self.invalidate();
        }
        self.masking.restored();
    }

    /// True when every message position the state holds is below `len` (a restored
    /// snapshot is checked with it).
    pub(crate) fn fits(&self, len: usize) -> bool {
        let holder = |h: &Holder| h.at.msg < len && h.order.0 < len;
        self.latest.values().all(holder)
            && self.failed.values().flatten().all(holder)
            && self.succeeded.values().all(holder)
            && self.remaining.keys().all(|at| at.msg < len)
            && self.pending.iter().all(|p| p.at.msg < len)
            && self.queued.iter().all(|(at, _)| at.msg < len)
            && self.aged.iter().all(|&a| a <= len)
            && self.masking.fits(len)
            && self.writes.fits(len)
    }

    /// Forgets everything; the next commit rebuilds from the messages (settings changed).
    pub fn invalidate(&mut self) {
        self.dirty = true;
    }

    /// True when the state must be rebuilt before it is used.
    pub fn is_dirty(&self) -> bool {
        self.dirty
    }

    /// Decisions not yet committed, oldest first.
    pub fn pending(&self) -> &[Pending] {
        &self.pending
    }

    /// Queues decisions again that a commit took but did not apply (held by the cache
    /// scheduler), ahead of anything queued since.
    pub fn hold(&mut self, held: Vec<Pending>) {
        let newer = std::mem::take(&mut self.pending);
        for p in held.into_iter().chain(newer) {
            if self.queued.insert((p.at.clone(), p.strategy)) {
                self.pending.push(p);
            }
        }
    }

    /// Keeps only the pending decisions `keep` accepts (those not yet applied).
    pub fn retain_pending(&mut self, mut keep: impl FnMut(&Pending) -> bool) {
        let queued = &mut self.queued;
        self.pending.retain(|p| {
            let kept = keep(p);
            if !kept {
                queued.remove(&(p.at.clone(), p.strategy));
            }
            kept
        });
    }

    /// Takes the pending decisions for a commit.
    pub fn take_pending(&mut self) -> Vec<Pending> {
        // `clear()` walks the whole capacity, which a rebuild over a long history leaves
        // large: a set that large is dropped, a turn-sized one is cleared and kept, so the
        // next turn's decisions do not grow a table from nothing again.
        if self.queued.capacity() > KEPT_QUEUE {
            self.queued = Default::default();
        } else {
            self.queued.clear();
        }
        let taken = std::mem::take(&mut self.pending);
        self.pending = Vec::with_capacity(taken.len().min(KEPT_QUEUE));
        taken
    }

    /// Rebuilds the state from the messages, exactly as the updates would have built it.
    pub fn rebuild(&mut self, messages: &[Message], users: &[usize], s: &Settings) {
        let cap = self.cap_chars;
        *self = Tracker::new(s);
        self.cap_chars = cap;
        for (mi, m) in messages.iter().enumerate() {
            if !m.is_sent() {
                continue; // its calls never reach the model: they supersede nothing
            }
            for (pi, stored) in m.parts.iter().enumerate() {
                if let PartKind::Tool(t) = &stored.part.kind {
                    self.on_tool(mi, pi, &stored.part, t, s);
                }
            }
        }
        self.advance_ages(messages, users, s);
    }

    /// A part was written at `messages[msg].parts[part]`.
    pub fn on_part(&mut self, messages: &[Message], msg: usize, part: usize, s: &Settings) {
        if self.dirty || s.strategies.is_empty() {
            return;
        }
        let m = &messages[msg];
        let stored = &m.parts[part].part;
        if let PartKind::Tool(t) = &stored.kind
            && m.is_sent()
        {
            self.on_tool(msg, part, stored, t, s);
        }
        // A late write to a message an age strategy has already passed.
        for (k, (strategy, _)) in AGED.iter().enumerate() {
            if msg < self.aged[k] && s.strategies.has(*strategy) {
                self.age_check(*strategy, msg, m, stored, s);
            }
        }
    }

    /// A user message arrived: older messages may have crossed an age threshold.
    pub fn on_user_message(&mut self, messages: &[Message], users: &[usize], s: &Settings) {
        if self.dirty || s.strategies.is_empty() {
            return;
        }
        self.advance_ages(messages, users, s);
    }

    fn advance_ages(&mut self, messages: &[Message], users: &[usize], s: &Settings) {
        for (k, (strategy, turns)) in AGED.iter().enumerate() {
            if !s.strategies.has(*strategy) {
                continue;
            }
            // Messages before the `turns`-th user turn from the end have at least `turns`
            // user turns after them.
            let Some(target) = turn_start(messages, users, *turns) else {
                continue;
            };
            for (mi, m) in messages.iter().enumerate().take(target).skip(self.aged[k]) {
                for stored in &m.parts {
                    self.age_check(*strategy, mi, m, &stored.part, s);
                }
            }
            self.aged[k] = self.aged[k].max(target);
        }
    }

    /// Queues `part` (in the aged message `m`) when the age strategy applies to it.
    fn age_check(
        &mut self,
        strategy: Strategy,
        msg: usize,
        m: &Message,
        part: &Part,
        s: &Settings,
    ) {
        let applies = match (strategy, &part.kind) {
            // Text files and directories reach the model as synthetic text parts (masked
            // below); the file part itself is never sent.
            (Strategy::PruneFiles, PartKind::File(f)) => !is_inlined_file(&f.mime),
            (Strategy::PruneFiles, PartKind::Text(t)) => {
                m.info.role == Role::User
                    && m.parts
                        .iter()
                        .any(|p| matches!(p.part.kind, PartKind::File(_)))
                    && inlined_breadcrumb(t).is_some()
            }
            (Strategy::TruncateOldErrors, PartKind::Tool(t)) => {
                t.state.status == ToolStatus::Error
                    && !s.is_strategy_protected(&t.tool)
                    && !file_paths(&t.tool, &t.state.input)
                        .iter()
                        .any(|p| self.globs.is_match(p))
            }
            (Strategy::PruneUserCodeBlocks, PartKind::Text(t)) => {
                m.info.role == Role::User
                    && !t.synthetic
                    && t.text.contains("```")
                    && truncate_code_blocks(&t.text).is_some()
            }
            _ => false,
        };
        if applies {
            self.queue(
                PartRef {
                    msg,
                    part: Arc::from(part.id.as_str()),
                },
                strategy,
                String::new(),
                0,
            );
        }
    }

    /// Registers a tool call in a final state (completed or failed).
    fn on_tool(&mut self, msg: usize, pi: usize, part: &Part, t: &ToolPart, s: &Settings) {
        let on = |st: Strategy| s.strategies.has(st);
        if !matches!(t.state.status, ToolStatus::Completed | ToolStatus::Error) {
            return;
        }
        let paths = file_paths(&t.tool, &t.state.input);
        let holder = Holder {
            at: PartRef {
                msg,
                part: Arc::from(part.id.as_str()),
            },
            order: (msg, pi),
            call: Arc::from(t.call_id.as_str()),
            // A recall's result is what the agent asked to read whole: capped or masked,
            // it could never be read.
            protected: s.is_strategy_protected(&t.tool)
                || t.tool == crate::engine::RECALL_TOOL
                || paths.iter().any(|p| self.globs.is_match(p)),
        };
        if on(Strategy::MaskObservations) {
            let (queued, pending) = (&mut self.queued, &mut self.pending);
            self.masking
                .on_result(holder.at.clone(), holder.protected, s.mask_keep, |victim| {
                    queue(
                        queued,
                        pending,
                        victim,
                        Strategy::MaskObservations,
                        String::new(),
                        0,
                    );
                });
        }
        let capped = on(Strategy::CapLargeOutputs)
            && t.state.status == ToolStatus::Completed
            && !holder.protected
            && self.cap_chars > 0
            && t.state.output.len() as u64 > self.cap_chars;
        if capped {
            let cap = self.cap_chars;
            self.queue(
                holder.at.clone(),
                Strategy::CapLargeOutputs,
                String::new(),
                cap,
            );
        }
        let hash = (on(Strategy::SupersedeDuplicates) || on(Strategy::PruneRetryParts))
            .then(|| call_hash(&t.tool, &t.state.input));
        if t.state.status == ToolStatus::Error {
            if let Some(hash) = hash.filter(|_| on(Strategy::PruneRetryParts)) {
                self.failed_call(hash, holder);
            }
            return;
        }
        if let Some(hash) = hash.filter(|_| on(Strategy::PruneRetryParts)) {
            self.succeeded_call(hash, &holder);
        }
        // `aggressiveFilePrune` supersedes every change a later read does, and more; with
        // `pruneToolInputs` off a superseded change would keep its content.
        if on(Strategy::SupersedeWrites)
            && on(Strategy::PruneToolInputs)
            && !on(Strategy::AggressiveFilePrune)
            && (1..=MAX_CHANGE_PATHS).contains(&paths.len())
        {
            let st = &t.state;
            let used = match file_use(&t.tool, &st.input, &st.output, st.metadata.as_ref()) {
                // A read the cap shortens shows the file's head and tail only.
                FileUse::WholeRead if capped => FileUse::Other,
                // Nothing of it would leave the context.
                FileUse::Change if !strips_something(&st.input) => FileUse::Other,
                used => used,
            };
            self.on_file_use(used, &holder, &paths);
        }
        let by_path = on(Strategy::AggressiveFilePrune) && paths.len() <= MAX_CALL_PATHS;
        let file_keys: Vec<String> = if by_path {
            paths.iter().map(|p| bounded(p.clone())).collect()
        } else {
            Vec::new()
        };
        if file_keys.len() > 1 {
            self.remaining
                .entry(holder.at.clone())
                .or_insert_with(|| file_keys.clone());
        }
        // Each key the call holds, in this order; keys are built only for strategies on.
        let mut offer = |st: Strategy, key: &dyn Fn() -> Option<String>| {
            if on(st)
                && let Some(key) = key()
            {
                self.offer(st, key, holder.clone());
            }
        };
        offer(Strategy::SupersedeTodos, &|| todo_key(&t.tool));
        offer(Strategy::PruneSourceUrls, &|| {
            url_key(&t.tool, &t.state.input)
        });
        offer(Strategy::StateQuerySupersede, &|| {
            query_key(&t.tool, &t.state.input)
        });
        offer(Strategy::PruneSnapshots, &|| {
            snapshot_key(&t.tool, &s.snapshot_tools)
        });
        offer(Strategy::SupersedeSearches, &|| {
            search_key(&t.tool, &t.state.input)
        });
        for p in &file_keys {
            offer(Strategy::AggressiveFilePrune, &|| {
                Some(prefixed("file:", p))
            });
        }
        if let Some(hash) = hash {
            offer(Strategy::SupersedeDuplicates, &|| Some(call_key(hash)));
        }
    }

    /// `supersedeWrites`: a change waits for reads of its files (a protected one is never
    /// cleared: it waits for nothing); a whole read, protected or not, supersedes the
    /// changes before it.
    fn on_file_use(&mut self, used: FileUse, h: &Holder, paths: &[String]) {
        let (queued, pending) = (&mut self.queued, &mut self.pending);
        let stale = |at, by| queue(queued, pending, at, Strategy::SupersedeWrites, by, 0);
        match (used, paths) {
            (FileUse::Change, _) if !h.protected => {
                self.writes.on_change(h.at.clone(), h.order, paths, stale)
            }
            (FileUse::WholeRead, [path]) => self.writes.on_read(path, h.order, &h.call, stale),
            _ => {}
        }
    }

    /// `h` holds `key` now, unless a newer holder already does (then `h` is the stale one).
    fn offer(&mut self, st: Strategy, key: String, h: Holder) {
        use std::collections::hash_map::Entry;
        // A file key's path is bounded already (`remaining` holds it as the key does).
        let key = if st == Strategy::AggressiveFilePrune {
            key
        } else {
            bounded(key)
        };
        // One lookup, and the key's copy (a file path) only when a holder goes stale.
        let mut held = match self.latest.entry((st, key)) {
            Entry::Vacant(v) => {
                v.insert(h);
                return;
            }
            Entry::Occupied(o) => o,
        };
        if held.get().at == h.at {
            *held.get_mut() = h;
            return;
        }
        let path = (st == Strategy::AggressiveFilePrune).then(|| {
            held.key()
                .1
                .get("file:".len()..)
                .unwrap_or_default()
                .to_string()
        });
        let l = held.get_mut();
        let stale = if l.order > h.order {
            let by = String::from(&*l.call);
            (h, by)
        } else {
            let by = String::from(&*h.call);
            (std::mem::replace(l, h), by)
        };
        self.supersede(st, stale.0, stale.1, path.as_deref());
    }

    fn supersede(&mut self, st: Strategy, victim: Holder, by: String, path: Option<&str>) {
        // Protected calls are never cleared; a newer todo state still replaces an older one.
        if victim.protected && st != Strategy::SupersedeTodos {
            return;
        }
        if let (Some(path), Some(left)) = (path, self.remaining.get_mut(&victim.at)) {
            left.retain(|p| p != path);
            if !left.is_empty() {
                return;
            }
        }
        self.queue(victim.at, st, by, 0);
    }

    fn failed_call(&mut self, hash: u128, h: Holder) {
        if let Some(ok) = self.succeeded.get(&hash).filter(|ok| ok.order > h.order) {
            let by = String::from(&*ok.call);
            self.supersede(Strategy::PruneRetryParts, h, by, None);
            return;
        }
        let list = self.failed.entry(hash).or_default();
        if !list.iter().any(|f| f.at == h.at) {
            list.push(h);
        }
    }

    fn succeeded_call(&mut self, hash: u128, h: &Holder) {
        if self
            .succeeded
            .get(&hash)
            .is_none_or(|ok| ok.order <= h.order)
        {
            self.succeeded.insert(hash, h.clone());
        }
        let Some(list) = self.failed.get_mut(&hash) else {
            return;
        };
        let (older, newer): (Vec<Holder>, Vec<Holder>) =
            list.drain(..).partition(|f| f.order < h.order);
        if newer.is_empty() {
            self.failed.remove(&hash);
        } else {
            self.failed.insert(hash, newer);
        }
        for f in older {
            self.supersede(Strategy::PruneRetryParts, f, String::from(&*h.call), None);
        }
    }

    fn queue(&mut self, at: PartRef, strategy: Strategy, by: String, keep: u64) {
        queue(&mut self.queued, &mut self.pending, at, strategy, by, keep);
    }
}

/// Queues a decision unless the same one waits already ([`Tracker::queue`] on the two
/// fields, so a caller holding another field mutably can queue too).
fn queue(
    queued: &mut FastSet<(PartRef, Strategy)>,
    pending: &mut Vec<Pending>,
    at: PartRef,
    strategy: Strategy,
    by: String,
    keep: u64,
) {
    if queued.insert((at.clone(), strategy)) {
        pending.push(Pending {
            at,
            strategy,
            by,
            keep,
        });
    }
}

/// Protected file globs, compiled by the rule that validated them where they entered
/// (flags, session overrides); a list an older version stored past today's bounds keeps
/// every pattern that compiles.
fn compile_globs(patterns: &[String]) -> GlobSet {
    crate::config::protected_globs_lenient(patterns)
}

/// `prefix` then `rest`, in one allocation (keys are built for every tool call).
/// `text` itself when it is at most [`MAX_KEY_BYTES`], else `#` and its hash in 32 hex
/// digits: equal texts still give equal keys, and a key costs what its index allowance
/// counts.
fn bounded(text: String) -> String {
    if text.len() <= MAX_KEY_BYTES {
        return text;
    }
    format!("#{:032x}", text_hash(&text))
}

fn prefixed(prefix: &str, rest: &str) -> String {
    let mut key = String::with_capacity(prefix.len() + rest.len());
    key.push_str(prefix);
    key.push_str(rest);
    key
}

/// The duplicate-call key: `call:` and the hash as 32 lowercase hex digits (the bytes of
/// `format!("call:{hash:032x}")`, which snapshots hold, without the formatter).
fn call_key(hash: u128) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut key = *b"call:00000000000000000000000000000000";
    for (i, digit) in key[5..].iter_mut().rev().enumerate() {
        *digit = HEX[((hash >> (i * 4)) & 0xf) as usize];
    }
    // Only ASCII was written: the conversion cannot fail.
    String::from_utf8(key.to_vec()).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tracker read back from a snapshot written before keys were bounded (a key or a
    /// path over 256 bytes held as text) is rebuilt, so new calls' hashed keys meet it.
    #[test]
    fn a_restored_state_with_unbounded_keys_is_rebuilt() {
        let s = Settings::default();
        let holder = Holder {
            at: PartRef {
                msg: 0,
                part: Arc::from("p"),
            },
            order: (0, 0),
            call: Arc::from("c"),
            protected: false,
        };
        for long in [MAX_KEY_BYTES, MAX_KEY_BYTES + 1] {
            let mut t = Tracker::new(&s);
            let key = prefixed("file:", &"a".repeat(long));
            t.latest
                .insert((Strategy::AggressiveFilePrune, key), holder.clone());
            let stored = serde_json::to_value(&t).expect("serializes");
            let mut back: Tracker = serde_json::from_value(stored).expect("deserializes");
            back.restored(&s);
            assert_eq!(
                back.is_dirty(),
                long > MAX_KEY_BYTES,
                "a path of {long} bytes"
            );
        }
    }

    #[test]
    fn call_keys_are_the_formatted_bytes_snapshots_hold() {
        for hash in [
            0,
            1,
            0xf,
            u128::MAX,
            0xf73e_89dd_a746_116d_3105_96bc_740a_6558,
        ] {
            assert_eq!(call_key(hash), format!("call:{hash:032x}"));
        }
        assert_eq!(prefixed("file:", "src/a.rs"), "file:src/a.rs");
    }
}
