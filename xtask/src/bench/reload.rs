//! Reloads in place with Debian's HAProxy (`-Ws`, `reload.signal = "SIGUSR2"`, `check =
//! haproxy -c`): how long `PUT /v1/agent/proxy/{id}/reload` takes to answer `applied`,
//! median and p99 of 50, beside HAProxy's own reload time (its `RELOADING=1` to `READY=1`,
//! read on a notification socket of this process, HAProxy run without tether) in the same
//! run; and the connections refused across 100 reloads, a client connecting every
//! millisecond.

use std::fs;
use std::net::{TcpListener, TcpStream};
use std::os::unix::net::UnixDatagram;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use super::lab::{Lab, request};
use super::report::{Met, Row, met, ms, ratio};
use super::sys;

/// Timed reloads.
const TIMED: usize = 50;
/// Reloads the client connects across.
const RELOADS: usize = 100;

/// Runs the section, appending its rows.
pub(crate) fn run(lab: &Lab, rows: &mut Vec<Row>) -> Result<(), String> {
    let Some(haproxy) = ["/usr/sbin/haproxy", "/usr/bin/haproxy"].into_iter().find(|p| Path::new(p).exists()) else {
        rows.push(Row::failed("reload in place (HAProxy)", "haproxy is not installed"));
        return Ok(());
    };
    let own = haproxy_alone(lab, haproxy)?;
    let (answers, refused, tried) = through_tether(lab, haproxy)?;
    let row = Row::new(
        "`tether reload` of HAProxy (-Ws, SIGUSR2, haproxy -c) until `applied`, median / p99 of 50",
        format!("HAProxy's own reload, RELOADING=1 to READY=1: {} / {}", ms(median(&own)), ms(p99(&own))),
        format!("{} / {}", ms(median(&answers)), ms(p99(&answers))),
        ratio(median(&answers).as_secs_f64(), median(&own).as_secs_f64()),
        "—",
        Met::Info,
    );
    eprintln!("xtask: bench: {}: {} (baseline {})", row.figure, row.value, row.baseline);
    rows.push(row);
    let row = Row::new(
        "connections refused across 100 reloads of HAProxy (a client connects every ms)",
        "—".to_owned(),
        format!("{refused} refused of {tried}"),
        "—".to_owned(),
        "0",
        met(refused == 0),
    );
    eprintln!("xtask: bench: {}: {}", row.figure, row.value);
    rows.push(row);
    Ok(())
}

fn sorted(durations: &[Duration]) -> Vec<Duration> {
    let mut sorted = durations.to_vec();
    sorted.sort_unstable();
    sorted
}

fn median(durations: &[Duration]) -> Duration {
    let sorted = sorted(durations);
    sorted.get(sorted.len() / 2).copied().unwrap_or_default()
}

fn p99(durations: &[Duration]) -> Duration {
    let sorted = sorted(durations);
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_precision_loss)]
    let at = ((sorted.len() as f64 - 1.0) * 0.99).round() as usize;
    sorted.get(at).copied().unwrap_or_default()
}

fn free_port() -> Result<u16, String> {
    let probe = TcpListener::bind("127.0.0.1:0").map_err(|err| err.to_string())?;
    Ok(probe.local_addr().map_err(|err| err.to_string())?.port())
}

fn write_haproxy_config(path: &Path, port: u16) -> Result<(), String> {
    let text = format!(
        "global\n    maxconn 1000\ndefaults\n    mode tcp\n    timeout connect 1s\n    timeout client 5s\n    \
         timeout server 5s\nfrontend front\n    bind 127.0.0.1:{port}\n    default_backend none\nbackend none\n"
    );
    fs::write(path, text).map_err(|err| format!("{}: {err}", path.display()))
}

/// An HAProxy run by this process, its group killed when dropped.
struct Haproxy(Child);

impl Drop for Haproxy {
    fn drop(&mut self) {
        sys::signal_group(self.0.id(), sys::Signal::SIGKILL);
        let _ = self.0.wait();
    }
}

