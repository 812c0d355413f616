//! Prompt-cache price models: what the provider charges for a cached input token and for
//! writing a fresh one, relative to an uncached token, and how long a cached prefix lives.
//! The replay's cost figures and the engine's cache-aware scheduler read the same model.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// A provider's prompt-cache prices, in fresh-token units.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct CacheModel {
    /// Price of a token read from the cache.
    #[serde(with = "super::float")]
    pub read: f64,
    /// Price of a token not in the cache (full price plus any write premium).
    #[serde(with = "super::float")]
    pub write: f64,
    /// How long a cached prefix lives after its last use, in milliseconds.
    pub ttl_ms: i64,
}

impl CacheModel {
    /// Anthropic: reads 0.1×, writes 1.25×, 5-minute TTL.
    pub const ANTHROPIC: CacheModel = CacheModel {
        read: 0.1,
        write: 1.25,
        ttl_ms: 300_000,
    };
    /// OpenAI: cached input 0.1×, no write premium, ~5-minute TTL.
    pub const OPENAI: CacheModel = CacheModel {
        read: 0.1,
        write: 1.0,
        ttl_ms: 300_000,
    };
    /// No prompt cache: every token costs the same (decisions apply at once).
    pub const NONE: CacheModel = CacheModel {
        read: 1.0,
        write: 1.0,
        ttl_ms: 0,
    };

    /// The named models, for help texts and errors.
    pub const NAMES: &'static str = "anthropic, openai, none, custom:READ:WRITE:TTL_SECONDS";

    /// True when a cached token costs what a fresh one does: nothing to protect, every
    /// decision may apply at once.
    pub fn is_flat(&self) -> bool {
        self.read >= self.write
    }

    /// The model's name when it is a named one.
    pub fn name(&self) -> Option<&'static str> {
        [
            ("anthropic", CacheModel::ANTHROPIC),
            ("openai", CacheModel::OPENAI),
            ("none", CacheModel::NONE),
        ]
        .into_iter()
        .find_map(|(n, m)| (m == *self).then_some(n))
    }

    /// Why the prices cannot work, if they cannot.
    pub fn check(&self) -> Result<(), String> {
        let ok = |v: f64| v.is_finite() && (0.0..=100.0).contains(&v);
        if !ok(self.read) || !ok(self.write) {
            return Err(format!(
                "cache prices must be between 0 and 100 (read {}, write {})",
                self.read, self.write
            ));
        }
        if self.ttl_ms < 0 {
            return Err("the cache TTL cannot be negative".into());
        }
        Ok(())
    }
}

impl Default for CacheModel {
    fn default() -> Self {
        CacheModel::ANTHROPIC
    }
}

impl fmt::Display for CacheModel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(n) => f.write_str(n),
            None => write!(
                f,
                "custom:{}:{}:{}",
                self.read,
                self.write,
                self.ttl_ms / 1000
            ),
        }
    }
}

impl FromStr for CacheModel {
    type Err = String;

    /// `anthropic`, `openai`, `none`, or `custom:READ:WRITE:TTL_SECONDS`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        match s.to_ascii_lowercase().as_str() {
            "anthropic" => return Ok(CacheModel::ANTHROPIC),
            "openai" => return Ok(CacheModel::OPENAI),
            "none" => return Ok(CacheModel::NONE),
            _ => {}
        }
        // Errors show its beginning only: a client sends it.
        let shown = super::shown::clipped(s);
        let unknown = || {
            format!(
                "unknown cache model {shown:?} (known: {})",
                CacheModel::NAMES
            )
        };
        let rest = s.strip_prefix("custom:").ok_or_else(unknown)?;
        // At most one field past the three: a text of colons is not split whole.
        let fields: Vec<&str> = rest.splitn(4, ':').collect();
        let [read, write, ttl] = fields.as_slice() else {
            return Err(unknown());
        };
        let num = |v: &str, what: &str| {
            v.trim().parse::<f64>().map_err(|_| {
                let v = super::shown::clipped(v);
                format!("cache model {shown:?}: {what} {v:?} is not a number")
            })
        };
        let ttl_s = num(ttl, "TTL")?;
        if !(0.0..=86_400.0).contains(&ttl_s) {
            return Err(format!(
                "cache model {shown:?}: TTL must be 0 to 86400 seconds"
            ));
        }
        let model = CacheModel {
            read: num(read, "read price")?,
            write: num(write, "write price")?,
            ttl_ms: (ttl_s * 1000.0) as i64,
        };
        model
            .check()
            .map_err(|e| format!("cache model {shown:?}: {e}"))?;
        Ok(model)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn named_and_custom_models_parse_and_print_back() {
        assert_eq!("anthropic".parse(), Ok(CacheModel::ANTHROPIC));
        assert_eq!("OpenAI".parse(), Ok(CacheModel::OPENAI));
        assert_eq!("none".parse(), Ok(CacheModel::NONE));
        let c: CacheModel = "custom:0.25:1.5:60".parse().expect("valid");
        assert_eq!(
            c,
            CacheModel {
                read: 0.25,
                write: 1.5,
                ttl_ms: 60_000
            }
        );
        assert_eq!(c.to_string(), "custom:0.25:1.5:60");
        assert_eq!(CacheModel::ANTHROPIC.to_string(), "anthropic");
    }

    #[test]
    fn bad_models_are_named_in_the_error() {
        for bad in [
            "gemini",
            "custom:1:2",
            "custom:x:1:1",
            "custom:-1:1:1",
            "custom:0.1:1:-5",
        ] {
            let err = bad.parse::<CacheModel>().expect_err(bad);
            assert!(err.contains(bad), "{err}");
        }
        assert!(CacheModel::NONE.is_flat());
        assert!(!CacheModel::ANTHROPIC.is_flat());
    }
}
