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
