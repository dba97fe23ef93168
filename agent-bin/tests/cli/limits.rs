//! What the API's listeners let a client take: connections over a listener's cap are
//! closed, a slow or silent client is cut after the header timeout (a blocking query is
//! not), the HTTP address answers only loopback names, and every error answer is JSON.

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::support::*;

/// The agent's header timeout (`HEADER_TIMEOUT` in `agent/serve.rs`).
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);

/// How long after the header timeout a cut connection must be seen closed.
const CUT_DEADLINE: Duration = Duration::from_secs(15);

fn root_flags() -> Vec<&'static str> {
    if is_root() { vec!["--allow-root"] } else { vec![] }
}

/// An agent with one `sleep` proxy, `web-proxy`, running, and `--http-addr` at the returned
/// address.
fn agent_with_http(dirs: &Dirs, nofile: Option<u64>) -> (Agent, String) {
    dirs.write_config("web.toml", &sleeper("web"));
    let addr = free_loopback_addr();
    let mut flags = root_flags();
    flags.extend(["--http-addr", addr.as_str()]);
    let agent = match nofile {
        Some(nofile) => Agent::start_with_nofile(dirs, &flags, nofile),
        None => Agent::start(dirs, &flags),
    };
    agent.wait_state("web-proxy", "running");
    (agent, addr)
}

