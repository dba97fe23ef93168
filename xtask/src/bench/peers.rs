//! tether beside what its users run today: s6, runit and supervisord, each supervising the
//! same N `/bin/sleep 3600` services without log services, at N = 100 and 1 000, with a raw
//! spawn loop of this process as the baseline of the same run.
//!
//! For each: bring-up (the supervisor's start until N sleeps run; the median of three, the
//! peers taking turns), the median restart after `kill -9` of a service (until its
//! replacement runs), memory per service (the PSS of the supervisor's own processes over
//! N) and stop (until no sleep is left). Each is started
//! the way its documentation runs it, in a process group of its own that the bench kills
//! whatever happens:
//!
//! - s6: `s6-svscan DIR`, one service dir with an executable `run` per service
//!   (`exec /bin/sleep 3600`); stopped with `s6-svscanctl -t DIR` (its supervisors take
//!   their services down and exit).
//! - runit: `runsvdir DIR`, the same service dirs; stopped with SIGHUP to `runsvdir` (it
//!   sends TERM to every `runsv`, which stops its service and exits).
//! - supervisord: one config with a `[program:x]` per service (`autorestart=true`,
//!   `startsecs=0`, no logs), `supervisord -n -c FILE`; stopped with SIGTERM.
//! - tether: `tether agent` with one config file of N services; stopped with `tether leave`.
//!
//! At N = 10 000, s6 alone runs beside tether (bring-up and stop; see [`LARGE`]).
//!
//! Debian's `s6`, `runit` and `supervisor` are installed when missing (as root); a peer
//! that is still missing gets a row saying so.

use std::collections::BTreeSet;
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use super::lab::{Lab, raw_bring_up};
use super::report::{Met, Row, median, ms, ratio, secs};
use super::sys;

const SIZES: [usize; 2] = [100, 1_000];
/// Bring-ups per peer and size, alternating between the peers; the median is reported, so
/// that one slow moment of a shared machine does not decide the comparison.
const BRING_UPS: usize = 3;
/// `kill -9`s per peer and size, each of a different service.
const KILLS: usize = 20;
const LIMIT: Duration = Duration::from_secs(120);

/// The figures of one supervisor at one size.
struct Figures {
    bring_up: Duration,
    restart: Duration,
    pss_per_service_kib: f64,
    stop: Duration,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Peer {
    S6,
    Runit,
    Supervisord,
    Tether,
}

impl Peer {
    const ALL: [Peer; 4] = [Peer::S6, Peer::Runit, Peer::Supervisord, Peer::Tether];

    fn name(self) -> &'static str {
        match self {
            Self::S6 => "s6",
            Self::Runit => "runit",
            Self::Supervisord => "supervisord",
            Self::Tether => "tether",
        }
    }

    fn program(self) -> &'static str {
        match self {
            Self::S6 => "s6-svscan",
            Self::Runit => "runsvdir",
            Self::Supervisord => "supervisord",
            Self::Tether => "tether",
        }
    }
}

/// Runs the section, appending its rows.
pub(crate) fn run(lab: &Lab, rows: &mut Vec<Row>) -> Result<(), String> {
    install_missing();
    for count in SIZES {
        let raw = raw_bring_up(lab, &format!("peer-raw-{count}"), count)?;
        let installed = |peer: Peer| peer == Peer::Tether || which(peer.program()).is_some();
        // The first bring-ups of every peer, each stopped at once; the last one goes on to
        // the other figures.
        let mut bring_ups: Vec<Vec<Duration>> = vec![Vec::new(); Peer::ALL.len()];
        for round in 1..BRING_UPS {
            for (index, peer) in Peer::ALL.into_iter().enumerate().filter(|(_, peer)| installed(*peer)) {
                match bring_up_and_stop(lab, peer, count, round) {
                    Ok(took) => bring_ups[index].push(took),
                    Err(err) => eprintln!("xtask: bench: {} at {count}, bring-up {round}: {err}", peer.name()),
                }
            }
        }
        let mut figures: Vec<(Peer, Result<Figures, String>)> = Vec::new();
        for (index, peer) in Peer::ALL.into_iter().enumerate() {
            let result = if installed(peer) {
                measure(lab, peer, count, 0).map(|mut figures| {
                    bring_ups[index].push(figures.bring_up);
                    figures.bring_up = median(&bring_ups[index]);
                    figures
                })
            } else {
                Err(format!("{} is not installed", peer.program()))
            };
            if let Err(err) = &result {
                eprintln!("xtask: bench: {} at {count}: {err}", peer.name());
            }
            figures.push((peer, result));
        }
        report(rows, count, raw, &figures);
    }
    large(lab, rows);
    Ok(())
}

