//! The built-in proxy: traffic, live config through blocking queries, tokens, and an agent
//! restart underneath it.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;

use crate::support::*;

fn root_flags() -> Vec<&'static str> {
    if is_root() { vec!["--allow-root"] } else { vec![] }
}

/// An upstream on loopback that serves each connection on a thread of its own.
struct Upstream {
    port: u16,
}

impl Upstream {
    /// Answers each line with `<name>: <line>`.
    fn start(name: &'static str) -> Self {
        Self::serving(move |mut stream| {
            let mut buffer = [0u8; 1024];
            while let Ok(n) = stream.read(&mut buffer) {
                if n == 0 {
                    return;
                }
                let line = String::from_utf8_lossy(&buffer[..n]);
                if stream.write_all(format!("{name}: {line}").as_bytes()).is_err() {
                    return;
                }
            }
        })
    }

    /// Reads until EOF, then answers every byte it read, reversed in order, and closes:
    /// both directions and the half-close must pass through the proxy intact.
    fn reverser() -> Self {
        Self::serving(|mut stream| {
            let mut received = Vec::new();
            if stream.read_to_end(&mut received).is_ok() {
                received.reverse();
                let _ = stream.write_all(&received);
            }
        })
    }

    fn serving(serve: impl Fn(TcpStream) + Copy + Send + 'static) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { return };
                std::thread::spawn(move || serve(stream));
            }
        });
        Self { port }
    }
}

/// An agent whose one service `<name>` has a built-in proxy on `bind` in front of
/// `upstream`, once that proxy runs. The agent drops (and stops) before the dirs.
struct Running {
    agent: Agent,
    dirs: Dirs,
    pid: i64,
}