/// HAProxy's own reload time: RELOADING=1 to READY=1 on SIGUSR2, `TIMED` times.
fn haproxy_alone(lab: &Lab, haproxy: &str) -> Result<Vec<Duration>, String> {
    let dir = lab.subdir("reload-alone")?;
    let config = dir.join("haproxy.cfg");
    write_haproxy_config(&config, free_port()?)?;
    let socket_path = dir.join("notify.sock");
    let socket = UnixDatagram::bind(&socket_path).map_err(|err| format!("{}: {err}", socket_path.display()))?;
    socket.set_read_timeout(Some(Duration::from_secs(10))).map_err(|err| err.to_string())?;
    let child = Command::new(haproxy)
        .args(["-Ws", "-f"])
        .arg(&config)
        .env("NOTIFY_SOCKET", &socket_path)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()
        .map_err(|err| format!("cannot start {haproxy}: {err}"))?;
    let haproxy = Haproxy(child);
    let mut buffer = [0u8; 4096];
    let mut next = |want: &str| -> Result<Instant, String> {
        loop {
            let read = socket.recv(&mut buffer).map_err(|err| format!("no {want} from HAProxy: {err}"))?;
            if String::from_utf8_lossy(&buffer[..read]).lines().any(|line| line == want) {
                return Ok(Instant::now());
            }
        }
    };
    next("READY=1")?;
    let mut took = Vec::with_capacity(TIMED);
    for _ in 0..TIMED {
        sys::signal(haproxy.0.id(), sys::Signal::SIGUSR2)?;
        let reloading = next("RELOADING=1")?;
        took.push(next("READY=1")?.duration_since(reloading));
    }
    Ok(took)
}

/// The same HAProxy under tether: `RELOADS` reloads through the API with a client on its
/// frontend; the times to `applied` of the first `TIMED`, and the connections refused.
fn through_tether(lab: &Lab, haproxy: &str) -> Result<(Vec<Duration>, u64, u64), String> {
    let config_dir = lab.subdir("reload-config")?;
    let data = lab.dir.join("reload-data");
    let haproxy_config = lab.subdir("reload-haproxy")?.join("haproxy.cfg");
    let port = free_port()?;
    write_haproxy_config(&haproxy_config, port)?;
    let cfg = haproxy_config.display();
    let service = format!(
        "[[service]]\nname = \"edge\"\n[service.proxy]\ncommand = [\"{haproxy}\", \"-Ws\", \"-f\", \"{cfg}\"]\n\
         kill_signal = \"SIGUSR1\"\n[service.proxy.readiness]\nnotify = true\n\
         [service.proxy.reload]\nsignal = \"SIGUSR2\"\ncheck = [\"{haproxy}\", \"-c\", \"-f\", \"{cfg}\"]\n"
    );
    let path = config_dir.join("edge.toml");
    fs::write(&path, service).map_err(|err| format!("{}: {err}", path.display()))?;
    let mut agent = lab.agent("reload", &config_dir, &data, &[])?;
    agent.wait_running(1, Duration::from_secs(30))?;
    let stop = Arc::new(AtomicBool::new(false));
    let counts = Arc::new((AtomicU64::new(0), AtomicU64::new(0)));
    let client = {
        let (stop, counts) = (Arc::clone(&stop), Arc::clone(&counts));
        thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                counts.0.fetch_add(1, Ordering::Relaxed);
                if TcpStream::connect(("127.0.0.1", port)).is_err() {
                    counts.1.fetch_add(1, Ordering::Relaxed);
                }
                thread::sleep(Duration::from_millis(1));
            }
        })
    };
    let mut took = Vec::with_capacity(TIMED);
    let mut failure = None;
    for n in 0..RELOADS {
        let start = Instant::now();
        let answer = request(&agent.socket, "PUT", "/v1/agent/proxy/edge-proxy/reload", &[], None);
        let elapsed = start.elapsed();
        let verdict = answer.and_then(|response| {
            let body: serde_json::Value = serde_json::from_slice(&response.body).map_err(|err| err.to_string())?;
            if response.status == 200 && body["result"] == "applied" { Ok(()) } else { Err(body.to_string()) }
        });
        if let Err(error) = verdict {
            failure = Some(agent.error(&format!("reload {n} was not applied: {error}")));
            break;
        }
        if n < TIMED {
            took.push(elapsed);
        }
    }
    stop.store(true, Ordering::Relaxed);
    let _ = client.join();
    agent.leave(Duration::from_secs(30))?;
    if let Some(failure) = failure {
        return Err(failure);
    }
    Ok((took, counts.1.load(Ordering::Relaxed), counts.0.load(Ordering::Relaxed)))
}
