//! The chunking policy against a scripted requester, counting with chars ÷ 4 so the
//! numbers are easy to follow.

use super::*;
use crate::summarize::window::WindowSource;
use crate::tokens::Counting;

fn counter() -> &'static dyn TokenCounter {
    Counting::Chars4.counter()
}

/// What the scripted requester saw of one request.
#[derive(Debug, Clone, Copy)]
struct Sent {
    last: bool,
    max_tokens: Option<u64>,
    counted: Option<u64>,
    refused: bool,
}

/// Answers each request with `summary N`; refuses (TooLong) requests whose messages are
/// longer than `limit` characters, and then knows the window `teaches`.
#[derive(Default)]
struct Scripted {
    window: Option<Window>,
    limit: Option<usize>,
    teaches: Option<Window>,
    usage: Option<TokenUsage>,
    /// Every request, in order.
    sent: Vec<Sent>,
    bodies: Vec<Vec<Value>>,
    splits: Vec<u64>,
    /// The answered request (1-based) answered with no text.
    empty: Option<usize>,
    /// A refusal without numbers teaches what `Windows::refused` learns from one: a
    /// window just below what was sent (its source `Shrunk`).
    shrinks: bool,
}

impl Requester for Scripted {
    fn request(
        &mut self,
        request: SummaryRequest,
        last: bool,
    ) -> impl Future<Output = Result<SummaryOutcome, SummarizeError>> + Send {
        let chars: usize = request
            .messages
            .iter()
            .map(|m| m["content"].as_str().map_or(0, str::len))
            .sum();
        let refused = self.limit.is_some_and(|l| chars > l);
        if refused && self.teaches.is_some() {
            self.window = self.teaches;
        }
        if refused && self.shrinks {
            let sent = request
                .counted_tokens
                .unwrap_or(0)
                .saturating_add(request.max_tokens.unwrap_or(0));
            self.window = Some(Window {
                tokens: sent.saturating_sub(1).max(2_048),
                source: WindowSource::Shrunk,
                ratio: 1.0,
            });
        }
        self.sent.push(Sent {
            last,
            max_tokens: request.max_tokens,
            counted: request.counted_tokens,
            refused,
        });
        self.bodies.push(request.messages);
        let n = self.sent.iter().filter(|s| !s.refused).count();
        let usage = self.usage;
        let empty = self.empty == Some(n);
        async move {
            if refused {
                return Err(SummarizeError::TooLong(format!("{chars} chars")));
            }
            Ok(SummaryOutcome {
                text: if empty {
                    String::new()
                } else {
                    format!("summary {n}")
                },
                usage,
                cost: 0.5,
                model: None,
            })
        }
    }

    fn window(&mut self) -> impl Future<Output = Option<Window>> + Send {
        std::future::ready(self.window)
    }

    fn splitting(&mut self, room_tokens: u64, _reason: &str) {
        self.splits.push(room_tokens);
    }
}

impl Scripted {
    fn answered(&self) -> usize {
        self.sent.iter().filter(|s| !s.refused).count()
    }

    /// No request follows a refused one with the same body.
    fn assert_no_repeat(&self) {
        for pair in self.bodies.windows(2) {
            assert_ne!(pair[0], pair[1], "the same request was sent twice in a row");
        }
    }
}

fn window(tokens: u64) -> Option<Window> {
    Some(Window {
        tokens,
        source: WindowSource::Props,
        ratio: 1.0,
    })
}

/// `n` blocks of `each` characters (each / 4 tokens), each opening with `<i>`.
fn blocks(n: usize, each: usize) -> Vec<String> {
    (0..n)
        .map(|i| {
            let tag = format!("<{i}>");
            format!("{tag}{}", ".".repeat(each - tag.len()))
        })
        .collect()
}

/// The blocks (by their tags) a request's transcript carries.
fn tags(body: &[Value]) -> Vec<usize> {
    let text = body[1]["content"].as_str().unwrap_or_default();
    text.split('<')
        .skip(1)
        .filter_map(|t| t.split('>').next()?.parse().ok())
        .collect()
}

fn options(prompts: &PromptConfig) -> Options<'_> {
    Options {
        previous_summary: None,
        prompts,
        instructions: "",
        counter: counter(),
    }
}

