//! cgroup v2: a cgroup of its own for every instance of a supervised process.
//!
//! This module owns the supervisor's cgroup subtree: finding a writable cgroup2 hierarchy,
//! the subtree of one owner (an agent's data dir), each instance's cgroup (created before
//! the instance, entered by the child before its exec, killed as a whole through
//! `cgroup.kill`, removed once `cgroup.events` says it is empty), its limits and its
//! accounting, and the sweep of cgroups that nothing claims. It never moves a process
//! that it did not create, and never touches a cgroup outside its subtree.
//!
//! Layout: `<base>/tether-<key>/<name>@<n>`, where `<base>` is the caller's cgroup (or the
//! one it names), `<key>` a hash of the owner's path (two owners never share a subtree,
//! and an owner recreated at the same path finds what its predecessor left), `<name>` the
//! process name and `<n>` a number unique in the subtree: two instances of one process
//! (an overlapping update) never share a cgroup.

use std::collections::HashSet;
use std::fs;
use std::io;
use std::os::fd::{OwnedFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, SystemTime};

use tether_state::{ResourceLimits, lock};

mod events;

use events::Events;

/// The controllers whose limits and accounting a subtree uses.
const CONTROLLERS: [&str; 3] = ["cpu", "memory", "pids"];

/// The leaf an agent moves itself to when its own cgroup must enable controllers for its
/// subtree (the "no internal processes" rule).
const AGENT_LEAF: &str = "tether-agent";

/// How long a killed cgroup may take to empty before the sweep gives up on it (a process
/// in uninterruptible sleep dies only when it wakes).
const EMPTY_TIMEOUT: Duration = Duration::from_secs(10);

/// Why no cgroup subtree could be used; the supervisor then uses process groups.
#[derive(Debug, thiserror::Error)]
#[error("{reason}")]
pub struct CgroupUnavailable {
    /// What was missing or refused, for the one log line that says so.
    pub reason: String,
}

impl CgroupUnavailable {
    fn new(reason: impl Into<String>) -> Self {
        Self { reason: reason.into() }
    }
}

/// A limit, an entry or the accounting of one instance's cgroup that could not be written
/// or read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CgroupError {
    /// A limit is set whose controller the subtree does not have.
    #[error(
        "{limit} needs the cgroup {controller} controller, which is not enabled in {} (enabled: {})",
        .subtree.display(),
        if .enabled.is_empty() { "none".to_owned() } else { .enabled.join(", ") }
    )]
    Controller {
        /// The configuration key of the limit.
        limit: &'static str,
        /// The controller it needs.
        controller: &'static str,
        /// The subtree.
        subtree: PathBuf,
        /// The controllers it has.
        enabled: Vec<String>,
    },
    /// A file of the cgroup could not be written or read, or the cgroup created.
    #[error("cgroup {}", .path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The cause.
        #[source]
        source: io::Error,
    },
}

/// What an instance's cgroup has used, as `status` shows it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Usage {
    /// CPU time, user and system (`cpu.stat`'s `usage_usec`), in seconds.
    pub cpu_seconds: f64,
    /// `memory.current`, when the memory controller is enabled.
    pub memory_bytes: Option<u64>,
    /// `pids.current`, when the pids controller is enabled.
    pub tasks: Option<u64>,
}

/// The cgroup subtree of one owner. Cheap to clone.
#[derive(Clone)]
pub struct Cgroups {
    tree: Arc<Tree>,
}

struct Tree {
    /// `<base>/tether-<key>`.
    dir: PathBuf,
    /// The subtree as `/proc/<pid>/cgroup` shows it: its path below the hierarchy's root.
    dir_in_hierarchy: String,
    /// Controllers enabled for the instances' cgroups.
    controllers: Vec<String>,
    /// Names of the instance cgroups that a supervised instance lives in, or is being
    /// created for: everything else in the subtree may be swept.
    claimed: Mutex<HashSet<Box<str>>>,
    next: AtomicU64,
    /// Waits for cgroups to empty: one inotify instance for the whole subtree, started on
    /// first use (it needs the runtime).
    events: OnceLock<io::Result<Events>>,
}

impl std::fmt::Debug for Cgroups {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cgroups")
            .field("dir", &self.tree.dir)
            .field("controllers", &self.tree.controllers)
            .finish_non_exhaustive()
    }
}

