//! Engine configuration: the server-wide defaults (from the seeds), the per-session
//! overrides a host may send, and the resolved [`Settings`] one session runs with.
//!
//! Plain values and their rules: reading flags, `COMPACTD_*` environment variables and the
//! config file happens in `cli/`; every range rule lives in `validate.rs`, called by the
//! CLI and the gRPC conversion alike; strategy names and presets are in `strategy.rs`.

/// Tokens kept free for the model's answer when `limit.input` is not given (seed 02).
pub const OUTPUT_TOKEN_MAX: u64 = 32_000;
/// OpenCode today reserves `min(COMPACTION_BUFFER, limit.output)` below usable input.
pub const COMPACTION_BUFFER: u64 = 20_000;
/// Default overflow threshold, a ratio of usable input (research note: 92%).
pub const DEFAULT_THRESHOLD: f64 = 0.92;
/// PRUNE_PROTECT: the newest tool output tokens prune never touches (seed 01).
pub const PRUNE_PROTECT: u64 = 40_000;
/// PRUNE_MINIMUM: prune commits only when it saves more than this (seed 01).
pub const PRUNE_MINIMUM: u64 = 20_000;
/// User turns at the end prune never touches (seed 01).
pub const PROTECT_TURNS: u32 = 2;
/// Tools whose output prune never clears (seed 01).
pub const PRUNE_PROTECTED_TOOLS: &[&str] = &["skill"];
/// What a cleared tool output reads as in the context (research note).
pub const PLACEHOLDER: &str = "[Old tool result content cleared]";
/// What a pending or running tool reads as in the context (OpenCode `toModelMessages`).
pub const INTERRUPTED: &str = "[Tool execution was interrupted]";
/// Finished assistant messages to wait after a compaction that left the context over the
/// threshold, before compacting automatically again.
pub const AUTO_COOLDOWN: u32 = 2;
/// Consecutive failed automatic compactions that pause auto-compaction for a session.
pub const BREAKER_FAILURES: u32 = 3;
/// Default limit of parts in one message (a real step has tens).
pub const MAX_PARTS_PER_MESSAGE: usize = 10_000;
/// The synthetic user message after an automatic compaction (seed 02).
pub const AUTO_CONTINUE_TEXT: &str = "Continue if you have next steps";
/// How a user `compaction` part reads in the context (OpenCode `toModelMessages`).
pub const COMPACTION_PROMPT_TEXT: &str = "What did we do so far?";
/// Tools the aggressive strategies never clear for age or size (ACP's list without
/// `write`/`edit`, which seed 03's one-file-one-view supersedes).
pub const STRATEGY_PROTECTED_TOOLS: &[&str] = &[
    "task",
    "todowrite",
    "todoread",
    "skill",
    "batch",
    "plan_enter",
    "plan_exit",
];
/// `pruneFiles`: attachments older than this many user turns become breadcrumbs (the
/// last 2 turns are never touched).
pub const FILE_AGE_TURNS: usize = 2;
/// `maskObservations`: the newest tool results that always read in full.
pub const MASK_KEEP: u32 = 10;
/// `capLargeOutputs`: an output above this share of usable input reads as head + tail.
pub const OUTPUT_CAP: f64 = 0.1;
/// `truncateOldErrors`: errors older than this many user turns keep their first line.
pub const ERROR_AGE_TURNS: usize = 3;
/// `pruneUserCodeBlocks`: user code blocks older than this many user turns are truncated.
pub const CODE_BLOCK_AGE_TURNS: usize = 5;

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::tokens::Tokenizer;

mod cache;
pub mod float;
pub mod redact;
pub mod shown;
mod strategy;
mod validate;
pub use cache::CacheModel;
pub use strategy::{
    DEFAULT_SNAPSHOT_TOOLS, Strategy, StrategyPreset, StrategySet, UnknownStrategy,
};
pub use validate::{
    InvalidSetting, MAX_AUTO_CONTINUE, MAX_GLOB, MAX_GLOBS, MAX_MASK_KEEP, MAX_MODEL_NAME,
    MAX_PLACEHOLDER, MAX_PROMPT, MAX_PROTECT_TURNS, compaction_text, compaction_text_given,
    model_name, protected_globs, protected_globs_lenient,
};