async fn run(blocks: &[String], r: &mut Scripted) -> Result<Summary, SummarizeError> {
    let prompts = PromptConfig::default();
    let tokens = count_all(counter(), blocks);
    summarize_blocks(blocks, &tokens, options(&prompts), r).await
}

#[tokio::test]
async fn without_a_window_the_head_goes_in_one_request_as_it_is() {
    let usage = TokenUsage {
        input: 10,
        output: 2,
        ..TokenUsage::default()
    };
    let mut r = Scripted {
        usage: Some(usage),
        ..Scripted::default()
    };
    let s = run(&blocks(10, 500), &mut r).await.expect("summary");
    assert_eq!((s.chunks, s.dropped_chars), (1, 0));
    assert_eq!(r.sent.len(), 1);
    let Sent {
        last,
        max_tokens,
        counted,
        ..
    } = r.sent[0];
    assert!(last, "the only request is the last");
    assert_eq!(max_tokens, None, "no window, no answer limit");
    assert!(counted.is_some_and(|c| c > 1_250), "{counted:?}");
    assert_eq!(
        s.outcome.usage,
        Some(usage),
        "one request's usage as reported"
    );
    assert_eq!(s.outcome.cost, 0.5);
}

#[tokio::test]
async fn a_head_that_fits_the_window_goes_whole_with_a_sized_answer() {
    let mut r = Scripted {
        window: window(8_192),
        ..Scripted::default()
    };
    let s = run(&blocks(10, 500), &mut r).await.expect("summary");
    assert_eq!(s.chunks, 1);
    assert_eq!(r.sent[0].max_tokens, Some(2_048), "a quarter of the window");
}

#[tokio::test]
async fn an_empty_answer_to_an_earlier_chunk_fails_the_summary() {
    // A small model that stops at once: folded as an empty running summary, the chunks
    // before it would be missing from a summary that still commits.
    let mut r = Scripted {
        window: window(4_096),
        empty: Some(1),
        ..Scripted::default()
    };
    let e = run(&blocks(40, 500), &mut r).await.expect_err("no summary");
    assert!(
        matches!(&e, SummarizeError::Malformed(m) if m.contains("nothing")),
        "{e}"
    );
    assert_eq!(r.sent.len(), 1, "nothing sent after it");
}

#[tokio::test]
async fn a_window_cuts_the_head_into_chunks_that_fit_and_fold_oldest_first() {
    let mut r = Scripted {
        window: window(4_096),
        usage: Some(TokenUsage {
            input: u64::MAX - 1,
            output: 7,
            ..TokenUsage::default()
        }),
        ..Scripted::default()
    };
    // 40 blocks of 125 tokens: 5,000 tokens, more than a 4k window holds.
    let s = run(&blocks(40, 500), &mut r).await.expect("summary");
    assert!(s.chunks >= 3, "{}", s.chunks);
    let budget = Budget::new(window(4_096).expect("window"));
    for sent in &r.sent {
        let max_tokens = sent.max_tokens.expect("sized");
        let counted = sent.counted.expect("counted");
        assert!(
            budget.endpoint_tokens(counted) + max_tokens <= 4_096,
            "prompt {counted} + answer {max_tokens} fit"
        );
    }
    assert_eq!(
        r.sent.iter().filter(|s| s.last).count(),
        1,
        "one last request"
    );
    assert!(r.sent.last().expect("sent").last);
    // Later chunks carry the running summary.
    let second = r.bodies[1][1]["content"].as_str().unwrap_or_default();
    assert!(second.starts_with("=== Summary of the earlier conversation ===\nsummary 1"));
    assert_eq!(s.outcome.text, format!("summary {}", s.chunks));
    let usage = s.outcome.usage.expect("summed");
    assert_eq!(usage.input, u64::MAX, "saturated, not wrapped");
    assert_eq!(usage.output, 7 * u64::from(s.chunks));
    assert_eq!(s.outcome.cost, 0.5 * f64::from(s.chunks));
}