impl Cgroups {
    /// Opens (creating it if needed) the subtree of `owner` under `base`, or under this
    /// process's own cgroup when `base` is `None`, and enables what it can of the `cpu`,
    /// `memory` and `pids` controllers for it.
    ///
    /// # Errors
    ///
    /// [`CgroupUnavailable`], with the reason, when there is no cgroup2 hierarchy, `base` is
    /// not on one, or the subtree cannot be created there.
    pub fn open(base: Option<&Path>, owner: &Path) -> Result<Self, CgroupUnavailable> {
        let mountinfo = fs::read_to_string("/proc/self/mountinfo")
            .map_err(|error| CgroupUnavailable::new(format!("cannot read /proc/self/mountinfo: {error}")))?;
        let mounts = cgroup2_mounts(&mountinfo);
        let own = base.is_none();
        let base = match base {
            Some(base) => {
                if !is_cgroup2(base) {
                    return Err(CgroupUnavailable::new(format!("{} is not in a cgroup2 file system", base.display())));
                }
                base.to_owned()
            }
            None => {
                let Some((mount, root)) = mounts.first() else {
                    return Err(CgroupUnavailable::new("no cgroup2 file system is mounted"));
                };
                let own = fs::read_to_string("/proc/self/cgroup")
                    .map_err(|error| CgroupUnavailable::new(format!("cannot read /proc/self/cgroup: {error}")))?;
                let Some(path) = own.lines().find_map(|line| line.strip_prefix("0::")) else {
                    return Err(CgroupUnavailable::new("this process is in no cgroup2 cgroup"));
                };
                let below = path.strip_prefix(root.as_str()).unwrap_or(path).trim_start_matches('/');
                let own = mount.join(below);
                // An agent that moved itself to its leaf: its subtree is beside it.
                match own.parent() {
                    Some(parent) if own.file_name().is_some_and(|name| name == AGENT_LEAF) => parent.to_owned(),
                    _ => own,
                }
            }
        };
        let Some((mount, root)) =
            mounts.iter().filter(|(mount, _)| base.starts_with(mount)).max_by_key(|(m, _)| m.as_os_str().len())
        else {
            return Err(CgroupUnavailable::new(format!("{} is below no cgroup2 mount", base.display())));
        };
        let dir = base.join(format!("tether-{:016x}", fnv1a(owner.as_os_str().as_encoded_bytes())));
        match fs::create_dir(&dir) {
            Ok(()) => {}
            Err(error) if error.kind() == io::ErrorKind::AlreadyExists => {}
            Err(error) => {
                return Err(CgroupUnavailable::new(format!("cannot create cgroup {}: {error}", dir.display())));
            }
        }
        let below = dir.strip_prefix(mount).unwrap_or(&dir).to_string_lossy().into_owned();
        let dir_in_hierarchy = format!("{}/{below}", root.trim_end_matches('/'));
        let controllers = enable_controllers(&base, &dir, own);
        let next = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default().as_micros() as u64;
        let tree = Tree {
            dir,
            dir_in_hierarchy,
            controllers,
            claimed: Mutex::default(),
            next: AtomicU64::new(next),
            events: OnceLock::new(),
        };
        Ok(Self { tree: Arc::new(tree) })
    }

    /// The subtree's directory.
    pub fn dir(&self) -> &Path {
        &self.tree.dir
    }

    /// The controllers enabled for the instances' cgroups (some of `cpu`, `memory`, `pids`).
    pub fn controllers(&self) -> &[String] {
        &self.tree.controllers
    }

    /// What the cgroup of process `pid` has used, if the process is in one of this subtree's
    /// instance cgroups.
    pub fn usage_of(&self, pid: u32) -> Option<Usage> {
        self.usage_in(&self.membership(pid).ok()??)
    }

