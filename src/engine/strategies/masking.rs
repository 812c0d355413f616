//! `maskObservations` (compactd; Lindenbauer et al., "The Complexity Trap", 2025): tool
//! outputs older than the newest `mask_keep` tool results read as a short placeholder that
//! names the tool, the call id and the size, so the agent knows what it saw and can ask
//! for it back (`compactd_recall`). Unlike OpenCode's prune it reaches into the current
//! user turn, where single-prompt sub-agent runs spend most of their tokens. It masks only
//! what the model has seen: the results of the newest message with results (a step's 12
//! parallel calls) wait for a later message's results, whose request sent them. A host
//! that writes every step into one assistant message is masked only once a later
//! message has results.
//!
//! The state is a list of results in arrival order and how far masking has reached, so
//! each new result costs O(1). (A rebuild feeds them in position order: a step whose
//! calls completed out of order may be masked differently after one.) A result is known
//! by its message and part id: part ids are scoped to their message, and a host may
//! number each message's parts from `p0`.

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize, Serializer};

use super::PartRef;
use crate::domain::FastSet;

/// The tool results seen, oldest first, and how many are already queued for masking.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Masking {
    results: Vec<(PartRef, bool)>,
    /// The results in `results`, to tell a re-sent one. Derived: rebuilt from `results`
    /// when a snapshot is restored ([`Masking::restored`]). It is still written as the
    /// part ids older builds kept (the same format 3 document), and not read back.
    #[serde(serialize_with = "part_ids", skip_deserializing)]
    seen: FastSet<PartRef>,
    queued: usize,
    /// The newest message position with a result: its results wait. Derived, as `seen`.
    #[serde(skip)]
    newest: usize,
}

/// `seen` as builds before it was keyed by message wrote it: each part id once, sorted.
fn part_ids<S: Serializer>(seen: &FastSet<PartRef>, s: S) -> Result<S::Ok, S::Error> {
    let ids: BTreeSet<&str> = seen.iter().map(|at| &*at.part).collect();
    s.collect_seq(ids)
}

impl Masking {
    /// True when every result is below message `len` and the queued count is in range.
    pub(crate) fn fits(&self, len: usize) -> bool {
        self.queued <= self.results.len() && self.results.iter().all(|(at, _)| at.msg < len)
    }

    /// After decoding: rebuilds what is derived from `results` (not read from a
    /// snapshot). Once per restore, O(results).
    pub(crate) fn restored(&mut self) {
        self.seen = self.results.iter().map(|(at, _)| at.clone()).collect();
        self.newest = self.results.iter().map(|(at, _)| at.msg).max().unwrap_or(0);
    }

    /// A tool result (completed or failed) at `at`; `protected` ones count toward the
    /// newest `keep` but are never masked. Hands `mask` each result that fell out of the
    /// newest `keep` with this one (no list built: it runs for every tool result).
    pub fn on_result(
        &mut self,
        at: PartRef,
        protected: bool,
        keep: u32,
        mut mask: impl FnMut(PartRef),
    ) {
        if !self.seen.insert(at.clone()) {
            return; // a re-sent result is not a new one
        }
        // Not the message of this result: a result of an older message can arrive after
        // a newer message's (a call that completed late), whose results still wait.
        self.newest = self.newest.max(at.msg);
        let newest = self.newest;
        self.results.push((at, protected));
        let keep = usize::try_from(keep).unwrap_or(usize::MAX);
        while self.results.len().saturating_sub(self.queued) > keep {
            let Some((victim, protected)) = self.results.get(self.queued) else {
                break;
            };
            // A result of the message still being written (a step's 12 parallel calls)
            // has not reached the model yet: it waits for the next message's results,
            // whose request sends it.
            if victim.msg == newest {
                break;
            }
            if !protected {
                mask(victim.clone());
            }
            self.queued += 1;
        }
    }
}

/// What a masked output reads as: the tool, the call id and the size, and how to get it
/// back.
pub fn masked_text(tool: &str, call_id: &str, bytes: usize) -> String {
    // Pieces pushed into one buffer: this runs for every masked part on every turn.
    let recall = crate::engine::recall::RECALL_TOOL;
    let mut text = String::with_capacity(80 + tool.len() + call_id.len() + recall.len());
    text.push('[');
    text.push_str(tool);
    text.push_str(" output hidden to save context (");
    push_size(&mut text, bytes);
    for piece in [
        "); call ",
        recall,
        " with call_id \"",
        call_id,
        "\" to see it]",
    ] {
        text.push_str(piece);
    }
    text
}

/// A size for a placeholder: `812 bytes`, `12.3 KB`, `1.4 MB`.
pub(crate) fn size(bytes: usize) -> String {
    let mut out = String::new();
    push_size(&mut out, bytes);
    out
}