fn run_builtin(name: &str, upstream: &Upstream, bind: u16) -> Running {
    let dirs = Dirs::new();
    dirs.write_config("a.toml", &builtin(name, upstream.port, bind));
    let agent = Agent::start(&dirs, &root_flags());
    let pid = agent.wait_state(&format!("{name}-proxy"), "running")["pid"].as_i64().unwrap();
    Running { agent, dirs, pid }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn builtin(name: &str, upstream: u16, bind: u16) -> String {
    format!(
        "[[service]]\nname = \"{name}\"\nport = {upstream}\n[service.proxy]\nkill_timeout = \"2s\"\nconfig = {{ bind_port = {bind} }}\n"
    )
}

/// Connects to `port`, retrying while the proxy starts listening.
fn connect(port: u16) -> TcpStream {
    let stream = wait_for("the proxy to listen", || TcpStream::connect(("127.0.0.1", port)).ok());
    stream.set_read_timeout(Some(DEADLINE)).unwrap();
    stream
}

fn exchange(stream: &mut TcpStream, line: &str) -> String {
    stream.write_all(line.as_bytes()).unwrap();
    let mut buffer = [0u8; 1024];
    let n = stream.read(&mut buffer).unwrap();
    String::from_utf8_lossy(&buffer[..n]).into_owned()
}

fn token_of(pid: i64) -> String {
    let environ = wait_for("the proxy's environment", || {
        let environ = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
        (!environ.is_empty()).then_some(environ)
    });
    environ
        .split(|b| *b == 0)
        .find_map(|var| var.strip_prefix(b"TETHER_PROXY_TOKEN="))
        .map(|t| String::from_utf8(t.to_vec()).unwrap())
        .unwrap()
}

#[test]
fn traffic_flows_and_a_new_bind_port_moves_the_listener_without_a_restart_or_a_broken_connection() {
    let upstream = Upstream::start("up");
    let (old_port, new_port) = (free_port(), free_port());
    let Running { agent, dirs, pid } = &run_builtin("web", &upstream, old_port);

    let mut open = connect(old_port);
    assert_eq!(exchange(&mut open, "one"), "up: one");

    dirs.write_config("a.toml", &builtin("web", upstream.port, new_port));
    agent.signal(Signal::SIGHUP);
    let mut moved = connect(new_port);
    assert_eq!(exchange(&mut moved, "two"), "up: two");
    wait_for("the old listener to close", || TcpStream::connect(("127.0.0.1", old_port)).is_err().then_some(()));
    assert_eq!(exchange(&mut open, "three"), "up: three", "the established connection keeps flowing");
    assert_eq!(agent.proxy("web-proxy").unwrap()["pid"].as_i64(), Some(*pid), "the proxy was not restarted");
}

#[test]
fn a_bulk_transfer_and_a_half_close_pass_through_intact_both_ways() {
    let bind = free_port();
    let _running = run_builtin("bulk", &Upstream::reverser(), bind);

    // 24 MiB of a pattern with no period that divides a pipe or socket buffer.
    let sent: Vec<u8> = (0..24 * 1024 * 1024_u32).map(|index| (index % 251) as u8).collect();
    let mut stream = connect(bind);
    let mut writer = stream.try_clone().unwrap();
    let to_send = sent.clone();
    let sending = std::thread::spawn(move || {
        writer.write_all(&to_send).unwrap();
        // The upstream answers only once it has seen EOF: the proxy must pass it on.
        writer.shutdown(std::net::Shutdown::Write).unwrap();
    });
    let mut received = Vec::new();
    stream.read_to_end(&mut received).unwrap();
    sending.join().unwrap();
    let mut expected = sent;
    expected.reverse();
    assert_eq!(received.len(), expected.len(), "bytes received back");
    assert!(received == expected, "the bytes came back altered");
}

/// A stream of pseudo-random bytes (xorshift), the same for the same seed.
struct Pattern(u64);

impl Pattern {
    fn fill(&mut self, buffer: &mut [u8]) {
        for byte in buffer {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            *byte = self.0 as u8;
        }
    }
}

/// An FNV-1a checksum of a stream, fed as it arrives.
struct Checksum {
    hash: u64,
    bytes: u64,
}

impl Checksum {
    fn new() -> Self {
        Self { hash: 0xcbf2_9ce4_8422_2325, bytes: 0 }
    }

    fn feed(&mut self, data: &[u8]) {
        for byte in data {
            self.hash = (self.hash ^ u64::from(*byte)).wrapping_mul(0x0100_0000_01b3);
        }
        self.bytes += data.len() as u64;
    }

    /// Reads `stream` to its end.
    fn of(stream: &mut TcpStream) -> std::io::Result<Self> {
        let mut checksum = Self::new();
        let mut buffer = vec![0; 256 * 1024];
        loop {
            match stream.read(&mut buffer)? {
                0 => return Ok(checksum),
                read => checksum.feed(&buffer[..read]),
            }
        }
    }
}

/// Writes `bytes` of the pattern of `seed` to `stream`: their checksum.
fn send_pattern(stream: &mut TcpStream, seed: u64, bytes: u64) -> Checksum {
    let mut pattern = Pattern(seed);
    let mut checksum = Checksum::new();
    let mut buffer = vec![0; 256 * 1024];
    let mut left = bytes;
    while left > 0 {
        let size = buffer.len().min(usize::try_from(left).unwrap());
        pattern.fill(&mut buffer[..size]);
        stream.write_all(&buffer[..size]).unwrap();
        checksum.feed(&buffer[..size]);
        left -= size as u64;
    }
    checksum
}

/// The descriptors `pid` has open.
fn open_descriptors(pid: i64) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, Iterator::count)
}

/// An upstream that serves one connection with `serve` on a thread whose result the test
/// joins.
fn serve_once<T: Send + 'static>(
    serve: impl FnOnce(TcpStream) -> T + Send + 'static,
) -> (Upstream, std::thread::JoinHandle<T>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let serving = std::thread::spawn(move || {
        let (stream, _) = listener.accept().unwrap();
        stream.set_read_timeout(Some(DEADLINE)).unwrap();
        serve(stream)
    });
    (Upstream { port }, serving)
}

/// Sends the pattern of `seed` from a thread of its own, then half-closes.
fn send_then_half_close(stream: &TcpStream, seed: u64, bytes: u64) -> std::thread::JoinHandle<Checksum> {
    let mut writer = stream.try_clone().unwrap();
    std::thread::spawn(move || {
        let sent = send_pattern(&mut writer, seed, bytes);
        writer.shutdown(std::net::Shutdown::Write).unwrap();
        sent
    })
}

