//! The status page in a real browser: headless Chromium driven through ChromeDriver's
//! WebDriver protocol (plain HTTP and JSON), so that what a person sees is what is tested.
//!
//! Skipped, with the reason printed, where `chromium` or `chromedriver` is missing; CI
//! installs both.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use base64::Engine;
use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::Pid;
use serde_json::{Value, json};

use crate::support::*;

const CHROMIUM: &str = "/usr/bin/chromium";
const CHROMEDRIVER: &str = "/usr/bin/chromedriver";

/// `--allow-root` when the tests run as root, so that proxies without `user` may run.
fn root_flags() -> Vec<&'static str> {
    if is_root() { vec!["--allow-root"] } else { vec![] }
}

pub(crate) fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// How long a browser may take to start: its first start on a fresh machine builds the
/// font cache, and on a loaded CI machine that alone has taken more than [`DEADLINE`].
const BROWSER_START: Duration = Duration::from_secs(120);

/// One HTTP/1.1 exchange with a JSON body over TCP, answered within `timeout`; the
/// answer's JSON.
fn http_json(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: Option<&Value>,
    timeout: Duration,
) -> std::io::Result<Value> {
    let body = body.map(Value::to_string).unwrap_or_default();
    let mut stream = TcpStream::connect(addr)?;
    stream.set_read_timeout(Some(timeout))?;
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )?;
    // ChromeDriver keeps the connection open whatever the request says: read the head,
    // then exactly the body it announces.
    let mut raw = Vec::new();
    let mut buffer = [0_u8; 16 << 10];
    let head_end = loop {
        let read = stream.read(&mut buffer)?;
        if read == 0 {
            return Err(std::io::Error::other("the connection closed before the head ended"));
        }
        raw.extend_from_slice(&buffer[..read]);
        if let Some(end) = raw.windows(4).position(|window| window == b"\r\n\r\n") {
            break end + 4;
        }
    };
    let head = String::from_utf8_lossy(&raw[..head_end]).to_ascii_lowercase();
    let length: usize = head
        .lines()
        .find_map(|line| line.strip_prefix("content-length:"))
        .and_then(|value| value.trim().parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("no content-length in {head}")))?;
    while raw.len() < head_end + length {
        let read = stream.read(&mut buffer)?;
        if read == 0 {
            break;
        }
        raw.extend_from_slice(&buffer[..read]);
    }
    let payload = String::from_utf8_lossy(&raw[head_end..]);
    serde_json::from_str(&payload).map_err(|err| std::io::Error::other(format!("{err}: {payload}")))
}

/// ChromeDriver and its browser, in a process group that is killed on drop.
pub(crate) struct Browser {
    driver: Child,
    addr: SocketAddr,
    session: String,
    _profile: tempfile::TempDir,
}

impl Browser {
    pub(crate) fn start() -> Self {
        let port = free_port();
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let driver = Command::new(CHROMEDRIVER)
            .arg(format!("--port={port}"))
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let profile = tempfile::tempdir().unwrap();
        let mut browser = Self { driver, addr, session: String::new(), _profile: profile };
        wait_until("chromedriver to answer", || {
            http_json(addr, "GET", "/status", None, DEADLINE).map_err(|err| err.to_string()).map(drop)
        });
        let capabilities = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": CHROMIUM,
                "args": [
                    "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                    "--disable-background-networking", "--disable-component-update", "--disable-sync",
                    "--disable-quic", "--no-first-run", "--window-size=1280,800",
                    format!("--user-data-dir={}", browser._profile.path().display()),
                ],
            },
        }}});
        let created = http_json(addr, "POST", "/session", Some(&capabilities), BROWSER_START)
            .unwrap_or_else(|err| panic!("the browser did not start within {BROWSER_START:?}: {err}"));
        browser.session =
            created["value"]["sessionId"].as_str().unwrap_or_else(|| panic!("no session: {created}")).to_owned();
        browser
    }

    fn command(&self, method: &str, what: &str, body: Option<&Value>) -> Value {
        let path = format!("/session/{}/{what}", self.session);
        let answer = http_json(self.addr, method, &path, body, DEADLINE).unwrap();
        assert!(answer["value"].get("error").is_none(), "{what}: {answer}");
        answer["value"].clone()
    }

    pub(crate) fn open(&self, url: &str) {
        self.command("POST", "url", Some(&json!({ "url": url })));
    }

    /// Runs `script` in the page and returns its value.
    pub(crate) fn eval(&self, script: &str) -> Value {
        self.command("POST", "execute/sync", Some(&json!({ "script": script, "args": [] })))
    }

    pub(crate) fn screenshot(&self, path: &Path) {
        let data = self.command("GET", "screenshot", None);
        let png = base64::engine::general_purpose::STANDARD.decode(data.as_str().unwrap()).unwrap();
        std::fs::write(path, png).unwrap();
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        if !self.session.is_empty() {
            let _ = http_json(self.addr, "DELETE", &format!("/session/{}", self.session), None, DEADLINE);
        }
        let _ = killpg(Pid::from_raw(self.driver.id() as i32), Signal::SIGKILL);
        let _ = self.driver.wait();
    }
}