/// How cached prompt tokens are counted when `tokens.total` is absent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CacheCounting {
    /// `input` excludes cache reads (Anthropic; OpenCode's stored usage): add them.
    #[default]
    Separate,
    /// `input` already includes cache reads (OpenAI raw usage): do not add them again.
    Included,
}

impl CacheCounting {
    /// The formula's name, shown in overflow reports.
    pub fn formula(self) -> &'static str {
        match self {
            CacheCounting::Separate => "input+cache.read+output",
            CacheCounting::Included => "input+output",
        }
    }
}

/// Tokens held back below usable input before the ratio applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reserved {
    /// A fixed number of tokens (compactd default: 0).
    Fixed(u64),
    /// OpenCode today: `min(20000, limit.output)` off `limit.input`, none without it; and
    /// overflow at the threshold itself (`engine::overflow`).
    OpenCode,
}

/// Named overflow settings a session can pick.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OverflowPreset {
    /// Ratio 0.92, reserved 0.
    Compactd,
    /// Ratio 1.0, OpenCode's reserve ([`Reserved::OpenCode`]): what OpenCode does today.
    OpenCode,
}

fn strings(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

/// Server-wide defaults every session starts from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EngineConfig {
    /// Overflow detection and automatic compaction (`COMPACTD_DISABLE_AUTOCOMPACT`).
    pub auto_compact: bool,
    /// Automatic prune after finished assistant messages (`COMPACTD_DISABLE_PRUNE`).
    pub prune: bool,
    /// Overflow threshold ratio of usable input.
    #[serde(with = "crate::config::float")]
    pub threshold: f64,
    /// Buffer below usable input.
    pub reserved: Reserved,
    /// Cache counting rule.
    pub cache_counting: CacheCounting,
    /// PRUNE_PROTECT.
    pub prune_protect: u64,
    /// PRUNE_MINIMUM.
    pub prune_minimum: u64,
    /// Tools prune never clears.
    pub protected_tools: Vec<String>,
    /// User turns prune never touches.
    pub protect_turns: u32,
    /// Placeholder for cleared outputs.
    pub placeholder: String,
    /// Text of the synthetic user message after an automatic compaction.
    pub auto_continue: String,
    /// Parts one message may hold (0: no limit).
    pub max_parts_per_message: usize,
    /// Cooldown after a compaction that did not fix the overflow (finished messages).
    pub auto_cooldown: u32,
    /// Consecutive automatic failures that pause auto-compaction (0: never pause).
    pub breaker_failures: u32,
    /// Strategies that are on (default: the `compactd` preset).
    pub strategies: StrategySet,
    /// Tools the strategies never clear for age or size.
    pub strategy_protected_tools: Vec<String>,
    /// Files (globs over normalized paths) whose operations are never superseded.
    pub protected_file_globs: Vec<String>,
    /// Tools whose outputs are snapshots (`pruneSnapshots`).
    pub snapshot_tools: Vec<String>,
    /// `maskObservations`: the newest tool results never masked.
    pub mask_keep: u32,
    /// `capLargeOutputs`: the share of usable input one output may fill.
    #[serde(with = "crate::config::float")]
    pub output_cap: f64,
    /// The provider's prompt-cache prices, which the scheduler weighs every rewrite of
    /// the prompt's past against (`none`: apply at once).
    pub cache_model: CacheModel,
    /// What counts the session's text (`auto`: by model family; the OpenCode preset:
    /// `chars4`, so prune decides on OpenCode's own numbers).
    pub tokenizer: Tokenizer,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            auto_compact: true,
            prune: true,
            threshold: DEFAULT_THRESHOLD,
            reserved: Reserved::Fixed(0),
            cache_counting: CacheCounting::Separate,
            prune_protect: PRUNE_PROTECT,
            prune_minimum: PRUNE_MINIMUM,
            protected_tools: PRUNE_PROTECTED_TOOLS
                .iter()
                .map(|s| s.to_string())
                .collect(),
            protect_turns: PROTECT_TURNS,
            placeholder: PLACEHOLDER.to_string(),
            auto_continue: AUTO_CONTINUE_TEXT.to_string(),
            max_parts_per_message: MAX_PARTS_PER_MESSAGE,
            auto_cooldown: AUTO_COOLDOWN,
            breaker_failures: BREAKER_FAILURES,
            strategies: StrategySet::compactd(),
            strategy_protected_tools: strings(STRATEGY_PROTECTED_TOOLS),
            protected_file_globs: Vec::new(),
            snapshot_tools: strings(DEFAULT_SNAPSHOT_TOOLS),
            mask_keep: MASK_KEEP,
            output_cap: OUTPUT_CAP,
            cache_model: CacheModel::ANTHROPIC,
            tokenizer: Tokenizer::Auto,
        }
    }
}

