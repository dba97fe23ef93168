//! What tether writes into etcd, one typed record per kind of key, shared by the one writer
//! and every reader: a field added here is written and read alike, never guessed from an
//! untyped value on one side.
//!
//! - `<prefix>/status/<node>`: [`NodeRecord`], written by the publisher, read by
//!   `tether fleet status` and rollouts;
//! - `<prefix>/status/<node>/proxies/<proxy id>`: [`PublishedProxy`], the same;
//! - `<prefix>/instances/<service name>/<node>/<service id>`: [`Instance`], written by the
//!   publisher, read by the one `FleetInstances` of an agent (the templates' `instances(name)`,
//!   the xDS server's endpoints, the built-in proxies' upstreams);
//! - `<prefix>/intentions/<source>/<destination>`: [`IntentionRecord`], written by operators,
//!   read by every agent beside the intentions of its config files;
//! - `<prefix>/rollouts/<service id>`: [`RolloutRecord`], written and read by
//!   `tether fleet rollout`.
//!
//! Times are [`rfc3339`] strings, the API's format too. The key order of each record is its
//! fields' order, the order in which the reference lists them.

use std::collections::BTreeMap;
use std::time::SystemTime;

use serde::{Deserialize, Serialize};
use tether_state::{Entry, ListenAddress};

use crate::cli::OnFailure;

/// A time as the API and etcd's records show it: RFC 3339, UTC, to the second.
pub(crate) fn rfc3339(time: SystemTime) -> String {
    humantime::format_rfc3339_seconds(time).to_string()
}

/// A node's own record, under its agent's lease: it exists while the agent is up.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct NodeRecord {
    /// When the agent started ([`rfc3339`]).
    #[serde(default)]
    pub(crate) started_at: String,
    /// The agent's version.
    #[serde(default)]
    pub(crate) version: String,
    /// The etcd revision of the desired set that the agent's follower has applied.
    #[serde(default)]
    pub(crate) revision: i64,
}

/// One proxy as its node publishes it: what runs, never how (no command, environment or
/// token).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct PublishedProxy {
    /// The engine's state (`running`, `backoff`, ...).
    pub(crate) state: String,
    #[serde(default)]
    pub(crate) ready: bool,
    #[serde(default)]
    pub(crate) pid: Option<u32>,
    #[serde(default)]
    pub(crate) restarts: u64,
    /// When its instance started ([`rfc3339`]).
    #[serde(default)]
    pub(crate) since: Option<String>,
    #[serde(default)]
    pub(crate) error: Option<String>,
    /// The mod revision of the desired key that its running instance was started from;
    /// `None` for a proxy that does not come from etcd, or while nothing runs.
    #[serde(default)]
    pub(crate) revision: Option<i64>,
    #[serde(default)]
    pub(crate) address: Option<String>,
    #[serde(default)]
    pub(crate) port: Option<u16>,
    /// Its service's id.
    #[serde(default)]
    pub(crate) service: Option<String>,
    #[serde(default)]
    pub(crate) tags: Option<Vec<String>>,
    #[serde(default)]
    pub(crate) meta: Option<BTreeMap<String, String>>,
}

/// One ready instance of a service, as the fleet lists it for discovery and as a
/// template's `instances(name)` shows it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub(crate) struct Instance {
    /// The node it runs on; `None` for an agent's own catalog without a node name.
    pub(crate) node: Option<String>,
    pub(crate) id: String,
    pub(crate) address: String,
    pub(crate) port: Option<u16>,
    pub(crate) tags: Vec<String>,
    pub(crate) meta: BTreeMap<String, String>,
    /// Where its proxy's public listener takes connections (mutual TLS with `[connect]`):
    /// what another node's built-in proxy dials for an upstream. `None` for a service
    /// without a proxy that listens; absent from the records of older agents.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) mesh: Option<MeshAddress>,
}

/// Where an instance's proxy listens.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub(crate) struct MeshAddress {
    pub(crate) address: String,
    pub(crate) port: u16,
}

