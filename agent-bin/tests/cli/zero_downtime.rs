//! Zero-downtime: the agent holds the listeners, so that no connection is refused while a
//! proxy is updated (`update = "overlap"`), killed, or its agent restarted or killed; and,
//! for contrast, today's behaviour without listeners, which refuses connections.
//!
//! A client connects every millisecond and makes one request per connection through the
//! built-in proxy to an upstream of the test.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::support::*;

fn root_flags() -> Vec<&'static str> {
    if is_root() { vec!["--allow-root"] } else { vec![] }
}

/// An upstream that answers one line per connection with `ok: <line>`, and closes.
pub(crate) fn upstream() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let address = listener.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { return };
            std::thread::spawn(move || {
                let mut line = Vec::new();
                let mut byte = [0u8; 1];
                while stream.read_exact(&mut byte).is_ok() && byte[0] != b'\n' {
                    line.push(byte[0]);
                }
                let _ = stream.write_all(&[b"ok: ", &line[..], b"\n"].concat());
            });
        }
    });
    address
}

/// What the client saw.
#[derive(Default)]
struct Counts {
    requests: AtomicU64,
    refused: AtomicU64,
    failed: AtomicU64,
}

/// A client that connects to `address` every millisecond, one request per connection,
/// until dropped.
pub(crate) struct Load {
    counts: Arc<Counts>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Load {
    pub(crate) fn start(address: &str) -> Self {
        Self::holding(address, Duration::ZERO)
    }

    /// [`Load::start`], with each connection held open for `hold` before its request is
    /// sent: a slow client, whose connections an instance told to stop has to finish.
    pub(crate) fn holding(address: &str, hold: Duration) -> Self {
        let counts = Arc::new(Counts::default());
        let stop = Arc::new(AtomicBool::new(false));
        let (address, seen, stopped) = (address.to_owned(), counts.clone(), stop.clone());
        let thread = std::thread::spawn(move || {
            let mut n = 0u64;
            while !stopped.load(Ordering::Relaxed) {
                n += 1;
                seen.requests.fetch_add(1, Ordering::Relaxed);
                match request(&address, n, hold) {
                    Ok(()) => {}
                    Err(error) if error.kind() == std::io::ErrorKind::ConnectionRefused => {
                        seen.refused.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(error) => {
                        // Told as it happens, so that a failed run shows when.
                        eprintln!("request {n} to {address} failed: {error}");
                        seen.failed.fetch_add(1, Ordering::Relaxed);
                    }
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        });
        Self { counts, stop, thread: Some(thread) }
    }

    /// (requests, refused, failed) so far.
    pub(crate) fn counts(&self) -> (u64, u64, u64) {
        let c = &self.counts;
        (c.requests.load(Ordering::Relaxed), c.refused.load(Ordering::Relaxed), c.failed.load(Ordering::Relaxed))
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn request(address: &str, n: u64, hold: Duration) -> std::io::Result<()> {
    let mut stream = TcpStream::connect(address)?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    if !hold.is_zero() {
        // The client's pace, not a synchronisation: the connection is in flight meanwhile.
        std::thread::sleep(hold);
    }
    stream.write_all(format!("request {n}\n").as_bytes())?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer)?;
    if answer == format!("ok: request {n}\n") {
        Ok(())
    } else {
        Err(std::io::Error::other(format!("answer {answer:?}")))
    }
}

/// The service: the built-in proxy to `upstream`, on a listener at `listen` (or binding
/// `listen` itself, without one), with `update`; `generation` is a variable of its
/// environment, whose change restarts it.
pub(crate) fn config(listen: &str, upstream: &str, update: &str, listener: bool, generation: u32) -> String {
    let port = listen.rsplit_once(':').unwrap().1;
    let (bind, listener) = if listener {
        (String::new(), format!("[[service.proxy.listener]]\nname = \"public\"\naddress = \"{listen}\"\n"))
    } else {
        (format!(", bind_port = {port}"), String::new())
    };
    format!(
        "[[service]]\nname = \"web\"\n\
         [service.proxy]\nupdate = \"{update}\"\nupdate_timeout = \"10s\"\nkill_timeout = \"5s\"\n\
         env = {{ GENERATION = \"{generation}\" }}\nconfig = {{ local_service_address = \"{upstream}\"{bind} }}\n\
         [service.proxy.restart]\nfree_attempts = 1000\n\
         [service.proxy.readiness]\nnotify = true\n{listener}"
    )
}

/// Waits until `web-proxy` runs, ready, with another pid than `old` and no update in
/// flight; returns its pid.
fn replaced(agent: &Agent, old: i64) -> i64 {
    wait_for("web-proxy to run again, replaced", || {
        let proxy = agent.proxy("web-proxy")?;
        let pid = proxy["pid"].as_i64()?;
        (proxy["state"] == "running" && pid != old && proxy["update"].is_null()).then_some(pid)
    })
}

fn reload(dirs: &Dirs) {
    let output = tether().arg("reload").arg("--data-dir").arg(&dirs.data).output().unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
}

/// Applies `changes` restart-requiring changes, from generation `from`, each once the
/// previous one is done; returns the pid that runs after them.
fn change(agent: &Agent, dirs: &Dirs, make: impl Fn(u32) -> String, from: u32, changes: u32, mut pid: i64) -> i64 {
    for generation in from..from + changes {
        dirs.write_config("web.toml", &make(generation));
        reload(dirs);
        pid = replaced(agent, pid);
    }
    pid
}

#[test]
fn overlapping_updates_crashes_and_agent_restarts_refuse_no_connection() {
    let dirs = Dirs::new();
    let _sweep = SweepOnDrop(dirs.socket());
    let (listen, upstream) = (free_loopback_addr(), upstream());
    let make = |generation| config(&listen, &upstream, "overlap", true, generation);
    dirs.write_config("web.toml", &make(0));
    let mut agent = Agent::start(&dirs, &root_flags());
    let mut pid = agent.wait_state("web-proxy", "running")["pid"].as_i64().unwrap();
    let load = Load::start(&listen);

    pid = change(&agent, &dirs, make, 1, 20, pid);
    let (requests, refused, failed) = load.counts();
    assert!(requests > 20, "the client made {requests} requests");
    assert_eq!((refused, failed), (0, 0), "20 overlapping updates, {requests} requests");

    for _ in 0..20 {
        kill(Pid::from_raw(pid as i32), Signal::SIGKILL).unwrap();
        pid = replaced(&agent, pid);
    }
    let (requests, refused, failed) = load.counts();
    assert_eq!(refused, 0, "20 SIGKILLs of the proxy, {requests} requests ({failed} in flight in a killed one)");

    // An agent restart, then an agent SIGKILL, each between two changes: the next agent
    // takes the listener back from the instance it adopts.
    agent.signal(Signal::SIGTERM);
    assert!(agent.wait().success());
    let mut agent = Agent::start(&dirs, &root_flags());
    assert_eq!(agent.wait_state("web-proxy", "running")["pid"].as_i64(), Some(pid), "adopted");
    pid = change(&agent, &dirs, make, 21, 2, pid);
    agent.signal(Signal::SIGKILL);
    agent.wait();
    let agent = Agent::start(&dirs, &root_flags());
    assert_eq!(agent.wait_state("web-proxy", "running")["pid"].as_i64(), Some(pid), "adopted");
    change(&agent, &dirs, make, 23, 2, pid);
    let (requests, refused, after_crashes) = load.counts();
    assert_eq!(
        (refused, after_crashes),
        (0, failed),
        "an agent restart and an agent SIGKILL between changes, {requests} requests"
    );
}

#[test]
fn without_listeners_a_restart_refuses_connections_and_with_them_it_does_not() {
    // Today's behaviour, for contrast: the proxy binds its port itself, and between the
    // old instance's stop and the new one's bind the port refuses connections.
    let dirs = Dirs::new();
    let _sweep = SweepOnDrop(dirs.socket());
    let (listen, upstream) = (free_loopback_addr(), upstream());
    let plain = |generation| config(&listen, &upstream, "restart", false, generation);
    dirs.write_config("web.toml", &plain(0));
    let agent = Agent::start(&dirs, &root_flags());
    let pid = agent.wait_state("web-proxy", "running")["pid"].as_i64().unwrap();
    let load = Load::start(&listen);
    let pid = change(&agent, &dirs, plain, 1, 20, pid);
    let (requests, refused, _) = load.counts();
    assert!(refused > 0, "20 restarts without listeners refused none of {requests} connections");
    drop(load);

    // The same restarts with the agent holding the listener: connections wait, none is
    // refused, none fails.
    let held = |generation| config(&listen, &upstream, "restart", true, generation);
    dirs.write_config("web.toml", &held(100));
    reload(&dirs);
    let pid = replaced(&agent, pid);
    let load = Load::start(&listen);
    change(&agent, &dirs, held, 101, 20, pid);
    let (requests, refused, failed) = load.counts();
    assert_eq!((refused, failed), (0, 0), "20 restarts (stop, then start) with a listener, {requests} requests");
}

#[test]
fn an_overlap_whose_new_instance_never_gets_ready_leaves_the_old_one_serving() {
    let dirs = Dirs::new();
    let _sweep = SweepOnDrop(dirs.socket());
    let (listen, upstream) = (free_loopback_addr(), upstream());
    dirs.write_config("web.toml", &config(&listen, &upstream, "overlap", true, 0));
    let agent = Agent::start(&dirs, &root_flags());
    let pid = agent.wait_state("web-proxy", "running")["pid"].as_i64().unwrap();
    let load = Load::start(&listen);
    // The new instance runs a program that never says it is ready.
    let never_ready = config(&listen, &upstream, "overlap", true, 1)
        .replace("update_timeout = \"10s\"", "update_timeout = \"1s\"")
        .replace("[service.proxy]\n", "[service.proxy]\ncommand = [\"/bin/sleep\", \"3600\"]\n");
    dirs.write_config("web.toml", &never_ready);
    reload(&dirs);
    let overlapping =
        wait_for("the new instance beside the old", || agent.proxy("web-proxy").filter(|p| !p["update"].is_null()));
    assert_eq!(overlapping["pid"].as_i64(), Some(pid), "the old instance serves: {overlapping}");
    assert_eq!(overlapping["state"], "running");
    assert_eq!(overlapping["update"]["state"], "starting");
    let abandoned = wait_for("the update to be abandoned", || {
        agent.proxy("web-proxy").filter(|p| p["error"].as_str().is_some_and(|e| e.contains("update_timeout")))
    });
    assert_eq!(abandoned["pid"].as_i64(), Some(pid), "{abandoned}");
    assert_eq!(abandoned["state"], "running");
    assert!(abandoned["update"].is_null());
    let error = abandoned["error"].as_str().unwrap();
    assert!(error.contains("old instance serves on") && error.contains("(1s)"), "{error}");
    assert_eq!(processes_by_proxy_id(&dirs.socket()).get("web-proxy").map(Vec::len), Some(1), "the new one is stopped");
    let (requests, refused, failed) = load.counts();
    assert_eq!((refused, failed), (0, 0), "{requests} requests");
    let table = tether().arg("status").arg("--data-dir").arg(&dirs.data).output().unwrap();
    assert!(String::from_utf8_lossy(&table.stdout).contains("update_timeout"));
}

#[test]
fn haproxy_on_a_handed_listener_refuses_no_connection_across_command_changes() {
    let Some(haproxy) = haproxy() else {
        eprintln!("skipped: haproxy is not installed (CI installs Debian's haproxy)");
        return;
    };
    let dirs = Dirs::new();
    let _sweep = SweepOnDrop(dirs.socket());
    let (listen, upstream) = (free_loopback_addr(), upstream());
    let haproxy_config = dirs.temp.path().join("haproxy.cfg");
    // `bind fd@3`: HAProxy serves the listener the agent hands over; nothing in it knows
    // about tether.
    std::fs::write(
        &haproxy_config,
        format!(
            "global\n    maxconn 1000\ndefaults\n    mode tcp\n    timeout connect 1s\n    timeout client 10s\n    timeout server 10s\n\
             frontend front\n    bind fd@3\n    default_backend up\nbackend up\n    server up {upstream}\n"
        ),
    )
    .unwrap();
    // -Ws: master-worker mode, ready through NOTIFY_SOCKET; SIGUSR1 is its soft stop (stop
    // accepting, finish what is in flight). Each change is a new command line (`-L`, its
    // local peer name).
    let make = |generation: u32| {
        format!(
            "[[service]]\nname = \"web\"\n[service.proxy]\n\
             command = [\"{haproxy}\", \"-Ws\", \"-L\", \"g{generation}\", \"-f\", \"{}\"]\n\
             update = \"overlap\"\nkill_signal = \"SIGUSR1\"\nkill_timeout = \"10s\"\n\
             [service.proxy.readiness]\nnotify = true\n\
             [[service.proxy.listener]]\nname = \"public\"\naddress = \"{listen}\"\n",
            haproxy_config.display()
        )
    };
    dirs.write_config("web.toml", &make(0));
    let agent = Agent::start(&dirs, &root_flags());
    let pid = agent.wait_state("web-proxy", "running")["pid"].as_i64().unwrap();
    let load = Load::start(&listen);
    change(&agent, &dirs, make, 1, 20, pid);
    let (requests, refused, failed) = load.counts();
    assert!(requests > 20, "the client made {requests} requests");
    assert_eq!((refused, failed), (0, 0), "20 command changes of HAProxy, {requests} requests");
}

#[test]
fn a_listener_closes_when_its_address_changes_and_when_its_proxy_goes() {
    let dirs = Dirs::new();
    let _sweep = SweepOnDrop(dirs.socket());
    let (first, second, upstream) = (free_loopback_addr(), free_loopback_addr(), upstream());
    dirs.write_config("web.toml", &config(&first, &upstream, "overlap", true, 0));
    let agent = Agent::start(&dirs, &root_flags());
    let pid = agent.wait_state("web-proxy", "running")["pid"].as_i64().unwrap();
    request(&first, 1, Duration::ZERO).expect("served on the first address");

    dirs.write_config("web.toml", &config(&second, &upstream, "overlap", true, 0));
    reload(&dirs);
    replaced(&agent, pid);
    request(&second, 2, Duration::ZERO).expect("served on the new address");
    let refused = TcpStream::connect(&first).map(drop).unwrap_err();
    assert_eq!(refused.kind(), std::io::ErrorKind::ConnectionRefused, "the old address is closed");

    std::fs::remove_file(dirs.config.join("web.toml")).unwrap();
    reload(&dirs);
    agent.wait_gone("web-proxy");
    let refused = TcpStream::connect(&second).map(drop).unwrap_err();
    assert_eq!(refused.kind(), std::io::ErrorKind::ConnectionRefused, "a deregistered proxy's listener is closed");
}

#[test]
fn a_listener_whose_address_is_taken_fails_the_proxy_with_the_address() {
    let dirs = Dirs::new();
    let _sweep = SweepOnDrop(dirs.socket());
    let taken = TcpListener::bind("127.0.0.1:0").unwrap();
    let address = taken.local_addr().unwrap().to_string();
    dirs.write_config("web.toml", &config(&address, &upstream(), "restart", true, 0));
    let agent = Agent::start(&dirs, &root_flags());
    let failed = agent.wait_state("web-proxy", "failed");
    let error = failed["error"].as_str().unwrap();
    assert!(error.contains(&format!("cannot listen on {address}: the address is in use")), "{error}");
}

#[test]
fn the_built_in_proxy_serves_a_unix_listener() {
    let dirs = Dirs::new();
    let _sweep = SweepOnDrop(dirs.socket());
    let path = dirs.temp.path().join("web.sock");
    let text = format!(
        "[[service]]\nname = \"web\"\n[service.proxy]\nconfig = {{ local_service_address = \"{}\" }}\n\
         [service.proxy.readiness]\nnotify = true\n\
         [[service.proxy.listener]]\nname = \"public\"\naddress = \"{}\"\n",
        upstream(),
        path.display()
    );
    dirs.write_config("web.toml", &text);
    let agent = Agent::start(&dirs, &root_flags());
    agent.wait_state("web-proxy", "running");
    let mut stream = std::os::unix::net::UnixStream::connect(&path).unwrap();
    stream.write_all(b"over unix\n").unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).unwrap();
    assert_eq!(answer, "ok: over unix\n");
}