/// What a host may override per session; `None` inherits the server value.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SessionOverrides {
    /// Applied first, then the fields below.
    pub preset: Option<OverflowPreset>,
    /// Overflow detection / auto compaction.
    pub auto_compact: Option<bool>,
    /// Automatic prune.
    pub prune: Option<bool>,
    /// Threshold ratio.
    #[serde(with = "crate::config::float::option")]
    pub threshold: Option<f64>,
    /// Fixed reserved buffer.
    pub reserved: Option<u64>,
    /// Cache counting rule.
    pub cache_counting: Option<CacheCounting>,
    /// PRUNE_PROTECT.
    pub prune_protect: Option<u64>,
    /// PRUNE_MINIMUM.
    pub prune_minimum: Option<u64>,
    /// Protected tools (replaces the server list).
    pub protected_tools: Option<Vec<String>>,
    /// Protected user turns.
    pub protect_turns: Option<u32>,
    /// Model the summarizer endpoint is asked for (read by the server, not the engine).
    pub compaction_model: Option<String>,
    /// Strategy preset applied before the switches.
    pub strategy_preset: Option<StrategyPreset>,
    /// Per-strategy switches (newer switches win strategy by strategy).
    pub strategies: BTreeMap<Strategy, bool>,
    /// Strategy-protected tools (replaces the server list).
    pub strategy_protected_tools: Option<Vec<String>>,
    /// Protected file globs (replaces the server list).
    pub protected_file_globs: Option<Vec<String>>,
    /// Snapshot tools (replaces the server list).
    pub snapshot_tools: Option<Vec<String>>,
    /// What a cleared tool output reads as.
    pub placeholder: Option<String>,
    /// Text of the synthetic user message after an automatic compaction.
    pub auto_continue: Option<String>,
    /// Compaction agent's system prompt (read by the server, not the engine).
    pub compaction_system: Option<String>,
    /// Summary prompt (read by the server).
    pub compaction_prompt: Option<String>,
    /// Summary template (read by the server).
    pub compaction_template: Option<String>,
    /// `maskObservations`: newest tool results never masked.
    pub mask_keep: Option<u32>,
    /// `capLargeOutputs`: share of usable input one output may fill.
    #[serde(with = "crate::config::float::option")]
    pub output_cap: Option<f64>,
    /// Prompt-cache prices the scheduler weighs rewrites against.
    pub cache_model: Option<CacheModel>,
    /// What counts the session's text.
    pub tokenizer: Option<Tokenizer>,
}

impl SessionOverrides {
    /// Overlays `newer` on `self`: fields `newer` sets win, the rest stay.
    pub fn merge(&mut self, newer: &SessionOverrides) {
        macro_rules! take {
            ($($f:ident),*) => { $( if newer.$f.is_some() { self.$f = newer.$f.clone(); } )* };
        }
        take!(
            preset,
            auto_compact,
            prune,
            threshold,
            reserved,
            cache_counting,
            prune_protect,
            prune_minimum,
            protected_tools,
            protect_turns,
            compaction_model,
            strategy_preset,
            strategy_protected_tools,
            protected_file_globs,
            snapshot_tools,
            placeholder,
            auto_continue,
            compaction_system,
            compaction_prompt,
            compaction_template,
            mask_keep,
            output_cap,
            cache_model,
            tokenizer
        );
        self.strategies
            .extend(newer.strategies.iter().map(|(k, v)| (*k, *v)));
    }
}

/// The settings one session runs with: server config with its overrides applied.
pub type Settings = EngineConfig;

