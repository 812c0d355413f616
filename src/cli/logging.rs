//! The process's log output. Client-supplied strings (session ids, tool names, error texts)
//! reach log fields, so in the human format every field value and message is written with
//! control characters escaped: a newline or an ANSI sequence in an id cannot forge a log
//! line or recolour a terminal. The JSON format escapes by construction. Colour codes are
//! only written to a terminal. Crates that log bodies are silenced (`QUIET_TARGETS`).

use std::fmt;
use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;
use tracing_subscriber::field::MakeExt;
use tracing_subscriber::fmt::format::Writer;

use super::LogFormat;

/// Third-party targets that log request or response bodies (an error body may echo the
/// request's headers, the API key among them): silenced unless `COMPACTD_LOG` names them.
/// compactd reports their failures itself, redacted.
const QUIET_TARGETS: [&str; 1] = ["async_openai"];

/// Third-party targets raised to `debug` unless `COMPACTD_LOG` names them: tonic's server
/// logs a connection it drops (an HTTP/2 protocol error or flood protection, a TLS
/// handshake failure) only at debug, and a dropped connection must never be silent.
const LOUD_TARGETS: [&str; 1] = ["tonic::transport::server"];

/// Installs the global subscriber: `COMPACTD_LOG` filter (default `info`), stderr, in
/// `format`.
pub fn init(format: LogFormat) {
    init_with(format, "info");
}

/// [`init`] with another default filter (`replay` says only what went wrong: `warn`).
pub fn init_with(format: LogFormat, default: &str) {
    // Empty (a template that left the value blank) is unset: a filter of no directives
    // would turn every line off without a word.
    let spec = std::env::var("COMPACTD_LOG")
        .ok()
        .filter(|s| !s.split(',').all(|directive| directive.trim().is_empty()))
        .unwrap_or_else(|| default.into());
    let (mut filter, refused) = match EnvFilter::try_new(&spec) {
        Ok(f) => (f, None),
        Err(e) => (EnvFilter::new("info"), Some(e)),
    };
    let levels = QUIET_TARGETS
        .iter()
        .map(|t| (t, "off"))
        .chain(LOUD_TARGETS.iter().map(|t| (t, "debug")));
    for (target, level) in levels {
        if !spec.contains(target)
            && let Ok(directive) = format!("{target}={level}").parse()
        {
            filter = filter.add_directive(directive);
        }
    }
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    match format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Pretty => builder
            .fmt_fields(tracing_subscriber::fmt::format::debug_fn(write_field).delimited(" "))
            .init(),
    }
    // Said once the subscriber is up: a mistyped filter must not pass unnoticed.
    if let Some(e) = refused {
        tracing::warn!(COMPACTD_LOG = %spec, error = %e, "COMPACTD_LOG is not a valid filter; logging at info");
    }
}

/// One field as `name=value` (the message bare), its value's control characters escaped.
fn write_field(
    w: &mut Writer<'_>,
    field: &tracing::field::Field,
    value: &dyn fmt::Debug,
) -> fmt::Result {
    let text = format!("{value:?}");
    if field.name() != "message" {
        write!(w, "{}=", field.name())?;
    }
    write_escaped(w, &text)
}

/// Writes `text` with every control character (newlines, carriage returns, escape, ...)
/// as a `\u{..}` escape, the rest as is.
fn write_escaped(w: &mut impl fmt::Write, text: &str) -> fmt::Result {
    for c in text.chars() {
        if c.is_control() {
            write!(w, "\\u{{{:x}}}", u32::from(c))?;
        } else {
            w.write_char(c)?;
        }
    }
    Ok(())
}

/// `text` as the human log writes it.
pub fn escaped(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let _ = write_escaped(&mut out, text);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_are_escaped_and_the_rest_kept() {
        assert_eq!(
            escaped("evil\n2026-01-01T00:00:00Z  INFO forged\u{1b}[31mred\r"),
            "evil\\u{a}2026-01-01T00:00:00Z  INFO forged\\u{1b}[31mred\\u{d}"
        );
        assert_eq!(escaped("ses_ok-ünïcode 世界"), "ses_ok-ünïcode 世界");
    }
}
