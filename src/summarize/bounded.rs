//! What compactd reads of an endpoint's response, bounded, in the HTTP layer under
//! async-openai (`retry_after.rs`). async-openai reads any non-2xx body whole, so the layer
//! reads an error's body first, at most [`ERROR_BODY_BYTES`] of it, and hands async-openai
//! a response it still reads the status and message of. An answer's body (2xx) passes
//! through [`guard`], which fails it past its limit ([`MAX_ANSWER_BYTES`] for a summary's
//! stream, [`PROBE_ANSWER_BYTES`] and the request's size for the probe's one JSON body),
//! past [`MAX_LINE_BYTES`] in one line, past [`MAX_EVENT_BYTES`] in one event, or past
//! [`MAX_LINE_ENDS`] lines, and hands it on one line at a time. What is not read never is:
//! the response is dropped, which closes the connection. How much summary text one request
//! may bring is `llm.rs`'s concern, how much of a message an error keeps `llm/errors.rs`'s.

use std::sync::{Arc, OnceLock};

use async_openai::error::OpenAIError;
use futures::StreamExt;
use futures::future::Either;
use prost::bytes::Bytes;
use reqwest::header::{CONTENT_ENCODING, CONTENT_LENGTH, TRANSFER_ENCODING};

/// The most compactd reads of an error body: any JSON error a server sends fits many times
/// over (OpenAI's and llama.cpp's, numbers included, are under 1 KiB), and a proxy's 50 MB
/// error page costs 64 KiB. Larger than the message an error keeps, so the cut made here
/// (before the key is redacted) never shows.
pub(super) const ERROR_BODY_BYTES: usize = 64 * 1024;

/// The most compactd reads of a summary's stream. async-openai reads a stream ahead of compactd into an unbounded queue, so while a caller
/// is slow to take the summary's deltas the queue holds whatever the endpoint sends; and an
/// event that never ends grows across its lines. 64 MiB holds a stream of over 100,000
/// tokens at the 500 bytes of SSE the wordiest servers spend on one, more than any model
/// writes in one answer.
pub(super) const MAX_ANSWER_BYTES: usize = 64 * 1024 * 1024;

/// The longest line of an answer across reads. async-openai's SSE parser keeps an unfinished
/// line and scans all of it again on every read, so one endless line costs memory and
/// quadratic time. A chunk of a stream is one line of a few hundred bytes; 1 MiB holds a
/// quarter of a million tokens' text in one chunk.
pub(super) const MAX_LINE_BYTES: usize = 1024 * 1024;

/// The largest event of an answer, from its first line to the blank line that ends it.
/// The SSE parser joins an event's `data:` lines into one text, which async-openai parses
/// as JSON whole: short lines that each pass [`MAX_LINE_BYTES`] would otherwise make one
/// event of the whole answer, parsed at once into a tree many times its size (`0,` is two
/// bytes, its `serde_json::Value` 72: 60 MiB of them, over 2 GB). A real event is one chunk
/// of a few hundred bytes; 1 MiB, as for a line, holds a quarter of a million tokens' text.
pub(super) const MAX_EVENT_BYTES: usize = 1024 * 1024;

/// The most line ends an answer may have. The SSE parser (eventsource-stream 0.2.3's
/// `parse_event`) takes each line by copying what follows it in its buffer, so one read of
/// many short lines costs the square of its length; [`guard`] hands it one line at a time,
/// which leaves nothing to copy but costs a few allocations a line. A stream of 128K tokens,
/// more than any model writes in one answer, is one event per token of two to four lines
/// (`data:`, maybe `event:` and `id:`, and the blank line): 1 Mi line ends is twice that,
/// and at the 130 bytes or more a chunk takes in OpenAI's shape, more lines than
/// [`MAX_ANSWER_BYTES`] holds.
pub(super) const MAX_LINE_ENDS: usize = 1 << 20;

/// The most compactd reads of the probe's answer (`llm/too_long.rs`) beside the size of the
/// probe itself: one JSON body, read whole and parsed at once, for one token, which any
/// server writes in a few KiB. The probe's size is allowed on top because a server may echo
/// the prompt (llama.cpp's server run with `--verbose` adds it under `__verbose`).
pub(super) const PROBE_ANSWER_BYTES: usize = 64 * 1024;

