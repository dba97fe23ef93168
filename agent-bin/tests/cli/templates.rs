//! `[[service.proxy.template]]`: files rendered from the catalog before a proxy starts, and
//! again when what they read changes.

use std::path::{Path, PathBuf};

use assert_cmd::prelude::*;

use crate::support::*;

/// `--allow-root` when the tests run as root, so that proxies without `user` may run.
fn root_flags() -> Vec<&'static str> {
    if is_root() { vec!["--allow-root"] } else { vec![] }
}

/// A service `web` whose proxy prints its rendered file at start, then sleeps; its template
/// is `contents`, rendered to `destination`.
fn web(destination: &Path, contents: &str) -> String {
    format!(
        "[[service]]\nname = \"web\"\nport = 8080\n[service.proxy]\n\
         command = [\"/bin/sh\", \"-c\", \"echo start; cat {dest}; echo end; exec sleep 3600\"]\n\
         kill_timeout = \"2s\"\n\
         [[service.proxy.template]]\ncontents = '''{contents}'''\ndestination = \"{dest}\"\nwait = \"50ms\"\n",
        dest = destination.display()
    )
}

fn rendered(dirs: &Dirs) -> PathBuf {
    dirs.temp.path().join("rendered").join("web.conf")
}

fn stdout_log(dirs: &Dirs) -> String {
    std::fs::read_to_string(dirs.data.join("logs/web-proxy-stdout.log")).unwrap_or_default()
}

fn register(dirs: &Dirs, body: &str) -> Response {
    put(&dirs.socket(), "/v1/agent/service/register", Some(body)).unwrap()
}

fn renders(dirs: &Dirs, result: &str) -> u64 {
    let metrics = get(&dirs.socket(), "/metrics").unwrap().body;
    let wanted = format!("tether_template_renders_total{{proxy=\"web-proxy\",result=\"{result}\"}} ");
    metrics.lines().find_map(|line| line.strip_prefix(&wanted)?.parse().ok()).unwrap_or(0)
}

/// A child process (`tether events --json`, say), killed and reaped on drop.
pub(crate) struct KillOnDrop(pub(crate) std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Streams the agent's events, one JSON line each, to the receiver as they come.
pub(crate) fn events(dirs: &Dirs) -> (KillOnDrop, std::sync::mpsc::Receiver<String>) {
    use std::io::BufRead;
    let mut child = tether()
        .args(["events", "--json", "--data-dir"])
        .arg(&dirs.data)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (send, receive) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in std::io::BufReader::new(stdout).lines() {
            let Ok(line) = line else { return };
            if send.send(line).is_err() {
                return;
            }
        }
    });
    (KillOnDrop(child), receive)
}

const SERVICES: &str = "{% for s in services %}{{ s.id }} {{ s.address }}:{{ s.port }}\n{% endfor %}";