/// At 10 000, s6 alone beside tether, bring-up and stop only. Finding s6's sleeps below
/// 10 000 supervisors costs more per look than a spawn, so s6 runs in a cgroup of its own
/// and its bring-up ends when the cgroup holds all its processes (the scanner, a
/// supervisor and a child per service): a moment before its last children have exec'd
/// their sleeps, which favours s6. tether's ends when its API lists every proxy running.
const LARGE: usize = 10_000;

fn large(lab: &Lab, rows: &mut Vec<Row>) {
    let figure = |who: &str, what: &str| format!("peers, N = {LARGE}: {who} {what}");
    let s6 = match which("s6-svscan") {
        None => Err("s6-svscan is not installed".to_owned()),
        Some(program) => s6_large(lab, &program),
    };
    let tether = tether_large(lab);
    let s6_bring_up = match s6 {
        Ok((bring_up, stop)) => {
            rows.push(Row::new(
                &figure("s6", "bring-up until its cgroup holds every service's process"),
                "—".into(),
                secs(bring_up),
                "—".into(),
                "—",
                Met::Info,
            ));
            rows.push(Row::new(&figure("s6", "stop all"), "—".into(), secs(stop), "—".into(), "—", Met::Info));
            Some(bring_up)
        }
        Err(err) => {
            eprintln!("xtask: bench: s6 at {LARGE}: {err}");
            rows.push(Row::failed(&figure("s6", "bring-up"), &err));
            None
        }
    };
    match tether {
        Ok((bring_up, stop)) => {
            let ahead = s6_bring_up.map_or(Met::Info, |s6| super::report::met(bring_up < s6));
            rows.push(Row::new(
                &figure("tether", "bring-up until the API lists every proxy running"),
                s6_bring_up.map_or_else(|| "—".to_owned(), |s6| format!("s6: {}", secs(s6))),
                secs(bring_up),
                s6_bring_up.map_or_else(|| "—".to_owned(), |s6| ratio(bring_up.as_secs_f64(), s6.as_secs_f64())),
                "ahead of s6",
                ahead,
            ));
            rows.push(Row::new(&figure("tether", "stop all"), "—".into(), secs(stop), "—".into(), "—", Met::Info));
        }
        Err(err) => {
            eprintln!("xtask: bench: tether at {LARGE}: {err}");
            rows.push(Row::failed(&figure("tether", "bring-up"), &err));
        }
    }
}

