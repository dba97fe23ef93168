//! The operating-system side of the end-to-end benchmarks: signals to arbitrary pids, the
//! open-file limit, kernel settings raised for a run (and put back), and what `/proc` says
//! about a process (memory, context switches, environment, liveness).
//!
//! std can only signal its own children with SIGKILL, and the bench signals the agent's
//! proxies and sends SIGTERM and SIGHUP to agents, so this module uses `nix`'s safe
//! wrappers of `kill(2)`, `killpg(2)` and `setrlimit(2)`.

use std::collections::BTreeMap;
use std::fs;
use std::time::{Duration, Instant};

use nix::sys::resource::{Resource, getrlimit, setrlimit};
pub(crate) use nix::sys::signal::Signal;
use nix::sys::signal::{kill, killpg};
use nix::unistd::Pid;

pub(crate) use nix::sys::signal::Signal::{SIGHUP, SIGINT, SIGKILL, SIGTERM};

fn pid_of(pid: u32) -> Result<Pid, String> {
    i32::try_from(pid).map(Pid::from_raw).map_err(|_| format!("pid {pid} out of range"))
}

/// Sends `signal` to the process `pid`.
pub(crate) fn signal(pid: u32, signal: Signal) -> Result<(), String> {
    kill(pid_of(pid)?, signal).map_err(|err| format!("kill({pid}, {signal}): {err}"))
}

/// Sends `signal` to the process group `pgid`; a group that no longer exists is no error.
pub(crate) fn signal_group(pgid: u32, signal: Signal) {
    if let Ok(pgid) = pid_of(pgid) {
        let _ = killpg(pgid, signal);
    }
}

/// Raises the soft limit of open files to the hard limit, so that the bench's 1 000 sockets
/// and the agent's descriptors fit; children inherit it. Returns the new soft limit.
pub(crate) fn raise_open_files() -> Result<u64, String> {
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE).map_err(|err| format!("getrlimit(NOFILE): {err}"))?;
    if soft < hard {
        setrlimit(Resource::RLIMIT_NOFILE, hard, hard).map_err(|err| format!("setrlimit(NOFILE, {hard}): {err}"))?;
    }
    Ok(hard.max(soft))
}

/// A kernel setting that the bench raised for its run: dropping it writes the old value
/// back, also when the run failed or panicked.
#[must_use = "dropping the guard puts the old value back at once"]
pub(crate) struct RaisedSysctl {
    name: &'static str,
    old: u64,
}

impl RaisedSysctl {
    /// The value before the run.
    pub(crate) fn old(&self) -> u64 {
        self.old
    }
}

impl Drop for RaisedSysctl {
    fn drop(&mut self) {
        match write_sysctl(self.name, self.old) {
            Ok(()) => eprintln!("xtask: bench: {} put back to {}", self.name, self.old),
            Err(err) => eprintln!("xtask: bench: cannot put {} back to {}: {err}", self.name, self.old),
        }
    }
}

/// `/proc/sys/...` of a dotted sysctl name.
fn sysctl_path(name: &str) -> String {
    format!("/proc/sys/{}", name.replace('.', "/"))
}

/// The value of the numeric sysctl `name` (dotted, as `sysctl` names it).
pub(crate) fn read_sysctl(name: &str) -> Result<u64, String> {
    let path = sysctl_path(name);
    let text = fs::read_to_string(&path).map_err(|err| format!("{name}: cannot read {path}: {err}"))?;
    text.trim().parse().map_err(|err| format!("{name}: {path} holds {:?}: {err}", text.trim()))
}

fn write_sysctl(name: &str, value: u64) -> Result<(), String> {
    let path = sysctl_path(name);
    fs::write(&path, format!("{value}\n")).map_err(|err| format!("{name}: cannot write {path}: {err}"))
}

