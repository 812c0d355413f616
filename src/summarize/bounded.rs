//! What compactd reads of an endpoint's error response, bounded. async-openai reads any
//! non-2xx body whole, so the HTTP layer under it (`retry_after.rs`) reads the body first,
//! at most [`ERROR_BODY_BYTES`] of it, and hands async-openai a response it still reads the
//! status and message of. The rest is never read: the response is dropped, which closes
//! the connection. How much of the message an error keeps is `llm/errors.rs`'s concern.

use async_openai::error::OpenAIError;
use reqwest::header::{CONTENT_ENCODING, CONTENT_LENGTH, TRANSFER_ENCODING};

/// The most compactd reads of an error body: any JSON error a server sends fits many times
/// over (OpenAI's and llama.cpp's, numbers included, are under 1 KiB), and a proxy's 50 MB
/// error page costs 64 KiB. Larger than the message an error keeps, so the cut made here
/// (before the key is redacted) never shows.
pub(super) const ERROR_BODY_BYTES: usize = 64 * 1024;

/// `response` (not a success) with its body read, at most [`ERROR_BODY_BYTES`] of it. A
/// longer body is replaced by its start, marked as cut, in the form async-openai expects
/// of the status: the text as it is for a server error (async-openai does not parse
/// those), an OpenAI error object otherwise (a cut JSON body would not parse, and the
/// status would be lost).
pub(super) async fn read_error(
    mut response: reqwest::Response,
) -> Result<reqwest::Response, OpenAIError> {
    let status = response.status();
    let version = response.version();
    let mut headers = response.headers().clone();
    let (kept, whole) = read_at_most(&mut response, ERROR_BODY_BYTES).await?;
    drop(response);
    let body = if whole {
        kept
    } else {
        cut_error_body(status, &kept)
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
    serde_json::json!({ "error": { "message": text } })
        .to_string()
        .into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;
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
}
