//! Benchmark of the supervisor against raw `posix_spawn`, measured in the same run.
//!
//! It owns nothing but its temporary data dir and the processes it starts, all of which
//! it stops (or kills and reaps) before it prints. It never uses a benchmark framework:
//! plain `Instant`s, and a small table on stdout.
//!
//! Figures: spawning N proxies until all are confirmed running (vs. `posix_spawn` of the
//! same N with the same program, environment, process group and log files), the latency
//! from a proxy's exit to its replacement running (median and p99), and the agent's
//! memory per supervised process (RSS delta / N).

#![allow(clippy::print_stdout)] // printing the table is the point
#![deny(unsafe_code)]

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use tether_proxy_daemon::{ProcessHandle, ProcessName, ProcessSpec, ProcessState, RestartPolicy, Supervisor};
use tether_state::persist::DataDir;

const PROCESSES: usize = 1_000;
const KILLS: usize = 300;

#[path = "../tests/it/fixture.rs"]
mod fixture;

fn env_for(name: &str) -> Vec<(String, String)> {
    vec![
        ("PATH".into(), "/usr/bin:/bin".into()),
        ("HOME".into(), "/nonexistent".into()),
        ("TETHER_PROXY_ID".into(), name.into()),
        ("TETHER_SERVICE_ID".into(), name.trim_end_matches("-proxy").into()),
        ("TETHER_PROXY_TOKEN".into(), "0123456789abcdef0123456789abcdef".into()),
    ]
}

fn spec(data: &DataDir, index: usize) -> ProcessSpec {
    let name = format!("bench{index}-proxy");
    let mut spec = ProcessSpec::new(ProcessName::new(name.as_str()).unwrap(), fixture::test_proxy(), data);
    spec.args = vec!["--sleep".into()];
    spec.env = env_for(&name).into_iter().map(|(k, v)| (k.into(), v.into())).collect();
    spec.restart = RestartPolicy { free_attempts: u32::MAX, ..RestartPolicy::default() };
    spec
}

fn c_string(bytes: &[u8]) -> CString {
    CString::new(bytes).unwrap()
}

/// Spawns `PROCESSES` processes with `posix_spawn`, the way a minimal supervisor would:
/// own process group, stdin from /dev/null, stdout/stderr appended to log files.
/// Returns the time until all exist, then kills and reaps them.
fn raw_posix_spawn(data_dir: &Path) -> Duration {
    let logs = data_dir.join("raw-logs");
    std::fs::create_dir_all(&logs).unwrap();
    let program = c_string(fixture::test_proxy().as_os_str().as_bytes());
    let argv_owned = [program.clone(), c_string(b"--sleep")];
    let mut argv: Vec<*mut libc::c_char> = argv_owned.iter().map(|arg| arg.as_ptr().cast_mut()).collect();
    argv.push(std::ptr::null_mut());
    let dev_null = c_string(b"/dev/null");

    let start = Instant::now();
    let mut pids = Vec::with_capacity(PROCESSES);
    for index in 0..PROCESSES {
        let name = format!("bench{index}-proxy");
        let envp_owned: Vec<CString> =
            env_for(&name).iter().map(|(k, v)| c_string(format!("{k}={v}").as_bytes())).collect();
        let mut envp: Vec<*mut libc::c_char> = envp_owned.iter().map(|var| var.as_ptr().cast_mut()).collect();
        envp.push(std::ptr::null_mut());
        let stdout = c_string(logs.join(format!("{name}-stdout.log")).as_os_str().as_bytes());
        let stderr = c_string(logs.join(format!("{name}-stderr.log")).as_os_str().as_bytes());
        let mut pid: libc::pid_t = 0;
        #[allow(unsafe_code)]
        // SAFETY: the attribute and file-action objects are initialised before use and
        // destroyed after; every pointer passed (paths, argv, envp) points to a live,
        // NUL-terminated string or a NULL-terminated array owned by this frame.
        let rc = unsafe {
            let mut actions: libc::posix_spawn_file_actions_t = std::mem::zeroed();
            let mut attr: libc::posix_spawnattr_t = std::mem::zeroed();
            libc::posix_spawn_file_actions_init(&mut actions);
            libc::posix_spawnattr_init(&mut attr);
            libc::posix_spawnattr_setflags(&mut attr, libc::POSIX_SPAWN_SETPGROUP as libc::c_short);
            libc::posix_spawnattr_setpgroup(&mut attr, 0);
            let append = libc::O_WRONLY | libc::O_APPEND | libc::O_CREAT | libc::O_CLOEXEC;
            libc::posix_spawn_file_actions_addopen(&mut actions, 0, dev_null.as_ptr(), libc::O_RDONLY, 0);
            libc::posix_spawn_file_actions_addopen(&mut actions, 1, stdout.as_ptr(), append & !libc::O_CLOEXEC, 0o600);
            libc::posix_spawn_file_actions_addopen(&mut actions, 2, stderr.as_ptr(), append & !libc::O_CLOEXEC, 0o600);
            let rc = libc::posix_spawn(&mut pid, program.as_ptr(), &actions, &attr, argv.as_ptr(), envp.as_ptr());
            libc::posix_spawn_file_actions_destroy(&mut actions);
            libc::posix_spawnattr_destroy(&mut attr);
            rc
        };
        assert_eq!(rc, 0, "posix_spawn failed");
        pids.push(pid);
    }
    let elapsed = start.elapsed();
    for &pid in &pids {
        let _ = nix::sys::signal::killpg(nix::unistd::Pid::from_raw(pid), Signal::SIGKILL);
    }
    for &pid in &pids {
        // Our own children, by pid: never waitpid(-1).
        let _ = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(pid), None);
    }
    elapsed
}

fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|line| line.starts_with("VmRSS:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

async fn stop_all(handles: Vec<ProcessHandle>) {
    let mut stops = tokio::task::JoinSet::new();
    for handle in handles {
        stops.spawn(async move { handle.stop().await });
    }
    while let Some(stopped) = stops.join_next().await {
        assert_eq!(stopped.unwrap().state, ProcessState::Stopped);
    }
}

/// Spawns `PROCESSES` processes through the supervisor until all are confirmed running.
/// Returns the time taken, the RSS growth, and the handles.
async fn supervised_spawn(supervisor: &Supervisor, data: &DataDir) -> (Duration, u64, Vec<ProcessHandle>) {
    let rss_before = rss_kib();
    let start = Instant::now();
    let mut handles = Vec::with_capacity(PROCESSES);
    for index in 0..PROCESSES {
        handles.push(supervisor.spawn(spec(data, index)).await.unwrap());
    }
    assert!(handles.iter().all(|handle| handle.status().state == ProcessState::Running));
    let elapsed = start.elapsed();
    // Let the pid-file writer and the log watcher catch up before reading the RSS.
    let last = spec(data, PROCESSES - 1).pid_file.expect("a pid file");
    let deadline = Instant::now() + Duration::from_secs(30);
    while !last.exists() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let rss_after = rss_kib();
    (elapsed, rss_after.saturating_sub(rss_before), handles)
}

async fn exit_to_replacement(supervisor: &Supervisor, data: &DataDir) -> Vec<Duration> {
    let handle = supervisor.spawn(spec(data, PROCESSES + 1)).await.unwrap();
    let mut status = handle.subscribe();
    let mut latencies = Vec::with_capacity(KILLS);
    for _ in 0..KILLS {
        let old = status.borrow().figures.pid.unwrap();
        let start = Instant::now();
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(old as i32), Signal::SIGKILL).unwrap();
        let wait = status.wait_for(|s| s.state == ProcessState::Running && s.figures.pid.is_some_and(|pid| pid != old));
        tokio::time::timeout(Duration::from_secs(10), wait).await.expect("replacement in time").unwrap();
        latencies.push(start.elapsed());
    }
    handle.stop().await;
    latencies.sort_unstable();
    latencies
}

fn ms(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1e3
}

fn main() {
    // Two supervisor fds per process (ours and tokio's pidfd): raise the soft limit.
    if let Ok((_, hard)) = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE) {
        let _ = nix::sys::resource::setrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE, hard, hard);
    }
    // The data dir's file system matters (every start fsyncs a pid file): by default the
    // system's temporary directory, or TETHER_BENCH_DIR.
    let data_dir = match std::env::var_os("TETHER_BENCH_DIR") {
        Some(parent) => tempfile::tempdir_in(parent).unwrap(),
        None => tempfile::tempdir().unwrap(),
    };
    let data = DataDir::open(data_dir.path()).unwrap();
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    runtime.block_on(async {
        let supervisor = Supervisor::new().unwrap();
        // Warm-up: page in the program, the allocator and the runtime.
        let mut warm = Vec::new();
        for index in 0..20 {
            warm.push(supervisor.spawn(spec(&data, PROCESSES + 10 + index)).await.unwrap());
        }
        stop_all(warm).await;

        let mut raw = Vec::new();
        let mut supervised = Vec::new();
        let mut memory = Vec::new();
        for round in 0..3 {
            // Fresh directories every round for both sides: every log file is created anew.
            let round_dir = data_dir.path().join(format!("round{round}"));
            raw.push(raw_posix_spawn(&round_dir));
            let round_data = DataDir::open(&round_dir).unwrap();
            let (elapsed, rss_kib, handles) = supervised_spawn(&supervisor, &round_data).await;
            supervised.push(elapsed);
            memory.push(rss_kib);
            stop_all(handles).await;
        }
        let latencies = exit_to_replacement(&supervisor, &data).await;

        let best_raw = *raw.iter().min().unwrap();
        let best_supervised = *supervised.iter().min().unwrap();
        let median = latencies[latencies.len() / 2];
        let p99 = latencies[latencies.len() * 99 / 100];
        let per_process_kib = memory[0] as f64 / PROCESSES as f64;
        println!("tether-proxy-daemon bench ({PROCESSES} processes, {KILLS} kills, best of {} rounds)", raw.len());
        println!("{:<44} {:>12} {:>12} {:>8}", "measure", "figure", "target", "ratio");
        println!("{:<44} {:>9.1} ms {:>12} {:>8}", "raw posix_spawn x1000", ms(best_raw), "baseline", "1.00");
        println!(
            "{:<44} {:>9.1} ms {:>12} {:>8.2}",
            "Supervisor::spawn x1000 (all running)",
            ms(best_supervised),
            "<= 1.3x",
            best_supervised.as_secs_f64() / best_raw.as_secs_f64()
        );
        println!("{:<44} {:>9.2} ms {:>12} {:>8}", "exit -> replacement running, median", ms(median), "< 5 ms", "");
        println!("{:<44} {:>9.2} ms {:>12} {:>8}", "exit -> replacement running, p99", ms(p99), "", "");
        println!(
            "{:<44} {:>9.1} KiB {:>11} {:>8}",
            "agent RSS per supervised process", per_process_kib, "<= 16 KiB", ""
        );
        println!("rounds (ms): raw {:?}", raw.iter().map(|d| ms(*d).round()).collect::<Vec<_>>());
        println!("rounds (ms): supervised {:?}", supervised.iter().map(|d| ms(*d).round()).collect::<Vec<_>>());
        println!("rss delta per round (KiB): {memory:?}");
    });
}