/// `response` (a success) whose body fails once it passes `limit` bytes, a line of it
/// [`MAX_LINE_BYTES`], an event [`MAX_EVENT_BYTES`] or its lines [`MAX_LINE_ENDS`]; why goes
/// to `cut`, as async-openai's stream error says only that the body failed. The failure ends
/// async-openai's reading task, which drops the response. What it reads is handed on cut
/// after each line end ([`lines`]), so the SSE parser never copies what follows a line.
pub(super) fn guard(
    response: reqwest::Response,
    cut: Option<Arc<OnceLock<String>>>,
    limit: usize,
) -> reqwest::Response {
    let status = response.status();
    let version = response.version();
    let headers = response.headers().clone();
    let body = response
        .bytes_stream()
        .scan(Meter::new(limit), move |meter, chunk| {
            let item = match chunk {
                // Fused: once over, nothing more is read.
                _ if meter.over => None,
                Err(e) => Some(Err(BoxError::from(e))),
                Ok(bytes) => Some(match meter.admit(&bytes) {
                    Ok(()) => Ok(bytes),
                    Err(why) => {
                        if let Some(cut) = &cut {
                            let _ = cut.set(why.clone());
                        }
                        Err(BoxError::from(why))
                    }
                }),
            };
            std::future::ready(item)
        })
        .flat_map(|item| match item {
            Ok(read) => Either::Left(futures::stream::iter(lines(read).map(Ok))),
            Err(e) => Either::Right(futures::stream::iter([Err(e)])),
        });
    let mut rebuilt = http::Response::new(reqwest::Body::wrap_stream(body));
    *rebuilt.status_mut() = status;
    *rebuilt.version_mut() = version;
    *rebuilt.headers_mut() = headers;
    reqwest::Response::from(rebuilt)
}

/// `response` (not a success) with its body read, at most [`ERROR_BODY_BYTES`] of it. A
/// longer body is replaced by its start, marked as cut, in the form async-openai expects
/// of the status: the text as it is for a server error (async-openai does not parse
/// those), an OpenAI error object otherwise (a cut JSON body would not parse, and the
/// status would be lost). A whole client error's body is made one async-openai reads
/// ([`readable_error`]).
pub(super) async fn read_error(
    mut response: reqwest::Response,
) -> Result<reqwest::Response, OpenAIError> {
    let status = response.status();
    let version = response.version();
    let mut headers = response.headers().clone();
    let (kept, whole) = read_at_most(&mut response, ERROR_BODY_BYTES).await?;
    drop(response);
    let body = if !whole {
        cut_error_body(status, &kept)
    } else if status.is_client_error() {
        readable_error(&kept)
    } else {
        kept
    };
    // The body is read (and decoded) already; what the headers said of it no longer holds.
    for name in [CONTENT_LENGTH, TRANSFER_ENCODING, CONTENT_ENCODING] {
        headers.remove(name);
    }
    let mut rebuilt = http::Response::new(reqwest::Body::from(body));
    *rebuilt.status_mut() = status;
    *rebuilt.version_mut() = version;
    *rebuilt.headers_mut() = headers;
    Ok(reqwest::Response::from(rebuilt))
}

/// The first `limit` bytes of `response`'s body, and whether that is all of it. Stops
/// reading once past the limit.
async fn read_at_most(
    response: &mut reqwest::Response,
    limit: usize,
) -> Result<(Vec<u8>, bool), OpenAIError> {
    let mut kept = Vec::new();
    while let Some(chunk) = response.chunk().await.map_err(OpenAIError::Reqwest)? {
        let room = limit.saturating_sub(kept.len());
        if chunk.len() > room {
            kept.extend_from_slice(&chunk[..room]);
            return Ok((kept, false));
        }
        kept.extend_from_slice(&chunk);
    }
    Ok((kept, true))
}

