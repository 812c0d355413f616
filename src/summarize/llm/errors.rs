//! Client errors as [`SummarizeError`]s: which are worth a retry, which are a refusal for
//! length (in any server's wording, including llama.cpp's, whose 4xx body `bounded.rs`
//! makes readable, and llama.cpp's 500 "Context size has been exceeded"), and the chain of
//! causes a transport error carries.

use async_openai::error::OpenAIError;

use crate::summarize::SummarizeError;
use crate::summarize::window;

/// The most of an endpoint's text an error keeps: ample for any real error message and the
/// start of an HTML error page. An endpoint's error body may be any size (a proxy's 502
/// page, a stack trace), and the text goes to a log line, to every `retrying` event and to
/// the failure's reason, which clients decode under a 4 MiB message limit by default.
pub(super) const MAX_MESSAGE_BYTES: usize = 4 * 1024;

/// Maps a client error; `started` tells whether summary text had arrived.
pub(super) fn request_error(e: OpenAIError, started: bool) -> SummarizeError {
    match e {
        OpenAIError::ApiError(r) => {
            let status = r.status_code.as_u16();
            if let Some(why) = refusal(status, &r.api_error) {
                return SummarizeError::TooLong(why);
            }
            // A billing failure: the same request fails until someone pays.
            let quota = [&r.api_error.code, &r.api_error.r#type]
                .iter()
                .any(|v| v.as_deref() == Some("insufficient_quota"));
            SummarizeError::Request {
                status: Some(status),
                message: format!("{status}: {}", r.api_error.message),
                retryable: (status == 429 && !quota) || status >= 500,
            }
        }
        OpenAIError::Reqwest(e) if started => SummarizeError::Broken(chain(e.without_url())),
        OpenAIError::Reqwest(e) => SummarizeError::Request {
            status: e.status().map(|s| s.as_u16()),
            retryable: e.is_connect()
                || e.is_timeout()
                || e.is_request()
                || e.status()
                    .is_some_and(|s| s.as_u16() == 429 || s.is_server_error()),
            message: chain(e.without_url()),
        },
        OpenAIError::StreamError(e) if started => SummarizeError::Broken(e.to_string()),
        OpenAIError::StreamError(e) => SummarizeError::Request {
            status: None,
            message: e.to_string(),
            retryable: true,
        },
        // Once text arrived, a line that is no chunk ends the stream broken whatever it
        // says: read as "too long", the head would be cut again after the answer's deltas
        // went out, with nothing to say they are void.
        OpenAIError::JSONDeserialize(e, _) if started => {
            SummarizeError::Broken(format!("a line of the stream is no chunk: {e}"))
        }
        // A line of the stream (or the probe's body) that is no JSON, before the answer
        // began, and says the request is too long: a server that writes its refusal as
        // text. (llama.cpp's 4xx error objects are made readable in `bounded.rs`.)
        OpenAIError::JSONDeserialize(_, body) if window::reads_too_long(&body) => {
            SummarizeError::TooLong(refusal_text(&body))
        }
        OpenAIError::JSONDeserialize(e, _) => SummarizeError::Malformed(e.to_string()),
        other => SummarizeError::Request {
            status: None,
            message: other.to_string(),
            retryable: false,
        },
    }
}

/// Whether `e` failed a request before any response came: its connection could not be
/// made, or it closed (or was reset) before a response's head, as a pooled connection the
/// server had closed does. Such a request was never answered, so sending it again asks
/// nothing twice. Not a response whose body broke or ran past its bound (a response
/// came: the endpoint read the request), nor a timeout.
pub(super) fn unanswered(e: &OpenAIError) -> bool {
    matches!(e, OpenAIError::Reqwest(e)
        if e.status().is_none() && !e.is_timeout() && (e.is_connect() || e.is_request()))
}

/// The failure an error chunk in the middle of a stream reports (`{"error": {...}}`, as
/// OpenAI, vLLM and SGLang send): a refusal for length in any server's wording; once text
/// arrived, a broken stream; before, a failed request worth a retry (the endpoint failed
/// while answering), unless it calls the request invalid.
pub(super) fn stream_error(error: &serde_json::Value, started: bool) -> SummarizeError {
    // Cut to size by `scrub`, after the key is redacted.
    let message = error["message"]
        .as_str()
        .unwrap_or("the endpoint sent an error in the stream")
        .to_string();
    if started {
        return SummarizeError::Broken(message);
    }
    if window::reads_too_long(&message) {
        return SummarizeError::TooLong(message);
    }
    SummarizeError::Request {
        status: None,
        retryable: error["type"] != "invalid_request_error",
        message,
    }
}

/// The endpoint's words when `status` and `e` refuse the request because it does not fit
/// the model's window: any 413, a 400 with OpenAI's `context_length_exceeded` or the wording
/// other servers use, a 429 for a request past the tokens a minute allows (no window, but
/// only a smaller request passes it), or a 5xx that says so plainly (some llama.cpp builds
/// answer a prompt too long with 500 "Context size has been exceeded.";
/// ggml-org/llama.cpp#19774).
fn refusal(status: u16, e: &async_openai::error::ApiError) -> Option<String> {
    match status {
        // "Payload too large", in any words: a proxy's body limit (nginx's default is
        // 1 MB) is a window like the model's, and a smaller request passes it.
        413 => Some(e.message.clone()),
        // TGI refuses with 422 (a validation error).
        400 | 422
            if e.code.as_deref() == Some("context_length_exceeded")
                || e.r#type.as_deref() == Some("exceed_context_size_error")
                || window::reads_too_long(&e.message) =>
        {
            Some(e.message.clone())
        }
        // A request larger than the tokens per minute the account may send: no wait lets
        // it pass, a smaller one does (a plain rate limit stays a retry).
        429 if window::rate_limit_ceiling(&e.message).is_some() => Some(e.message.clone()),
        // async-openai does not parse a 5xx body: the message is the body itself.
        500..=599 if server_says_too_long(&e.message) => Some(refusal_text(&e.message)),
        _ => None,
    }
}

/// Whether a 5xx `body` is a refusal for length. Stricter than a 400's reading, since a
/// server error may mention the context for other reasons ("failed to allocate the context
/// size"): the error's type or code names the refusal, or its message both names the
/// context and says it was exceeded.
fn server_says_too_long(body: &str) -> bool {
    let Ok(v) = serde_json::from_str::<serde_json::Value>(body) else {
        return says_exceeded(body);
    };
    let error = &v["error"];
    if !error.is_object() {
        return says_exceeded(body);
    }
    error["type"] == "exceed_context_size_error"
        || error["code"] == "context_length_exceeded"
        || error["message"].as_str().is_some_and(says_exceeded)
}

/// `text` names the context (window, length, size) and says it was exceeded.
fn says_exceeded(text: &str) -> bool {
    text.to_ascii_lowercase().contains("exceed") && window::reads_too_long(text)
}

/// The message of a raw error body, with llama.cpp's numbers (`n_prompt_tokens`, `n_ctx`)
/// kept beside it when the message does not spell them out; the body itself when it is
/// not JSON. Not cut here: `scrub` cuts it after the key is redacted (a cut first could
/// leave part of the key behind), and the body is bounded as it is read.
fn refusal_text(body: &str) -> String {
    let Ok(v) = serde_json::from_str::<serde_json::Value>(body) else {
        return body.to_string();
    };
    let error = &v["error"];
    let mut text: String = error["message"]
        .as_str()
        .unwrap_or("the request exceeds the model's context")
        .to_string();
    let numbers: serde_json::Map<String, serde_json::Value> = ["n_prompt_tokens", "n_ctx"]
        .into_iter()
        .filter_map(|k| error[k].as_u64().map(|n| (k.to_string(), n.into())))
        .collect();
    if !numbers.is_empty() {
        text.push(' ');
        text.push_str(&serde_json::Value::Object(numbers).to_string());
    }
    text
}

/// `message` cut to [`MAX_MESSAGE_BYTES`] on a character boundary, with a note saying so;
/// unchanged when it fits (so cutting twice changes nothing). Cut after the key is
/// redacted, so no cut can leave part of the key behind.
pub(super) fn bounded(message: String) -> String {
    if message.len() <= MAX_MESSAGE_BYTES {
        return message;
    }
    let total = message.len();
    // The note's longest form; the kept part is never longer than the bound, so the note
    // written is never longer than this.
    let room = format!("… (cut at {MAX_MESSAGE_BYTES} of {total} bytes)").len();
    let kept = floor_char_boundary(&message, MAX_MESSAGE_BYTES.saturating_sub(room));
    format!("{}… (cut at {kept} of {total} bytes)", &message[..kept])
}

/// The largest character boundary of `s` at or below `at` (`str::floor_char_boundary` is
/// newer than the crate's minimum Rust).
fn floor_char_boundary(s: &str, at: usize) -> usize {
    let mut i = at.min(s.len());
    while !s.is_char_boundary(i) {
        i = i.saturating_sub(1);
    }
    i
}

/// An error with its causes ("error sending request: connection refused"), so the event
/// says what actually failed.
pub(super) fn chain(e: impl std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        out.push_str(": ");
        out.push_str(&cause.to_string());
        source = cause.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn llama_cpp_refusal_bodies_keep_their_numbers() {
        let body = r#"{"error":{"code":400,"message":"the request exceeds the available context size, try increasing it","type":"exceed_context_size_error","n_prompt_tokens":9100,"n_ctx":8192}}"#;
        let text = refusal_text(body);
        assert_eq!(
            text,
            r#"the request exceeds the available context size, try increasing it {"n_prompt_tokens":9100,"n_ctx":8192}"#
        );
        assert_eq!(
            window::refusal(&text),
            window::Refusal {
                window: Some(8_192),
                prompt_tokens: Some(9_100),
                ceiling: None
            }
        );
        assert_eq!(refusal_text("not json"), "not json");
    }

    /// How `body` sent with `status` maps, as async-openai hands it over (a 5xx body as the
    /// message itself, a 4xx body parsed).
    fn check(status: u16, body: &str, too_long: bool) {
        let api_error = if status >= 500 {
            async_openai::error::ApiError {
                message: body.to_string(),
                ..Default::default()
            }
        } else {
            serde_json::from_str::<serde_json::Value>(body)
                .ok()
                .and_then(|v| serde_json::from_value(v["error"].clone()).ok())
                .unwrap_or_default()
        };
        let e = OpenAIError::ApiError(async_openai::error::ApiErrorResponse {
            status_code: reqwest::StatusCode::from_u16(status).unwrap_or_default(),
            api_error,
        });
        let mapped = request_error(e, false);
        assert_eq!(
            matches!(mapped, SummarizeError::TooLong(_)),
            too_long,
            "{status} {body}: {mapped:?}"
        );
        if !too_long {
            assert!(matches!(
                mapped,
                SummarizeError::Request { status: Some(s), .. } if s == status
            ));
        }
    }

    #[test]
    fn a_line_that_is_no_chunk_is_too_long_only_before_the_answer_began() {
        let line = "Error: context length exceeded";
        let unreadable = || {
            let e = serde_json::from_str::<serde_json::Value>(line)
                .err()
                .map(|e| OpenAIError::JSONDeserialize(e, line.to_string()));
            e.expect("not JSON")
        };
        assert!(matches!(
            request_error(unreadable(), false),
            SummarizeError::TooLong(_)
        ));
        assert!(matches!(
            request_error(unreadable(), true),
            SummarizeError::Broken(_)
        ));
    }

    #[test]
    fn long_messages_are_cut_on_a_character_boundary_once() {
        assert_eq!(bounded("short".to_string()), "short");
        let fits = "x".repeat(MAX_MESSAGE_BYTES);
        assert_eq!(bounded(fits.clone()), fits);

        // Three-byte characters, so the cut must step back to a boundary.
        let long = "€".repeat(50_000);
        let cut = bounded(long.clone());
        assert!(cut.len() <= MAX_MESSAGE_BYTES, "{}", cut.len());
        assert!(
            cut.ends_with(&format!(" of {} bytes)", long.len())),
            "{cut}"
        );
        let (head, _) = cut.split_once('…').unwrap_or_default();
        assert!(long.starts_with(head) && head.len() > MAX_MESSAGE_BYTES / 2);
        assert_eq!(
            bounded(cut.clone()),
            cut,
            "a bounded message stays as it is"
        );
    }

    #[test]
    fn a_server_error_that_says_the_context_was_exceeded_is_too_long() {
        // ggml-org/llama.cpp#19774: the same server answers 500 or 400.
        check(
            500,
            r#"{"error":{"code":500,"message":"Context size has been exceeded.","type":"server_error"}}"#,
            true,
        );
        check(
            500,
            r#"{"error":{"code":500,"message":"the request exceeds the available context size. try increasing the context size or enable context shift","type":"exceed_context_size_error","n_prompt_tokens":1407,"n_ctx":256}}"#,
            true,
        );
        check(503, "Context size has been exceeded.", true);
        check(
            400,
            r#"{"error":{"message":"This model's maximum context length is 8192 tokens","code":"context_length_exceeded"}}"#,
            true,
        );
    }

    #[test]
    fn other_server_errors_stay_retryable_requests() {
        check(
            500,
            r#"{"error":{"code":500,"message":"failed to allocate the KV cache for context size 8192","type":"server_error"}}"#,
            false,
        );
        check(
            500,
            r#"{"error":{"message":"The server had an error while processing your request","type":"server_error"}}"#,
            false,
        );
        check(
            502,
            "<html>Bad Gateway: upstream context window service</html>",
            false,
        );
        // A 404 is never a refusal for length, whatever it says.
        check(
            404,
            r#"{"error":{"message":"context length exceeded route not found"}}"#,
            false,
        );
    }

    #[test]
    fn a_server_refusal_keeps_its_numbers() {
        let body = r#"{"error":{"code":500,"message":"the request exceeds the available context size","type":"exceed_context_size_error","n_prompt_tokens":1407,"n_ctx":256}}"#;
        let e = OpenAIError::ApiError(async_openai::error::ApiErrorResponse {
            status_code: reqwest::StatusCode::INTERNAL_SERVER_ERROR,
            api_error: async_openai::error::ApiError {
                message: body.to_string(),
                ..Default::default()
            },
        });
        let SummarizeError::TooLong(why) = request_error(e, false) else {
            panic!("a refusal for length")
        };
        assert_eq!(
            window::refusal(&why),
            window::Refusal {
                window: Some(256),
                prompt_tokens: Some(1_407),
                ceiling: None
            }
        );
    }
}