    /// What instance cgroup `name` has used.
    pub(crate) fn usage_in(&self, name: &str) -> Option<Usage> {
        let dir = self.tree.dir.join(name);
        let cpu = fs::read_to_string(dir.join("cpu.stat")).ok()?;
        let usec: u64 = cpu.lines().find_map(|line| line.strip_prefix("usage_usec "))?.trim().parse().ok()?;
        // Only the files of enabled controllers exist: the others are not looked for.
        let number = |controller: &str, file: &str| {
            if !self.tree.controllers.iter().any(|c| c == controller) {
                return None;
            }
            fs::read_to_string(dir.join(file)).ok()?.trim().parse().ok()
        };
        Some(Usage {
            cpu_seconds: usec as f64 / 1e6,
            memory_bytes: number("memory", "memory.current"),
            tasks: number("pids", "pids.current"),
        })
    }

    /// The instance cgroup of this subtree that process `pid` is in: `None` when it is in
    /// none (outside the subtree, or in the subtree's own directory).
    ///
    /// # Errors
    ///
    /// When `/proc/<pid>/cgroup` cannot be read (the process is gone).
    pub(crate) fn membership(&self, pid: u32) -> io::Result<Option<Box<str>>> {
        let text = fs::read_to_string(format!("/proc/{pid}/cgroup"))?;
        let Some(path) = text.lines().find_map(|line| line.strip_prefix("0::")) else { return Ok(None) };
        let Some(rest) = path.strip_prefix(self.tree.dir_in_hierarchy.as_str()) else { return Ok(None) };
        let Some(name) = rest.strip_prefix('/') else { return Ok(None) };
        // A process of an instance is in the instance's cgroup itself, never below it.
        Ok((!name.is_empty() && !name.contains('/')).then(|| name.into()))
    }

    /// Creates a cgroup for a new instance of process `process`, with `limits` written, and
    /// opens its directory for the child to be born in.
    pub(crate) fn create(&self, process: &str, limits: &ResourceLimits) -> Result<NewCgroup, CgroupError> {
        self.check_controllers(limits)?;
        let name = loop {
            let n = self.tree.next.fetch_add(1, Ordering::Relaxed);
            let name: Box<str> = format!("{process}@{n:x}").into();
            if !self.claim(&name) {
                continue;
            }
            let dir = self.tree.dir.join(&*name);
            match fs::create_dir(&dir) {
                Ok(()) => break name,
                // Left by an earlier owner: it is swept as unclaimed; take another number.
                Err(error) if error.kind() == io::ErrorKind::AlreadyExists => self.unclaim(&name),
                Err(source) => {
                    self.unclaim(&name);
                    return Err(CgroupError::Io { path: dir, source });
                }
            }
        };
        self.prepare(name, limits)
    }

    /// Writes `limits` into instance cgroup `name`, in place.
    pub(crate) fn set_limits(&self, name: &str, limits: &ResourceLimits) -> Result<(), CgroupError> {
        self.check_controllers(limits)?;
        write_limits(&self.tree.dir.join(name), limits, &self.tree.controllers)
    }

    fn check_controllers(&self, limits: &ResourceLimits) -> Result<(), CgroupError> {
        let wanted = [
            ("memory_max", "memory", limits.memory_max.is_some()),
            ("cpus", "cpu", limits.cpus.is_some()),
            ("pids_max", "pids", limits.pids_max.is_some()),
        ];
        for (limit, controller, set) in wanted {
            if set && !self.tree.controllers.iter().any(|c| c == controller) {
                return Err(CgroupError::Controller {
                    limit,
                    controller,
                    subtree: self.tree.dir.clone(),
                    enabled: self.tree.controllers.clone(),
                });
            }
        }
        Ok(())
    }

    /// Marks instance cgroup `name` as in use (an adopted instance lives in it); `false`
    /// when it already was.
    pub(crate) fn claim(&self, name: &str) -> bool {
        lock(&self.tree.claimed).insert(name.into())
    }

    fn unclaim(&self, name: &str) {
        lock(&self.tree.claimed).remove(name);
    }

    /// Removes instance cgroup `name`, which nothing entered, and lets its name go.
    pub(crate) fn remove_empty(&self, name: &str) {
        let dir = self.tree.dir.join(name);
        if let Err(error) = fs::remove_dir(&dir) {
            if error.kind() != io::ErrorKind::NotFound {
                tracing::warn!(cgroup = %dir.display(), %error, "cannot remove cgroup");
            }
        }
        self.unclaim(name);
    }

