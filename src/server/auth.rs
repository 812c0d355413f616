//! Optional bearer-token authentication: every `compactd.v1.Sessions` call (and, as
//! configured, health and reflection) must carry `authorization: Bearer <token>`. The
//! comparison is constant-time; the token never appears in logs, errors or `Debug`.

use std::sync::Arc;

use subtle::ConstantTimeEq;
use tonic::{Request, Status};

/// The expected header value, `Bearer <token>`.
#[derive(Clone)]
pub struct BearerToken(Arc<[u8]>);

impl BearerToken {
    /// A token (surrounding whitespace, such as a file's newline, is not part of it).
    /// Refused when empty, or when no client could send it (a control character inside:
    /// a file of two lines), which would leave every call UNAUTHENTICATED; the error says
    /// where, never what.
    pub fn new(token: &str) -> Result<BearerToken, String> {
        let token = token.trim();
        if token.is_empty() {
            return Err("is empty".into());
        }
        // What gRPC metadata carries: printable ASCII, space to `~`.
        if let Some(at) = token.bytes().position(|b| !(b' '..=b'~').contains(&b)) {
            let what = if token.as_bytes()[at].is_ascii() {
                "a control character"
            } else {
                "a byte outside ASCII"
            };
            return Err(format!(
                "holds {what} at byte {at} (a second line?): no client can send it; a token \
                 is one line of printable ASCII"
            ));
        }
        Ok(BearerToken(format!("Bearer {token}").into_bytes().into()))
    }

    /// True when `header` is exactly `Bearer <token>`, compared in constant time.
    fn accepts(&self, header: &[u8]) -> bool {
        bool::from(self.0.as_ref().ct_eq(header))
    }
}

impl std::fmt::Debug for BearerToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BearerToken([redacted])")
    }
}

/// Who must authenticate.
#[derive(Debug, Clone, Default)]
pub struct AuthConfig {
    /// The token; `None` turns authentication off.
    pub token: Option<BearerToken>,
    /// Health checks need the token too (off by default: probes cannot send one).
    pub protect_health: bool,
    /// Reflection is open without the token (off by default).
    pub open_reflection: bool,
}

/// An interceptor that checks the token (or lets everything through when `token` is None).
pub fn interceptor(
    token: Option<BearerToken>,
) -> impl FnMut(Request<()>) -> Result<Request<()>, Status> + Clone {
    move |req: Request<()>| {
        let Some(token) = &token else {
            return Ok(req);
        };
        let header = req
            .metadata()
            .get("authorization")
            .map(|v| v.as_bytes())
            .unwrap_or_default();
        if token.accepts(header) {
            Ok(req)
        } else {
            crate::telemetry::rejected(tonic::Code::Unauthenticated);
            Err(Status::unauthenticated(
                "missing or wrong bearer token (send `authorization: Bearer <token>`)",
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_exact_header_passes() {
        let t = BearerToken::new(" s3cret\n").expect("token");
        assert!(t.accepts(b"Bearer s3cret"));
        assert!(!t.accepts(b"Bearer s3cre"));
        assert!(!t.accepts(b"bearer s3cret"));
        assert!(!t.accepts(b""));
        assert!(BearerToken::new("  ").is_err());
        let two_lines = BearerToken::new("first-token\nsecond-token\n").map(drop);
        let err = two_lines.expect_err("refused");
        assert!(err.contains("byte 11") && !err.contains("token\n"), "{err}");
        let err = BearerToken::new("tok-é-tok")
            .map(drop)
            .expect_err("refused");
        assert!(err.contains("outside ASCII at byte 4"), "{err}");
        assert!(!format!("{t:?}").contains("s3cret"));
    }
}
