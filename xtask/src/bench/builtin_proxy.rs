//! The built-in proxy (`tether connect-proxy`) against a direct connection to the same
//! upstream, in the same run: bulk throughput and request/response round trips.
//!
//! The upstreams are threads of this process on loopback: a sink that counts what it
//! reads and answers the count at EOF, and an echo server.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use super::lab::Lab;
use super::report::{Met, Row, median, met, percentile, ratio};

/// Bytes per bulk transfer.
const BULK: u64 = 1 << 30;
/// Round trips per latency run, after as many again of warm-up.
const ROUND_TRIPS: usize = 2_000;
const MESSAGE: usize = 64;

/// An upstream served by threads of this process until dropped.
struct Upstream {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
}

impl Upstream {
    fn start(serve: fn(TcpStream)) -> Result<Self, String> {
        let listener = TcpListener::bind("127.0.0.1:0").map_err(|err| format!("bind: {err}"))?;
        let addr = listener.local_addr().map_err(|err| err.to_string())?;
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = Arc::clone(&stop);
        thread::spawn(move || {
            for stream in listener.incoming() {
                if stopping.load(Ordering::SeqCst) {
                    break;
                }
                if let Ok(stream) = stream {
                    let _ = stream.set_nodelay(true);
                    thread::spawn(move || serve(stream));
                }
            }
        });
        Ok(Self { addr, stop })
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the accept loop so that it sees the flag.
        let _ = TcpStream::connect(self.addr);
    }
}

fn sink(mut stream: TcpStream) {
    let mut buffer = vec![0; 256 * 1024];
    let mut total: u64 = 0;
    loop {
        match stream.read(&mut buffer) {
            Ok(0) => break,
            Ok(read) => total += read as u64,
            Err(_) => return,
        }
    }
    let _ = stream.write_all(&total.to_le_bytes());
}

fn echo(mut stream: TcpStream) {
    let mut buffer = [0; 4096];
    while let Ok(read) = stream.read(&mut buffer) {
        if read == 0 || stream.write_all(&buffer[..read]).is_err() {
            return;
        }
    }
}

fn free_port() -> Result<u16, String> {
    let listener = TcpListener::bind("127.0.0.1:0").map_err(|err| format!("bind: {err}"))?;
    listener.local_addr().map(|addr| addr.port()).map_err(|err| err.to_string())
}

/// Sends `bytes` to `addr` and waits for the sink's count: the transfer's duration.
fn bulk(addr: SocketAddr, bytes: u64) -> Result<Duration, String> {
    let fail = |err: std::io::Error| format!("bulk transfer to {addr}: {err}");
    let start = Instant::now();
    let mut stream = TcpStream::connect(addr).map_err(fail)?;
    let chunk = vec![0x5a_u8; 256 * 1024];
    let mut sent = 0;
    while sent < bytes {
        let size = chunk.len().min(usize::try_from(bytes - sent).unwrap_or(usize::MAX));
        stream.write_all(&chunk[..size]).map_err(fail)?;
        sent += size as u64;
    }
    stream.shutdown(Shutdown::Write).map_err(fail)?;
    let mut count = [0; 8];
    stream.read_exact(&mut count).map_err(fail)?;
    let took = start.elapsed();
    if u64::from_le_bytes(count) != bytes {
        return Err(format!("bulk transfer to {addr}: the sink got {} of {bytes} bytes", u64::from_le_bytes(count)));
    }
    Ok(took)
}

/// Round trips of one small message through `addr`, after a warm-up of as many.
fn round_trips(addr: SocketAddr, count: usize) -> Result<Vec<Duration>, String> {
    let fail = |err: std::io::Error| format!("round trips through {addr}: {err}");
    let mut stream = TcpStream::connect(addr).map_err(fail)?;
    stream.set_nodelay(true).map_err(fail)?;
    let message = [0x5a_u8; MESSAGE];
    let mut answer = [0_u8; MESSAGE];
    let mut samples = Vec::with_capacity(count);
    for index in 0..count * 2 {
        let start = Instant::now();
        stream.write_all(&message).map_err(fail)?;
        stream.read_exact(&mut answer).map_err(fail)?;
        if index >= count {
            samples.push(start.elapsed());
        }
    }
    Ok(samples)
}

