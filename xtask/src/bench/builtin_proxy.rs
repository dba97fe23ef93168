//! The built-in proxy (`tether connect-proxy`) against a direct connection to the same
//! upstream, in the same run: bulk throughput and request/response round trips.
//!
//! The upstreams are threads of this process on loopback: a sink that counts what it
//! reads and answers the count at EOF, and an echo server.
//!
//! A second baseline bounds what any user-space forwarder can reach on the machine: a
//! minimal one, in threads of this process, that copies each direction with blocking
//! reads and writes of 256 KiB; another splices each direction through a 1 MiB pipe with
//! blocking calls, the least work per byte that any forwarder splicing can do, so its rate
//! is the ceiling of the built-in proxy's here. A third forwards in the kernel
//! ([`super::redirect`], as root): no user space per byte, only the TCP work of the extra hop.
//! A fourth is what operators run: Debian's HAProxy in tcp mode
//! with `option splice-auto` (installed when missing, as root; a row says so when it is
//! still missing). Direct, minimal, in-kernel, HAProxy and built-in transfers alternate
//! round by round, so that a noisy neighbour slows all of them alike; the figures are medians.
//!
//! A third upstream accepts and never reads: how much a client gets queued before its
//! writes block shows what each path buffers, and that the in-kernel one does not stop.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use super::lab::Lab;
use super::redirect::{Redirect, kernel_forwarder};
use super::report::{Met, Row, median, met, percentile, ratio};
use super::sys;

/// Bytes per bulk transfer.
pub(super) const BULK: u64 = 1 << 30;
/// Rounds of bulk transfers (direct, minimal forwarder, built-in proxy each).
pub(super) const BULK_ROUNDS: usize = 5;
/// Round trips per latency run, after as many again of warm-up.
const ROUND_TRIPS: usize = 2_000;
const MESSAGE: usize = 64;

/// A loopback listener served by threads of this process until dropped.
pub(super) struct Upstream {
    pub(super) addr: SocketAddr,
    stop: Arc<AtomicBool>,
}

impl Upstream {
    /// Serves each connection with `serve` on a thread of its own.
    pub(super) fn start(serve: fn(TcpStream)) -> Result<Self, String> {
        Self::accepting(move |stream| {
            let _ = stream.set_nodelay(true);
            thread::spawn(move || serve(stream));
        })
    }