/// A 4xx `body` in the one shape async-openai reads, OpenAI's error object with text
/// fields: as it is when it is one. async-openai fails on any other, reporting a malformed
/// answer and losing the status and the endpoint's words (a 429 would not be retried, a
/// refusal of `max_tokens` not read). llama.cpp's server sends its `code` as a number
/// (`{"error":{"code":401,"message":"Invalid API Key","type":"authentication_error"}}`):
/// such an object's fields become text, its message the body when it has none as text, and
/// llama.cpp's numbers of a refusal for length (`n_prompt_tokens`, `n_ctx`, read in
/// `window.rs`) go into the message. A body of another shape (a gateway's JSON, an HTML
/// page, plain text) becomes the message of one ([`error_object`]).
fn readable_error(body: &[u8]) -> Vec<u8> {
    use serde_json::Value;
    if serde_json::from_slice::<async_openai::error::WrappedError>(body).is_ok() {
        return body.to_vec();
    }
    let text = String::from_utf8_lossy(body);
    let Ok(Value::Object(mut whole)) = serde_json::from_slice::<Value>(body) else {
        return error_object(&text);
    };
    let Some(Value::Object(error)) = whole.remove("error") else {
        return error_object(&text);
    };
    let mut message = match error.get("message") {
        Some(Value::String(message)) => message.clone(),
        _ => text.into_owned(),
    };
    let numbers: serde_json::Map<String, Value> = ["n_prompt_tokens", "n_ctx"]
        .into_iter()
        .filter_map(|k| {
            error
                .get(k)
                .and_then(Value::as_u64)
                .map(|n| (k.into(), n.into()))
        })
        .collect();
    if !numbers.is_empty() {
        message.push(' ');
        message.push_str(&Value::Object(numbers).to_string());
    }
    let as_text = |field: &str| match error.get(field) {
        None | Some(Value::Null) => Value::Null,
        Some(Value::String(s)) => Value::String(s.clone()),
        Some(other) => Value::String(other.to_string()),
    };
    serde_json::json!({ "error": {
        "message": message,
        "type": as_text("type"),
        "param": as_text("param"),
        "code": as_text("code"),
    }})
    .to_string()
    .into_bytes()
}

/// `{"error":{"message": text}}`: how a 4xx body of another shape (a gateway's JSON, an
/// HTML page, plain text) reaches async-openai, which otherwise fails to parse it and
/// loses the status (a 429 would read as a malformed answer, and not be retried).
fn error_object(text: &str) -> Vec<u8> {
    serde_json::json!({ "error": { "message": text } })
        .to_string()
        .into_bytes()
}

/// The body standing in for an error body cut at `kept`: its text (lossy UTF-8) after a
/// note, as text for a server error and inside `{"error":{"message":…}}` otherwise. The
/// note goes first so it survives the cut of the message (`llm/errors.rs`).
fn cut_error_body(status: reqwest::StatusCode, kept: &[u8]) -> Vec<u8> {
    let text = format!(
        "[the error body is over {ERROR_BODY_BYTES} bytes; compactd read no more] {}",
        String::from_utf8_lossy(kept)
    );
    if status.is_server_error() {
        return text.into_bytes();
    }
    error_object(&text)
}

/// `read` cut after each line end (CR, LF, or CRLF whole), the line still open last. Each
/// cut is O(1) (`Bytes::split_to` shares the read's buffer).
fn lines(mut read: Bytes) -> impl Iterator<Item = Bytes> {
    std::iter::from_fn(move || {
        if read.is_empty() {
            return None;
        }
        let end = match read.iter().position(|b| *b == b'\n' || *b == b'\r') {
            Some(at) if read.get(at..at.saturating_add(2)) == Some(b"\r\n") => at.saturating_add(2),
            Some(at) => at.saturating_add(1),
            None => read.len(),
        };
        Some(read.split_to(end))
    })
}

/// A body's error, as reqwest takes it.
type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Counts an answer's body as it arrives.
#[derive(Debug)]
struct Meter {
    /// The most bytes the answer may have.
    limit: usize,
    /// The most bytes of one line ([`MAX_LINE_BYTES`], or `limit` for one body).
    line_limit: usize,
    /// The most bytes of one event ([`MAX_EVENT_BYTES`], or `limit` for one body).
    event_limit: usize,
    /// Bytes so far.
    total: usize,
    /// Bytes of the line still open at the end of the last read.
    open_line: usize,
    /// Bytes of the event still open (since the last blank line), line ends aside.
    open_event: usize,
    /// Line ends so far (a CRLF is one).
    line_ends: usize,
    /// The last byte read was a CR: a LF right after it ends the same line.
    after_cr: bool,
    /// A limit was passed: nothing more is read.
    over: bool,
}

