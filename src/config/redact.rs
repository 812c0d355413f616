//! What may be shown of a secret-bearing setting: URLs lose their credentials (the
//! `user:password@` part and every query value) before they reach a log line or
//! `config print`, and texts lose an API key in every form a provider may echo it (as is,
//! after `Bearer `, base64-encoded, or base64 of `:key` as in Basic auth).

use base64::Engine as _;
use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};

/// What a removed secret reads as.
pub const REDACTED: &str = "[redacted]";

/// `url` without credentials: userinfo, and every query and fragment value, replaced
/// (keys kept, so a reader sees what was set). Safety first where a URL is ambiguous: a
/// password may hold `/`, `?`, `#` or `@` unencoded (base64 keys hold `/`), which a URL
/// parser takes for the authority's end, so everything before the last `@` is taken for
/// userinfo (an `@` in a path or query hides more than needed: shown short, never
/// leaked), and when that hidden part held a `?` or `#`, what follows the `@` is still
/// query or fragment and its values are hidden too. A value without `scheme://` is read
/// the same way (a mistyped URL still carries its credentials).
pub fn url(url: &str) -> String {
    let (scheme, rest) = split_scheme(url);
    let mut out = scheme.to_string();
    let rest = match rest.rfind('@') {
        Some(at) => {
            out.push_str(REDACTED);
            out.push('@');
            let (hidden, after) = (&rest[..at], &rest[at + 1..]);
            if hidden.contains(['?', '#']) {
                out.push_str(&pairs_redacted(after));
                return out;
            }
            after
        }
        None => rest,
    };
    let (base, fragment) = match rest.split_once('#') {
        Some((b, f)) => (b, Some(f)),
        None => (rest, None),
    };
    let (base, query) = match base.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (base, None),
    };
    out.push_str(base);
    if let Some(q) = query {
        out.push('?');
        out.push_str(&pairs_redacted(q));
    }
    if let Some(f) = fragment {
        out.push('#');
        out.push_str(&pairs_redacted(f));
    }
    out
}

/// `scheme://` and what follows it; no scheme (`""`) unless `url` starts with a scheme's
/// name (a letter, then letters, digits, `+`, `-` or `.`) right before `://`: a `://`
/// later on (a callback URL in a query) is no scheme.
fn split_scheme(url: &str) -> (&str, &str) {
    match url.find("://") {
        Some(at)
            if url[..at].starts_with(|c: char| c.is_ascii_alphabetic())
                && url[..at]
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"+-.".contains(&b)) =>
        {
            url.split_at(at + 3)
        }
        _ => ("", url),
    }
}

/// `k=v&k2=v2` (or bare items) with every value replaced.
/// The items are split at `&`, `?` and `#` (kept), so a value before a second `?` is
/// never shown as a key; an item shows its key only when it reads as `name=value` (see
/// [`as_pair`]), else it is hidden whole.
fn pairs_redacted(pairs: &str) -> String {
    let mut out = String::with_capacity(pairs.len());
    let mut rest = pairs;
    loop {
        let end = rest.find(['&', '?', '#']).unwrap_or(rest.len());
        let item = &rest[..end];
        match as_pair(item) {
            Some((k, _)) => {
                out.push_str(k);
                out.push('=');
                out.push_str(REDACTED);
            }
            None if item.is_empty() => {}
            None => out.push_str(REDACTED),
        }
        let Some(sep) = rest[end..].chars().next() else {
            return out;
        };
        out.push(sep);
        rest = &rest[end + 1..];
    }
}

/// `item` as `(name, value)` when it reads as a parameter: a name of at most 64 letters,
/// digits, `_`, `-`, `.`, `[` or `]`, then `=` and a value, neither empty nor more `=`
/// (base64 padding: `c2stbGl2ZQ==` and `c2stbGl2ZS0=` are bare tokens, not keys).
fn as_pair(item: &str) -> Option<(&str, &str)> {
    let (k, v) = item.split_once('=')?;
    let name = !k.is_empty()
        && k.len() <= 64
        && k.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_-.[]".contains(&b));
    (name && !v.is_empty() && !v.starts_with('=')).then_some((k, v))
}