/// s6 with `LARGE` services in a cgroup of its own: (bring-up, stop).
fn s6_large(lab: &Lab, program: &Path) -> Result<(Duration, Duration), String> {
    let dir = lab.subdir(&format!("peer-s6-{LARGE}"))?;
    let scan = dir.join("scan");
    write_service_dirs(&scan, LARGE)?;
    let cgroup = PeerCgroup::new("s6")?;
    let procs = cgroup.dir.join("cgroup.procs");
    let log = fs::File::create(dir.join("supervisor.log")).map_err(|err| err.to_string())?;
    let start = Instant::now();
    // The shell enters the cgroup, then becomes s6-svscan: everything s6 starts is born there.
    let child = Command::new("/bin/sh")
        .args(["-c", "echo $$ > \"$1\" && exec \"$2\" -c \"$3\" \"$4\"", "sh"])
        .arg(&procs)
        .arg(program)
        .arg((LARGE * 2).to_string())
        .arg(&scan)
        .current_dir(&dir)
        .stdin(Stdio::null())
        .stdout(log.try_clone().map_err(|err| err.to_string())?)
        .stderr(log)
        .process_group(0)
        .spawn()
        .map_err(|err| format!("cannot start s6-svscan: {err}"))?;
    let running = Running { root: child.id(), child };
    let all = 2 * LARGE + 1;
    // A look reads 20 000 pids: every 10 ms, so that looking costs s6 little.
    let look = Duration::from_millis(10);
    wait_every(&format!("{all} processes in s6's cgroup"), look, || (cgroup.count() >= all).then_some(()))?;
    let bring_up = start.elapsed();
    // That the services run sleep, not how soon: a scan of 20 000 processes is slow.
    wait_every(&format!("{LARGE} sleeps"), Duration::from_millis(500), || {
        (sleeps_below(running.root).len() >= LARGE).then_some(())
    })?;
    let stopping = Instant::now();
    let status = Command::new(which("s6-svscanctl").ok_or("s6-svscanctl is not installed")?)
        .arg("-t")
        .arg(&scan)
        .status()
        .map_err(|err| err.to_string())?;
    if !status.success() {
        return Err(format!("s6-svscanctl -t: {status}"));
    }
    wait_every("s6's cgroup empty", look, || (cgroup.count() == 0).then_some(()))?;
    let stop = stopping.elapsed();
    drop(running);
    Ok((bring_up, stop))
}

/// tether with `LARGE` proxies: (bring-up, stop).
fn tether_large(lab: &Lab) -> Result<(Duration, Duration), String> {
    let dir = lab.subdir(&format!("peer-tether-{LARGE}"))?;
    write_tether_config(&dir, LARGE)?;
    let start = Instant::now();
    let mut agent = lab.agent(&format!("peer-{LARGE}"), &dir, &dir.join("data"), &[])?;
    let (_, seen) = agent.wait_running(LARGE, LIMIT)?;
    let bring_up = seen - start;
    let root = agent.pid();
    let stopping = Instant::now();
    agent.leave(LIMIT)?;
    wait_for("every sleep gone", || children_of(root).is_empty().then_some(()))?;
    Ok((bring_up, stopping.elapsed()))
}

/// A cgroup of the bench's own for a peer, below the bench's cgroup in the cgroup2
/// hierarchy; whatever is left in it is killed, and it is removed, when dropped.
struct PeerCgroup {
    dir: PathBuf,
}

impl PeerCgroup {
    fn new(name: &str) -> Result<Self, String> {
        let mountinfo = fs::read_to_string("/proc/self/mountinfo").map_err(|err| err.to_string())?;
        // Field 5 is the mount point; the file system type follows " - ".
        let mount = mountinfo
            .lines()
            .find(|line| line.split(" - ").nth(1).is_some_and(|after| after.starts_with("cgroup2 ")))
            .and_then(|line| line.split_whitespace().nth(4))
            .ok_or("no cgroup2 file system is mounted")?;
        let own = fs::read_to_string("/proc/self/cgroup").map_err(|err| err.to_string())?;
        let own = own.lines().find_map(|line| line.strip_prefix("0::")).ok_or("not in a cgroup2 hierarchy")?;
        let dir = Path::new(mount)
            .join(own.trim_start_matches('/'))
            .join(format!("tether-bench-{name}-{}", std::process::id()));
        fs::create_dir(&dir).map_err(|err| format!("{}: {err}", dir.display()))?;
        Ok(Self { dir })
    }

    /// The processes in it.
    fn count(&self) -> usize {
        fs::read_to_string(self.dir.join("cgroup.procs")).map_or(0, |procs| procs.lines().count())
    }
}

impl Drop for PeerCgroup {
    fn drop(&mut self) {
        super::lab::kill_cgroup(&self.dir);
    }
}