#[tokio::test]
async fn a_refusal_halves_what_is_left_and_never_repeats_a_request() {
    let prompts = PromptConfig::default();
    let overhead = prompt::overhead_chars(Some(""), &prompts, Some(""));
    let mut r = Scripted {
        limit: Some(overhead + 2_500),
        ..Scripted::default()
    };
    // 8 blocks of 250 tokens: refused whole (2,000), then 1,000 (refused), then 500s.
    let s = run(&blocks(8, 1_000), &mut r).await.expect("summary");
    assert_eq!(r.splits, [1_000, 500]);
    assert_eq!(s.chunks, 4);
    assert_eq!(r.sent.len(), 6, "two refusals, four answers");
    r.assert_no_repeat();
}

#[tokio::test]
async fn refusals_without_numbers_halve_the_chunk_though_they_teach_a_window() {
    // A refusal without numbers teaches a window one below what was sent; the room it
    // leaves is most of the refused chunk (the answer's quarter aside), so cut to that,
    // a head many times the real window ran out of cuts before it fit.
    let prompts = PromptConfig::default();
    let overhead = prompt::overhead_chars(Some("summary 1"), &prompts, Some(""));
    let mut r = Scripted {
        limit: Some(overhead + 2_500),
        shrinks: true,
        ..Scripted::default()
    };
    // 32 blocks of 250 tokens (8,000); the endpoint takes two a request.
    let s = run(&blocks(32, 1_000), &mut r).await.expect("summary");
    let refused: Vec<u64> = r
        .sent
        .iter()
        .filter(|s| s.refused)
        .filter_map(|s| s.counted)
        .collect();
    for (cut, refused) in r.splits.iter().zip(&refused) {
        assert!(
            cut * 2 <= *refused,
            "cut to {cut} after a refusal at {refused}: {:?}",
            r.splits
        );
    }
    assert!(s.chunks >= 4, "{}", s.chunks);
    r.assert_no_repeat();
}

#[tokio::test]
async fn a_refusal_keeps_what_was_already_summarized() {
    let prompts = PromptConfig::default();
    let overhead = prompt::overhead_chars(Some("summary 1"), &prompts, Some(""));
    // The window holds nine 1,000-character blocks a request; the endpoint takes three.
    let mut r = Scripted {
        window: window(4_096),
        limit: Some(overhead + 3_000),
        ..Scripted::default()
    };
    let s = run(&blocks(12, 1_000), &mut r).await.expect("summary");
    assert_eq!(
        r.splits,
        [1_125, 500],
        "halves of nine, then four blocks: {:?}",
        r.sent
    );
    r.assert_no_repeat();
    // Every block reached an answered request exactly once, in order.
    let answered: Vec<usize> = r
        .sent
        .iter()
        .zip(&r.bodies)
        .filter(|(s, _)| !s.refused)
        .flat_map(|(_, body)| tags(body))
        .collect();
    assert_eq!(answered, (0..12).collect::<Vec<_>>(), "{:?}", r.sent);
    assert_eq!(s.chunks as usize, r.answered());
}

#[tokio::test]
async fn a_refusal_that_names_the_window_recuts_to_it() {
    // Nothing known at first; the refusal teaches a 2k window.
    let mut r = Scripted {
        limit: Some(6_000),
        teaches: window(2_048),
        ..Scripted::default()
    };
    let s = run(&blocks(16, 400), &mut r).await.expect("summary");
    let taught = r.splits[0];
    let expected = Budget::new(window(2_048).expect("window")).room(
        count_messages(
            counter(),
            &prompt::build_messages_for("", Some(""), &PromptConfig::default(), Some("")),
        ),
        0,
    );
    assert_eq!(
        taught, expected,
        "the room the learned window leaves, not a half"
    );
    assert_eq!(r.splits.len(), 1, "one refusal was enough");
    assert!(
        r.sent[1..].iter().all(|s| s.max_tokens == Some(512)),
        "{:?}",
        r.sent
    );
    assert!(s.chunks >= 2);
}

#[tokio::test]
async fn the_cutting_gives_up_after_max_splits_or_at_the_smallest_chunk() {
    let mut r = Scripted {
        limit: Some(1),
        ..Scripted::default()
    };
    let e = run(&blocks(64, 1_000), &mut r)
        .await
        .expect_err("never fits");
    assert!(matches!(e, SummarizeError::TooLong(_)), "{e}");
    assert_eq!(r.splits.len(), MAX_SPLITS);
    assert_eq!(r.sent.len(), MAX_SPLITS + 1);
    r.assert_no_repeat();

    let mut r = Scripted {
        limit: Some(1),
        ..Scripted::default()
    };
    let e = run(&blocks(1, 1_500), &mut r)
        .await
        .expect_err("never fits");
    assert!(matches!(e, SummarizeError::TooLong(_)), "{e}");
    assert_eq!(r.splits, [187], "no cut below the smallest chunk");
    r.assert_no_repeat();
}