#[test]
fn idle_connections_beyond_the_cap_leave_the_socket_and_supervision_working() {
    let dirs = Dirs::new();
    let _sweep = SweepOnDrop(dirs.socket());
    // With 256 descriptors, the TCP address may hold 32 connections.
    let (agent, addr) = agent_with_http(&dirs, Some(256));
    let first = agent.wait_state("web-proxy", "running");

    // More connections than the agent has descriptors: without a cap they would take every one.
    let idle: Vec<TcpStream> = (0..300).map(|_| TcpStream::connect(&addr).unwrap()).collect();
    wait_for("the agent to close connections over its cap", || {
        agent.logs().contains("connection cap reached").then_some(())
    });

    let started = Instant::now();
    assert_cmd::Command::from_std(tether())
        .args(["status", "--data-dir"])
        .arg(&dirs.data)
        .timeout(DEADLINE)
        .assert()
        .code(0)
        .stdout(predicates::str::contains("web-proxy"));
    let took = started.elapsed();
    assert!(took < Duration::from_secs(1), "`tether status` took {took:?} with {} idle connections", idle.len());

    let pid = first["pid"].as_i64().unwrap();
    kill(Pid::from_raw(pid as i32), Signal::SIGKILL).unwrap();
    let again = wait_until("web-proxy to run again with a new pid", || match agent.proxy("web-proxy") {
        Some(proxy) if proxy["state"] == "running" && proxy["pid"].as_i64() != Some(pid) => Ok(proxy),
        other => Err(format!("{other:?}")),
    });
    assert_eq!(again["error"], serde_json::Value::Null, "{again}");

    drop(idle);
    wait_until("the HTTP address to answer again", || {
        let raw = format!("GET /v1/agent/health HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
        match tcp_exchange(&addr, raw.as_bytes()) {
            Ok(response) if response.status == 200 => Ok(()),
            other => Err(format!("{other:?}")),
        }
    });
}

/// Sends `head` one byte a second, never finishing it, until the agent closes `stream`;
/// returns how long the agent kept it, or fails after [`CUT_DEADLINE`].
fn dribble<S: Read + Write>(mut stream: S, head: &[u8], set_timeout: impl Fn(&S, Duration)) -> Duration {
    set_timeout(&stream, Duration::from_secs(1));
    let started = Instant::now();
    let mut sent = 0;
    while started.elapsed() < CUT_DEADLINE {
        // The one-second read timeout paces the bytes.
        if sent < head.len() {
            if stream.write_all(&head[sent..=sent]).is_err() {
                return started.elapsed();
            }
            sent += 1;
        }
        let mut buffer = [0; 1024];
        match stream.read(&mut buffer) {
            Ok(0) => return started.elapsed(),
            Ok(_) => {} // hyper closes without answering, but an answer is no failure.
            Err(err) if matches!(err.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(_) => return started.elapsed(),
        }
    }
    panic!("the agent kept a connection sending {sent} bytes of a head for {:?}", started.elapsed());
}

#[test]
fn a_request_head_sent_slowly_is_cut_after_the_header_timeout_on_both_listeners() {
    let dirs = Dirs::new();
    let _sweep = SweepOnDrop(dirs.socket());
    let (_agent, addr) = agent_with_http(&dirs, None);
    let head = format!("GET /v1/agent/health HTTP/1.1\r\nHost: {addr}\r\nX-Padding: {}", "a".repeat(100));

    let tcp = std::thread::spawn({
        let stream = TcpStream::connect(&addr).unwrap();
        let head = head.clone();
        move || dribble(stream, head.as_bytes(), |s, t| s.set_read_timeout(Some(t)).unwrap())
    });
    let unix = dribble(UnixStream::connect(dirs.socket()).unwrap(), head.as_bytes(), |s, t| {
        s.set_read_timeout(Some(t)).unwrap();
    });
    let tcp = tcp.join().unwrap();
    for (listener, kept) in [("tcp", tcp), ("unix", unix)] {
        assert!(kept >= HEADER_TIMEOUT - Duration::from_secs(1), "{listener}: cut after {kept:?}");
    }
}

/// Sends one keep-alive request for `/v1/agent/health`, reads its answer, then waits for the
/// agent to close the idle connection; returns how long it stayed open after the answer.
fn idle_after_one_request<S: Read + Write>(mut stream: S, host: &str) -> Duration {
    write!(stream, "GET /v1/agent/health HTTP/1.1\r\nHost: {host}\r\n\r\n").unwrap();
    let mut answer = Vec::new();
    let mut buffer = [0; 1024];
    while !String::from_utf8_lossy(&answer).contains(r#"{"status":"ok"}"#) {
        let read = stream.read(&mut buffer).unwrap();
        assert!(read > 0, "closed before the answer: {}", String::from_utf8_lossy(&answer));
        answer.extend_from_slice(&buffer[..read]);
    }
    let answered = Instant::now();
    // The stream's read timeout is the deadline.
    match stream.read(&mut buffer) {
        Ok(0) => {}
        other => panic!("the idle connection was not closed: {other:?}"),
    }
    answered.elapsed()
}

#[test]
fn an_idle_connection_is_closed_but_a_blocking_query_that_waits_longer_is_answered() {
    let dirs = Dirs::new();
    let _sweep = SweepOnDrop(dirs.socket());
    let (agent, addr) = agent_with_http(&dirs, None);
    let pid = agent.wait_state("web-proxy", "running")["pid"].as_i64().unwrap();
    let token = environ_var(pid as i32, "TETHER_PROXY_TOKEN").expect("the proxy's token");
    let config = |query: &str| {
        let raw = format!(
            "GET /v1/agent/proxy/web-proxy/config{query} HTTP/1.1\r\nHost: {addr}\r\n\
             X-Tether-Proxy-Token: {token}\r\nConnection: close\r\n\r\n"
        );
        tcp_exchange(&addr, raw.as_bytes()).unwrap()
    };
    let index = config("").json()["index"].as_u64().unwrap();

    let wait = HEADER_TIMEOUT + Duration::from_secs(2);
    let tcp = TcpStream::connect(&addr).unwrap();
    tcp.set_read_timeout(Some(CUT_DEADLINE)).unwrap();
    let unix = UnixStream::connect(dirs.socket()).unwrap();
    unix.set_read_timeout(Some(CUT_DEADLINE)).unwrap();
    let ((answer, took), idle_tcp, idle_unix) = std::thread::scope(|scope| {
        let query = scope.spawn(|| {
            let started = Instant::now();
            (config(&format!("?index={index}&wait={}s", wait.as_secs())), started.elapsed())
        });
        let idle_tcp = scope.spawn(|| idle_after_one_request(tcp, &addr));
        let idle_unix = idle_after_one_request(unix, "tether");
        (query.join().unwrap(), idle_tcp.join().unwrap(), idle_unix)
    });
    for (listener, kept) in [("tcp", idle_tcp), ("unix", idle_unix)] {
        assert!(kept >= HEADER_TIMEOUT - Duration::from_secs(1), "{listener}: closed after {kept:?}");
    }
    assert_eq!(answer.status, 200, "{answer:?}");
    assert_eq!(answer.json()["index"].as_u64(), Some(index));
    assert!(took >= wait - Duration::from_millis(500), "the blocking query returned after {took:?}");
}

/// The `error` of a JSON error answer.
#[track_caller]
fn error_of(response: &Response, status: u16) -> String {
    assert_eq!(response.status, status, "{response:?}");
    assert!(response.headers.to_ascii_lowercase().contains("content-type: application/json"), "{}", response.headers);
    response.json()["error"].as_str().unwrap_or_else(|| panic!("no error in {}", response.body)).to_owned()
}

#[test]
fn every_error_answer_is_json_with_its_status_code() {
    let dirs = Dirs::new();
    let _sweep = SweepOnDrop(dirs.socket());
    let (_agent, addr) = agent_with_http(&dirs, None);
    let socket = dirs.socket();
    let unix = |raw: &str| unix_exchange(&socket, raw.as_bytes()).unwrap();
    let tcp = |raw: &str| tcp_exchange(&addr, raw.as_bytes()).unwrap();
    let request = |method: &str, path: &str| {
        format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Length: 0\r\n\r\n")
    };

    for response in [unix(&request("POST", "/v1/agent/proxies")), tcp(&request("DELETE", "/metrics"))] {
        let message = error_of(&response, 405);
        assert!(message.contains("is not allowed on"), "{message}");
        assert!(response.headers.to_ascii_lowercase().contains("allow: get,head"), "{}", response.headers);
    }
    for response in [unix(&request("GET", "/v1/agent/nothing")), tcp(&request("GET", "/nothing"))] {
        assert_eq!(error_of(&response, 404), "no such endpoint");
    }
    // The socket-only endpoints do not exist on the HTTP address.
    error_of(&tcp(&request("PUT", "/v1/agent/leave")), 404);

    // One byte over the 2 MiB limit: the agent reads the whole body before it refuses it, so
    // its close is not a reset that could lose the answer (as unread bytes would make it).
    let big = "x".repeat((2 << 20) + 1);
    let too_large = unix(&format!(
        "PUT /v1/agent/service/register HTTP/1.1\r\nHost: tether\r\nConnection: close\r\n\
         Content-Length: {}\r\n\r\n{big}",
        big.len()
    ));
    let message = error_of(&too_large, 413);
    assert!(message.contains("length limit exceeded"), "{message}");

    let bad_query = request("GET", "/v1/agent/proxy/web-proxy/config?index=soon");
    for response in [unix(&bad_query), tcp(&bad_query)] {
        let message = error_of(&response, 400);
        assert!(message.contains("query string"), "{message}");
    }
}

#[test]
fn the_http_address_answers_only_requests_that_name_the_loopback() {
    let dirs = Dirs::new();
    let _sweep = SweepOnDrop(dirs.socket());
    let (_agent, addr) = agent_with_http(&dirs, None);
    let port = addr.rsplit_once(':').unwrap().1;
    let get = |host: Option<&str>, target: &str| {
        let host = host.map(|host| format!("Host: {host}\r\n")).unwrap_or_default();
        let raw = format!("GET {target} HTTP/1.1\r\n{host}Connection: close\r\n\r\n");
        tcp_exchange(&addr, raw.as_bytes()).unwrap()
    };

    let with_port = format!("rebound.example:{port}");
    for host in ["rebound.example", with_port.as_str(), "10.0.0.1", "localhost.rebound.example"] {
        for target in ["/v1/agent/proxies", "/metrics", "/no/such/path"] {
            let message = error_of(&get(Some(host), target), 403);
            assert!(message.contains(&format!("host {host:?}")), "{message}");
        }
    }
    let absolute = get(Some(&addr), "http://rebound.example/v1/agent/proxies");
    assert!(error_of(&absolute, 403).contains("rebound.example"));
    assert_eq!(error_of(&get(None, "/v1/agent/proxies"), 400), "missing Host header");

    let local = [addr.clone(), format!("localhost:{port}"), "localhost".to_owned(), format!("[::1]:{port}")];
    for host in &local {
        let response = get(Some(host), "/v1/agent/proxies");
        assert_eq!(response.status, 200, "{host}: {response:?}");
        assert!(response.body.contains("\"web-proxy\""), "{host}: {}", response.body);
    }

    // The socket is for the agent's own user, not for browsers: it does not look at Host.
    let raw = "GET /v1/agent/proxies HTTP/1.1\r\nHost: rebound.example\r\nConnection: close\r\n\r\n";
    assert_eq!(unix_exchange(&dirs.socket(), raw.as_bytes()).unwrap().status, 200);
}

/// Asserts that `tether status` works and lists `id`.
fn status_lists(dirs: &Dirs, id: &str) {
    assert_cmd::Command::from_std(tether())
        .args(["status", "--data-dir"])
        .arg(&dirs.data)
        .timeout(DEADLINE)
        .assert()
        .code(0)
        .stdout(predicates::str::contains(id));
}

/// Opens a connection and asks for an answer that stays open, then reads only its head.
fn open_stream<S: Read + Write>(mut stream: S, host: &str, path: &str) -> (S, u16) {
    let head = format!("GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n");
    stream.write_all(head.as_bytes()).unwrap();
    let mut seen = Vec::new();
    let mut byte = [0_u8; 1];
    while !seen.ends_with(b"\r\n\r\n") {
        match stream.read(&mut byte) {
            Ok(1) => seen.push(byte[0]),
            _ => break,
        }
    }
    let status = String::from_utf8_lossy(&seen).split_whitespace().nth(1).and_then(|code| code.parse().ok());
    (stream, status.unwrap_or(0))
}

/// Raises this process's soft descriptor limit to its hard one, for tests that hold many
/// connections.
fn raise_own_descriptor_limit() -> u64 {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
    setrlimit(Resource::RLIMIT_NOFILE, hard, hard).unwrap();
    hard
}

#[test]
fn streams_held_by_the_thousand_leave_room_for_the_reads_that_answer_at_once() {
    if raise_own_descriptor_limit() < 4096 {
        eprintln!("skipped: this process may not open the 2 000 connections the test holds");
        return;
    }
    let dirs = Dirs::new();
    let _sweep = SweepOnDrop(dirs.socket());
    let (agent, addr) = agent_with_http(&dirs, None);
    let socket = dirs.socket();

    let mut held_tcp = Vec::new();
    let mut held_unix = Vec::new();
    let mut refused_tcp = 0;
    for _ in 0..1000 {
        // Over the cap, a connection is closed at once: no status line at all.
        match open_stream(TcpStream::connect(&addr).unwrap(), &addr, "/v1/agent/events") {
            (stream, 200) => held_tcp.push(stream),
            _ => refused_tcp += 1,
        }
        // The socket's slots follow the descriptor limit: thousands here, fewer elsewhere.
        let (stream, status) = open_stream(UnixStream::connect(&socket).unwrap(), "localhost", "/v1/agent/events");
        if status == 200 {
            held_unix.push(stream);
        }
    }
    assert!(!held_tcp.is_empty() && refused_tcp > 0, "held {}, refused {refused_tcp}", held_tcp.len());
    assert!(!held_unix.is_empty(), "held none on the socket");

    // Every listener still answers the reads that answer at once, and the CLI works.
    let health = wait_until("health on the TCP address", || {
        tcp_exchange(
            &addr,
            format!("GET /v1/agent/health HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .map_err(|err| err.to_string())
    });
    assert_eq!(health.status, 200, "{}", health.body);
    let health = get(&socket, "/v1/agent/health").unwrap();
    assert_eq!(health.status, 200, "{}", health.body);
    let metrics =
        tcp_exchange(&addr, format!("GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes())
            .unwrap();
    assert_eq!(metrics.status, 200);
    status_lists(&dirs, "web-proxy");
    // A stream over the listener's slots is refused with 503, and the refusal closes.
    let (mut over, status) = open_stream(TcpStream::connect(&addr).unwrap(), &addr, "/v1/agent/events");
    assert_eq!(status, 503);
    over.set_read_timeout(Some(DEADLINE)).unwrap();
    let mut rest = Vec::new();
    over.read_to_end(&mut rest).unwrap();
    drop((held_tcp, held_unix));
    drop(agent);
}

#[test]
fn under_a_low_descriptor_limit_streams_on_the_socket_leave_the_cli_working() {
    let dirs = Dirs::new();
    let _sweep = SweepOnDrop(dirs.socket());
    // 64 descriptors: the socket holds 16 connections, 12 of them streams.
    let (agent, _addr) = agent_with_http(&dirs, Some(64));
    let socket = dirs.socket();
    let held: Vec<_> = (0..16)
        .map(|_| open_stream(UnixStream::connect(&socket).unwrap(), "localhost", "/v1/agent/events"))
        .filter(|(_, status)| *status == 200)
        .collect();
    assert_eq!(held.len(), 12);
    status_lists(&dirs, "web-proxy");
    drop(held);
    drop(agent);
}

#[test]
fn a_stream_whose_client_reads_nothing_is_closed_and_frees_its_slot() {
    let dirs = Dirs::new();
    let _sweep = SweepOnDrop(dirs.socket());
    // A megabyte a second into the log: enough to fill what a follow buffers, soon.
    dirs.write_config(
        "loud.toml",
        "[[service]]\nname = \"loud\"\n[service.proxy]\n\
         command = [\"/bin/sh\", \"-c\", \"while :; do head -c 1048576 /dev/zero; sleep 1; done\"]\nkill_timeout = \"1s\"\n",
    );
    // 64 descriptors: the socket holds 12 streams.
    let (agent, _addr) = agent_with_http(&dirs, Some(64));
    agent.wait_state("loud-proxy", "running");
    let socket = dirs.socket();
    let follow = "/v1/agent/proxy/loud/logs?follow=true&lines=0";
    let silent: Vec<_> =
        (0..12).map(|_| open_stream(UnixStream::connect(&socket).unwrap(), "localhost", follow)).collect();
    assert!(silent.iter().all(|(_, status)| *status == 200));
    assert_eq!(open_stream(UnixStream::connect(&socket).unwrap(), "localhost", follow).1, 503);
    // The silent clients read nothing: once their buffers are full, each stream waits 30 s
    // for them, then ends, and its slot is free for a client that reads.
    let start = Instant::now();
    loop {
        let (_stream, status) = open_stream(UnixStream::connect(&socket).unwrap(), "localhost", follow);
        if status == 200 {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(120), "the silent streams still hold every slot");
        std::thread::sleep(Duration::from_millis(500));
    }
    drop(silent);
    drop(agent);
}