fn report(rows: &mut Vec<Row>, count: usize, raw: Duration, figures: &[(Peer, Result<Figures, String>)]) {
    let s6_bring_up = figures.iter().find_map(|(peer, f)| (*peer == Peer::S6).then_some(f.as_ref().ok()?.bring_up));
    for (peer, result) in figures {
        let figure = |what: &str| format!("peers, N = {count}: {} {what}", peer.name());
        let figures = match result {
            Ok(figures) => figures,
            Err(err) => {
                rows.push(Row::failed(&figure("figures"), err));
                continue;
            }
        };
        let ahead = (*peer == Peer::Tether).then(|| s6_bring_up.is_some_and(|s6| figures.bring_up < s6));
        rows.push(Row::new(
            &figure(&format!("bring-up until all run (median of {BRING_UPS})")),
            format!("raw spawn loop: {}", secs(raw)),
            secs(figures.bring_up),
            ratio(figures.bring_up.as_secs_f64(), raw.as_secs_f64()),
            if *peer == Peer::Tether { "ahead of s6" } else { "—" },
            ahead.map_or(Met::Info, super::report::met),
        ));
        rows.push(Row::new(
            &figure("restart after `kill -9`, median"),
            "—".into(),
            ms(figures.restart),
            "—".into(),
            "—",
            Met::Info,
        ));
        rows.push(Row::new(
            &figure("memory per service (PSS of the supervisor's processes)"),
            "—".into(),
            format!("{:.1} KiB", figures.pss_per_service_kib),
            "—".into(),
            "—",
            Met::Info,
        ));
        rows.push(Row::new(&figure("stop all"), "—".into(), secs(figures.stop), "—".into(), "—", Met::Info));
    }
}

/// Installs Debian's packages of the peers that are missing, as root; failures are left to
/// the rows of the missing peers.
pub(crate) fn install_missing() {
    let missing: Vec<&str> = [("s6-svscan", "s6"), ("runsvdir", "runit"), ("supervisord", "supervisor")]
        .into_iter()
        .filter(|(program, _)| which(program).is_none())
        .map(|(_, package)| package)
        .collect();
    if missing.is_empty() || !sys::is_root() {
        return;
    }
    eprintln!("xtask: bench: installing {}", missing.join(", "));
    // Only the packages: runit's recommends would replace the init system.
    let installed = Command::new("apt-get")
        .args(["install", "-y", "--no-install-recommends"])
        .args(&missing)
        .env("DEBIAN_FRONTEND", "noninteractive")
        .stdout(Stdio::null())
        .status();
    if !installed.is_ok_and(|status| status.success()) {
        let _ = Command::new("apt-get").args(["update"]).stdout(Stdio::null()).status();
        let _ = Command::new("apt-get")
            .args(["install", "-y", "--no-install-recommends"])
            .args(&missing)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .stdout(Stdio::null())
            .status();
    }
}

pub(crate) fn which(program: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .chain(["/usr/sbin", "/sbin"])
        .map(|dir| Path::new(dir).join(program))
        .find(|path| path.is_file())
}

/// A supervisor under test: its top process, in its own process group, killed with the
/// group and every sleep it left when dropped.
struct Running {
    child: Child,
    /// Where to find its services' sleeps: processes below this pid.
    root: u32,
}

impl Drop for Running {
    fn drop(&mut self) {
        let sleeps = sleeps_below(self.root);
        sys::signal_group(self.child.id(), sys::SIGKILL);
        for pid in sleeps {
            let _ = sys::signal(pid, sys::SIGKILL);
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A supervisor of `count` sleeps, just started: itself (or the agent) and its sleeps.
struct Started<'lab> {
    running: Option<Running>,
    agent: Option<super::lab::Agent<'lab>>,
    dir: PathBuf,
    root: u32,
    sleeps: Vec<u32>,
    bring_up: Duration,
}

/// Starts `peer` with `count` sleeps (round `round` of its bring-ups) and waits until all
/// run.
fn start<'lab>(lab: &'lab Lab, peer: Peer, count: usize, round: usize) -> Result<Started<'lab>, String> {
    let dir = lab.subdir(&format!("peer-{}-{count}-{round}", peer.name()))?;
    let start = Instant::now();
    let (running, agent) = match peer {
        Peer::Tether => {
            write_tether_config(&dir, count)?;
            let mut agent = lab.agent(&format!("peer-{count}-{round}"), &dir, &dir.join("data"), &[])?;
            agent.wait_running(count, LIMIT)?;
            (None, Some(agent))
        }
        _ => (Some(start_peer(peer, &dir, count)?), None),
    };
    let root = running.as_ref().map_or_else(|| agent.as_ref().map_or(0, super::lab::Agent::pid), |r| r.root);
    let sleeps = wait_for(&format!("{count} sleeps"), || {
        let sleeps = sleeps_below(root);
        (sleeps.len() >= count).then_some(sleeps)
    })?;
    Ok(Started { running, agent, dir, root, sleeps, bring_up: start.elapsed() })
}

