//! Envoy in the mesh, fed by the agent's xDS server with its leaf and the roots over SDS: Envoy
//! as a client reaches a built-in proxy over mutual TLS, a built-in proxy reaches Envoy as a
//! service's sidecar, Envoy's RBAC follows the intentions with no restart, a renewed leaf
//! reaches Envoy on the same stream, and a client without a certificate is refused. The other
//! ends are the built-in proxy and `openssl`, TLS stacks that Envoy does not share.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};

use crate::connect::{file_mesh, openssl_ca};
use crate::mesh::{builtin, dev_mesh, echo, exchange_once, intention};
use crate::support::{Agent, DEADLINE, SweepOnDrop, alive, wait_for};
use crate::xds::{Setup, free_port, metric, root_flags};

/// What Envoy's admin interface answers at `path`, or why it did not.
fn admin(port: u16, path: &str) -> Result<String, String> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).map_err(|err| format!("connect: {err}"))?;
    stream.set_read_timeout(Some(DEADLINE)).map_err(|err| err.to_string())?;
    write!(stream, "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        .map_err(|err| err.to_string())?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer).map_err(|err| format!("read: {err}"))?;
    answer.split_once("\r\n\r\n").map(|(_, body)| body.to_owned()).ok_or_else(|| format!("no body: {answer}"))
}

/// The serial numbers of the leaves that Envoy's listeners and clusters hold now, as its
/// admin's `/certs` lists them.
fn envoy_serials(admin_port: u16) -> Result<Vec<String>, String> {
    envoy_certificates(admin_port, "cert_chain")
}

/// The serial numbers of the certificates of `kind` (`cert_chain`: the leaves; `ca_cert`: the
/// roots) that Envoy holds now, as its admin's `/certs` lists them.
fn envoy_certificates(admin_port: u16, kind: &str) -> Result<Vec<String>, String> {
    let body = admin(admin_port, "/certs")?;
    // The body comes in chunks: the JSON is from the first brace to the last.
    let json = body.find('{').zip(body.rfind('}')).map_or("", |(start, end)| &body[start..=end]);
    let certs: serde_json::Value = serde_json::from_str(json).map_err(|err| format!("{err}: {body}"))?;
    let serials: Vec<String> = certs["certificates"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|entry| entry[kind].as_array().into_iter().flatten())
        .filter_map(|cert| cert["serial_number"].as_str().map(str::to_owned))
        .collect();
    if serials.is_empty() { Err(format!("no leaf yet: {body}")) } else { Ok(serials) }
}

/// The value of Envoy's counter `name`, as its admin's `/stats` shows it.
fn envoy_counter(admin_port: u16, name: &str) -> u64 {
    let body = admin(admin_port, &format!("/stats?filter={name}")).unwrap_or_default();
    body.lines()
        .filter_map(|line| line.split_once(": "))
        .filter(|(stat, _)| stat.ends_with(name))
        .map(|(_, value)| value.trim().parse::<u64>().unwrap_or(0))
        .sum()
}

/// How many xDS streams the agent's log says it opened for `proxy`.
fn streams_opened(agent: &Agent, proxy: &str) -> usize {
    let proxy = format!("\"proxy\":\"{proxy}\"");
    agent.logs().lines().filter(|line| line.contains("xDS stream opened") && line.contains(&proxy)).count()
}

#[test]
fn envoy_reaches_a_builtin_proxy_over_mutual_tls_with_its_leaf_from_sds() {
    reaches_a_builtin_proxy_over_mutual_tls(
        "envoy_reaches_a_builtin_proxy_over_mutual_tls_with_its_leaf_from_sds",
        false,
    );
}

#[test]
fn over_incremental_ads_envoy_reaches_a_builtin_proxy_over_mutual_tls() {
    reaches_a_builtin_proxy_over_mutual_tls("over_incremental_ads_envoy_reaches_a_builtin_proxy_over_mutual_tls", true);
}

