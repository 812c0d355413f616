//! Which tokenizer counts a session: the setting a host picks (`tokenizer`) and what it
//! resolves to for the session's model.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use super::bpe::{CL100K, O200K};
use super::{CharsPerToken, TokenCounter};

/// The `tokenizer` setting: a named tokenizer, or `auto` to pick one by model family.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Tokenizer {
    /// By model family: `cl100k` for GPT-3.5 and GPT-4 (not 4o or 4.1), `o200k` for
    /// everything else, which is exact for current OpenAI models and, calibrated from
    /// usage reports, the closest public proxy for models without a public tokenizer.
    #[default]
    Auto,
    /// OpenAI's o200k_base (GPT-4o, GPT-4.1, GPT-5, o-series).
    O200k,
    /// OpenAI's cl100k_base (GPT-3.5, GPT-4).
    Cl100k,
    /// OpenCode's heuristic: JavaScript string length ÷ 4. The OpenCode preset uses it so
    /// prune decides on exactly OpenCode's numbers.
    Chars4,
}

/// What a session counts with once `auto` is resolved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Counting {
    /// o200k_base.
    O200k,
    /// cl100k_base.
    Cl100k,
    /// Characters ÷ 4.
    Chars4,
}

impl Tokenizer {
    /// Every choice, in the order help text lists them.
    pub const ALL: [Tokenizer; 4] = [
        Tokenizer::Auto,
        Tokenizer::O200k,
        Tokenizer::Cl100k,
        Tokenizer::Chars4,
    ];

    /// The setting's name.
    pub fn as_str(self) -> &'static str {
        match self {
            Tokenizer::Auto => "auto",
            Tokenizer::O200k => "o200k",
            Tokenizer::Cl100k => "cl100k",
            Tokenizer::Chars4 => "chars4",
        }
    }

    /// What this setting counts with for `model` (the model id, e.g. `gpt-4o-mini` or
    /// `openai/gpt-4`; empty when the host has not named one).
    pub fn resolve(self, model: &str) -> Counting {
        match self {
            Tokenizer::O200k => Counting::O200k,
            Tokenizer::Cl100k => Counting::Cl100k,
            Tokenizer::Chars4 => Counting::Chars4,
            Tokenizer::Auto => by_family(model),
        }
    }
}

/// `cl100k` for the GPT-3.5 / GPT-4 family (and the embedding models of that era),
/// `o200k` for everything else.
fn by_family(model: &str) -> Counting {
    let name = model
        .rsplit('/')
        .next()
        .unwrap_or(model)
        .to_ascii_lowercase();
    let gpt4_classic = name.starts_with("gpt-4")
        && !["gpt-4o", "gpt-4.1", "gpt-4.5"]
            .iter()
            .any(|newer| name.starts_with(newer));
    if gpt4_classic
        || name.starts_with("gpt-3.5")
        || name.starts_with("gpt-35")
        || name.starts_with("text-embedding-3")
        || name.starts_with("text-embedding-ada")
    {
        Counting::Cl100k
    } else {
        Counting::O200k
    }
}

impl Counting {
    /// Every resolved tokenizer (replay reports each).
    pub const ALL: [Counting; 3] = [Counting::Chars4, Counting::O200k, Counting::Cl100k];

    /// True when every count is cheap enough for an async worker (chars ÷ 4): nothing
    /// needs counting ahead on a blocking thread.
    pub fn is_cheap(self) -> bool {
        matches!(self, Counting::Chars4)
    }

    /// The counter behind it: shared, process-wide instances.
    pub fn counter(self) -> &'static dyn TokenCounter {
        static CHARS4: CharsPerToken = CharsPerToken;
        match self {
            Counting::O200k => &O200K,
            Counting::Cl100k => &CL100K,
            Counting::Chars4 => &CHARS4,
        }
    }

    /// Its name in reports and settings.
    pub fn as_str(self) -> &'static str {
        match self {
            Counting::O200k => "o200k",
            Counting::Cl100k => "cl100k",
            Counting::Chars4 => "chars4",
        }
    }
}

impl fmt::Display for Tokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A tokenizer name that is not one of [`Tokenizer::ALL`]. Its message leaves the name
/// out (a client may send megabytes of it): a flag's error shows it, the wire its
/// beginning.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown tokenizer (expected auto, o200k, cl100k or chars4)")]
pub struct UnknownTokenizer(pub String);

impl FromStr for Tokenizer {
    type Err = UnknownTokenizer;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Tokenizer::ALL
            .into_iter()
            .find(|t| t.as_str().eq_ignore_ascii_case(s.trim()))
            .ok_or_else(|| UnknownTokenizer(s.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_picks_by_model_family() {
        let auto = Tokenizer::Auto;
        for m in ["gpt-4", "gpt-4-turbo", "openai/gpt-4-0613", "gpt-3.5-turbo"] {
            assert_eq!(auto.resolve(m), Counting::Cl100k, "{m}");
        }
        for m in [
            "gpt-4o",
            "gpt-4.1-mini",
            "openai/gpt-5.3-codex",
            "o3",
            "claude-sonnet-4-5",
            "",
        ] {
            assert_eq!(auto.resolve(m), Counting::O200k, "{m}");
        }
        assert_eq!(Tokenizer::Chars4.resolve("gpt-4o"), Counting::Chars4);
    }

    #[test]
    fn names_parse_back() {
        for t in Tokenizer::ALL {
            assert_eq!(t.as_str().parse::<Tokenizer>(), Ok(t));
        }
        // The name is left out of the message (a flag's error shows it, the wire its
        // beginning): a client may send megabytes of it.
        let e = "bpe".parse::<Tokenizer>().unwrap_err();
        assert!(e.to_string().starts_with("unknown tokenizer"), "{e}");
        assert!(!e.to_string().contains("bpe"), "{e}");
    }
}