#[test]
fn large_transfers_both_ways_at_once_arrive_whole_through_the_spliced_path() {
    // More than any pipe or socket buffer holds, in both directions at the same time, so
    // that each direction waits for a full pipe and a full socket while the other flows.
    const BYTES: u64 = 256 * 1024 * 1024;
    let (upstream, serving) = serve_once(|mut stream| {
        let sending = send_then_half_close(&stream, 2, BYTES);
        let read = Checksum::of(&mut stream).unwrap();
        (read, sending.join().unwrap())
    });
    let bind = free_port();
    let _running = run_builtin("large", &upstream, bind);
    let mut stream = connect(bind);
    let sending = send_then_half_close(&stream, 1, BYTES);
    let received = Checksum::of(&mut stream).unwrap();
    let sent = sending.join().unwrap();
    let (upstream_read, upstream_sent) = serving.join().unwrap();
    assert_eq!((upstream_read.bytes, upstream_read.hash), (sent.bytes, sent.hash), "client to upstream");
    assert_eq!((received.bytes, received.hash), (upstream_sent.bytes, upstream_sent.hash), "upstream to client");
}

#[test]
fn a_half_close_by_the_upstream_leaves_the_other_direction_flowing() {
    // The upstream says all it has to say and half-closes first; the client reads the EOF,
    // and only then sends its own stream, which must still arrive whole.
    const BYTES: u64 = 16 * 1024 * 1024;
    let (upstream, serving) = serve_once(|mut stream| {
        stream.write_all(b"hello").unwrap();
        stream.shutdown(std::net::Shutdown::Write).unwrap();
        Checksum::of(&mut stream).unwrap()
    });
    let bind = free_port();
    let _running = run_builtin("halfup", &upstream, bind);
    let mut stream = connect(bind);
    let mut greeting = Vec::new();
    stream.read_to_end(&mut greeting).unwrap();
    assert_eq!(greeting, b"hello", "the upstream's bytes, then its EOF");
    let sent = send_then_half_close(&stream, 3, BYTES).join().unwrap();
    let read = serving.join().unwrap();
    assert_eq!((read.bytes, read.hash), (sent.bytes, sent.hash), "sent after the upstream's half-close");
}

#[test]
fn a_client_that_resets_resets_the_upstream_and_frees_the_connection() {
    let (greeted, greeting) = std::sync::mpsc::channel();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let upstream = Upstream { port: listener.local_addr().unwrap().port() };
    let serving = std::thread::spawn(move || {
        // The connection that greets; the test's first one, which only checks that the
        // proxy listens, ends at once.
        let mut stream = loop {
            let (mut stream, _) = listener.accept().unwrap();
            stream.set_read_timeout(Some(DEADLINE)).unwrap();
            let mut buffer = [0; 5];
            if stream.read_exact(&mut buffer).is_ok() {
                greeted.send(buffer).unwrap();
                break stream;
            }
        };
        // Then the reset, not an orderly EOF.
        loop {
            match stream.read(&mut [0; 1024]) {
                Ok(0) => return Err("an orderly EOF".to_owned()),
                Ok(_) => {}
                Err(err) if err.kind() == std::io::ErrorKind::ConnectionReset => return Ok(()),
                Err(err) => return Err(err.to_string()),
            }
        }
    });
    let bind = free_port();
    let Running { pid, .. } = &run_builtin("reset", &upstream, bind);
    // The proxy listening and following its config: what it holds with no connection.
    drop(connect(bind));
    let idle = wait_for("the proxy to settle", || {
        let before = open_descriptors(*pid);
        std::thread::sleep(Duration::from_millis(50));
        (open_descriptors(*pid) == before).then_some(before)
    });
    let mut stream = connect(bind);
    stream.write_all(b"hello").unwrap();
    assert_eq!(&greeting.recv_timeout(DEADLINE).unwrap(), b"hello", "forwarded before the reset");
    // A zero linger makes the close a reset.
    nix::sys::socket::setsockopt(&stream, nix::sys::socket::sockopt::Linger, &libc::linger { l_onoff: 1, l_linger: 0 })
        .unwrap();
    drop(stream);
    assert_eq!(serving.join().unwrap(), Ok(()), "what the upstream saw");
    wait_for("the proxy to close both sockets and both pipes", || (open_descriptors(*pid) <= idle).then_some(()));
}