/// Envoy as `web`'s proxy (over state-of-the-world ADS, or incremental with `delta`) reaches
/// `db`'s built-in proxy through its upstream, with the leaf and roots it got over SDS.
fn reaches_a_builtin_proxy_over_mutual_tls(test: &str, delta: bool) {
    let Some(mut setup) = Setup::new(test) else { return };
    setup.delta = delta;
    let _envoys = setup.guard();
    let _sweep = SweepOnDrop(setup.dirs.socket());
    let (db_bind, web_upstream) = (free_port(), free_port());
    setup.dirs.write_config("mesh.toml", &dev_mesh("72h"));
    setup.dirs.write_config("intentions.toml", &intention("web", "db", "allow"));
    setup.dirs.write_config("db.toml", &builtin("db", Some(echo()), &format!("bind_port = {db_bind}")));
    let upstream = format!("upstreams = [{{ destination_name = \"db\", local_bind_port = {web_upstream} }}]");
    setup.write_service("web", echo(), &format!("{{ bind_port = {}, {upstream} }}", setup.bind_port));
    let agent = Agent::start(&setup.dirs, &root_flags());
    agent.wait_state("db-proxy", "running");
    let pid = agent.wait_state("web-proxy", "running")["pid"].as_i64().unwrap();
    setup.note_base_id();

    let (_, answer) = wait_for("web's Envoy to reach db through its upstream", || exchange_once(web_upstream, "one"));
    assert_eq!(answer, "db: one");
    let serials = envoy_serials(setup.admin_port).unwrap();
    let status = agent.proxy("web-proxy").unwrap();
    assert_eq!(status["pid"].as_i64(), Some(pid), "{status}");
    // Envoy uses the secrets as soon as it took them; its ACK follows.
    wait_for("Envoy's ACK of its secrets", || {
        (metric(&agent, "tether_xds_responses_total", &["type=\"secret\"", "result=\"applied\""]) >= 1.0).then_some(())
    });
    assert!(!serials.is_empty());
    // Envoy's own public listener takes mutual TLS only: plaintext gets a TLS alert at most.
    let plain = exchange_once(setup.bind_port, "plain\n").map(|(_, answer)| answer).unwrap_or_default();
    assert!(!plain.contains("plain"), "Envoy's public listener forwarded plaintext: {plain:?}");
    // The key went to Envoy only: the agent's log and status do not hold it.
    assert!(!agent.logs().contains("PRIVATE KEY"), "a private key in the agent's log");
    assert!(!status.to_string().contains("PRIVATE KEY"), "a private key in the status");
}

/// `openssl s_client` without a client certificate to `port`, sending `line`: what it
/// printed, once the server closed the connection (within 10 s, else `timeout` ends it);
/// `None` without openssl.
fn s_client_without_certificate(port: u16, line: &str) -> Option<String> {
    // `-quiet` ignores the end of its input: it ends when the server closes.
    let mut child = Command::new("timeout")
        .args(["10", "openssl", "s_client", "-quiet", "-connect", &format!("127.0.0.1:{port}")])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .ok()?;
    let mut stdin = child.stdin.take()?;
    let _ = stdin.write_all(line.as_bytes());
    drop(stdin);
    let output = child.wait_with_output().ok()?;
    if output.status.code() == Some(127) {
        return None;
    }
    Some(format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr)))
}

#[test]
fn a_builtin_proxy_reaches_envoy_whose_rbac_follows_the_intentions_and_whose_leaf_renews_on_the_same_stream() {
    builtin_proxy_reaches_envoy(
        "a_builtin_proxy_reaches_envoy_whose_rbac_follows_the_intentions_and_whose_leaf_renews_on_the_same_stream",
        false,
    );
}

#[test]
fn over_incremental_ads_envoys_rbac_follows_the_intentions_and_its_leaf_renews_on_the_same_stream() {
    builtin_proxy_reaches_envoy(
        "over_incremental_ads_envoys_rbac_follows_the_intentions_and_its_leaf_renews_on_the_same_stream",
        true,
    );
}

