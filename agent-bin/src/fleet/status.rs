//! `tether fleet status`: every node's desired services and what its agent publishes, read
//! from etcd directly (no agent needed), with an exit code a deploy script can use.
//!
//! A node is `up` while its agent's status key lives (under the agent's lease), `down` when
//! it has desired keys but no status. A proxy that an up node still publishes as started
//! from a desired key that no longer exists is `removing`. The command succeeds when every
//! desired proxy of every up node runs the revision of its desired key and is ready, and no
//! proxy is `removing`, and fails while any node with desired keys is `down`, so that a
//! script's `tether fleet status || alert` sees a dead host.

use std::collections::BTreeMap;
use std::io::Write;
use std::process::ExitCode;

use tether_state::ServiceId;

use super::etcd_failure;
pub(crate) use crate::etcd::PublishedProxy;
use crate::etcd::{self, EtcdError, EtcdOptions, NodeRecord, RolloutRecord, timed};

/// One node: its desired services (by id, with the mod revision of each key) and, while its
/// agent is up, what it publishes.
#[derive(Debug, Clone, Default)]
pub(crate) struct NodeView {
    pub(crate) desired: BTreeMap<String, i64>,
    /// The node's status key's `revision`, while it is up.
    pub(crate) up: Option<i64>,
    /// Published proxies, by proxy id.
    pub(crate) proxies: BTreeMap<String, PublishedProxy>,
}

impl NodeView {
    /// The proxy of desired service `id`, as published.
    pub(crate) fn proxy_of(&self, id: &str) -> Option<&PublishedProxy> {
        let proxy = ServiceId::new(id).ok()?.proxy_id();
        self.proxies.get(proxy.as_str())
    }

    /// Whether the node is up and its proxy of `id` runs desired revision `revision` and is
    /// ready.
    pub(crate) fn runs(&self, id: &str, revision: i64) -> bool {
        self.up.is_some() && self.proxy_of(id).is_some_and(|proxy| proxy.ready && proxy.revision == Some(revision))
    }
}

/// The whole fleet as etcd holds it now.
pub(crate) type FleetView = BTreeMap<String, NodeView>;

/// Reads every node's desired keys and status keys under `prefix`.
///
/// # Errors
///
/// An [`EtcdError`] when etcd cannot be asked.
pub(crate) async fn read(options: &EtcdOptions, client: &etcd::Client, prefix: &str) -> Result<FleetView, EtcdError> {
    let mut view = FleetView::new();
    let nodes_prefix = format!("{prefix}/nodes/");
    let desired = timed(options, "read", client.get_prefix(&nodes_prefix)).await?;
    for kv in &desired.kvs {
        let key = String::from_utf8_lossy(&kv.key);
        let Some(rest) = key.strip_prefix(&nodes_prefix) else { continue };
        let Some((node, id)) = rest.split_once("/services/") else { continue };
        view.entry(node.to_owned()).or_default().desired.insert(id.to_owned(), kv.mod_revision);
    }
    let status_prefix = format!("{prefix}/status/");
    let published = timed(options, "read", client.get_prefix(&status_prefix)).await?;
    for kv in &published.kvs {
        let key = String::from_utf8_lossy(&kv.key);
        let Some(rest) = key.strip_prefix(&status_prefix) else { continue };
        match rest.split_once("/proxies/") {
            None if !rest.contains('/') => {
                // A record that does not parse still says that the node is up.
                let revision = serde_json::from_slice::<NodeRecord>(&kv.value).map_or(0, |record| record.revision);
                view.entry(rest.to_owned()).or_default().up = Some(revision);
            }
            Some((node, proxy)) => {
                // A value that does not parse is shown as such rather than dropped.
                let parsed = serde_json::from_slice::<PublishedProxy>(&kv.value).unwrap_or_else(|err| PublishedProxy {
                    state: "invalid".to_owned(),
                    error: Some(format!("{key}: {err}")),
                    ..PublishedProxy::default()
                });
                view.entry(node.to_owned()).or_default().proxies.insert(proxy.to_owned(), parsed);
            }
            None => {}
        }
    }
    Ok(view)
}

