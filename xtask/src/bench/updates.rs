//! Zero-downtime updates: the connections refused while a proxy is updated 100 times, with
//! today's `update = "restart"` and no listener (the proxy binds its port itself) against
//! `update = "overlap"` on a listener the agent holds, in the same run; and the latency a
//! connection sees during the overlapping updates against the same client at rest.
//!
//! The proxy is the built-in one, forwarding to an upstream of this process; a client
//! connects every millisecond and makes one request per connection.

use std::fs;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use super::lab::{Agent, Lab};
use super::report::{Met, Row, met};

/// Updates per strategy.
const UPDATES: u32 = 100;
/// How long the client runs at rest, for the latency baseline.
const REST: Duration = Duration::from_secs(3);
/// The longest one update may take.
const UPDATE_LIMIT: Duration = Duration::from_secs(30);

/// Runs the section, appending its rows.
pub(crate) fn run(lab: &Lab, rows: &mut Vec<Row>) -> Result<(), String> {
    let upstream = upstream()?;
    let restart = updates(lab, "u-restart", &upstream, false)?;
    let overlap = updates(lab, "u-overlap", &upstream, true)?;
    let row = Row::new(
        "connections refused during 100 updates of a proxy (a client connects every ms)",
        format!(
            "update = \"restart\", no listener: {} refused of {} ({} failed)",
            restart.during.refused, restart.during.requests, restart.during.failed
        ),
        format!(
            "update = \"overlap\", listener held by the agent: {} refused of {} ({} failed)",
            overlap.during.refused, overlap.during.requests, overlap.during.failed
        ),
        "—".to_owned(),
        "0",
        met(overlap.during.refused == 0 && overlap.during.failed == 0),
    );
    eprintln!("xtask: bench: {}: {} (baseline {})", row.figure, row.value, row.baseline);
    rows.push(row);
    let (rest_p50, rest_p99) = (overlap.rest.percentile(0.50), overlap.rest.percentile(0.99));
    let (during_p50, during_p99) = (overlap.during.percentile(0.50), overlap.during.percentile(0.99));
    let row = Row::new(
        "latency of a connection (connect to answer) during overlapping updates, p50 / p99",
        format!("the same client at rest: {} / {}", ms(rest_p50), ms(rest_p99)),
        format!(
            "{} / {} (extra: {} / {}; {:.0} ms per update)",
            ms(during_p50),
            ms(during_p99),
            ms(during_p50.saturating_sub(rest_p50)),
            ms(during_p99.saturating_sub(rest_p99)),
            overlap.per_update.as_secs_f64() * 1000.0
        ),
        super::report::ratio(during_p99.as_secs_f64(), rest_p99.as_secs_f64()),
        "—",
        Met::Info,
    );
    eprintln!("xtask: bench: {}: {} (baseline {})", row.figure, row.value, row.baseline);
    rows.push(row);
    Ok(())
}

fn ms(duration: Duration) -> String {
    format!("{:.2} ms", duration.as_secs_f64() * 1000.0)
}

/// What the client saw in one phase.
#[derive(Default)]
struct Seen {
    requests: u64,
    refused: u64,
    failed: u64,
    latencies: Vec<Duration>,
}

impl Seen {
    fn percentile(&self, share: f64) -> Duration {
        let mut sorted = self.latencies.clone();
        sorted.sort_unstable();
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_precision_loss)]
        let at = ((sorted.len() as f64 - 1.0) * share).round() as usize;
        sorted.get(at).copied().unwrap_or_default()
    }
}

struct Outcome {
    rest: Seen,
    during: Seen,
    per_update: Duration,
}

/// An upstream on loopback that answers one line per connection, on a thread per
/// connection; returns its address.
fn upstream() -> Result<String, String> {
    let listener = TcpListener::bind("127.0.0.1:0").map_err(|err| format!("upstream: {err}"))?;
    let address = listener.local_addr().map_err(|err| err.to_string())?.to_string();
    thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { return };
            thread::spawn(move || {
                let mut line = Vec::new();
                let mut byte = [0u8; 1];
                while stream.read_exact(&mut byte).is_ok() && byte[0] != b'\n' {
                    line.push(byte[0]);
                }
                let _ = stream.write_all(&[b"ok: ", &line[..], b"\n"].concat());
            });
        }
    });
    Ok(address)
}

/// A client connecting to `address` every millisecond until stopped, recording into the
/// phase `seen` points at.
struct Client {
    phase: Arc<Mutex<Seen>>,
    stop: Arc<AtomicBool>,
    thread: Option<thread::JoinHandle<()>>,
}

