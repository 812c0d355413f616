//! The token arithmetic of one compaction request against a known window: how many counted
//! tokens of transcript fit after the answer, the running summary and the prompt, and the
//! `max_tokens` to ask for so prompt plus answer fit. Pure; unit-tested below.
//!
//! compactd counts with a real BPE tokenizer (o200k for most models); the endpoint counts
//! with its own, and wraps each message in its chat template. A [`Budget`] turns one into the
//! other: counted tokens × the learned ratio × [`COUNT_MARGIN_PERCENT`], plus the
//! template's tokens. Integer arithmetic (thousandths), saturating.

use super::window::Window;

/// Tokens a chat template adds around each message: ChatML's
/// `<|im_start|>role\n…<|im_end|>\n` is 5, OpenAI documents 3 to 4, Llama 3's header 5;
/// 8 covers them with room to spare.
pub const TEMPLATE_TOKENS_PER_MESSAGE: u64 = 8;
/// Tokens a template adds once per request: the header that primes the answer, a BOS token,
/// a default system line some templates insert.
pub const TEMPLATE_TOKENS_PER_REQUEST: u64 = 16;
/// Messages in every compaction request (system, transcript, instruction: `prompt.rs`).
pub const MESSAGES_PER_REQUEST: u64 = 3;
/// Counted tokens are scaled by this (in percent) on top of the learned ratio: texts
/// tokenize unevenly (logs, JSON and code denser than prose), so a ratio learned on one
/// chunk is off by some percent on the next, and a request that does not fit costs a whole
/// round trip.
pub const COUNT_MARGIN_PERCENT: u64 = 110;
/// Smallest transcript chunk worth a request, in counted tokens (about 1,000 characters).
pub const MIN_CHUNK_TOKENS: u64 = 250;

/// One window's arithmetic.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Budget {
    window: u64,
    /// Endpoint tokens per 1,000 counted tokens, the margin included.
    per_mille: u64,
}

impl Budget {
    /// The budget of `window` (its tokens, and the ratio learned for its endpoint).
    pub fn new(window: Window) -> Budget {
        // The ratio is bounded (`window::RATIO_BOUNDS`); the cast saturates anyway.
        let ratio = (window.ratio.max(1.0) * 1000.0).round() as u64;
        Budget {
            window: window.tokens,
            per_mille: ratio.saturating_mul(COUNT_MARGIN_PERCENT) / 100,
        }
    }

    /// The answer's share of the window (`max_tokens`): a quarter, as small local models
    /// otherwise write until their context is full.
    pub fn answer(&self) -> u64 {
        self.window / 4
    }

    /// The endpoint's tokens for a request whose messages compactd counts at `counted`.
    pub fn endpoint_tokens(&self, counted: u64) -> u64 {
        self.scale(counted)
            .saturating_add(TEMPLATE_TOKENS_PER_MESSAGE.saturating_mul(MESSAGES_PER_REQUEST))
            .saturating_add(TEMPLATE_TOKENS_PER_REQUEST)
    }

    /// Counted tokens of transcript that fit one request beside `fixed` counted tokens of
    /// prompt (system, instructions), a running summary of `running` endpoint tokens, and
    /// the answer.
    pub fn room(&self, fixed: u64, running: u64) -> u64 {
        let used = self
            .endpoint_tokens(fixed)
            .saturating_add(running)
            .saturating_add(self.answer());
        let left = self.window.saturating_sub(used);
        let room = u128::from(left) * 1000 / u128::from(self.per_mille.max(1));
        u64::try_from(room).unwrap_or(u64::MAX)
    }

    /// `max_tokens` for a request counted at `counted`: the answer's share, less when the
    /// prompt leaves less room, never below a quarter of the share (a request that leaves
    /// less than that is refused by the endpoint, which teaches compactd the window).
    pub fn max_tokens(&self, counted: u64) -> u64 {
        let left = self.window.saturating_sub(self.endpoint_tokens(counted));
        self.answer().min(left).max(self.answer() / 4).max(1)
    }

    /// The endpoint tokens a running summary of `counted` tokens takes.
    pub fn running(&self, counted: u64) -> u64 {
        self.scale(counted)
    }

    /// `counted` in endpoint tokens, rounded up.
    fn scale(&self, counted: u64) -> u64 {
        let scaled = (u128::from(counted) * u128::from(self.per_mille)).div_ceil(1000);
        u64::try_from(scaled).unwrap_or(u64::MAX)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::summarize::window::WindowSource;

    fn budget(tokens: u64, ratio: f64) -> Budget {
        Budget::new(Window {
            tokens,
            source: WindowSource::Props,
            ratio,
        })
    }

    #[test]
    fn the_room_keeps_the_answer_the_running_summary_and_the_template() {
        let b = budget(8_192, 1.0);
        assert_eq!(b.answer(), 2_048);
        // 8192 - 2048 - (400 * 1.1 + 24 + 16) = 5664 endpoint tokens, / 1.1.
        assert_eq!(b.room(400, 0), 5_149);
        // 3616 / 1.1.
        assert_eq!(b.room(400, 2_048), 3_287);
        // A prompt that fills the window leaves nothing, without wrapping.
        assert_eq!(b.room(u64::MAX, u64::MAX), 0);
    }

    #[test]
    fn a_finer_tokenizer_leaves_less_room() {
        let plain = budget(8_192, 1.0).room(400, 0);
        let fine = budget(8_192, 1.6).room(400, 0);
        assert!(fine < plain * 2 / 3, "{fine} vs {plain}");
    }

    #[test]
    fn prompt_and_answer_fit_the_window() {
        let b = budget(8_192, 1.3);
        let room = b.room(500, 0);
        let counted = 500 + room;
        assert!(b.endpoint_tokens(counted) + b.max_tokens(counted) <= 8_192);
        assert_eq!(b.max_tokens(counted), b.answer());
        // A prompt too long for the share still asks for a quarter of it, not zero
        // (llama.cpp reads zero as "no limit").
        assert_eq!(b.max_tokens(u64::MAX), 512);
        assert_eq!(budget(0, 1.0).max_tokens(10), 1);
    }
}