/// The state shown for a proxy that runs from a desired key that was deleted.
const REMOVING: &str = "removing";

/// One row of the table or of `--json`.
#[derive(Debug, serde::Serialize)]
pub(crate) struct Row {
    proxy: String,
    service: Option<String>,
    state: Option<String>,
    ready: bool,
    pid: Option<u32>,
    restarts: u64,
    desired_revision: Option<i64>,
    running_revision: Option<i64>,
    error: Option<String>,
}

/// One node of `--json`, and of the API's `GET /v1/agent/fleet/nodes`.
#[derive(Debug, serde::Serialize)]
pub(crate) struct NodeRow {
    node: String,
    state: &'static str,
    revision: Option<i64>,
    proxies: Vec<Row>,
}

/// The rows of `view`, filtered; and whether every desired proxy runs its desired revision
/// and is ready on a node that is up (a node that is down, with desired keys, fails it).
fn rows(view: &FleetView, node: Option<&str>, service: Option<&str>) -> (Vec<NodeRow>, bool) {
    let mut all_good = true;
    let mut nodes = Vec::new();
    for (name, seen) in view {
        if node.is_some_and(|wanted| wanted != name) {
            continue;
        }
        let mut proxies = Vec::new();
        let mut ids: BTreeMap<String, Option<String>> = BTreeMap::new();
        for id in seen.desired.keys() {
            let proxy = ServiceId::new(id).map_or_else(|_| id.clone(), |id| id.proxy_id().to_string());
            ids.insert(proxy, Some(id.clone()));
        }
        for (proxy, published) in &seen.proxies {
            ids.entry(proxy.clone()).or_insert_with(|| published.service.clone());
        }
        for (proxy, service_id) in ids {
            let service_id = service_id.or_else(|| seen.proxies.get(&proxy).and_then(|p| p.service.clone()));
            if service.is_some_and(|wanted| service_id.as_deref() != Some(wanted)) {
                continue;
            }
            let desired = service_id.as_deref().and_then(|id| seen.desired.get(id).copied());
            let published = seen.up.and(seen.proxies.get(&proxy));
            // A desired proxy fails the check unless its node is up and runs it: a down node
            // fails it too, since what it should run is not known to run.
            if let (Some(id), Some(revision)) = (service_id.as_deref(), desired) {
                if !seen.runs(id, revision) {
                    all_good = false;
                }
            }
            // Started from a desired key (it has a revision) that is gone: not converged until
            // the agent has stopped it and taken its status key away.
            let removing = desired.is_none() && published.is_some_and(|p| p.revision.is_some());
            if removing {
                all_good = false;
            }
            proxies.push(Row {
                proxy,
                service: service_id,
                state: if removing { Some(REMOVING.to_owned()) } else { published.map(|p| p.state.clone()) },
                ready: published.is_some_and(|p| p.ready),
                pid: published.and_then(|p| p.pid),
                restarts: published.map_or(0, |p| p.restarts),
                desired_revision: desired,
                running_revision: published.and_then(|p| p.revision),
                error: published.and_then(|p| p.error.clone()),
            });
        }
        nodes.push(NodeRow {
            node: name.clone(),
            state: if seen.up.is_some() { "up" } else { "down" },
            revision: seen.up,
            proxies,
        });
    }
    (nodes, all_good)
}

/// A rollout in progress, as etcd keeps it: its services, its nodes in order, how far it
/// went.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct RolloutView {
    pub(crate) services: Vec<String>,
    pub(crate) nodes: Vec<String>,
    /// The index in `nodes` of the first node of the batch in progress.
    pub(crate) next: usize,
    pub(crate) max_parallel: usize,
    pub(crate) started_at: String,
}

