//! The model's window as OpenCode reads it from the limits: output reserved, input usable.
//! A leaf of the engine: the overflow check, the output cap and compaction all size
//! themselves from it. The arithmetic is `ModelLimits`' own (the domain refuses limits
//! that leave no input with it); these are the engine's names for it.

use crate::domain::ModelLimits;

/// Max output tokens as OpenCode's `maxOutputTokens`: min(limit.output, 32000), or 32000.
pub fn max_output(limits: &ModelLimits) -> u64 {
    limits.max_output()
}

/// Usable input: `limit.input`, else `context − max_output`.
pub fn usable_input(limits: &ModelLimits) -> u64 {
    limits.usable_input()
}