impl Meter {
    /// A meter of an answer of at most `limit` bytes. An answer smaller than a stream's
    /// (the probe's one JSON body, `limit` allowing for a prompt echoed back) is one line
    /// and one event: those bounds rise to `limit` with it.
    fn new(limit: usize) -> Meter {
        let one_body = if limit < MAX_ANSWER_BYTES { limit } else { 0 };
        Meter {
            limit,
            line_limit: MAX_LINE_BYTES.max(one_body),
            event_limit: MAX_EVENT_BYTES.max(one_body),
            total: 0,
            open_line: 0,
            open_event: 0,
            line_ends: 0,
            after_cr: false,
            over: false,
        }
    }

    /// Counts `chunk`; why it is one too many when the answer, a line, an event (across
    /// reads or within one) or the count of lines is now past its limit.
    fn admit(&mut self, chunk: &[u8]) -> Result<(), String> {
        self.total = self.total.saturating_add(chunk.len());
        let why = if self.total > self.limit {
            Some(format!(
                "the endpoint's answer exceeded {} bytes",
                self.limit
            ))
        } else {
            chunk.iter().find_map(|&b| self.step(b))
        };
        let Some(why) = why else { return Ok(()) };
        self.over = true;
        Err(format!("{why}; compactd stopped reading it"))
    }

