//! The most answer tokens an endpoint accepts asking for. compactd sizes `max_tokens` from
//! the window (a quarter of it), but a hosted model's output is capped apart from its
//! window (gpt-4o-mini: 128k window, 16,384 output tokens; DeepSeek, Anthropic's
//! compatible API: 8k-64k), and some models refuse the `max_tokens` field outright
//! (OpenAI's o-series and gpt-5 take `max_completion_tokens`). Such a refusal is read
//! here; [`super::window::Windows`] keeps what it taught per endpoint and model, and the
//! request is sent again at once with `max_tokens` within the cap, or without it.
//!
//! No I/O: the parser reads the endpoint's message.

/// Smallest figure read as a cap: smaller numbers in a refusal are versions and model
/// names ("gpt-5", "claude-3-5"), and no model caps its answer that low.
pub const MIN_CAP: u64 = 256;

/// What a refusal of `max_tokens` taught.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutputCap {
    /// Ask for at most this many answer tokens.
    At(u64),
    /// Send no `max_tokens`: the endpoint does not take the field (or named no figure).
    Omit,
}

impl OutputCap {
    /// `max_tokens` for a request sized at `wanted` under this cap (None: omit the field).
    pub fn apply(self, wanted: u64) -> Option<u64> {
        match self {
            OutputCap::At(cap) => Some(wanted.min(cap)),
            OutputCap::Omit => None,
        }
    }
}

/// Reads a refusal (`message`, the endpoint's words) of a request that asked for `sent`
/// answer tokens: the cap it names (the largest figure in it below `sent`, at least
/// [`MIN_CAP`]), [`OutputCap::Omit`]
/// when it names the field but no such figure, None when it is about something else.
/// Refusals for length (the prompt too long for the window, even one naming the field
/// beside it, as Anthropic's "input length and `max_tokens` exceed context limit") are
/// read before this (`llm/errors.rs` makes them "too long"), and never reach it.
pub fn refusal(message: &str, sent: u64) -> Option<OutputCap> {
    let lower = message.to_ascii_lowercase();
    let names_field = [
        "max_tokens",
        "max_completion_tokens",
        "output tokens",
        "completion tokens",
    ]
    .iter()
    .any(|n| lower.contains(n));
    if !names_field {
        return None;
    }
    let figure = numbers(&lower)
        .filter(|n| (MIN_CAP..sent).contains(n))
        .max();
    Some(figure.map_or(OutputCap::Omit, OutputCap::At))
}

/// The numbers written in `text` (runs of at most 12 digits).
fn numbers(text: &str) -> impl Iterator<Item = u64> + '_ {
    text.split(|c: char| !c.is_ascii_digit())
        .filter(|run| !run.is_empty() && run.len() <= 12)
        .filter_map(|run| run.parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wordings_of_hosted_endpoints_are_read() {
        // OpenAI.
        let openai = "max_tokens is too large: 32000. This model supports at most 16384 completion tokens, whereas you provided 32000.";
        assert_eq!(refusal(openai, 32_000), Some(OutputCap::At(16_384)));
        let gpt5 = "Unsupported parameter: 'max_tokens' is not supported with gpt-5.";
        assert_eq!(refusal(gpt5, 32_000), Some(OutputCap::Omit));
        // OpenAI's reasoning models take another field.
        let o_series = "Unsupported parameter: 'max_tokens' is not supported with this model. Use 'max_completion_tokens' instead.";
        assert_eq!(refusal(o_series, 32_000), Some(OutputCap::Omit));
        // DeepSeek.
        let deepseek = "Invalid max_tokens value, the valid range of max_tokens is [1, 8192]";
        assert_eq!(refusal(deepseek, 32_000), Some(OutputCap::At(8_192)));
        // Anthropic's OpenAI-compatible API.
        let anthropic = "max_tokens: 32000 > 8192, which is the maximum allowed number of output tokens for claude-3-5-haiku-20241022";
        assert_eq!(refusal(anthropic, 32_000), Some(OutputCap::At(8_192)));
    }

    #[test]
    fn other_refusals_and_figures_past_the_request_teach_nothing() {
        assert_eq!(
            refusal("messages: the first message must be a user message", 4_096),
            None
        );
        assert_eq!(refusal("Invalid model 'gpt-9'", 4_096), None);
        // A figure no smaller than what was asked cannot be the cap: no figure, omit.
        assert_eq!(
            refusal("max_tokens must be at most 4096", 4_096),
            Some(OutputCap::Omit)
        );
        assert_eq!(
            refusal("max_tokens 99999999999999999999", 10),
            Some(OutputCap::Omit)
        );
    }

    #[test]
    fn a_cap_bounds_what_is_asked_for() {
        assert_eq!(OutputCap::At(8_192).apply(32_000), Some(8_192));
        assert_eq!(OutputCap::At(8_192).apply(1_000), Some(1_000));
        assert_eq!(OutputCap::Omit.apply(1_000), None);
    }
}