#[tokio::test]
async fn a_window_with_no_room_for_the_conversation_sends_nothing() {
    let mut r = Scripted {
        window: window(1_024),
        ..Scripted::default()
    };
    let e = run(&blocks(40, 1_000), &mut r).await.expect_err("no room");
    assert!(e.to_string().contains("leaves no room"), "{e}");
    assert!(r.sent.is_empty());
}

#[tokio::test]
async fn a_block_too_long_for_any_chunk_keeps_its_newest_text() {
    let mut big = "old ".repeat(4_000);
    big.push_str("NEWEST");
    let mut r = Scripted {
        window: window(4_096),
        ..Scripted::default()
    };
    let s = run(&[big.clone()], &mut r).await.expect("summary");
    assert_eq!(s.chunks, 1);
    assert!(s.dropped_chars > 0);
    let sent = r.bodies[0][1]["content"].as_str().unwrap_or_default();
    assert!(sent.ends_with("NEWEST"), "{}", &sent[sent.len() - 20..]);
    assert!(sent.contains("earlier characters dropped by compactd"));
}

#[tokio::test]
async fn an_empty_head_is_still_one_request() {
    let mut r = Scripted::default();
    let s = run(&[], &mut r).await.expect("summary");
    assert_eq!(s.chunks, 1);
    assert_eq!(r.sent.len(), 1);
}

/// The transcript a request carried, without the running summary it folded.
fn transcript(body: &[Value]) -> &str {
    let text = body[1]["content"].as_str().unwrap_or_default();
    text.split_once("=== Newer conversation ===\n")
        .map_or(text, |(_, newer)| newer)
}

#[tokio::test]
async fn a_previous_summary_that_fits_is_folded_as_the_running_summary() {
    let prompts = PromptConfig::default();
    let previous = "word ".repeat(1_000);
    let mut r = Scripted {
        window: window(8_192),
        ..Scripted::default()
    };
    let head = blocks(4, 1_000);
    let tokens = count_all(counter(), &head);
    let head_options = Options {
        previous_summary: Some(&previous),
        ..options(&prompts)
    };
    let s = summarize_blocks(&head, &tokens, head_options, &mut r)
        .await
        .expect("summary");
    assert_eq!((s.chunks, s.dropped_chars), (1, 0));
    let body = r.bodies[0][1]["content"].as_str().unwrap_or_default();
    assert!(
        body.starts_with(&format!(
            "=== Summary of the earlier conversation ===\n{previous}\n\n"
        )),
        "{}",
        &body[..80]
    );
    assert_eq!(tags(&r.bodies[0]), [0, 1, 2, 3]);
    let ask = r.bodies[0][2]["content"].as_str().unwrap_or_default();
    assert!(ask.contains(prompt::FOLD_INSTRUCTION));
}

