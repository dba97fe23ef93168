//! What the agent serves one Envoy: its listeners, clusters and endpoints, built from the
//! proxy's service, its `config` and the ready instances of its upstreams.
//!
//! A pure function of its inputs: no I/O, no clock, no lock. The same inputs give the same
//! bytes, so that a resource type's version (a hash of what is sent) says whether anything
//! changed, across streams and across agent restarts.

use std::collections::BTreeMap;
use std::fmt;
use std::hash::{Hash, Hasher};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::config::cluster::v3::cluster::{ClusterDiscoveryType, DiscoveryType, EdsClusterConfig};
use envoy_types::pb::envoy::config::core::v3::address::Address as AddressKind;
use envoy_types::pb::envoy::config::core::v3::config_source::ConfigSourceSpecifier;
use envoy_types::pb::envoy::config::core::v3::socket_address::PortSpecifier;
use envoy_types::pb::envoy::config::core::v3::{
    Address, AggregatedConfigSource, ApiVersion, ConfigSource, SocketAddress,
};
use envoy_types::pb::envoy::config::endpoint::v3::lb_endpoint::HostIdentifier;
use envoy_types::pb::envoy::config::endpoint::v3::{ClusterLoadAssignment, Endpoint, LbEndpoint, LocalityLbEndpoints};
use envoy_types::pb::envoy::config::listener::v3::filter::ConfigType;
use envoy_types::pb::envoy::config::listener::v3::{Filter, FilterChain, Listener};
use envoy_types::pb::envoy::extensions::filters::network::tcp_proxy::v3::TcpProxy;
use envoy_types::pb::envoy::extensions::filters::network::tcp_proxy::v3::tcp_proxy::ClusterSpecifier;
use envoy_types::pb::envoy::extensions::transport_sockets::tls::v3::Secret;
use envoy_types::pb::google::protobuf::{Any, Duration as ProtoDuration};
use prost::{Message, Name};
use serde_json::Value;
use tether_state::{ProxyId, Service};

pub(crate) use mesh::{Mesh, leaf_secret_name};

/// The resource types the agent serves, in the order it sends them: a cluster exists before
/// its endpoints, and both, with the secrets they name, before a listener that names the
/// cluster.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum Kind {
    Cluster,
    Endpoint,
    /// SDS: the leaf and the roots, with `[connect]`.
    Secret,
    Listener,
}

impl Kind {
    /// Every kind, in the order of sending.
    pub(crate) const ALL: [Kind; 4] = [Kind::Cluster, Kind::Endpoint, Kind::Secret, Kind::Listener];

    /// Whether Envoy asks for resources of this kind by name (endpoints, secrets), rather
    /// than for all of them.
    pub(crate) fn named(self) -> bool {
        matches!(self, Kind::Endpoint | Kind::Secret)
    }

    /// The type URL of its resources, as Envoy asks for them.
    pub(crate) fn type_url(self) -> String {
        match self {
            Kind::Cluster => Cluster::type_url(),
            Kind::Endpoint => ClusterLoadAssignment::type_url(),
            Kind::Secret => Secret::type_url(),
            Kind::Listener => Listener::type_url(),
        }
    }

    /// The kind whose type URL is `url`.
    pub(crate) fn from_type_url(url: &str) -> Option<Kind> {
        Kind::ALL.into_iter().find(|kind| kind.type_url() == url)
    }

    /// Its name in metrics and the status: `cluster`, `endpoint`, `secret`, `listener`.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Kind::Cluster => "cluster",
            Kind::Endpoint => "endpoint",
            Kind::Secret => "secret",
            Kind::Listener => "listener",
        }
    }

    pub(crate) fn index(self) -> usize {
        self as usize
    }
}

/// The cluster of the local service.
pub(crate) const LOCAL_CLUSTER: &str = "local_app";

/// How long Envoy may take to connect to an endpoint.
const CONNECT_TIMEOUT_SECONDS: i64 = 5;

/// A ready instance of an upstream's destination: where it listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Target {
    pub(crate) address: String,
    pub(crate) port: u16,
}

/// One resource type's resources, by name.
pub(crate) type Resources = BTreeMap<String, Any>;

