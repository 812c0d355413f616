//! Real tokenizers and calibration in the engine: build logs are where chars ÷ 4 falls
//! short, and a session counting them with o200k (or calibrated from its reports) sees
//! the overflow coming where chars ÷ 4 would let the next request exceed the window.

use std::sync::Mutex;

use super::*;
use crate::domain::{ModelLimits, TokenUsage};
use crate::engine::estimate::{estimate_over, json_text};
use crate::engine::{Trigger, counted_texts, estimate};
use crate::tokens::{Counting, TokenCounter, Tokenizer};

/// A build log as compilers and test runners print it: paths, versions, timings, counts.
fn build_log(seed: usize, lines: usize) -> String {
    let mut out = String::new();
    for i in 0..lines {
        let n = seed * 7919 + i * 104_729;
        out.push_str(&match i % 5 {
            0 => format!(
                "[INFO] Compiling {} source files to /home/runner/work/app/module-{}/target/classes\n",
                n % 997,
                n % 31
            ),
            1 => format!(
                "[WARNING] /home/runner/work/app/src/main/java/com/example/core/Reader{}.java:[{},{}] unchecked conversion\n",
                n % 89,
                n % 4_000,
                n % 80
            ),
            2 => format!(
                "   Compiling serde_derive v1.0.{} (registry+https://registry.invalid/index)\n",
                n % 230
            ),
            3 => format!(
                "test result: ok. {} passed; 0 failed; {} ignored; finished in {}.{:02}s\n",
                n % 512,
                n % 7,
                n % 60,
                n % 100
            ),
            _ => format!(
                "2026-11-{:02}T{:02}:{:02}:{:02}.{:03}Z DEBUG [worker-{}] 0x{:08x} took {} ms\n",
                1 + n % 28,
                n % 24,
                n % 60,
                (n / 7) % 60,
                n % 1000,
                n % 16,
                n,
                n % 5_000
            ),
        });
    }
    out
}

/// Limits whose threshold is `floor(92_000 × 0.92)` = 84,640.
fn limits() -> ModelLimits {
    ModelLimits {
        context: 100_000,
        input: 0,
        output: 8_000,
    }
}

fn counting(tokenizer: Tokenizer) -> SessionOverrides {
    SessionOverrides {
        tokenizer: Some(tokenizer),
        // Prune stays out of the way: this is about the prediction.
        prune: Some(false),
        ..Default::default()
    }
}

/// A session whose provider reported a `reported`-token prompt, then ran a build whose
/// log (`log`) is input to the next request.
fn after_build(tokenizer: Tokenizer, reported: u64, log: &str) -> Session {
    let mut s = new_session(counting(tokenizer), limits());
    apply(&mut s, Update::UpsertMessage(user("u1")));
    apply(
        &mut s,
        Update::UpsertPart(text("u1", "t1", "Build it and fix the warnings.")),
    );
    let mut a1 = assistant("a1", "u1");
    a1.finish.clear();
    apply(&mut s, Update::UpsertMessage(a1));
    apply(
        &mut s,
        Update::ReportUsage {
            message_id: None,
            tokens: TokenUsage {
                input: reported,
                ..TokenUsage::default()
            },
        },
    );
    apply(&mut s, Update::UpsertPart(tool("a1", "build", "bash", log)));
    s
}

#[test]
fn build_logs_count_far_above_chars_over_four() {
    let log = build_log(1, 400);
    let (c4, o200k) = (
        Counting::Chars4.counter().count(&log),
        Counting::O200k.counter().count(&log),
    );
    assert!(
        o200k as f64 > 1.3 * c4 as f64,
        "o200k {o200k} vs chars/4 {c4}"
    );
}

#[test]
fn a_build_log_overflows_on_time_with_o200k_where_chars4_misses_it() {
    let log = build_log(2, 1_200);
    let (c4, o200k) = (
        Counting::Chars4.counter().count(&log),
        Counting::O200k.counter().count(&log),
    );
    let threshold = 84_640u64;
    // The last report leaves room for the log as chars ÷ 4 counts it, not as the
    // provider (an OpenAI model: o200k is its tokenizer) will.
    let reported = threshold - (c4 + o200k) / 2;
    assert!(reported + o200k > threshold && reported + c4 < threshold);

    let real = after_build(Tokenizer::O200k, reported, &log);
    let c = real.check_overflow(Trigger::Request);
    assert_eq!(c.threshold, threshold);
    assert!(c.overflow, "o200k sees it coming: {c:?}");
    assert!(c.predicted >= reported + o200k, "{c:?}");

    let heuristic = after_build(Tokenizer::Chars4, reported, &log);
    let c = heuristic.check_overflow(Trigger::Request);
    assert!(!c.overflow, "chars/4 misses it: {c:?}");
    assert!(c.predicted < threshold, "{c:?}");
}