#[tokio::test]
async fn a_previous_summary_too_long_for_the_window_is_summarized_as_the_oldest_text() {
    // 37,500 counted tokens of previous summary: more than an 8k window holds beside the
    // prompt and the answer, so as the running summary it left no room at all.
    let prompts = PromptConfig::default();
    let previous = "word ".repeat(30_000);
    let mut r = Scripted {
        window: window(8_192),
        ..Scripted::default()
    };
    let head = blocks(4, 1_000);
    let tokens = count_all(counter(), &head);
    let head_options = Options {
        previous_summary: Some(&previous),
        ..options(&prompts)
    };
    let s = summarize_blocks(&head, &tokens, head_options, &mut r)
        .await
        .expect("summary");
    assert_eq!(s.dropped_chars, 0, "nothing of it dropped");
    assert!(s.chunks > 1, "{}", s.chunks);
    assert_eq!(s.chunks as usize, r.sent.len());
    let budget = Budget::new(window(8_192).expect("window"));
    for sent in &r.sent {
        let max_tokens = sent.max_tokens.expect("sized");
        let counted = sent.counted.expect("counted");
        assert!(
            budget.endpoint_tokens(counted) + max_tokens <= 8_192,
            "prompt {counted} + answer {max_tokens} fit"
        );
    }
    // The first request opens with it as the conversation's oldest text, not as a
    // summary to fold; every word of it reaches a request once, before the head's
    // messages, which follow in order.
    let first = r.bodies[0][1]["content"].as_str().unwrap_or_default();
    assert!(
        first.starts_with("--- summary ---\nword word"),
        "{}",
        &first[..40]
    );
    let carried: String = r.bodies.iter().map(|b| transcript(b)).collect();
    assert_eq!(carried.matches("word").count(), 30_000);
    let head_at = carried.find("<0>").expect("the head was sent");
    assert!(carried[..head_at].ends_with("word \n\n"));
    let sent_tags: Vec<usize> = r.bodies.iter().flat_map(|b| tags(b)).collect();
    assert_eq!(sent_tags, [0, 1, 2, 3]);
    // Later requests fold the answers as usual; only the last is the summary.
    let second = r.bodies[1][1]["content"].as_str().unwrap_or_default();
    assert!(second.starts_with("=== Summary of the earlier conversation ===\nsummary 1"));
    assert_eq!(r.sent.iter().filter(|s| s.last).count(), 1);
    assert!(r.sent.last().expect("sent").last);
    assert_eq!(s.outcome.text, format!("summary {}", s.chunks));
}

#[test]
fn a_previous_summary_is_cut_into_pieces_no_chunk_is_too_small_for() {
    // Multi-byte text without spaces or line ends for long stretches (cut at character
    // boundaries), then words (cut after a space).
    let previous = format!("{}\n{}", "é".repeat(3_000), "mot ".repeat(2_000));
    let (pieces, tokens) = previous_blocks(&previous, counter());
    assert_eq!(
        pieces.concat(),
        format!("--- summary ---\n{previous}\n\n"),
        "nothing lost or reordered"
    );
    assert_eq!(tokens, count_all(counter(), &pieces));
    assert!(pieces.len() > 10, "{}", pieces.len());
    assert!(tokens.iter().all(|&t| t <= MIN_CHUNK_TOKENS), "{tokens:?}");
    assert!(
        pieces
            .iter()
            .rev()
            .skip(1)
            .take(5)
            .all(|p| p.ends_with(' '))
    );

    // A real tokenizer packs a run of spaces 128 to a token and numbers two bytes to one:
    // cut by the summary's average, the numbers would come in pieces of thousands.
    let o200k = Counting::O200k.counter();
    let numbers: String = (0..2_000)
        .map(|i| format!("{},", i * 7_919 % 100_003))
        .collect();
    let previous = format!("{}\n{numbers}", " ".repeat(200_000));
    let (pieces, tokens) = previous_blocks(&previous, o200k);
    assert_eq!(pieces.concat(), format!("--- summary ---\n{previous}\n\n"));
    assert!(tokens.iter().all(|&t| t <= MIN_CHUNK_TOKENS), "{tokens:?}");
    assert_eq!(tokens, count_all(o200k, &pieces));
}

/// Counts what is not blank, one token a character: text whose blank stretches are cheap
/// and whose end is dense, as padded output is.
#[derive(Debug)]
struct InkOnly;

impl TokenCounter for InkOnly {
    fn count(&self, text: &str) -> u64 {
        text.chars().filter(|c| !c.is_whitespace()).count() as u64
    }
    fn name(&self) -> &'static str {
        "ink"
    }
}

/// A block mostly blank with a dense end: cut in proportion to the whole, the newest part
/// still holds the whole dense end, and eight cuts by a quarter kept it over the room (the
/// same request refused again). It always fits now.
#[test]
fn the_newest_part_of_an_oversized_block_always_fits() {
    let block = format!("{}{}", " ".repeat(1_000_000), "x".repeat(300));
    let tokens = InkOnly.count(&block);
    for room in [100, 150, 299] {
        let (text, dropped, counted) = newest_part(&block, tokens, room, &InkOnly);
        assert!(counted <= room, "room {room}: {counted}");
        assert_eq!(counted, InkOnly.count(&text));
        assert!(
            dropped > 0 && text.ends_with('x'),
            "the newest text is kept"
        );
    }
}