/// Starts an agent with `mesh` (its `[connect]` table), an intention that lets web reach db,
/// db's proxy an Envoy before an echo service, and web's built-in proxy whose upstream reaches
/// db; returns the agent once both run, Envoy's pid, and web's upstream port.
fn web_to_envoys_db(setup: &Setup, mesh: &str) -> (Agent, i64, u16) {
    let (web_bind, web_upstream) = (free_port(), free_port());
    setup.dirs.write_config("mesh.toml", mesh);
    setup.dirs.write_config("intentions.toml", &intention("web", "db", "allow"));
    setup.write_service("db", echo(), &format!("{{ bind_port = {} }}", setup.bind_port));
    let web = format!(
        "bind_port = {web_bind}, upstreams = [{{ destination_name = \"db\", local_bind_port = {web_upstream} }}]"
    );
    setup.dirs.write_config("web.toml", &builtin("web", None, &web));
    let agent = Agent::start(&setup.dirs, &root_flags());
    agent.wait_state("web-proxy", "running");
    let pid = agent.wait_state("db-proxy", "running")["pid"].as_i64().unwrap();
    setup.note_base_id();
    (agent, pid, web_upstream)
}

/// `web`'s built-in proxy reaches Envoy as `db`'s proxy (fed over state-of-the-world ADS, or
/// incremental with `delta`): a client without a certificate is refused, a renewed leaf is
/// taken on the same stream, and the intentions are followed by Envoy's RBAC, all with one
/// Envoy process and one ADS stream.
fn builtin_proxy_reaches_envoy(test: &str, delta: bool) {
    let Some(mut setup) = Setup::new(test) else { return };
    setup.delta = delta;
    let _envoys = setup.guard();
    let _sweep = SweepOnDrop(setup.dirs.socket());
    // Leaves of seconds: Envoy's renews every 6 to 8 s while the test runs.
    let (agent, pid, web_upstream) = web_to_envoys_db(&setup, &dev_mesh("10s"));

    let (mut open, answer) = wait_for("web's upstream to reach db's Envoy", || exchange_once(web_upstream, "one"));
    assert_eq!(answer, "db: one");

    // (e) A client without a certificate is refused by Envoy's TLS.
    if let Some(output) = s_client_without_certificate(setup.bind_port, "plain\n") {
        assert!(!output.contains("db: plain"), "a client without a certificate got through: {output}");
        assert!(output.contains("alert") || output.contains("error"), "no refusal said: {output}");
    } else {
        eprintln!("openssl s_client not run: openssl is not installed");
    }

    // (d) The leaf renews: Envoy takes the new one on the same stream, and the connection
    // opened before keeps working.
    let first = envoy_serials(setup.admin_port).unwrap();
    let renewed = wait_for("Envoy to hold a renewed leaf", || {
        let now = envoy_serials(setup.admin_port).ok()?;
        (now != first).then_some(now)
    });
    assert_ne!(renewed, first);
    open.write_all(b"two").unwrap();
    let mut buffer = [0u8; 64];
    let n = open.read(&mut buffer).unwrap();
    assert_eq!(&buffer[..n], b"db: two", "the connection opened before the renewal");
    assert_eq!(streams_opened(&agent, "db-proxy"), 1, "the ADS stream was not opened again: {}", agent.logs());
    // Envoy shows the new leaf as soon as it took it; its ACK follows.
    let secrets = ["proxy=\"db-proxy\"", "type=\"secret\"", "result=\"applied\""];
    wait_for("Envoy's ACK of the renewed leaf", || {
        (metric(&agent, "tether_xds_responses_total", &secrets) >= 2.0).then_some(())
    });

    // (c) A deny intention: Envoy's RBAC refuses new connections, with no restart.
    let denied_before = envoy_counter(setup.admin_port, "rbac.denied");
    setup.dirs.write_config("intentions.toml", &intention("web", "db", "deny"));
    setup.reload();
    wait_for("Envoy's RBAC to refuse web", || exchange_once(web_upstream, "three").is_none().then_some(()));
    wait_for("Envoy to count the refusal", || {
        (envoy_counter(setup.admin_port, "rbac.denied") > denied_before).then_some(())
    });
    // A wildcard allow does not win over the exact deny.
    let listeners = ["proxy=\"db-proxy\"", "type=\"listener\"", "result=\"applied\""];
    let before = metric(&agent, "tether_xds_responses_total", &listeners);
    setup.dirs.write_config(
        "intentions.toml",
        &format!("{}{}", intention("web", "db", "deny"), intention("*", "db", "allow")),
    );
    setup.reload();
    wait_for("the listeners with the wildcard rule applied", || {
        (metric(&agent, "tether_xds_responses_total", &listeners) > before).then_some(())
    });
    assert!(exchange_once(web_upstream, "four").is_none(), "a wildcard allow let web in past its exact deny");

    setup.dirs.write_config("intentions.toml", &intention("web", "db", "allow"));
    setup.reload();
    let (_, answer) = wait_for("the allow intention to let web in again", || exchange_once(web_upstream, "five"));
    assert_eq!(answer, "db: five");
    let status = agent.proxy("db-proxy").unwrap();
    assert_eq!(status["pid"].as_i64(), Some(pid), "Envoy was not restarted: {status}");
    assert_eq!(status["restarts"], 0, "{status}");
    assert!(alive(pid));
    assert_eq!(streams_opened(&agent, "db-proxy"), 1, "one ADS stream throughout");
    drop(open);
}