#[test]
fn logs_written_to_files_are_plain_text_without_terminal_colours() {
    let bind = free_port();
    let Running { agent, dirs, .. } = &run_builtin("web", &Upstream::start("up"), bind);
    // The proxy logs its route once it has its config; by then it listens.
    assert_eq!(exchange(&mut connect(bind), "hi"), "up: hi");
    let proxy_log = dirs.data.join("logs/web-proxy-stderr.log");
    let proxy_lines = wait_for("the built-in proxy to log its route", || {
        std::fs::read_to_string(&proxy_log).ok().filter(|text| text.contains("listening"))
    });
    for (whose, text) in [("the agent's stderr", agent.logs()), ("the proxy's log file", proxy_lines)] {
        assert!(!text.is_empty(), "{whose} is empty");
        assert!(!text.contains('\x1b'), "{whose} has terminal escape codes: {text:?}");
    }
}

#[test]
fn the_config_endpoint_needs_the_token_and_hints_nothing() {
    let upstream = Upstream::start("up");
    let Running { dirs, pid, .. } = &run_builtin("web", &upstream, free_port());
    let token = token_of(*pid);
    let socket = dirs.socket();
    let config = |id: &str, token: Option<&str>| {
        let headers: Vec<(&str, &str)> = token.map(|t| ("X-Tether-Proxy-Token", t)).into_iter().collect();
        request(&socket, "GET", &format!("/v1/agent/proxy/{id}/config"), &headers, None).unwrap()
    };
    let good = config("web-proxy", Some(&token));
    assert_eq!(good.status, 200, "{}", good.body);
    let body = good.json();
    assert_eq!(body["service"]["port"], upstream.port);
    assert!(body["config"]["bind_port"].is_number());
    assert!(body["index"].as_u64().unwrap() > 0);

    let wrong = config("web-proxy", Some(&"0".repeat(64)));
    let missing = config("web-proxy", None);
    let unknown = config("nope-proxy", Some(&token));
    for refused in [&wrong, &missing, &unknown] {
        assert_eq!(refused.status, 403);
    }
    assert_eq!(wrong.body, unknown.body, "an unknown id and a wrong token look the same");
}

#[test]
fn a_blocking_query_returns_on_change_and_on_timeout() {
    let upstream = Upstream::start("up");
    let bind = free_port();
    let Running { agent, dirs, pid } = &run_builtin("web", &upstream, bind);
    let token = token_of(*pid);
    let socket = dirs.socket();
    let headers = [("X-Tether-Proxy-Token", token.as_str())];
    let index = request(&socket, "GET", "/v1/agent/proxy/web-proxy/config", &headers, None).unwrap().json()["index"]
        .as_u64()
        .unwrap();

    let started = Instant::now();
    let timed_out =
        request(&socket, "GET", &format!("/v1/agent/proxy/web-proxy/config?index={index}&wait=300ms"), &headers, None)
            .unwrap();
    assert!(started.elapsed() >= Duration::from_millis(300), "it waited for the change that did not come");
    assert_eq!(timed_out.json()["index"].as_u64(), Some(index));

    let waiter = {
        let socket = socket.clone();
        let token = token.clone();
        std::thread::spawn(move || {
            let headers = [("X-Tether-Proxy-Token", token.as_str())];
            request(&socket, "GET", &format!("/v1/agent/proxy/web-proxy/config?index={index}&wait=60s"), &headers, None)
        })
    };
    dirs.write_config("a.toml", &builtin("web", upstream.port, bind).replace("bind_port", "answer = 42, bind_port"));
    agent.signal(Signal::SIGHUP);
    let changed = waiter.join().unwrap().unwrap().json();
    assert!(changed["index"].as_u64().unwrap() > index);
    assert_eq!(changed["config"]["answer"], 42);
    let stale = request(&socket, "GET", "/v1/agent/proxy/web-proxy/config?index=0&wait=60s", &headers, None).unwrap();
    assert_eq!(stale.status, 200, "a stale index answers at once");
}

#[test]
fn the_built_in_proxy_survives_an_agent_restart_and_keeps_forwarding() {
    let bind = free_port();
    let Running { agent: first, dirs, pid } = &mut run_builtin("web", &Upstream::start("up"), bind);
    let mut open = connect(bind);
    assert_eq!(exchange(&mut open, "before"), "up: before");

    first.signal(Signal::SIGTERM);
    assert!(first.wait().success());
    assert_eq!(exchange(&mut open, "during"), "up: during", "forwarding goes on without the agent");
    let mut fresh = connect(bind);
    assert_eq!(exchange(&mut fresh, "new"), "up: new");

    let second = Agent::start(dirs, &root_flags());
    assert_eq!(second.wait_state("web-proxy", "running")["pid"].as_i64(), Some(*pid));
    assert_eq!(exchange(&mut open, "after"), "up: after");
}

