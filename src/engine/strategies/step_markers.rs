//! Strategy 2, `pruneStepMarkers`: `step-start` and `step-finish` parts are structure,
//! not content; with the strategy on they never reach the context. A rendering rule, so
//! nothing is marked. (The OpenAI rendering finds step boundaries without them.)

use crate::domain::PartKind;

/// True for the parts the strategy drops from the context.
pub fn is_step_marker(kind: &PartKind) -> bool {
    matches!(kind, PartKind::StepStart { .. } | PartKind::StepFinish(_))
}
