//! How a summary's stream ended, by its `finish_reason`: finished, cut at `max_tokens`,
//! stopped by the endpoint's content filter, or stopped by the endpoint for a reason of
//! its own (OpenRouter's `error`, vLLM's `abort`). Only the first two leave a summary.

use crate::summarize::SummarizeError;

/// A stream's `finish_reason`, classified.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Finish {
    /// The model finished (`stop`, and any reason not named below: endpoints name the end
    /// of a turn their own way, `eos`, `end_turn`, ...).
    Done,
    /// Cut at `max_tokens`, at an output cap of the endpoint's own, or where its window ran
    /// out (`too_long::ran_out` tells them apart).
    Length,
    /// The endpoint's content filter stopped it.
    Filtered,
    /// The endpoint stopped it on a failure: what was written is not a whole summary.
    Stopped(String),
}

impl Finish {
    /// Classifies one `finish_reason`.
    pub(super) fn of(reason: &str) -> Finish {
        match reason {
            "length" => Finish::Length,
            "content_filter" => Finish::Filtered,
            // One of these few words, so quoting it in an error is safe.
            "error" | "abort" | "aborted" | "cancelled" | "canceled" => {
                Finish::Stopped(reason.to_string())
            }
            _ => Finish::Done,
        }
    }
}

/// The failure of a stream the endpoint stopped with `reason`: broken once text arrived
/// (nothing is committed, nor asked for again), else a failed request worth a retry.
pub(super) fn stopped(reason: &str, started: bool) -> SummarizeError {
    let what = format!("the endpoint stopped the stream (finish_reason \"{reason}\")");
    if started {
        SummarizeError::Broken(what)
    } else {
        SummarizeError::Request {
            status: None,
            message: what,
            retryable: true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_finish_or_a_cut_leaves_a_summary() {
        assert_eq!(Finish::of("stop"), Finish::Done);
        assert_eq!(Finish::of("eos"), Finish::Done);
        assert_eq!(Finish::of("length"), Finish::Length);
        assert_eq!(Finish::of("content_filter"), Finish::Filtered);
        assert_eq!(Finish::of("error"), Finish::Stopped("error".into()));
        assert_eq!(Finish::of("abort"), Finish::Stopped("abort".into()));
        assert!(matches!(stopped("error", true), SummarizeError::Broken(_)));
        assert!(stopped("error", false).retryable());
    }
}