#[test]
fn dev_mode_serves_the_demo_over_mutual_tls_between_two_built_in_proxies_and_leaves_nothing_behind() {
    use std::io::BufRead;
    let mut child = tether()
        .args(["agent", "--dev", "--sync-quiescent", "20ms"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    struct Guard(std::process::Child, Option<std::path::PathBuf>);
    impl Drop for Guard {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
            if let Some(socket) = &self.1 {
                kill_proxies_of(socket);
            }
        }
    }
    let stdout = child.stdout.take().unwrap();
    let mut guard = Guard(child, None);
    let mut lines = std::io::BufReader::new(stdout).lines();
    let mut port = None;
    let mut data_dir = None;
    let mut demo_port = None;
    for line in lines.by_ref() {
        let line = line.unwrap();
        if let Some(address) = line.trim().strip_prefix("demo proxy:") {
            let address = address.split_whitespace().next().unwrap();
            demo_port = Some(address.trim_start_matches("127.0.0.1:").parse::<u16>().unwrap());
        }
        if let Some(dir) = line.trim().strip_prefix("data dir:") {
            data_dir = Some(std::path::PathBuf::from(dir.split_whitespace().next().unwrap()));
        }
        if let Some(url) = line.trim().strip_prefix("curl http://127.0.0.1:") {
            port = Some(url.trim_end_matches('/').parse::<u16>().unwrap());
            break;
        }
    }
    let (port, data_dir) = (port.expect("a curl command"), data_dir.expect("the data dir"));
    guard.1 = Some(data_dir.join("agent.sock"));
    let answer = wait_for("the demo through the proxy", || {
        let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
        stream.set_read_timeout(Some(DEADLINE)).ok()?;
        stream.write_all(b"GET / HTTP/1.1\r\nHost: demo\r\n\r\n").ok()?;
        let mut answer = String::new();
        stream.read_to_string(&mut answer).ok()?;
        (!answer.is_empty()).then_some(answer)
    });
    assert!(answer.starts_with("HTTP/1.1 200 OK"), "{answer}");
    assert!(answer.contains("hello from the tether demo upstream"), "{answer}");
    // The demo's readiness is `notify`: the built-in proxy said READY=1 once it listened.
    let socket = data_dir.join("agent.sock");
    let demo = wait_for("the demo proxy ready", || {
        get(&socket, "/v1/agent/proxy/demo-proxy").ok().map(|r| r.json()).filter(|p| p["ready"] == true)
    });
    assert_eq!(demo["state"], "running", "{demo}");
    // The curl goes to web's upstream, which reaches the demo's proxy over mutual TLS.
    let demo_port = demo_port.expect("the demo proxy's address");
    assert_eq!(demo["status_text"], format!("listening on 127.0.0.1:{demo_port}"), "{demo}");
    // --dev makes a CA in its data dir: the demo has an identity.
    let spiffe = demo["certificate"]["spiffe_id"].as_str().unwrap_or_default();
    assert!(spiffe.starts_with("spiffe://") && spiffe.ends_with(".tether/ns/default/dc/dc1/svc/demo"), "{demo}");

    nix::sys::signal::kill(nix::unistd::Pid::from_raw(guard.0.id() as i32), Signal::SIGINT).unwrap();
    let status = wait_for("the dev agent to exit", || guard.0.try_wait().unwrap());
    assert!(status.success());
    assert!(proxies_of(&data_dir.join("agent.sock")).is_empty(), "--dev stops its proxies on exit");
    assert!(!data_dir.exists(), "--dev leaves no data dir behind");
}

#[test]
fn the_built_in_proxy_carries_on_when_its_log_cannot_be_written() {
    // Its stderr is a file on a full file system: each line it logs is lost, and it goes on.
    // The "agent" here is a socket that hangs up on every request: the proxy logs a warning
    // after each, then asks again, so a second request means it survived a lost line.
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("agent.sock");
    let agent = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    let mut proxy = command(Path::new(env!("CARGO_BIN_EXE_tether")))
        .arg("connect-proxy")
        .env("TETHER_PROXY_ID", "web-proxy")
        .env("TETHER_PROXY_TOKEN", "0123456789abcdef0123456789abcdef")
        .env("TETHER_SOCKET", &socket)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::OpenOptions::new().write(true).open("/dev/full").unwrap())
        .spawn()
        .unwrap();
    let (answered, asked) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for request in agent.incoming().take(3) {
            drop(request);
            if answered.send(()).is_err() {
                return;
            }
        }
    });
    for n in 1..=3 {
        let start = Instant::now();
        while asked.recv_timeout(Duration::from_millis(20)).is_err() {
            let exited = proxy.try_wait().unwrap();
            if exited.is_some() || start.elapsed() > DEADLINE {
                let _ = proxy.kill();
                panic!("request {n} never came; the proxy exited: {exited:?}");
            }
        }
    }
    let _ = proxy.kill();
    proxy.wait().unwrap();
}