/// Everything one proxy is served, by kind.
#[derive(Clone, Default, PartialEq)]
pub(crate) struct ProxyResources {
    by_kind: [Resources; Kind::ALL.len()],
}

impl fmt::Debug for ProxyResources {
    /// The names only: a leaf secret's bytes hold its private key.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut map = f.debug_map();
        for kind in Kind::ALL {
            map.entry(&kind.as_str(), &self.of(kind).keys().collect::<Vec<_>>());
        }
        map.finish()
    }
}

impl ProxyResources {
    /// The resources of `kind`.
    pub(crate) fn of(&self, kind: Kind) -> &Resources {
        &self.by_kind[kind.index()]
    }

    fn insert(&mut self, kind: Kind, name: String, resource: Any) {
        self.by_kind[kind.index()].insert(name, resource);
    }
}

/// The version of a set of resources: a hash of their names and bytes (and, for a type
/// whose resources Envoy asks for by name, of the names asked for), as 16 hex digits.
pub(crate) fn version<'a>(resources: impl IntoIterator<Item = (&'a String, &'a Any)>, asked: &[String]) -> String {
    // SipHash with fixed keys: the same resources give the same version in every agent.
    #[allow(deprecated)]
    let mut hasher = std::hash::SipHasher::new();
    for (name, resource) in resources {
        name.hash(&mut hasher);
        resource.type_url.hash(&mut hasher);
        resource.value.hash(&mut hasher);
    }
    asked.hash(&mut hasher);
    format!("{:016x}", hasher.finish())
}

/// Why a proxy's `config` cannot be served: the proxy, the key and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("proxy {proxy}: config.{field}: {problem}")]
pub(crate) struct ConfigError {
    pub(crate) proxy: ProxyId,
    pub(crate) field: String,
    pub(crate) problem: String,
}

/// One entry of `config.upstreams`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Upstream {
    /// The service name whose ready instances it reaches.
    pub(crate) destination_name: String,
    pub(crate) local_bind_address: IpAddr,
    pub(crate) local_bind_port: u16,
}

/// A proxy's `config`, as the xDS server reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct EnvoyConfig {
    /// Where the public listener listens.
    pub(crate) bind: SocketAddr,
    /// Where it forwards to: an address and port, or a host name and port.
    pub(crate) local_service: (String, u16),
    pub(crate) upstreams: Vec<Upstream>,
}

impl EnvoyConfig {
    /// Reads the keys of `config` that the xDS server serves (the built-in proxy's
    /// `bind_address`, `bind_port` and `local_service_address`, and `upstreams`); other keys
    /// are left alone, as `config` is the proxy's.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] naming the proxy and the key.
    pub(crate) fn read(
        proxy: &ProxyId,
        service: &Service,
        config: &tether_state::ProxyConfigMap,
    ) -> Result<Self, ConfigError> {
        let error =
            |field: &str, problem: String| ConfigError { proxy: proxy.clone(), field: field.to_owned(), problem };
        let bind_address = match config.get("bind_address") {
            None => IpAddr::V4(Ipv4Addr::LOCALHOST),
            Some(value) => ip_address(value).map_err(|problem| error("bind_address", problem))?,
        };
        let bind_port = match config.get("bind_port") {
            None => return Err(error("bind_port", "is required: the port of the proxy's public listener".to_owned())),
            Some(value) => port(value).map_err(|problem| error("bind_port", problem))?,
        };
        let local_service = match config.get("local_service_address") {
            Some(Value::String(address)) => {
                host_port(address).map_err(|problem| error("local_service_address", problem))?
            }
            Some(other) => {
                return Err(error("local_service_address", format!("must be a string HOST:PORT, not {other}")));
            }
            None => match service.port {
                Some(port) => (service.address.clone(), port),
                None => {
                    return Err(error(
                        "local_service_address",
                        format!("is required when the service {} has no port", service.id),
                    ));
                }
            },
        };
        let upstreams = read_upstreams(config).map_err(|(field, problem)| error(&field, problem))?;
        let mut seen = BTreeMap::new();
        let bind = SocketAddr::new(bind_address, bind_port);
        seen.insert(bind, "bind_port".to_owned());
        for (at, upstream) in upstreams.iter().enumerate() {
            let address = SocketAddr::new(upstream.local_bind_address, upstream.local_bind_port);
            if let Some(first) = seen.insert(address, format!("upstreams[{at}]")) {
                return Err(error(
                    &format!("upstreams[{at}].local_bind_port"),
                    format!("{address} is already the address of {first}"),
                ));
            }
        }
        Ok(Self { bind, local_service, upstreams })
    }
}