impl EngineConfig {
    /// Resolves a session's settings: the server config, then the preset, then overrides.
    pub fn resolve(&self, o: &SessionOverrides) -> Settings {
        let mut s = self.clone();
        match o.preset {
            Some(OverflowPreset::OpenCode) => {
                s.threshold = 1.0;
                s.reserved = Reserved::OpenCode;
                // OpenCode prunes as soon as it decides: no cache-aware holding.
                s.cache_model = CacheModel::NONE;
                // ... on its own counts (JavaScript length ÷ 4).
                s.tokenizer = Tokenizer::Chars4;
            }
            Some(OverflowPreset::Compactd) => {
                s.threshold = DEFAULT_THRESHOLD;
                s.reserved = Reserved::Fixed(0);
            }
            None => {}
        }
        if let Some(v) = o.auto_compact {
            s.auto_compact = v;
        }
        if let Some(v) = o.prune {
            s.prune = v;
        }
        if let Some(v) = o.threshold {
            s.threshold = v;
        }
        if let Some(v) = o.reserved {
            s.reserved = Reserved::Fixed(v);
        }
        if let Some(v) = o.cache_counting {
            s.cache_counting = v;
        }
        if let Some(v) = o.prune_protect {
            s.prune_protect = v;
        }
        if let Some(v) = o.prune_minimum {
            s.prune_minimum = v;
        }
        if let Some(v) = &o.protected_tools {
            s.protected_tools = v.clone();
        }
        if let Some(v) = o.protect_turns {
            s.protect_turns = v;
        }
        if let Some(p) = o.strategy_preset {
            s.strategies = StrategySet::preset(p);
        }
        for (st, on) in &o.strategies {
            s.strategies = s.strategies.with(*st, *on);
        }
        if let Some(v) = &o.strategy_protected_tools {
            s.strategy_protected_tools = v.clone();
        }
        if let Some(v) = &o.protected_file_globs {
            s.protected_file_globs = v.clone();
        }
        if let Some(v) = &o.snapshot_tools {
            s.snapshot_tools = v.clone();
        }
        if let Some(v) = &o.placeholder {
            s.placeholder = v.clone();
        }
        if let Some(v) = &o.auto_continue {
            s.auto_continue = v.clone();
        }
        if let Some(v) = o.mask_keep {
            s.mask_keep = v;
        }
        if let Some(v) = o.output_cap {
            s.output_cap = v;
        }
        if let Some(v) = o.cache_model {
            s.cache_model = v;
        }
        if let Some(v) = o.tokenizer {
            s.tokenizer = v;
        }
        s
    }

    /// True when the aggressive strategies must leave this tool's calls alone.
    pub fn is_strategy_protected(&self, tool: &str) -> bool {
        self.strategy_protected_tools
            .iter()
            .any(|t| t.eq_ignore_ascii_case(tool))
    }

    /// True when prune must leave this tool's output alone.
    pub fn is_protected_tool(&self, tool: &str) -> bool {
        self.protected_tools.iter().any(|t| t == tool)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_the_seed_constants() {
        let c = EngineConfig::default();
        assert_eq!(c.threshold, 0.92);
        assert_eq!(c.prune_protect, 40_000);
        assert_eq!(c.prune_minimum, 20_000);
        assert_eq!(c.protected_tools, vec!["skill".to_string()]);
        assert_eq!(c.protect_turns, 2);
        assert_eq!(c.placeholder, "[Old tool result content cleared]");
        assert_eq!(c.reserved, Reserved::Fixed(0));
    }

    #[test]
    fn opencode_preset_then_override() {
        let base = EngineConfig::default();
        let o = SessionOverrides {
            preset: Some(OverflowPreset::OpenCode),
            prune_minimum: Some(5),
            ..Default::default()
        };
        let s = base.resolve(&o);
        assert_eq!(s.threshold, 1.0);
        assert_eq!(s.reserved, Reserved::OpenCode);
        assert_eq!(s.prune_minimum, 5);
        assert_eq!(s.prune_protect, 40_000);
    }

    #[test]
    fn merge_keeps_unset_fields() {
        let mut a = SessionOverrides {
            threshold: Some(0.5),
            ..Default::default()
        };
        a.merge(&SessionOverrides {
            prune: Some(false),
            ..Default::default()
        });
        assert_eq!(a.threshold, Some(0.5));
        assert_eq!(a.prune, Some(false));
    }
}
