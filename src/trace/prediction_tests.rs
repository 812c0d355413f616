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

/// Ten turns after a 40,000-character output, each request 110 tokens more than the
/// last; with `pruned_at`, the original run cleared the output at that time (its stamp)
/// and the provider reported the prompts without it from then on.
fn pruned_run(pruned_at: Option<i64>) -> Export {
    super::super::from_value(pruned_run_doc(pruned_at)).expect("a valid export")
}

/// [`pruned_run`] as the export's JSON, for tests that add messages to it.
fn pruned_run_doc(pruned_at: Option<i64>) -> Value {
    let text = |id: &str, n: usize| json!({"id": id, "type": "text", "text": "a".repeat(n)});
    let start = |id: &str| json!({"id": id, "type": "step-start"});
    let mut output = tool("a1_x", 40_000);
    if let Some(at) = pruned_at {
        output["state"]["time"] = json!({"start": 1, "end": 2, "compacted": at});
    }
    let mut messages = vec![
        message("u1", "user", 1_000, None, vec![text("u1_t", 400)]),
        message(
            "a1",
            "assistant",
            2_000,
            Some(1_000),
            vec![
                start("a1_s"),
                text("a1_t", 40),
                output,
                step_finish("a1_f", 1_000),
            ],
        ),
    ];
    for n in 2..=10i64 {
        let at = n * 2_000;
        let cleared = pruned_at.is_some_and(|p| p < at);
        let input = 1_000 + 10_000 + 110 * (n as u64 - 1) - if cleared { 10_000 } else { 0 };
        let (u, a) = (format!("u{n}"), format!("a{n}"));
        messages.push(message(
            &u,
            "user",
            at - 1_000,
            None,
            vec![text(&format!("{u}_t"), 400)],
        ));
        messages.push(message(
            &a,
            "assistant",
            at,
            Some(input),
            vec![
                start(&format!("{a}_s")),
                text(&format!("{a}_t"), 40),
                step_finish(&format!("{a}_f"), input),
            ],
        ));
    }
    json!({
        "info": {"id": "ses_t", "title": "t", "time": {"created": 1, "updated": 1}},
        "messages": messages,
    })
}

/// The request after the original run's prune is left out of the table, and it does
/// not teach the calibration either: the replayed session sees the prune where the
/// original did (its stamp), so the calibrated figures of the pruned run are those of
/// the same run unpruned. Before, its report (10,000 tokens under the estimate of a
/// context still holding the output) taught a factor that put every later prediction
/// off (median 0.07% -> 4.29% in the review's run).
#[test]
fn a_prune_of_the_original_run_does_not_teach_the_calibration() {
    let config = EngineConfig {
        tokenizer: Tokenizer::Chars4,
        ..EngineConfig::default()
    };
    let figures = |e: &Export| {
        let p = measure(e, &config, &mut ModelPriors::default());
        p.modes[3].figures()
    };
    let (plain, pruned) = (
        figures(&pruned_run(None)),
        figures(&pruned_run(Some(5_000))),
    );
    assert_eq!(
        pruned.requests + 1,
        plain.requests,
        "the request after the prune is left out"
    );
    assert!(
        pruned.median_abs_pct <= plain.median_abs_pct + 0.5
            && pruned.worst_under_pct <= plain.worst_under_pct + 0.5,
        "pruned {pruned:?}\nplain {plain:?}"
    );
}

/// The `calibrated` figures of `export` with the chars/4 tokenizer.
fn calibrated(export: &Export) -> ModeFigures {
    let config = EngineConfig {
        tokenizer: Tokenizer::Chars4,
        ..EngineConfig::default()
    };
    measure(export, &config, &mut ModelPriors::default()).modes[3].figures()
}

/// An assistant message created at `created` that failed before any usage was reported.
fn errored(id: &str, created: i64) -> Value {
    let mut m = message(
        id,
        "assistant",
        created,
        None,
        vec![json!({"id": format!("{id}_s"), "type": "step-start"})],
    );
    m["info"]["finish"] = Value::Null;
    m["info"]["error"] = json!({"name": "APIError", "data": {"message": "overloaded"}});
    m
}

/// A prune between a report and an errored request (no usage) still leaves out the next
/// request that reports: its check builds on the report before the prune. Before, the
/// exclusion was tied to the errored message, which made no check, and was lost.
#[test]
fn a_prune_before_an_errored_request_leaves_out_the_next_reported_one() {
    let with_error = |pruned_at: Option<i64>| {
        let mut doc = pruned_run_doc(pruned_at);
        let messages = doc["messages"].as_array_mut().expect("messages");
        // After u3 (5,000), before a3 (6,000); the prune's stamp is at 5,000.
        messages.insert(5, errored("e3", 5_500));
        super::super::from_value(doc).expect("a valid export")
    };
    let (plain, pruned) = (
        calibrated(&with_error(None)),
        calibrated(&with_error(Some(5_000))),
    );
    assert_eq!(
        pruned.requests + 1,
        plain.requests,
        "pruned {pruned:?}\nplain {plain:?}"
    );
}

/// The request right after a summary makes no check (nothing reported of the new
/// context), and the next step of its message is checked: it builds on that request's
/// report. Before, the exclusion fell on the message's first check, that second step.
#[test]
fn the_step_after_the_first_request_after_a_summary_is_checked() {
    let text = |id: &str, n: usize| json!({"id": id, "type": "text", "text": "a".repeat(n)});
    let start = |id: &str| json!({"id": id, "type": "step-start"});
    let mut summary = message(
        "a2",
        "assistant",
        4_000,
        Some(500),
        vec![start("a2_s"), text("a2_t", 400), step_finish("a2_f", 500)],
    );
    summary["info"]["summary"] = json!(true);
    let doc = json!({
        "info": {"id": "ses_t", "title": "t", "time": {"created": 1, "updated": 1}},
        "messages": [
            message("u1", "user", 1_000, None, vec![text("u1_t", 400)]),
            message("a1", "assistant", 2_000, Some(1_000), vec![
                start("a1_s"), text("a1_t", 40), step_finish("a1_f", 1_000)]),
            message("u2", "user", 3_000, None, vec![
                json!({"id": "u2_c", "type": "compaction", "auto": true})]),
            summary,
            message("u3", "user", 5_000, None, vec![text("u3_t", 400)]),
            message("a3", "assistant", 6_000, Some(1_210), vec![
                start("a3_s0"), text("a3_t0", 40), step_finish("a3_f0", 1_100),
                start("a3_s1"), text("a3_t1", 40), step_finish("a3_f1", 1_210)]),
        ],
    });
    let export = super::super::from_value(doc).expect("a valid export");
    assert_eq!(calibrated(&export).requests, 1);
}