/// `config.upstreams`, as Envoy's listeners and the built-in proxy's both read it; an error
/// names the key (`upstreams[0].local_bind_port`) and the problem.
pub(crate) fn read_upstreams(config: &tether_state::ProxyConfigMap) -> Result<Vec<Upstream>, (String, String)> {
    match config.get("upstreams") {
        None => Ok(Vec::new()),
        Some(Value::Array(entries)) => entries
            .iter()
            .enumerate()
            .map(|(at, entry)| upstream(entry).map_err(|(key, problem)| (format!("upstreams[{at}]{key}"), problem)))
            .collect(),
        Some(other) => Err(("upstreams".to_owned(), format!("must be an array of tables, not {other}"))),
    }
}

fn ip_address(value: &Value) -> Result<IpAddr, String> {
    let Value::String(text) = value else { return Err(format!("must be a string, an IP address, not {value}")) };
    if text == "localhost" {
        return Ok(IpAddr::V4(Ipv4Addr::LOCALHOST));
    }
    text.parse().map_err(|_| format!("{text:?} is not an IP address (Envoy listens on addresses, not names)"))
}

fn port(value: &Value) -> Result<u16, String> {
    value
        .as_u64()
        .and_then(|port| u16::try_from(port).ok())
        .filter(|port| *port > 0)
        .ok_or_else(|| format!("must be a TCP port, 1 to 65535, not {value}"))
}

/// `HOST:PORT`, an IPv6 host in brackets.
fn host_port(text: &str) -> Result<(String, u16), String> {
    if let Ok(address) = text.parse::<SocketAddr>() {
        return Ok((address.ip().to_string(), address.port()));
    }
    let (host, port) = text.rsplit_once(':').ok_or_else(|| format!("{text:?} is not HOST:PORT"))?;
    let port =
        port.parse::<u16>().ok().filter(|port| *port > 0).ok_or_else(|| format!("{text:?} has no valid port"))?;
    if host.is_empty() || host.contains(':') || host.contains(char::is_whitespace) {
        return Err(format!("{text:?} is not HOST:PORT"));
    }
    Ok((host.to_owned(), port))
}

/// One `upstreams` entry; an error names the key within the entry (`.local_bind_port`).
fn upstream(entry: &Value) -> Result<Upstream, (String, String)> {
    let Value::Object(table) = entry else { return Err((String::new(), format!("must be a table, not {entry}"))) };
    for key in table.keys() {
        if !matches!(key.as_str(), "destination_name" | "destination_type" | "local_bind_address" | "local_bind_port") {
            return Err((
                format!(".{key}"),
                "unknown key; an upstream has destination_name, destination_type, local_bind_address and local_bind_port"
                    .to_owned(),
            ));
        }
    }
    let destination_name = match table.get("destination_name") {
        Some(Value::String(name)) if !name.is_empty() && !name.chars().any(char::is_control) => name.clone(),
        Some(other) => return Err((".destination_name".to_owned(), format!("must be a service name, not {other}"))),
        None => return Err((".destination_name".to_owned(), "is required: the service name to reach".to_owned())),
    };
    match table.get("destination_type") {
        None => {}
        Some(Value::String(kind)) if kind == "service" => {}
        Some(other) => return Err((".destination_type".to_owned(), format!("must be \"service\", not {other}"))),
    }
    let local_bind_address = match table.get("local_bind_address") {
        None => IpAddr::V4(Ipv4Addr::LOCALHOST),
        Some(value) => ip_address(value).map_err(|problem| (".local_bind_address".to_owned(), problem))?,
    };
    let local_bind_port = match table.get("local_bind_port") {
        None => {
            return Err((".local_bind_port".to_owned(), "is required: the port the upstream listens on".to_owned()));
        }
        Some(value) => port(value).map_err(|problem| (".local_bind_port".to_owned(), problem))?,
    };
    Ok(Upstream { destination_name, local_bind_address, local_bind_port })
}