/// The secrets a URL carries, for [`text`] to remove from what an endpoint says: the
/// userinfo (`user:password`, whose base64 is the Basic auth header reqwest sends, as
/// written and percent-decoded) and the password alone; a user without a password (a
/// token, `https://sk-...@gateway/v1`, sent as `user:`); and every query and fragment
/// item and value (at most [`ITEMS`]). Forms under [`MIN_SHOWN_SECRET`] bytes are left
/// out: a one-letter password
/// would turn every such letter of an error into `[redacted]`, and break the numbers a
/// refusal is read by.
pub fn url_secrets(url: &str) -> Vec<String> {
    let mut forms: Vec<String> = Vec::new();
    let (_, rest) = split_scheme(url);
    let decode = |s: &str| {
        percent_encoding::percent_decode_str(s)
            .decode_utf8_lossy()
            .into_owned()
    };
    // Every reading of the userinfo a URL may have (up to the last `@`, as `url` hides
    // it, and up to the earlier ones, at most `READINGS` of them, as each is a form as
    // long as what precedes it): removing a form that was no secret costs nothing.
    let ats: Vec<usize> = rest.match_indices('@').map(|(at, _)| at).collect();
    let earliest = ats.iter().take(READINGS);
    for &at in earliest.chain(ats.last().filter(|_| ats.len() > READINGS)) {
        let userinfo = &rest[..at];
        let (user, password) = userinfo.split_once(':').unwrap_or((userinfo, ""));
        if !password.is_empty() {
            forms.extend([
                userinfo.to_string(),
                format!("{}:{}", decode(user), decode(password)),
                password.to_string(),
                decode(password),
            ]);
        } else {
            forms.extend([format!("{}:", decode(user)), user.to_string(), decode(user)]);
        }
    }
    // Every item after the first `?` or `#`, wherever it stands: its value when it reads
    // as `name=value`, and the whole item (a bare or padded token) either way.
    if let Some(at) = rest.find(['?', '#']) {
        for item in rest[at + 1..].split(['&', '?', '#']).take(ITEMS) {
            if let Some((_, value)) = as_pair(item) {
                forms.extend([value.to_string(), decode(value)]);
            }
            forms.extend([item.to_string(), decode(item)]);
        }
    }
    let mut seen = std::collections::HashSet::new();
    let mut secrets: Vec<String> = Vec::new();
    for form in forms {
        if form.len() >= MIN_SHOWN_SECRET && seen.insert(form.clone()) {
            secrets.push(form);
        }
    }
    // The longest first: each is removed in turn, and a shorter one removed first would
    // leave part of a longer one's encoded form behind.
    secrets.sort_by_key(|s| std::cmp::Reverse(s.len()));
    secrets
}

/// Query and fragment items [`url_secrets`] lists: a URL of thousands of items must not
/// make every endpoint error scrubbed thousands of times (`url` hides every item).
const ITEMS: usize = 64;
/// Readings of a URL's userinfo [`url_secrets`] lists, up to its first `@`s (and its
/// last): a URL holding thousands of `@` must not make thousands of forms as long as it.
const READINGS: usize = 8;
/// Shortest URL secret removed from text (see [`url_secrets`]).
pub const MIN_SHOWN_SECRET: usize = 6;

