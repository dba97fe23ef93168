//! Bring-up seen from outside, the same way for every peer: from the moment a supervisor is
//! started until every one of its N children has exec'd, as a user's monitoring sees it.
//!
//! Each bring-up gives its children a `sleep` argument of its own (`3600.<tag>`, which GNU
//! `sleep` reads as a number of seconds), and a thread of this process scans `/proc` every
//! 2 ms for processes whose command line is `/bin/sleep 3600.<tag>`: a child counts once it
//! has exec'd, not when its supervisor says it runs. The peers are a raw spawn loop of this
//! process, s6 (`s6-svscan` on a scan dir of N services, installed when missing as the
//! `peers` section does, a row saying so when it is still missing) and `tether agent`; they
//! take turns round by round, and the figures are medians: three rounds at N = 1 000, one at
//! N = 10 000.
//!
//! The existing figure (agent start until the API lists every proxy `running`) counts
//! differently: it ends when the agent has recorded each start, which may come before or
//! after the scan sees the last exec.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use super::lab::{Flock, Lab};
use super::report::{Met, Row, median, met, ratio, secs};
use super::sys;

/// The sizes, each with its number of bring-ups per peer (the peers taking turns).
const SIZES: [(usize, usize); 2] = [(1_000, 3), (10_000, 1)];
/// How often the scanner looks at `/proc`.
const SCAN: Duration = Duration::from_millis(2);
const LIMIT: Duration = Duration::from_secs(120);

/// The pids of the processes that run `/bin/sleep <argument>`.
fn sleeps_with(argument: &str) -> Vec<u32> {
    let wanted = format!("/bin/sleep\0{argument}\0");
    let Ok(entries) = fs::read_dir("/proc") else { return Vec::new() };
    entries
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|cmdline| cmdline == wanted.as_bytes()))
        .collect()
}

/// A scanner of `/proc` every [`SCAN`], from now until `count` sleeps of `argument` have
/// exec'd: how long after `start` it saw them.
struct Watch {
    seen: Option<thread::JoinHandle<Option<Instant>>>,
    stop: Arc<AtomicBool>,
}