/// Stops what [`start`] started, the way its documentation says, and waits until no sleep
/// is left; returns how long that took.
fn stop(peer: Peer, started: Started<'_>) -> Result<Duration, String> {
    let Started { mut running, agent, dir, root, .. } = started;
    let stopping = Instant::now();
    match (&mut running, agent) {
        (Some(running), _) => stop_peer(peer, &dir, running)?,
        (None, Some(mut agent)) => agent.leave(LIMIT)?,
        (None, None) => return Err("nothing ran".into()),
    }
    wait_for("every sleep gone", || sleeps_below(root).is_empty().then_some(()))?;
    Ok(stopping.elapsed())
}

fn bring_up_and_stop(lab: &Lab, peer: Peer, count: usize, round: usize) -> Result<Duration, String> {
    let started = start(lab, peer, count, round)?;
    let bring_up = started.bring_up;
    stop(peer, started)?;
    Ok(bring_up)
}

fn measure(lab: &Lab, peer: Peer, count: usize, round: usize) -> Result<Figures, String> {
    let started = start(lab, peer, count, round)?;
    let (root, bring_up) = (started.root, started.bring_up);
    let sleeps = started.sleeps.clone();
    thread::sleep(Duration::from_secs(1));

    let supervisors =
        descendants(root).into_iter().filter(|pid| !is_sleep(*pid)).chain([root]).collect::<BTreeSet<_>>();
    let pss: u64 = supervisors.iter().filter_map(|pid| pss_kib(*pid)).sum();
    #[allow(clippy::cast_precision_loss)]
    let pss_per_service_kib = pss as f64 / count as f64;

    let mut restarts = Vec::new();
    for victim in sleeps.iter().take(KILLS) {
        let parent = sys::parent(*victim).ok_or("a sleep vanished")?;
        // A supervisor of many services (supervisord, tether) has other sleeps as children:
        // the replacement is the one that was not there before.
        let before: BTreeSet<u32> = children_of(parent).into_iter().collect();
        let killed = Instant::now();
        sys::signal(*victim, sys::SIGKILL)?;
        wait_for("a restarted sleep", || {
            children_of(parent).into_iter().find(|pid| !before.contains(pid) && is_sleep(*pid)).map(drop)
        })?;
        restarts.push(killed.elapsed());
    }
    let restart = median(&restarts);
    let stop = stop(peer, started)?;
    Ok(Figures { bring_up, restart, pss_per_service_kib, stop })
}

fn start_peer(peer: Peer, dir: &Path, count: usize) -> Result<Running, String> {
    let program = which(peer.program()).ok_or_else(|| format!("{} is not installed", peer.program()))?;
    let mut command = Command::new(&program);
    match peer {
        Peer::S6 | Peer::Runit => {
            let scan = dir.join("scan");
            write_service_dirs(&scan, count)?;
            if peer == Peer::S6 {
                // Its default is 500 services; room for every one, as an operator would give.
                command.args(["-c", &(count * 2).to_string()]);
            }
            command.arg(&scan);
        }
        Peer::Supervisord => {
            let config = write_supervisord_config(dir, count)?;
            command.args(["-n", "-c"]).arg(config);
        }
        Peer::Tether => return Err("tether runs through the lab".into()),
    }
    let log = fs::File::create(dir.join("supervisor.log")).map_err(|err| err.to_string())?;
    let child = command
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(log.try_clone().map_err(|err| err.to_string())?)
        .stderr(log)
        .process_group(0)
        .spawn()
        .map_err(|err| format!("cannot start {}: {err}", program.display()))?;
    let root = child.id();
    Ok(Running { child, root })
}

