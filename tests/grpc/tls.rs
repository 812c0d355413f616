//! TLS and mutual TLS with certificates made in the test (rcgen): the handshake succeeds
//! with the right CA (and, for mTLS, a client certificate the server's CA signed) and
//! fails otherwise.

use compactd::config::EngineConfig;
use compactd::server::{ServerOptions, pb};
use compactd::store::Store;
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Identity, ServerTlsConfig};

use crate::common::*;

/// A CA and a certificate it signed for `names`: (ca pem, cert pem, key pem).
struct Pki {
    ca: CertifiedIssuer<'static, KeyPair>,
}

impl Pki {
    fn new() -> Pki {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("params");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca =
            CertifiedIssuer::self_signed(params, KeyPair::generate().expect("key")).expect("CA");
        Pki { ca }
    }

    fn ca_pem(&self) -> String {
        self.ca.pem()
    }

    /// A leaf certificate for `names`: (cert pem, key pem).
    fn leaf(&self, names: &[&str]) -> (String, String) {
        let key = KeyPair::generate().expect("key");
        let params =
            CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
                .expect("params");
        let cert = params.signed_by(&key, &self.ca).expect("signed");
        (cert.pem(), key.serialize_pem())
    }
}

async fn tls_server(pki: &Pki, client_ca: Option<&Pki>) -> TestServer {
    let (cert, key) = pki.leaf(&["localhost"]);
    let mut tls = ServerTlsConfig::new().identity(Identity::from_pem(cert, key));
    if let Some(ca) = client_ca {
        tls = tls.client_ca_root(Certificate::from_pem(ca.ca_pem()));
    }
    start_server_on(
        Store::new(EngineConfig::default()),
        ServerOptions {
            tls: Some(tls),
            ..Default::default()
        },
    )
    .await
}

/// Connects over TLS trusting `ca`, presenting `identity` if given; a failed handshake
/// may surface at connect or at the first call, so both are folded into one result.
async fn list_over_tls(
    server: &TestServer,
    ca: &Pki,
    identity: Option<(String, String)>,
) -> Result<(), String> {
    let mut tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca.ca_pem()))
        .domain_name("localhost");
    if let Some((cert, key)) = identity {
        tls = tls.identity(Identity::from_pem(cert, key));
    }
    let channel: Channel = Channel::from_shared(format!("https://{}", server.addr))
        .map_err(|e| e.to_string())?
        .tls_config(tls)
        .map_err(|e| e.to_string())?
        .connect()
        .await
        .map_err(|e| format!("connect: {e}"))?;
    pb::sessions_client::SessionsClient::new(channel)
        .list_sessions(pb::ListSessionsRequest::default())
        .await
        .map(|_| ())
        .map_err(|e| format!("call: {e}"))
}

#[tokio::test]
async fn tls_handshakes_with_the_right_ca_and_refuses_plaintext_and_strangers() {
    let pki = Pki::new();
    let server = tls_server(&pki, None).await;
    list_over_tls(&server, &pki, None)
        .await
        .expect("TLS with the server's CA works");

    // A client trusting another CA refuses the server's certificate.
    let stranger = Pki::new();
    assert!(list_over_tls(&server, &stranger, None).await.is_err());

    // Plaintext gRPC against a TLS port fails.
    let plain = async {
        let channel = Channel::from_shared(format!("http://{}", server.addr))
            .expect("uri")
            .connect()
            .await
            .map_err(|e| e.to_string())?;
        pb::sessions_client::SessionsClient::new(channel)
            .list_sessions(pb::ListSessionsRequest::default())
            .await
            .map(|_| ())
            .map_err(|e| e.to_string())
    };
    assert!(plain.await.is_err(), "plaintext must not get through");
}

#[tokio::test]
async fn mutual_tls_needs_a_client_certificate_from_the_trusted_ca() {
    let server_pki = Pki::new();
    let client_pki = Pki::new();
    let server = tls_server(&server_pki, Some(&client_pki)).await;

    // No client certificate: refused.
    assert!(list_over_tls(&server, &server_pki, None).await.is_err());
    // A certificate from a CA the server does not trust: refused.
    let rogue = Pki::new();
    assert!(
        list_over_tls(&server, &server_pki, Some(rogue.leaf(&["agent-host"])))
            .await
            .is_err()
    );
    // The trusted CA's client certificate: in.
    list_over_tls(&server, &server_pki, Some(client_pki.leaf(&["agent-host"])))
        .await
        .expect("mTLS with a trusted client certificate works");
}
