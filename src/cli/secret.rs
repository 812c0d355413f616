//! Settings whose value must never be printed: their `Debug` hides it, so a `{:?}` of the
//! parsed command line (`Cli`, `ServeArgs`, `Layered`) cannot leak a key, a token or a
//! URL's credentials into a log.

use std::convert::Infallible;
use std::fmt;
use std::str::FromStr;

/// A secret setting (an API key, a bearer token): `Debug` shows `[redacted]`.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// The value, for the one place that uses it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[redacted]")
    }
}

impl FromStr for Secret {
    type Err = Infallible;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Secret(s.to_string()))
    }
}

/// A URL setting that may carry credentials (`user:password@`, a key in its query):
/// `Debug` shows it with them redacted.
#[derive(Clone, PartialEq, Eq)]
pub struct SecretUrl(String);

impl SecretUrl {
    /// The URL as given, for the one place that uses it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for SecretUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", crate::config::redact::url(&self.0))
    }
}

impl FromStr for SecretUrl {
    type Err = Infallible;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(SecretUrl(s.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_hides_the_value() {
        let key: Secret = "sk-VISIBLE".parse().unwrap_or_else(|e| match e {});
        assert_eq!(format!("{key:?}"), "[redacted]");
        assert_eq!(key.expose(), "sk-VISIBLE");
        let url: SecretUrl = "https://user:PASSWORD@host/v1"
            .parse()
            .unwrap_or_else(|e| match e {});
        let shown = format!("{url:?}");
        assert!(
            !shown.contains("PASSWORD") && shown.contains("host/v1"),
            "{shown}"
        );
    }
}