/// Makes sure that the sysctl `name` is at least `needed` for `why`. A value high enough is
/// left as it is (`None`). As root, a lower one is raised to `needed` and the guard puts the
/// old one back; otherwise the error names the setting and the command that raises it.
pub(crate) fn sysctl_at_least(name: &'static str, needed: u64, why: &str) -> Result<Option<RaisedSysctl>, String> {
    let old = read_sysctl(name)?;
    if old >= needed {
        return Ok(None);
    }
    if !is_root() {
        return Err(format!(
            "{name} is {old}; {why} needs {needed}: run the bench as root (it raises it for the run and puts it \
             back), or raise it yourself: sysctl -w {name}={needed}"
        ));
    }
    write_sysctl(name, needed).map_err(|err| format!("{why} needs {name} >= {needed} (it is {old}): {err}"))?;
    eprintln!("xtask: bench: {name} raised from {old} to {needed} for {why}; put back after the run");
    Ok(Some(RaisedSysctl { name, old }))
}

/// The fields of `/proc/<pid>[/task/<tid>]/status`.
fn status_fields(path: &str) -> Option<BTreeMap<String, String>> {
    let text = fs::read_to_string(path).ok()?;
    Some(
        text.lines()
            .filter_map(|line| line.split_once(':'))
            .map(|(key, value)| (key.to_owned(), value.trim().to_owned()))
            .collect(),
    )
}

/// The resident set of `pid`, in KiB (`VmRSS`).
pub(crate) fn rss_kib(pid: u32) -> Result<u64, String> {
    let fields = status_fields(&format!("/proc/{pid}/status")).ok_or_else(|| format!("process {pid} is gone"))?;
    let value = fields.get("VmRSS").ok_or_else(|| format!("process {pid} has no VmRSS"))?;
    value.trim_end_matches("kB").trim().parse().map_err(|err| format!("VmRSS {value:?} of {pid}: {err}"))
}

/// The children of `pid`, from each of its threads' `children`.
pub(crate) fn children_of(pid: u32) -> Vec<u32> {
    let Ok(tasks) = fs::read_dir(format!("/proc/{pid}/task")) else { return Vec::new() };
    tasks
        .flatten()
        .filter_map(|task| fs::read_to_string(task.path().join("children")).ok())
        .flat_map(|text| text.split_whitespace().filter_map(|pid| pid.parse().ok()).collect::<Vec<u32>>())
        .collect()
}

/// The memory that `pid` alone holds, in KiB: its private pages (`Private_Clean` and
/// `Private_Dirty` of `smaps_rollup`), not the program's pages that it shares with others.
pub(crate) fn private_kib(pid: u32) -> Result<u64, String> {
    let path = format!("/proc/{pid}/smaps_rollup");
    let text = fs::read_to_string(&path).map_err(|err| format!("{path}: {err}"))?;
    let kib = |name: &str| {
        text.lines()
            .find_map(|line| line.strip_prefix(name))
            .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .unwrap_or(0)
    };
    Ok(kib("Private_Clean:") + kib("Private_Dirty:"))
}

/// The CPU time that the live threads of `pid` have run, from their `schedstat`
/// (nanoseconds, unlike the ticks of `stat`).
pub(crate) fn cpu_time(pid: u32) -> Result<Duration, String> {
    let tasks = fs::read_dir(format!("/proc/{pid}/task")).map_err(|err| format!("process {pid}: {err}"))?;
    let mut total = Duration::ZERO;
    for task in tasks.flatten() {
        let Ok(text) = fs::read_to_string(task.path().join("schedstat")) else { continue };
        let nanos = text.split_whitespace().next().and_then(|field| field.parse::<u64>().ok());
        total += Duration::from_nanos(nanos.ok_or_else(|| format!("{}: unreadable schedstat", task.path().display()))?);
    }
    Ok(total)
}

