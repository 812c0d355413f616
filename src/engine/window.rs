//! The model's window as OpenCode reads it from the limits: output reserved, input usable.
//! A leaf of the engine: the overflow check, the output cap and compaction all size
//! themselves from it.

use crate::config::OUTPUT_TOKEN_MAX;
use crate::domain::ModelLimits;

/// Max output tokens as OpenCode's `maxOutputTokens`: min(limit.output, 32000), or 32000.
pub fn max_output(limits: &ModelLimits) -> u64 {
    match limits.output {
        0 => OUTPUT_TOKEN_MAX,
        n => n.min(OUTPUT_TOKEN_MAX),
    }
}

/// Usable input: `limit.input`, else `context − max_output`.
pub fn usable_input(limits: &ModelLimits) -> u64 {
    if limits.input > 0 {
        limits.input
    } else {
        limits.context.saturating_sub(max_output(limits))
    }
}
