//! The one home of every range and format rule on settings, for the server config (flags,
//! environment, file) and for the per-session overrides a client sends alike. Callers map
//! [`InvalidSetting::key`] to their own spelling (a flag, a proto field path).

use thiserror::Error;

use super::{CacheModel, EngineConfig, SessionOverrides};

/// Longest placeholder text (server or session).
pub const MAX_PLACEHOLDER: usize = 1 << 10;
/// Longest auto-continue text (server or session).
pub const MAX_AUTO_CONTINUE: usize = 4 << 10;
/// Longest compaction prompt or template a session may set.
pub const MAX_PROMPT: usize = 64 << 10;
/// Most user turns prune can be told to protect.
pub const MAX_PROTECT_TURNS: u32 = 1000;
/// Longest protected-file glob: bounds the nesting the glob parser recurses through
/// (a 200 KB pattern of nested braces overflowed a worker's stack).
pub const MAX_GLOB: usize = 1 << 10;
/// Most protected-file globs a list may hold.
pub const MAX_GLOBS: usize = 256;
/// Longest model or provider name accepted (a session's model, a compaction model):
/// names are keys of process-wide tables (calibration priors, learned windows), so a
/// client cannot make one entry hold megabytes.
pub const MAX_MODEL_NAME: usize = 256;

/// Most names a tool list may hold (`protected_tools`, `strategy_protected_tools`,
/// `snapshot_tools`): every tool part is looked up in them, on prune's scan too.
pub const MAX_TOOL_NAMES: usize = 256;
/// Longest name in a tool list.
pub const MAX_TOOL_NAME: usize = 256;

/// A setting out of range, named by its key (`threshold`, `protected_file_globs`, ...).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{key}: {message}")]
pub struct InvalidSetting {
    /// The setting's key, as in the config file and `SessionConfig`.
    pub key: &'static str,
    /// What is wrong with it.
    pub message: String,
}

fn invalid(key: &'static str, message: impl Into<String>) -> InvalidSetting {
    InvalidSetting {
        key,
        message: message.into(),
    }
}

fn threshold(t: f64) -> Result<(), InvalidSetting> {
    if t > 0.0 && t <= 1.0 {
        Ok(())
    } else {
        Err(invalid("threshold", format!("{t} is not in (0, 1]")))
    }
}

fn protect_turns(t: u32) -> Result<(), InvalidSetting> {
    if t > MAX_PROTECT_TURNS {
        return Err(invalid(
            "protect_turns",
            format!("{t} is over {MAX_PROTECT_TURNS}"),
        ));
    }
    Ok(())
}

/// Most tool results `maskObservations` can be told to keep.
pub const MAX_MASK_KEEP: u32 = 100_000;

fn mask_keep(n: u32) -> Result<(), InvalidSetting> {
    if n > MAX_MASK_KEEP {
        return Err(invalid("mask_keep", format!("{n} is over {MAX_MASK_KEEP}")));
    }
    Ok(())
}

fn output_cap(share: f64) -> Result<(), InvalidSetting> {
    if share > 0.0 && share <= 1.0 {
        Ok(())
    } else {
        Err(invalid("output_cap", format!("{share} is not in (0, 1]")))
    }
}

fn cache_model(m: &CacheModel) -> Result<(), InvalidSetting> {
    m.check().map_err(|e| invalid("cache_model", e))
}

/// A text that is rendered into the context: not blank, at most `max` bytes.
fn text(key: &'static str, v: &str, max: usize) -> Result<(), InvalidSetting> {
    if v.trim().is_empty() {
        return Err(invalid(key, "must not be empty"));
    }
    prompt(key, v, max)
}

/// A list of tool names: at most [`MAX_TOOL_NAMES`] of [`MAX_TOOL_NAME`] bytes each.
fn tool_names(key: &'static str, names: &[String]) -> Result<(), InvalidSetting> {
    if names.len() > MAX_TOOL_NAMES {
        return Err(invalid(
            key,
            format!("{} names; at most {MAX_TOOL_NAMES}", names.len()),
        ));
    }
    if let Some((i, name)) = names
        .iter()
        .enumerate()
        .find(|(_, n)| n.len() > MAX_TOOL_NAME)
    {
        return Err(invalid(
            key,
            format!(
                "name {i} is {} bytes long; at most {MAX_TOOL_NAME}",
                name.len()
            ),
        ));
    }
    Ok(())
}

/// A text that may be anything up to `max` bytes.
fn prompt(key: &'static str, v: &str, max: usize) -> Result<(), InvalidSetting> {
    if v.len() > max {
        return Err(invalid(key, format!("{} bytes; at most {max}", v.len())));
    }
    Ok(())
}

