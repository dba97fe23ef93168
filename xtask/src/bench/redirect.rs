//! An in-kernel forwarder, to show what forwarding costs on the machine when user space
//! takes no part in it: a socket hash map with an `sk_skb` verdict program that moves each
//! segment received on one socket of a pair straight onto the other socket's send queue. No
//! byte and no wake-up per segment passes through user space; what remains is the TCP work
//! of the extra hop, which any proxy that terminates TCP pays.
//!
//! Loading it takes root (`CAP_BPF` and `CAP_NET_ADMIN`) and a kernel with
//! `CONFIG_BPF_STREAM_PARSER`; [`Redirect::load`] says why when it cannot.
//!
//! The program is eleven instructions, written out below rather than compiled, so that the
//! bench needs no BPF toolchain:
//!
//! ```text
//! r6 = r1                                  ; the segment
//! r0 = bpf_get_socket_cookie(r1)           ; of the socket that received it
//! *(u64 *)(r10 - 8) = r0
//! r0 = bpf_sk_redirect_hash(r6, map, r10 - 8, 0)
//! exit                                     ; to the send queue of the socket under that key
//! ```
//!
//! Each socket of a pair is stored under the other's cookie.

use std::io;
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use nix::libc;
use nix::sys::socket::{getsockopt, setsockopt, sockopt};

use super::builtin_proxy::Upstream;

const BPF_MAP_CREATE: libc::c_int = 0;
const BPF_MAP_UPDATE_ELEM: libc::c_int = 2;
const BPF_MAP_DELETE_ELEM: libc::c_int = 3;
const BPF_PROG_LOAD: libc::c_int = 5;
const BPF_PROG_ATTACH: libc::c_int = 8;
const BPF_MAP_TYPE_SOCKHASH: u32 = 18;
const BPF_PROG_TYPE_SK_SKB: u32 = 14;
/// The verdict without a stream parser: each segment as it is read.
const BPF_SK_SKB_VERDICT: u32 = 38;
const BPF_FUNC_GET_SOCKET_COOKIE: i32 = 46;
const BPF_FUNC_SK_REDIRECT_HASH: i32 = 72;
const BPF_PSEUDO_MAP_FD: u8 = 1;
/// Sockets in the map at most; the bench forwards one connection at a time.
const MAX_SOCKETS: u32 = 1024;
/// Send buffer of each paired socket. A segment redirected to a full send queue waits for
/// a timer tick before it is tried again; a send queue this large is rarely full on loopback.
const SEND_BUFFER: usize = 32 << 20;

/// `union bpf_attr`, as the words the commands below use; the rest stays zero, as the
/// kernel requires.
#[repr(C, align(8))]
#[derive(Default)]
struct Attr([u32; 32]);

impl Attr {
    fn set(mut self, index: usize, value: u32) -> Self {
        self.0[index] = value;
        self
    }

    /// A 64-bit field at word `index` (8-byte aligned).
    fn set_u64(self, index: usize, value: u64) -> Self {
        let bytes = value.to_ne_bytes();
        let word = |at: usize| u32::from_ne_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]]);
        self.set(index, word(0)).set(index + 1, word(4))
    }

    fn pointer<T>(self, index: usize, to: *const T) -> Self {
        self.set_u64(index, to as u64)
    }
}

/// `bpf(2)`: the returned descriptor or zero.
fn bpf(command: libc::c_int, attr: &Attr) -> io::Result<libc::c_long> {
    // SAFETY: `attr` is a zero-filled `union bpf_attr` of the size passed, whose pointer
    // fields point at memory that outlives the call (the caller's locals), and the kernel
    // reads no more than the size given.
    let result = unsafe { libc::syscall(libc::SYS_bpf, command, attr, std::mem::size_of::<Attr>()) };
    if result < 0 { Err(io::Error::last_os_error()) } else { Ok(result) }
}

