//! Connect's vocabulary: who a service is in the mesh ([`TrustDomain`], [`Datacenter`]),
//! where its certificates come from ([`CaConfig`], [`CaProvider`], [`PemPath`], [`LeafTtl`]),
//! what a certificate authority signs ([`SpiffeId`], [`LeafRequest`], [`IssuedLeaf`], [`CaRoot`]),
//! and who may talk to whom ([`Intention`], [`IntentionTarget`], [`IntentionAction`]), with
//! the one precedence rule that decides a connection, [`Intentions::decide`].
//!
//! This module is pure: it reads no file and performs no cryptography (a key it carries was
//! made elsewhere, and is never shown). The
//! config loader builds these values from `[connect]` and `[[intention]]` tables; every value
//! here is valid by construction.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::service::ServiceName;

mod certs;

pub use certs::{CaRoot, IssuedLeaf, LeafRequest, PrivateKeyPem, SpiffeId, SpiffeNameError};

/// The datacenter of a service's identity when the config names none.
pub const DEFAULT_DATACENTER: &str = "dc1";

/// What decides a connection that no intention matches, when the config does not say.
pub const DEFAULT_INTENTION: IntentionAction = IntentionAction::Deny;

/// The longest trust domain, in bytes.
pub const MAX_TRUST_DOMAIN_LEN: usize = 255;

/// The rule every datacenter name must follow, as shown in error messages.
pub const DATACENTER_RULE: &str = "^[a-z0-9_-]{1,64}$";

/// The wildcard of an intention's `source` or `destination`: every service.
pub const WILDCARD: &str = "*";

/// A value of the Connect vocabulary that breaks its rule.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectValueError {
    /// A trust domain that is not a valid SPIFFE trust domain.
    #[error("invalid trust domain {domain:?}: {reason}")]
    TrustDomain {
        /// The rejected input, escaped when shown.
        domain: String,
        /// Which part of the rule it breaks.
        reason: &'static str,
    },
    /// A datacenter name that breaks [`DATACENTER_RULE`].
    #[error("invalid datacenter {name:?}: {reason} (datacenters must match {DATACENTER_RULE})")]
    Datacenter {
        /// The rejected input, escaped when shown.
        name: String,
        /// Which part of the rule it breaks.
        reason: &'static str,
    },
    /// A path of a certificate or key that is not an absolute path of a file.
    #[error("invalid path {path:?}: it must be an absolute path of a file")]
    PemPath {
        /// The rejected input.
        path: PathBuf,
    },
    /// A leaf certificate lifetime outside [`LeafTtl::MIN`] to [`LeafTtl::MAX`].
    #[error(
        "leaf_ttl of {} is {reason}: it must be {} to {}",
        humantime::format_duration(*.ttl),
        humantime::format_duration(LeafTtl::MIN),
        humantime::format_duration(LeafTtl::MAX)
    )]
    LeafTtl {
        /// The rejected lifetime.
        ttl: Duration,
        /// `too short` or `too long`.
        reason: &'static str,
    },
    /// An intention's `source` or `destination` that names no service.
    #[error("invalid service name {name:?} in an intention: {reason}")]
    IntentionTarget {
        /// The rejected input, escaped when shown.
        name: String,
        /// Which part of the rule it breaks.
        reason: &'static str,
    },
    /// An intention's description that cannot be shown on one line.
    #[error("invalid description: {reason}")]
    Description {
        /// Which part of the rule it breaks.
        reason: &'static str,
    },
}

/// A SPIFFE trust domain: the `example.org` of `spiffe://example.org/...`.
///
/// Lowercase letters, digits, `.`, `-` and `_`; not empty; at most [`MAX_TRUST_DOMAIN_LEN`]
/// bytes. No scheme, port or path: those belong to a SPIFFE id, not to its trust domain.
///
/// ```
/// use tether_state::TrustDomain;
///
/// assert_eq!(TrustDomain::new("mesh.example.org").unwrap().as_str(), "mesh.example.org");
/// let err = TrustDomain::new("spiffe://example.org").unwrap_err();
/// assert!(err.to_string().contains("scheme"), "{err}");
/// assert!(TrustDomain::new("Example.org").is_err());
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct TrustDomain(Box<str>);

