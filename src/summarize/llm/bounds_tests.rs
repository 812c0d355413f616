//! What an endpoint's answer may make compactd read and parse, over a real loopback
//! connection: the bounds of `bounded.rs` as the summarizer meets them.

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::summarize::bounded::{MAX_EVENT_BYTES, MAX_LINE_ENDS};
use crate::summarize::fake_endpoint::{Endpoint, config, json_response, request, sse};
use crate::summarize::{OpenAiSummarizer, SummarizeError, Summarizer};

/// What `summarizer` makes of one request.
async fn summarize(summarizer: &OpenAiSummarizer) -> Result<String, SummarizeError> {
    let (tx, _rx) = mpsc::channel(1024);
    summarizer
        .summarize(request(1_000, Some(100)), tx, CancellationToken::new())
        .await
        .map(|outcome| outcome.text)
}

/// A stream answering `body` is refused, not retryable, with a reason starting `why`, and
/// the same answer is not asked for again.
async fn assert_refused_once(body: Vec<u8>, why: String) {
    let endpoint = Endpoint::start(move |_, _| sse(&body)).await;
    let summarizer = OpenAiSummarizer::new(config(&endpoint, 2));
    match summarize(&summarizer).await {
        Err(SummarizeError::Request {
            message,
            retryable: false,
            ..
        }) if message.starts_with(&why) => {}
        other => panic!("{other:?}"),
    }
    assert_eq!(
        endpoint.received().len(),
        1,
        "the same answer is not asked again"
    );
}

/// One SSE event of short `data:` lines, each far under a line's bound, that the parser
/// would join into one JSON array past an event's bound (the review's 60 MiB of them became
/// gigabytes of `Value`s). Before, the meter passed it and async-openai parsed it whole.
#[tokio::test]
async fn one_event_of_many_short_lines_is_cut_at_its_bound() {
    let line = format!("data: {}\n", ",0".repeat(512));
    let mut body = b"data: [0\n".to_vec();
    while body.len() <= MAX_EVENT_BYTES + line.len() {
        body.extend_from_slice(line.as_bytes());
    }
    body.extend_from_slice(b"data: ]\n\n");
    let why = format!("an event of the endpoint's answer exceeded {MAX_EVENT_BYTES} bytes");
    assert_refused_once(body, why).await;
}

/// The one-token probe of an empty stream reads one JSON body parsed whole: a body of
/// numbers far past what one token needs is cut (before, it was read up to a stream's
/// 64 MiB), while one echoing the prompt (llama.cpp's `--verbose`) is read.
#[tokio::test]
async fn the_probes_answer_is_bounded_by_what_one_token_and_the_prompt_need() {
    let flood = format!(r#"{{"choices":[],"x":[{}0]}}"#, "0,".repeat(200_000));
    let endpoint = Endpoint::start(move |_, r| {
        if r.body["stream"] == true {
            sse(b"")
        } else {
            json_response(200, &flood)
        }
    })
    .await;
    let summarizer = OpenAiSummarizer::new(config(&endpoint, 0));
    // A probe that fails for no reason worth a retry leaves the empty stream unexplained:
    // "too long", nothing learned (`too_long.rs`).
    match summarize(&summarizer).await {
        Err(SummarizeError::TooLong(why)) if why.contains("the endpoint's answer exceeded") => {}
        other => panic!("{other:?}"),
    }
    assert_eq!(endpoint.received().len(), 2, "the stream and its probe");

    // A prompt of 200 KiB, echoed whole beside the answer's one token.
    let prompt = "word ".repeat(40_000);
    let echo = serde_json::json!({
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "A"},
                     "finish_reason": "length"}],
        "usage": {"prompt_tokens": 40_010, "completion_tokens": 1, "total_tokens": 40_011},
        "__verbose": {"prompt": prompt},
    })
    .to_string();
    let endpoint = Endpoint::start(move |_, r| {
        if r.body["stream"] == true {
            sse(b"")
        } else {
            json_response(200, &echo)
        }
    })
    .await;
    let summarizer = OpenAiSummarizer::new(config(&endpoint, 0));
    let mut long = request(40_000, Some(100));
    long.messages = vec![serde_json::json!({"role": "user", "content": prompt})];
    let (tx, _rx) = mpsc::channel(1024);
    let answered = summarizer
        .summarize(long, tx, CancellationToken::new())
        .await;
    // Read: the empty stream of a prompt that fits alone is "too long" (`too_long.rs`).
    assert!(
        matches!(&answered, Err(SummarizeError::TooLong(why)) if why.contains("though the prompt alone fits")),
        "{answered:?}"
    );
}

/// A stream of blank lines in reads as large as the transport makes them: each line is
/// empty and each event too, so only their count bounds it, and the parser, handed one line
/// at a time, never copies the rest of a read. Before, each line cost a copy of what
/// followed it in its read.
#[tokio::test]
async fn a_stream_of_blank_lines_fails_past_the_count_of_lines() {
    let body = "\n".repeat(MAX_LINE_ENDS + 1).into_bytes();
    let why = format!("the endpoint's answer exceeded {MAX_LINE_ENDS} lines");
    assert_refused_once(body, why).await;
}