/// The CPU time, user and system, that `pid` has used, its exited threads included (fields
/// 14 and 15 of `/proc/<pid>/stat`, in clock ticks of 10 ms: for windows of seconds).
pub(crate) fn process_cpu_time(pid: u32) -> Result<Duration, String> {
    const TICKS_PER_SECOND: u64 = 100;
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).map_err(|err| format!("process {pid}: {err}"))?;
    let after_name = stat.rfind(')').map(|end| &stat[end + 2..]).ok_or_else(|| format!("process {pid}: bad stat"))?;
    // Fields from the state (field 3) on: utime is field 14, stime field 15.
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    let ticks = |index: usize| fields.get(index - 3).and_then(|field| field.parse::<u64>().ok());
    let total = ticks(14).zip(ticks(15)).map(|(user, system)| user + system);
    total
        .map(|ticks| Duration::from_millis(ticks * 1000 / TICKS_PER_SECOND))
        .ok_or_else(|| format!("process {pid}: unreadable CPU times"))
}

/// The CPU time, user and system, of the calling thread.
pub(crate) fn thread_cpu_time() -> Duration {
    use nix::sys::resource::{UsageWho, getrusage};
    getrusage(UsageWho::RUSAGE_THREAD).map_or(Duration::ZERO, |usage| {
        let to_duration = |time: nix::sys::time::TimeVal| {
            Duration::new(u64::try_from(time.tv_sec()).unwrap_or(0), u32::try_from(time.tv_usec()).unwrap_or(0) * 1_000)
        };
        to_duration(usage.user_time()) + to_duration(usage.system_time())
    })
}

/// Voluntary plus involuntary context switches of each thread of `pid`, by thread id.
pub(crate) fn context_switches(pid: u32) -> Result<BTreeMap<u32, u64>, String> {
    let dir = format!("/proc/{pid}/task");
    let entries = fs::read_dir(&dir).map_err(|err| format!("{dir}: {err}"))?;
    let mut threads = BTreeMap::new();
    for entry in entries.flatten() {
        let Some(tid) = entry.file_name().to_str().and_then(|name| name.parse::<u32>().ok()) else { continue };
        let Some(fields) = status_fields(&format!("{dir}/{tid}/status")) else { continue };
        let count = |key: &str| fields.get(key).and_then(|value| value.parse::<u64>().ok()).unwrap_or(0);
        threads.insert(tid, count("voluntary_ctxt_switches") + count("nonvoluntary_ctxt_switches"));
    }
    Ok(threads)
}

/// Context switches between two readings of [`context_switches`]: the growth of every thread
/// seen twice plus the whole count of threads born in between. The second value is how many
/// threads exited in between (whose last switches are then not counted).
pub(crate) fn switches_between(before: &BTreeMap<u32, u64>, after: &BTreeMap<u32, u64>) -> (u64, usize) {
    let grown = after.iter().map(|(tid, now)| now.saturating_sub(before.get(tid).copied().unwrap_or(0))).sum();
    let exited = before.keys().filter(|tid| !after.contains_key(tid)).count();
    (grown, exited)
}

/// The value of the environment variable `name` in the process `pid`, if readable.
pub(crate) fn environ_var(pid: u32, name: &str) -> Option<String> {
    let bytes = fs::read(format!("/proc/{pid}/environ")).ok()?;
    bytes.split(|byte| *byte == 0).find_map(|entry| {
        let entry = std::str::from_utf8(entry).ok()?;
        let (key, value) = entry.split_once('=')?;
        (key == name).then(|| value.to_owned())
    })
}