impl TrustDomain {
    /// Validates `domain`.
    ///
    /// # Errors
    ///
    /// [`ConnectValueError::TrustDomain`] naming the part of the rule it breaks.
    pub fn new(domain: impl Into<String>) -> Result<Self, ConnectValueError> {
        let domain = domain.into();
        match check_trust_domain(&domain) {
            Ok(()) => Ok(Self(domain.into_boxed_str())),
            Err(reason) => Err(ConnectValueError::TrustDomain { domain, reason }),
        }
    }

    /// The trust domain as a string.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// The SPIFFE rule for trust domains, with a reason that says what to write instead.
fn check_trust_domain(domain: &str) -> Result<(), &'static str> {
    if domain.is_empty() {
        return Err("it is empty");
    }
    if domain.len() > MAX_TRUST_DOMAIN_LEN {
        return Err("it is longer than 255 bytes");
    }
    if domain.contains("://") {
        return Err("it has a scheme: write the trust domain alone, such as \"example.org\"");
    }
    if domain.contains('/') {
        return Err("it has a path: write the trust domain alone, such as \"example.org\"");
    }
    if domain.contains(':') {
        return Err("it has a port: a trust domain is a name, not an address");
    }
    if domain.bytes().any(|b| b.is_ascii_uppercase()) {
        return Err("it has uppercase letters: SPIFFE trust domains are lowercase");
    }
    if !domain.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'.' | b'-' | b'_')) {
        return Err("it may only contain lowercase letters, digits, `.`, `-` and `_`");
    }
    Ok(())
}

/// The datacenter of a service's identity (`.../dc/<datacenter>/...`): [`DATACENTER_RULE`].
///
/// ```
/// use tether_state::Datacenter;
///
/// assert_eq!(Datacenter::default().as_str(), "dc1");
/// assert!(Datacenter::new("eu-west_2").is_ok());
/// assert!(Datacenter::new("EU West").is_err());
/// ```
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Datacenter(Box<str>);

impl Datacenter {
    /// The longest datacenter name, in bytes.
    pub const MAX_LEN: usize = 64;

    /// Validates `name`.
    ///
    /// # Errors
    ///
    /// [`ConnectValueError::Datacenter`] naming the part of the rule it breaks.
    pub fn new(name: impl Into<String>) -> Result<Self, ConnectValueError> {
        let name = name.into();
        let reason = if name.is_empty() {
            Some("it is empty")
        } else if name.len() > Self::MAX_LEN {
            Some("it is longer than 64 bytes")
        } else if !name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'-' | b'_')) {
            Some("it may only contain lowercase letters, digits, `-` and `_`")
        } else {
            None
        };
        match reason {
            Some(reason) => Err(ConnectValueError::Datacenter { name, reason }),
            None => Ok(Self(name.into_boxed_str())),
        }
    }

    /// The name as a string.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl Default for Datacenter {
    fn default() -> Self {
        Self(DEFAULT_DATACENTER.into())
    }
}

/// Shows a string newtype as its string, and debugs it as a quoted string.
macro_rules! name_traits {
    ($ty:ident) => {
        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl fmt::Debug for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Debug::fmt(&*self.0, f)
            }
        }
    };
}

name_traits!(TrustDomain);
name_traits!(Datacenter);

/// The absolute path of a PEM file: a CA certificate, its key, or a trusted root.
///
/// Only the path is checked here; the file is read where certificates are made.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PemPath(PathBuf);

