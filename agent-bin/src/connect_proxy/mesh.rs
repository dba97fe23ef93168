//! The built-in proxy in the mesh: what it follows of the agent (the roots, its service's
//! leaf, the intentions that decide who may connect to it, the instances of its upstreams),
//! each through blocking queries with its token, and the TLS that it speaks with them.
//!
//! A new leaf or new roots make new TLS configs for the connections that follow; a
//! connection already established keeps the config it began with, so a rotation drops
//! nothing. Client certificates must chain to a root the agent serves; a server must prove
//! the SPIFFE id of the destination it was dialled for.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hyper::StatusCode;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::server::WebPkiClientVerifier;
use rustls::{CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, ServerConfig, SignatureScheme};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use serde::de::DeserializeOwned;
use tether_state::{Intention, IntentionAction, IntentionTarget, Intentions, ServiceName};
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;

use super::{Identity, QUERY_WAIT, RETRY_BACKOFF};
use crate::api::dto::{CaRootsDto, IntentionsDto, LeafDto, TOKEN_HEADER};
use crate::client;

/// How often a proxy asks again whether the agent has a CA, while it has none.
const NOT_ENABLED_POLL: Duration = Duration::from_secs(5);

/// What a blocking query answered: the value, or that Connect is off (404).
pub(super) enum Answer<T> {
    Value(T),
    NotEnabled,
}

/// Follows `path` through blocking queries until `stop`, handing each new answer (a new
/// index, or Connect turned off) to `publish`. The agent may be away: it asks again on the
/// backoff, and what was published stays in force meanwhile.
pub(super) async fn follow<T: DeserializeOwned>(
    identity: &Identity,
    path: &str,
    index_of: fn(&T) -> u64,
    mut publish: impl FnMut(Answer<T>),
    stop: &CancellationToken,
) {
    let mut index: Option<u64> = None;
    let mut off = false;
    let mut backoff = RETRY_BACKOFF;
    let separator = if path.contains('?') { '&' } else { '?' };
    loop {
        let url = match index {
            Some(index) => format!("{path}{separator}index={index}&wait={}s", QUERY_WAIT.as_secs()),
            None => path.to_owned(),
        };
        let headers = [(TOKEN_HEADER, identity.token.as_str())];
        let answer = tokio::select! {
            () = stop.cancelled() => return,
            answer = client::request_with(&identity.agent, &url, &headers, QUERY_WAIT + Duration::from_secs(30)) => answer,
        };
        let problem = match answer {
            Ok(response) if response.status == StatusCode::OK => match serde_json::from_slice::<T>(&response.body) {
                Ok(value) => {
                    backoff.reset();
                    let new = index_of(&value);
                    if index != Some(new) || off {
                        index = Some(new);
                        off = false;
                        publish(Answer::Value(value));
                    }
                    continue;
                }
                Err(err) => format!("the agent sent an answer this proxy cannot read: {err}"),
            },
            Ok(response) if response.status == StatusCode::NOT_FOUND => {
                backoff.reset();
                if !off {
                    off = true;
                    index = None;
                    publish(Answer::NotEnabled);
                }
                tokio::select! {
                    () = stop.cancelled() => return,
                    () = tokio::time::sleep(NOT_ENABLED_POLL) => continue,
                }
            }
            Ok(response) => format!("the agent answered {}: {}", response.status, response.error_message()),
            Err(err) => crate::error::error_chain(&err),
        };
        let retry = backoff.next();
        tracing::warn!(%path, %problem, retry_ms = retry.as_millis(), "cannot follow the mesh");
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(retry) => {}
        }
    }
}

pub(super) fn roots_index(roots: &CaRootsDto) -> u64 {
    roots.index
}

pub(super) fn leaf_index(leaf: &LeafDto) -> u64 {
    leaf.index
}

pub(super) fn intentions_index(intentions: &IntentionsDto) -> u64 {
    intentions.index
}

/// The intentions an answer lists, with their default, decided by tether-state's one
/// precedence rule.
pub(super) fn intentions_of(answer: &IntentionsDto) -> Result<Intentions, String> {
    let default = IntentionAction::from_name(&answer.default_intention)
        .ok_or_else(|| format!("unknown default intention {:?}", answer.default_intention))?;
    let rules = answer
        .intentions
        .iter()
        .map(|rule| {
            let source = IntentionTarget::parse(&rule.source).map_err(|err| err.to_string())?;
            let destination = IntentionTarget::parse(&rule.destination).map_err(|err| err.to_string())?;
            let action =
                IntentionAction::from_name(&rule.action).ok_or_else(|| format!("unknown action {:?}", rule.action))?;
            Ok(Intention::new(source, destination, action))
        })
        .collect::<Result<Vec<_>, String>>()?;
    Intentions::new(rules, default).map_err(|err| err.to_string())
}