    /// Kills every process of instance cgroup `name` (`cgroup.kill`), waits until
    /// `cgroup.events` says it is empty, and removes it. A daemonised grandchild that
    /// left the instance's process group dies with the rest.
    pub(crate) async fn sweep(&self, name: &str) {
        if matches!(self.empty(name).await, Emptied::Already | Emptied::ByKill) {
            self.remove_empty(name);
        }
    }

    /// Whether instance cgroup `name`, whose main process has exited, is empty and may take
    /// the next instance of its process as it is. Otherwise it is swept, and `false`: a
    /// cgroup that was killed through `cgroup.kill` is not used again, as processes born
    /// into it right after a kill have been seen to die of it.
    pub(crate) async fn reusable(&self, name: &str) -> bool {
        match self.empty(name).await {
            Emptied::Already => true,
            Emptied::ByKill => {
                self.remove_empty(name);
                false
            }
            Emptied::Not => false,
        }
    }

    /// Kills what is left in instance cgroup `name` and waits until it is empty. When it is
    /// gone, or still holds processes, it is let go (and left where it is).
    async fn empty(&self, name: &str) -> Emptied {
        let dir = self.tree.dir.join(name);
        // Usually only the main process was in it, and it has exited: nothing to kill.
        if matches!(populated(&dir.join("cgroup.events")), Ok(false)) {
            if dir.exists() {
                return Emptied::Already;
            }
            self.unclaim(name);
            return Emptied::Not;
        }
        match fs::write(dir.join("cgroup.kill"), b"1") {
            Ok(()) => {}
            Err(_) if !dir.exists() => {
                self.unclaim(name);
                return Emptied::Not;
            }
            // A kernel before 5.14 has no `cgroup.kill`.
            Err(error) if error.kind() == io::ErrorKind::NotFound => kill_frozen(&dir),
            Err(error) => tracing::warn!(cgroup = %dir.display(), %error, "cannot kill cgroup"),
        }
        match tokio::time::timeout(EMPTY_TIMEOUT, self.wait_empty(&dir)).await {
            Ok(Ok(())) => return Emptied::ByKill,
            Ok(Err(error)) => tracing::warn!(cgroup = %dir.display(), %error, "cannot watch cgroup; leaving it"),
            Err(_) => tracing::warn!(cgroup = %dir.display(), "cgroup still populated after a kill; leaving it"),
        }
        self.unclaim(name);
        Emptied::Not
    }

    /// Takes empty instance cgroup `name` (left by the previous instance of the process,
    /// [`Cgroups::reusable`]) for a new instance, with `limits` written: a restart costs no
    /// removal and creation.
    pub(crate) fn reuse(&self, name: Box<str>, limits: &ResourceLimits) -> Result<NewCgroup, CgroupError> {
        if let Err(error) = self.check_controllers(limits) {
            self.remove_empty(&name);
            return Err(error);
        }
        self.prepare(name, limits)
    }

    /// Writes `limits` into claimed, empty instance cgroup `name` and opens it for a child;
    /// on failure the cgroup is removed and its name let go.
    fn prepare(&self, name: Box<str>, limits: &ResourceLimits) -> Result<NewCgroup, CgroupError> {
        let dir = self.tree.dir.join(&*name);
        let opened = write_limits(&dir, limits, &self.tree.controllers).and_then(|()| open_dir(&dir));
        match opened {
            Ok(handle) => Ok(NewCgroup { name, dir: handle }),
            Err(error) => {
                self.remove_empty(&name);
                Err(error)
            }
        }
    }

    /// Stops what runs in every cgroup of the subtree that no instance claims (left by an
    /// owner that crashed or lost its state) and removes them. Returns how many held
    /// processes.
    pub async fn sweep_unclaimed(&self) -> usize {
        let Ok(entries) = fs::read_dir(&self.tree.dir) else { return 0 };
        let mut names = Vec::new();
        for entry in entries.flatten() {
            if entry.file_type().is_ok_and(|kind| kind.is_dir()) {
                if let Some(name) = entry.file_name().to_str() {
                    if !lock(&self.tree.claimed).contains(name) {
                        names.push(name.to_owned());
                    }
                }
            }
        }
        let mut stopped = 0;
        for name in names {
            // Claimed for the sweep, so that no instance is created in it meanwhile.
            if !self.claim(&name) {
                continue;
            }
            let procs = fs::read_to_string(self.tree.dir.join(&name).join("cgroup.procs")).unwrap_or_default();
            let pids: Vec<&str> = procs.lines().collect();
            if !pids.is_empty() {
                stopped += 1;
                tracing::warn!(cgroup = %name, pids = %pids.join(" "), "stopping processes that no proxy claims");
            }
            self.sweep(&name).await;
        }
        stopped
    }