impl PemPath {
    /// Checks that `path` is absolute, names a file (not `/` or a path ending in `..`) and
    /// holds no NUL byte.
    ///
    /// # Errors
    ///
    /// [`ConnectValueError::PemPath`].
    pub fn new(path: impl Into<PathBuf>) -> Result<Self, ConnectValueError> {
        let path = path.into();
        let nul = path.as_os_str().as_encoded_bytes().contains(&0);
        if !path.is_absolute() || path.file_name().is_none() || nul {
            return Err(ConnectValueError::PemPath { path });
        }
        Ok(Self(path))
    }

    /// The path.
    pub fn as_path(&self) -> &Path {
        &self.0
    }
}

/// How long a service's leaf certificate is valid: [`LeafTtl::MIN`] to [`LeafTtl::MAX`],
/// [`LeafTtl::DEFAULT`] unless the config says otherwise.
///
/// ```
/// use std::time::Duration;
/// use tether_state::LeafTtl;
///
/// assert_eq!(LeafTtl::default().get(), Duration::from_secs(72 * 3600));
/// assert!(LeafTtl::new(Duration::from_secs(1)).is_err());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LeafTtl(Duration);

impl LeafTtl {
    /// Three days, as Consul's built-in CA.
    pub const DEFAULT: Duration = Duration::from_secs(72 * 3600);

    /// The shortest lifetime. A leaf is renewed at 60 to 80 % of its life, so this bounds
    /// renewals to one every 6 seconds per service at most.
    pub const MIN: Duration = Duration::from_secs(10);

    /// The longest lifetime: a year (`1y`, 365.25 days). A stolen key should not outlive that.
    pub const MAX: Duration = Duration::from_secs(31_557_600);

    /// Checks `ttl` against the bounds.
    ///
    /// # Errors
    ///
    /// [`ConnectValueError::LeafTtl`] when it is shorter than [`LeafTtl::MIN`] or longer
    /// than [`LeafTtl::MAX`].
    pub fn new(ttl: Duration) -> Result<Self, ConnectValueError> {
        if ttl < Self::MIN {
            return Err(ConnectValueError::LeafTtl { ttl, reason: "too short" });
        }
        if ttl > Self::MAX {
            return Err(ConnectValueError::LeafTtl { ttl, reason: "too long" });
        }
        Ok(Self(ttl))
    }

    /// The lifetime.
    pub fn get(self) -> Duration {
        self.0
    }
}

impl Default for LeafTtl {
    fn default() -> Self {
        Self(Self::DEFAULT)
    }
}

/// Where the certificate authority's certificate and key come from.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum CaProvider {
    /// The operator's CA: a certificate and its private key, both PEM.
    File {
        /// The CA certificate.
        cert_file: PemPath,
        /// The CA's private key.
        key_file: PemPath,
    },
    /// A CA that the agent makes for itself in its data dir.
    Dev,
}

impl CaProvider {
    /// The provider's name, as the config spells it: `file` or `dev`.
    pub fn name(&self) -> &'static str {
        match self {
            Self::File { .. } => "file",
            Self::Dev => "dev",
        }
    }
}

/// The `[connect.ca]` table: the CA, the roots trusted beside it, and the leaves' lifetime.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CaConfig {
    /// Where the CA comes from.
    pub provider: CaProvider,
    /// More root certificates to trust, beside the CA's own: a root being rotated in or out.
    pub roots: Vec<PemPath>,
    /// The lifetime of each service's leaf certificate.
    pub leaf_ttl: LeafTtl,
}

impl CaConfig {
    /// A CA from `provider`, with no extra roots and the default leaf lifetime.
    pub fn new(provider: CaProvider) -> Self {
        Self { provider, roots: Vec::new(), leaf_ttl: LeafTtl::default() }
    }
}

/// The `[connect]` table: the identity every service gets, its CA, and what decides a
/// connection that no intention matches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectConfig {
    /// The trust domain of every identity.
    pub trust_domain: TrustDomain,
    /// The datacenter of every identity.
    pub datacenter: Datacenter,
    /// The certificate authority.
    pub ca: CaConfig,
    /// What decides a connection that no intention matches.
    pub default_intention: IntentionAction,
}