/// The state letter, parent and process group of `pid` from `/proc/<pid>/stat`.
fn stat(pid: u32) -> Option<(char, u32, u32)> {
    let text = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may hold spaces and parentheses: the fields start after the last ')'.
    let rest = &text[text.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace();
    let state = fields.next()?.chars().next()?;
    let parent = fields.next()?.parse().ok()?;
    let pgid = fields.next()?.parse().ok()?;
    Some((state, parent, pgid))
}

/// Whether `pid` is a live process (it exists and is not a zombie).
pub(crate) fn alive(pid: u32) -> bool {
    stat(pid).is_some_and(|(state, _, _)| state != 'Z' && state != 'X')
}

/// The process group of `pid`, if it is alive.
pub(crate) fn process_group(pid: u32) -> Option<u32> {
    stat(pid).filter(|(state, _, _)| *state != 'Z').map(|(_, _, pgid)| pgid)
}

/// The parent of `pid`, if it exists.
pub(crate) fn parent(pid: u32) -> Option<u32> {
    stat(pid).map(|(_, parent, _)| parent)
}

/// The pid most recently created on the machine (the last field of `/proc/loadavg`).
pub(crate) fn last_pid() -> Result<u32, String> {
    let text = fs::read_to_string("/proc/loadavg").map_err(|err| format!("/proc/loadavg: {err}"))?;
    text.split_whitespace().nth(4).and_then(|pid| pid.parse().ok()).ok_or_else(|| format!("/proc/loadavg: {text:?}"))
}

/// The largest pid (`/proc/sys/kernel/pid_max`).
pub(crate) fn pid_max() -> u32 {
    fs::read_to_string("/proc/sys/kernel/pid_max").ok().and_then(|max| max.trim().parse().ok()).unwrap_or(32_768)
}

/// Watches the pids created on the machine since it was made, for the first child of
/// `parent` whose environment has `name=value`: a process that has exec'd its program.
/// It reads `/proc` only for new pids, so that a poll costs microseconds.
pub(crate) struct NewProcesses {
    next: u32,
    max: u32,
    /// Pids allocated since, with when they were first seen allocated.
    pending: Vec<(u32, Instant)>,
}

/// How long a pid that the kernel has handed out may take to appear in `/proc`: it is
/// allocated (and `ns_last_pid` moves) before the new task is visible there.
const APPEAR_WITHIN: Duration = Duration::from_secs(2);

impl NewProcesses {
    pub(crate) fn since_now() -> Result<Self, String> {
        Ok(Self { next: last_pid()?, max: pid_max(), pending: Vec::new() })
    }

    /// One look; the pid found, if any.
    pub(crate) fn poll(&mut self, parent_pid: u32, name: &str, value: &str) -> Result<Option<u32>, String> {
        let last = last_pid()?;
        let now = Instant::now();
        while self.next != last {
            // Pids wrap from pid_max to 300 (the kernel's reserved range).
            self.next = if self.next >= self.max { 300 } else { self.next + 1 };
            self.pending.push((self.next, now));
        }
        let mut found = None;
        self.pending.retain(|(pid, allocated)| match parent(*pid) {
            Some(parent) if parent == parent_pid => {
                // Until it has exec'd, a child still has its parent's environment.
                if found.is_none() && environ_var(*pid, name).is_some_and(|found| found == value) {
                    found = Some(*pid);
                }
                true
            }
            // Another parent's process never becomes this parent's child.
            Some(_) => false,
            // Not visible yet, or already gone: wait a while for the first.
            None => now.duration_since(*allocated) < APPEAR_WITHIN,
        });
        Ok(found)
    }
}

/// Every live process whose environment has `name=value`.
pub(crate) fn processes_with_env(name: &str, value: &str) -> Vec<u32> {
    let Ok(entries) = fs::read_dir("/proc") else { return Vec::new() };
    entries
        .flatten()
        .filter_map(|entry| entry.file_name().to_str().and_then(|name| name.parse::<u32>().ok()))
        .filter(|pid| *pid != std::process::id())
        .filter(|pid| environ_var(*pid, name).is_some_and(|found| found == value))
        .filter(|pid| alive(*pid))
        .collect()
}

/// Whether this process runs as root (it may install packages).
pub(crate) fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| status.lines().find_map(|line| line.strip_prefix("Uid:")).map(str::to_owned))
        .is_some_and(|uids| uids.split_whitespace().nth(1) == Some("0"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn switches_count_growth_and_new_threads() {
        let before = BTreeMap::from([(1, 10), (2, 5), (3, 7)]);
        let after = BTreeMap::from([(1, 12), (2, 5), (4, 3)]);
        assert_eq!(switches_between(&before, &after), (5, 1));
    }

    #[test]
    fn this_process_is_readable() {
        let me = std::process::id();
        assert!(alive(me));
        assert!(rss_kib(me).unwrap() > 0);
        assert!(!context_switches(me).unwrap().is_empty());
        assert!(process_group(me).is_some());
    }
}