/// Whether `source` may connect to `destination`: `Err` with the rule that denies it.
pub(super) fn allowed(intentions: &Intentions, source: &ServiceName, destination: &ServiceName) -> Result<(), String> {
    let decision = intentions.decide(source, destination);
    match (decision.action, decision.rule) {
        (IntentionAction::Allow, _) => Ok(()),
        (IntentionAction::Deny, Some(rule)) => Err(format!("{source} is denied by intention {rule}")),
        (IntentionAction::Deny, None) => Err(format!(
            "{source} is denied by default_intention = \"deny\": no intention matches {source} -> {destination}"
        )),
    }
}

/// The TLS of one leaf and one set of roots: the inbound acceptor, and a client config per
/// destination identity, made once and kept (with its sessions, for resumption) until the
/// leaf or the roots change.
pub(super) struct MeshTls {
    pub(super) acceptor: TlsAcceptor,
    pub(super) trust_domain: String,
    provider: Arc<CryptoProvider>,
    roots: Arc<RootCertStore>,
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    clients: Mutex<HashMap<String, Arc<ClientConfig>>>,
}

impl MeshTls {
    /// The TLS of `leaf`, trusting `roots`.
    ///
    /// # Errors
    ///
    /// What is wrong with the PEM or the key, for the proxy's log.
    pub(super) fn new(roots: &CaRootsDto, leaf: &LeafDto) -> Result<Self, String> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut store = RootCertStore::empty();
        for root in &roots.roots {
            for cert in CertificateDer::pem_slice_iter(root.root_cert.as_bytes()) {
                let cert = cert.map_err(|err| format!("root {}: {err}", root.id))?;
                store.add(cert).map_err(|err| format!("root {}: {err}", root.id))?;
            }
        }
        let roots_store = Arc::new(store);
        let chain = CertificateDer::pem_slice_iter(leaf.cert_pem.as_bytes())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|err| format!("the leaf certificate: {err}"))?;
        let key = PrivateKeyDer::from_pem_slice(leaf.private_key_pem.as_bytes())
            .map_err(|_| "the leaf's key is no PEM key")?;
        let verifier = WebPkiClientVerifier::builder_with_provider(roots_store.clone(), provider.clone())
            .build()
            .map_err(|err| format!("the client verifier: {err}"))?;
        let server = ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|err| err.to_string())?
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain.clone(), key.clone_key())
            .map_err(|err| format!("the leaf and its key: {err}"))?;
        Ok(Self {
            acceptor: TlsAcceptor::from(Arc::new(server)),
            trust_domain: roots.trust_domain.clone(),
            provider,
            roots: roots_store,
            chain,
            key,
            clients: Mutex::default(),
        })
    }

    /// The client config that proves this proxy's leaf and accepts only a server whose
    /// certificate chains to the roots and carries `expected`.
    pub(super) fn client(&self, expected: &str) -> Result<Arc<ClientConfig>, String> {
        let mut clients = self.clients.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(config) = clients.get(expected) {
            return Ok(config.clone());
        }
        let verifier = SpiffeVerifier {
            roots: self.roots.clone(),
            expected: expected.to_owned(),
            provider: self.provider.clone(),
        };
        let config = ClientConfig::builder_with_provider(self.provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|err| err.to_string())?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(verifier))
            .with_client_auth_cert(self.chain.clone(), self.key.clone_key())
            .map_err(|err| format!("the leaf and its key: {err}"))?;
        let config = Arc::new(config);
        clients.insert(expected.to_owned(), config.clone());
        Ok(config)
    }
}

/// The SPIFFE id in a certificate's URI SAN, if it has one.
pub(super) fn spiffe_of(cert: &CertificateDer<'_>) -> Option<String> {
    let (_, parsed) = x509_parser::parse_x509_certificate(cert.as_ref()).ok()?;
    let names = parsed.subject_alternative_name().ok()??;
    names.value.general_names.iter().find_map(|name| match name {
        x509_parser::extensions::GeneralName::URI(uri) if uri.starts_with("spiffe://") => Some((*uri).to_owned()),
        _ => None,
    })
}

