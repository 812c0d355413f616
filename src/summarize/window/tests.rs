//! What each endpoint says about its window, read from the texts they send, and what the
//! cache learns from it.

use serde_json::json;

use super::*;

const URL: &str = "http://127.0.0.1:8080/v1";

#[test]
fn llama_cpp_props_tell_the_runtime_window() {
    let props =
        json!({"default_generation_settings": {"n_ctx": 8192, "params": {}}, "total_slots": 1});
    assert_eq!(from_props(&props), Some(8_192));
    assert_eq!(from_props(&json!({"n_ctx": 4096})), Some(4_096));
    assert_eq!(from_props(&json!({"detail": "Not Found"})), None);
    assert_eq!(
        from_props(&json!({"n_ctx": 3})),
        None,
        "implausible figures are ignored"
    );
}

#[test]
fn models_lists_tell_the_window_of_the_named_or_only_model() {
    let vllm = json!({"object": "list", "data": [
        {"id": "other", "max_model_len": 32768},
        {"id": "smol", "max_model_len": 8192},
    ]});
    assert_eq!(from_models(&vllm, "smol"), Some(8_192));
    assert_eq!(
        from_models(&vllm, "missing"),
        None,
        "several models, none named so"
    );
    // llama.cpp's server names its one model after the file: any name finds it.
    let llama = json!({"data": [{"id": "/models/smol.gguf", "meta": {"n_ctx_train": 8192}}]});
    assert_eq!(from_models(&llama, "local"), Some(8_192));
    // llama-cpp-python's list says nothing about the window.
    let python = json!({"object": "list", "data": [{"id": "/x/smol.gguf", "object": "model", "owned_by": "me", "permissions": []}]});
    assert_eq!(from_models(&python, "local"), None);
    assert_eq!(from_models(&json!({"data": "nope"}), "local"), None);
}

#[test]
fn refusals_name_the_window_and_the_prompt_in_every_known_wording() {
    for (text, window, prompt) in [
        (
            "This model's maximum context length is 8192 tokens. However, you requested 10131 tokens (10031 in the messages, 100 in the completion). Please reduce the length of the messages or completion.",
            Some(8_192),
            Some(10_031),
        ),
        (
            "This model's maximum context length is 128000 tokens. However, your messages resulted in 130512 tokens. Please reduce the length of the messages.",
            Some(128_000),
            Some(130_512),
        ),
        (
            "'max_tokens' or 'max_completion_tokens' is too large: 2048. This model's maximum context length is 8192 tokens and your request has 6431 input tokens (2048 > 8192 - 6431).",
            Some(8_192),
            Some(6_431),
        ),
        (
            r#"{"error":{"code":400,"message":"request (9100 tokens) exceeds the available context size (8192 tokens), try increasing it","type":"exceed_context_size_error","n_prompt_tokens":9100,"n_ctx":8192}}"#,
            Some(8_192),
            Some(9_100),
        ),
        (
            "prompt is too long: 213462 tokens > 200000 maximum",
            Some(200_000),
            Some(213_462),
        ),
        (
            "input length and `max_tokens` exceed context limit: 188059 + 20000 > 200000, decrease input length or `max_tokens` and try again",
            Some(200_000),
            Some(188_059),
        ),
        (
            "The input token count (1200000) exceeds the maximum number of tokens allowed (1048576).",
            Some(1_048_576),
            Some(1_200_000),
        ),
        (
            "Input validation error: `inputs` tokens + `max_new_tokens` must be <= 4096. Given: 4000 `inputs` tokens and 200 `max_new_tokens`",
            Some(4_096),
            Some(4_000),
        ),
        (
            "the request exceeds the available context size, try increasing it",
            None,
            None,
        ),
        (
            "This model's maximum context length is exceeded",
            None,
            None,
        ),
    ] {
        assert_eq!(
            refusal(text),
            Refusal {
                window,
                prompt_tokens: prompt,
                ceiling: None
            },
            "{text}"
        );
        assert!(reads_too_long(text), "{text}");
    }
    assert!(!reads_too_long("Rate limit reached"));
    assert_eq!(
        refusal("maximum context length is 99999999999999999999 tokens"),
        Refusal::default(),
        "absurd numbers are not read"
    );
    assert_eq!(
        refusal("é(7 in the messages"),
        Refusal {
            window: None,
            prompt_tokens: Some(7),
            ceiling: None
        }
    );
}

