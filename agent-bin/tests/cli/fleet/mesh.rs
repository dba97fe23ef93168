//! The mesh across a fleet: two agents on one etcd, sharing an operator's CA, web on node a
//! and db on node b. web's built-in proxy finds db's instance in the fleet's `instances/`
//! keys and reaches it over mutual TLS; an intention put under `<prefix>/intentions/`
//! closes the open connection and refuses new ones, and its deletion lets web in again.
//! Envoy's endpoints over xDS come from the same fleet keys.

use super::*;
use crate::connect::{file_mesh, openssl_ca};
use crate::mesh::{builtin, closed, echo, exchange_once, intention};

#[test]
fn an_upstream_reaches_another_nodes_instance_and_the_fleets_intentions_close_and_reopen_it() {
    let Some(etcd) = Etcd::start("fleet mesh") else { return };
    let (a, b) = (Dirs::new(), Dirs::new());
    let Some((cert, key)) = openssl_ca(a.temp.path()) else { return };
    let (db_bind, web_bind, web_upstream) = (free_port(), free_port(), free_port());
    for dirs in [&a, &b] {
        dirs.write_config("mesh.toml", &file_mesh(&cert, &key, "72h"));
    }
    // Node b lets anyone reach db; the fleet's more precise rule decides below.
    b.write_config("intentions.toml", &intention("*", "db", "allow"));
    b.write_config("db.toml", &builtin("db", Some(echo()), &format!("bind_port = {db_bind}")));
    let web = format!(
        "bind_port = {web_bind}, upstreams = [{{ destination_name = \"db\", local_bind_port = {web_upstream} }}]"
    );
    a.write_config("web.toml", &builtin("web", None, &web));
    let node_b = publishing_agent(&b, &etcd, "b");
    let node_a = publishing_agent(&a, &etcd, "a");
    node_b.wait_state("db-proxy", "running");
    node_a.wait_state("web-proxy", "running");

    // Node a has no db of its own: the only way there is the fleet's instance on node b.
    let (mut open, answer) = wait_for("web's upstream to reach db on node b", || exchange_once(web_upstream, "one"));
    assert_eq!(answer, "db: one");

    // A bad key next to the good one is skipped, and stops nothing.
    etcd.put_raw("/tether/intentions/web", r#"{"action":"deny"}"#);
    etcd.put_raw("/tether/intentions/web/db", r#"{"action":"deny"}"#);
    assert!(closed(&mut open), "the open connection was not closed when the fleet's intention came to deny it");
    assert!(exchange_once(web_upstream, "two").is_none(), "a new connection passed the fleet's deny intention");
    wait_for("the bad key's warning, naming it", || {
        let logs = node_b.logs();
        let named = |line: &&str| line.contains("skipping an intention key") && line.contains("/tether/intentions/web");
        logs.lines().filter(named).any(|line| line.contains("<source>/<destination>")).then_some(())
    });
    assert_eq!(node_b.proxy("db-proxy").unwrap()["state"], "running");

    etcd.delete_prefix("/tether/intentions/web/");
    let (_, answer) = wait_for("the deletion to let web in again", || exchange_once(web_upstream, "three"));
    assert_eq!(answer, "db: three");
}

/// Envoy's endpoints come from the same fleet: web's Envoy on node a reaches db on node b,
/// and follows it when db's instance on node b changes, without a restart.
#[test]
fn envoys_upstream_endpoints_are_the_fleets_instances_and_follow_them() {
    use crate::xds::{Greeter, Setup, wait_served};
    let Some(etcd) = Etcd::start("fleet xds") else { return };
    let Some(setup) = Setup::new("envoys_upstream_endpoints_are_the_fleets_instances_and_follow_them") else { return };
    let _envoys = setup.guard();
    let b = Dirs::new();
    let _sweeps = (support::SweepOnDrop(setup.dirs.socket()), support::SweepOnDrop(b.socket()));
    let service = Greeter::start("service\n");
    let (one, two) = (Greeter::start("db one\n"), Greeter::start("db two\n"));
    let upstream_port = free_port();
    let upstream = format!("upstreams = [{{ destination_name = \"db\", local_bind_port = {upstream_port} }}]");
    setup.write_web(service.port, &format!("{{ bind_port = {}, {upstream} }}", setup.bind_port));
    // An instance is published while its proxy is ready: db has one that sleeps.
    let db = |id: &str, port: u16| {
        format!(
            "[[service]]\nname = \"db\"\nid = \"{id}\"\nport = {port}\n[service.proxy]\ncommand = [\"/bin/sleep\", \"3600\"]\nkill_timeout = \"2s\"\n"
        )
    };
    b.write_config("db.toml", &db("db-1", one.port));
    let node_b = publishing_agent(&b, &etcd, "b");
    node_b.wait_state("db-1-proxy", "running");
    let node_a = publishing_agent(&setup.dirs, &etcd, "a");
    let pid = node_a.wait_state("web-proxy", "running")["pid"].as_i64().unwrap();
    setup.note_base_id();
    wait_served(upstream_port, "db one\n");

    b.write_config("db.toml", &db("db-2", two.port));
    let reloaded = tether().arg("reload").arg("--data-dir").arg(&b.data).output().unwrap();
    assert!(reloaded.status.success(), "{}", String::from_utf8_lossy(&reloaded.stderr));
    wait_served(upstream_port, "db two\n");
    let status = node_a.proxy("web-proxy").unwrap();
    assert_eq!(status["pid"].as_i64(), Some(pid), "Envoy was not restarted: {status}");
}