/// The service a SPIFFE id in Consul's layout names, if it is of `trust_domain`:
/// `spiffe://<trust domain>/ns/<namespace>/dc/<datacenter>/svc/<service>`.
///
/// # Errors
///
/// Why the id is not a service of this mesh.
pub(super) fn service_of(spiffe: &str, trust_domain: &str) -> Result<ServiceName, String> {
    let rest = spiffe.strip_prefix("spiffe://").ok_or_else(|| format!("{spiffe} is no SPIFFE id"))?;
    let (domain, path) = rest.split_once('/').ok_or_else(|| format!("{spiffe} names no service"))?;
    if domain != trust_domain {
        return Err(format!("{spiffe} is of the trust domain {domain}, not {trust_domain}"));
    }
    let segments: Vec<&str> = path.split('/').collect();
    match segments.as_slice() {
        ["ns", _, "dc", _, "svc", name] => {
            ServiceName::new(*name).map_err(|err| format!("{spiffe} names no valid service: {err}"))
        }
        _ => Err(format!("{spiffe} names no service (.../ns/<ns>/dc/<dc>/svc/<service>)")),
    }
}

/// Why an inbound handshake failed, as a reason of the agent's refusal metric and a detail;
/// `None` for a peer that went away before it said anything (a port probe).
pub(super) fn handshake_refusal(err: &std::io::Error) -> Option<(&'static str, String)> {
    let Some(tls) = err.get_ref().and_then(|inner| inner.downcast_ref::<rustls::Error>()) else {
        return match err.kind() {
            std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::ConnectionReset => None,
            _ => Some(("handshake", err.to_string())),
        };
    };
    let reason = match tls {
        rustls::Error::NoCertificatesPresented => "no-certificate",
        rustls::Error::InvalidCertificate(CertificateError::Expired | CertificateError::ExpiredContext { .. }) => {
            "expired"
        }
        rustls::Error::InvalidCertificate(
            CertificateError::UnknownIssuer | CertificateError::BadSignature | CertificateError::BadEncoding,
        ) => "untrusted",
        _ => "handshake",
    };
    Some((reason, tls.to_string()))
}

/// A server verifier that checks the chain to the mesh's roots and the SPIFFE id, not a
/// host name: a leaf carries its service's identity, not its address.
#[derive(Debug)]
struct SpiffeVerifier {
    roots: Arc<RootCertStore>,
    expected: String,
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for SpiffeVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let parsed = rustls::server::ParsedCertificate::try_from(end_entity)?;
        rustls::client::verify_server_cert_signed_by_trust_anchor(
            &parsed,
            &self.roots,
            intermediates,
            now,
            self.provider.signature_verification_algorithms.all,
        )?;
        match spiffe_of(end_entity) {
            Some(id) if id == self.expected => Ok(ServerCertVerified::assertion()),
            Some(id) => Err(rustls::Error::General(format!("the server is {id}, not {}", self.expected))),
            None => Err(rustls::Error::General(format!("the server has no SPIFFE id; {} was expected", self.expected))),
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.provider.signature_verification_algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.provider.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider.signature_verification_algorithms.supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spiffe_id_names_its_service_only_in_its_own_trust_domain() {
        let id = "spiffe://mesh.example.org/ns/default/dc/dc1/svc/web";
        assert_eq!(service_of(id, "mesh.example.org").unwrap().as_str(), "web");
        assert!(service_of(id, "other.org").unwrap_err().contains("trust domain mesh.example.org"));
        assert!(service_of("spiffe://mesh.example.org/web", "mesh.example.org").is_err());
        assert!(service_of("https://mesh.example.org/ns/default/dc/dc1/svc/web", "mesh.example.org").is_err());
    }

    #[test]
    fn the_decisive_rule_is_named_in_a_denial() {
        let answer = IntentionsDto {
            default_intention: "deny".to_owned(),
            intentions: vec![crate::api::dto::IntentionDto {
                source: "web".to_owned(),
                destination: "db".to_owned(),
                action: "allow".to_owned(),
            }],
            index: 1,
        };
        let intentions = intentions_of(&answer).unwrap();
        let name = |n: &str| ServiceName::new(n).unwrap();
        assert_eq!(allowed(&intentions, &name("web"), &name("db")), Ok(()));
        let denied = allowed(&intentions, &name("api"), &name("db")).unwrap_err();
        assert!(denied.contains("default_intention"), "{denied}");
    }
}
