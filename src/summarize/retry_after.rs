//! The server's own retry hint. async-openai turns an HTTP error into an `ApiError` without
//! its headers, so a thin tower layer under it notes `retry-after-ms` / `Retry-After` of a
//! 429 or 503 into a task-local slot that the retry loop reads after the attempt fails.
//! The same layer bounds what is read of a response (`bounded.rs`): an error's body it reads
//! itself, before async-openai would read all of it; an answer's body fails once it runs
//! too long, and the slot says why, which async-openai's stream error cannot carry.

use std::cell::Cell;
use std::future::Future;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use async_openai::Client;
use async_openai::config::OpenAIConfig;
use async_openai::error::OpenAIError;
use async_openai::middleware::{HttpRequestFactory, ReqwestService};
use tower::ServiceExt;

use super::bounded;

/// What the HTTP layer saw of one attempt, for the retry loop.
#[derive(Debug, Default)]
pub(super) struct Seen {
    /// The wait a 429/503 asked for.
    pub hint: Option<Duration>,
    /// Why the answer's body was cut short (`bounded::guard`), when it was.
    pub cut: Option<String>,
}

/// One attempt's slot. The cut is shared because the answer's body is read by
/// async-openai's own task, outside the attempt's task-local scope.
struct Slot {
    hint: Cell<Option<Duration>>,
    cut: Arc<OnceLock<String>>,
    /// The most bytes the answer's body may have (`bounded::guard`).
    limit: usize,
}

tokio::task_local! {
    static SLOT: Slot;
}

/// Runs one attempt with a fresh slot; returns its result and what the HTTP layer saw.
pub(super) async fn scoped<T>(attempt: impl Future<Output = T>) -> (T, Seen) {
    scoped_within(bounded::MAX_ANSWER_BYTES, attempt).await
}

/// [`scoped`] for a request whose answer's body may have at most `limit` bytes: the probe's,
/// one JSON body that async-openai reads whole and parses at once.
pub(super) async fn scoped_within<T>(limit: usize, attempt: impl Future<Output = T>) -> (T, Seen) {
    let slot = Slot {
        hint: Cell::new(None),
        cut: Arc::new(OnceLock::new()),
        limit,
    };
    SLOT.scope(slot, async {
        let out = attempt.await;
        let seen = SLOT.with(|slot| Seen {
            hint: slot.hint.get(),
            cut: slot.cut.get().cloned(),
        });
        (out, seen)
    })
    .await
}

/// A client whose HTTP service is the bare reqwest transport (no retries of its own:
/// compactd owns them, bounded by its deadline and reported as events) plus the hint probe
/// and the bounds on what is read of a response.
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
                    let _ = SLOT.try_with(|slot| slot.hint.set(Some(hint)));
                }
            }
            if response.status().is_success() {
                let (cut, limit) = SLOT
                    .try_with(|slot| (Some(slot.cut.clone()), slot.limit))
                    .unwrap_or((None, bounded::MAX_ANSWER_BYTES));
                return Ok::<_, OpenAIError>(bounded::guard(response, cut, limit));
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
