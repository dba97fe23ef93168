//! What Connect adds to a proxy's resources when the agent has a CA: the secrets (its
//! service's leaf and the trust roots, served over SDS on the same stream), the TLS of the
//! public listener and of the upstream clusters, and the RBAC filter built from the
//! intentions.
//!
//! Pure, as the rest of `resources`: the leaf, roots and intentions come in as values.
//! The leaf's private key is put only in the leaf secret, which only the stream of a proxy of
//! the leaf's own service is given (the caller's rule, `Xds::desired`).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3::transport_socket::ConfigType as SocketConfig;
use envoy_types::pb::envoy::config::core::v3::{DataSource, TransportSocket, data_source};
use envoy_types::pb::envoy::config::listener::v3::Filter;
use envoy_types::pb::envoy::config::listener::v3::filter::ConfigType;
use envoy_types::pb::envoy::config::rbac::v3::principal::{Authenticated, Identifier};
use envoy_types::pb::envoy::config::rbac::v3::rbac::Action;
use envoy_types::pb::envoy::config::rbac::v3::{Permission, Policy, Principal, Rbac, permission};
use envoy_types::pb::envoy::extensions::filters::network::rbac::v3::Rbac as RbacFilter;
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::common_tls_context::{
    CombinedCertificateValidationContext, ValidationContextType,
};
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::subject_alt_name_matcher::SanType;
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::{
    CertificateValidationContext, CommonTlsContext, DownstreamTlsContext, SdsSecretConfig, Secret,
    SubjectAltNameMatcher, TlsCertificate, UpstreamTlsContext, secret,
};
use envoy_types::pb::envoy::r#type::matcher::v3::string_matcher::MatchPattern;
use envoy_types::pb::envoy::r#type::matcher::v3::{RegexMatcher, StringMatcher};
use envoy_types::pb::google::protobuf::BoolValue;
use tether_state::{CaRoot, IntentionAction, IntentionTarget, Intentions, IssuedLeaf, ServiceName, TrustDomain};

use super::{ads, pack, stat_prefix};

/// The name of the secret that holds the trust roots.
pub(crate) const ROOTS_SECRET: &str = "roots";

/// The name of the network filter that enforces the intentions.
pub(crate) const RBAC_FILTER: &str = "envoy.filters.network.rbac";

/// The name of the single RBAC policy: one policy, so that its bytes (a map in the proto)
/// never depend on the order of a hash map.
const RBAC_POLICY: &str = "intentions";

/// The name of the secret that holds the leaf of the service `service_id`.
pub(crate) fn leaf_secret_name(service_id: &str) -> String {
    format!("leaf:{service_id}")
}

/// What a proxy needs of Connect: its service's identity and leaf, the roots, the
/// intentions, and the identity of each upstream's destination.
#[derive(Clone)]
pub(crate) struct Mesh {
    pub(crate) trust_domain: TrustDomain,
    /// The proxy's service, whose connections the intentions decide.
    pub(crate) service_name: ServiceName,
    /// The name of its leaf's secret ([`leaf_secret_name`]).
    pub(crate) leaf_secret: String,
    /// The service's leaf; `None` while it is not issued (Envoy's listeners and clusters that
    /// need it wait for it).
    pub(crate) leaf: Option<Arc<IssuedLeaf>>,
    pub(crate) roots: Arc<[CaRoot]>,
    pub(crate) intentions: Arc<Intentions>,
    /// The SPIFFE id of each upstream's destination, by destination name.
    pub(crate) destinations: BTreeMap<String, String>,
}

impl std::fmt::Debug for Mesh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The leaf holds a private key: only its serial is shown.
        f.debug_struct("Mesh")
            .field("service_name", &self.service_name)
            .field("leaf", &self.leaf.as_ref().map(|leaf| leaf.serial.as_str()))
            .field("roots", &self.roots.len())
            .finish_non_exhaustive()
    }
}