/// A compaction prompt, system prompt, template or instructions: at most [`MAX_PROMPT`]
/// bytes. Public: a compaction request's own are held to a session's rule.
pub fn compaction_text(key: &'static str, v: &str) -> Result<(), InvalidSetting> {
    prompt(key, v, MAX_PROMPT)
}

/// Whether a compaction prompt, system prompt or template is given: one of only white
/// space is not, and the setting is inherited (the session's, then the server's). The one
/// rule for both places they are sent, a session's config and a compaction request.
pub fn compaction_text_given(v: &str) -> bool {
    !v.trim().is_empty()
}

/// A model or provider name: at most [`MAX_MODEL_NAME`] bytes. Public: the session's
/// model and a compaction request's model are held to the same rule.
pub fn model_name(key: &'static str, v: &str) -> Result<(), InvalidSetting> {
    if v.len() > MAX_MODEL_NAME {
        return Err(invalid(
            key,
            format!(
                "{} bytes long; model names are at most {MAX_MODEL_NAME} bytes",
                v.len()
            ),
        ));
    }
    Ok(())
}

/// The globs one protected-file pattern compiles to: itself, and, without a leading `/`,
/// `**/` before it (any depth, as a .gitignore line).
fn glob_forms(p: &str) -> Vec<String> {
    let mut forms = vec![p.to_string()];
    if !p.starts_with('/') && !p.starts_with("**/") {
        forms.push(format!("**/{p}"));
    }
    forms
}

/// The matcher of a protected-file glob list, and the one place the list is checked: at
/// most [`MAX_GLOBS`] patterns of [`MAX_GLOB`] bytes, compiled into one set (a list whose
/// set cannot be built is refused, not left to protect nothing). A pattern without a
/// leading `/` matches at any depth, as a .gitignore line does: hosts' file tools send
/// absolute paths (`Cargo.toml` matches `/home/u/proj/Cargo.toml`).
pub fn protected_globs(patterns: &[String]) -> Result<globset::GlobSet, InvalidSetting> {
    const KEY: &str = "protected_file_globs";
    if patterns.len() > MAX_GLOBS {
        return Err(invalid(
            KEY,
            format!("{} patterns; at most {MAX_GLOBS}", patterns.len()),
        ));
    }
    let mut set = globset::GlobSetBuilder::new();
    for (i, p) in patterns.iter().enumerate() {
        if p.len() > MAX_GLOB {
            return Err(invalid(
                KEY,
                format!("pattern {i} is {} bytes long; at most {MAX_GLOB}", p.len()),
            ));
        }
        for form in glob_forms(p) {
            let glob = globset::Glob::new(&form)
                .map_err(|e| invalid(KEY, format!("{p:?} is not a valid glob: {e}")))?;
            set.add(glob);
        }
    }
    set.build()
        .map_err(|e| invalid(KEY, format!("the patterns cannot be matched: {e}")))
}

/// The matcher of a list that may predate [`protected_globs`]'s bounds (a session stored
/// by an older version): the list itself when it passes, else every pattern that
/// compiles alone, by the same any-depth rule. A pattern over 16 × [`MAX_GLOB`] bytes is
/// skipped: compiling it recurses once per nesting level.
pub fn protected_globs_lenient(patterns: &[String]) -> globset::GlobSet {
    if let Ok(set) = protected_globs(patterns) {
        return set;
    }
    let mut set = globset::GlobSetBuilder::new();
    for p in patterns.iter().filter(|p| p.len() <= 16 * MAX_GLOB) {
        for form in glob_forms(p) {
            let Ok(glob) = globset::Glob::new(&form) else {
                continue;
            };
            if globset::GlobSetBuilder::new()
                .add(glob.clone())
                .build()
                .is_ok()
            {
                set.add(glob);
            }
        }
    }
    set.build().unwrap_or_else(|_| globset::GlobSet::empty())
}

impl EngineConfig {
    /// Checks every setting; the first one out of range is named.
    pub fn validate(&self) -> Result<(), InvalidSetting> {
        threshold(self.threshold)?;
        protect_turns(self.protect_turns)?;
        text("placeholder", &self.placeholder, MAX_PLACEHOLDER)?;
        text("auto_continue", &self.auto_continue, MAX_AUTO_CONTINUE)?;
        mask_keep(self.mask_keep)?;
        output_cap(self.output_cap)?;
        cache_model(&self.cache_model)?;
        tool_names("protected_tools", &self.protected_tools)?;
        tool_names("strategy_protected_tools", &self.strategy_protected_tools)?;
        tool_names("snapshot_tools", &self.snapshot_tools)?;
        protected_globs(&self.protected_file_globs).map(drop)
    }
}