impl ConnectConfig {
    /// A config for `trust_domain` with `ca`, and every other default.
    pub fn new(trust_domain: TrustDomain, ca: CaConfig) -> Self {
        Self { trust_domain, datacenter: Datacenter::default(), ca, default_intention: DEFAULT_INTENTION }
    }
}

/// Whether an intention lets a connection through.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IntentionAction {
    /// The connection is let through.
    Allow,
    /// The connection is refused.
    Deny,
}

impl IntentionAction {
    /// The action's name, as the config spells it: `allow` or `deny`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Allow => "allow",
            Self::Deny => "deny",
        }
    }

    /// The action named `name`, if there is one.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "allow" => Some(Self::Allow),
            "deny" => Some(Self::Deny),
            _ => None,
        }
    }
}

impl fmt::Display for IntentionAction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The `source` or `destination` of an intention: one service, by name, or every service.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum IntentionTarget {
    /// `*`: every service.
    Any,
    /// The services of this name.
    Service(ServiceName),
}

impl IntentionTarget {
    /// Reads `*` or a service name. A name that holds `*` beside other characters is
    /// refused: only a whole `*` is a wildcard.
    ///
    /// # Errors
    ///
    /// [`ConnectValueError::IntentionTarget`] for an empty or invalid name, or a partial
    /// wildcard.
    pub fn parse(raw: &str) -> Result<Self, ConnectValueError> {
        if raw == WILDCARD {
            return Ok(Self::Any);
        }
        let refuse = |reason| ConnectValueError::IntentionTarget { name: raw.to_owned(), reason };
        if raw.contains('*') {
            return Err(refuse("`*` is a wildcard only on its own; it cannot match part of a name"));
        }
        ServiceName::new(raw).map(Self::Service).map_err(|err| refuse(err.reason))
    }

    /// Whether `name` is one of the services this target names.
    pub fn matches(&self, name: &ServiceName) -> bool {
        match self {
            Self::Any => true,
            Self::Service(own) => own == name,
        }
    }

    /// Whether this is a single service rather than the wildcard.
    pub fn is_exact(&self) -> bool {
        matches!(self, Self::Service(_))
    }
}

impl fmt::Display for IntentionTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Any => f.write_str(WILDCARD),
            Self::Service(name) => f.write_str(name.as_str()),
        }
    }
}

/// How precise an intention is. The more precise of two matching intentions decides, and a
/// precise destination outweighs a precise source (Consul's order).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Precedence {
    /// `*` to `*`.
    AnyToAny,
    /// A service to `*`.
    ExactToAny,
    /// `*` to a service.
    AnyToExact,
    /// A service to a service.
    ExactToExact,
}

/// One rule: may `source` open connections to `destination`?
///
/// ```
/// use tether_state::{Intention, IntentionAction, IntentionTarget, Precedence};
///
/// let rule = Intention::new(
///     IntentionTarget::parse("web").unwrap(),
///     IntentionTarget::parse("*").unwrap(),
///     IntentionAction::Deny,
/// );
/// assert_eq!(rule.to_string(), "web -> *");
/// assert_eq!(rule.precedence(), Precedence::ExactToAny);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Intention {
    source: IntentionTarget,
    destination: IntentionTarget,
    action: IntentionAction,
    description: Option<Box<str>>,
}

impl Intention {
    /// The longest description, in bytes.
    pub const MAX_DESCRIPTION_LEN: usize = 1024;

    /// A rule without a description.
    pub fn new(source: IntentionTarget, destination: IntentionTarget, action: IntentionAction) -> Self {
        Self { source, destination, action, description: None }
    }

    /// The same rule with a description: at most [`Intention::MAX_DESCRIPTION_LEN`] bytes,
    /// without control characters, so that it shows on one line.
    ///
    /// # Errors
    ///
    /// [`ConnectValueError::Description`].
    pub fn with_description(mut self, description: impl Into<String>) -> Result<Self, ConnectValueError> {
        let description = description.into();
        check_description(&description)?;
        self.description = Some(description.into_boxed_str());
        Ok(self)
    }

