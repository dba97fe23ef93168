//! What one proxy is served, from its config and the instances of its upstreams: names,
//! addresses, routes and versions, and the errors that name the key at fault.

use std::collections::BTreeMap;

use envoy_types::pb::envoy::config::cluster::v3::Cluster;
use envoy_types::pb::envoy::config::cluster::v3::cluster::{ClusterDiscoveryType, DiscoveryType};
use envoy_types::pb::envoy::config::core::v3::address::Address as AddressKind;
use envoy_types::pb::envoy::config::core::v3::socket_address::PortSpecifier;
use envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment;
use envoy_types::pb::envoy::config::endpoint::v3::lb_endpoint::HostIdentifier;
use envoy_types::pb::envoy::config::listener::v3::Listener;
use envoy_types::pb::envoy::config::listener::v3::filter::ConfigType;
use envoy_types::pb::envoy::extensions::filters::network::tcp_proxy::v3::TcpProxy;
use envoy_types::pb::envoy::extensions::filters::network::tcp_proxy::v3::tcp_proxy::ClusterSpecifier;
use prost::Message;
use serde_json::json;
use tether_state::{ServiceId, ServiceName};

use super::*;

fn service(port: Option<u16>) -> Service {
    let mut service = Service::new(ServiceId::new("web").unwrap(), ServiceName::new("web").unwrap());
    service.port = port;
    service
}

fn proxy() -> ProxyId {
    ProxyId::parse("web-proxy").unwrap()
}

fn config(value: serde_json::Value) -> tether_state::ProxyConfigMap {
    let serde_json::Value::Object(map) = value else { panic!("a table") };
    map
}

#[track_caller]
fn built(value: serde_json::Value, targets: &[(&str, &str, u16)]) -> ProxyResources {
    let mut by_name: BTreeMap<String, Vec<Target>> = BTreeMap::new();
    for (name, address, port) in targets {
        by_name.entry((*name).to_owned()).or_default().push(Target { address: (*address).to_owned(), port: *port });
    }
    build(&proxy(), &service(Some(8080)), &config(value), &by_name).unwrap()
}

#[track_caller]
fn refused(value: serde_json::Value, port: Option<u16>) -> String {
    build(&proxy(), &service(port), &config(value), &BTreeMap::new()).unwrap_err().to_string()
}

fn listener(resources: &ProxyResources, name: &str) -> Listener {
    Listener::decode(resources.of(Kind::Listener)[name].value.as_slice()).unwrap()
}

fn cluster(resources: &ProxyResources, name: &str) -> Cluster {
    Cluster::decode(resources.of(Kind::Cluster)[name].value.as_slice()).unwrap()
}

/// The addresses of a load assignment, as `ip:port`.
fn endpoints(resources: &ProxyResources, name: &str) -> Vec<String> {
    let assignment = ClusterLoadAssignment::decode(resources.of(Kind::Endpoint)[name].value.as_slice()).unwrap();
    assert_eq!(assignment.cluster_name, name);
    assignment
        .endpoints
        .iter()
        .flat_map(|locality| &locality.lb_endpoints)
        .map(|endpoint| {
            let Some(HostIdentifier::Endpoint(endpoint)) = &endpoint.host_identifier else { panic!("an endpoint") };
            let Some(AddressKind::SocketAddress(address)) = endpoint.address.as_ref().and_then(|a| a.address.clone())
            else {
                panic!("a socket address")
            };
            let Some(PortSpecifier::PortValue(port)) = address.port_specifier else { panic!("a port") };
            format!("{}:{port}", address.address)
        })
        .collect()
}

/// The listener's address and the cluster its tcp_proxy forwards to.
fn route(listener: &Listener) -> (String, String) {
    let Some(AddressKind::SocketAddress(address)) = listener.address.as_ref().and_then(|a| a.address.clone()) else {
        panic!("a socket address")
    };
    let Some(PortSpecifier::PortValue(port)) = address.port_specifier else { panic!("a port") };
    let filter = &listener.filter_chains[0].filters[0];
    assert_eq!(filter.name, "envoy.filters.network.tcp_proxy");
    let Some(ConfigType::TypedConfig(any)) = &filter.config_type else { panic!("a typed config") };
    let tcp_proxy = TcpProxy::decode(any.value.as_slice()).unwrap();
    let Some(ClusterSpecifier::Cluster(cluster)) = tcp_proxy.cluster_specifier else { panic!("a cluster") };
    (format!("{}:{port}", address.address), cluster)
}

#[test]
fn the_public_listener_forwards_to_the_local_service_through_an_eds_cluster() {
    let resources = built(json!({"bind_port": 21000}), &[]);
    let public = listener(&resources, "public_listener:127.0.0.1:21000");
    assert_eq!(route(&public), ("127.0.0.1:21000".to_owned(), LOCAL_CLUSTER.to_owned()));
    let local = cluster(&resources, LOCAL_CLUSTER);
    assert_eq!(local.cluster_discovery_type, Some(ClusterDiscoveryType::Type(DiscoveryType::Eds as i32)));
    assert_eq!(local.eds_cluster_config.unwrap().service_name, LOCAL_CLUSTER);
    assert_eq!(endpoints(&resources, LOCAL_CLUSTER), ["127.0.0.1:8080"]);
    assert_eq!(resources.of(Kind::Listener).len(), 1);
}

#[test]
fn bind_address_and_local_service_address_are_taken_from_the_config() {
    let resources =
        built(json!({"bind_address": "0.0.0.0", "bind_port": 21000, "local_service_address": "127.0.0.2:9090"}), &[]);
    let public = listener(&resources, "public_listener:0.0.0.0:21000");
    assert_eq!(route(&public).0, "0.0.0.0:21000");
    assert_eq!(endpoints(&resources, LOCAL_CLUSTER), ["127.0.0.2:9090"]);
}

