//! The identity of a service in the mesh ([`SpiffeId`]) and the certificates that carry it,
//! as values: what a certificate authority is asked for ([`LeafRequest`]) and what it answers
//! ([`IssuedLeaf`], [`CaRoot`]).
//!
//! Nothing here parses or signs anything: the PEM text is carried as it was made, beside
//! the figures read from it. A private key is a [`PrivateKeyPem`], which never shows its
//! text through `Debug`, `Display` or serde.

use std::fmt;
use std::time::SystemTime;

use super::{Datacenter, TrustDomain};
use crate::id::ServiceId;
use crate::service::ServiceName;

/// A service's SPIFFE id, in Consul's layout:
/// `spiffe://<trust domain>/ns/default/dc/<datacenter>/svc/<service name>`.
///
/// A SPIFFE path segment holds only letters, digits, `.`, `-` and `_`, so a service whose
/// name holds anything else (a space, a `/`) has no identity.
///
/// ```
/// use tether_state::{Datacenter, ServiceName, SpiffeId, TrustDomain};
///
/// let domain = TrustDomain::new("mesh.example.org").unwrap();
/// let web = ServiceName::new("web").unwrap();
/// let id = SpiffeId::service(&domain, &Datacenter::default(), &web).unwrap();
/// assert_eq!(id.as_str(), "spiffe://mesh.example.org/ns/default/dc/dc1/svc/web");
///
/// let spaced = ServiceName::new("web frontend").unwrap();
/// assert!(SpiffeId::service(&domain, &Datacenter::default(), &spaced).is_err());
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct SpiffeId(Box<str>);

/// A service name that cannot be a segment of a SPIFFE id.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("service name {name:?} cannot be part of a SPIFFE id: it may only contain letters, digits, `.`, `-` and `_`")]
pub struct SpiffeNameError {
    /// The name.
    pub name: String,
}

impl SpiffeId {
    /// The identity of the service `name` in `trust_domain` and `datacenter`.
    ///
    /// # Errors
    ///
    /// [`SpiffeNameError`] when the name holds a character that a SPIFFE path may not.
    pub fn service(
        trust_domain: &TrustDomain,
        datacenter: &Datacenter,
        name: &ServiceName,
    ) -> Result<Self, SpiffeNameError> {
        let segment = name.as_str();
        let valid = !matches!(segment, "." | "..")
            && segment.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_'));
        if !valid {
            return Err(SpiffeNameError { name: segment.to_owned() });
        }
        Ok(Self(format!("spiffe://{trust_domain}/ns/default/dc/{datacenter}/svc/{segment}").into_boxed_str()))
    }

    /// The URI.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for SpiffeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for SpiffeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

/// A private key in PEM. Its text is reached only through [`PrivateKeyPem::expose`]:
/// `Debug` shows `<redacted>`, and it has no `Display` and no serde, so that a log line, a
/// status or an event never carries it by accident.
#[derive(Clone, PartialEq, Eq)]
pub struct PrivateKeyPem(Box<str>);

impl PrivateKeyPem {
    /// Wraps the PEM text of a private key.
    pub fn new(pem: impl Into<String>) -> Self {
        Self(pem.into().into_boxed_str())
    }

    /// The PEM text, for the one place that hands it to its owner.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for PrivateKeyPem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("PrivateKeyPem(<redacted>)")
    }
}

/// What a certificate authority is asked to sign: a leaf for one instance of a service.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeafRequest {
    /// The instance the leaf is for.
    pub service_id: ServiceId,
    /// The identity it carries in its URI SAN.
    pub spiffe_id: SpiffeId,
    /// How long it is valid from now.
    pub ttl: std::time::Duration,
}

/// A leaf certificate and its private key, as a certificate authority issued them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IssuedLeaf {
    /// The serial number, as lowercase hex pairs separated by `:`.
    pub serial: String,
    /// The certificate, PEM.
    pub cert_pem: String,
    /// Its private key.
    pub key: PrivateKeyPem,
    /// The identity it carries.
    pub spiffe_id: SpiffeId,
    /// When it becomes valid.
    pub not_before: SystemTime,
    /// When it stops being valid.
    pub not_after: SystemTime,
}

/// A root certificate that the mesh trusts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CaRoot {
    /// The serial number, as [`IssuedLeaf::serial`].
    pub serial: String,
    /// The certificate, PEM.
    pub cert_pem: String,
    /// When it stops being valid.
    pub not_after: SystemTime,
    /// Whether the leaves issued now chain to it: exactly one root is active, the others
    /// are trusted beside it while a root is rotated in or out.
    pub active: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(name: &str) -> Result<SpiffeId, SpiffeNameError> {
        let domain = TrustDomain::new("example.org").unwrap();
        SpiffeId::service(&domain, &Datacenter::new("eu-1").unwrap(), &ServiceName::new(name).unwrap())
    }

    #[test]
    fn a_spiffe_id_follows_consuls_layout() {
        assert_eq!(id("db.v2_a-b").unwrap().as_str(), "spiffe://example.org/ns/default/dc/eu-1/svc/db.v2_a-b");
    }

    #[test]
    fn names_that_a_spiffe_path_cannot_hold_are_refused() {
        for name in ["a/b", "a b", "..", ".", "é", "a%20", "a?b", "a#b"] {
            let err = id(name).unwrap_err();
            assert_eq!(err.name, name);
            assert!(err.to_string().contains("SPIFFE"), "{err}");
        }
    }

    #[test]
    fn a_private_key_never_shows_in_debug() {
        let key = PrivateKeyPem::new("-----BEGIN PRIVATE KEY-----\nsecret\n-----END PRIVATE KEY-----\n");
        let shown = format!("{key:?}");
        assert!(!shown.contains("secret"), "{shown}");
        let leaf = IssuedLeaf {
            serial: "01".into(),
            cert_pem: String::new(),
            key,
            spiffe_id: id("web").unwrap(),
            not_before: SystemTime::UNIX_EPOCH,
            not_after: SystemTime::UNIX_EPOCH,
        };
        assert!(!format!("{leaf:?}").contains("secret"));
        assert!(leaf.key.expose().contains("secret"));
    }
}