    /// Who opens the connection.
    pub fn source(&self) -> &IntentionTarget {
        &self.source
    }

    /// Who is connected to.
    pub fn destination(&self) -> &IntentionTarget {
        &self.destination
    }

    /// Whether the connection is let through.
    pub fn action(&self) -> IntentionAction {
        self.action
    }

    /// The operator's note, if any.
    pub fn description(&self) -> Option<&str> {
        self.description.as_deref()
    }

    /// How precise the rule is.
    pub fn precedence(&self) -> Precedence {
        match (self.destination.is_exact(), self.source.is_exact()) {
            (true, true) => Precedence::ExactToExact,
            (true, false) => Precedence::AnyToExact,
            (false, true) => Precedence::ExactToAny,
            (false, false) => Precedence::AnyToAny,
        }
    }

    /// Whether the rule applies to a connection from `source` to `destination`.
    pub fn matches(&self, source: &ServiceName, destination: &ServiceName) -> bool {
        self.source.matches(source) && self.destination.matches(destination)
    }
}

/// The rule of [`Intention::with_description`].
pub(crate) fn check_description(description: &str) -> Result<(), ConnectValueError> {
    if description.len() > Intention::MAX_DESCRIPTION_LEN {
        return Err(ConnectValueError::Description { reason: "it is longer than 1024 bytes" });
    }
    if description.chars().any(char::is_control) {
        return Err(ConnectValueError::Description { reason: "it contains control characters" });
    }
    Ok(())
}

/// Shows the pair, `source -> destination`.
impl fmt::Display for Intention {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} -> {}", self.source, self.destination)
    }
}

/// Two or more rules about the same source and destination: which one decides would depend
/// on their order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DuplicateIntentions {
    /// The first duplicated pair, `source -> destination`.
    pair: String,
    /// Each duplicate as (index of the first rule of its pair, index of the duplicate), in
    /// the order of the duplicates: at least one.
    pairs: Vec<(usize, usize)>,
}

impl fmt::Display for DuplicateIntentions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (first, second) = self.pairs[0];
        write!(f, "intention {} is defined twice (rules {first} and {second})", self.pair)?;
        if self.pairs.len() > 1 {
            write!(f, ", and {} more rule(s) repeat a pair", self.pairs.len() - 1)?;
        }
        Ok(())
    }
}

impl std::error::Error for DuplicateIntentions {}

impl DuplicateIntentions {
    /// Each duplicate, as the index of the first rule with its source and destination and
    /// the index of the rule that repeats them, in the order of the repeats.
    pub fn pairs(&self) -> &[(usize, usize)] {
        &self.pairs
    }
}

/// Every intention, and what decides a connection that none matches.
///
/// ```
/// use tether_state::{Intention, IntentionAction, IntentionTarget, Intentions, ServiceName};
///
/// let rule = |source: &str, destination: &str, action| {
///     Intention::new(IntentionTarget::parse(source).unwrap(), IntentionTarget::parse(destination).unwrap(), action)
/// };
/// let intentions = Intentions::new(
///     vec![rule("*", "db", IntentionAction::Deny), rule("web", "db", IntentionAction::Allow)],
///     IntentionAction::Deny,
/// )
/// .unwrap();
/// let name = |n: &str| ServiceName::new(n).unwrap();
///
/// let decision = intentions.decide(&name("web"), &name("db"));
/// assert_eq!(decision.action, IntentionAction::Allow);
/// assert_eq!(decision.rule.unwrap().to_string(), "web -> db");
///
/// let decision = intentions.decide(&name("api"), &name("cache"));
/// assert_eq!((decision.action, decision.rule), (IntentionAction::Deny, None));
/// ```
#[derive(Debug, Clone)]
pub struct Intentions {
    /// In the order given.
    rules: Vec<Intention>,
    default: IntentionAction,
    /// The rules with an exact destination, by destination.
    by_destination: HashMap<ServiceName, SourceIndex>,
    /// The rules whose destination is `*`.
    any_destination: SourceIndex,
}

