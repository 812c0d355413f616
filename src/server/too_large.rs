//! An update past the transport's size cap, as compactd says it. Updates up to
//! `--max-update-bytes` plus a slack are read and refused one by one (RESOURCE_EXHAUSTED
//! naming `max_update_bytes`, the stream goes on); one past that cap is refused by tonic's
//! decoder before compactd sees it, as OUT_OF_RANGE "Error, decoded message length too
//! large", which names neither the flag nor compactd's limit. The stream's reader and
//! the unary replies (their headers) map that status here; compactd itself never answers
//! OUT_OF_RANGE.

use http::HeaderValue;
use tonic::{Code, Status};

/// How tonic's decoder starts its refusal of a message over the decoding cap.
const TONIC_WORDS: &str = "Error, decoded message length too large";

/// `status` as compactd says it when it is tonic's refusal of an update past the
/// transport's cap (`max_update_bytes`: the limit updates are held to); else unchanged.
pub fn status(status: Status, max_update_bytes: usize, streamed: bool) -> Status {
    if status.code() != Code::OutOfRange || !status.message().starts_with(TONIC_WORDS) {
        return status;
    }
    Status::resource_exhausted(message(status.message(), max_update_bytes, streamed))
}

/// The same for a unary reply's headers (a refused request gets a trailers-only reply:
/// its status is in the headers).
pub fn headers(headers: &mut http::HeaderMap, max_update_bytes: usize) {
    if headers.get("grpc-status").map(HeaderValue::as_bytes) != Some(b"11") {
        return;
    }
    let Some(said) = headers
        .get("grpc-message")
        .and_then(|m| m.to_str().ok())
        .map(|m| m.replace("%20", " "))
    else {
        return;
    };
    if !said.starts_with(TONIC_WORDS) {
        return;
    }
    let text = message(&said, max_update_bytes, false);
    // Printable ASCII without '%': nothing to percent-encode.
    if let Ok(value) = HeaderValue::from_str(&text) {
        headers.insert("grpc-status", HeaderValue::from_static("8"));
        headers.insert("grpc-message", value);
    }
}

/// What compactd says: the update's size when tonic gave it, the limit and the flag.
fn message(tonic_said: &str, max_update_bytes: usize, streamed: bool) -> String {
    let found = tonic_said
        .split("found ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .and_then(|n| n.parse::<u64>().ok());
    let size = found.map_or_else(
        || "an update".to_string(),
        |n| format!("an update of {n} bytes"),
    );
    let ends = if streamed {
        "; the stream ends here, as an update that large is not read"
    } else {
        ""
    };
    format!(
        "{size} is over max_update_bytes ({max_update_bytes} bytes): send large content in smaller parts, or raise --max-update-bytes{ends}"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAID: &str =
        "Error, decoded message length too large: found 200123 bytes, the limit is: 66560 bytes";

    #[test]
    fn tonics_refusal_names_the_flag_and_the_limit() {
        let s = status(Status::out_of_range(SAID), 1024, true);
        assert_eq!(s.code(), Code::ResourceExhausted);
        assert!(
            s.message()
                .starts_with("an update of 200123 bytes is over max_update_bytes (1024 bytes)"),
            "{}",
            s.message()
        );
        assert!(s.message().contains("the stream ends here"));
        let other = status(Status::out_of_range("something else"), 1024, true);
        assert_eq!(other.code(), Code::OutOfRange);
    }

    #[test]
    fn a_unary_replys_headers_are_rewritten() {
        let mut h = http::HeaderMap::new();
        h.insert("grpc-status", HeaderValue::from_static("11"));
        h.insert(
            "grpc-message",
            HeaderValue::from_str(&SAID.replace(' ', "%20")).expect("ascii"),
        );
        headers(&mut h, 1024);
        assert_eq!(h["grpc-status"], "8");
        let m = h["grpc-message"].to_str().expect("ascii");
        assert!(
            m.contains("max_update_bytes (1024 bytes)") && !m.contains("stream ends"),
            "{m}"
        );
        let mut ok = http::HeaderMap::new();
        ok.insert("grpc-status", HeaderValue::from_static("0"));
        headers(&mut ok, 1024);
        assert_eq!(ok["grpc-status"], "0");
    }
}