/// The configured window is every model's, and wins over what the endpoint tells and
/// over a refusal without numbers; a refusal naming a smaller window lowers it for that
/// model. Before, the configured figure won over that too: a session's compaction model
/// with an 8k window, under `--llm-context-tokens 128000`, was sent requests it refused
/// naming its window, each time, and every compaction failed `too_long`.
#[test]
fn the_configured_window_is_a_ceiling_a_refusal_naming_a_smaller_one_lowers() {
    let w = Windows::new(Some(6_000));
    assert!(!w.should_ask(URL, "m"), "nothing to ask");
    w.told(URL, "m", Some((8_192, WindowSource::Props)));
    let now = w.get(URL, "m").expect("known");
    assert_eq!((now.tokens, now.source), (6_000, WindowSource::Configured));
    let silent = w
        .refused(URL, "m", Refusal::default(), 2_000, Some(1_000))
        .expect("known");
    assert_eq!(
        (silent.tokens, silent.source),
        (6_000, WindowSource::Configured)
    );
    // A refusal naming a window above the configured one changes nothing.
    let above = Refusal {
        window: Some(16_384),
        prompt_tokens: None,
        ceiling: None,
    };
    let now = w.refused(URL, "m", above, 2_000, None).expect("known");
    assert_eq!((now.tokens, now.source), (6_000, WindowSource::Configured));
    let refusal = Refusal {
        window: Some(4_096),
        prompt_tokens: Some(3_000),
        ceiling: None,
    };
    let now = w.refused(URL, "m", refusal, 2_000, None).expect("known");
    assert_eq!((now.tokens, now.source), (4_096, WindowSource::Refusal));
    assert_eq!(now.ratio, 1.5, "the ratio is still learned");
    // A later refusal without numbers shrinks below it, never back up to the ceiling.
    let now = w
        .refused(URL, "m", Refusal::default(), 2_000, Some(1_000))
        .expect("known");
    assert!(now.tokens < 4_096, "{now:?}");
    // Only for that model.
    let other = w.get(URL, "other").expect("known");
    assert_eq!(
        (other.tokens, other.source),
        (6_000, WindowSource::Configured)
    );
}

#[test]
fn a_told_window_is_kept_per_endpoint_and_model() {
    let w = Windows::new(None);
    assert!(w.should_ask(URL, "m"));
    assert_eq!(w.get(URL, "m"), None);
    w.told(URL, "m", Some((8_192, WindowSource::Props)));
    assert!(!w.should_ask(URL, "m"));
    assert_eq!(
        w.get(URL, "m"),
        Some(Window {
            tokens: 8_192,
            source: WindowSource::Props,
            ratio: 1.0
        })
    );
    assert_eq!(w.get(URL, "other"), None);
    assert!(w.should_ask("http://elsewhere/v1", "m"));
    // Asked, nothing told: not asked again.
    w.told(URL, "silent", None);
    assert!(!w.should_ask(URL, "silent"));
    assert_eq!(w.get(URL, "silent"), None);
}

#[test]
fn a_refusal_with_numbers_sets_the_window_and_the_ratio() {
    let w = Windows::new(None);
    w.told(URL, "m", Some((32_768, WindowSource::Models)));
    let refusal = Refusal {
        window: Some(8_192),
        prompt_tokens: Some(10_031),
        ceiling: None,
    };
    let now = w.refused(URL, "m", refusal, 6_000, Some(1)).expect("known");
    assert_eq!((now.tokens, now.source), (8_192, WindowSource::Refusal));
    assert!(
        (now.ratio - 10_031.0 / 6_000.0).abs() < 1e-9,
        "{}",
        now.ratio
    );
    // A later discovery answer does not undo it.
    w.told(URL, "m", Some((32_768, WindowSource::Models)));
    assert_eq!(w.get(URL, "m").map(|k| k.tokens), Some(8_192));
}

#[test]
fn a_signal_without_numbers_lowers_the_window_below_the_request() {
    let w = Windows::new(None);
    let now = w
        .refused(URL, "m", Refusal::default(), 9_000, Some(1_000))
        .expect("learned");
    assert_eq!((now.tokens, now.source), (9_999, WindowSource::Shrunk));
    // Only ever lower, and never below the floor.
    let now = w
        .refused(URL, "m", Refusal::default(), 20_000, None)
        .expect("known");
    assert_eq!(now.tokens, 9_999);
    let now = w
        .refused(URL, "m", Refusal::default(), 10, None)
        .expect("known");
    assert_eq!(now.tokens, MIN_SHRUNK_WINDOW);
}