/// The text of `class`'s cell in the row of proxy `id`, or null.
fn cell_script(id: &str, class: &str) -> String {
    format!(
        "const row = document.querySelector('tr[data-proxy=\"{id}\"]'); \
         return row ? row.querySelector('td.{class}').textContent : null;"
    )
}

#[test]
fn the_status_page_lists_the_proxies_and_shows_a_restart_without_a_reload() {
    for program in [CHROMIUM, CHROMEDRIVER] {
        if !Path::new(program).exists() {
            eprintln!("skipped: {program} is missing (install Debian's chromium and chromium-driver)");
            return;
        }
    }
    let dirs = Dirs::new();
    let _sweep = SweepOnDrop(dirs.socket());
    let services: String = (0..3).map(|n| sleeper(&format!("s{n}"))).collect();
    dirs.write_config("a.toml", &services);
    let port = free_port();
    let http_addr = format!("127.0.0.1:{port}");
    let mut flags = root_flags();
    flags.extend(["--http-addr", &http_addr]);
    let agent = Agent::start(&dirs, &flags);
    for n in 0..3 {
        agent.wait_state(&format!("s{n}-proxy"), "running");
    }

    let browser = Browser::start();
    browser.open(&format!("http://{http_addr}/"));
    let listed = wait_for("the page to list the proxies", || {
        let ids =
            browser.eval("return [...document.querySelectorAll('#proxies tr[data-proxy]')].map(r => r.dataset.proxy);");
        (ids.as_array().is_some_and(|ids| ids.len() == 3)).then_some(ids)
    });
    assert_eq!(listed, json!(["s0-proxy", "s1-proxy", "s2-proxy"]));
    let pid = wait_for("s1-proxy's pid on the page", || {
        let pid = browser.eval(&cell_script("s1-proxy", "pid"));
        pid.as_str().and_then(|pid| pid.parse::<i32>().ok())
    });
    assert_eq!(Some(i64::from(pid)), agent.proxy("s1-proxy").unwrap()["pid"].as_i64());
    assert_eq!(browser.eval(&cell_script("s1-proxy", "state")), json!("running"));
    wait_for("the page to say it is live", || {
        (browser.eval("return document.getElementById('connection').textContent;") == json!("live")).then_some(())
    });

    // Killed from outside: the page shows the new process, and one more restart, by
    // itself (no reload), within a second.
    kill(Pid::from_raw(pid), Signal::SIGKILL).unwrap();
    let killed_at = Instant::now();
    let shown = loop {
        let now = browser.eval(&cell_script("s1-proxy", "pid"));
        let restarts = browser.eval(&cell_script("s1-proxy", "restarts"));
        if let Some(new) = now.as_str().and_then(|text| text.parse::<i32>().ok()).filter(|new| *new != pid) {
            if restarts == json!("1") {
                break new;
            }
        }
        assert!(killed_at.elapsed() < Duration::from_secs(1), "the page did not show the restart within a second");
        std::thread::sleep(Duration::from_millis(20));
    };
    let took = killed_at.elapsed();
    assert_eq!(Some(i64::from(shown)), agent.proxy("s1-proxy").unwrap()["pid"].as_i64());
    eprintln!("the page showed the restart {took:?} after the kill");
    let artifact = Path::new(env!("CARGO_TARGET_TMPDIR")).join("status-page.png");
    browser.screenshot(&artifact);
    eprintln!("screenshot: {}", artifact.display());
    assert!(std::fs::metadata(&artifact).unwrap().len() > 1000);
}

