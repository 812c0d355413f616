//! Strategy names, sets and presets: what a server, a session or a flag can switch on.
//! They live in `config` (not next to the strategies' code in `engine/strategies/`) so the
//! domain model can name a strategy on a mark and every layer above can parse one.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Snapshot tools out of the box (Playwright MCP, Chrome DevTools MCP, generic names).
pub const DEFAULT_SNAPSHOT_TOOLS: &[&str] = &[
    "browser_snapshot",
    "browser_take_screenshot",
    "take_snapshot",
    "take_screenshot",
    "screenshot",
    "snapshot",
];

/// One strategy, by the name ACP's config uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Strategy {
    /// 1. A superseded or compacted call keeps only metadata in its input.
    PruneToolInputs,
    /// 2. `step-start` / `step-finish` never reach the context.
    PruneStepMarkers,
    /// 3. Only the newest `webfetch` of a url / `websearch` of a query stays.
    PruneSourceUrls,
    /// 4. Only the newest `ls`, `find`, `pwd`, `git status|branch|log`, `tree` stays.
    StateQuerySupersede,
    /// 5. Only the newest snapshot tool output stays.
    PruneSnapshots,
    /// 6. A failed call retried successfully with the same input is superseded.
    PruneRetryParts,
    /// 7. Attached files older than 2 turns become `[File: name, NKB]`.
    PruneFiles,
    /// 8. Code blocks in user messages older than 5 turns are truncated.
    PruneUserCodeBlocks,
    /// 9. Errors older than 3 turns keep their first line.
    TruncateOldErrors,
    /// 10. Any read/write/edit of a path supersedes every earlier operation on it.
    AggressiveFilePrune,
    /// Base layer: identical calls (same tool, same canonical input) keep only the newest.
    SupersedeDuplicates,
    /// Base layer: only the newest `todowrite`/`todoread` state stays.
    SupersedeTodos,
    /// Base layer: `glob`/`grep` of the same path + pattern (+ include) keep the newest.
    SupersedeSearches,
    /// compactd: tool outputs older than the newest `mask_keep` tool results read as a
    /// short placeholder naming the tool, the call id and the size (observation masking).
    MaskObservations,
    /// compactd: one output above `output_cap` of usable input reads as head + tail.
    CapLargeOutputs,
    /// compactd: a write, edit or patch is superseded once every file it changed has
    /// been read whole in a later message (seed 03's write→read supersede).
    SupersedeWrites,
}

impl Strategy {
    /// Every strategy, in report order: ACP's (seed 03's ten, then the base layer), then
    /// compactd's own.
    pub const ALL: [Strategy; 16] = {
        let mut all = [Strategy::MaskObservations; 16];
        let mut i = 0;
        while i < Strategy::ACP.len() {
            all[i] = Strategy::ACP[i];
            i += 1;
        }
        all[13] = Strategy::MaskObservations;
        all[14] = Strategy::CapLargeOutputs;
        all[15] = Strategy::SupersedeWrites;
        all
    };

    /// ACP's strategies (seed 03's ten and the base layer), without compactd's own.
    pub const ACP: [Strategy; 13] = [
        Strategy::PruneToolInputs,
        Strategy::PruneStepMarkers,
        Strategy::PruneSourceUrls,
        Strategy::StateQuerySupersede,
        Strategy::PruneSnapshots,
        Strategy::PruneRetryParts,
        Strategy::PruneFiles,
        Strategy::PruneUserCodeBlocks,
        Strategy::TruncateOldErrors,
        Strategy::AggressiveFilePrune,
        Strategy::SupersedeDuplicates,
        Strategy::SupersedeTodos,
        Strategy::SupersedeSearches,
    ];