/// The ratio is the largest of the latest [`RATIO_KEPT`] the endpoint taught: never
/// lower than any of them, and one wrong report ages out. Before, it was the largest
/// ever: one inflated report fixed it at 4.0 for the process's life, and a 4,096-token
/// model's chunks had no room left.
#[test]
fn the_ratio_is_the_largest_of_the_latest_and_stays_within_bounds() {
    let w = Windows::new(None);
    let ratio = |w: &Windows| w.get(URL, "m").map(|k| k.ratio);
    w.told(URL, "m", Some((8_192, WindowSource::Props)));
    assert_eq!(ratio(&w), Some(RATIO_BOUNDS.0), "1.0 until told otherwise");
    w.observed(URL, "m", 1_000, 1_400);
    assert_eq!(ratio(&w), Some(1.4));
    w.observed(URL, "m", 1_000, 1_100);
    assert_eq!(ratio(&w), Some(1.4), "never lower than one kept");
    w.observed(URL, "m", 1, u64::MAX);
    assert_eq!(ratio(&w), Some(RATIO_BOUNDS.1));
    for _ in 1..RATIO_KEPT {
        w.observed(URL, "m", 1_000, 1_100);
    }
    assert_eq!(
        ratio(&w),
        Some(RATIO_BOUNDS.1),
        "kept while among the latest"
    );
    w.observed(URL, "m", 1_000, 1_100);
    assert_eq!(ratio(&w), Some(1.1), "aged out");
    // A refusal's count teaches it too.
    w.refused(
        URL,
        "m",
        Refusal {
            window: Some(8_192),
            prompt_tokens: Some(2_000),
            ceiling: None,
        },
        1_000,
        None,
    );
    assert_eq!(ratio(&w), Some(2.0));
    w.observed(URL, "m", 0, 5);
    assert_eq!(scale(u64::MAX, RATIO_BOUNDS.1), u64::MAX, "saturates");
}

#[test]
fn the_pairs_kept_are_bounded_and_asking_keeps_nothing() {
    let w = Windows::new(None);
    // Asking about models no one told anything of keeps no entry.
    for i in 0..1_000 {
        assert_eq!(w.get(URL, &format!("asked-{i}")), None);
    }
    assert_eq!(w.known.lock().expect("lock").len(), 0);
    // Models told of are kept up to the bound; past it a new one is not (each costs a
    // key), while those already kept go on learning.
    for i in 0..(MAX_KNOWN + 100) {
        w.told(URL, &format!("m{i}"), Some((8_192, WindowSource::Props)));
    }
    assert_eq!(w.known.lock().expect("lock").len(), MAX_KNOWN);
    assert_eq!(w.get(URL, &format!("m{}", MAX_KNOWN + 1)), None);
    w.told(URL, "m0", Some((4_096, WindowSource::Props)));
    w.observed(URL, "m0", 1_000, 2_000);
    let m0 = w.get(URL, "m0").expect("kept");
    assert_eq!((m0.tokens, m0.ratio), (8_192, 2.0));
}

#[test]
fn a_refused_max_tokens_field_stays_omitted() {
    use crate::summarize::output_cap::OutputCap;
    let w = Windows::new(None);
    w.cap_output("u", "m", OutputCap::At(16_384));
    w.cap_output("u", "m", OutputCap::At(32_000));
    assert_eq!(
        w.output_cap("u", "m"),
        Some(OutputCap::At(16_384)),
        "the lower cap"
    );
    w.cap_output("u", "m", OutputCap::Omit);
    // A request built before the field was refused may still teach a figure.
    w.cap_output("u", "m", OutputCap::At(8_192));
    assert_eq!(w.output_cap("u", "m"), Some(OutputCap::Omit));
}