/// The rules of one destination (or of `*`), by source: indices into `Intentions::rules`.
#[derive(Debug, Clone, Default)]
struct SourceIndex {
    by_source: HashMap<ServiceName, usize>,
    any_source: Option<usize>,
}

impl SourceIndex {
    /// The most precise rule of this destination for `source`.
    fn find(&self, source: &ServiceName) -> Option<usize> {
        self.by_source.get(source).copied().or(self.any_source)
    }
}

/// What decides a connection: the action, and the rule that chose it, or `None` when no rule
/// matches and the default decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Decision<'a> {
    /// Let through or refused.
    pub action: IntentionAction,
    /// The most precise matching rule, or `None` for the default.
    pub rule: Option<&'a Intention>,
}

impl Intentions {
    /// The rules, each source and destination pair at most once, and the default.
    ///
    /// # Errors
    ///
    /// [`DuplicateIntentions`] naming every rule that repeats the source and destination
    /// of an earlier one.
    pub fn new(rules: Vec<Intention>, default: IntentionAction) -> Result<Self, DuplicateIntentions> {
        let mut intentions = Self {
            rules: Vec::new(),
            default,
            by_destination: HashMap::new(),
            any_destination: SourceIndex::default(),
        };
        let mut duplicates = Vec::new();
        for (index, rule) in rules.iter().enumerate() {
            let slot = match &rule.destination {
                IntentionTarget::Any => &mut intentions.any_destination,
                IntentionTarget::Service(name) => intentions.by_destination.entry(name.clone()).or_default(),
            };
            // The first rule of a pair stays the one indexed, so that each duplicate names it.
            let earlier = match &rule.source {
                IntentionTarget::Any => match slot.any_source {
                    Some(first) => Some(first),
                    None => {
                        slot.any_source = Some(index);
                        None
                    }
                },
                IntentionTarget::Service(name) => match slot.by_source.entry(name.clone()) {
                    Entry::Occupied(first) => Some(*first.get()),
                    Entry::Vacant(vacant) => {
                        vacant.insert(index);
                        None
                    }
                },
            };
            if let Some(first) = earlier {
                duplicates.push((first, index));
            }
        }
        if let Some(&(first, _)) = duplicates.first() {
            return Err(DuplicateIntentions { pair: rules[first].to_string(), pairs: duplicates });
        }
        intentions.rules = rules;
        Ok(intentions)
    }

    /// No rule: the default decides every connection.
    pub fn empty(default: IntentionAction) -> Self {
        Self { rules: Vec::new(), default, by_destination: HashMap::new(), any_destination: SourceIndex::default() }
    }

    /// The rules, in the order given.
    pub fn rules(&self) -> &[Intention] {
        &self.rules
    }

    /// What decides a connection that no rule matches.
    pub fn default_action(&self) -> IntentionAction {
        self.default
    }

    /// Whether `source` may open a connection to `destination`: the most precise matching
    /// rule decides (see [`Precedence`]), and without one, the default.
    ///
    /// At most four lookups, whatever the number of rules.
    pub fn decide(&self, source: &ServiceName, destination: &ServiceName) -> Decision<'_> {
        let index = self
            .by_destination
            .get(destination)
            .and_then(|rules| rules.find(source))
            .or_else(|| self.any_destination.find(source));
        match index {
            Some(index) => {
                let rule = &self.rules[index];
                Decision { action: rule.action, rule: Some(rule) }
            }
            None => Decision { action: self.default, rule: None },
        }
    }
}

impl Default for Intentions {
    /// No rule, and [`DEFAULT_INTENTION`].
    fn default() -> Self {
        Self::empty(DEFAULT_INTENTION)
    }
}

#[cfg(test)]
mod tests;