impl Mesh {
    /// The secrets, by name: the leaf (once issued) and the roots.
    pub(crate) fn secrets(&self) -> Vec<(String, Secret)> {
        let mut secrets = Vec::with_capacity(2);
        if let Some(leaf) = &self.leaf {
            let certificate = TlsCertificate {
                certificate_chain: Some(inline(&leaf.cert_pem)),
                private_key: Some(inline(leaf.key.expose())),
                ..TlsCertificate::default()
            };
            secrets.push((
                self.leaf_secret.clone(),
                Secret { name: self.leaf_secret.clone(), r#type: Some(secret::Type::TlsCertificate(certificate)) },
            ));
        }
        let trusted: String = self.roots.iter().map(|root| root.cert_pem.as_str()).collect::<Vec<_>>().join("\n");
        let validation = CertificateValidationContext { trusted_ca: Some(inline(&trusted)), ..Default::default() };
        secrets.push((
            ROOTS_SECRET.to_owned(),
            Secret { name: ROOTS_SECRET.to_owned(), r#type: Some(secret::Type::ValidationContext(validation)) },
        ));
        secrets
    }

    /// The public listener's TLS: the leaf, and a client certificate that chains to the
    /// roots, required.
    pub(crate) fn downstream_tls(&self) -> TransportSocket {
        let context = DownstreamTlsContext {
            common_tls_context: Some(CommonTlsContext {
                tls_certificate_sds_secret_configs: vec![sds(&self.leaf_secret)],
                validation_context_type: Some(ValidationContextType::ValidationContextSdsSecretConfig(sds(
                    ROOTS_SECRET,
                ))),
                ..CommonTlsContext::default()
            }),
            require_client_certificate: Some(BoolValue { value: true }),
            ..DownstreamTlsContext::default()
        };
        tls_socket(pack(context))
    }

    /// An upstream cluster's TLS to `destination`: the leaf as the client certificate, and a
    /// server that chains to the roots and carries the destination's SPIFFE id (`None` when
    /// the destination has none, which `Xds::desired` refuses before).
    pub(crate) fn upstream_tls(&self, destination: &str) -> Option<TransportSocket> {
        let spiffe_id = self.destinations.get(destination)?;
        let default_validation_context = CertificateValidationContext {
            match_typed_subject_alt_names: vec![SubjectAltNameMatcher {
                san_type: SanType::Uri as i32,
                matcher: Some(StringMatcher {
                    match_pattern: Some(MatchPattern::Exact(spiffe_id.clone())),
                    ..StringMatcher::default()
                }),
                ..SubjectAltNameMatcher::default()
            }],
            ..CertificateValidationContext::default()
        };
        let context = UpstreamTlsContext {
            common_tls_context: Some(CommonTlsContext {
                tls_certificate_sds_secret_configs: vec![sds(&self.leaf_secret)],
                validation_context_type: Some(ValidationContextType::CombinedValidationContext(
                    CombinedCertificateValidationContext {
                        default_validation_context: Some(default_validation_context),
                        validation_context_sds_secret_config: Some(sds(ROOTS_SECRET)),
                        ..CombinedCertificateValidationContext::default()
                    },
                )),
                ..CommonTlsContext::default()
            }),
            ..UpstreamTlsContext::default()
        };
        Some(tls_socket(pack(context)))
    }

    /// The RBAC network filter of the public listener, named by `listener` in its stats.
    pub(crate) fn rbac_filter(&self, listener: &str) -> Filter {
        let filter = RbacFilter {
            rules: Some(rbac(&self.intentions, &self.service_name, &self.trust_domain)),
            stat_prefix: format!("{}.", stat_prefix(listener)),
            ..RbacFilter::default()
        };
        Filter { name: RBAC_FILTER.to_owned(), config_type: Some(ConfigType::TypedConfig(pack(filter))) }
    }
}

/// The rules that let Envoy decide each connection to `destination` as
/// [`Intentions::decide`] does, which is what the built-in proxy asks.
///
/// Envoy's RBAC has one action and a list of principals, with no precedence between rules.
/// So the precedence is worked out here, as Consul's own xDS server does: every source that
/// a rule for this destination names exactly is decided, and so is any other source (the
/// wildcard rules, else the default). The sources whose verdict differs from that of any
/// other are listed as principals, and the action is the opposite of the others' verdict:
/// `DENY` the listed sources when the others are allowed, else `ALLOW` only them.
pub(crate) fn rbac(intentions: &Intentions, destination: &ServiceName, trust_domain: &TrustDomain) -> Rbac {
    let others = others_verdict(intentions, destination);
    let named: BTreeSet<&ServiceName> = intentions
        .rules()
        .iter()
        .filter(|rule| rule.destination().matches(destination))
        .filter_map(|rule| match rule.source() {
            IntentionTarget::Service(name) => Some(name),
            IntentionTarget::Any => None,
        })
        .collect();
    let principals: Vec<Principal> = named
        .into_iter()
        .filter(|source| intentions.decide(source, destination).action != others)
        .map(|source| principal(trust_domain, source))
        .collect();
    let action = match others {
        IntentionAction::Allow => Action::Deny,
        IntentionAction::Deny => Action::Allow,
    };
    let mut policies = HashMap::new();
    if !principals.is_empty() {
        let any = Permission { rule: Some(permission::Rule::Any(true)) };
        policies.insert(RBAC_POLICY.to_owned(), Policy { permissions: vec![any], principals, ..Policy::default() });
    }
    Rbac { action: action as i32, policies, ..Rbac::default() }
}

/// The verdict for a source that no rule names exactly. `*` stands for it: it is no service
/// name that a rule can name exactly (a rule's `*` is the wildcard) nor that a SPIFFE id can
/// carry, so only the wildcard rules and the default decide it.
fn others_verdict(intentions: &Intentions, destination: &ServiceName) -> IntentionAction {
    match ServiceName::new("*") {
        Ok(other) => intentions.decide(&other, destination).action,
        Err(_) => unreachable!("`*` is a valid service name"),
    }
}

/// A client whose certificate's URI SAN is the SPIFFE id of `source` in `trust_domain`, in
/// any namespace and datacenter (as the built-in proxy reads an identity).
fn principal(trust_domain: &TrustDomain, source: &ServiceName) -> Principal {
    let regex = format!(
        "^spiffe://{}/ns/[^/]+/dc/[^/]+/svc/{}$",
        regex_escape(trust_domain.as_str()),
        regex_escape(source.as_str())
    );
    let matcher = StringMatcher {
        match_pattern: Some(MatchPattern::SafeRegex(RegexMatcher { regex, ..RegexMatcher::default() })),
        ..StringMatcher::default()
    };
    Principal { identifier: Some(Identifier::Authenticated(Authenticated { principal_name: Some(matcher) })) }
}

/// `text` as a literal in an RE2 pattern.
fn regex_escape(text: &str) -> String {
    let mut escaped = String::with_capacity(text.len());
    for c in text.chars() {
        if "\\.+*?()|[]{}^$".contains(c) {
            escaped.push('\\');
        }
        escaped.push(c);
    }
    escaped
}

fn inline(text: &str) -> DataSource {
    DataSource { specifier: Some(data_source::Specifier::InlineString(text.to_owned())), ..DataSource::default() }
}

fn sds(name: &str) -> SdsSecretConfig {
    SdsSecretConfig { name: name.to_owned(), sds_config: Some(ads()) }
}

fn tls_socket(context: envoy_types::pb::google::protobuf::Any) -> TransportSocket {
    TransportSocket {
        name: "envoy.transport_sockets.tls".to_owned(),
        config_type: Some(SocketConfig::TypedConfig(context)),
    }
}

#[cfg(test)]
mod tests {
    use tether_state::Intention;

    use super::*;

    fn intentions(rules: &[(&str, &str, IntentionAction)], default: IntentionAction) -> Intentions {
        let rules = rules
            .iter()
            .map(|(source, destination, action)| {
                Intention::new(
                    IntentionTarget::parse(source).unwrap(),
                    IntentionTarget::parse(destination).unwrap(),
                    *action,
                )
            })
            .collect();
        Intentions::new(rules, default).unwrap()
    }

    /// The service a principal's pattern matches, read back from the one pattern it builds.
    fn principal_service(principal: &Principal) -> String {
        let Some(Identifier::Authenticated(Authenticated { principal_name: Some(matcher) })) = &principal.identifier
        else {
            panic!("an authenticated principal: {principal:?}")
        };
        let Some(MatchPattern::SafeRegex(regex)) = &matcher.match_pattern else { panic!("a regex: {matcher:?}") };
        let prefix = "^spiffe://mesh\\.example\\.org/ns/[^/]+/dc/[^/]+/svc/";
        let name = regex.regex.strip_prefix(prefix).and_then(|rest| rest.strip_suffix('$')).unwrap();
        name.replace('\\', "")
    }

    /// Whether Envoy lets `source` in under `rules`: a policy's principal matches, or none
    /// does, and the action says what that means.
    fn envoy_allows(rules: &Rbac, source: &str) -> bool {
        let matched = rules
            .policies
            .values()
            .flat_map(|policy| &policy.principals)
            .any(|principal| principal_service(principal) == source);
        match Action::try_from(rules.action).unwrap() {
            Action::Allow => matched,
            Action::Deny => !matched,
            Action::Log => panic!("no log action"),
        }
    }

    #[test]
    fn envoys_rules_give_the_verdict_of_the_intentions_precedence_for_every_source() {
        use IntentionAction::{Allow, Deny};
        let domain = TrustDomain::new("mesh.example.org").unwrap();
        type Rule<'a> = (&'a str, &'a str, IntentionAction);
        let tables: Vec<(Vec<Rule<'_>>, IntentionAction)> = vec![
            (vec![], Deny),
            (vec![], Allow),
            (vec![("web", "db", Allow)], Deny),
            (vec![("web", "db", Deny)], Allow),
            (vec![("*", "db", Deny), ("web", "db", Allow)], Allow),
            (vec![("*", "db", Allow), ("web", "db", Deny), ("api", "*", Deny)], Deny),
            (vec![("*", "*", Allow), ("web", "*", Deny), ("web", "db", Allow)], Deny),
            (vec![("api", "*", Allow), ("*", "db", Deny)], Allow),
            (vec![("web", "cache", Allow), ("api", "db", Allow)], Deny),
        ];
        let destination = ServiceName::new("db").unwrap();
        for (rules, default) in tables {
            let table = intentions(&rules, default);
            let envoy = rbac(&table, &destination, &domain);
            assert!(envoy.policies.len() <= 1, "one policy, so that its bytes are stable");
            for source in ["web", "api", "cache", "other", "db"] {
                let name = ServiceName::new(source).unwrap();
                let decided = table.decide(&name, &destination).action == Allow;
                assert_eq!(envoy_allows(&envoy, source), decided, "{source} -> db under {rules:?}, default {default}");
            }
        }
    }

    #[test]
    fn a_principal_pattern_escapes_the_trust_domain_and_the_name() {
        let domain = TrustDomain::new("mesh.example.org").unwrap();
        let found = principal(&domain, &ServiceName::new("a.b").unwrap());
        assert_eq!(principal_service(&found), "a.b");
        let Some(Identifier::Authenticated(Authenticated { principal_name: Some(matcher) })) = &found.identifier else {
            panic!()
        };
        let Some(MatchPattern::SafeRegex(regex)) = &matcher.match_pattern else { panic!() };
        assert!(regex.regex.ends_with("/svc/a\\.b$"), "{}", regex.regex);
    }

    #[test]
    fn the_leaf_secret_holds_the_key_and_the_roots_secret_every_root() {
        let leaf = IssuedLeaf {
            serial: "01".to_owned(),
            cert_pem: "LEAF".to_owned(),
            key: tether_state::PrivateKeyPem::new("KEY"),
            spiffe_id: tether_state::SpiffeId::service(
                &TrustDomain::new("mesh.example.org").unwrap(),
                &tether_state::Datacenter::default(),
                &ServiceName::new("web").unwrap(),
            )
            .unwrap(),
            not_before: std::time::SystemTime::UNIX_EPOCH,
            not_after: std::time::SystemTime::UNIX_EPOCH,
        };
        let root = |pem: &str| CaRoot {
            serial: pem.to_owned(),
            cert_pem: pem.to_owned(),
            not_after: std::time::SystemTime::UNIX_EPOCH,
            active: true,
        };
        let mesh = Mesh {
            trust_domain: TrustDomain::new("mesh.example.org").unwrap(),
            service_name: ServiceName::new("web").unwrap(),
            leaf_secret: leaf_secret_name("web"),
            leaf: Some(Arc::new(leaf)),
            roots: vec![root("ONE"), root("TWO")].into(),
            intentions: Arc::new(Intentions::default()),
            destinations: BTreeMap::new(),
        };
        assert!(!format!("{mesh:?}").contains("KEY"), "no key in Debug: {mesh:?}");
        let secrets = mesh.secrets();
        assert_eq!(secrets.iter().map(|(name, _)| name.as_str()).collect::<Vec<_>>(), ["leaf:web", ROOTS_SECRET]);
        let Some(secret::Type::TlsCertificate(certificate)) = &secrets[0].1.r#type else { panic!("a certificate") };
        assert_eq!(certificate.private_key, Some(inline("KEY")));
        let Some(secret::Type::ValidationContext(roots)) = &secrets[1].1.r#type else { panic!("roots") };
        assert_eq!(roots.trusted_ca, Some(inline("ONE\nTWO")));

        // Served: the secrets, and a public listener with TLS and the RBAC filter first.
        let config = super::super::EnvoyConfig {
            bind: "127.0.0.1:21000".parse().unwrap(),
            local_service: ("127.0.0.1".to_owned(), 8080),
            upstreams: Vec::new(),
        };
        let served = super::super::build_from(&config, &BTreeMap::new(), Some(&mesh));
        assert_eq!(served.of(super::super::Kind::Secret).keys().collect::<Vec<_>>(), ["leaf:web", ROOTS_SECRET]);
        assert!(!format!("{served:?}").contains("KEY"), "no key in Debug: {served:?}");
        let listener = &served.of(super::super::Kind::Listener)["public_listener:127.0.0.1:21000"];
        let listener = <envoy_types::pb::envoy::config::listener::v3::Listener as prost::Message>::decode(
            listener.value.as_slice(),
        )
        .unwrap();
        let chain = &listener.filter_chains[0];
        let names: Vec<&str> = chain.filters.iter().map(|filter| filter.name.as_str()).collect();
        assert_eq!(names, [RBAC_FILTER, "envoy.filters.network.tcp_proxy"]);
        assert_eq!(
            chain.transport_socket.as_ref().map(|socket| socket.name.as_str()),
            Some("envoy.transport_sockets.tls")
        );
    }
}