fn stop_peer(peer: Peer, dir: &Path, running: &mut Running) -> Result<(), String> {
    match peer {
        Peer::S6 => {
            let status = Command::new(which("s6-svscanctl").ok_or("s6-svscanctl is not installed")?)
                .arg("-t")
                .arg(dir.join("scan"))
                .status()
                .map_err(|err| err.to_string())?;
            if !status.success() {
                return Err(format!("s6-svscanctl -t: {status}"));
            }
        }
        Peer::Runit => sys::signal(running.root, sys::SIGHUP)?,
        Peer::Supervisord => sys::signal(running.root, sys::SIGTERM)?,
        Peer::Tether => {}
    }
    Ok(())
}

fn write_service_dirs(scan: &Path, count: usize) -> Result<(), String> {
    for index in 0..count {
        let service = scan.join(format!("s{index:04}"));
        fs::create_dir_all(&service).map_err(|err| format!("{}: {err}", service.display()))?;
        let run = service.join("run");
        fs::write(&run, "#!/bin/sh\nexec /bin/sleep 3600\n").map_err(|err| format!("{}: {err}", run.display()))?;
        fs::set_permissions(&run, fs::Permissions::from_mode(0o755)).map_err(|err| err.to_string())?;
    }
    Ok(())
}

fn write_supervisord_config(dir: &Path, count: usize) -> Result<PathBuf, String> {
    let mut text = format!(
        "[supervisord]\nnodaemon=true\nlogfile=/dev/null\nlogfile_maxbytes=0\npidfile={}\n\n",
        dir.join("supervisord.pid").display()
    );
    for index in 0..count {
        text.push_str(&format!(
            "[program:s{index:04}]\ncommand=/bin/sleep 3600\nautorestart=true\nstartsecs=0\n\
             stdout_logfile=NONE\nstderr_logfile=NONE\n\n"
        ));
    }
    let path = dir.join("supervisord.conf");
    fs::write(&path, text).map_err(|err| format!("{}: {err}", path.display()))?;
    Ok(path)
}

fn write_tether_config(dir: &Path, count: usize) -> Result<(), String> {
    let mut text = String::new();
    for index in 0..count {
        text.push_str(&format!(
            "[[service]]\nname = \"s{index:04}\"\n\n[service.proxy]\ncommand = [\"/bin/sleep\", \"3600\"]\nkill_timeout = \"1s\"\n\n"
        ));
    }
    fs::write(dir.join("services.toml"), text).map_err(|err| err.to_string())
}

fn wait_for<T>(what: &str, probe: impl FnMut() -> Option<T>) -> Result<T, String> {
    wait_every(what, Duration::from_micros(500), probe)
}

/// [`wait_for`], looking every `interval`: for a look that costs much.
fn wait_every<T>(what: &str, interval: Duration, mut probe: impl FnMut() -> Option<T>) -> Result<T, String> {
    let deadline = Instant::now() + LIMIT;
    loop {
        if let Some(value) = probe() {
            return Ok(value);
        }
        if Instant::now() > deadline {
            return Err(format!("timed out after {LIMIT:?} waiting for {what}"));
        }
        thread::sleep(interval);
    }
}

/// The children of `pid`, from every one of its threads.
fn children_of(pid: u32) -> Vec<u32> {
    sys::children_of(pid)
}

/// Every process below `root` (children, grandchildren, …).
fn descendants(root: u32) -> Vec<u32> {
    let mut found = Vec::new();
    let mut next = vec![root];
    while let Some(pid) = next.pop() {
        for child in children_of(pid) {
            found.push(child);
            next.push(child);
        }
    }
    found
}

/// The live `sleep`s below `root`: the services' processes once they exec'd.
fn sleeps_below(root: u32) -> Vec<u32> {
    descendants(root).into_iter().filter(|pid| is_sleep(*pid)).collect()
}

fn is_sleep(pid: u32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|comm| comm.trim_end() == "sleep") && sys::alive(pid)
}

/// The proportional set size of `pid`, in KiB.
fn pss_kib(pid: u32) -> Option<u64> {
    let text = fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?;
    let line = text.lines().find(|line| line.starts_with("Pss:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}