fn owned(descriptor: libc::c_long) -> io::Result<OwnedFd> {
    let raw = i32::try_from(descriptor).map_err(|_| io::Error::other("descriptor out of range"))?;
    // SAFETY: `raw` was just returned by `bpf(2)` as a new descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

/// One BPF instruction: opcode, registers (destination in the low nibble), offset, immediate.
#[repr(C)]
#[derive(Clone, Copy)]
struct Insn(u8, u8, i16, i32);

/// The loaded map and verdict program; dropping it unloads both.
pub(super) struct Redirect {
    map: OwnedFd,
    _program: OwnedFd,
}

impl Redirect {
    /// Creates the map, loads the program and attaches it to the map.
    pub(super) fn load() -> Result<Self, String> {
        let attr = Attr::default().set(0, BPF_MAP_TYPE_SOCKHASH).set(1, 8).set(2, 4).set(3, MAX_SOCKETS);
        let map =
            bpf(BPF_MAP_CREATE, &attr).and_then(owned).map_err(|err| format!("cannot create a sockhash: {err}"))?;
        let map_fd = map.as_raw_fd();
        let program = [
            Insn(0xbf, 0x16, 0, 0),                                 // r6 = r1
            Insn(0x85, 0, 0, BPF_FUNC_GET_SOCKET_COOKIE),           // call
            Insn(0x7b, 0x0a, -8, 0),                                // *(u64 *)(r10 - 8) = r0
            Insn(0xbf, 0x61, 0, 0),                                 // r1 = r6
            Insn(0x18, 0x02 | (BPF_PSEUDO_MAP_FD << 4), 0, map_fd), // r2 = map (two words)
            Insn(0, 0, 0, 0),
            Insn(0xbf, 0xa3, 0, 0),                      // r3 = r10
            Insn(0x07, 0x03, 0, -8),                     // r3 += -8
            Insn(0xb7, 0x04, 0, 0),                      // r4 = 0: to the send queue
            Insn(0x85, 0, 0, BPF_FUNC_SK_REDIRECT_HASH), // call
            Insn(0x95, 0, 0, 0),                         // exit
        ];
        let license = c"GPL";
        let mut log = vec![0_u8; 16 * 1024];
        let attr = Attr::default()
            .set(0, BPF_PROG_TYPE_SK_SKB)
            .set(1, u32::try_from(program.len()).unwrap_or(0))
            .pointer(2, program.as_ptr())
            .pointer(4, license.as_ptr())
            .set(6, 1)
            .set(7, u32::try_from(log.len()).unwrap_or(0))
            .pointer(8, log.as_mut_ptr())
            .set(17, BPF_SK_SKB_VERDICT);
        let program = bpf(BPF_PROG_LOAD, &attr).and_then(owned).map_err(|err| {
            let end = log.iter().position(|&byte| byte == 0).unwrap_or(log.len());
            format!("cannot load the verdict program: {err} {}", String::from_utf8_lossy(&log[..end]).trim())
        })?;
        let attr = Attr::default()
            .set(0, map.as_raw_fd() as u32)
            .set(1, program.as_raw_fd() as u32)
            .set(2, BPF_SK_SKB_VERDICT);
        bpf(BPF_PROG_ATTACH, &attr).map_err(|err| format!("cannot attach the verdict program: {err}"))?;
        Ok(Self { map, _program: program })
    }

    /// Stores `value` under `key`, the other socket's cookie.
    fn store(&self, key: u64, value: &TcpStream) -> io::Result<()> {
        let fd = value.as_raw_fd();
        let attr = Attr::default().set(0, self.map.as_raw_fd() as u32).pointer(2, &key).pointer(4, &fd);
        bpf(BPF_MAP_UPDATE_ELEM, &attr).map(drop)
    }

    fn remove(&self, key: u64) {
        let attr = Attr::default().set(0, self.map.as_raw_fd() as u32).pointer(2, &key);
        let _ = bpf(BPF_MAP_DELETE_ELEM, &attr);
    }

    /// Forwards `a` and `b` to each other in the kernel until both have sent EOF, passing
    /// each EOF on, then takes them out of the map.
    fn forward(&self, a: &TcpStream, b: &TcpStream) -> io::Result<()> {
        let (key_a, key_b) = (cookie(a)?, cookie(b)?);
        for stream in [a, b] {
            setsockopt(stream, sockopt::SndBufForce, &SEND_BUFFER)?;
        }
        self.store(key_a, b)?;
        let result = self.store(key_b, a).and_then(|()| {
            // Bytes that arrived before the socket was stored wait in its queue until a
            // segment arrives and the kernel reads the queue; a sender whose window is full,
            // or that waits for an answer, sends none. Setting the low-water mark makes the
            // kernel look at the queue now, through the program, in order.
            for stream in [a, b] {
                low_water_mark(stream, 1)?;
            }
            pass_eofs(a, b)
        });
        self.remove(key_a);
        self.remove(key_b);
        result
    }
}

/// The socket's cookie (`SO_COOKIE`): its key in the map, as the program reads it.
fn cookie(stream: &TcpStream) -> io::Result<u64> {
    let mut cookie = 0_u64;
    let mut size = std::mem::size_of::<u64>() as libc::socklen_t;
    // SAFETY: `SO_COOKIE` writes at most `size` bytes to the pointer given, a live local of
    // that size, and the new size to `size`.
    let result = unsafe {
        libc::getsockopt(stream.as_raw_fd(), libc::SOL_SOCKET, libc::SO_COOKIE, (&raw mut cookie).cast(), &mut size)
    };
    if result < 0 { Err(io::Error::last_os_error()) } else { Ok(cookie) }
}

/// Sets `SO_RCVLOWAT`, which nix does not name.
fn low_water_mark(stream: &TcpStream, bytes: libc::c_int) -> io::Result<()> {
    let size = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `SO_RCVLOWAT` reads one `int` from the pointer given, a live local.
    let result = unsafe {
        libc::setsockopt(stream.as_raw_fd(), libc::SOL_SOCKET, libc::SO_RCVLOWAT, (&raw const bytes).cast(), size)
    };
    if result < 0 { Err(io::Error::last_os_error()) } else { Ok(()) }
}

/// What `TCP_INFO` says of a socket.
struct TcpInfo {
    /// Payload bytes received (the peer's EOF counts as one more, as it does in TCP's
    /// sequence numbers).
    received: u64,
    /// Payload bytes written to the send queue: sent once, plus not yet sent.
    written: u64,
}

/// Reads `TCP_INFO`. libc's `tcp_info` stops before the counts of bytes sent and sent
/// again (Linux 4.19), so the kernel's layout is read by offset.
fn tcp_info(stream: &TcpStream) -> io::Result<TcpInfo> {
    const BYTES_RECEIVED: usize = 128;
    const NOTSENT_BYTES: usize = 144;
    const BYTES_SENT: usize = 200;
    const BYTES_RETRANS: usize = 208;
    let mut info = [0_u8; 256];
    let mut size = info.len() as libc::socklen_t;
    // SAFETY: `TCP_INFO` writes at most `size` bytes to the pointer given, a live local of
    // that size, and the size written to `size`.
    let result = unsafe {
        libc::getsockopt(stream.as_raw_fd(), libc::IPPROTO_TCP, libc::TCP_INFO, info.as_mut_ptr().cast(), &mut size)
    };
    if result < 0 {
        return Err(io::Error::last_os_error());
    }
    if (size as usize) < BYTES_RETRANS + 8 {
        return Err(io::Error::other("TCP_INFO has no count of bytes sent (Linux 4.19 or later has)"));
    }
    let word = |at: usize| u64::from_ne_bytes(info[at..at + 8].try_into().unwrap_or_default());
    let notsent = u32::from_ne_bytes(info[NOTSENT_BYTES..NOTSENT_BYTES + 4].try_into().unwrap_or_default());
    Ok(TcpInfo { received: word(BYTES_RECEIVED), written: word(BYTES_SENT) - word(BYTES_RETRANS) + u64::from(notsent) })
}

/// Waits until each side's peer has sent EOF and every byte it sent is in the other side's
/// send queue, then shuts the other side's sending down.
///
/// The kernel moves the segments but not the EOF, so this thread passes it on, and not
/// earlier: the segments reach the other send queue from a kernel worker, and a send queue
/// shut down before the last of them reach it drops them. Handing over the EOF segment,
/// which carries no bytes, leaves `EPIPE` on the other socket; the thread takes it.
fn pass_eofs(a: &TcpStream, b: &TcpStream) -> io::Result<()> {
    let mut open = [true, true];
    while open.iter().any(|&open| open) {
        let watch = |stream: &TcpStream, open: bool| libc::pollfd {
            fd: stream.as_raw_fd(),
            events: if open { libc::POLLRDHUP } else { 0 },
            revents: 0,
        };
        let mut fds = [watch(a, open[0]), watch(b, open[1])];
        // SAFETY: `fds` is a live array of two `pollfd`, as the count says. (nix's `PollFd`
        // drops what it has no name for, `POLLRDHUP` among it.)
        if unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) } < 0 {
            let err = io::Error::last_os_error();
            if err.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(err);
        }
        for (index, ((from, to), fd)) in [(a, b), (b, a)].into_iter().zip(fds).enumerate() {
            if fd.revents & libc::POLLERR != 0 {
                let error = getsockopt(from, sockopt::SocketError)?;
                if error != 0 && error != libc::EPIPE {
                    return Err(io::Error::from_raw_os_error(error));
                }
            }
            if !open[index] || fd.revents & (libc::POLLRDHUP | libc::POLLHUP) == 0 {
                continue;
            }
            open[index] = false;
            let received = tcp_info(from)?.received;
            let deadline = Instant::now() + Duration::from_secs(10);
            // The EOF counts as one byte received.
            while tcp_info(to)?.written + 1 < received {
                if Instant::now() > deadline {
                    return Err(io::Error::other("the last segments were not forwarded within 10 s"));
                }
                thread::sleep(Duration::from_micros(100));
            }
            let _ = to.shutdown(Shutdown::Write);
        }
    }
    Ok(())
}

/// The in-kernel forwarder: accepts on loopback and has `redirect` forward each connection
/// to `upstream`.
pub(super) fn kernel_forwarder(redirect: &Arc<Redirect>, upstream: SocketAddr) -> Result<Upstream, String> {
    let redirect = Arc::clone(redirect);
    Upstream::accepting(move |client| {
        let Ok(server) = TcpStream::connect(upstream) else { return };
        let _ = client.set_nodelay(true);
        let _ = server.set_nodelay(true);
        let redirect = Arc::clone(&redirect);
        thread::spawn(move || {
            match redirect.forward(&client, &server) {
                // The bench resets connections on purpose.
                Err(err) if err.kind() == io::ErrorKind::ConnectionReset => {}
                Err(err) => eprintln!("xtask: bench: in-kernel forwarder: {err}"),
                Ok(()) => {}
            }
        });
    })
}