#[test]
fn a_new_ca_reaches_envoy_as_new_roots_and_a_new_leaf_on_the_same_stream() {
    let Some(setup) = Setup::new("a_new_ca_reaches_envoy_as_new_roots_and_a_new_leaf_on_the_same_stream") else {
        return;
    };
    let _envoys = setup.guard();
    let _sweep = SweepOnDrop(setup.dirs.socket());
    let (first_ca, second_ca) = (setup.dirs.temp.path().join("first-ca"), setup.dirs.temp.path().join("second-ca"));
    std::fs::create_dir(&first_ca).unwrap();
    std::fs::create_dir(&second_ca).unwrap();
    let Some((cert, key)) = openssl_ca(&first_ca) else { return };
    let (second_cert, second_key) = openssl_ca(&second_ca).unwrap();
    let (agent, pid, web_upstream) = web_to_envoys_db(&setup, &file_mesh(&cert, &key, "72h"));
    let (_, answer) = wait_for("web's upstream to reach db's Envoy", || exchange_once(web_upstream, "one"));
    assert_eq!(answer, "db: one");
    let (roots, leaves) =
        (envoy_certificates(setup.admin_port, "ca_cert").unwrap(), envoy_serials(setup.admin_port).unwrap());

    // Another CA: every leaf is issued again, and Envoy gets the new roots and its new leaf as
    // new versions of its secrets.
    setup.dirs.write_config("mesh.toml", &file_mesh(&second_cert, &second_key, "72h"));
    setup.reload();
    wait_for("Envoy to hold the new roots and a new leaf", || {
        let now = (envoy_certificates(setup.admin_port, "ca_cert").ok()?, envoy_serials(setup.admin_port).ok()?);
        (now.0.iter().all(|serial| !roots.contains(serial)) && now.1.iter().all(|serial| !leaves.contains(serial)))
            .then_some(())
    });
    let (_, answer) = wait_for("web to reach db under the new CA", || exchange_once(web_upstream, "two"));
    assert_eq!(answer, "db: two");
    let status = agent.proxy("db-proxy").unwrap();
    assert_eq!(status["pid"].as_i64(), Some(pid), "Envoy was not restarted: {status}");
    assert!(alive(pid));
    assert_eq!(streams_opened(&agent, "db-proxy"), 1, "one ADS stream throughout");
}