/// Appends [`size`]'s text. Tenths by integer arithmetic, which is what formatting the
/// float with one decimal gives except exactly halfway between two tenths, where the
/// float's binary value decides, and past 2^53 bytes, where the float is not the size:
/// those few go through the float. (Formatting the float every time was most of
/// re-rendering a masked part.)
fn push_size(out: &mut String, bytes: usize) {
    let mut digits = itoa::Buffer::new();
    let (unit, name) = match bytes {
        b if b < 1000 => {
            out.push_str(digits.format(b));
            out.push_str(" bytes");
            return;
        }
        b if b < 1_000_000 => (1000, " KB"),
        _ => (1_000_000, " MB"),
    };
    let tenth = unit / 10;
    if bytes % tenth == tenth / 2 || bytes >= 1 << 53 {
        use std::fmt::Write as _;
        // Writing into a String cannot fail.
        let _ = write!(out, "{:.1}{name}", bytes as f64 / unit as f64);
        return;
    }
    let tenths = bytes / tenth + usize::from(bytes % tenth > tenth / 2);
    out.push_str(digits.format(tenths / 10));
    out.push('.');
    out.push_str(digits.format(tenths % 10));
    out.push_str(name);
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    fn at(i: usize) -> PartRef {
        PartRef {
            msg: i,
            part: Arc::from(format!("p{i}")),
        }
    }

    /// The results `on_result` hands out for one new result.
    fn masked(m: &mut Masking, at: PartRef, protected: bool, keep: u32) -> Vec<PartRef> {
        let mut out = Vec::new();
        m.on_result(at, protected, keep, |v| out.push(v));
        out
    }

    #[test]
    fn results_beyond_the_newest_keep_are_masked_once() {
        let mut m = Masking::default();
        assert!(masked(&mut m, at(0), false, 2).is_empty());
        assert!(masked(&mut m, at(1), false, 2).is_empty());
        assert_eq!(masked(&mut m, at(2), false, 2), vec![at(0)]);
        assert!(masked(&mut m, at(2), false, 2).is_empty(), "re-sent");
        assert_eq!(masked(&mut m, at(3), false, 2), vec![at(1)]);
    }

    /// Part ids are scoped to their message: `p0` of message 1 is not `p0` of message 0
    /// sent again.
    #[test]
    fn the_same_part_id_in_another_message_is_another_result() {
        let p0 = |msg| PartRef {
            msg,
            part: Arc::from("p0"),
        };
        let mut m = Masking::default();
        assert!(masked(&mut m, p0(0), false, 1).is_empty());
        assert_eq!(masked(&mut m, p0(1), false, 1), vec![p0(0)]);
        assert!(masked(&mut m, p0(1), false, 1).is_empty(), "re-sent");
    }

    /// The results that wait are the newest message's with results, not those of the
    /// message whose result came last: message 1's late result leaves message 2's
    /// waiting, live and after a restore.
    #[test]
    fn a_late_result_of_an_older_message_leaves_the_newest_ones_waiting() {
        let q = |i: usize| PartRef {
            msg: 2,
            part: Arc::from(format!("q{i}")),
        };
        for restore in [false, true] {
            let mut m = Masking::default();
            for i in 0..3 {
                assert!(masked(&mut m, q(i), false, 2).is_empty());
            }
            if restore {
                let stored = serde_json::to_value(&m).expect("serializes");
                m = serde_json::from_value(stored).expect("deserializes");
                m.restored();
            }
            assert!(
                masked(&mut m, at(1), false, 2).is_empty(),
                "late ({restore})"
            );
            assert_eq!(masked(&mut m, at(3), false, 2), vec![q(0), q(1), q(2)]);
        }
    }

    /// A snapshot writes `seen` as the part ids older builds read, and a restore
    /// rebuilds it from the list: a re-sent result is still no new one.
    #[test]
    fn a_restored_list_knows_the_results_it_holds() {
        let mut m = Masking::default();
        for i in 0..3 {
            masked(&mut m, at(i), false, 1);
        }
        let stored = serde_json::to_value(&m).expect("serializes");
        assert_eq!(stored["seen"], serde_json::json!(["p0", "p1", "p2"]));
        let mut back: Masking = serde_json::from_value(stored).expect("deserializes");
        back.restored();
        assert!(masked(&mut back, at(2), false, 1).is_empty(), "re-sent");
        assert_eq!(masked(&mut back, at(3), false, 1), vec![at(2)]);
    }

    #[test]
    fn protected_results_count_but_are_never_masked() {
        let mut m = Masking::default();
        masked(&mut m, at(0), true, 1);
        assert!(
            masked(&mut m, at(1), false, 1).is_empty(),
            "p0 is protected"
        );
        assert_eq!(masked(&mut m, at(2), false, 1), vec![at(1)]);
    }

    #[test]
    fn a_smaller_keep_masks_every_result_beyond_it_at_once() {
        let mut m = Masking::default();
        for i in 0..4 {
            masked(&mut m, at(i), i == 1, 10);
        }
        assert_eq!(masked(&mut m, at(4), false, 1), vec![at(0), at(2), at(3)]);
    }

    #[test]
    fn the_placeholder_names_tool_call_and_size() {
        let t = masked_text("read", "call_7", 12_345);
        assert!(
            t.contains("read") && t.contains("call_7") && t.contains("12.3 KB"),
            "{t}"
        );
        assert_eq!(size(999), "999 bytes");
        assert_eq!(size(1_400_000), "1.4 MB");
    }

    #[test]
    fn sizes_read_as_the_float_formatted_to_one_decimal() {
        let float = |b: usize| match b {
            b if b < 1000 => format!("{b} bytes"),
            b if b < 1_000_000 => format!("{:.1} KB", b as f64 / 1000.0),
            b => format!("{:.1} MB", b as f64 / 1_000_000.0),
        };
        // Every size up to 20 KB, every halfway case and its neighbours to 2 MB, and a
        // stride through the rest up to 10 GB (carries into the next unit included).
        let halfway = (0..40_000usize).flat_map(|k| {
            let (unit, k) = if k < 20_000 {
                (100, k)
            } else {
                (100_000, k - 20_000)
            };
            let b = k * unit + unit / 2;
            [b.saturating_sub(1), b, b + 1]
        });
        let stride = (0..100_000usize).map(|k| k * 100_003);
        for b in (0..20_000)
            .chain(halfway)
            .chain(stride)
            .chain([999_949, 999_950, 999_999])
            .chain([(1 << 53) - 1, 1 << 53, (1 << 53) + 1, usize::MAX])
        {
            assert_eq!(size(b), float(b), "{b} bytes");
        }
    }
}