impl SessionOverrides {
    /// Checks every override that is set; the first one out of range is named.
    pub fn validate(&self) -> Result<(), InvalidSetting> {
        if let Some(t) = self.threshold {
            threshold(t)?;
        }
        if let Some(t) = self.protect_turns {
            protect_turns(t)?;
        }
        if let Some(v) = &self.placeholder {
            text("placeholder", v, MAX_PLACEHOLDER)?;
        }
        if let Some(v) = &self.auto_continue {
            text("auto_continue", v, MAX_AUTO_CONTINUE)?;
        }
        for (key, v) in [
            ("compaction_system", &self.compaction_system),
            ("compaction_prompt", &self.compaction_prompt),
            ("compaction_template", &self.compaction_template),
        ] {
            if let Some(v) = v {
                prompt(key, v, MAX_PROMPT)?;
            }
        }
        if let Some(m) = &self.compaction_model {
            model_name("compaction_model", m)?;
        }
        if let Some(g) = &self.protected_file_globs {
            protected_globs(g)?;
        }
        if let Some(n) = self.mask_keep {
            mask_keep(n)?;
        }
        if let Some(v) = self.output_cap {
            output_cap(v)?;
        }
        if let Some(m) = &self.cache_model {
            cache_model(m)?;
        }
        for (key, list) in [
            ("protected_tools", &self.protected_tools),
            ("strategy_protected_tools", &self.strategy_protected_tools),
            ("snapshot_tools", &self.snapshot_tools),
        ] {
            if let Some(list) = list {
                tool_names(key, list)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_defaults_are_valid() {
        assert_eq!(EngineConfig::default().validate(), Ok(()));
        assert_eq!(SessionOverrides::default().validate(), Ok(()));
    }

    #[test]
    fn each_rule_names_its_key() {
        let bad = [
            SessionOverrides {
                threshold: Some(0.0),
                ..Default::default()
            },
            SessionOverrides {
                threshold: Some(f64::NAN),
                ..Default::default()
            },
            SessionOverrides {
                protect_turns: Some(1001),
                ..Default::default()
            },
            SessionOverrides {
                placeholder: Some("  ".into()),
                ..Default::default()
            },
            SessionOverrides {
                auto_continue: Some("x".repeat(MAX_AUTO_CONTINUE + 1)),
                ..Default::default()
            },
            SessionOverrides {
                compaction_prompt: Some("x".repeat(MAX_PROMPT + 1)),
                ..Default::default()
            },
            SessionOverrides {
                compaction_model: Some("m".repeat(MAX_MODEL_NAME + 1)),
                ..Default::default()
            },
            SessionOverrides {
                protected_file_globs: Some(vec!["src/[".into()]),
                ..Default::default()
            },
            SessionOverrides {
                mask_keep: Some(MAX_MASK_KEEP + 1),
                ..Default::default()
            },
            SessionOverrides {
                output_cap: Some(0.0),
                ..Default::default()
            },
            SessionOverrides {
                cache_model: Some(CacheModel {
                    read: f64::NAN,
                    write: 1.0,
                    ttl_ms: 0,
                }),
                ..Default::default()
            },
            SessionOverrides {
                protected_tools: Some(vec!["x".into(); MAX_TOOL_NAMES + 1]),
                ..Default::default()
            },
            SessionOverrides {
                strategy_protected_tools: Some(vec!["t".repeat(MAX_TOOL_NAME + 1)]),
                ..Default::default()
            },
            SessionOverrides {
                snapshot_tools: Some(vec!["x".into(); 1_000_000]),
                ..Default::default()
            },
        ];
        let keys: Vec<&str> = bad
            .iter()
            .map(|o| o.validate().expect_err("invalid").key)
            .collect();
        assert_eq!(
            keys,
            [
                "threshold",
                "threshold",
                "protect_turns",
                "placeholder",
                "auto_continue",
                "compaction_prompt",
                "compaction_model",
                "protected_file_globs",
                "mask_keep",
                "output_cap",
                "cache_model",
                "protected_tools",
                "strategy_protected_tools",
                "snapshot_tools"
            ]
        );
    }

    #[test]
    fn server_config_follows_the_same_rules() {
        let c = EngineConfig {
            threshold: 1.5,
            ..EngineConfig::default()
        };
        assert_eq!(c.validate().expect_err("invalid").key, "threshold");
        let c = EngineConfig {
            placeholder: String::new(),
            ..EngineConfig::default()
        };
        assert_eq!(c.validate().expect_err("invalid").key, "placeholder");
        let c = EngineConfig {
            protected_tools: vec!["x".into(); MAX_TOOL_NAMES + 1],
            ..EngineConfig::default()
        };
        assert_eq!(c.validate().expect_err("invalid").key, "protected_tools");
    }
}