#[test]
fn a_local_service_by_host_name_is_resolved_by_envoy() {
    let resources = built(json!({"bind_port": 21000, "local_service_address": "app.internal:9090"}), &[]);
    let local = cluster(&resources, LOCAL_CLUSTER);
    assert_eq!(local.cluster_discovery_type, Some(ClusterDiscoveryType::Type(DiscoveryType::StrictDns as i32)));
    assert!(!resources.of(Kind::Endpoint).contains_key(LOCAL_CLUSTER), "no EDS for a DNS cluster");
}

#[test]
fn each_upstream_gets_a_listener_and_its_destination_a_cluster_of_ready_instances() {
    let resources = built(
        json!({"bind_port": 21000, "upstreams": [
            {"destination_name": "db", "local_bind_port": 9191},
            {"destination_name": "db", "local_bind_address": "127.0.0.3", "local_bind_port": 9192, "destination_type": "service"},
            {"destination_name": "cache", "local_bind_port": 9193},
        ]}),
        &[("db", "127.0.0.1", 5432), ("db", "localhost", 5433), ("db", "db.example", 5434)],
    );
    let names: Vec<&String> = resources.of(Kind::Listener).keys().collect();
    assert_eq!(
        names,
        [
            "public_listener:127.0.0.1:21000",
            "upstream:cache:127.0.0.1:9193",
            "upstream:db:127.0.0.1:9191",
            "upstream:db:127.0.0.3:9192"
        ]
    );
    assert_eq!(route(&listener(&resources, "upstream:db:127.0.0.3:9192")).1, "service:db");
    assert_eq!(endpoints(&resources, "service:db"), ["127.0.0.1:5432", "127.0.0.1:5433"], "a host name is left out");
    assert_eq!(endpoints(&resources, "service:cache"), Vec::<String>::new(), "no instance, no endpoint");
    let clusters: Vec<&String> = resources.of(Kind::Cluster).keys().collect();
    assert_eq!(clusters, [LOCAL_CLUSTER, "service:cache", "service:db"]);
}

#[test]
fn the_same_inputs_give_the_same_versions_and_a_change_another() {
    let one = built(json!({"bind_port": 21000}), &[]);
    let again = built(json!({"bind_port": 21000}), &[]);
    for kind in Kind::ALL {
        assert_eq!(version(one.of(kind), &[]), version(again.of(kind), &[]), "{kind}");
    }
    let moved = built(json!({"bind_port": 21000, "local_service_address": "127.0.0.1:8081"}), &[]);
    assert_eq!(version(one.of(Kind::Listener), &[]), version(moved.of(Kind::Listener), &[]));
    assert_ne!(version(one.of(Kind::Endpoint), &[]), version(moved.of(Kind::Endpoint), &[]));
}

#[test]
fn bad_config_is_refused_naming_the_proxy_and_the_key() {
    assert_eq!(
        refused(json!({}), Some(8080)),
        "proxy web-proxy: config.bind_port: is required: the port of the proxy's public listener"
    );
    assert!(
        refused(json!({"bind_port": 0}), Some(8080))
            .starts_with("proxy web-proxy: config.bind_port: must be a TCP port")
    );
    assert!(
        refused(json!({"bind_port": 21000, "bind_address": "example.org"}), Some(8080))
            .starts_with("proxy web-proxy: config.bind_address: \"example.org\" is not an IP address")
    );
    assert_eq!(
        refused(json!({"bind_port": 21000}), None),
        "proxy web-proxy: config.local_service_address: is required when the service web has no port"
    );
    assert!(
        refused(json!({"bind_port": 21000, "local_service_address": "nope"}), Some(8080))
            .starts_with("proxy web-proxy: config.local_service_address: \"nope\" is not HOST:PORT")
    );
    assert!(
        refused(json!({"bind_port": 21000, "upstreams": [{"local_bind_port": 9191}]}), Some(8080))
            .starts_with("proxy web-proxy: config.upstreams[0].destination_name: is required")
    );
    assert!(
        refused(json!({"bind_port": 21000, "upstreams": [{"destination_name": "db", "local_bind_port": 9191, "datacenter": "x"}]}), Some(8080))
            .starts_with("proxy web-proxy: config.upstreams[0].datacenter: unknown key")
    );
    assert!(
        refused(json!({"bind_port": 21000, "upstreams": [{"destination_name": "db", "destination_type": "prepared_query", "local_bind_port": 1}]}), Some(8080))
            .starts_with("proxy web-proxy: config.upstreams[0].destination_type: must be \"service\"")
    );
    assert_eq!(
        refused(
            json!({"bind_port": 21000, "upstreams": [{"destination_name": "db", "local_bind_port": 21000}]}),
            Some(8080)
        ),
        "proxy web-proxy: config.upstreams[0].local_bind_port: 127.0.0.1:21000 is already the address of bind_port"
    );
    assert!(
        refused(json!({"bind_port": 21000, "upstreams": {"db": 1}}), Some(8080))
            .starts_with("proxy web-proxy: config.upstreams: must be an array of tables")
    );
}

#[test]
fn kinds_go_by_their_type_urls() {
    for kind in Kind::ALL {
        assert_eq!(Kind::from_type_url(&kind.type_url()), Some(kind));
    }
    assert_eq!(Kind::Cluster.type_url(), "type.googleapis.com/envoy.config.cluster.v3.Cluster");
    assert_eq!(Kind::from_type_url("type.googleapis.com/envoy.config.route.v3.RouteConfiguration"), None);
}
