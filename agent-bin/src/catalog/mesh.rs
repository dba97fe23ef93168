//! Where the instances of a service take mutual TLS: the one answer that the built-in
//! proxies' upstream endpoint and the xDS server's upstream clusters share.

use tether_state::{Entry, ListenAddress, LocalState, ProxyId, ServiceName};

/// One instance of a destination whose proxy is ready: the service id, and where its proxy
/// listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct MeshInstance {
    pub(crate) service_id: String,
    pub(crate) address: String,
    pub(crate) port: u16,
}

/// The instances of `destination` in `catalog` whose proxy `ready` says is ready, at their
/// proxy's mutual TLS address ([`mesh_address`]).
pub(crate) fn mesh_instances(
    catalog: &LocalState,
    destination: &ServiceName,
    ready: impl Fn(&ProxyId) -> bool,
) -> Vec<MeshInstance> {
    catalog
        .entries()
        .iter()
        .filter(|entry| entry.service.name == *destination)
        .filter(|entry| entry.proxy.as_ref().is_some_and(|proxy| ready(proxy.id())))
        .filter_map(|entry| {
            let (address, port) = mesh_address(entry)?;
            Some(MeshInstance { service_id: entry.service.id.to_string(), address, port })
        })
        .collect()
}

/// Where an instance's proxy takes mutual TLS: its first TCP listener, when the agent holds
/// its listeners, else its `config.bind_port` on `config.bind_address` (the service's address
/// when the proxy listens on every address).
fn mesh_address(entry: &Entry) -> Option<(String, u16)> {
    let proxy = entry.proxy.as_ref()?;
    let spec = proxy.spec();
    for listener in &spec.listeners {
        if let ListenAddress::Tcp(target) = &listener.address {
            let (host, port) = target.as_str().rsplit_once(':')?;
            return Some((host.trim_start_matches('[').trim_end_matches(']').to_owned(), port.parse().ok()?));
        }
    }
    let port = spec.config.get("bind_port").and_then(serde_json::Value::as_u64).and_then(|p| u16::try_from(p).ok())?;
    let address = spec.config.get("bind_address").and_then(serde_json::Value::as_str).unwrap_or("127.0.0.1");
    let address = match address {
        "0.0.0.0" | "::" | "[::]" => entry.service.address.clone(),
        "localhost" => "127.0.0.1".to_owned(),
        other => other.to_owned(),
    };
    Some((address, port))
}
