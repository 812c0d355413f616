//! `serve`'s TLS files, read and checked before the server starts. tonic parses them only
//! once it builds its listener, after "compactd serving" is logged, and its errors name
//! neither the flag nor the file (a certificate file holding no certificate reads "peer
//! sent no certificates"). Each check here names both.

use std::path::Path;

use rustls_pki_types::pem::{self, PemObject as _};
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tonic::transport::{Certificate, Identity, ServerTlsConfig};

use super::{ConfigError, read_text};

/// The server's identity from `--tls-cert` and `--tls-key`: each file holds what its flag
/// says, and the key is the certificate's.
pub(super) fn identity(cert: &Path, key: &Path) -> Result<Identity, ConfigError> {
    let cert_pem = read_text("tls-cert", cert)?;
    certificates("tls-cert", cert, &cert_pem)?;
    let key_pem = read_text("tls-key", key)?;
    PrivateKeyDer::from_pem_slice(key_pem.as_bytes()).map_err(|e| ConfigError {
        flag: "tls-key",
        message: format!(
            "{}: no private key read ({}); expected a PEM private key (PKCS#8, PKCS#1 or SEC1)",
            key.display(),
            pem_error(&e)
        ),
    })?;
    let identity = Identity::from_pem(cert_pem, key_pem);
    // The pair as the listener will build it: a key of another certificate fails here.
    tonic::transport::Server::builder()
        .tls_config(ServerTlsConfig::new().identity(identity.clone()))
        .map_err(|e| ConfigError {
            flag: "tls-key",
            message: format!(
                "{} does not go with the certificate in --tls-cert {}: {}",
                key.display(),
                cert.display(),
                chain(&e)
            ),
        })?;
    Ok(identity)
}

/// `tls` requiring client certificates signed by `--tls-client-ca`.
pub(super) fn with_client_ca(
    tls: ServerTlsConfig,
    ca: &Path,
) -> Result<ServerTlsConfig, ConfigError> {
    let pem = read_text("tls-client-ca", ca)?;
    certificates("tls-client-ca", ca, &pem)?;
    let tls = tls.client_ca_root(Certificate::from_pem(pem));
    tonic::transport::Server::builder()
        .tls_config(tls.clone())
        .map_err(|e| ConfigError {
            flag: "tls-client-ca",
            message: format!("{}: not usable as a client CA: {}", ca.display(), chain(&e)),
        })?;
    Ok(tls)
}

/// Checks that `text` holds at least one PEM certificate, every one readable.
fn certificates(flag: &'static str, path: &Path, text: &str) -> Result<(), ConfigError> {
    let refused = |why: String| ConfigError {
        flag,
        message: format!(
            "{}: {why}; expected PEM certificates (-----BEGIN CERTIFICATE-----)",
            path.display()
        ),
    };
    let mut found = 0usize;
    for c in CertificateDer::pem_slice_iter(text.as_bytes()) {
        c.map_err(|e| refused(format!("unreadable certificate ({})", pem_error(&e))))?;
        found = found.saturating_add(1);
    }
    if found == 0 {
        return Err(refused("no certificate in it".into()));
    }
    Ok(())
}

/// A PEM error in words, without the file's bytes.
fn pem_error(e: &pem::Error) -> String {
    match e {
        pem::Error::NoItemsFound => "nothing of that kind in the file".into(),
        other => crate::config::shown::clipped(&format!("{other:?}")).into_owned(),
    }
}

/// An error with its sources, as "outer: inner: ...".
fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !out.ends_with(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = s.source();
    }
    out
}
