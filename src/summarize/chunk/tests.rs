//! The chunk arithmetic and the fold, against a scripted requester.

use super::*;

#[test]
fn chunk_chars_keeps_half_the_window_minus_the_prompt_at_two_chars_per_token() {
    assert_eq!(chunk_chars(8_192, 1_500), Ok(6_692));
    assert_eq!(chunk_chars(8_192, 0), Ok(8_192));
    // An odd overhead rounds the same way as before the move.
    assert_eq!(chunk_chars(8_192, 1_501), Ok(6_692));
}

#[test]
fn chunk_chars_refuses_windows_with_no_room_for_the_conversation() {
    for (window, overhead) in [(0, 0), (1, 0), (999, 0), (8_192, 8_192), (2_000, 1_002)] {
        assert!(
            matches!(
                chunk_chars(window, overhead),
                Err(SummarizeError::TooLong(_))
            ),
            "window {window}, overhead {overhead}"
        );
    }
    // The smallest window that leaves exactly one minimal chunk.
    assert_eq!(chunk_chars(1_000, 0), Ok(MIN_CHUNK_CHARS));
    assert_eq!(chunk_chars(2_000, 1_000), Ok(MIN_CHUNK_CHARS));
}

#[test]
fn chunk_chars_saturates_on_huge_numbers() {
    let huge = chunk_chars(u64::MAX, 0).expect("room");
    assert!(huge >= usize::MAX / 2, "{huge}");
    assert!(chunk_chars(u64::MAX, usize::MAX).is_err());
    assert!(chunk_chars(0, usize::MAX).is_err());
    assert!(chunk_chars(u64::MAX, usize::MAX - 1).is_err());
}

/// Answers each request with `summary N`; refuses requests longer than `limit` chars.
#[derive(Default)]
struct Scripted {
    limit: Option<usize>,
    usage: Option<TokenUsage>,
    sent: Vec<(usize, bool)>,
    splits: Vec<usize>,
}

impl Requester for Scripted {
    fn request(
        &mut self,
        messages: Vec<Value>,
        last: bool,
    ) -> impl Future<Output = Result<SummaryOutcome, SummarizeError>> + Send {
        let chars: usize = messages
            .iter()
            .map(|m| m["content"].as_str().map_or(0, str::len))
            .sum();
        let refused = self.limit.is_some_and(|l| chars > l);
        if !refused {
            self.sent.push((chars, last));
        }
        let n = self.sent.len();
        let usage = self.usage;
        async move {
            if refused {
                return Err(SummarizeError::TooLong(format!("{chars} chars")));
            }
            Ok(SummaryOutcome {
                text: format!("summary {n}"),
                usage,
                cost: 0.5,
                model: None,
            })
        }
    }

    fn splitting(&mut self, max_chars: usize, _reason: &str) {
        self.splits.push(max_chars);
    }
}

fn blocks(n: usize, each: usize) -> Vec<String> {
    (0..n).map(|i| format!("{i:>each$}")).collect()
}

fn options(prompts: &PromptConfig, window: Option<u64>) -> Options<'_> {
    Options {
        previous_summary: None,
        prompts,
        instructions: "",
        window,
    }
}

#[tokio::test]
async fn without_a_window_the_head_goes_in_one_request_as_it_is() {
    let prompts = PromptConfig::default();
    let usage = TokenUsage {
        input: 10,
        output: 2,
        ..TokenUsage::default()
    };
    let mut r = Scripted {
        usage: Some(usage),
        ..Scripted::default()
    };
    let s = summarize_blocks(&blocks(10, 500), options(&prompts, None), &mut r)
        .await
        .expect("summary");
    assert_eq!((s.chunks, s.dropped_chars), (1, 0));
    assert_eq!(r.sent.len(), 1);
    assert!(r.sent[0].1, "the only request is the last");
    assert_eq!(
        s.outcome.usage,
        Some(usage),
        "one request's usage as reported"
    );
    assert_eq!(s.outcome.cost, 0.5);
}

#[tokio::test]
async fn a_window_cuts_the_head_and_the_chunks_fold_oldest_first() {
    let prompts = PromptConfig::default();
    let overhead = prompt::overhead_chars(None, &prompts, Some(""));
    // Room for about two 500-character blocks per request.
    let window = u64::try_from(overhead + 1_000).expect("fits");
    let mut r = Scripted {
        usage: Some(TokenUsage {
            input: u64::MAX - 1,
            output: 7,
            ..TokenUsage::default()
        }),
        ..Scripted::default()
    };
    let s = summarize_blocks(&blocks(6, 500), options(&prompts, Some(window)), &mut r)
        .await
        .expect("summary");
    assert_eq!(s.chunks, 3);
    assert_eq!(
        r.sent.iter().map(|(_, last)| *last).collect::<Vec<_>>(),
        [false, false, true]
    );
    assert_eq!(s.outcome.text, "summary 3");
    let usage = s.outcome.usage.expect("summed");
    assert_eq!(usage.input, u64::MAX, "saturated, not wrapped");
    assert_eq!(usage.output, 21);
    assert_eq!(usage.total, Some(u64::MAX));
    assert_eq!(s.outcome.cost, 1.5);
}

#[tokio::test]
async fn a_refusal_for_length_halves_the_chunks_and_starts_over() {
    let prompts = PromptConfig::default();
    let overhead = prompt::overhead_chars(None, &prompts, Some(""));
    let mut r = Scripted {
        limit: Some(overhead + 2_500),
        ..Scripted::default()
    };
    let s = summarize_blocks(&blocks(8, 1_000), options(&prompts, None), &mut r)
        .await
        .expect("summary");
    // 8,000 → 4,000 → 2,000 characters per chunk: four requests of two blocks.
    assert_eq!(r.splits, [4_000, 2_000]);
    assert_eq!(s.chunks, 4);
}

#[tokio::test]
async fn the_splitting_gives_up_after_max_splits_or_at_the_smallest_chunk() {
    let prompts = PromptConfig::default();
    let mut r = Scripted {
        limit: Some(1),
        ..Scripted::default()
    };
    let e = summarize_blocks(&blocks(64, 1_000), options(&prompts, None), &mut r)
        .await
        .expect_err("never fits");
    assert!(matches!(e, SummarizeError::TooLong(_)), "{e}");
    assert_eq!(r.splits.len(), MAX_SPLITS);
    assert!(r.sent.is_empty());

    let mut r = Scripted {
        limit: Some(1),
        ..Scripted::default()
    };
    let e = summarize_blocks(&blocks(1, 1_500), options(&prompts, None), &mut r)
        .await
        .expect_err("never fits");
    assert!(matches!(e, SummarizeError::TooLong(_)), "{e}");
    assert_eq!(r.splits, [750], "no split below the smallest chunk");
}

#[tokio::test]
async fn an_empty_head_is_still_one_request() {
    let prompts = PromptConfig::default();
    let mut r = Scripted::default();
    let s = summarize_blocks(&[], options(&prompts, None), &mut r)
        .await
        .expect("summary");
    assert_eq!(s.chunks, 1);
    assert_eq!(r.sent.len(), 1);
}