/// `text` with `secret` removed in every form it is sent or echoed in: as is (which
/// covers `Bearer <secret>`), base64 (standard and URL-safe), and base64 of `:secret`.
/// An empty secret changes nothing.
pub fn text(text: &str, secret: &str) -> String {
    if secret.is_empty() {
        return text.to_string();
    }
    let mut out = text.replace(secret, REDACTED);
    for form in [
        STANDARD.encode(secret),
        URL_SAFE_NO_PAD.encode(secret),
        STANDARD.encode(format!(":{secret}")),
    ] {
        // With its padding first, then without (padding may be cut where the form ends
        // inside a longer token).
        let bare = form.trim_end_matches('=');
        if bare.len() >= 8 {
            out = out.replace(&form, REDACTED).replace(bare, REDACTED);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &str = "sk-live-4f1c9a7e";

    /// `url(given)` reads `shown`, and an endpoint's text echoing `given` holds none of
    /// `marks` once every form `url_secrets` lists is removed.
    fn assert_hidden(given: &str, shown: &str, marks: &[&str]) {
        assert_eq!(url(given), shown, "{given}");
        let mut echoed = format!("refused {given}");
        for s in url_secrets(given) {
            echoed = text(&echoed, &s);
        }
        assert!(
            marks.iter().all(|m| !echoed.contains(m)),
            "{given}: {echoed}"
        );
    }

    #[test]
    fn urls_lose_userinfo_and_query_values() {
        assert_eq!(
            url("https://user:pw@api.example.com/v1?api-key=sk-1&api-version=2024"),
            "https://[redacted]@api.example.com/v1?api-key=[redacted]&api-version=[redacted]"
        );
        assert_eq!(url("http://127.0.0.1:8080/v1"), "http://127.0.0.1:8080/v1");
        assert_eq!(
            url("http://h/v1?sk-bare#frag"),
            "http://h/v1?[redacted]#[redacted]"
        );
        assert_eq!(url("no url"), "no url");
    }

    /// A password holding `/` or `#` unencoded (base64 keys do), or a URL without its
    /// scheme, kept the password whole before.
    #[test]
    fn a_password_holding_url_delimiters_is_redacted_whole() {
        for (given, shown) in [
            (
                "https://apikey:Ab3/xY9+Zq==@gw.example.com/v1",
                "https://[redacted]@gw.example.com/v1",
            ),
            (
                "https://u:p#ssw0rdSECRET@gw.example.com/v1",
                "https://[redacted]@[redacted]",
            ),
            (
                "https://u:pa?ss=SECRET@gw.example.com/v1?k=v",
                "https://[redacted]@[redacted]?k=[redacted]",
            ),
            (
                "bob:SECRETpw@gw.example.com/v1",
                "[redacted]@gw.example.com/v1",
            ),
        ] {
            assert_hidden(given, shown, &["SECRET", "Ab3/xY9"]);
        }
    }

    /// What a URL may hide its secrets in, read safety first: everything before the last
    /// `@`, every query and fragment value, and a query that runs on past the `@`. Found
    /// in reviews of two earlier versions: one showed the query after an `@` in it
    /// (`email=ops@example.com&key=...`), the next took a user or password holding `/` or
    /// a digit-only port-like prefix for a host, and a later `://` for the scheme.
    #[test]
    fn no_secret_shows_whatever_the_url_holds() {
        for (given, shown) in [
            (
                "https://gw.example.com/v1?email=ops@example.com&key=SECRETKEY",
                "https://[redacted]@[redacted]&key=[redacted]",
            ),
            (
                "https://apikey:/Ab3xY9+Zq==SECRET@gw.example.com/v1",
                "https://[redacted]@gw.example.com/v1",
            ),
            (
                "https://Ab3xY9/Zq+wSECRET@gw.example.com/v1",
                "https://[redacted]@gw.example.com/v1",
            ),
            ("https://u:12#SECRET@gw/v1", "https://[redacted]@[redacted]"),
            (
                "http://llm_proxy:4000/v1?key=SECRETKEY&user=ops@example.com",
                "http://[redacted]@[redacted]",
            ),
            (
                "bob:SECRETpw@gw.example.com/v1?cb=https://x",
                "[redacted]@gw.example.com/v1?cb=[redacted]",
            ),
            (
                "https://h/cb#access_token=SECRETTOKEN",
                "https://h/cb#access_token=[redacted]",
            ),
            (
                "https://u:p@ss/wordSECRET@host/v1",
                "https://[redacted]@host/v1",
            ),
            (
                "https://api.cloudflare.com/client/v4/ai/run/@cf/meta/llama",
                "https://[redacted]@cf/meta/llama",
            ),
        ] {
            assert_hidden(given, shown, &["SECRET", "Ab3xY9"]);
        }
        assert_eq!(
            url("http://[::1]:8080/v1?k=v"),
            "http://[::1]:8080/v1?k=[redacted]"
        );
        // A value before a second `?` or `#`, and a padded base64 token (found in review
        // of the version above, which showed them as keys).
        for (given, shown) in [
            (
                "https://gw/v1?sk-live-SECRETab?api-version=2024",
                "https://gw/v1?[redacted]?api-version=[redacted]",
            ),
            (
                "https://h/cb#SECRETTOKEN#x=1",
                "https://h/cb#[redacted]#x=[redacted]",
            ),
            (
                "https://gw/v1?c2stbGl2ZS0xMjM0NTY3OA==",
                "https://gw/v1?[redacted]",
            ),
            // One `=` of padding, or an empty value (found in the next review).
            ("https://gw/v1?c2stbGl2ZSECRET=", "https://gw/v1?[redacted]"),
        ] {
            assert_hidden(given, shown, &["SECRET", "c2stbGl2"]);
        }
        // Thousands of `@`, or of query items, make a bounded number of forms.
        let many = format!("https://u:{}@gw/v1", "p@".repeat(20_000));
        assert!(url_secrets(&many).len() <= 4 * (READINGS + 1) + 2);
        let items = format!("https://gw/v1?{}", "aaaaa1&".repeat(20_000));
        assert!(url_secrets(&items).len() <= 4 * ITEMS);
        // A token given as the user, down to the shortest secret listed.
        assert!(url_secrets("https://sk-abc@gw/v1").contains(&"sk-abc".to_string()));
    }

    #[test]
    fn a_urls_secrets_are_its_userinfo_its_password_and_its_query_values() {
        assert_eq!(
            url_secrets("https://bob:p%40ss-word@h.example/v1?api-key=sk-12345678&v=2024"),
            [
                "api-key=sk-12345678",
                "bob:p%40ss-word",
                "bob:p@ss-word",
                "p%40ss-word",
                "sk-12345678",
                "p@ss-word",
                "v=2024"
            ]
        );
        assert!(url_secrets("http://127.0.0.1:8080/v1").is_empty());
        assert!(
            url_secrets("http://bob@h/v1").is_empty(),
            "a short user is no token"
        );
        assert!(url_secrets("no url").is_empty());
        // Basic auth's header is the base64 of user:password: text() removes it.
        let basic = STANDARD.encode("bob:p@ss-word");
        let echoed = format!("authorization: Basic {basic}");
        let mut out = echoed.clone();
        for s in url_secrets("https://bob:p%40ss-word@h/v1") {
            out = text(&out, &s);
        }
        assert_eq!(out, "authorization: Basic [redacted]");
        // A token given as the user: reqwest sends base64("token:").
        let mut out = format!("Basic {}", STANDARD.encode("sk-abcdefgh:"));
        for s in url_secrets("https://sk-abcdefgh@gw/v1") {
            out = text(&out, &s);
        }
        assert_eq!(out, "Basic [redacted]");
        // A one-letter password is not removed as text: numbers stay readable.
        let secrets = url_secrets("http://u:0@h/v1");
        let mut out = "maximum context length is 4096".to_string();
        for s in &secrets {
            out = text(&out, s);
        }
        assert_eq!(out, "maximum context length is 4096");
    }

    #[test]
    fn a_key_is_removed_in_every_form() {
        let b64 = STANDARD.encode(KEY);
        let basic = STANDARD.encode(format!(":{KEY}"));
        let echoed = format!(
            "headers: authorization: Bearer {KEY}; x-key: {b64}; basic {basic}; again {KEY}"
        );
        let clean = text(&echoed, KEY);
        assert!(!clean.contains(KEY), "{clean}");
        assert!(!clean.contains(b64.trim_end_matches('=')), "{clean}");
        assert!(!clean.contains(basic.trim_end_matches('=')), "{clean}");
        assert!(clean.contains("Bearer [redacted]"), "{clean}");
        assert_eq!(text("nothing here", ""), "nothing here");
    }
}