    /// ACP's config name (camelCase).
    pub fn name(self) -> &'static str {
        match self {
            Strategy::PruneToolInputs => "pruneToolInputs",
            Strategy::PruneStepMarkers => "pruneStepMarkers",
            Strategy::PruneSourceUrls => "pruneSourceUrls",
            Strategy::StateQuerySupersede => "stateQuerySupersede",
            Strategy::PruneSnapshots => "pruneSnapshots",
            Strategy::PruneRetryParts => "pruneRetryParts",
            Strategy::PruneFiles => "pruneFiles",
            Strategy::PruneUserCodeBlocks => "pruneUserCodeBlocks",
            Strategy::TruncateOldErrors => "truncateOldErrors",
            Strategy::AggressiveFilePrune => "aggressiveFilePrune",
            Strategy::SupersedeDuplicates => "supersedeDuplicates",
            Strategy::SupersedeTodos => "supersedeTodos",
            Strategy::SupersedeSearches => "supersedeSearches",
            Strategy::MaskObservations => "maskObservations",
            Strategy::CapLargeOutputs => "capLargeOutputs",
            Strategy::SupersedeWrites => "supersedeWrites",
        }
    }

    /// The same name in snake_case (`prune_tool_inputs`).
    pub fn snake_name(self) -> String {
        let mut out = String::new();
        for c in self.name().chars() {
            if c.is_ascii_uppercase() {
                out.push('_');
                out.push(c.to_ascii_lowercase());
            } else {
                out.push(c);
            }
        }
        out
    }

    /// True for strategies that mark an older call stale because of a newer one.
    pub fn supersedes(self) -> bool {
        matches!(
            self,
            Strategy::PruneSourceUrls
                | Strategy::StateQuerySupersede
                | Strategy::PruneSnapshots
                | Strategy::PruneRetryParts
                | Strategy::AggressiveFilePrune
                | Strategy::SupersedeDuplicates
                | Strategy::SupersedeTodos
                | Strategy::SupersedeSearches
                | Strategy::SupersedeWrites
        )
    }

    /// Which mark wins when two strategies want the same part: a supersede (the part is
    /// stale) outranks masking (the part is old), which outranks a shortening.
    pub fn rank(self) -> u8 {
        match self {
            s if s.supersedes() => 3,
            Strategy::MaskObservations => 2,
            _ => 1,
        }
    }

    fn bit(self) -> u16 {
        1 << (self as u16)
    }
}

impl fmt::Display for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An unknown strategy or preset name (its beginning: [`super::shown::clipped`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown strategy {0:?} (known: {known})", known = known_names())]
pub struct UnknownStrategy(pub String);

fn known_names() -> String {
    Strategy::ALL
        .iter()
        .map(|s| s.name())
        .collect::<Vec<_>>()
        .join(", ")
}

impl FromStr for Strategy {
    type Err = UnknownStrategy;

    /// Accepts ACP's camelCase name and its snake_case twin, in any case.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        // Marks carry the exact name: no allocation on that (hot) path.
        if let Some(st) = Strategy::ALL.into_iter().find(|st| st.name() == s) {
            return Ok(st);
        }
        let wanted: String = s
            .trim()
            .chars()
            .filter(|c| *c != '_' && *c != '-')
            .collect();
        Strategy::ALL
            .into_iter()
            .find(|st| st.name().eq_ignore_ascii_case(&wanted))
            .ok_or_else(|| UnknownStrategy(super::shown::clipped(s).into_owned()))
    }
}

/// Which strategies are on.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct StrategySet(u16);

impl StrategySet {
    /// No strategy.
    pub const NONE: StrategySet = StrategySet(0);

    /// Every strategy, ACP's and compactd's (the default: opt-out).
    pub fn all() -> StrategySet {
        Strategy::ALL
            .iter()
            .fold(StrategySet::NONE, |s, st| s.with(*st, true))
    }

    /// compactd's default: every strategy but `aggressiveFilePrune`. Over the ten shared
    /// traces that one strategy nearly doubled the references the agent made to content
    /// the context had hidden (an edit supersedes the read the agent is working from),
    /// while observation masking already hides old reads by age. `supersedeWrites` keeps
    /// the seed's legacy write→read supersede, which hides only the change.
    pub fn compactd() -> StrategySet {
        StrategySet::all().with(Strategy::AggressiveFilePrune, false)
    }

    /// ACP's strategies alone (its `compact` preset).
    pub fn acp() -> StrategySet {
        Strategy::ACP
            .iter()
            .fold(StrategySet::NONE, |s, st| s.with(*st, true))
    }

    /// The set a preset names.
    pub fn preset(p: StrategyPreset) -> StrategySet {
        match p {
            StrategyPreset::Compactd => StrategySet::compactd(),
            StrategyPreset::Compact => StrategySet::acp(),
            StrategyPreset::Balanced => StrategySet::acp()
                .with(Strategy::PruneUserCodeBlocks, false)
                .with(Strategy::TruncateOldErrors, false),
            StrategyPreset::Verbose => StrategySet::NONE,
        }
    }

    /// This set with one strategy switched.
    pub fn with(self, s: Strategy, on: bool) -> StrategySet {
        if on {
            StrategySet(self.0 | s.bit())
        } else {
            StrategySet(self.0 & !s.bit())
        }
    }

    /// True when `s` is on.
    pub fn has(self, s: Strategy) -> bool {
        self.0 & s.bit() != 0
    }

    /// True when no strategy is on.
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// The strategies that are on, in report order.
    pub fn iter(self) -> impl Iterator<Item = Strategy> {
        Strategy::ALL.into_iter().filter(move |s| self.has(*s))
    }

    /// Parses a comma-separated list of names: exactly those are on.
    pub fn parse_list(list: &str) -> Result<StrategySet, UnknownStrategy> {
        list.split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .try_fold(StrategySet::NONE, |set, name| {
                Ok(set.with(name.parse()?, true))
            })
    }
}

impl Default for StrategySet {
    fn default() -> Self {
        StrategySet::compactd()
    }
}

impl fmt::Debug for StrategySet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_set()
            .entries(self.iter().map(Strategy::name))
            .finish()
    }
}