    /// Removes the subtree's directory, if nothing is left in it.
    pub fn remove_if_empty(&self) {
        let _not_empty = fs::remove_dir(&self.tree.dir);
    }

    async fn wait_empty(&self, dir: &Path) -> io::Result<()> {
        let events = match self.tree.events.get_or_init(Events::start) {
            Ok(events) => events,
            Err(error) => return Err(io::Error::new(error.kind(), error.to_string())),
        };
        let file = dir.join("cgroup.events");
        loop {
            // Registered before the file is read, so that no change between is missed.
            let changed = events.watch(&file)?;
            if !populated(&file)? {
                return Ok(());
            }
            let _ = changed.await;
        }
    }
}

/// How an instance cgroup ended up after [`Cgroups::empty`].
enum Emptied {
    /// Nothing was left in it.
    Already,
    /// What was left in it was killed.
    ByKill,
    /// It is gone, or still holds processes; its name has been let go.
    Not,
}

/// A cgroup made for an instance that does not exist yet.
#[derive(Debug)]
pub(crate) struct NewCgroup {
    pub(crate) name: Box<str>,
    /// Its directory, into which the child is born (or whose `cgroup.procs` it writes
    /// itself into before its exec).
    pub(crate) dir: OwnedFd,
}

/// Kills every process of the cgroup at `dir` without `cgroup.kill`: frozen first, so that
/// none forks while the list is read, then SIGKILLed one by one, then thawed (a frozen
/// process dies of SIGKILL once thawed).
fn kill_frozen(dir: &Path) {
    let freeze = dir.join("cgroup.freeze");
    let frozen = fs::write(&freeze, b"1").is_ok();
    let procs = fs::read_to_string(dir.join("cgroup.procs")).unwrap_or_default();
    for pid in procs.lines().filter_map(|line| line.trim().parse::<i32>().ok()) {
        // Frozen, it cannot exit by itself between the read and the signal.
        let _gone = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGKILL);
    }
    if frozen {
        let _gone = fs::write(&freeze, b"0");
    }
}

/// Opens a cgroup's directory, for a child to be born in.
fn open_dir(dir: &Path) -> Result<OwnedFd, CgroupError> {
    fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_CLOEXEC)
        .open(dir)
        .map(OwnedFd::from)
        .map_err(|source| CgroupError::Io { path: dir.to_owned(), source })
}

/// Whether `cgroup.events` says `populated 1`.
fn populated(events: &Path) -> io::Result<bool> {
    match fs::read_to_string(events) {
        Ok(text) => Ok(text.lines().any(|line| line == "populated 1")),
        // Removed: nothing is in it.
        Err(error) if error.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(error) => Err(error),
    }
}

/// Writes each limit whose controller is enabled: a set limit, or `max` for none.
fn write_limits(dir: &Path, limits: &ResourceLimits, controllers: &[String]) -> Result<(), CgroupError> {
    let has = |controller: &str| controllers.iter().any(|c| c == controller);
    let max = |value: Option<u64>| value.map_or_else(|| "max".to_owned(), |v| v.to_string());
    let mut writes = Vec::new();
    if has("memory") {
        writes.push(("memory.max", max(limits.memory_max)));
    }
    if has("cpu") {
        let quota = limits.cpus.map(|cpus| cpus.quota_micros());
        writes.push(("cpu.max", format!("{} {}", max(quota), tether_state::CpuLimit::PERIOD_MICROS)));
    }
    if has("pids") {
        writes.push(("pids.max", max(limits.pids_max)));
    }
    for (file, value) in writes {
        let path = dir.join(file);
        fs::write(&path, value).map_err(|source| CgroupError::Io { path, source })?;
    }
    Ok(())
}

