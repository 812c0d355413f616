//! Asking an endpoint for its model's window before the first compaction request: llama.cpp
//! server's `GET /props` (at the server's root, beside `/v1`), then `GET <base>/models`
//! (vLLM's `max_model_len`, a gateway's `context_length`). What the answers mean is read in
//! `window.rs`; this file only makes the two bounded requests.
//!
//! Never fails: an endpoint that does not answer, or says nothing useful, leaves the window
//! unknown (compactd then learns it from the first refusal). A 5xx or a 429 is no answer:
//! llama.cpp's server answers 503 "Loading model" while it starts, and tells its window once
//! loaded, so such an endpoint is asked again before the next compaction, as one that
//! could not be reached. The key goes only into the
//! `Authorization` header; URLs in logs are redacted and errors carry no URL.

use std::time::Duration;

use serde_json::Value;

use super::ApiKey;
use super::window::{self, WindowSource};
use crate::config::redact;

/// Deadline of each discovery request: a server that is up answers these in milliseconds,
/// and a compaction waits for them.
pub const DISCOVERY_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest discovery answer read, parsed whole into a `serde_json::Value` (36 times its
/// size for a body of small numbers). The longest lists served are a gateway's, some 400
/// models with a description each (OpenRouter's), around 1 MiB; vLLM's and llama.cpp's are a
/// few KiB. A longer answer is ignored (the window is then learned from the first refusal).
pub const MAX_DISCOVERY_BYTES: usize = 2 << 20;

/// What the endpoint said when asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    /// It told its window.
    Told(u64, WindowSource),
    /// It answered, without a window (not asked again).
    Silent,
    /// It could not be reached, or answered only with a 5xx or a 429 (asked again next
    /// time).
    Unreachable,
}

/// Asks `base_url` for `model`'s window: `/props` first, then `/models`.
pub async fn ask(
    http: &reqwest::Client,
    base_url: &str,
    model: &str,
    key: Option<&ApiKey>,
) -> Answer {
    let Ok(base) = reqwest::Url::parse(base_url.trim_end_matches('/')) else {
        return Answer::Silent;
    };
    let path = base.path().trim_end_matches('/').to_string();
    let root = path.strip_suffix("/v1").unwrap_or(&path);
    let mut reached = false;
    let asks: [(String, WindowSource); 2] = [
        (format!("{root}/props"), WindowSource::Props),
        (format!("{path}/models"), WindowSource::Models),
    ];
    for (path, source) in asks {
        let mut url = base.clone();
        url.set_path(&path);
        let Some(body) = get_json(http, url, key).await else {
            continue;
        };
        reached = true;
        let told = match source {
            WindowSource::Props => body.as_ref().and_then(window::from_props),
            _ => body.as_ref().and_then(|b| window::from_models(b, model)),
        };
        if let Some(tokens) = told {
            return Answer::Told(tokens, source);
        }
    }
    if reached {
        Answer::Silent
    } else {
        Answer::Unreachable
    }
}

/// `GET url`: `None` when unreachable or answered with a 5xx or a 429 (it may answer
/// later: a server still loading its model), `Some(None)` when it answered with no JSON
/// worth reading (another error status, another format, too long).
async fn get_json(
    http: &reqwest::Client,
    url: reqwest::Url,
    key: Option<&ApiKey>,
) -> Option<Option<Value>> {
    let shown = redact::url(url.as_str());
    let mut request = http.get(url).timeout(DISCOVERY_TIMEOUT);
    if let Some(key) = key.map(ApiKey::expose).filter(|k| !k.is_empty()) {
        request = request.bearer_auth(key);
    }
    let mut response = match request.send().await {
        Ok(r) => r,
        Err(e) => {
            tracing::debug!(url = %shown, error = %e.without_url(), "window discovery: no answer");
            return None;
        }
    };
    let status = response.status();
    if status.is_server_error() || status == reqwest::StatusCode::TOO_MANY_REQUESTS {
        tracing::debug!(url = %shown, status = status.as_u16(), "window discovery: not answered now; asked again next time");
        return None;
    }
    if !status.is_success() {
        tracing::debug!(url = %shown, status = status.as_u16(), "window discovery: not served here");
        return Some(None);
    }
    let mut bytes = Vec::new();
    loop {
        match response.chunk().await {
            Ok(Some(chunk)) if bytes.len().saturating_add(chunk.len()) <= MAX_DISCOVERY_BYTES => {
                bytes.extend_from_slice(&chunk);
            }
            Ok(Some(_)) => {
                tracing::debug!(url = %shown, "window discovery: answer too long; ignored");
                return Some(None);
            }
            Ok(None) => break,
            Err(e) => {
                tracing::debug!(url = %shown, error = %e.without_url(), "window discovery: answer cut");
                return Some(None);
            }
        }
    }
    Some(serde_json::from_slice(&bytes).ok())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::summarize::fake_endpoint::{Endpoint, json_response};

    /// Serves `list` at `/v1/models` (and nothing at `/props`).
    async fn serving(list: String) -> Endpoint {
        Endpoint::start(move |_, r| {
            if r.path.ends_with("/models") {
                json_response(200, &list)
            } else {
                json_response(404, r#"{"error":{"message":"not found"}}"#)
            }
        })
        .await
    }

    /// A discovery answer is parsed whole into a `Value`: one past the bound is ignored
    /// (before, up to 4 MiB of it was parsed), and a list as long as the longest a gateway
    /// serves is read.
    #[tokio::test]
    async fn a_model_list_past_the_bound_is_ignored_and_a_gateways_is_read() {
        let http = reqwest::Client::new();
        // 600 entries of 1.5 KiB (OpenRouter's carry a description each): 900 KiB.
        let entries: Vec<Value> = (0..600)
            .map(|i| {
                json!({"id": format!("vendor/model-{i}"), "context_length": 131_072,
                       "description": "d".repeat(1_400)})
            })
            .collect();
        let gateway = serving(json!({ "data": entries }).to_string()).await;
        assert_eq!(
            ask(&http, &gateway.base_url(), "vendor/model-7", None).await,
            Answer::Told(131_072, WindowSource::Models)
        );

        // 3 MB of small numbers, parsed into 108 MB of `Value`s.
        let numbers = vec![0; 1_500_000];
        let padded = json!({"data": [{"id": "m", "context_length": 8_192}], "pad": numbers});
        let padded = serving(padded.to_string()).await;
        assert_eq!(
            ask(&http, &padded.base_url(), "m", None).await,
            Answer::Silent
        );
    }
}