impl Watch {
    fn start(argument: String, count: usize) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let stopping = Arc::clone(&stop);
        let seen = thread::spawn(move || {
            let deadline = Instant::now() + LIMIT;
            while !stopping.load(Ordering::SeqCst) && Instant::now() < deadline {
                if sleeps_with(&argument).len() >= count {
                    return Some(Instant::now());
                }
                thread::sleep(SCAN);
            }
            None
        });
        Self { seen: Some(seen), stop }
    }

    fn wait(mut self, start: Instant) -> Result<Duration, String> {
        match self.seen.take().map(thread::JoinHandle::join) {
            Some(Ok(Some(seen))) => Ok(seen - start),
            _ => Err(format!("not every child exec'd within {LIMIT:?}")),
        }
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// Kills every sleep of `argument` that is left.
fn kill_sleeps(argument: &str) {
    for pid in sleeps_with(argument) {
        let _ = sys::signal(pid, sys::SIGKILL);
    }
}

/// Waits until no sleep of `argument` is left.
fn wait_gone(argument: &str) -> Result<(), String> {
    let deadline = Instant::now() + LIMIT;
    while !sleeps_with(argument).is_empty() {
        if Instant::now() > deadline {
            return Err(format!("sleeps of {argument} still run after {LIMIT:?}"));
        }
        thread::sleep(SCAN);
    }
    Ok(())
}

fn raw(lab: &Lab, size: usize, argument: &str) -> Result<Duration, String> {
    let logs = lab.subdir(&format!("bring-up-raw-{argument}"))?;
    let watch = Watch::start(argument.to_owned(), size);
    let start = Instant::now();
    let mut flock = Flock::default();
    for index in 0..size {
        flock.spawn(&["/bin/sleep", argument], &logs, &format!("s{index:05}"))?;
    }
    let took = watch.wait(start);
    flock.kill_all();
    took
}

/// s6-svscan in a process group of its own, stopped with `s6-svscanctl -t`, and killed with
/// its sleeps when dropped.
struct S6 {
    child: Child,
    argument: String,
}

impl Drop for S6 {
    fn drop(&mut self) {
        sys::signal_group(self.child.id(), sys::SIGKILL);
        let _ = self.child.kill();
        let _ = self.child.wait();
        kill_sleeps(&self.argument);
    }
}

fn s6(lab: &Lab, program: &Path, size: usize, argument: &str) -> Result<Duration, String> {
    let dir = lab.subdir(&format!("bring-up-s6-{argument}"))?;
    let scan = dir.join("scan");
    for index in 0..size {
        let service = scan.join(format!("s{index:05}"));
        fs::create_dir_all(&service).map_err(|err| format!("{}: {err}", service.display()))?;
        let run = service.join("run");
        fs::write(&run, format!("#!/bin/sh\nexec /bin/sleep {argument}\n")).map_err(|err| err.to_string())?;
        fs::set_permissions(&run, fs::Permissions::from_mode(0o755)).map_err(|err| err.to_string())?;
    }
    let log = fs::File::create(dir.join("supervisor.log")).map_err(|err| err.to_string())?;
    let watch = Watch::start(argument.to_owned(), size);
    let start = Instant::now();
    let child = Command::new(program)
        // Its default is 500 services; room for every one, as an operator would give.
        .args(["-c", &(size * 2).to_string()])
        .arg(&scan)
        .current_dir(&dir)
        .stdin(Stdio::null())
        .stdout(log.try_clone().map_err(|err| err.to_string())?)
        .stderr(log)
        .process_group(0)
        .spawn()
        .map_err(|err| format!("cannot start {}: {err}", program.display()))?;
    let s6 = S6 { child, argument: argument.to_owned() };
    let took = watch.wait(start)?;
    let control = program.with_file_name("s6-svscanctl");
    let _ = Command::new(control).arg("-t").arg(&scan).status();
    wait_gone(argument)?;
    drop(s6);
    Ok(took)
}

/// tether: (until every child exec'd, until the API lists every proxy running).
fn tether(lab: &Lab, size: usize, argument: &str) -> Result<(Duration, Duration), String> {
    let dir = lab.subdir(&format!("bring-up-tether-{argument}"))?;
    let mut text = String::new();
    for index in 0..size {
        text.push_str(&format!(
            "[[service]]\nname = \"s{index:05}\"\n\n[service.proxy]\ncommand = [\"/bin/sleep\", \"{argument}\"]\n\
             kill_timeout = \"1s\"\n\n"
        ));
    }
    fs::write(dir.join("services.toml"), text).map_err(|err| err.to_string())?;
    let watch = Watch::start(argument.to_owned(), size);
    let start = Instant::now();
    let mut agent = lab.agent(&format!("bring-up-{argument}"), &dir, &dir.join("data"), &[])?;
    let (_, listed) = agent.wait_running(size, LIMIT)?;
    let exec = watch.wait(start);
    let left = agent.leave(LIMIT);
    kill_sleeps(argument);
    left?;
    Ok((exec?, listed - start))
}

/// Runs the section, appending its rows.
pub(crate) fn run(lab: &Lab, rows: &mut Vec<Row>) -> Result<(), String> {
    super::peers::install_missing();
    let s6_program = super::peers::which("s6-svscan");
    for (size, rounds) in SIZES {
        size_rows(lab, s6_program.as_deref(), size, rounds, rows)?;
    }
    Ok(())
}

/// The rows of one size: `rounds` bring-ups of each peer, taking turns.
fn size_rows(
    lab: &Lab,
    s6_program: Option<&Path>,
    size: usize,
    rounds: usize,
    rows: &mut Vec<Row>,
) -> Result<(), String> {
    let (mut raws, mut s6s, mut execs, mut listed) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let tag = std::process::id();
    for round in 0..rounds {
        let argument = |peer: usize| format!("3600.{tag}{size}{round}{peer}");
        raws.push(raw(lab, size, &argument(1))?);
        if let Some(program) = s6_program {
            s6s.push(s6(lab, program, size, &argument(2))?);
        }
        let (exec, api) = tether(lab, size, &argument(3))?;
        execs.push(exec);
        listed.push(api);
        eprintln!(
            "xtask: bench: bring-up of {size}, round {round}: raw {}, s6 {}, tether {} (API {})",
            secs(raws[round]),
            s6s.get(round).map_or_else(|| "—".to_owned(), |took| secs(*took)),
            secs(exec),
            secs(api)
        );
    }
    let (raw, exec, api) = (median(&raws), median(&execs), median(&listed));
    let of = if rounds == 1 { "one round".to_owned() } else { format!("median of {rounds}") };
    let figure = |who: &str| {
        format!("bring-up seen from outside: start until {size} children exec'd ({who}, /proc every 2 ms, {of})")
    };
    let baseline = format!("raw spawn loop: {}", secs(raw));
    let s6 = (!s6s.is_empty()).then(|| median(&s6s));
    match s6 {
        Some(s6) => rows.push(Row::new(
            &figure("s6"),
            baseline.clone(),
            secs(s6),
            ratio(s6.as_secs_f64(), raw.as_secs_f64()),
            "—",
            Met::Info,
        )),
        None => rows.push(Row::failed(&figure("s6"), "s6-svscan is not installed")),
    }
    rows.push(Row::new(
        &figure("tether"),
        baseline,
        secs(exec),
        ratio(exec.as_secs_f64(), raw.as_secs_f64()),
        "≤ 1.5, ahead of s6",
        met(exec.as_secs_f64() <= 1.5 * raw.as_secs_f64() && s6.is_none_or(|s6| exec < s6)),
    ));
    rows.push(Row::new(
        &format!("bring-up as the agent counts it: start until the API lists {size} running (same rounds)"),
        format!("children exec'd: {}", secs(exec)),
        secs(api),
        ratio(api.as_secs_f64(), exec.as_secs_f64()),
        "—",
        Met::Info,
    ));
    Ok(())
}