/// Skips the test, saying why, where the browser or its driver is missing.
pub(crate) fn browser_missing() -> bool {
    for program in [CHROMIUM, CHROMEDRIVER] {
        if !Path::new(program).exists() {
            eprintln!("skipped: {program} is missing (install Debian's chromium and chromium-driver)");
            return true;
        }
    }
    false
}

/// Where a screenshot of the page in `state` is written, for a person to look at.
pub(crate) fn artifact(state: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("status-page-{state}.png"))
}

/// Opens the detail of proxy `id` once the page lists its row: a page just opened may
/// not have received its first list yet.
fn open_detail(browser: &Browser, id: &str) {
    wait_for(&format!("{id}'s row to click"), || {
        let script = format!(
            "const cell = document.querySelector('tr[data-proxy=\"{id}\"] td.id'); \
             if (!cell) return false; cell.click(); return true;"
        );
        (browser.eval(&script) == json!(true)).then_some(())
    });
}

/// The text of the detail's entry `key` of proxy `id`, or null while it is not shown.
fn detail_script(id: &str, key: &str) -> String {
    format!(
        "const detail = document.querySelector('tr[data-detail=\"{id}\"]'); \
         const entry = detail && detail.querySelector('dd[data-key=\"{key}\"]'); \
         return entry ? entry.textContent : null;"
    )
}

#[test]
fn the_page_shows_a_failed_reload_with_its_message_and_a_restart_on_the_proxys_timeline() {
    if browser_missing() {
        return;
    }
    let dirs = Dirs::new();
    let _sweep = SweepOnDrop(dirs.socket());
    // web's reload is refused by its check, with a message; db is killed from outside.
    let config = sleeper("web")
        + "[service.proxy.reload]\nsignal = \"SIGHUP\"\ncheck = [\"/bin/sh\", \"-c\", \"echo bad config line 7; exit 1\"]\n"
        + &sleeper("db");
    dirs.write_config("a.toml", &config);
    let port = free_port();
    let http_addr = format!("127.0.0.1:{port}");
    let mut flags = root_flags();
    flags.extend(["--http-addr", &http_addr]);
    let agent = Agent::start(&dirs, &flags);
    agent.wait_state("web-proxy", "running");
    let db = pid_of(&agent.wait_state("db-proxy", "running"));

    let browser = Browser::start();
    browser.open(&format!("http://{http_addr}/"));
    wait_for("the page to say it is live", || {
        (browser.eval("return document.getElementById('connection').textContent;") == json!("live")).then_some(())
    });
    // The page's own rules: no inline script or style would run under its policy.
    let inline = browser.eval("return document.querySelectorAll('script:not([src]), style, [style]').length;");
    assert_eq!(inline, json!(0), "the page has inline script or style");

    // A refused reload: its verdict and message in web's detail, and in the events feed.
    let answer = put(&dirs.socket(), "/v1/agent/proxy/web-proxy/reload", None).unwrap();
    assert!(answer.body.contains("bad config line 7"), "the check refuses the reload: {}", answer.body);
    open_detail(&browser, "web-proxy");
    let shown = wait_for("the failed reload in web's detail", || {
        browser.eval(&detail_script("web-proxy", "last-reload")).as_str().map(str::to_owned)
    });
    assert!(shown.contains("refused") && shown.contains("bad config line 7"), "{shown}");
    wait_for("the failed reload in the events feed", || {
        let found = browser.eval("return [...document.querySelectorAll('#feed li')].filter(li => li.dataset.event === 'reload-failed' && li.textContent.includes('bad config line 7')).length;");
        (found.as_i64() >= Some(1)).then_some(())
    });
    browser.screenshot(&artifact("failed-reload"));

    // A kill from outside: db's timeline gets a restart mark, and its detail names it.
    open_detail(&browser, "db-proxy");
    kill(Pid::from_raw(i32::try_from(db).unwrap()), Signal::SIGKILL).unwrap();
    wait_for("a restart on db's timeline", || {
        let marks = browser.eval("const d = document.querySelector('tr[data-detail=\"db-proxy\"]'); return d ? [...d.querySelectorAll('svg.timeline .mark')].map(m => m.dataset.event) : [];");
        let marks: Vec<String> = serde_json::from_value(marks).unwrap_or_default();
        (marks.iter().any(|mark| mark == "restarted") && marks.iter().any(|mark| mark == "exited")).then_some(())
    });
    // The feed follows one proxy when asked.
    browser.eval("const f = document.getElementById('feed-filter'); f.value = 'db-proxy'; f.dispatchEvent(new Event('input')); return null;");
    let proxies =
        browser.eval("return [...new Set([...document.querySelectorAll('#feed li')].map(li => li.dataset.proxy))];");
    assert_eq!(proxies, json!(["db-proxy"]));
    browser.screenshot(&artifact("restart-timeline"));

    // What the page learned before it was opened: a page opened now shows the same
    // timeline from the agent's history.
    browser.open(&format!("http://{http_addr}/"));
    wait_for("db's restart from the history", || {
        let found = browser.eval("return [...document.querySelectorAll('#feed li')].filter(li => li.dataset.proxy === 'db-proxy' && li.dataset.event === 'restarted').length;");
        (found.as_i64() >= Some(1)).then_some(())
    });
    eprintln!("screenshots: {} and {}", artifact("failed-reload").display(), artifact("restart-timeline").display());
}