/// A set is written as the list of its strategies' names (in report order), so the bits
/// behind it can be renumbered without changing a stored value.
impl Serialize for StrategySet {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.iter())
    }
}

impl<'de> Deserialize<'de> for StrategySet {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let list = Vec::<Strategy>::deserialize(d)?;
        Ok(list
            .into_iter()
            .fold(StrategySet::NONE, |set, st| set.with(st, true)))
    }
}

/// ACP's presets, and compactd's default.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StrategyPreset {
    /// compactd's default: every strategy but `aggressiveFilePrune`.
    Compactd,
    /// ACP's strategies (ACP's default).
    Compact,
    /// All but user code block and error truncation.
    Balanced,
    /// None.
    Verbose,
}

impl FromStr for StrategyPreset {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "compactd" => Ok(StrategyPreset::Compactd),
            "compact" => Ok(StrategyPreset::Compact),
            "balanced" => Ok(StrategyPreset::Balanced),
            "verbose" => Ok(StrategyPreset::Verbose),
            _ => Err(format!(
                "unknown strategy preset {:?} (compactd, compact, balanced, verbose)",
                super::shown::clipped(s.trim())
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_in_camel_and_snake_case() {
        for s in Strategy::ALL {
            assert_eq!(s.name().parse::<Strategy>(), Ok(s));
            assert_eq!(s.snake_name().parse::<Strategy>(), Ok(s));
        }
        assert_eq!(
            "prune_tool_inputs".parse::<Strategy>(),
            Ok(Strategy::PruneToolInputs)
        );
        assert!("pruneEverything".parse::<Strategy>().is_err());
    }

    #[test]
    fn presets_follow_acp() {
        let compactd = StrategySet::preset(StrategyPreset::Compactd);
        assert_eq!(compactd, StrategySet::default());
        assert!(
            compactd.has(Strategy::MaskObservations) && compactd.has(Strategy::CapLargeOutputs)
        );
        assert!(!compactd.has(Strategy::AggressiveFilePrune));
        let acp = StrategySet::preset(StrategyPreset::Compact);
        assert_eq!(acp.iter().count(), Strategy::ACP.len());
        assert!(!acp.has(Strategy::MaskObservations));
        let balanced = StrategySet::preset(StrategyPreset::Balanced);
        assert!(!balanced.has(Strategy::PruneUserCodeBlocks));
        assert!(!balanced.has(Strategy::TruncateOldErrors));
        assert_eq!(balanced.iter().count(), Strategy::ACP.len() - 2);
        assert!(StrategySet::preset(StrategyPreset::Verbose).is_empty());
    }

    #[test]
    fn lists_parse_exactly() {
        let set = StrategySet::parse_list("pruneFiles, truncate_old_errors").expect("valid");
        assert_eq!(
            set.iter().collect::<Vec<_>>(),
            [Strategy::PruneFiles, Strategy::TruncateOldErrors]
        );
        let err = StrategySet::parse_list("pruneFiles,nope").expect_err("unknown");
        assert!(err.to_string().contains("\"nope\""), "{err}");
    }
}
