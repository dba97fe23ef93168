//! A stand-in proxy for the integration tests and the benchmark, in the spirit of
//! Consul's helper process.
//!
//! It owns nothing but its own behaviour, chosen by flags applied in order; it never
//! talks to the agent and never runs a shell. Flags:
//!
//! - `--ignore-sigint`: ignore SIGINT (inherited by workers forked afterwards).
//! - `--die-with-parent`: ask for SIGTERM when the parent dies (`PR_SET_PDEATHSIG`), as
//!   Envoy does for itself.
//! - `--fork-worker FILE`: fork a worker that sleeps forever, and write its pid to FILE
//!   (atomically, so a reader never sees half a number).
//! - `--print TEXT`: print TEXT and a newline to stdout.
//! - `--eprint TEXT`: print TEXT and a newline to stderr.
//! - `--print-env`: print the environment, one `KEY=VALUE` per line, to stdout.
//! - `--print-cwd`: print the working directory to stdout.
//! - `--write-bytes N`: write N bytes of output (lines of `x`) to stdout.
//! - `--exit N`: exit with code N.
//! - `--delay MS`: sleep MS milliseconds.
//! - `--notify TEXT`: send TEXT as one datagram to `NOTIFY_SOCKET` (sd_notify).
//! - `--watchdog MS COUNT`: send `WATCHDOG=1` every MS milliseconds, COUNT times, from a
//!   thread, while the flags after it go on.
//! - `--write-fd N TEXT`: write TEXT to descriptor N (s6's notification-fd).
//! - `--serve-http ADDR`: listen on the TCP address ADDR and answer every request with
//!   `200 OK`, from a thread, while the flags after it go on.
//! - `--block SIG`: block the signal SIG (`HUP`, `USR1`, …), so that it waits for `--await`
//!   instead of ending the program.
//! - `--await SIG`: wait until the (blocked) signal SIG arrives, as a proxy that reloads on it.
//! - `--sleep` (also the default at the end): sleep until killed.

#![deny(unsafe_code)]
#![allow(clippy::print_stdout, clippy::print_stderr)] // printing is this program's whole purpose

use std::io::Write;
use std::time::Duration;

fn main() {
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let mut value = || args.next().unwrap_or_else(|| fail(&format!("{flag} needs a value")));
        match flag.as_str() {
            "--ignore-sigint" => ignore_sigint(),
            "--die-with-parent" => nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGTERM)
                .unwrap_or_else(|error| fail(&format!("prctl: {error}"))),
            "--fork-worker" => fork_worker(&value()),
            "--print" => println!("{}", value()),
            "--eprint" => eprintln!("{}", value()),
            "--print-env" => {
                for (key, val) in std::env::vars_os() {
                    println!("{}={}", key.to_string_lossy(), val.to_string_lossy());
                }
            }
            "--print-cwd" => println!("{}", std::env::current_dir().unwrap_or_default().display()),
            "--write-bytes" => write_bytes(value().parse().unwrap_or_else(|_| fail("bad byte count"))),
            "--write-rate" => {
                let spec = value();
                let (rate, seconds) = spec.split_once(':').unwrap_or_else(|| fail("expected BYTES_PER_SECOND:SECONDS"));
                let rate = rate.parse().unwrap_or_else(|_| fail("bad rate"));
                let seconds = seconds.parse().unwrap_or_else(|_| fail("bad duration"));
                write_at_rate(rate, seconds);
            }
            "--exit" => {
                let _ = std::io::stdout().flush();
                std::process::exit(value().parse().unwrap_or_else(|_| fail("bad exit code")));
            }
            "--delay" => {
                std::thread::sleep(Duration::from_millis(value().parse().unwrap_or_else(|_| fail("bad delay"))));
            }
            "--serve-http" => serve_http(&value()),
            "--notify" => notify(&value()),
            "--write-fd" => {
                let fd = value();
                let text = value().replace("\\n", "\n");
                // Opened again through /proc, which needs no unsafe code for a raw descriptor.
                let mut file = std::fs::OpenOptions::new()
                    .write(true)
                    .open(format!("/proc/self/fd/{fd}"))
                    .unwrap_or_else(|e| fail(&format!("descriptor {fd}: {e}")));
                file.write_all(text.as_bytes()).unwrap_or_else(|e| fail(&format!("write to {fd}: {e}")));
            }
            "--watchdog" => {
                let every = Duration::from_millis(value().parse().unwrap_or_else(|_| fail("bad watchdog interval")));
                let count: u32 = value().parse().unwrap_or_else(|_| fail("bad watchdog count"));
                std::thread::spawn(move || {
                    for _ in 0..count {
                        notify("WATCHDOG=1");
                        std::thread::sleep(every);
                    }
                });
            }
            "--block" => {
                let set = signal_set(&value());
                set.thread_block().unwrap_or_else(|e| fail(&format!("cannot block: {e}")));
            }
            "--await" => {
                let set = signal_set(&value());
                set.wait().unwrap_or_else(|e| fail(&format!("cannot wait for a signal: {e}")));
            }
            "--sleep" => sleep_forever(),
            other => fail(&format!("unknown flag {other}")),
        }
    }
    sleep_forever();
}