#[test]
fn the_detail_shows_each_dependency_with_its_state_the_last_render_and_the_last_lines_of_output() {
    if browser_missing() {
        return;
    }
    let dirs = Dirs::new();
    let _sweep = SweepOnDrop(dirs.socket());
    let ready = dirs.temp.path().join("db.ready");
    let rendered = dirs.temp.path().join("web.conf");
    // db says two lines and is ready once the test makes its file; web waits for it and
    // renders a file from the catalog.
    let config = format!(
        "[[service]]\nname = \"db\"\n[service.proxy]\n\
         command = [\"/bin/sh\", \"-c\", \"echo hello from db; echo second line; exec sleep 3600\"]\n\
         kill_timeout = \"2s\"\n\
         [service.proxy.readiness]\nexec = [\"/bin/test\", \"-e\", \"{ready}\"]\ninterval = \"50ms\"\n\
         [[service]]\nname = \"web\"\n[service.proxy]\ncommand = [\"/bin/sleep\", \"3600\"]\nkill_timeout = \"2s\"\n\
         depends_on = {{ db = \"ready\" }}\n\
         [[service.proxy.template]]\ncontents = '''{{% for s in services %}}{{{{ s.id }}}}\n{{% endfor %}}'''\n\
         destination = \"{rendered}\"\n",
        ready = ready.display(),
        rendered = rendered.display()
    );
    dirs.write_config("a.toml", &config);
    let port = free_port();
    let http_addr = format!("127.0.0.1:{port}");
    let mut flags = root_flags();
    flags.extend(["--http-addr", &http_addr, "--http-logs"]);
    let agent = Agent::start(&dirs, &flags);
    agent.wait_state("web-proxy", "waiting");

    let browser = Browser::start();
    browser.open(&format!("http://{http_addr}/"));
    open_detail(&browser, "web-proxy");
    let waiting = wait_for("web's dependency in its detail", || {
        browser.eval(&detail_script("web-proxy", "depends-on")).as_str().map(str::to_owned)
    });
    assert!(waiting.starts_with("db (ready): ") && !waiting.contains("running"), "db is not ready yet: {waiting}");

    std::fs::write(&ready, "").unwrap();
    agent.wait_state("web-proxy", "running");
    wait_for("db running in web's detail", || {
        let shown = browser.eval(&detail_script("web-proxy", "depends-on"));
        (shown.as_str() == Some("db (ready): running")).then_some(())
    });
    let templates = wait_for("web's template in its detail", || {
        browser.eval(&detail_script("web-proxy", "templates")).as_str().map(str::to_owned)
    });
    assert!(templates.starts_with(&format!("{}: ", rendered.display())), "{templates}");
    assert!(templates.ends_with("rendered") || templates.ends_with("unchanged"), "{templates}");
    let status = agent.proxy("web-proxy").unwrap();
    assert_eq!(status["depends_on"], json!([{ "dependency": "db", "condition": "ready", "proxy": "db-proxy" }]));
    assert_eq!(status["templates"][0]["error"], Value::Null, "{status}");

    // db's output, through the logs endpoint that the agent serves with --http-logs.
    open_detail(&browser, "db-proxy");
    let logs = wait_for("db's output in its detail", || {
        let shown = browser.eval(&detail_script("db-proxy", "logs"));
        shown.as_str().filter(|text| text.contains("second line")).map(str::to_owned)
    });
    assert!(logs.contains("hello from db\nsecond line"), "{logs}");
    browser.screenshot(&artifact("dependencies-templates-logs"));
    eprintln!("screenshot: {}", artifact("dependencies-templates-logs").display());
}

