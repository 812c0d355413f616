//! Strategy 3, `pruneSourceUrls`: a `webfetch` of a url, or a `websearch` of a query,
//! supersedes every earlier fetch of the same url / search of the same query (and of the
//! same other fields, such as a `WebFetch` `prompt`).

use serde_json::Value;

use super::{other_fields, str_field, tool_is};

/// The supersede key of a fetch or search call (`None`: neither).
pub fn url_key(tool: &str, input: &Value) -> Option<String> {
    let field = |k: &str| str_field(input, k).map(str::trim);
    if tool_is(tool, &["webfetch", "web_fetch", "fetch"]) {
        let url = field("url")?;
        // The fragment never reaches the server: same document.
        let url = url.split('#').next().unwrap_or(url);
        // OpenCode's fields only change how the same document is written; any other
        // (Claude Code's `WebFetch` `prompt`: an answer about the page, not the page)
        // makes another fetch.
        let rest = other_fields(input, &["url", "format", "timeout"]);
        return (!url.is_empty()).then(|| format!("url:{url}{rest}"));
    }
    if tool_is(tool, &["websearch", "web_search"]) {
        let query = field("query")?;
        let rest = other_fields(input, &["query"]);
        return (!query.is_empty()).then(|| format!("search:{query}{rest}"));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn fetches_key_by_url_and_searches_by_query() {
        assert_eq!(
            url_key(
                "webfetch",
                &json!({"url": " https://x.dev/a#top ", "format": "markdown"})
            ),
            Some("url:https://x.dev/a".into())
        );
        assert_eq!(
            url_key("websearch", &json!({"query": "tonic keepalive"})),
            Some("search:tonic keepalive".into())
        );
        assert_eq!(url_key("read", &json!({"url": "x"})), None);
        assert_eq!(url_key("webfetch", &json!({})), None);
    }
}
