//! OpenCode export files: import into a [`Session`] and replay through the engine.
//!
//! Import is a load, not live traffic: every message and part is applied in document
//! order with [`Session::apply`], so the incremental state (prune window, usage, boundary)
//! is rebuilt exactly as if the updates had streamed in, but no automatic prune runs and
//! no events are produced. Replay ([`replay`]) is the opposite: it feeds the same messages
//! through [`crate::engine::step`] one by one, as a live host would, and reports what
//! compactd would have done.

mod bounded_value;
pub mod chart;
pub mod cost;
mod import;
pub mod lanes;
pub mod prediction;
pub mod references;
pub mod replay;

pub use import::{
    Export, ImportError, LimitedError, from_value, from_value_limited, parse_export,
    parse_export_limited,
};

use crate::config::{EngineConfig, SessionOverrides};
use crate::domain::{ModelLimits, PartKind};
use crate::engine::{ApplyError, ByteLimit, Session, Update};

/// Builds a session from a parsed export. `limits` and `overrides` come from the caller:
/// exports carry neither.
pub fn load(
    export: Export,
    limits: ModelLimits,
    overrides: SessionOverrides,
    config: &EngineConfig,
) -> Result<Session, ApplyError> {
    load_within(export, limits, overrides, config, ByteLimit::NONE)
}

/// [`load`], refusing at the first update that takes the session past `byte_limit`
/// (an import is never built past the limit it will be held to).
pub fn load_within(
    export: Export,
    limits: ModelLimits,
    overrides: SessionOverrides,
    config: &EngineConfig,
    byte_limit: ByteLimit,
) -> Result<Session, ApplyError> {
    let mut info = export.info;
    info.limits = limits;
    info.config = overrides;
    let mut session = Session::new(info, config);
    session.set_byte_limit(byte_limit);
    for (i, (minfo, parts)) in export.messages.into_iter().enumerate() {
        session
            .apply(Update::UpsertMessage(minfo), config)
            .map_err(|e| at(e, &format!("messages[{i}].info"), false))?;
        for (j, p) in parts.into_iter().enumerate() {
            session
                .apply(Update::UpsertPart(p), config)
                .map_err(|e| at(e, &format!("messages[{i}].parts[{j}]"), true))?;
        }
    }
    Ok(session)
}

/// A refusal of the update built from the document at `path`, naming its field there as
/// the document spells it (the whole message or part when the refusal names none: a
/// limit).
fn at(mut e: ApplyError, path: &str, part: bool) -> ApplyError {
    let field = import::json_field(&e.field, part);
    e.field = if field.is_empty() {
        path.to_string()
    } else {
        format!("{path}.{field}")
    };
    e
}

/// Removes every `time.compacted` mark, so a session pruned by OpenCode can be pruned
/// again by compactd and the two decisions compared.
pub fn strip_compacted(export: &mut Export) -> usize {
    let mut n = 0;
    for (_, parts) in &mut export.messages {
        for p in parts {
            if let PartKind::Tool(t) = &mut p.kind {
                n += usize::from(t.state.time.compacted.take().is_some());
            }
        }
    }
    n
}

#[cfg(test)]
mod load_tests;