/// Enables what it can of [`CONTROLLERS`] for the subtree `dir` of `base`: in `base`'s
/// `cgroup.subtree_control` (refused when `base` holds processes and is not the root: the
/// "no internal processes" rule), then in `dir`'s, which holds none. Returns what the
/// instances' cgroups get.
///
/// `own`: `base` is this process's own cgroup. If it holds this process and so refuses a
/// controller, the process moves to a leaf of its own, [`AGENT_LEAF`], as systemd asks of
/// a service with `Delegate=yes`, and tries again.
fn enable_controllers(base: &Path, dir: &Path, own: bool) -> Vec<String> {
    let words = |path: &Path| -> Vec<String> {
        fs::read_to_string(path).unwrap_or_default().split_whitespace().map(str::to_owned).collect()
    };
    let available = words(&base.join("cgroup.controllers"));
    let enabled_in_base = words(&base.join("cgroup.subtree_control"));
    let mut moved = false;
    for controller in CONTROLLERS {
        if available.iter().any(|c| c == controller) && !enabled_in_base.iter().any(|c| c == controller) {
            let enable = || fs::write(base.join("cgroup.subtree_control"), format!("+{controller}"));
            let mut result = enable();
            if own && !moved && result.as_ref().is_err_and(|e| e.raw_os_error() == Some(libc::EBUSY)) {
                moved = true;
                let leaf = base.join(AGENT_LEAF);
                let entered = match fs::create_dir(&leaf) {
                    Ok(()) => Ok(()),
                    Err(error) if error.kind() == io::ErrorKind::AlreadyExists => Ok(()),
                    Err(error) => Err(error),
                }
                .and_then(|()| fs::write(leaf.join("cgroup.procs"), b"0"));
                match entered {
                    Ok(()) => {
                        tracing::info!(cgroup = %leaf.display(), "moved to a cgroup of its own, to enable controllers");
                        result = enable();
                    }
                    Err(error) => {
                        tracing::info!(cgroup = %leaf.display(), %error, "cannot move to a cgroup of its own")
                    }
                }
            }
            if let Err(error) = result {
                tracing::info!(%controller, base = %base.display(), %error, "cannot enable a cgroup controller");
            }
        }
    }
    let for_dir = words(&dir.join("cgroup.controllers"));
    let mut enabled = Vec::new();
    for controller in CONTROLLERS {
        if for_dir.iter().any(|c| c == controller) {
            match fs::write(dir.join("cgroup.subtree_control"), format!("+{controller}")) {
                Ok(()) => enabled.push(controller.to_owned()),
                Err(error) => {
                    tracing::info!(%controller, subtree = %dir.display(), %error, "cannot enable a cgroup controller");
                }
            }
        }
    }
    enabled
}

/// The cgroup2 mounts of `/proc/self/mountinfo`: mount point and root, in order.
fn cgroup2_mounts(mountinfo: &str) -> Vec<(PathBuf, String)> {
    mountinfo
        .lines()
        .filter_map(|line| {
            let (before, after) = line.split_once(" - ")?;
            if after.split_whitespace().next()? != "cgroup2" {
                return None;
            }
            let fields: Vec<&str> = before.split_whitespace().collect();
            let unescape = |field: &str| field.replace("\\040", " ");
            Some((PathBuf::from(unescape(fields.get(4)?)), unescape(fields.get(3)?)))
        })
        .collect()
}

fn is_cgroup2(path: &Path) -> bool {
    nix::sys::statfs::statfs(path).is_ok_and(|stat| stat.filesystem_type() == nix::sys::statfs::CGROUP2_SUPER_MAGIC)
}

/// FNV-1a, 64 bits: a subtree's name must stay the same across versions of this crate,
/// which `std`'s hasher does not promise.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, &byte| (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3))
}

/// Writes `0` into the cgroup's `cgroup.procs` from the forked child, before its exec:
/// the child enters the cgroup before its program can fork.
///
/// # Safety
///
/// To be called only between fork and exec, where only async-signal-safe calls are
/// allowed: it makes one `write` of a constant.
#[allow(unsafe_code)]
pub(crate) unsafe fn enter(procs: RawFd) -> io::Result<()> {
    // SAFETY: `write` of a static buffer to a descriptor the caller keeps open.
    let written = unsafe { libc::write(procs, b"0".as_ptr().cast(), 1) };
    if written == 1 { Ok(()) } else { Err(io::Error::last_os_error()) }
}

#[cfg(test)]
mod tests;
