//! A partition the kernel makes: two network namespaces made by the test, joined by a veth
//! pair. The *store* side holds the etcd members, the agents that stay connected, the
//! `tether fleet` commands and the test's own thread; the *cut-off* side holds one agent.
//! A cut is a firewall rule inside the cut-off namespace that drops every packet on the
//! link, both ways: nothing is refused or reset, bytes are lost, as when a host loses its
//! network. Nothing of this touches the host's own namespace.

use std::os::fd::{AsRawFd, BorrowedFd};
use std::os::unix::process::CommandExt;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

use nix::sched::{CloneFlags, setns};

/// The store side's address on the link; the cut-off side is `.2`.
pub const STORE_ADDRESS: &str = "10.77.0.1";

/// The two namespaces and their link; dropping it returns the test's thread to the
/// namespace it came from and deletes both.
pub struct Partition {
    store: String,
    cut_off: String,
    /// The cut-off side's end of the link.
    link: String,
    /// The thread's own namespace, while it is in the store's.
    home: std::fs::File,
    /// The cut-off namespace, for [`Partition::in_cut_off`].
    cut_off_ns: std::fs::File,
}

impl Partition {
    /// Makes both namespaces and moves the calling thread into the store's (its children
    /// are born there), or returns `None` and says why when this is not root or `ip`/`nft`
    /// are missing. CI has both and runs as root.
    pub fn new(test: &str) -> Option<Self> {
        let missing = ["ip", "nft"].into_iter().find(|tool| !on_path(tool));
        let why = match (super::is_root(), missing) {
            (false, _) => "network namespaces need root".to_owned(),
            (true, Some(tool)) => format!("no `{tool}` on PATH (apt-get install iproute2 nftables)"),
            (true, None) => return Some(Self::make()),
        };
        assert!(std::env::var_os("CI").is_none(), "CI runs as root with iproute2 and nftables: {why}");
        eprintln!("skipping {test}: {why}");
        None
    }

    fn make() -> Self {
        static MADE: AtomicUsize = AtomicUsize::new(0);
        let made = MADE.fetch_add(1, Ordering::Relaxed);
        let tag = format!("{}-{made}", std::process::id());
        let (store, cut_off) = (format!("tether-store-{tag}"), format!("tether-cut-{tag}"));
        // Interface names are at most 15 bytes.
        let suffix = format!("{:x}", std::process::id() % 0x10_0000 * 16 + made as u32 % 16);
        let (store_end, cut_end) = (format!("tts{suffix}"), format!("ttc{suffix}"));
        ip(&["netns", "add", &store]);
        ip(&["netns", "add", &cut_off]);
        let home = std::fs::File::open("/proc/thread-self/ns/net").unwrap();
        let partition = Self {
            cut_off_ns: std::fs::File::open(format!("/run/netns/{cut_off}")).unwrap(),
            store,
            cut_off,
            link: cut_end.clone(),
            home,
        };
        ip(&[
            "link",
            "add",
            "name",
            &store_end,
            "netns",
            &partition.store,
            "type",
            "veth",
            "peer",
            "name",
            &cut_end,
            "netns",
            &partition.cut_off,
        ]);
        for (ns, end, address) in
            [(&partition.store, &store_end, STORE_ADDRESS), (&partition.cut_off, &cut_end, "10.77.0.2")]
        {
            ip(&["-n", ns, "addr", "add", &format!("{address}/30"), "dev", end]);
            ip(&["-n", ns, "link", "set", end, "up"]);
            ip(&["-n", ns, "link", "set", "lo", "up"]);
        }
        let store_ns = std::fs::File::open(format!("/run/netns/{}", partition.store)).unwrap();
        setns(&store_ns, CloneFlags::CLONE_NEWNET).unwrap();
        partition
    }

    /// Makes `command` run in the cut-off namespace.
    pub fn in_cut_off(&self, command: &mut Command) {
        let fd = self.cut_off_ns.as_raw_fd();
        // SAFETY: the hook runs in the forked child, where only async-signal-safe calls are
        // allowed: setns(2) is a plain system call, and the closure allocates nothing. The
        // descriptor stays open in the parent (held by `self`) until the spawn returns.
        unsafe {
            command.pre_exec(move || {
                setns(BorrowedFd::borrow_raw(fd), CloneFlags::CLONE_NEWNET).map_err(std::io::Error::from)
            });
        }
    }

    /// Drops every packet on the link, both ways, from now on.
    pub fn cut(&self) {
        let rules = format!(
            "table inet tether_cut {{\n\
             chain out {{ type filter hook output priority 0; oifname \"{0}\" drop; }}\n\
             chain in {{ type filter hook input priority 0; iifname \"{0}\" drop; }}\n\
             }}\n",
            self.link
        );
        let mut nft = Command::new("ip")
            .args(["netns", "exec", &self.cut_off, "nft", "-f", "-"])
            .stdin(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        std::io::Write::write_all(nft.stdin.as_mut().unwrap(), rules.as_bytes()).unwrap();
        drop(nft.stdin.take());
        assert!(nft.wait().unwrap().success(), "nft refused the cut");
    }

    /// Carries packets on the link again.
    pub fn heal(&self) {
        let status = Command::new("ip")
            .args(["netns", "exec", &self.cut_off, "nft", "delete", "table", "inet", "tether_cut"])
            .status()
            .unwrap();
        assert!(status.success(), "nft refused to heal the cut");
    }
}

impl Drop for Partition {
    fn drop(&mut self) {
        let _ = setns(&self.home, CloneFlags::CLONE_NEWNET);
        for ns in [&self.cut_off, &self.store] {
            let _ = Command::new("ip").args(["netns", "delete", ns]).status();
        }
    }
}

/// Runs `ip ARGS...`; must succeed.
fn ip(args: &[&str]) {
    let output = Command::new("ip").args(args).output().unwrap();
    assert!(output.status.success(), "ip {}: {}", args.join(" "), String::from_utf8_lossy(&output.stderr));
}

fn on_path(tool: &str) -> bool {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path).any(|dir| dir.join(tool).is_file())
}
