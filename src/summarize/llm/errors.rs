//! Client errors as [`SummarizeError`]s: which are worth a retry, which are a refusal for
//! length (in any server's wording, including llama.cpp's body that async-openai cannot
//! parse), and the chain of causes a transport error carries.

use async_openai::error::OpenAIError;

use crate::summarize::SummarizeError;
use crate::summarize::window;

/// Maps a client error; `started` tells whether summary text had arrived.
pub(super) fn request_error(e: OpenAIError, started: bool) -> SummarizeError {
    match e {
        OpenAIError::ApiError(r) if too_long(r.status_code.as_u16(), &r.api_error) => {
            SummarizeError::TooLong(r.api_error.message)
        }
        OpenAIError::ApiError(r) => {
            let status = r.status_code.as_u16();
            SummarizeError::Request {
                status: Some(status),
                message: format!("{status}: {}", r.api_error.message),
                retryable: status == 429 || status >= 500,
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
        // llama.cpp's server sends `"code": 400` as a number, which async-openai's error
        // type cannot read: its refusal for length arrives here, as the raw body.
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

/// A refusal because the request does not fit the model's window (OpenAI's
/// `context_length_exceeded`, or the wording other servers use).
fn too_long(status: u16, e: &async_openai::error::ApiError) -> bool {
    (status == 400 || status == 413)
        && (e.code.as_deref() == Some("context_length_exceeded")
            || window::reads_too_long(&e.message))
}

/// The message of a raw error body, with llama.cpp's numbers (`n_prompt_tokens`, `n_ctx`)
/// kept beside it when the message does not spell them out; the body itself (cut short)
/// when it is not JSON.
fn refusal_text(body: &str) -> String {
    const MAX_CHARS: usize = 1_000;
    let Ok(v) = serde_json::from_str::<serde_json::Value>(body) else {
        return body.chars().take(MAX_CHARS).collect();
    };
    let error = &v["error"];
    let mut text: String = error["message"]
        .as_str()
        .unwrap_or("the request exceeds the model's context")
        .chars()
        .take(MAX_CHARS)
        .collect();
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
                prompt_tokens: Some(9_100)
            }
        );
        assert_eq!(refusal_text("not json"), "not json");
    }
}