/// The set of the one signal named `name` (`HUP` or `SIGHUP`).
fn signal_set(name: &str) -> nix::sys::signal::SigSet {
    let full = if name.starts_with("SIG") { name.to_owned() } else { format!("SIG{name}") };
    let signal: nix::sys::signal::Signal = full.parse().unwrap_or_else(|_| fail(&format!("unknown signal {name}")));
    let mut set = nix::sys::signal::SigSet::empty();
    set.add(signal);
    set
}

fn fail(message: &str) -> ! {
    eprintln!("tether-test-proxy: {message}");
    std::process::exit(100);
}

fn sleep_forever() -> ! {
    let _ = std::io::stdout().flush();
    loop {
        std::thread::sleep(Duration::from_secs(3600));
    }
}

fn notify(text: &str) {
    use std::os::linux::net::SocketAddrExt;
    use std::os::unix::net::{SocketAddr, UnixDatagram};
    let target = std::env::var("NOTIFY_SOCKET").unwrap_or_else(|_| fail("no NOTIFY_SOCKET"));
    let address = match target.strip_prefix('@') {
        Some(name) => SocketAddr::from_abstract_name(name.as_bytes()),
        None => SocketAddr::from_pathname(&target),
    }
    .unwrap_or_else(|e| fail(&format!("bad NOTIFY_SOCKET {target}: {e}")));
    let socket = UnixDatagram::unbound().unwrap_or_else(|e| fail(&format!("socket: {e}")));
    socket.send_to_addr(text.as_bytes(), &address).unwrap_or_else(|e| fail(&format!("notify {target}: {e}")));
}

fn serve_http(address: &str) {
    use std::io::Read;
    let listener =
        std::net::TcpListener::bind(address).unwrap_or_else(|e| fail(&format!("cannot listen on {address}: {e}")));
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let mut request = [0_u8; 1024];
            let _ = stream.read(&mut request);
            let _ = stream.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nConnection: close\r\n\r\nok\n");
        }
    });
}

fn ignore_sigint() {
    use nix::sys::signal::{SigHandler, Signal, signal};
    #[allow(unsafe_code)]
    // SAFETY: SIG_IGN installs no handler code, so no async-signal-safety rule applies.
    let result = unsafe { signal(Signal::SIGINT, SigHandler::SigIgn) };
    if let Err(error) = result {
        fail(&format!("cannot ignore SIGINT: {error}"));
    }
}

fn fork_worker(pid_file: &str) {
    let _ = std::io::stdout().flush();
    #[allow(unsafe_code)]
    // SAFETY: this program is single-threaded, so the child may run arbitrary code.
    match unsafe { nix::unistd::fork() } {
        Ok(nix::unistd::ForkResult::Child) => sleep_forever(),
        Ok(nix::unistd::ForkResult::Parent { child }) => {
            let temp = format!("{pid_file}.tmp");
            std::fs::write(&temp, format!("{child}\n")).unwrap_or_else(|e| fail(&format!("write {temp}: {e}")));
            std::fs::rename(&temp, pid_file).unwrap_or_else(|e| fail(&format!("rename {temp}: {e}")));
        }
        Err(error) => fail(&format!("fork failed: {error}")),
    }
}

/// Writes lines to stdout at `rate` bytes a second, at most, for `seconds`: 64 KiB writes,
/// one per slot of the schedule. A writer that was kept from running skips the slots it
/// missed instead of writing them all at once, so that a busy machine never turns it into
/// a burst faster than `rate`.
fn write_at_rate(rate: u64, seconds: f64) {
    use std::time::{Duration, Instant};
    let block: Vec<u8> = (0..64 << 10).map(|at| if at % 1024 == 1023 { b'\n' } else { b'x' }).collect();
    let slot = Duration::from_secs_f64(block.len() as f64 / rate as f64);
    let mut stdout = std::io::stdout().lock();
    let end = Instant::now() + Duration::from_secs_f64(seconds);
    let mut next = Instant::now();
    while Instant::now() < end {
        let now = Instant::now();
        if now < next {
            std::thread::sleep(next - now);
            continue;
        }
        let _ = stdout.write_all(&block);
        // The next slot, or now if this one came late: never two blocks in one slot.
        next = (next + slot).max(now);
    }
    let _ = stdout.flush();
}

fn write_bytes(count: usize) {
    let line = [b'x'; 1023];
    let mut stdout = std::io::stdout().lock();
    let mut left = count;
    while left > 0 {
        let chunk = left.min(1024);
        let _ = stdout.write_all(&line[..chunk - 1]);
        let _ = stdout.write_all(b"\n");
        left -= chunk;
    }
    let _ = stdout.flush();
}