/// A model with no public tokenizer: the session counts chars ÷ 4, and its provider's
/// reports teach it that tool output counts ~1.6× that. The calibrated prediction then
/// sees the next build log coming.
#[test]
fn calibration_from_reports_lets_chars4_see_the_build_log_coming() {
    let mut s = new_session(counting(Tokenizer::Chars4), limits());
    apply(&mut s, Update::UpsertMessage(user("u1")));
    apply(&mut s, Update::UpsertPart(text("u1", "t1", "Build it.")));
    let mut prompt = 8_000u64;
    for i in 0..8 {
        let id = format!("a{i}");
        let mut m = assistant(&id, "u1");
        m.finish.clear();
        apply(&mut s, Update::UpsertMessage(m));
        apply(
            &mut s,
            Update::ReportUsage {
                message_id: None,
                tokens: TokenUsage {
                    input: prompt,
                    ..TokenUsage::default()
                },
            },
        );
        let log = build_log(10 + i, 120);
        let c4 = Counting::Chars4.counter().count(&log);
        apply(
            &mut s,
            Update::UpsertPart(tool(&id, &format!("{id}_b"), "bash", &log)),
        );
        // What the provider will count for it.
        prompt += c4 * 16 / 10;
    }
    let f = s.calibration().factors();
    assert!(f[0] > 1.3, "tool output factor learned: {f:?}");
    // The next request: the provider says `prompt`; as chars ÷ 4 counts what was added
    // since the last report, the plain estimate falls short of it, the calibrated one
    // does not (by more than a few percent).
    let c = s.check_overflow(Trigger::Request);
    let plain = s.totals().usage().delta() as u64;
    let reported = s.usage().last().map_or(0, |u| u.input);
    assert!(reported + plain < prompt);
    assert!(
        c.predicted as f64 >= 0.97 * prompt as f64,
        "calibrated {} vs actual {prompt} (plain {})",
        c.predicted,
        reported + plain
    );
}

/// Records every text it is asked to count.
#[derive(Debug, Default)]
struct Recording(Mutex<Vec<String>>);

impl TokenCounter for Recording {
    fn count(&self, text: &str) -> u64 {
        if let Ok(mut seen) = self.0.lock() {
            seen.push(text.to_string());
        }
        0
    }

    fn name(&self) -> &'static str {
        "recording"
    }
}

#[test]
fn the_server_precounts_every_long_text_the_estimate_counts() {
    let long = "x".repeat(5_000);
    let mut with_input = tool("m", "p1", "write", &long);
    state_mut(&mut with_input).input = serde_json::json!({"filePath": "a.rs", "content": long});
    let mut failed = tool_in("m", "p2", "bash", ToolStatus::Error, "");
    state_mut(&mut failed).error = long.clone();
    // A subtask's description and a file sent by name were counted on the session's
    // actor, on the async runtime (an 8 MB one held other sessions' calls 2-3 s).
    let subtask = Part {
        kind: PartKind::Subtask(crate::domain::SubtaskPart {
            prompt: long.clone(),
            description: format!("{long} described"),
            ..Default::default()
        }),
        ..text("m", "p4", "")
    };
    let named_file = Part {
        kind: PartKind::File(crate::domain::FilePart {
            mime: "application/pdf".into(),
            url: "file:///tmp/report.pdf".into(),
            filename: format!("{long}.pdf"),
            ..Default::default()
        }),
        ..text("m", "p5", "")
    };
    let parts = [
        text("m", "p0", &long),
        with_input,
        failed,
        parse_part("m", "reasoning:r=5000"),
        subtask,
        named_file,
    ];
    for p in parts {
        let recording = Recording::default();
        estimate(&p, &recording);
        let precounted: Vec<String> = counted_texts(&p)
            .into_iter()
            .map(|t| t.into_owned())
            .collect();
        let seen = recording.0.lock().map(|v| v.clone()).unwrap_or_default();
        for t in seen
            .iter()
            .filter(|t| t.len() >= crate::tokens::bpe::CACHED_MIN)
        {
            assert!(precounted.contains(t), "{} not precounted", p.id);
        }
    }
}