    /// Counts one byte; which limit it passed, if any.
    fn step(&mut self, b: u8) -> Option<String> {
        let lf_of_crlf = b == b'\n' && self.after_cr;
        self.after_cr = b == b'\r';
        if lf_of_crlf {
            return None;
        }
        if b == b'\n' || b == b'\r' {
            // A blank line ends the event.
            if self.open_line == 0 {
                self.open_event = 0;
            }
            self.open_line = 0;
            self.line_ends = self.line_ends.saturating_add(1);
            return (self.line_ends > MAX_LINE_ENDS).then(|| {
                format!(
                    "the endpoint's answer exceeded {MAX_LINE_ENDS} lines (no stream has that many)"
                )
            });
        }
        self.open_line = self.open_line.saturating_add(1);
        self.open_event = self.open_event.saturating_add(1);
        if self.open_line > self.line_limit {
            return Some(format!(
                "a line of the endpoint's answer exceeded {} bytes",
                self.line_limit
            ));
        }
        if self.open_event > self.event_limit {
            return Some(format!(
                "an event of the endpoint's answer exceeded {} bytes (no \
                 stream's chunk is that large)",
                self.event_limit
            ));
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds `read` to `meter` again and again until it refuses, within `at_most` bytes:
    /// why it refused.
    fn admitted_until_over(meter: &mut Meter, read: &str, at_most: usize) -> String {
        let mut fed = 0usize;
        loop {
            if let Err(why) = meter.admit(read.as_bytes()) {
                return why;
            }
            fed += read.len();
            assert!(fed <= at_most, "the bound was not applied");
        }
    }

    /// The probe's one JSON body may be one line as long as its limit (a server echoing a
    /// prompt of over 1 MiB back): its line and event bounds rise with it. Found in review:
    /// the stream's 1 MiB bounds cut such a probe, though its own limit allowed it.
    #[test]
    fn one_body_within_its_limit_is_not_cut_as_a_line_or_an_event() {
        let limit = PROBE_ANSWER_BYTES + 3 * MAX_LINE_BYTES;
        let mut probe = Meter::new(limit);
        assert_eq!(probe.admit(&vec![b'x'; 2 * MAX_LINE_BYTES]), Ok(()));
        assert!(
            probe.admit(&vec![b'x'; 2 * MAX_LINE_BYTES]).is_err(),
            "past its limit"
        );
        let mut stream = Meter::new(MAX_ANSWER_BYTES);
        assert!(
            stream.admit(&vec![b'x'; 2 * MAX_LINE_BYTES]).is_err(),
            "a stream's line"
        );
    }
    use reqwest::StatusCode;

    #[test]
    fn a_cut_server_error_stays_text_and_a_cut_client_error_stays_an_error_object() {
        let kept = br#"{"error":{"message":"upstream failed: xxxx"#;
        let note =
            format!("[the error body is over {ERROR_BODY_BYTES} bytes; compactd read no more] ");

        let text = cut_error_body(StatusCode::BAD_GATEWAY, kept);
        assert_eq!(
            String::from_utf8_lossy(&text),
            format!("{note}{}", String::from_utf8_lossy(kept))
        );

        let json = cut_error_body(StatusCode::BAD_REQUEST, kept);
        let parsed: async_openai::error::ApiError =
            serde_json::from_slice::<serde_json::Value>(&json)
                .ok()
                .and_then(|v| serde_json::from_value(v["error"].clone()).ok())
                .unwrap_or_default();
        assert_eq!(
            parsed.message,
            format!("{note}{}", String::from_utf8_lossy(kept))
        );
    }

    #[test]
    fn a_line_that_spans_reads_is_measured_across_them() {
        let mut meter = Meter::new(MAX_ANSWER_BYTES);
        let half = vec![b'x'; MAX_LINE_BYTES / 2 + 1];
        assert_eq!(meter.admit(&half), Ok(()));
        // A line that ends in this read, longer than the limit with the last one.
        let mut ending = half.clone();
        ending.extend_from_slice(b"\n\ndata: {");
        assert_eq!(
            meter.admit(&ending),
            Err(format!(
                "a line of the endpoint's answer exceeded {MAX_LINE_BYTES} bytes; compactd stopped reading it"
            ))
        );
        assert!(meter.over);

        // Lines that end keep the count low, whatever the total.
        let mut meter = Meter::new(MAX_ANSWER_BYTES);
        let frame = b"data: {\"choices\":[]}\r\n\r\n".repeat(1_000);
        for _ in 0..100 {
            assert_eq!(meter.admit(&frame), Ok(()));
        }
        assert_eq!(meter.open_line, 0);
    }

    #[test]
    fn an_answer_past_its_limit_is_over() {
        let mut meter = Meter::new(MAX_ANSWER_BYTES);
        let event = format!("data: {{\"x\":\"{}\"}}\n\n", "x".repeat(1_000));
        let read = event.repeat(MAX_ANSWER_BYTES / event.len() / 64);
        let mut reads = 0;
        let why = loop {
            if let Err(why) = meter.admit(read.as_bytes()) {
                break why;
            }
            reads += 1;
            assert!(reads <= 65, "the limit was never reached");
        };
        assert!(
            why.starts_with(&format!(
                "the endpoint's answer exceeded {MAX_ANSWER_BYTES} bytes"
            )),
            "{why}"
        );
        assert!(meter.total > MAX_ANSWER_BYTES);
    }

    /// The SSE parser joins an event's lines into one text parsed whole: an event of short
    /// lines is measured until the blank line that ends it, across reads, whatever its
    /// line ends; events that end stay small whatever the answer's total.
    #[test]
    fn an_event_is_measured_to_the_blank_line_that_ends_it() {
        let line = format!("data: {}\n", ",0".repeat(500));
        let read = line.repeat(64);
        let mut meter = Meter::new(MAX_ANSWER_BYTES);
        let why = admitted_until_over(&mut meter, &read, 2 * MAX_EVENT_BYTES);
        assert_eq!(
            why,
            format!(
                "an event of the endpoint's answer exceeded {MAX_EVENT_BYTES} bytes (no \
                 stream's chunk is that large); compactd stopped reading it"
            )
        );
        assert!(meter.open_line < MAX_LINE_BYTES);

        for eol in ["\n", "\r\n", "\r"] {
            // Events of half the bound, one after the other.
            let mut meter = Meter::new(MAX_ANSWER_BYTES);
            let lines = format!("{}{eol}", line.trim_end()).repeat(500);
            let event = format!("{lines}{eol}");
            for _ in 0..8 {
                assert_eq!(meter.admit(event.as_bytes()), Ok(()), "{eol:?}");
            }
            assert_eq!(meter.open_event, 0, "{eol:?}");
        }
        // A CRLF split across reads ends one line, not two (no blank line between them).
        let mut meter = Meter::new(MAX_ANSWER_BYTES);
        assert_eq!(meter.admit(b"data: 1\r"), Ok(()));
        assert_eq!(meter.admit(b"\ndata: 2\r\n"), Ok(()));
        assert_eq!(meter.open_event, 14);
    }

    /// The SSE parser copies what follows each line in its buffer, so what the guard hands
    /// on is cut after each line end: nothing follows. Before, a read of many lines went
    /// on whole, and each of its lines cost a copy of the rest.
    #[tokio::test]
    async fn what_the_guard_hands_on_ends_at_each_line_end() {
        let read = format!(
            "{}{}\rdata: {{\"open",
            "data: {}\r\n\r\n".repeat(100),
            "\n".repeat(10_000)
        );
        let response = http::Response::new(reqwest::Body::from(read.clone()));
        let guarded = guard(reqwest::Response::from(response), None, MAX_ANSWER_BYTES);
        let mut body = guarded.bytes_stream();
        let mut pieces = Vec::new();
        while let Some(piece) = body.next().await {
            pieces.push(piece.unwrap_or_default());
        }
        assert_eq!(pieces.concat(), read.as_bytes());
        assert_eq!(pieces.len(), 200 + 10_000 + 2);
        let (open, ended) = pieces.split_last().unwrap_or_else(|| panic!("no piece"));
        assert_eq!(&open[..], b"data: {\"open");
        for piece in ended {
            let ends = piece
                .iter()
                .filter(|b| **b == b'\n' || **b == b'\r')
                .count();
            let whole = piece.ends_with(b"\r\n") && ends == 2;
            assert!(
                whole || (ends == 1 && lines(piece.clone()).count() == 1),
                "{piece:?}"
            );
        }
    }

    #[test]
    fn an_answer_of_too_many_lines_is_over() {
        let mut meter = Meter::new(MAX_ANSWER_BYTES);
        let read = "\n".repeat(64 * 1024);
        let why = admitted_until_over(&mut meter, &read, MAX_LINE_ENDS);
        assert_eq!(
            why,
            format!(
                "the endpoint's answer exceeded {MAX_LINE_ENDS} lines (no stream has that \
                 many); compactd stopped reading it"
            )
        );
        // A CRLF is one line end, even split across reads.
        let mut meter = Meter::new(MAX_ANSWER_BYTES);
        assert_eq!(meter.admit(b"data: {}\r\n\r"), Ok(()));
        assert_eq!(meter.admit(b"\n"), Ok(()));
        assert_eq!(meter.line_ends, 2);
    }

    /// What async-openai reads of a 4xx body once it is made readable.
    fn read(body: &str) -> async_openai::error::ApiError {
        let readable = readable_error(body.as_bytes());
        serde_json::from_slice::<async_openai::error::WrappedError>(&readable)
            .map(|w| w.error)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&readable)))
    }

    /// llama.cpp's error objects carry a numeric `code`, which async-openai cannot read:
    /// its fields become text, the message stays the endpoint's words (the body when it has
    /// none as text), and a refusal's numbers join the message. OpenAI's stays as it is.
    #[test]
    fn a_client_errors_body_is_made_one_async_openai_reads() {
        let openai = r#"{"error":{"message":"Incorrect API key provided","type":"invalid_request_error","param":null,"code":"invalid_api_key"}}"#;
        assert_eq!(readable_error(openai.as_bytes()), openai.as_bytes());

        let llama = read(
            r#"{"error":{"code":401,"message":"Invalid API Key","type":"authentication_error"}}"#,
        );
        assert_eq!(llama.message, "Invalid API Key");
        assert_eq!(llama.code.as_deref(), Some("401"));
        assert_eq!(llama.r#type.as_deref(), Some("authentication_error"));

        let refusal = read(
            r#"{"error":{"code":400,"message":"the request exceeds the available context size, try increasing it","type":"exceed_context_size_error","n_prompt_tokens":9100,"n_ctx":8192}}"#,
        );
        assert_eq!(
            refusal.message,
            r#"the request exceeds the available context size, try increasing it {"n_prompt_tokens":9100,"n_ctx":8192}"#
        );

        let no_message = r#"{"error":{"code":404,"detail":{"model":"gone"}}}"#;
        assert_eq!(read(no_message).message, no_message);
        let numeric_message = r#"{"error":{"message":7,"param":["a"]}}"#;
        let odd = read(numeric_message);
        assert_eq!(odd.message, numeric_message);
        assert_eq!(odd.param.as_deref(), Some(r#"["a"]"#));
        assert_eq!(
            read("<html>Forbidden</html>").message,
            "<html>Forbidden</html>"
        );
        assert_eq!(
            read(r#"{"error":"denied"}"#).message,
            r#"{"error":"denied"}"#
        );
    }
}