#[test]
fn a_thousand_proxies_are_listed_and_one_change_applied_without_freezing_the_page() {
    if browser_missing() {
        return;
    }
    const PROXIES: usize = 1000;
    let dirs = Dirs::new();
    let _sweep = SweepOnDrop(dirs.socket());
    let services: String = (0..PROXIES).map(|n| sleeper(&format!("s{n:04}"))).collect();
    dirs.write_config("many.toml", &services);
    let port = free_port();
    let http_addr = format!("127.0.0.1:{port}");
    let mut flags = root_flags();
    flags.extend(["--http-addr", &http_addr]);
    let agent = Agent::start(&dirs, &flags);
    wait_for("every proxy running", || {
        let proxies = agent.proxies();
        (proxies.iter().filter(|p| p["state"] == "running").count() == PROXIES).then_some(())
    });

    let browser = Browser::start();
    browser.open(&format!("http://{http_addr}/"));
    let first = wait_for("the page's first list", || {
        let timings = browser.eval("return window.tetherTimings;");
        (timings["rows"] == json!(PROXIES)).then_some(timings)
    });
    let summary = browser.eval("return document.getElementById('summary').textContent;");
    assert_eq!(summary, json!(format!("{PROXIES} proxies: {PROXIES} running")));
    // A page of rows is in the document, and the next page holds the rest.
    let rows = browser.eval("return document.querySelectorAll('#proxies tr[data-proxy]').length;");
    assert_eq!(rows, json!(500));
    browser.eval("document.getElementById('next').click(); return null;");
    let last = browser
        .eval("const r = document.querySelectorAll('#proxies tr[data-proxy]'); return r[r.length - 1].dataset.proxy;");
    assert_eq!(last, json!(format!("s{:04}-proxy", PROXIES - 1)));

    // One change: the page applies it, and says how long its last refresh took.
    let victim = format!("s{:04}-proxy", PROXIES - 1);
    let pid = pid_of(&agent.proxy(&victim).unwrap());
    let before = browser.eval("return window.tetherTimings.lastApply;");
    kill(Pid::from_raw(i32::try_from(pid).unwrap()), Signal::SIGKILL).unwrap();
    wait_for("the restart on the page", || {
        let restarts = browser.eval(&cell_script(&victim, "restarts"));
        (restarts == json!("1")).then_some(())
    });
    let after = browser.eval("return window.tetherTimings;");
    assert_ne!(after["lastApply"], before, "the change was applied by a refresh");
    eprintln!(
        "{PROXIES} proxies: first list drawn {:.0} ms after the page began to load; a refresh with one change took {:.1} ms \
         (fetch, parse and draw)",
        first["firstRender"].as_f64().unwrap_or(f64::NAN),
        after["lastRefreshMs"].as_f64().unwrap_or(f64::NAN)
    );
    browser.screenshot(&artifact("thousand"));
}