/// The fleet as the agent shows it to its page: every node, whether every node runs what it
/// should, and the rollouts in progress.
pub(crate) struct FleetReport {
    pub(crate) nodes: Vec<NodeRow>,
    pub(crate) converged: bool,
    pub(crate) rollouts: Vec<RolloutView>,
}

/// Reads the fleet for the agent's API through one connection, made at the first read and
/// made again after a read that failed.
pub(crate) struct FleetReader {
    options: EtcdOptions,
    prefix: String,
    client: tokio::sync::Mutex<Option<etcd::Client>>,
}

impl FleetReader {
    pub(crate) fn new(options: EtcdOptions, prefix: String) -> Self {
        Self { options, prefix, client: tokio::sync::Mutex::new(None) }
    }

    /// Every node and the rollouts in progress, as etcd holds them now.
    ///
    /// # Errors
    ///
    /// An [`EtcdError`] when etcd cannot be asked.
    pub(crate) async fn report(&self) -> Result<FleetReport, EtcdError> {
        let mut slot = self.client.lock().await;
        let client = match slot.as_ref() {
            Some(client) => client.clone(),
            None => {
                let client = self.options.connect().await?;
                *slot = Some(client.clone());
                client
            }
        };
        drop(slot);
        let read = async {
            let view = read(&self.options, &client, &self.prefix).await?;
            let rollouts = rollouts(&self.options, &client, &self.prefix).await?;
            Ok::<_, EtcdError>((view, rollouts))
        };
        match read.await {
            Ok((view, rollouts)) => {
                let (nodes, converged) = rows(&view, None, None);
                Ok(FleetReport { nodes, converged, rollouts })
            }
            Err(err) => {
                *self.client.lock().await = None;
                Err(err)
            }
        }
    }
}

/// The rollouts in progress under `prefix`: each once, though etcd keeps it under each of
/// its services. A record that does not parse is left out.
async fn rollouts(options: &EtcdOptions, client: &etcd::Client, prefix: &str) -> Result<Vec<RolloutView>, EtcdError> {
    let kept = timed(options, "read", client.get_prefix(&format!("{prefix}/rollouts/"))).await?;
    let mut found: Vec<RolloutView> = Vec::new();
    for kv in &kept.kvs {
        let Ok(record) = serde_json::from_slice::<RolloutRecord>(&kv.value) else { continue };
        let view = RolloutView {
            services: record.services.keys().cloned().collect(),
            nodes: record.nodes,
            next: record.next,
            max_parallel: record.max_parallel,
            started_at: record.started_at,
        };
        if !found.contains(&view) {
            found.push(view);
        }
    }
    Ok(found)
}

