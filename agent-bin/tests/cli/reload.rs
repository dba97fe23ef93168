//! Reloads in place (`[service.proxy.reload]`, `tether reload PROXY_ID`) with real proxies
//! nobody here wrote: Debian's HAProxy in master-worker mode, whose verdict comes through
//! sd_notify (`RELOADING=1`, then `READY=1`), and Debian's nginx, whose verdict is its
//! readiness probe passing again.

use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::Output;

use crate::support::*;

fn root_flags() -> Vec<&'static str> {
    if is_root() { vec!["--allow-root"] } else { vec![] }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// `tether reload ID`.
fn reload(dirs: &Dirs, id: &str) -> Output {
    tether().args(["reload", id, "--data-dir"]).arg(&dirs.data).output().unwrap()
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The pids of the children of `pid` (HAProxy's workers, under its master).
fn children(pid: i64) -> Vec<i64> {
    let tasks = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap_or_default();
    let mut pids: Vec<i64> = tasks.split_whitespace().filter_map(|p| p.parse().ok()).collect();
    pids.sort_unstable();
    pids
}

/// An HAProxy config with one TCP frontend per port.
fn haproxy_config(ports: &[u16]) -> String {
    let mut config =
        "global\n    maxconn 256\ndefaults\n    mode tcp\n    timeout connect 1s\n    timeout client 5s\n    \
                      timeout server 5s\n"
            .to_owned();
    for port in ports {
        config.push_str(&format!("frontend f{port}\n    bind 127.0.0.1:{port}\n    default_backend none\n"));
    }
    config + "backend none\n"
}

/// The service of an HAProxy under `-Ws` whose reload is SIGUSR2, checked by `haproxy -c`.
fn haproxy_service(haproxy: &str, config: &Path, watch: bool) -> String {
    let config = config.display();
    let watch = if watch { format!("watch = [\"{config}\"]\n") } else { String::new() };
    format!(
        "[[service]]\nname = \"edge\"\n[service.proxy]\ncommand = [\"{haproxy}\", \"-Ws\", \"-f\", \"{config}\"]\n\
         kill_signal = \"SIGUSR1\"\nkill_timeout = \"5s\"\n[service.proxy.readiness]\nnotify = true\n\
         [service.proxy.reload]\nsignal = \"SIGUSR2\"\ncheck = [\"{haproxy}\", \"-c\", \"-f\", \"{config}\"]\n{watch}"
    )
}

#[test]
fn haproxy_reloads_in_place_with_a_verdict_refuses_a_broken_config_and_no_connection() {
    let Some(haproxy) = haproxy() else {
        eprintln!("skipped: haproxy is not installed (CI installs Debian's haproxy)");
        return;
    };
    let dirs = Dirs::new();
    let (old, new) = (free_port(), free_port());
    let config = dirs.temp.path().join("haproxy.cfg");
    std::fs::write(&config, haproxy_config(&[old])).unwrap();
    dirs.write_config("edge.toml", &haproxy_service(haproxy, &config, false));
    let agent = Agent::start(&dirs, &root_flags());
    let master = agent.wait_state("edge-proxy", "running")["pid"].as_i64().unwrap();
    assert!(agent.proxy("edge-proxy").unwrap()["last_reload"].is_null());
    let prober = Prober::start(old);

    // The config gains a frontend: the reload applies it, in the same master.
    std::fs::write(&config, haproxy_config(&[old, new])).unwrap();
    let applied = reload(&dirs, "edge");
    assert!(applied.status.success(), "{} {}", text(&applied.stdout), text(&applied.stderr));
    assert_eq!(text(&applied.stdout).trim(), "reload edge: applied");
    TcpStream::connect(("127.0.0.1", new)).expect("the new frontend answers after `applied`");
    let status = agent.proxy("edge-proxy").unwrap();
    assert_eq!(status["pid"].as_i64(), Some(master), "the master was not restarted: {status}");
    assert_eq!((status["state"].as_str(), status["restarts"].as_u64()), (Some("running"), Some(0)), "{status}");
    assert_eq!(status["last_reload"]["result"], "applied", "{status}");
    assert!(status["last_reload"]["error"].is_null() && status["last_reload"]["at"].is_string(), "{status}");

    // A broken config is refused with HAProxy's own words; nothing is signalled (the
    // workers are the same), and the config before it keeps serving.
    let workers = wait_for("haproxy's workers after the reload", || {
        let workers = children(master);
        (workers.len() == 1).then_some(workers)
    });
    std::fs::write(&config, haproxy_config(&[old, new]) + "frontend broken\n    bind 127.0.0.1:notaport\n").unwrap();
    let refused = reload(&dirs, "edge-proxy");
    assert_eq!(refused.status.code(), Some(1), "{}", text(&refused.stdout));
    let reason = text(&refused.stderr);
    assert!(reason.contains("refused") && reason.contains("check failed (exit code 1)"), "{reason}");
    assert!(reason.contains("notaport"), "HAProxy's own message: {reason}");
    assert_eq!(children(master), workers, "no reload was signalled");
    TcpStream::connect(("127.0.0.1", old)).expect("the old config serves");
    TcpStream::connect(("127.0.0.1", new)).expect("the old config serves");
    let status = agent.proxy("edge-proxy").unwrap();
    assert_eq!(status["last_reload"]["result"], "refused", "{status}");
    assert!(status["last_reload"]["error"].as_str().unwrap().contains("notaport"), "{status}");

    let (tried, refused) = prober.counts();
    drop(prober);
    assert!(tried > 50, "the client connected {tried} times");
    assert_eq!(refused, 0, "{refused} of {tried} connections to the old frontend were refused across the reloads");

    let metrics = tether_get(&dirs, "/metrics");
    for line in [
        r#"tether_proxy_reloads_total{proxy="edge-proxy",result="applied"} 1"#,
        r#"tether_proxy_reloads_total{proxy="edge-proxy",result="refused"} 1"#,
        r#"tether_proxy_last_reload_success_timestamp_seconds{proxy="edge-proxy"}"#,
    ] {
        assert!(metrics.contains(line), "{line} in {metrics}");
    }
}

/// The body of `GET path` on the agent's socket.
fn tether_get(dirs: &Dirs, path: &str) -> String {
    let response = get(&dirs.socket(), path).unwrap();
    assert_eq!(response.status, 200, "GET {path}");
    response.body
}

#[test]
fn haproxy_reloads_when_a_watched_config_is_edited_or_renamed_into_place() {
    let Some(haproxy) = haproxy() else {
        eprintln!("skipped: haproxy is not installed (CI installs Debian's haproxy)");
        return;
    };
    let dirs = Dirs::new();
    let (first, second, third) = (free_port(), free_port(), free_port());
    let config = dirs.temp.path().join("haproxy.cfg");
    std::fs::write(&config, haproxy_config(&[first])).unwrap();
    dirs.write_config("edge.toml", &haproxy_service(haproxy, &config, true));
    let agent = Agent::start(&dirs, &root_flags());
    let master = agent.wait_state("edge-proxy", "running")["pid"].as_i64().unwrap();

    // Written in place: no command asks for the reload.
    std::fs::write(&config, haproxy_config(&[first, second])).unwrap();
    let edited = wait_for("a reload of the edited config", || {
        agent.proxy("edge-proxy").filter(|p| p["last_reload"]["result"] == "applied")
    });
    TcpStream::connect(("127.0.0.1", second)).expect("the edited config serves");
    // Renamed into place, as deployment tools write files.
    let staged = dirs.temp.path().join("haproxy.cfg.new");
    std::fs::write(&staged, haproxy_config(&[first, second, third])).unwrap();
    std::fs::rename(&staged, &config).unwrap();
    wait_for("a reload of the renamed config", || {
        agent.proxy("edge-proxy").filter(|p| p["last_reload"]["at"] != edited["last_reload"]["at"])
    });
    wait_until("the renamed config serves", || TcpStream::connect(("127.0.0.1", third)).map_err(|err| err.to_string()));
    let status = agent.proxy("edge-proxy").unwrap();
    assert_eq!(status["last_reload"]["result"], "applied", "{status}");
    assert_eq!(status["pid"].as_i64(), Some(master), "{status}");
}

/// Debian's nginx, when installed.
fn nginx() -> Option<&'static str> {
    ["/usr/sbin/nginx", "/usr/bin/nginx"].into_iter().find(|path| Path::new(path).exists())
}

/// An nginx config that runs in the foreground with every file in `dir`, and answers
/// `body` on `port`.
fn nginx_config(dir: &Path, port: u16, body: &str) -> String {
    let dir = dir.display();
    format!(
        "daemon off;\nworker_processes 1;\npid {dir}/nginx.pid;\nerror_log {dir}/error.log;\n\
         events {{ worker_connections 64; }}\n\
         http {{\n  access_log off;\n  client_body_temp_path {dir}/body;\n  proxy_temp_path {dir}/proxy;\n  \
         fastcgi_temp_path {dir}/fastcgi;\n  uwsgi_temp_path {dir}/uwsgi;\n  scgi_temp_path {dir}/scgi;\n  \
         server {{\n    listen 127.0.0.1:{port};\n    location / {{ return 200 \"{body}\"; }}\n  }}\n}}\n"
    )
}

/// The body nginx answers on `port`.
fn served(port: u16) -> String {
    let response = tcp_exchange(
        &format!("127.0.0.1:{port}"),
        format!("GET / HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .unwrap();
    response.body
}

#[test]
fn nginx_serves_a_changed_config_once_its_reload_is_applied() {
    let Some(nginx) = nginx() else {
        eprintln!("skipped: nginx is not installed (CI installs Debian's nginx)");
        return;
    };
    let dirs = Dirs::new();
    let port = free_port();
    let dir = dirs.temp.path().join("nginx");
    std::fs::create_dir(&dir).unwrap();
    let config = dir.join("nginx.conf");
    std::fs::write(&config, nginx_config(&dir, port, "v1")).unwrap();
    let config_text = config.display();
    dirs.write_config(
        "web.toml",
        &format!(
            "[[service]]\nname = \"web\"\n[service.proxy]\ncommand = [\"{nginx}\", \"-c\", \"{config_text}\"]\n\
             kill_signal = \"SIGQUIT\"\n[service.proxy.readiness]\nhttp = \"http://127.0.0.1:{port}/\"\ninterval = \"500ms\"\n\
             [service.proxy.reload]\nsignal = \"SIGHUP\"\ncheck = [\"{nginx}\", \"-t\", \"-c\", \"{config_text}\"]\n"
        ),
    );
    let agent = Agent::start(&dirs, &root_flags());
    let pid = agent.wait_state("web-proxy", "running")["pid"].as_i64().unwrap();
    assert_eq!(served(port), "v1");

    std::fs::write(&config, nginx_config(&dir, port, "v2")).unwrap();
    let applied = reload(&dirs, "web");
    assert!(applied.status.success(), "{} {}", text(&applied.stdout), text(&applied.stderr));
    assert_eq!(text(&applied.stdout).trim(), "reload web: applied");
    assert_eq!(served(port), "v2", "served once the reload is applied");
    assert_eq!(agent.proxy("web-proxy").unwrap()["pid"].as_i64(), Some(pid), "the same master");

    // `nginx -t` refuses a broken config, in its own words.
    std::fs::write(&config, nginx_config(&dir, port, "v3").replace("return 200", "retrun 200")).unwrap();
    let refused = reload(&dirs, "web");
    assert_eq!(refused.status.code(), Some(1));
    assert!(text(&refused.stderr).contains("unknown directive \"retrun\""), "{}", text(&refused.stderr));
    assert_eq!(served(port), "v2");
}

#[test]
fn a_reload_table_added_to_a_running_proxy_applies_in_place() {
    let dirs = Dirs::new();
    dirs.write_config("s.toml", &sleeper("s"));
    let agent = Agent::start(&dirs, &root_flags());
    let pid = agent.wait_state("s-proxy", "running")["pid"].as_i64().unwrap();
    let answer = reload(&dirs, "s");
    assert_eq!(answer.status.code(), Some(2), "{}", text(&answer.stderr));
    assert!(text(&answer.stderr).contains("has no reload table"), "{}", text(&answer.stderr));
    let unknown = reload(&dirs, "nothing");
    assert_eq!(unknown.status.code(), Some(1), "{}", text(&unknown.stderr));

    // The table alone changes: the same process takes it. (`sleep` would die of a SIGHUP;
    // the check refuses every reload, so nothing is signalled.)
    dirs.write_config(
        "s.toml",
        &(sleeper("s")
            + "[service.proxy.reload]\nsignal = \"SIGHUP\"\ncheck = [\"/bin/sh\", \"-c\", \"echo nope; exit 1\"]\n"),
    );
    let applied = tether().args(["reload", "--data-dir"]).arg(&dirs.data).output().unwrap();
    assert!(applied.status.success(), "{}", text(&applied.stderr));
    let refused = wait_for("the reload table in force", || {
        let answer = reload(&dirs, "s");
        (answer.status.code() == Some(1)).then_some(answer)
    });
    assert!(
        text(&refused.stderr).contains("reload s: refused: check failed (exit code 1): nope"),
        "{}",
        text(&refused.stderr)
    );
    let status = agent.proxy("s-proxy").unwrap();
    assert_eq!((status["pid"].as_i64(), status["restarts"].as_u64()), (Some(pid), Some(0)), "not restarted: {status}");
}

#[test]
fn an_exec_reload_runs_like_the_proxy_and_its_exit_is_the_verdict() {
    let dirs = Dirs::new();
    let marks = dirs.data.parent().unwrap().join("reloads");
    let pid_file = dirs.data.parent().unwrap().join("main.pid");
    // A proxy that re-reads on SIGHUP; its reload program finds it by its pid file and
    // signals it, as `nginx -s reload` does.
    let proxy = format!(
        "echo $$ > {pid}; trap 'echo reloaded >> {marks}' HUP; while :; do sleep 0.1; done",
        pid = pid_file.display(),
        marks = marks.display()
    );
    let exec = format!(
        "echo reload of $TETHER_PROXY_ID; [ ! -e {fail} ] || {{ echo refusing; exit 3; }}; kill -HUP $(cat {pid})",
        fail = dirs.data.parent().unwrap().join("fail").display(),
        pid = pid_file.display()
    );
    dirs.write_config(
        "s.toml",
        &format!(
            "[[service]]\nname = \"s\"\n[service.proxy]\ncommand = [\"/bin/sh\", \"-c\", \"{proxy}\"]\n\
             kill_timeout = \"2s\"\n[service.proxy.reload]\nexec = [\"/bin/sh\", \"-c\", \"{exec}\"]\n"
        ),
    );
    let agent = Agent::start(&dirs, &root_flags());
    let pid = agent.wait_state("s-proxy", "running")["pid"].as_i64().unwrap();
    wait_for("the proxy's pid file", || std::fs::read_to_string(&pid_file).ok().filter(|text| text.ends_with('\n')));

    // Nothing tells more than the program's exit 0: `signalled`, and the proxy got it.
    let answer = reload(&dirs, "s");
    assert_eq!(answer.status.code(), Some(0), "{}", text(&answer.stderr));
    assert!(text(&answer.stdout).contains("signalled"), "{}", text(&answer.stdout));
    wait_for("the proxy's own account of the reload", || {
        std::fs::read_to_string(&marks).ok().filter(|text| text == "reloaded\n")
    });
    let log = std::fs::read_to_string(dirs.data.join("logs").join("s-proxy-reload.log")).unwrap();
    assert_eq!(log, "reload of s-proxy\n", "run with the proxy's environment");

    // A program that exits non-zero fails the reload with its output; the proxy runs on.
    std::fs::write(dirs.data.parent().unwrap().join("fail"), "").unwrap();
    let failed = reload(&dirs, "s");
    assert_eq!(failed.status.code(), Some(1), "{}", text(&failed.stderr));
    assert!(text(&failed.stderr).contains("refusing"), "{}", text(&failed.stderr));
    let status = agent.proxy("s-proxy").unwrap();
    assert_eq!(status["last_reload"]["result"], "failed", "{status}");
    assert_eq!((status["pid"].as_i64(), status["restarts"].as_u64()), (Some(pid), Some(0)), "not restarted: {status}");
    assert_eq!(std::fs::read_to_string(&marks).unwrap(), "reloaded\n", "not signalled");
}