/// A window compactd guessed (one below what a signal without numbers refused) is not
/// the endpoint's word: after [`SHRUNK_ANSWERS`] answered requests it is forgotten, and
/// what was known before it (told, named by a refusal, or nothing) is used again. Before,
/// it was kept for the process's life, only ever lowered: a 32,768-token window told by
/// `/props` stayed at a third of that after one odd answer.
#[test]
fn a_guessed_window_is_forgotten_after_answers_what_was_known_before_returns() {
    let w = Windows::new(None);
    w.told(URL, "m", Some((32_768, WindowSource::Props)));
    let guessed = w
        .refused(URL, "m", Refusal::default(), 3_000, Some(8_192))
        .expect("known");
    assert_eq!(
        (guessed.tokens, guessed.source),
        (11_191, WindowSource::Shrunk)
    );
    for _ in 1..SHRUNK_ANSWERS {
        w.answered(URL, "m");
    }
    assert_eq!(w.get(URL, "m"), Some(guessed), "kept until the last answer");
    w.answered(URL, "m");
    let now = w.get(URL, "m").expect("known");
    assert_eq!((now.tokens, now.source), (32_768, WindowSource::Props));
    w.answered(URL, "m");
    assert_eq!(w.get(URL, "m").map(|k| k.tokens), Some(32_768));

    // Below a window a refusal named: that one again. Nothing known before: nothing.
    let named = Refusal {
        window: Some(8_192),
        prompt_tokens: None,
        ceiling: None,
    };
    w.refused(URL, "m", named, 3_000, None);
    w.refused(URL, "m", Refusal::default(), 3_000, Some(1_000));
    assert_eq!(w.get(URL, "m").map(|k| k.tokens), Some(3_999));
    // A lower guess starts the count again.
    for _ in 1..SHRUNK_ANSWERS {
        w.answered(URL, "m");
    }
    w.refused(URL, "m", Refusal::default(), 2_000, Some(1_000));
    w.answered(URL, "m");
    assert_eq!(w.get(URL, "m").map(|k| k.tokens), Some(2_999));
    for _ in 1..SHRUNK_ANSWERS {
        w.answered(URL, "m");
    }
    let now = w.get(URL, "m").expect("known");
    assert_eq!((now.tokens, now.source), (8_192, WindowSource::Refusal));
    w.refused(URL, "other", Refusal::default(), 9_000, Some(1_000));
    for _ in 0..SHRUNK_ANSWERS {
        w.answered(URL, "other");
    }
    assert_eq!(w.get(URL, "other"), None);
    // A discovery answer that comes while a guess is kept is used once it is forgotten.
    w.refused(URL, "late", Refusal::default(), 9_000, Some(1_000));
    w.told(URL, "late", Some((65_536, WindowSource::Models)));
    assert_eq!(w.get(URL, "late").map(|k| k.tokens), Some(9_999));
    for _ in 0..SHRUNK_ANSWERS {
        w.answered(URL, "late");
    }
    assert_eq!(w.get(URL, "late").map(|k| k.tokens), Some(65_536));
    // Answers for a model nothing is known of keep nothing.
    let before = w.known.lock().expect("lock").len();
    w.answered(URL, "unknown");
    assert_eq!(w.known.lock().expect("lock").len(), before);
}

/// A 429 for a request larger than the tokens a minute allows names that limit: a ceiling
/// for a guess, no window (it is no figure of the model's). A plain rate limit names none.
#[test]
fn a_rate_limit_passed_by_one_request_is_a_ceiling_for_a_guess() {
    let tpm = "Request too large for gpt-4o in organization org-x on tokens per min (TPM): Limit 30000, Requested 36278. The input or output tokens must be reduced in order to run successfully.";
    assert_eq!(rate_limit_ceiling(tpm), Some(30_000));
    assert_eq!(
        refusal(tpm),
        Refusal {
            window: None,
            prompt_tokens: None,
            ceiling: Some(30_000)
        }
    );
    for plain in [
        "Rate limit reached for gpt-4o in organization org-x on tokens per min (TPM): Limit 30000, Used 29000, Requested 2000. Please try again in 2s.",
        "Rate limit reached for gpt-4o in organization org-x on requests per min (RPM): Limit 3, Used 3, Requested 1. Please try again in 20s.",
        // Too large, but nothing says it passes the limit alone.
        "Request too large: Limit 30000, Requested 2000.",
    ] {
        assert_eq!(rate_limit_ceiling(plain), None, "{plain}");
    }

    // The guess is the ceiling when what was sent is above it, and is forgotten.
    let w = Windows::new(None);
    w.told(URL, "m", Some((128_000, WindowSource::Models)));
    let now = w
        .refused(URL, "m", refusal(tpm), 32_000, Some(4_000))
        .expect("known");
    assert_eq!((now.tokens, now.source), (30_000, WindowSource::Shrunk));
    for _ in 0..SHRUNK_ANSWERS {
        w.answered(URL, "m");
    }
    let later = w.get(URL, "m").expect("known");
    assert_eq!(
        (later.tokens, later.source),
        (128_000, WindowSource::Models)
    );

    // Never over the operator's window.
    let w = Windows::new(Some(200_000));
    let now = w
        .refused(URL, "m", refusal(tpm), 32_000, Some(4_000))
        .expect("known");
    assert_eq!(
        (now.tokens, now.source),
        (200_000, WindowSource::Configured)
    );
}