/// The built-in proxy as `user` (root only: switching users; `None` elsewhere, said for
/// `test`), in front of an upstream that answers lines, with `extra` agent flags: the
/// running agent, the dirs, the port, and the directory of the agent's binary, which must
/// outlive the agent.
fn run_as_nobody(test: &str, extra: &[&str]) -> Option<(Agent, Dirs, u16, tempfile::TempDir)> {
    if !is_root() {
        eprintln!("skipping {test}: needs root (switching users)");
        return None;
    }
    let upstream = Upstream::start("up");
    let bind = free_port();
    let dirs = Dirs::new();
    dirs.write_config(
        "a.toml",
        &builtin("web", upstream.port, bind).replace("kill_timeout", "user = \"nobody\"\nkill_timeout"),
    );
    // The built-in proxy is the agent's own binary, which `nobody` must be able to run: the
    // build's directory may be closed to other users (a checkout in a private directory),
    // so the agent runs from a copy in one that is open to them.
    let bin = tempfile::tempdir().unwrap();
    std::fs::set_permissions(bin.path(), std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let program = bin.path().join("tether");
    let built = Path::new(env!("CARGO_BIN_EXE_tether"));
    if std::fs::hard_link(built, &program).is_err() {
        std::fs::copy(built, &program).unwrap();
    }
    let agent = Agent::spawn_with(&program, &dirs, extra);
    wait_for("the agent's socket", || get(&agent.socket, "/v1/agent/health").ok().filter(|r| r.status == 200));
    Some((agent, dirs, bind, bin))
}

#[test]
fn as_root_a_built_in_proxy_with_a_user_reaches_the_agent_at_its_http_address() {
    let http = format!("127.0.0.1:{}", free_port());
    let test = "as_root_a_built_in_proxy_with_a_user_reaches_the_agent_at_its_http_address";
    let Some((agent, dirs, bind, _bin)) = run_as_nobody(test, &["--http-addr", &http]) else { return };
    agent.wait_state("web-proxy", "running");
    let mut stream = connect(bind);
    assert_eq!(exchange(&mut stream, "one"), "up: one");
    let log = std::fs::read_to_string(dirs.data.join("logs/web-proxy-stderr.log")).unwrap();
    assert!(log.contains("the agent's socket is closed to this user; asking the agent at its HTTP address"), "{log}");
}

#[test]
fn as_root_a_built_in_proxy_with_a_user_and_no_http_address_exits_saying_what_it_needs() {
    let test = "as_root_a_built_in_proxy_with_a_user_and_no_http_address_exits_saying_what_it_needs";
    let Some((agent, dirs, _, _bin)) = run_as_nobody(test, &[]) else { return };
    let log = dirs.data.join("logs/web-proxy-stderr.log");
    wait_for("the proxy to say why it cannot run", || {
        let text = std::fs::read_to_string(&log).ok()?;
        text.contains("a proxy with another `user` reaches the agent at its --http-addr").then_some(())
    });
    // It exits as for a usage error, and the agent tries again on its backoff.
    wait_until("the proxy's exit and a restart", || {
        let status = agent.proxy("web-proxy").ok_or("no such proxy")?;
        let exited = status["last_exit"] == serde_json::json!({ "code": 2 }) && status["restarts"].as_u64() >= Some(1);
        if exited { Ok(()) } else { Err(status.to_string()) }
    });
}