/// The name of the public listener: it carries its address, so that a new address is a new
/// listener (Envoy does not move a listener), and the old one drains.
pub(crate) fn public_listener_name(bind: SocketAddr) -> String {
    format!("public_listener:{bind}")
}

/// The cluster of an upstream's destination.
pub(crate) fn upstream_cluster_name(destination: &str) -> String {
    format!("service:{destination}")
}

/// The listener of an upstream.
pub(crate) fn upstream_listener_name(upstream: &Upstream) -> String {
    format!(
        "upstream:{}:{}",
        upstream.destination_name,
        SocketAddr::new(upstream.local_bind_address, upstream.local_bind_port)
    )
}

/// A stat prefix Envoy takes as it is: the name with anything but `[A-Za-z0-9_.-]` as `_`.
fn stat_prefix(name: &str) -> String {
    name.chars().map(|c| if c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-') { c } else { '_' }).collect()
}

/// [`build_from`], for a `config` not read yet.
///
/// # Errors
///
/// [`ConfigError`] when its `config` cannot be served.
#[cfg(test)]
pub(crate) fn build(
    proxy: &ProxyId,
    service: &Service,
    config: &tether_state::ProxyConfigMap,
    targets: &BTreeMap<String, Vec<Target>>,
) -> Result<ProxyResources, ConfigError> {
    let config = EnvoyConfig::read(proxy, service, config)?;
    Ok(build_from(&config, targets, None))
}

/// What a proxy is served, for its config as [`EnvoyConfig::read`] read it and the ready
/// `targets` of each upstream's destination (by destination name; a name absent is a
/// destination with no instance). With `mesh` (the agent has a CA), the public listener takes
/// mutual TLS only and enforces the intentions, the upstream clusters speak mutual TLS to
/// their destination's identity, and the leaf and roots are served as secrets.
pub(crate) fn build_from(
    config: &EnvoyConfig,
    targets: &BTreeMap<String, Vec<Target>>,
    mesh: Option<&Mesh>,
) -> ProxyResources {
    let mut resources = ProxyResources::default();
    let (host, port) = &config.local_service;
    let local_ip = resolve_literal(host);
    let local_cluster = match local_ip {
        Some(ip) => {
            resources.insert(
                Kind::Endpoint,
                LOCAL_CLUSTER.to_owned(),
                pack(load_assignment(LOCAL_CLUSTER, &[(ip.to_string(), *port)])),
            );
            eds_cluster(LOCAL_CLUSTER)
        }
        // A host name: Envoy resolves it (and follows its changes), so it is no EDS cluster.
        None => dns_cluster(LOCAL_CLUSTER, host, *port),
    };
    resources.insert(Kind::Cluster, LOCAL_CLUSTER.to_owned(), pack(local_cluster));
    let public = public_listener_name(config.bind);
    let mut public_listener = tcp_listener(&public, config.bind, LOCAL_CLUSTER);
    if let Some(mesh) = mesh {
        for (name, secret) in mesh.secrets() {
            resources.insert(Kind::Secret, name, pack(secret));
        }
        let chain = &mut public_listener.filter_chains[0];
        chain.filters.insert(0, mesh.rbac_filter(&public));
        chain.transport_socket = Some(mesh.downstream_tls());
    }
    resources.insert(Kind::Listener, public.clone(), pack(public_listener));
    for upstream in &config.upstreams {
        let cluster = upstream_cluster_name(&upstream.destination_name);
        if !resources.of(Kind::Cluster).contains_key(&cluster) {
            let mut upstream_cluster = eds_cluster(&cluster);
            upstream_cluster.transport_socket = mesh.and_then(|mesh| mesh.upstream_tls(&upstream.destination_name));
            resources.insert(Kind::Cluster, cluster.clone(), pack(upstream_cluster));
            let endpoints: Vec<(String, u16)> = targets
                .get(&upstream.destination_name)
                .into_iter()
                .flatten()
                .filter_map(|target| resolve_literal(&target.address).map(|ip| (ip.to_string(), target.port)))
                .collect();
            resources.insert(Kind::Endpoint, cluster.clone(), pack(load_assignment(&cluster, &endpoints)));
        }
        let address = SocketAddr::new(upstream.local_bind_address, upstream.local_bind_port);
        let name = upstream_listener_name(upstream);
        resources.insert(Kind::Listener, name.clone(), pack(tcp_listener(&name, address, &cluster)));
    }
    resources
}

/// An IP address for `host`: itself when it is one, the loopback for `localhost`; `None`
/// for any other name.
fn resolve_literal(host: &str) -> Option<IpAddr> {
    if host == "localhost" {
        return Some(IpAddr::V4(Ipv4Addr::LOCALHOST));
    }
    host.trim_start_matches('[').trim_end_matches(']').parse().ok()
}

fn pack<T: Message + Name>(message: T) -> Any {
    Any { type_url: T::type_url(), value: message.encode_to_vec() }
}

fn socket_address(ip: &str, port: u16) -> Address {
    Address {
        address: Some(AddressKind::SocketAddress(SocketAddress {
            address: ip.to_owned(),
            port_specifier: Some(PortSpecifier::PortValue(u32::from(port))),
            ..SocketAddress::default()
        })),
    }
}

fn ads() -> ConfigSource {
    ConfigSource {
        resource_api_version: ApiVersion::V3 as i32,
        config_source_specifier: Some(ConfigSourceSpecifier::Ads(AggregatedConfigSource {})),
        ..ConfigSource::default()
    }
}

fn connect_timeout() -> Option<ProtoDuration> {
    Some(ProtoDuration { seconds: CONNECT_TIMEOUT_SECONDS, nanos: 0 })
}

fn eds_cluster(name: &str) -> Cluster {
    Cluster {
        name: name.to_owned(),
        alt_stat_name: stat_prefix(name),
        cluster_discovery_type: Some(ClusterDiscoveryType::Type(DiscoveryType::Eds as i32)),
        eds_cluster_config: Some(EdsClusterConfig { eds_config: Some(ads()), service_name: name.to_owned() }),
        connect_timeout: connect_timeout(),
        ..Cluster::default()
    }
}

fn dns_cluster(name: &str, host: &str, port: u16) -> Cluster {
    Cluster {
        name: name.to_owned(),
        alt_stat_name: stat_prefix(name),
        cluster_discovery_type: Some(ClusterDiscoveryType::Type(DiscoveryType::StrictDns as i32)),
        load_assignment: Some(load_assignment(name, &[(host.to_owned(), port)])),
        connect_timeout: connect_timeout(),
        ..Cluster::default()
    }
}

fn load_assignment(cluster: &str, endpoints: &[(String, u16)]) -> ClusterLoadAssignment {
    let lb_endpoints = endpoints
        .iter()
        .map(|(ip, port)| LbEndpoint {
            host_identifier: Some(HostIdentifier::Endpoint(Endpoint {
                address: Some(socket_address(ip, *port)),
                ..Endpoint::default()
            })),
            ..LbEndpoint::default()
        })
        .collect();
    ClusterLoadAssignment {
        cluster_name: cluster.to_owned(),
        endpoints: vec![LocalityLbEndpoints { lb_endpoints, ..LocalityLbEndpoints::default() }],
        ..ClusterLoadAssignment::default()
    }
}

fn tcp_listener(name: &str, address: SocketAddr, cluster: &str) -> Listener {
    let tcp_proxy = TcpProxy {
        stat_prefix: stat_prefix(name),
        cluster_specifier: Some(ClusterSpecifier::Cluster(cluster.to_owned())),
        ..TcpProxy::default()
    };
    Listener {
        name: name.to_owned(),
        stat_prefix: stat_prefix(name),
        address: Some(socket_address(&address.ip().to_string(), address.port())),
        filter_chains: vec![FilterChain {
            filters: vec![Filter {
                name: "envoy.filters.network.tcp_proxy".to_owned(),
                config_type: Some(ConfigType::TypedConfig(pack(tcp_proxy))),
            }],
            ..FilterChain::default()
        }],
        ..Listener::default()
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

mod mesh;

#[cfg(test)]
mod tests;
