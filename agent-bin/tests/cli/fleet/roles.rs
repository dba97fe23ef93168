//! Least privilege in the store: the role `tether fleet roles NODE` prints, created in an
//! etcd with auth on, is all that the agent of NODE needs, and etcd refuses what it must
//! not write.

use super::*;

/// One POST to etcd's JSON gateway as the user whose token is `token`.
fn gateway_as(port: u16, token: &str, path: &str, body: &str) -> Result<String, String> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).map_err(|err| err.to_string())?;
    stream.set_read_timeout(Some(support::DEADLINE)).unwrap();
    let request = format!(
        "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nAuthorization: {token}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).map_err(|err| err.to_string())?;
    let mut raw = String::new();
    stream.read_to_string(&mut raw).map_err(|err| err.to_string())?;
    if raw.starts_with("HTTP/1.1 200") { Ok(raw) } else { Err(raw) }
}

/// The token of user `name`.
fn token(etcd: &Etcd, name: &str, password: &str) -> String {
    let body =
        etcd.call("/v3/auth/authenticate", &format!(r#"{{"name": "{name}", "password": "{password}"}}"#)).unwrap();
    serde_json::from_str::<serde_json::Value>(&body).unwrap()["token"].as_str().unwrap().to_owned()
}

/// The end of the range of every key under `prefix`.
fn prefix_end(prefix: &str) -> Vec<u8> {
    let mut end = prefix.as_bytes().to_vec();
    *end.last_mut().unwrap() += 1;
    end
}

/// Creates what `script` says through etcd's gateway, as `etcdctl` would: roles, their
/// grants, and users (each with `password`) given roles.
fn apply(etcd: &Etcd, script: &str, password: &str) {
    for line in script.lines().filter(|line| !line.starts_with('#')) {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words[1..] {
            ["role", "add", role] => {
                etcd.call("/v3/auth/role/add", &format!(r#"{{"name": "{role}"}}"#)).unwrap();
            }
            ["role", "grant-permission", "--prefix", role, kind, key]
            | ["role", "grant-permission", role, kind, key] => {
                let range_end = if words.contains(&"--prefix") {
                    format!(r#", "range_end": "{}""#, BASE64.encode(prefix_end(key)))
                } else {
                    String::new()
                };
                let kind = kind.to_uppercase();
                let body = format!(
                    r#"{{"name": "{role}", "perm": {{"permType": "{kind}", "key": "{}"{range_end}}}}}"#,
                    BASE64.encode(key)
                );
                etcd.call("/v3/auth/role/grant", &body).unwrap();
            }
            ["user", "add", user] => {
                etcd.call("/v3/auth/user/add", &format!(r#"{{"name": "{user}", "password": "{password}"}}"#)).unwrap();
            }
            ["user", "grant-role", user, role] => {
                etcd.call("/v3/auth/user/grant", &format!(r#"{{"user": "{user}", "role": "{role}"}}"#)).unwrap();
            }
            _ => panic!("a line this test does not know: {line}"),
        }
    }
}

#[test]
fn an_agent_runs_with_its_node_role_alone_and_etcd_refuses_it_another_nodes_keys() {
    let Some(etcd) = Etcd::start("fleet roles") else { return };
    let dirs = Dirs::new();
    let _sweep = support::SweepOnDrop(dirs.socket());
    put_sleeper(&etcd, &dirs, "n1", "web", 3600);
    put_sleeper(&etcd, &dirs, "n2", "db", 3600);
    let roles = fleet(&etcd.url(), &["roles", "n1"]);
    assert!(roles.status.success(), "{}", String::from_utf8_lossy(&roles.stderr));
    let script = String::from_utf8(roles.stdout).unwrap();
    assert!(script.contains("/tether/instances/web/n1/") && !script.contains("db"), "{script}");
    apply(&etcd, &script, "n1-secret");
    etcd.call("/v3/auth/role/add", r#"{"name": "root"}"#).unwrap();
    etcd.call("/v3/auth/user/add", r#"{"name": "root", "password": "secret"}"#).unwrap();
    etcd.call("/v3/auth/user/grant", r#"{"user": "root", "role": "root"}"#).unwrap();
    etcd.call("/v3/auth/enable", "{}").unwrap();

    // The agent of n1, with nothing but its role: it follows, runs and publishes.
    let url = etcd.url();
    let mut flags = vec!["--etcd", url.as_str(), "--node", "n1", "--etcd-user", "tether-node-n1:n1-secret"];
    if is_root() {
        flags.push("--allow-root");
    }
    let agent = Agent::start(&dirs, &flags);
    pid_of(&agent, "web-proxy");
    wait_until("n1 up, its proxy ready, as the operator sees it", || {
        let output =
            fleet_with(&url, &["status", "--node", "n1", "--json"], &["--etcd-user".into(), "root:secret".into()]);
        let text = String::from_utf8_lossy(&output.stdout).into_owned();
        (output.status.success() && text.contains("\"up\"") && text.contains("web-proxy")).then_some(()).ok_or(text)
    });
    let root = token(&etcd, "root", "secret");
    let instances = gateway_as(
        etcd.client_port,
        &root,
        "/v3/kv/range",
        &format!(
            r#"{{"key": "{}", "range_end": "{}"}}"#,
            BASE64.encode("/tether/instances/web/n1/"),
            BASE64.encode(prefix_end("/tether/instances/web/n1/"))
        ),
    )
    .unwrap();
    assert!(instances.contains("\"count\":\"1\""), "its instance is published: {instances}");
    assert!(!agent.logs().contains("permission denied"), "{}", agent.logs());

    // What it must not write, etcd refuses it.
    let n1 = token(&etcd, "tether-node-n1", "n1-secret");
    for key in [
        "/tether/nodes/n2/services/x",
        "/tether/nodes/n1/services/x",
        "/tether/status/n2",
        "/tether/instances/db/n2/x",
        "/tether/rollouts/web",
    ] {
        let put = format!(r#"{{"key": "{}", "value": "{}"}}"#, BASE64.encode(key), BASE64.encode("{}"));
        let refused = gateway_as(etcd.client_port, &n1, "/v3/kv/put", &put).unwrap_err();
        assert!(refused.contains("permission denied"), "{key}: {refused}");
    }
}
