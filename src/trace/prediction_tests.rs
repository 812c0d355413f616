//! The prediction table's figures on small handmade exports.

use serde_json::{Value, json};

use super::*;

/// A tool part of `chars` characters of output.
fn tool(id: &str, chars: usize) -> Value {
    json!({"id": id, "type": "tool", "callID": format!("call_{id}"), "tool": "bash",
        "state": {"status": "completed", "input": {}, "output": "x".repeat(chars)}})
}

fn step_finish(id: &str, input: u64) -> Value {
    json!({"id": id, "type": "step-finish", "reason": "tool-calls",
        "tokens": {"input": input, "output": 10, "reasoning": 0, "cache": {"read": 0, "write": 0}}})
}

fn message(id: &str, role: &str, created: i64, tokens: Option<u64>, parts: Vec<Value>) -> Value {
    let mut info = json!({"id": id, "sessionID": "ses_t", "role": role,
        "time": {"created": created, "completed": created + 1}});
    if role == "assistant" {
        info["finish"] = json!("stop");
        info["modelID"] = json!("claude-sonnet-4");
        info["providerID"] = json!("anthropic");
    }
    if let Some(input) = tokens {
        info["tokens"] = json!({"input": input, "output": 10, "reasoning": 0,
            "cache": {"read": 0, "write": 0}});
    }
    json!({"info": info, "parts": parts})
}

/// Two turns; the second assistant message takes three steps (two of them after a
/// 4,000-character tool output), each reported by its step-finish, the message's own
/// usage the last step's (as OpenCode records it).
fn multi_step() -> Export {
    let text = |id: &str, n: usize| json!({"id": id, "type": "text", "text": "a".repeat(n)});
    let start = |id: &str| json!({"id": id, "type": "step-start"});
    let doc = json!({
        "info": {"id": "ses_t", "title": "t", "time": {"created": 1, "updated": 1}},
        "messages": [
            message("u1", "user", 1_000, None, vec![text("u1_t", 400)]),
            message("a1", "assistant", 2_000, Some(1_000), vec![
                start("a1_s0"), text("a1_t0", 40), step_finish("a1_f0", 1_000)]),
            message("u2", "user", 3_000, None, vec![text("u2_t", 400)]),
            message("a2", "assistant", 4_000, Some(3_130), vec![
                start("a2_s0"), text("a2_t0", 40), tool("a2_x0", 4_000), step_finish("a2_f0", 1_110),
                start("a2_s1"), text("a2_t1", 40), tool("a2_x1", 4_000), step_finish("a2_f1", 2_120),
                start("a2_s2"), text("a2_t2", 40), step_finish("a2_f2", 3_130)]),
        ],
    });
    super::super::from_value(doc).expect("a valid export")
}

/// Each step of a multi-step message is one request, checked once. Before, the message's
/// own usage (its last step's) was reported as it opened, before any part: a fourth
/// sample, 64% and 183% off.
#[test]
fn a_multi_step_message_is_checked_once_per_step() {
    let config = EngineConfig {
        tokenizer: Tokenizer::Chars4,
        ..EngineConfig::default()
    };
    let p = measure(&multi_step(), &config, &mut ModelPriors::default());
    for (mode, errors) in MODES.iter().zip(&p.modes) {
        assert_eq!(errors.figures().requests, 3, "{mode}: {:?}", errors.errors);
    }
    // The reported prompts were made up to chars/4 of the texts (BPE counts runs of one
    // letter as few tokens): the chars4 estimate of each step is close.
    let chars4 = &p.modes[0].errors;
    assert!(chars4.iter().all(|(e, _)| e.abs() < 5.0), "{chars4:?}");
}

/// The median of an even count is the mean of the two middle values.
#[test]
fn the_median_of_an_even_count_is_the_mean_of_the_middle_two() {
    let errors = ModeErrors {
        errors: vec![(0.0, 1_000), (-11.43, 1_000)],
    };
    let f = errors.figures();
    assert!((f.median_abs_pct - 5.715).abs() < 1e-9, "{f:?}");
    assert_eq!(f.p95_abs_pct, 11.43);
    let odd = ModeErrors {
        errors: vec![(1.0, 1_000), (-3.0, 1_000), (2.0, 1_000)],
    };
    assert_eq!(odd.figures().median_abs_pct, 2.0);
}
