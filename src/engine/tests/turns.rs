//! The model's reasoning across user turns. Providers drop the reasoning of earlier turns
//! (Anthropic: `(input_tokens − previous_thinking_tokens) + current_turn_tokens`; OpenAI's
//! reasoning items before the last user message), and hosts send it back within a turn
//! or not at all. The prediction follows both: it drops what the turn carried when a user
//! message starts a new one, by as much as the session's reports say the host carried.

use super::*;
use crate::domain::TokenUsage;
use crate::engine::Trigger;
use crate::tokens::Tokenizer;

/// Limits whose threshold is `floor(92_000 × 0.92)` = 84,640.
fn limits() -> ModelLimits {
    ModelLimits {
        context: 100_000,
        input: 0,
        output: 8_000,
    }
}

fn session() -> Session {
    let overrides = SessionOverrides {
        tokenizer: Some(Tokenizer::Chars4),
        prune: Some(false),
        ..Default::default()
    };
    let mut s = new_session(overrides, limits());
    apply(&mut s, Update::UpsertMessage(user("u1")));
    apply(
        &mut s,
        Update::UpsertPart(text("u1", "t1", "Find the bug.")),
    );
    s
}

/// One request of the turn: an assistant message whose report counted `prompt` and an
/// output of `text + reasoning`.
fn request(s: &mut Session, id: &str, parent: &str, prompt: u64, text: u64, reasoning: u64) {
    let mut m = assistant(id, parent);
    m.finish.clear();
    apply(s, Update::UpsertMessage(m));
    let tokens = TokenUsage {
        input: prompt,
        output: text + reasoning,
        reasoning,
        ..TokenUsage::default()
    };
    apply(
        s,
        Update::ReportUsage {
            message_id: None,
            tokens,
        },
    );
}

/// The reasoning of each request of the turn (varied, as a model's is).
fn reasoning_of(i: u64) -> u64 {
    300 + 400 * ((i * 3) % 7)
}

/// A turn of `steps` requests from `prompt`, each writing 200 tokens of text and
/// [`reasoning_of`] of reasoning, which the host sends back within the turn when
/// `carried`. Returns the last prompt, the last output and the turn's reasoning.
fn turn(s: &mut Session, mut prompt: u64, steps: u64, carried: bool) -> (u64, u64, u64) {
    let (mut output, mut total) = (0, 0);
    for i in 0..steps {
        if i > 0 {
            prompt += if carried { output } else { 200 };
        }
        let r = reasoning_of(i);
        request(s, &format!("a{i}"), "u1", prompt, 200, r);
        (output, total) = (200 + r, total + r);
    }
    (prompt, output, total)
}

/// A user message of `tokens` tokens (chars ÷ 4, as the provider counts this prose).
fn new_turn(s: &mut Session, tokens: usize) {
    apply(s, Update::UpsertMessage(user("u2")));
    apply(s, Update::UpsertPart(text("u2", "t2", &chars(4 * tokens))));
}

/// The last request of a long turn stopped just below the threshold; the user then pastes
/// 4,000 tokens. The provider drops the turn's 15,000 tokens of reasoning, so the next
/// request fits: no compaction. Counting the reasoning as still there would compact.
#[test]
fn a_new_turn_that_fits_without_the_old_reasoning_does_not_compact() {
    let mut s = session();
    let steps = 10;
    let (_, _, reasoning) = {
        let mut probe = session();
        turn(&mut probe, 0, steps, true)
    };
    // Chosen so that the last report's whole request is 84,000 tokens.
    let start = 84_000 - (steps - 1) * 200 - reasoning - 200;
    let (last, output, reasoning) = turn(&mut s, start, steps, true);
    assert_eq!(last + output, 84_000);
    let before = s.check_overflow(Trigger::Request);
    assert!(!before.overflow, "{before:?}");
    new_turn(&mut s, 4_000);
    let c = s.check_overflow(Trigger::Request);
    // What the provider will count: the last prompt without the reasoning it carried,
    // the text just written, the new message.
    let actual = last - (reasoning - reasoning_of(steps - 1)) + 200 + 4_000;
    assert!(actual < c.threshold && last + output + 4_000 > c.threshold);
    assert!(!c.overflow, "{c:?}");
    // The calibration learned from this turn alone how much reasoning the host sends back
    // (from a prior of none): the prediction is not under, and most of the old error is
    // gone.
    let kept = last + output + 4_000;
    assert!(
        c.predicted >= actual && (c.predicted - actual) * 3 < kept - actual,
        "predicted {} vs actual {actual} (with the reasoning kept: {kept})",
        c.predicted
    );
}

/// A host that never sends reasoning back: each prompt grows by the text alone. The
/// reports teach the calibration so, and a new turn then removes next to nothing: the
/// prediction stays at or above what the provider counts (no under-prediction from a
/// drop of reasoning that was never there).
#[test]
fn a_host_that_never_sends_reasoning_back_is_not_under_predicted() {
    let mut s = session();
    let (last, _, reasoning) = turn(&mut s, 20_000, 20, false);
    assert!(reasoning > 25_000, "{reasoning}");
    let f = s.calibration().factors();
    assert!(f[4] < 0.25, "reasoning factor learned: {f:?}");
    new_turn(&mut s, 1_000);
    let actual = last + 200 + 1_000;
    let c = s.check_overflow(Trigger::Request);
    assert!(
        c.predicted as f64 >= 0.99 * actual as f64,
        "predicted {} vs actual {actual}",
        c.predicted
    );
}