fn gib_per_second(took: Duration) -> f64 {
    #[allow(clippy::cast_precision_loss)]
    let gib = BULK as f64 / f64::from(1_u32 << 30);
    gib / took.as_secs_f64()
}

fn us(duration: Duration) -> String {
    format!("{:.1} µs", duration.as_secs_f64() * 1e6)
}

/// Runs the built-in proxy figures, appending rows.
pub(crate) fn run(lab: &Lab, rows: &mut Vec<Row>) -> Result<(), String> {
    let sink_upstream = Upstream::start(sink)?;
    let echo_upstream = Upstream::start(echo)?;
    let (sink_port, echo_port) = (free_port()?, free_port()?);
    let config = lab.subdir("p-config")?;
    let text = format!(
        "[[service]]\nname = \"sink\"\nport = {}\n\n[service.proxy]\nconfig = {{ bind_port = {sink_port} }}\n\n\
         [[service]]\nname = \"echo\"\nport = {}\n\n[service.proxy]\nconfig = {{ bind_port = {echo_port} }}\n",
        sink_upstream.addr.port(),
        echo_upstream.addr.port()
    );
    std::fs::write(config.join("proxies.toml"), text).map_err(|err| err.to_string())?;
    let mut agent = lab.agent("p", &config, &lab.dir.join("p-data"), &[])?;
    agent.wait_running(2, Duration::from_secs(60))?;
    let through_sink = SocketAddr::from(([127, 0, 0, 1], sink_port));
    let through_echo = SocketAddr::from(([127, 0, 0, 1], echo_port));
    let deadline = Instant::now() + Duration::from_secs(30);
    while TcpStream::connect(through_sink).is_err() || TcpStream::connect(through_echo).is_err() {
        if Instant::now() > deadline {
            return Err(agent.error("the built-in proxies do not listen"));
        }
        thread::sleep(Duration::from_millis(5));
    }

    bulk(sink_upstream.addr, BULK / 16)?;
    bulk(through_sink, BULK / 16)?;
    let (mut direct, mut proxied) = (Duration::MAX, Duration::MAX);
    for _ in 0..2 {
        direct = direct.min(bulk(sink_upstream.addr, BULK)?);
        proxied = proxied.min(bulk(through_sink, BULK)?);
    }
    let (direct_rate, proxied_rate) = (gib_per_second(direct), gib_per_second(proxied));
    rows.push(Row::new(
        "built-in proxy: bulk throughput, 1 GiB over loopback (best of 2)",
        format!("direct: {direct_rate:.2} GiB/s"),
        format!("{proxied_rate:.2} GiB/s"),
        ratio(proxied_rate, direct_rate),
        "≥ 0.8",
        met(proxied_rate >= 0.8 * direct_rate),
    ));

    let (mut direct, mut proxied) = (Vec::new(), Vec::new());
    for _ in 0..2 {
        direct.extend(round_trips(echo_upstream.addr, ROUND_TRIPS)?);
        proxied.extend(round_trips(through_echo, ROUND_TRIPS)?);
    }
    let (direct_median, proxied_median) = (median(&direct), median(&proxied));
    rows.push(Row::new(
        "built-in proxy: 64-byte round trip, median (4 000)",
        format!("direct: {}", us(direct_median)),
        format!("{} (+{})", us(proxied_median), us(proxied_median.saturating_sub(direct_median))),
        ratio(proxied_median.as_secs_f64(), direct_median.as_secs_f64()),
        "—",
        Met::Info,
    ));
    let (direct_p99, proxied_p99) = (percentile(&direct, 99.0), percentile(&proxied, 99.0));
    rows.push(Row::new(
        "built-in proxy: 64-byte round trip, p99",
        format!("direct: {}", us(direct_p99)),
        us(proxied_p99),
        ratio(proxied_p99.as_secs_f64(), direct_p99.as_secs_f64()),
        "—",
        Met::Info,
    ));
    agent.leave(Duration::from_secs(30))
}