impl Instance {
    /// The instance of `entry`'s service on `node`.
    pub(crate) fn of(node: Option<&str>, entry: &Entry) -> Self {
        let service = &entry.service;
        Self {
            node: node.map(str::to_owned),
            id: service.id.as_str().to_owned(),
            address: service.address.clone(),
            port: service.port,
            tags: service.tags.clone(),
            meta: service.meta.clone(),
            mesh: mesh_address(entry),
        }
    }
}

/// Where an instance's proxy takes connections: its first TCP listener, when the agent holds
/// its listeners, else its `config.bind_port` on `config.bind_address` (the service's address
/// when the proxy listens on every address).
fn mesh_address(entry: &Entry) -> Option<MeshAddress> {
    let proxy = entry.proxy.as_ref()?;
    let spec = proxy.spec();
    for listener in &spec.listeners {
        if let ListenAddress::Tcp(target) = &listener.address {
            let (host, port) = target.as_str().rsplit_once(':')?;
            let address = host.trim_start_matches('[').trim_end_matches(']').to_owned();
            return Some(MeshAddress { address, port: port.parse().ok()? });
        }
    }
    let port = spec.config.get("bind_port").and_then(serde_json::Value::as_u64).and_then(|p| u16::try_from(p).ok())?;
    let address = spec.config.get("bind_address").and_then(serde_json::Value::as_str).unwrap_or("127.0.0.1");
    let address = match address {
        "0.0.0.0" | "::" | "[::]" => entry.service.address.clone(),
        "localhost" => "127.0.0.1".to_owned(),
        other => other.to_owned(),
    };
    Some(MeshAddress { address, port })
}

/// An intention as etcd keeps it: the key names the source and the destination (a service
/// name or `*`), the value says what the rule does.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct IntentionRecord {
    /// `allow` or `deny`.
    pub(crate) action: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) description: Option<String>,
}

/// A rollout as etcd keeps it, taken and moved in transactions so that a second rollout of
/// the same service is refused and a dead one can be resumed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RolloutRecord {
    /// Each service's value, by id, as `tether fleet put` writes it.
    pub(crate) services: BTreeMap<String, String>,
    pub(crate) nodes: Vec<String>,
    pub(crate) max_parallel: usize,
    pub(crate) wait_ms: u64,
    pub(crate) on_failure: OnFailure,
    /// The index in `nodes` of the first node of the batch in progress.
    pub(crate) next: usize,
    /// What the batch's keys held before it was written: node, then service id, then the
    /// value (`None`: no key).
    pub(crate) previous: BTreeMap<String, BTreeMap<String, Option<String>>>,
    /// When the rollout started ([`rfc3339`]).
    pub(crate) started_at: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_published_proxy_keeps_the_documented_keys_in_their_order() {
        let proxy = PublishedProxy {
            state: "running".to_owned(),
            ready: true,
            pid: Some(7),
            restarts: 1,
            since: Some(rfc3339(SystemTime::UNIX_EPOCH)),
            error: None,
            revision: Some(12),
            address: Some("127.0.0.1".to_owned()),
            port: Some(8080),
            service: Some("web".to_owned()),
            tags: Some(vec!["a".to_owned()]),
            meta: Some(BTreeMap::from([("k".to_owned(), "v".to_owned())])),
        };
        let text = serde_json::to_string(&proxy).unwrap();
        assert_eq!(
            text,
            r#"{"state":"running","ready":true,"pid":7,"restarts":1,"since":"1970-01-01T00:00:00Z","error":null,"revision":12,"address":"127.0.0.1","port":8080,"service":"web","tags":["a"],"meta":{"k":"v"}}"#
        );
        assert_eq!(serde_json::from_str::<PublishedProxy>(&text).unwrap(), proxy);
    }

    #[test]
    fn a_node_record_of_an_older_agent_reads_with_defaults() {
        let record: NodeRecord = serde_json::from_str(r#"{"started_at": "x"}"#).unwrap();
        assert_eq!(record.revision, 0);
        let text =
            serde_json::to_string(&NodeRecord { started_at: "t".into(), version: "1".into(), revision: 3 }).unwrap();
        assert_eq!(text, r#"{"started_at":"t","version":"1","revision":3}"#);
    }
}