    /// Hands each accepted connection to `accept`, on the accepting thread.
    pub(super) fn accepting(mut accept: impl FnMut(TcpStream) + Send + 'static) -> Result<Self, String> {
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
                    accept(stream);
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

pub(super) fn sink(mut stream: TcpStream) {
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

pub(super) fn echo(mut stream: TcpStream) {
    let mut buffer = [0; 4096];
    while let Ok(read) = stream.read(&mut buffer) {
        if read == 0 || stream.write_all(&buffer[..read]).is_err() {
            return;
        }
    }
}

/// The minimal forwarder: accepts on loopback and copies both directions to `upstream`
/// with a blocking thread each, one connection at a time. `cpu` counts the connections
/// it has finished and the CPU time their threads took.
fn minimal_forwarder(upstream: SocketAddr, cpu: Arc<Mutex<(usize, Duration)>>) -> Result<Upstream, String> {
    Upstream::accepting(move |client| {
        let Ok(server) = TcpStream::connect(upstream) else { return };
        let _ = client.set_nodelay(true);
        let _ = server.set_nodelay(true);
        let (Ok(client_reader), Ok(server_writer)) = (client.try_clone(), server.try_clone()) else { return };
        let up = thread::spawn(move || pump(client_reader, server_writer));
        let down = thread::spawn(move || pump(server, client));
        let took = up.join().unwrap_or_default() + down.join().unwrap_or_default();
        let mut cpu = lock(&cpu);
        cpu.0 += 1;
        cpu.1 += took;
    })
}

/// The minimal splice forwarder: as [`minimal_forwarder`], but each direction moves pages
/// from one socket into a 1 MiB pipe and from the pipe into the other socket with blocking
/// `splice(2)`, as the built-in proxy does. No forwarder that splices can do less work per
/// byte, so its rate is the ceiling of the built-in proxy's on this machine.
fn splice_forwarder(upstream: SocketAddr) -> Result<Upstream, String> {
    Upstream::accepting(move |client| {
        let Ok(server) = TcpStream::connect(upstream) else { return };
        let _ = client.set_nodelay(true);
        let _ = server.set_nodelay(true);
        let (Ok(client_reader), Ok(server_writer)) = (client.try_clone(), server.try_clone()) else { return };
        thread::spawn(move || splice_pump(&client_reader, &server_writer));
        thread::spawn(move || splice_pump(&server, &client));
    })
}

/// Splices `from` to `to` through a pipe until EOF, then passes the EOF on.
fn splice_pump(from: &TcpStream, to: &TcpStream) {
    use nix::fcntl::{FcntlArg, OFlag, SpliceFFlags, fcntl, splice};
    let Ok((read_end, write_end)) = nix::unistd::pipe2(OFlag::O_CLOEXEC) else { return };
    let capacity = fcntl(&write_end, FcntlArg::F_SETPIPE_SZ(1 << 20))
        .ok()
        .and_then(|size| usize::try_from(size).ok())
        .unwrap_or(1 << 16);
    let flags = SpliceFFlags::SPLICE_F_MOVE;
    'transfer: loop {
        let mut in_pipe = match splice(from, None, &write_end, None, capacity, flags) {
            Ok(0) | Err(_) => break,
            Ok(read) => read,
        };
        while in_pipe > 0 {
            match splice(&read_end, None, to, None, in_pipe, flags) {
                Ok(0) | Err(_) => break 'transfer,
                Ok(written) => in_pipe -= written,
            }
        }
    }
    let _ = to.shutdown(Shutdown::Write);
}

/// Copies `from` to `to` until EOF, then passes the EOF on; the thread's CPU time.
fn pump(mut from: TcpStream, mut to: TcpStream) -> Duration {
    let mut buffer = vec![0; 256 * 1024];
    while let Ok(read) = from.read(&mut buffer) {
        if read == 0 || to.write_all(&buffer[..read]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Write);
    sys::thread_cpu_time()
}

/// HAProxy in tcp mode with `option splice-auto`, in front of `upstream`, in a process group
/// of its own that is killed when dropped.
struct Haproxy {
    child: Child,
    addr: SocketAddr,
}

impl Haproxy {
    /// Starts HAProxy if it is installed (or can be, as root): `Ok(None)` when it is not.
    fn start(lab: &Lab, upstream: SocketAddr) -> Result<Option<Self>, String> {
        let Some(program) = haproxy_program() else { return Ok(None) };
        let port = free_port()?;
        let dir = lab.subdir("p-haproxy")?;
        let config = dir.join("haproxy.cfg");
        let text = format!(
            "global\n    maxconn 100\n\ndefaults\n    mode tcp\n    option splice-auto\n    \
             timeout connect 5s\n    timeout client 60s\n    timeout server 60s\n\n\
             listen bench\n    bind 127.0.0.1:{port}\n    server sink {upstream}\n"
        );
        std::fs::write(&config, text).map_err(|err| format!("{}: {err}", config.display()))?;
        let log = std::fs::File::create(dir.join("haproxy.log")).map_err(|err| err.to_string())?;
        let child = Command::new(&program)
            .arg("-db")
            .arg("-f")
            .arg(&config)
            .stdin(Stdio::null())
            .stdout(log.try_clone().map_err(|err| err.to_string())?)
            .stderr(log)
            .process_group(0)
            .spawn()
            .map_err(|err| format!("cannot start {program}: {err}"))?;
        let haproxy = Self { child, addr: SocketAddr::from(([127, 0, 0, 1], port)) };
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(haproxy.addr).is_err() {
            if Instant::now() > deadline {
                return Err(format!("HAProxy does not listen on {} (see {})", haproxy.addr, dir.display()));
            }
            thread::sleep(Duration::from_millis(5));
        }
        Ok(Some(haproxy))
    }
}

impl Drop for Haproxy {
    fn drop(&mut self) {
        sys::signal_group(self.child.id(), sys::SIGKILL);
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Debian's `haproxy`, installed first when missing and this process is root.
fn haproxy_program() -> Option<String> {
    let find = || ["/usr/sbin/haproxy", "/usr/bin/haproxy"].into_iter().find(|path| Path::new(path).exists());
    if find().is_none() && sys::is_root() {
        eprintln!("xtask: bench: installing haproxy");
        let install = || {
            Command::new("apt-get")
                .args(["install", "-y", "--no-install-recommends", "haproxy"])
                .env("DEBIAN_FRONTEND", "noninteractive")
                .stdout(Stdio::null())
                .status()
                .is_ok_and(|status| status.success())
        };
        if !install() {
            let _ = Command::new("apt-get").arg("update").stdout(Stdio::null()).status();
            install();
        }
    }
    find().map(str::to_owned)
}

/// The row of the built-in proxy's median round trip against `forwarder`'s, both beside
/// direct's.
fn round_trip_against(forwarder: &str, its: Duration, direct: Duration, proxied: Duration) -> Row {
    Row::new(
        &format!("built-in proxy: 64-byte round trip against the {forwarder}, median (4 000)"),
        format!("{forwarder}: {} (+{} over direct)", us(its), us(its.saturating_sub(direct))),
        us(proxied),
        ratio(proxied.as_secs_f64(), its.as_secs_f64()),
        "—",
        Met::Info,
    )
}

/// A row for a figure against the in-kernel forwarder when it could not be loaded.
fn kernel_unmeasured(figure: &str, reason: &str) -> Row {
    Row::new(figure, "—".into(), format!("not measured: {reason}"), "—".into(), "—", Met::Info)
}

pub(super) fn free_port() -> Result<u16, String> {
    let listener = TcpListener::bind("127.0.0.1:0").map_err(|err| format!("bind: {err}"))?;
    listener.local_addr().map(|addr| addr.port()).map_err(|err| err.to_string())
}

/// Sends `bytes` to `addr` and waits for the sink's count: the transfer's duration.
pub(super) fn bulk(addr: SocketAddr, bytes: u64) -> Result<Duration, String> {
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

/// Where [`queued_unread`] stops writing if the writes have not blocked yet.
const UNREAD_CAP: u64 = 1 << 30;

/// How many bytes a client writes to `addr` before its writes make no progress for a
/// second, up to [`UNREAD_CAP`], while the upstream behind it holds its connections in
/// `held` unread: what the path in between queues for it. The client then resets, and the
/// held connections close.
fn queued_unread(addr: SocketAddr, held: &Mutex<Vec<TcpStream>>) -> Result<u64, String> {
    let fail = |err: std::io::Error| format!("writing to an upstream that does not read, through {addr}: {err}");
    let mut stream = TcpStream::connect(addr).map_err(fail)?;
    stream.set_write_timeout(Some(Duration::from_secs(1))).map_err(fail)?;
    let chunk = vec![0x5a_u8; 256 * 1024];
    let mut queued = 0;
    while queued < UNREAD_CAP {
        match stream.write(&chunk) {
            Ok(written) => queued += written as u64,
            Err(err) if matches!(err.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => break,
            Err(err) => return Err(fail(err)),
        }
    }
    // A reset, not an orderly close: whatever is queued is dropped at once.
    nix::sys::socket::setsockopt(
        &stream,
        nix::sys::socket::sockopt::Linger,
        &nix::libc::linger { l_onoff: 1, l_linger: 0 },
    )
    .map_err(|err| fail(err.into()))?;
    drop(stream);
    lock(held).clear();
    Ok(queued)
}

/// The value behind `mutex`, even if a thread panicked holding it.
fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
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

pub(super) fn gib_per_second(took: Duration) -> f64 {
    #[allow(clippy::cast_precision_loss)]
    let gib = BULK as f64 / f64::from(1_u32 << 30);
    gib / took.as_secs_f64()
}

/// The median of `values`; zero for none.
pub(super) fn median_f64(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    sorted.get(sorted.len() / 2).copied().unwrap_or(0.0)
}

pub(super) fn us(duration: Duration) -> String {
    format!("{:.1} µs", duration.as_secs_f64() * 1e6)
}

/// Runs the built-in proxy figures, appending rows.
pub(crate) fn run(lab: &Lab, rows: &mut Vec<Row>) -> Result<(), String> {
    let sink_upstream = Upstream::start(sink)?;
    let echo_upstream = Upstream::start(echo)?;
    let held = Arc::new(Mutex::new(Vec::new()));
    let holding = Arc::clone(&held);
    let hold_upstream = Upstream::accepting(move |stream| lock(&holding).push(stream))?;
    let (sink_port, echo_port, hold_port) = (free_port()?, free_port()?, free_port()?);
    let config = lab.subdir("p-config")?;
    let text = [
        ("sink", sink_upstream.addr, sink_port),
        ("echo", echo_upstream.addr, echo_port),
        ("hold", hold_upstream.addr, hold_port),
    ]
    .map(|(name, upstream, port)| {
        format!(
            "[[service]]\nname = \"{name}\"\nport = {}\n\n[service.proxy]\nconfig = {{ bind_port = {port} }}\n\n",
            upstream.port()
        )
    })
    .concat();
    std::fs::write(config.join("proxies.toml"), text).map_err(|err| err.to_string())?;
    let mut agent = lab.agent("p", &config, &lab.dir.join("p-data"), &[])?;
    agent.wait_running(3, Duration::from_secs(60))?;
    let through_sink = SocketAddr::from(([127, 0, 0, 1], sink_port));
    let through_echo = SocketAddr::from(([127, 0, 0, 1], echo_port));
    let deadline = Instant::now() + Duration::from_secs(30);
    while TcpStream::connect(through_sink).is_err() || TcpStream::connect(through_echo).is_err() {
        if Instant::now() > deadline {
            return Err(agent.error("the built-in proxies do not listen"));
        }
        thread::sleep(Duration::from_millis(5));
    }

    let minimal_cpu = Arc::new(Mutex::new((0, Duration::ZERO)));
    let minimal = minimal_forwarder(sink_upstream.addr, Arc::clone(&minimal_cpu))?;
    let spliced = splice_forwarder(sink_upstream.addr)?;
    let haproxy = Haproxy::start(lab, sink_upstream.addr)?;
    let redirect = Redirect::load().map(Arc::new);
    let kernel = redirect.as_ref().ok().map(|redirect| kernel_forwarder(redirect, sink_upstream.addr)).transpose()?;
    let proxy_pid = agent.proxy("sink-proxy")?.pid.ok_or_else(|| agent.error("sink-proxy has no pid"))?;
    // Warm-up: connection set-up, page cache of the binaries, TCP autotuning.
    for addr in [sink_upstream.addr, minimal.addr, spliced.addr, through_sink]
        .into_iter()
        .chain(haproxy.as_ref().map(|h| h.addr))
        .chain(kernel.as_ref().map(|k| k.addr))
    {
        bulk(addr, BULK / 16)?;
    }
    let (mut direct, mut reference, mut proxied, mut of_haproxy) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let (mut of_direct, mut of_reference, mut haproxied) = (Vec::new(), Vec::new(), Vec::new());
    let (mut ceiling, mut of_ceiling) = (Vec::new(), Vec::new());
    let (mut kernel_of_direct, mut of_kernel) = (Vec::new(), Vec::new());
    let (mut reference_cpu, mut proxied_cpu) = (Vec::new(), Vec::new());
    for _ in 0..BULK_ROUNDS {
        let direct_rate = gib_per_second(bulk(sink_upstream.addr, BULK)?);
        let before = *lock(&minimal_cpu);
        let reference_rate = gib_per_second(bulk(minimal.addr, BULK)?);
        let deadline = Instant::now() + Duration::from_secs(10);
        let after = loop {
            let now = *lock(&minimal_cpu);
            if now.0 > before.0 {
                break now;
            }
            if Instant::now() > deadline {
                return Err("the minimal forwarder did not finish its connection".to_owned());
            }
            thread::sleep(Duration::from_millis(1));
        };
        reference_cpu.push(after.1 - before.1);
        let ceiling_rate = gib_per_second(bulk(spliced.addr, BULK)?);
        let haproxy_rate = match &haproxy {
            Some(haproxy) => Some(gib_per_second(bulk(haproxy.addr, BULK)?)),
            None => None,
        };
        let kernel_rate = kernel.as_ref().map(|kernel| bulk(kernel.addr, BULK).map(gib_per_second)).transpose()?;
        let before = sys::cpu_time(proxy_pid)?;
        let proxied_rate = gib_per_second(bulk(through_sink, BULK)?);
        proxied_cpu.push(sys::cpu_time(proxy_pid)? - before);
        direct.push(direct_rate);
        reference.push(reference_rate);
        proxied.push(proxied_rate);
        of_direct.push(proxied_rate / direct_rate);
        of_reference.push(proxied_rate / reference_rate);
        ceiling.push(ceiling_rate / direct_rate);
        of_ceiling.push(proxied_rate / ceiling_rate);
        if let Some(kernel_rate) = kernel_rate {
            kernel_of_direct.push(kernel_rate / direct_rate);
            of_kernel.push(proxied_rate / kernel_rate);
        }
        if let Some(haproxy_rate) = haproxy_rate {
            haproxied.push(haproxy_rate);
            of_haproxy.push(proxied_rate / haproxy_rate);
        }
    }
    drop(minimal);
    drop(spliced);
    drop(kernel);
    let (direct_rate, reference_rate, proxied_rate) =
        (median_f64(&direct), median_f64(&reference), median_f64(&proxied));
    let (of_direct, of_reference) = (median_f64(&of_direct), median_f64(&of_reference));
    rows.push(Row::new(
        &format!("built-in proxy: bulk throughput, 1 GiB over loopback, median of {BULK_ROUNDS} alternating rounds"),
        format!("direct: {direct_rate:.2} GiB/s"),
        format!("{proxied_rate:.2} GiB/s"),
        format!("{of_direct:.2}"),
        "≥ 0.9",
        met(of_direct >= 0.9),
    ));
    rows.push(Row::new(
        "built-in proxy: bulk throughput against a minimal blocking splice forwarder (the ceiling of splicing here)",
        format!("minimal splice forwarder: {:.2} of direct", median_f64(&ceiling)),
        format!("{proxied_rate:.2} GiB/s"),
        format!("{:.2}", median_f64(&of_ceiling)),
        "—",
        Met::Info,
    ));
    rows.push(match &redirect {
        Ok(_) => Row::new(
            "built-in proxy: bulk throughput against an in-kernel forwarder (sockmap redirect: no user space per byte)",
            format!("in-kernel forwarder: {:.2} of direct", median_f64(&kernel_of_direct)),
            format!("{proxied_rate:.2} GiB/s"),
            format!("{:.2}", median_f64(&of_kernel)),
            "—",
            Met::Info,
        ),
        Err(reason) => kernel_unmeasured("built-in proxy: bulk throughput against an in-kernel forwarder", reason),
    });
    if haproxy.is_some() {
        let (haproxy_rate, of_haproxy) = (median_f64(&haproxied), median_f64(&of_haproxy));
        rows.push(Row::new(
            "built-in proxy: bulk throughput against HAProxy, tcp mode, `option splice-auto`",
            format!("HAProxy: {haproxy_rate:.2} GiB/s ({:.2} of direct)", haproxy_rate / direct_rate),
            format!("{proxied_rate:.2} GiB/s"),
            format!("{of_haproxy:.2}"),
            "≥ 2",
            met(of_haproxy >= 2.0),
        ));
    } else {
        rows.push(Row::failed("built-in proxy: bulk throughput against HAProxy", "haproxy is not installed"));
    }
    rows.push(Row::new(
        "built-in proxy: bulk throughput against a minimal blocking user-space forwarder",
        format!("minimal forwarder: {reference_rate:.2} GiB/s ({:.2} of direct)", reference_rate / direct_rate),
        format!("{proxied_rate:.2} GiB/s"),
        format!("{of_reference:.2}"),
        "—",
        Met::Info,
    ));
    let (reference_cpu, proxied_cpu) = (median(&reference_cpu), median(&proxied_cpu));
    rows.push(Row::new(
        "built-in proxy: CPU time (user + system) per GiB forwarded, median",
        format!("minimal forwarder: {:.0} ms", reference_cpu.as_secs_f64() * 1e3),
        format!("{:.0} ms", proxied_cpu.as_secs_f64() * 1e3),
        ratio(proxied_cpu.as_secs_f64(), reference_cpu.as_secs_f64()),
        "—",
        Met::Info,
    ));
    drop(haproxy);

    // What a client gets queued on its way to an upstream that does not read.
    let through_hold = SocketAddr::from(([127, 0, 0, 1], hold_port));
    let direct = queued_unread(hold_upstream.addr, &held)?;
    let proxied = queued_unread(through_hold, &held)?;
    let mib = |bytes: u64| format!("{:.1} MiB", bytes as f64 / f64::from(1_u32 << 20));
    rows.push(Row::new(
        "built-in proxy: a client's bytes queued before its writes block, the upstream not reading",
        format!("direct: {}", mib(direct)),
        mib(proxied),
        ratio(proxied as f64, direct as f64),
        "—",
        Met::Info,
    ));
    let unread_kernel =
        "in-kernel forwarder: a client's bytes queued before its writes block, the upstream not reading";
    rows.push(match &redirect {
        Ok(redirect) => {
            let kernel = kernel_forwarder(redirect, hold_upstream.addr)?;
            let queued = queued_unread(kernel.addr, &held)?;
            let shown = if queued >= UNREAD_CAP { format!("≥ {} (stopped there)", mib(queued)) } else { mib(queued) };
            Row::new(
                unread_kernel,
                format!("direct: {}", mib(direct)),
                shown,
                ratio(queued as f64, direct as f64),
                "—",
                Met::Info,
            )
        }
        Err(reason) => kernel_unmeasured(unread_kernel, reason),
    });
    drop(hold_upstream);

    let echo_spliced = splice_forwarder(echo_upstream.addr)?;
    let echo_kernel =
        redirect.as_ref().ok().map(|redirect| kernel_forwarder(redirect, echo_upstream.addr)).transpose()?;
    let (mut direct, mut proxied, mut minimal, mut in_kernel) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..2 {
        direct.extend(round_trips(echo_upstream.addr, ROUND_TRIPS)?);
        minimal.extend(round_trips(echo_spliced.addr, ROUND_TRIPS)?);
        if let Some(kernel) = &echo_kernel {
            in_kernel.extend(round_trips(kernel.addr, ROUND_TRIPS)?);
        }
        proxied.extend(round_trips(through_echo, ROUND_TRIPS)?);
    }
    drop(echo_spliced);
    drop(echo_kernel);
    let (direct_median, proxied_median) = (median(&direct), median(&proxied));
    rows.push(Row::new(
        "built-in proxy: 64-byte round trip, median (4 000)",
        format!("direct: {}", us(direct_median)),
        format!("{} (+{})", us(proxied_median), us(proxied_median.saturating_sub(direct_median))),
        ratio(proxied_median.as_secs_f64(), direct_median.as_secs_f64()),
        "≤ direct + 10 µs",
        met(proxied_median <= direct_median + Duration::from_micros(10)),
    ));
    rows.push(round_trip_against("minimal splice forwarder", median(&minimal), direct_median, proxied_median));
    rows.push(match &redirect {
        Ok(_) => round_trip_against("in-kernel forwarder", median(&in_kernel), direct_median, proxied_median),
        Err(reason) => kernel_unmeasured("built-in proxy: 64-byte round trip against the in-kernel forwarder", reason),
    });
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