/// Runs `tether fleet status`.
pub(crate) async fn run(
    options: &EtcdOptions,
    prefix: &str,
    node: Option<&str>,
    service: Option<&str>,
    json: bool,
) -> anyhow::Result<ExitCode> {
    let client = options.connect().await.map_err(etcd_failure)?;
    let view = read(options, &client, prefix).await?;
    let (nodes, all_good) = rows(&view, node, service);
    let mut stdout = std::io::stdout().lock();
    if json {
        writeln!(stdout, "{}", serde_json::json!({ "nodes": nodes }))?;
    } else {
        let dash = |value: Option<String>| value.unwrap_or_else(|| "-".to_owned());
        let mut table = vec![
            ["NODE", "PROXY", "STATE", "READY", "PID", "RESTARTS", "DESIRED", "RUNNING", "ERROR"].map(str::to_owned),
        ];
        for node in &nodes {
            if node.proxies.is_empty() {
                let state = if node.state == "up" { "-" } else { "down" };
                table.push([&node.node, "-", state, "-", "-", "-", "-", "-", "-"].map(str::to_owned));
            }
            for row in &node.proxies {
                let state = if node.state == "down" { "down".to_owned() } else { dash(row.state.clone()) };
                table.push([
                    node.node.clone(),
                    row.proxy.clone(),
                    state,
                    if row.ready { "yes" } else { "no" }.to_owned(),
                    dash(row.pid.map(|pid| pid.to_string())),
                    row.restarts.to_string(),
                    dash(row.desired_revision.map(|r| r.to_string())),
                    dash(row.running_revision.map(|r| r.to_string())),
                    dash(row.error.as_ref().map(|e| e.escape_debug().to_string())),
                ]);
            }
        }
        let widths: Vec<usize> =
            (0..9).map(|c| table.iter().map(|row| row[c].chars().count()).max().unwrap_or(0)).collect();
        for row in &table {
            let mut line = String::new();
            for (column, cell) in row.iter().enumerate() {
                if column == 8 {
                    line.push_str(cell);
                } else {
                    line.push_str(&format!("{cell:<width$}  ", width = widths[column]));
                }
            }
            writeln!(stdout, "{}", line.trim_end())?;
        }
        let up = nodes.iter().filter(|node| node.state == "up").count();
        // A proxy being removed counts apart: neither ready nor waiting to be.
        let rows = || nodes.iter().flat_map(|node| &node.proxies);
        let is_removing = |row: &Row| row.state.as_deref() == Some(REMOVING);
        let removing = rows().filter(|row| is_removing(row)).count();
        let ready = rows().filter(|row| row.ready && !is_removing(row)).count();
        let not_ready = rows().count() - ready - removing;
        let removing = if removing > 0 { format!(", {removing} removing") } else { String::new() };
        writeln!(
            stdout,
            "nodes: {up} up, {} down; proxies: {ready} ready, {not_ready} not ready{removing}",
            nodes.len() - up
        )?;
    }
    Ok(if all_good { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn proxy(ready: bool, revision: Option<i64>) -> PublishedProxy {
        PublishedProxy { state: "running".to_owned(), ready, revision, ..PublishedProxy::default() }
    }

    #[test]
    fn success_needs_every_node_with_desired_keys_up_and_every_desired_proxy_on_its_revision_and_ready() {
        let mut view = FleetView::new();
        let n1 = view.entry("n1".to_owned()).or_default();
        n1.up = Some(9);
        n1.desired.insert("web".to_owned(), 5);
        n1.proxies.insert("web-proxy".to_owned(), proxy(true, Some(5)));
        assert!(rows(&view, None, None).1);
        // A down node with desired keys fails the check: a script must see a dead host.
        view.entry("n2".to_owned()).or_default().desired.insert("web".to_owned(), 6);
        let (nodes, good) = rows(&view, None, None);
        assert!(!good, "n2 is down");
        assert_eq!(nodes[1].state, "down");
        assert!(rows(&view, Some("n1"), None).1, "filtered to the node that is up");
        view.remove("n2");

        view.get_mut("n1").unwrap().proxies.insert("web-proxy".to_owned(), proxy(true, Some(4)));
        assert!(!rows(&view, None, None).1, "an old revision runs");
        view.get_mut("n1").unwrap().proxies.insert("web-proxy".to_owned(), proxy(false, Some(5)));
        assert!(!rows(&view, None, None).1, "not ready");
        view.get_mut("n1").unwrap().proxies.clear();
        assert!(!rows(&view, None, None).1, "not published at all");
        assert!(rows(&view, None, Some("other")).1, "filtered to another service");

        // Started from a key that was deleted: removing, and a failure until it is gone.
        let n1 = view.get_mut("n1").unwrap();
        n1.desired.clear();
        n1.proxies.insert("web-proxy".to_owned(), proxy(true, Some(5)));
        let (nodes, good) = rows(&view, None, None);
        assert!(!good, "a proxy is still being removed");
        assert_eq!(nodes[0].proxies[0].state.as_deref(), Some(REMOVING));
        // A proxy that never came from etcd (no revision) is not the fleet's to remove.
        view.get_mut("n1").unwrap().proxies.insert("web-proxy".to_owned(), proxy(true, None));
        assert!(rows(&view, None, None).1);
    }
}