impl Client {
    fn start(address: &str) -> Self {
        let phase = Arc::new(Mutex::new(Seen::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let (address, seen, stopped) = (address.to_owned(), phase.clone(), stop.clone());
        let thread = thread::spawn(move || {
            let mut n = 0u64;
            let mut next = Instant::now();
            while !stopped.load(Ordering::Relaxed) {
                n += 1;
                let start = Instant::now();
                let outcome = exchange(&address, n);
                let took = start.elapsed();
                let mut seen = seen.lock().unwrap_or_else(|e| e.into_inner());
                seen.requests += 1;
                match outcome {
                    Ok(()) => seen.latencies.push(took),
                    Err(error) if error.kind() == std::io::ErrorKind::ConnectionRefused => seen.refused += 1,
                    Err(_) => seen.failed += 1,
                }
                drop(seen);
                next += Duration::from_millis(1);
                match next.checked_duration_since(Instant::now()) {
                    Some(wait) => thread::sleep(wait),
                    None => next = Instant::now(),
                }
            }
        });
        Self { phase, stop, thread: Some(thread) }
    }

    /// What was seen since the last call.
    fn take(&self) -> Seen {
        std::mem::take(&mut *self.phase.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn exchange(address: &str, n: u64) -> std::io::Result<()> {
    let mut stream = TcpStream::connect(address)?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    stream.write_all(format!("request {n}\n").as_bytes())?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer)?;
    if answer == format!("ok: request {n}\n") { Ok(()) } else { Err(std::io::Error::other("short answer")) }
}

/// 100 updates of one proxy, with `update = "overlap"` on a held listener, or today's
/// `update = "restart"` binding its own port.
fn updates(lab: &Lab, name: &str, upstream: &str, overlap: bool) -> Result<Outcome, String> {
    let listen = {
        let probe = TcpListener::bind("127.0.0.1:0").map_err(|err| err.to_string())?;
        probe.local_addr().map_err(|err| err.to_string())?.to_string()
    };
    let config = lab.subdir(&format!("{name}-config"))?;
    let data = lab.dir.join(format!("{name}-data"));
    write_config(&config, &listen, upstream, overlap, 0)?;
    let mut agent = lab.agent(name, &config, &data, &[])?;
    let (rows, _) = agent.wait_running(1, Duration::from_secs(30))?;
    let mut pid = rows[0].pid;
    let client = Client::start(&listen);
    thread::sleep(REST);
    let rest = client.take();
    let start = Instant::now();
    for generation in 1..=UPDATES {
        write_config(&config, &listen, upstream, overlap, generation)?;
        reload(lab, &data)?;
        pid = replaced(&agent, pid)?;
    }
    let per_update = start.elapsed() / UPDATES;
    let during = client.take();
    drop(client);
    agent.leave(Duration::from_secs(30))?;
    Ok(Outcome { rest, during, per_update })
}

fn write_config(dir: &Path, listen: &str, upstream: &str, overlap: bool, generation: u32) -> Result<(), String> {
    let port = listen.rsplit_once(':').map_or("", |(_, port)| port);
    let (update, bind, listener) = if overlap {
        ("overlap", String::new(), format!("[[service.proxy.listener]]\nname = \"public\"\naddress = \"{listen}\"\n"))
    } else {
        ("restart", format!(", bind_port = {port}"), String::new())
    };
    let text = format!(
        "[[service]]\nname = \"web\"\n[service.proxy]\nupdate = \"{update}\"\n\
         env = {{ GENERATION = \"{generation}\" }}\nconfig = {{ local_service_address = \"{upstream}\"{bind} }}\n\
         [service.proxy.readiness]\nnotify = true\n{listener}"
    );
    let path = dir.join("web.toml");
    let temp = dir.join(".web.toml.partial");
    fs::write(&temp, text).map_err(|err| format!("{}: {err}", temp.display()))?;
    fs::rename(&temp, &path).map_err(|err| format!("{}: {err}", path.display()))
}

fn reload(lab: &Lab, data: &Path) -> Result<(), String> {
    let status = Command::new(&lab.tether)
        .arg("reload")
        .arg("--data-dir")
        .arg(data)
        .stdout(Stdio::null())
        .status()
        .map_err(|err| format!("tether reload: {err}"))?;
    if status.success() { Ok(()) } else { Err(format!("tether reload: {status}")) }
}

/// Waits until the proxy runs, ready, with another pid than `old` and no update in flight.
fn replaced(agent: &Agent<'_>, old: Option<u32>) -> Result<Option<u32>, String> {
    let deadline = Instant::now() + UPDATE_LIMIT;
    loop {
        if let Ok(row) = agent.proxy("web-proxy")
            && row.state == "running"
            && row.pid.is_some()
            && row.pid != old
            && !row.updating
        {
            return Ok(row.pid);
        }
        if Instant::now() > deadline {
            return Err(agent.error(&format!("web-proxy not replaced within {UPDATE_LIMIT:?}")));
        }
        thread::sleep(Duration::from_millis(2));
    }
}
