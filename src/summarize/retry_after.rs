//! The server's own retry hint. async-openai turns an HTTP error into an `ApiError` without
//! its headers, so a thin tower layer under it notes `retry-after-ms` / `Retry-After` of a
//! 429 or 503 into a task-local slot that the retry loop reads after the attempt fails.
//! The same layer reads an error's body, bounded (`bounded.rs`), before async-openai would
//! read all of it.

use std::cell::Cell;
use std::future::Future;
use std::time::Duration;

use async_openai::Client;
use async_openai::config::OpenAIConfig;
use async_openai::error::OpenAIError;
use async_openai::middleware::{HttpRequestFactory, ReqwestService};
use tower::ServiceExt;

use super::bounded;

tokio::task_local! {
    static HINT: Cell<Option<Duration>>;
}

/// Runs one attempt with a fresh hint slot; returns its result and the hint the server
/// sent with a 429/503, if any.
pub(super) async fn scoped<T>(attempt: impl Future<Output = T>) -> (T, Option<Duration>) {
    HINT.scope(Cell::new(None), async {
        let out = attempt.await;
        (out, HINT.with(Cell::get))
    })
    .await
}

/// A client whose HTTP service is the bare reqwest transport (no retries of its own:
/// compactd owns them, bounded by its deadline and reported as events) plus the hint probe
/// and the bounded read of error bodies.
pub(super) fn client(config: OpenAIConfig) -> Client<OpenAIConfig> {
    let inner = ReqwestService::default();
    let service = tower::service_fn(move |request: HttpRequestFactory| {
        let inner = inner.clone();
        async move {
            let response = inner.oneshot(request).await?;
            let status = response.status().as_u16();
            if status == 429 || status == 503 {
                let header = |name: &str| {
                    response
                        .headers()
                        .get(name)
                        .and_then(|v| v.to_str().ok())
                        .map(str::to_owned)
                };
                if let Some(hint) = parse(header("retry-after-ms"), header("retry-after")) {
                    // Outside `scoped` (no slot) there is nobody to tell.
                    let _ = HINT.try_with(|slot| slot.set(Some(hint)));
                }
            }
            if response.status().is_success() {
                return Ok::<_, OpenAIError>(response);
            }
            bounded::read_error(response).await
        }
    });
    Client::with_config(config).with_http_service(service)
}

/// OpenAI sends `retry-after-ms`; the HTTP standard header counts whole seconds. The
/// HTTP-date form is not used by LLM APIs and is ignored (the backoff applies).
fn parse(millis: Option<String>, secs: Option<String>) -> Option<Duration> {
    let millis = millis.and_then(|m| m.trim().parse::<f64>().ok());
    let secs = secs.and_then(|s| s.trim().parse::<f64>().ok().map(|s| s * 1000.0));
    millis
        .or(secs)
        .filter(|ms| ms.is_finite() && *ms >= 0.0)
        .map(|ms| Duration::from_millis(ms.min(u32::MAX as f64) as u64))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn some(s: &str) -> Option<String> {
        Some(s.to_string())
    }

    #[test]
    fn milliseconds_win_over_seconds() {
        assert_eq!(
            parse(some("1500"), some("7")),
            Some(Duration::from_millis(1500))
        );
        assert_eq!(parse(None, some("7")), Some(Duration::from_secs(7)));
        assert_eq!(parse(None, some("0.5")), Some(Duration::from_millis(500)));
    }

    #[test]
    fn dates_and_junk_are_ignored() {
        assert_eq!(parse(None, some("Wed, 21 Oct 2026 07:28:00 GMT")), None);
        assert_eq!(parse(some("-3"), None), None);
        assert_eq!(parse(some("NaN"), None), None);
        assert_eq!(parse(None, None), None);
    }
}