#[test]
fn a_proxy_reads_its_rendered_file_at_start_and_is_restarted_when_a_new_service_changes_it() {
    let dirs = Dirs::new();
    let _sweep = SweepOnDrop(dirs.socket());
    std::fs::create_dir(dirs.temp.path().join("rendered")).unwrap();
    dirs.write_config("web.toml", &web(&rendered(&dirs), SERVICES));
    dirs.write_config("db.toml", "[[service]]\nname = \"db\"\nport = 5432\n");
    let agent = Agent::start(&dirs, &root_flags());
    let first = agent.wait_state("web-proxy", "running");

    // Rendered before the start: the process read it.
    let expected = "db 127.0.0.1:5432\nweb 127.0.0.1:8080\n";
    let log = wait_for("the proxy to print its file", || {
        let log = stdout_log(&dirs);
        log.contains("end\n").then_some(log)
    });
    assert_eq!(log, format!("start\n{expected}end\n"));
    assert_eq!(std::fs::read_to_string(rendered(&dirs)).unwrap(), expected);
    assert_eq!(mode(&rendered(&dirs)), 0o644);
    assert_eq!(renders(&dirs, "rendered"), 1);

    // A new service changes the file: rendered again, and the proxy restarted to read it.
    let answer = register(&dirs, r#"{"name": "cache", "port": 6379}"#);
    assert_eq!(answer.status, 200, "{}", answer.body);
    let expected = "cache 127.0.0.1:6379\ndb 127.0.0.1:5432\nweb 127.0.0.1:8080\n";
    let second = wait_for("a restart after the new file", || {
        let now = agent.proxy("web-proxy")?;
        (now["state"] == "running" && now["pid"] != first["pid"]).then_some(now)
    });
    assert_eq!(std::fs::read_to_string(rendered(&dirs)).unwrap(), expected);
    wait_for("the new instance to print the new file", || {
        stdout_log(&dirs).ends_with(&format!("start\n{expected}end\n")).then_some(())
    });
    assert_eq!(renders(&dirs, "rendered"), 2);

    // A change that leaves the bytes as they are rewrites nothing and restarts nothing.
    let inode = std::fs::metadata(rendered(&dirs)).map(|m| std::os::unix::fs::MetadataExt::ino(&m)).unwrap();
    let unchanged_before = renders(&dirs, "unchanged");
    let answer = register(&dirs, r#"{"name": "cache", "port": 6379, "tags": ["new"]}"#);
    assert_eq!(answer.status, 200, "{}", answer.body);
    wait_for("an unchanged render", || (renders(&dirs, "unchanged") > unchanged_before).then_some(()));
    let inode_after = std::fs::metadata(rendered(&dirs)).map(|m| std::os::unix::fs::MetadataExt::ino(&m)).unwrap();
    assert_eq!(inode_after, inode, "the file was not rewritten");
    assert_eq!(agent.proxy("web-proxy").unwrap()["pid"], second["pid"], "not restarted");
}

#[test]
fn a_template_that_cannot_render_fails_the_start_naming_the_template_and_line() {
    let dirs = Dirs::new();
    let _sweep = SweepOnDrop(dirs.socket());
    std::fs::create_dir(dirs.temp.path().join("rendered")).unwrap();
    dirs.write_config("web.toml", &web(&rendered(&dirs), "fine\n{{ service.nmae }}\n"));
    let agent = Agent::start(&dirs, &root_flags());
    let failed = agent.wait_state("web-proxy", "failed");
    let error = failed["error"].as_str().unwrap();
    let destination = rendered(&dirs).display().to_string();
    assert!(error.contains(&format!("template {destination}: line 2: ")) && error.contains("undefined"), "{error}");
    assert!(!rendered(&dirs).exists(), "nothing is written");
    assert!(stdout_log(&dirs).is_empty(), "the proxy never ran");
    assert!(renders(&dirs, "failed") >= 1);

    // Fixed: started at once on the change, without waiting for the backoff.
    dirs.write_config("web.toml", &web(&rendered(&dirs), "fine\n{{ service.name }}\n"));
    tether().args(["reload", "--data-dir"]).arg(&dirs.data).assert().code(0);
    let running = agent.wait_state("web-proxy", "running");
    assert!(running["error"].is_null(), "{running}");
    assert_eq!(std::fs::read_to_string(rendered(&dirs)).unwrap(), "fine\nweb\n");
}

#[test]
fn a_later_render_error_keeps_the_last_good_file_and_the_proxy_running() {
    let dirs = Dirs::new();
    let _sweep = SweepOnDrop(dirs.socket());
    std::fs::create_dir(dirs.temp.path().join("rendered")).unwrap();
    // Every instance of `api` must have a `zone`: one without is an error of the template.
    let template = "{% for i in instances('api') %}{{ i.id }} {{ i.meta.zone }}\n{% endfor %}";
    dirs.write_config("web.toml", &web(&rendered(&dirs), template));
    dirs.write_config("api.toml", "[[service]]\nname = \"api\"\nid = \"api-1\"\nmeta = { zone = \"a\" }\n");
    let agent = Agent::start(&dirs, &root_flags());
    agent.wait_state("web-proxy", "running");
    assert_eq!(std::fs::read_to_string(rendered(&dirs)).unwrap(), "api-1 a\n");

    // The events stream is open once it tells of a restart.
    let (_events, lines) = events(&dirs);
    wait_for("the events stream", || {
        tether().args(["restart", "web-proxy", "--data-dir"]).arg(&dirs.data).assert().code(0);
        lines.recv_timeout(std::time::Duration::from_millis(500)).ok()
    });
    let running = agent.wait_state("web-proxy", "running");
    let answer = register(&dirs, r#"{"name": "api", "id": "api-2"}"#);
    assert_eq!(answer.status, 200, "{}", answer.body);
    let failed = wait_for("a template-failed event", || {
        let line = lines.try_recv().ok()?;
        let event: serde_json::Value = serde_json::from_str(&line).unwrap();
        (event["event"] == "template-failed").then_some(event)
    });
    assert_eq!(failed["proxy"], "web-proxy");
    assert!(failed["detail"].as_str().unwrap().contains("line 1"), "{failed}");
    let shown =
        wait_for("the template's error in the status", || agent.proxy("web-proxy").filter(|p| p["error"].is_string()));
    let error = shown["error"].as_str().unwrap();
    assert!(error.contains(&format!("template {}: line 1: ", rendered(&dirs).display())), "{error}");
    assert_eq!(shown["state"], "running");
    assert_eq!(shown["pid"], running["pid"], "the proxy runs on");
    assert_eq!(std::fs::read_to_string(rendered(&dirs)).unwrap(), "api-1 a\n", "the last good file stays");
    assert!(renders(&dirs, "failed") >= 1);

    // The instance gets its zone: the file is rendered again and the error goes.
    let answer = register(&dirs, r#"{"name": "api", "id": "api-2", "meta": {"zone": "b"}}"#);
    assert_eq!(answer.status, 200, "{}", answer.body);
    wait_for("the new file", || (std::fs::read_to_string(rendered(&dirs)).ok()? == "api-1 a\napi-2 b\n").then_some(()));
    wait_for("the error to clear", || agent.proxy("web-proxy").filter(|p| p["error"].is_null()));
}

#[test]
fn the_register_api_refuses_templates_without_allow_api_commands() {
    let dirs = Dirs::new();
    let _sweep = SweepOnDrop(dirs.socket());
    let _agent = Agent::start(&dirs, &root_flags());
    let body = r#"{"name": "x", "proxy": {"template": [{"contents": "x", "destination": "/etc/cron.d/x"}]}}"#;
    let answer = register(&dirs, body);
    assert_eq!(answer.status, 403, "{}", answer.body);
    assert!(answer.body.contains("proxy.template"), "{}", answer.body);
    assert!(!Path::new("/etc/cron.d/x").exists());
}

#[test]
fn validate_names_a_template_that_does_not_parse() {
    let dirs = Dirs::new();
    dirs.write_config("web.toml", &web(Path::new("/run/web.conf"), "ok\n{% for x in %}\n"));
    let output = tether().arg("validate").arg(&dirs.config).output().unwrap();
    let stderr = String::from_utf8(output.stderr).unwrap();
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("web.toml: field `service[0].proxy.template[0]`: template /run/web.conf: line 2: syntax error"),
        "{stderr}"
    );
    dirs.write_config("web.toml", &web(Path::new("/run/web.conf"), "ok\n"));
    tether().arg("validate").arg(&dirs.config).assert().code(0);
}

#[test]
fn instances_follow_readiness_and_on_change_none_leaves_the_proxy_running() {
    let dirs = Dirs::new();
    let _sweep = SweepOnDrop(dirs.socket());
    std::fs::create_dir(dirs.temp.path().join("rendered")).unwrap();
    let template = "{% for i in instances('api') %}{{ i.id }}\n{% endfor %}";
    let text = web(&rendered(&dirs), template).replace("wait = \"50ms\"", "wait = \"50ms\"\non_change = \"none\"");
    dirs.write_config("web.toml", &text);
    dirs.write_config("api.toml", &sleeper("api"));
    let agent = Agent::start(&dirs, &root_flags());
    agent.wait_state("api-proxy", "running");
    let web = agent.wait_state("web-proxy", "running");
    // An instance with a proxy counts once its proxy is running.
    wait_for("api in the file", || (std::fs::read_to_string(rendered(&dirs)).ok()? == "api\n").then_some(()));

    // Held down, it is not ready: it leaves the file; the proxy is not restarted (`none`).
    tether().args(["stop", "api", "--data-dir"]).arg(&dirs.data).assert().code(0);
    wait_for("api out of the file", || (std::fs::read_to_string(rendered(&dirs)).ok()?.is_empty()).then_some(()));
    tether().args(["start", "api", "--data-dir"]).arg(&dirs.data).assert().code(0);
    wait_for("api back in the file", || (std::fs::read_to_string(rendered(&dirs)).ok()? == "api\n").then_some(()));
    assert_eq!(agent.proxy("web-proxy").unwrap()["pid"], web["pid"], "on_change = \"none\" restarts nothing");
}

#[test]
fn a_changed_file_reloads_its_proxy_and_a_refused_reload_puts_the_previous_file_back() {
    let dirs = Dirs::new();
    let _sweep = SweepOnDrop(dirs.socket());
    std::fs::create_dir(dirs.temp.path().join("rendered")).unwrap();
    let destination = rendered(&dirs);
    // A proxy that counts its SIGHUPs in its log, whose check refuses a file naming `bad`;
    // with a reload table, `on_change` defaults to `reload`.
    let config = format!(
        "[[service]]\nname = \"web\"\nport = 8080\n[service.proxy]\n\
         command = [\"/bin/sh\", \"-c\", \"trap 'echo hup' HUP; while :; do sleep 0.05; done\"]\n\
         kill_timeout = \"2s\"\n\
         [service.proxy.reload]\nsignal = \"SIGHUP\"\n\
         check = [\"/bin/sh\", \"-c\", \"if grep -q bad {dest}; then echo 'bad line in {dest}'; exit 1; fi\"]\n\
         [[service.proxy.template]]\ncontents = '''{SERVICES}'''\ndestination = \"{dest}\"\nwait = \"50ms\"\n",
        dest = destination.display()
    );
    dirs.write_config("web.toml", &config);
    let agent = Agent::start(&dirs, &root_flags());
    let first = agent.wait_state("web-proxy", "running");
    assert_eq!(std::fs::read_to_string(&destination).unwrap(), "web 127.0.0.1:8080\n");

    // A new service: the file changes, the check passes, the proxy is signalled, not restarted.
    let answer = register(&dirs, r#"{"name": "cache", "port": 6379}"#);
    assert_eq!(answer.status, 200, "{}", answer.body);
    let good = "cache 127.0.0.1:6379\nweb 127.0.0.1:8080\n";
    let reloaded = wait_for("a reload after the new file", || {
        let now = agent.proxy("web-proxy")?;
        (!now["last_reload"].is_null()).then_some(now)
    });
    assert_eq!(reloaded["last_reload"]["result"], "signalled", "{reloaded}");
    assert_eq!(reloaded["pid"], first["pid"], "reloaded, not restarted");
    assert_eq!(std::fs::read_to_string(&destination).unwrap(), good);
    wait_for("the proxy to see its SIGHUP", || stdout_log(&dirs).contains("hup\n").then_some(()));

    // A service whose name the check refuses: the reload is refused, the previous file is
    // back, the proxy keeps running, and its status says why.
    let answer = register(&dirs, r#"{"name": "bad", "port": 9}"#);
    assert_eq!(answer.status, 200, "{}", answer.body);
    let refused = wait_for("a refused reload", || {
        let now = agent.proxy("web-proxy")?;
        (now["last_reload"]["result"] == "refused").then_some(now)
    });
    assert_eq!(refused["pid"], first["pid"], "still the same process");
    let error = wait_for("the template's error", || {
        let now = agent.proxy("web-proxy")?;
        now["error"].as_str().filter(|e| e.contains("previous file is back")).map(str::to_owned)
    });
    assert!(error.contains("bad line in"), "the check's own output: {error}");
    assert_eq!(std::fs::read_to_string(&destination).unwrap(), good, "the previous file is back");
    assert_eq!(stdout_log(&dirs).matches("hup\n").count(), 1, "nothing signalled for the refused file");
}

#[test]
fn temporaries_that_a_crash_left_beside_a_rendered_file_and_in_the_data_dir_are_removed() {
    let dirs = Dirs::new();
    let destination = rendered(&dirs);
    std::fs::create_dir_all(destination.parent().unwrap()).unwrap();
    std::fs::create_dir_all(dirs.data.join("registrations")).unwrap();
    // A crashed agent's: its pid is gone.
    let mut crashed = std::process::Command::new("/bin/true").spawn().unwrap();
    let gone = crashed.id();
    crashed.wait().unwrap();
    let left = [
        destination.with_file_name(format!(".web.conf.tmp.{gone}.0")),
        dirs.data.join(format!(".snapshot.json.tmp.{gone}.4")),
        dirs.data.join("registrations").join(format!(".api.json.tmp.{gone}.1")),
    ];
    // Not the agent's to remove: a live writer's, and another file's.
    let kept = [
        destination.with_file_name(format!(".web.conf.tmp.{}.0", std::process::id())),
        destination.with_file_name(format!(".other.conf.tmp.{gone}.0")),
    ];
    for path in left.iter().chain(&kept) {
        std::fs::write(path, "partial").unwrap();
    }
    dirs.write_config("web.toml", &web(&destination, "port {{ service.port }}"));
    let agent = Agent::start(&dirs, &root_flags());
    agent.wait_state("web-proxy", "running");
    assert_eq!(std::fs::read_to_string(&destination).unwrap(), "port 8080");
    for path in &left {
        assert!(!path.exists(), "{} is left", path.display());
    }
    for path in &kept {
        assert!(path.exists(), "{} was removed", path.display());
    }
}

#[test]
fn a_destination_that_another_proxy_writes_fails_the_second_and_leaves_the_file_alone() {
    let dirs = Dirs::new();
    let destination = rendered(&dirs);
    std::fs::create_dir_all(destination.parent().unwrap()).unwrap();
    dirs.write_config("web.toml", &web(&destination, "web's"));
    let mut flags = root_flags();
    flags.push("--allow-api-commands");
    let agent = Agent::start(&dirs, &flags);
    agent.wait_state("web-proxy", "running");
    // From another source, which the config files are not validated with.
    let body = format!(
        r#"{{"name": "other", "proxy": {{"command": ["/bin/sleep", "3600"],
            "template": [{{"contents": "other's", "destination": "{}"}}]}}}}"#,
        destination.display()
    );
    let response = register(&dirs, &body);
    assert_eq!(response.status, 200, "{}", response.body);
    let other = wait_for("other-proxy refused its template", || {
        agent.proxy("other-proxy").filter(|status| status["state"] == "failed" || status["state"] == "backoff")
    });
    let error = other["error"].as_str().unwrap_or_default();
    assert!(error.contains("also the destination of a template of web-proxy"), "{other}");
    assert_eq!(std::fs::read_to_string(&destination).unwrap(), "web's");
    assert_eq!(agent.proxy("web-proxy").unwrap()["state"], "running");
}

#[test]
fn a_destination_whose_directory_became_a_link_is_not_written_through() {
    let dirs = Dirs::new();
    let _sweep = SweepOnDrop(dirs.socket());
    let base = dirs.temp.path().join("rendered");
    let parent = base.join("pd");
    let victim = base.join("victim");
    std::fs::create_dir_all(&parent).unwrap();
    std::fs::create_dir_all(&victim).unwrap();
    let destination = parent.join("p.cfg");
    let config = web(&destination, SERVICES).replace("wait = \"50ms\"", "wait = \"50ms\"\non_change = \"none\"");
    dirs.write_config("web.toml", &config);
    let agent = Agent::start(&dirs, &root_flags());
    let running = agent.wait_state("web-proxy", "running");
    assert_eq!(std::fs::read_to_string(&destination).unwrap(), "web 127.0.0.1:8080\n");

    // The destination's directory is swapped for a link after the first render.
    std::fs::rename(&parent, base.join("pd.real")).unwrap();
    std::os::unix::fs::symlink(&victim, &parent).unwrap();
    let answer = register(&dirs, r#"{"name": "cache", "port": 6379}"#);
    assert_eq!(answer.status, 200, "{}", answer.body);
    let error = wait_for("the template's error naming the link", || {
        agent.proxy("web-proxy")?["error"].as_str().map(str::to_owned)
    });
    assert!(error.contains(&format!("template {}", destination.display())), "{error}");
    assert!(error.contains(&format!("{} is a symbolic link", parent.display())), "{error}");
    assert!(!victim.join("p.cfg").exists(), "written through the link");
    assert_eq!(std::fs::read_dir(&victim).unwrap().count(), 0, "nothing is left in the link's target");
    let now = agent.proxy("web-proxy").unwrap();
    assert_eq!((&now["state"], &now["pid"]), (&running["state"], &running["pid"]), "the proxy runs on");

    // The directory is back: the next change renders again and the error goes.
    std::fs::remove_file(&parent).unwrap();
    std::fs::rename(base.join("pd.real"), &parent).unwrap();
    let answer = register(&dirs, r#"{"name": "db", "port": 5432}"#);
    assert_eq!(answer.status, 200, "{}", answer.body);
    let expected = "cache 127.0.0.1:6379\ndb 127.0.0.1:5432\nweb 127.0.0.1:8080\n";
    wait_for("the new file", || (std::fs::read_to_string(&destination).ok()? == expected).then_some(()));
    wait_for("the error to clear", || agent.proxy("web-proxy").filter(|p| p["error"].is_null()));
}

#[test]
fn a_template_beyond_its_max_size_fails_naming_it_and_writes_nothing() {
    let dirs = Dirs::new();
    let _sweep = SweepOnDrop(dirs.socket());
    std::fs::create_dir(dirs.temp.path().join("rendered")).unwrap();
    // 17 000 000 bytes: beyond the default of 16 MiB.
    dirs.write_config("web.toml", &web(&rendered(&dirs), "{{ 'x' * 17000000 }}"));
    let agent = Agent::start(&dirs, &root_flags());
    let failed = agent.wait_state("web-proxy", "failed");
    let error = failed["error"].as_str().unwrap();
    let destination = rendered(&dirs).display().to_string();
    assert!(error.contains(&format!("template {destination}: ")), "{error}");
    assert!(error.contains("more than its max_size of 16777216 bytes"), "{error}");
    assert!(!rendered(&dirs).exists(), "nothing is written");
    assert!(stdout_log(&dirs).is_empty(), "the proxy never ran");

    // A larger cap lets it render.
    let config = web(&rendered(&dirs), "{{ 'x' * 17000000 }}").replace("wait = \"50ms\"", "max_size = \"32MiB\"");
    dirs.write_config("web.toml", &config);
    tether().args(["reload", "--data-dir"]).arg(&dirs.data).assert().code(0);
    agent.wait_state("web-proxy", "running");
    assert_eq!(std::fs::metadata(rendered(&dirs)).unwrap().len(), 17_000_000);
}

#[test]
fn a_failing_template_does_not_stop_its_siblings_from_rendering() {
    let dirs = Dirs::new();
    let _sweep = SweepOnDrop(dirs.socket());
    let base = dirs.temp.path().join("rendered");
    std::fs::create_dir(&base).unwrap();
    let zones = base.join("zones.conf");
    let listing = base.join("services.conf");
    // The first template needs every service to have a `zone`; the second lists them all.
    let config = format!(
        "[[service]]\nname = \"web\"\nport = 8080\nmeta = {{ zone = \"a\" }}\n[service.proxy]\n\
         command = [\"/bin/sleep\", \"3600\"]\nkill_timeout = \"2s\"\n\
         [[service.proxy.template]]\ncontents = '''{{% for s in services %}}{{{{ s.meta.zone }}}}\n{{% endfor %}}'''\n\
         destination = \"{zones}\"\nwait = \"50ms\"\non_change = \"none\"\n\
         [[service.proxy.template]]\ncontents = '''{SERVICES}'''\ndestination = \"{listing}\"\nwait = \"50ms\"\n\
         on_change = \"none\"\n",
        zones = zones.display(),
        listing = listing.display(),
    );
    dirs.write_config("web.toml", &config);
    let agent = Agent::start(&dirs, &root_flags());
    let running = agent.wait_state("web-proxy", "running");
    assert_eq!(std::fs::read_to_string(&zones).unwrap(), "a\n");
    assert_eq!(std::fs::read_to_string(&listing).unwrap(), "web 127.0.0.1:8080\n");

    // A service without a zone: the first template fails, the second renders all the same.
    let answer = register(&dirs, r#"{"name": "cache", "port": 6379}"#);
    assert_eq!(answer.status, 200, "{}", answer.body);
    let error =
        wait_for("the first template's error", || agent.proxy("web-proxy")?["error"].as_str().map(str::to_owned));
    assert!(error.contains(&format!("template {}: line 1", zones.display())), "{error}");
    let expected = "cache 127.0.0.1:6379\nweb 127.0.0.1:8080\n";
    wait_for("the sibling's new file", || (std::fs::read_to_string(&listing).ok()? == expected).then_some(()));
    assert_eq!(std::fs::read_to_string(&zones).unwrap(), "a\n", "the failed one keeps its last good file");

    // And again on the next change, while the first still fails.
    let answer = register(&dirs, r#"{"name": "db", "port": 5432}"#);
    assert_eq!(answer.status, 200, "{}", answer.body);
    let expected = "cache 127.0.0.1:6379\ndb 127.0.0.1:5432\nweb 127.0.0.1:8080\n";
    wait_for("the sibling's next file", || (std::fs::read_to_string(&listing).ok()? == expected).then_some(()));
    assert_eq!(agent.proxy("web-proxy").unwrap()["pid"], running["pid"], "the proxy runs on");
}