/// A `write` call with a build log as its content, in `status`, with `input`.
fn write_call(status: ToolStatus, input: &serde_json::Value) -> Part {
    let mut p = tool_in("a1", "p1", "write", status, "");
    if status == ToolStatus::Completed {
        state_mut(&mut p).output = "Wrote file successfully.".into();
    }
    state_mut(&mut p).input = input.clone();
    p
}

/// Hosts resend a tool part as it runs; while its input is unchanged the input is not
/// counted again, and the estimate is the one counting everything gives.
#[test]
fn a_resent_tool_call_keeps_its_input_count() {
    let input = serde_json::json!({"filePath": "src/lib.rs", "content": build_log(3, 40)});
    let o200k = Counting::O200k.counter();
    let running = write_call(ToolStatus::Running, &input);
    let was = estimate(&running, o200k);
    let done = write_call(ToolStatus::Completed, &input);
    assert_eq!(
        estimate_over(&done, Some((&running, &was)), o200k),
        estimate(&done, o200k)
    );
    let counted_over = |part: &Part| {
        let recording = Recording::default();
        estimate_over(part, Some((&running, &was)), &recording);
        recording.0.lock().map(|v| v.clone()).unwrap_or_default()
    };
    assert!(!counted_over(&done).contains(&json_text(&input)));
    // An edited input is counted afresh.
    let edited_input = serde_json::json!({"filePath": "src/lib.rs", "content": build_log(4, 40)});
    let edited = write_call(ToolStatus::Completed, &edited_input);
    assert!(counted_over(&edited).contains(&json_text(&edited_input)));
    assert_eq!(
        estimate_over(&edited, Some((&running, &was)), o200k),
        estimate(&edited, o200k)
    );
}

/// The same, through a session: a call sent pending, running, then completed leaves the
/// totals of one sent completed only.
#[test]
fn a_call_sent_as_it_runs_totals_as_one_sent_done() {
    let input = serde_json::json!({"command": "cargo build", "log": build_log(5, 30)});
    let session = |statuses: &[ToolStatus]| {
        let mut s = after_build(Tokenizer::O200k, 20_000, "ok");
        for &status in statuses {
            apply(&mut s, Update::UpsertPart(write_call(status, &input)));
        }
        s
    };
    let resent = session(&[
        ToolStatus::Pending,
        ToolStatus::Running,
        ToolStatus::Completed,
    ]);
    let once = session(&[ToolStatus::Completed]);
    assert_eq!(resent.total_tokens(), once.total_tokens());
    assert!(once.total_tokens() > session(&[]).total_tokens());
}

/// A tokenizer change after a compaction re-counts the summarized build log too, but
/// the next request sends what it would have sent: the prediction stays where the
/// provider's report put it. Before, it moved by the whole session's change (526 ->
/// 57,685 in an earlier review, the context going 526 -> 267), then by the context's
/// change (a chars4 session switched to o200k predicted 88,871 for a context the
/// provider had just counted at 52,350: an automatic compaction nobody needed).
#[test]
fn a_tokenizer_change_after_a_compaction_leaves_the_prediction_where_the_report_put_it() {
    let mut s = new_session(counting(Tokenizer::Chars4), limits());
    for u in parse("user u1 text:t1=10\nassistant a1") {
        apply(&mut s, u);
    }
    apply(
        &mut s,
        Update::UpsertPart(tool("a1", "build", "bash", &build_log(3, 3_000))),
    );
    for u in parse("user u2 compaction:c1\nassistant s1 summary text:sum=100\nuser u3 text:t3=10") {
        apply(&mut s, u);
    }
    let c0 = s.context_tokens();
    apply(
        &mut s,
        Update::ReportUsage {
            message_id: None,
            tokens: TokenUsage {
                input: c0,
                ..TokenUsage::default()
            },
        },
    );
    let p0 = s.check_overflow(Trigger::Request).predicted;
    let configure = Update::Configure(SessionInfo {
        id: s.info().id.clone(),
        limits: s.info().limits,
        config: counting(Tokenizer::O200k),
        ..Default::default()
    });
    let whole_before = s.total_tokens();
    apply(&mut s, configure);
    assert!(
        s.total_tokens().abs_diff(whole_before) > 10_000,
        "the log counts differently"
    );
    let c1 = s.context_tokens();
    assert_ne!(c1, c0, "the context counts differently too");
    let p1 = s.check_overflow(Trigger::Request).predicted;
    assert_eq!(p1, p0, "the same content, the same prompt");
}
