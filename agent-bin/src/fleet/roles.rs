//! `tether fleet roles NODE`: the etcd role that the agent of NODE needs, and nothing more,
//! as the `etcdctl` commands that create it.
//!
//! The agent reads its node's desired services, the `instances/` of every service (for
//! templates, Envoy's endpoints and the built-in proxies' upstreams) and the fleet's
//! `intentions/`, and writes its node's status keys and the `instances/<name>/<node>/` keys of
//! the services it runs. etcd grants by key range, and the instance keys put the service's
//! name before the node, so the role names each service of the node: the services that
//! NODE has in etcd now, and those given with `--service-name`.

use std::collections::BTreeSet;
use std::io::Write;
use std::process::ExitCode;

use super::{etcd_failure, parse_entry};
use crate::etcd::{EtcdOptions, Layout, timed};

/// The role's name for `node`.
pub(crate) fn role_name(node: &str) -> String {
    format!("tether-node-{node}")
}

/// The `etcdctl` commands that create the role of `layout`'s node, for the services named
/// `names`.
pub(crate) fn script(layout: &Layout, names: &BTreeSet<String>) -> String {
    let (prefix, node) = (layout.prefix(), layout.node());
    let role = role_name(node);
    let mut lines = vec![
        format!("# The etcd role of the agent of node {node}: it reads its desired services, every"),
        "# service's instances and the intentions, and writes its own status and the instances of".to_owned(),
        "# its services.".to_owned(),
        format!("etcdctl role add {role}"),
        format!("etcdctl role grant-permission --prefix {role} read {}", layout.services_prefix()),
        format!("etcdctl role grant-permission --prefix {role} read {prefix}/instances/"),
        format!("etcdctl role grant-permission --prefix {role} read {}", layout.intentions_prefix()),
        format!("etcdctl role grant-permission {role} readwrite {}", layout.status_key()),
        format!("etcdctl role grant-permission --prefix {role} readwrite {}/", layout.status_key()),
    ];
    for name in names {
        lines
            .push(format!("etcdctl role grant-permission --prefix {role} readwrite {prefix}/instances/{name}/{node}/"));
    }
    lines.push("# A user for the agent (etcdctl asks for its password), given the role:".to_owned());
    lines.push(format!("etcdctl user add {role}"));
    lines.push(format!("etcdctl user grant-role {role} {role}"));
    let mut text = lines.join("\n");
    text.push('\n');
    text
}

/// Runs `tether fleet roles NODE`: reads the names of NODE's services from etcd, adds
/// `extra`, and prints the script.
pub(crate) async fn run(options: &EtcdOptions, layout: &Layout, extra: &[String]) -> anyhow::Result<ExitCode> {
    let client = options.connect().await.map_err(etcd_failure)?;
    let response = timed(options, "read", client.get_prefix(&layout.services_prefix())).await?;
    let mut names: BTreeSet<String> = extra.iter().cloned().collect();
    for kv in &response.kvs {
        // An invalid value runs nothing, and needs no instance key.
        if let Ok(service) = parse_entry(layout, &kv.key, &kv.value) {
            names.insert(service.name.to_string());
        }
    }
    std::io::stdout().lock().write_all(script(layout, &names).as_bytes())?;
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_role_reads_its_services_instances_and_intentions_and_writes_only_its_own_keys() {
        let layout = Layout::new("/tether/", "n1").unwrap();
        let names = ["api".to_owned(), "web".to_owned()].into_iter().collect();
        let text = script(&layout, &names);
        let grants: Vec<&str> = text.lines().filter(|line| line.contains("grant-permission")).collect();
        assert_eq!(
            grants,
            [
                "etcdctl role grant-permission --prefix tether-node-n1 read /tether/nodes/n1/services/",
                "etcdctl role grant-permission --prefix tether-node-n1 read /tether/instances/",
                "etcdctl role grant-permission --prefix tether-node-n1 read /tether/intentions/",
                "etcdctl role grant-permission tether-node-n1 readwrite /tether/status/n1",
                "etcdctl role grant-permission --prefix tether-node-n1 readwrite /tether/status/n1/",
                "etcdctl role grant-permission --prefix tether-node-n1 readwrite /tether/instances/api/n1/",
                "etcdctl role grant-permission --prefix tether-node-n1 readwrite /tether/instances/web/n1/",
            ]
        );
        assert!(!text.contains("/tether/nodes/n2") && !text.contains("readwrite /tether/instances/\n"));
    }
}
