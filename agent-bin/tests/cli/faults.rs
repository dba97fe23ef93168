//! Fault tests (issue 7): things broken on purpose. A storm of registrations with the agent
//! SIGKILLed in the middle, a full data dir file system, hostile proxies and a hostile config
//! dir. Each is bounded by the deadlines of `support`, and cleans up through its `Agent` guard.

use std::collections::BTreeMap;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use assert_cmd::prelude::*;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

use crate::support::*;

/// `--allow-root` when the tests run as root, so that proxies without `user` may run.
fn root_flags() -> Vec<&'static str> {
    if is_root() { vec!["--allow-root"] } else { vec![] }
}

fn sigkill(pid: i64) {
    kill(Pid::from_raw(i32::try_from(pid).unwrap()), Signal::SIGKILL).unwrap();
}

/// A small deterministic generator (SplitMix64), so that a failed storm replays from its seed.
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: usize) -> usize {
        usize::try_from(self.next() % n as u64).unwrap()
    }
}

/// `TETHER_FAULT_SEED` when set (to replay a failure), else the clock.
fn seed() -> u64 {
    std::env::var("TETHER_FAULT_SEED").ok().and_then(|seed| seed.parse().ok()).unwrap_or_else(|| {
        let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
        now.as_secs() ^ u64::from(now.subsec_nanos()).rotate_left(32)
    })
}

// ---------------------------------------------------------------------------------------
// A storm of register/deregister operations with the agent SIGKILLed at a random moment.

const STORM_OPERATIONS: usize = 1_000;
const STORM_SERVICES: usize = 24;

/// One operation of the storm. A registration's `variant` picks the proxy's command
/// (`/bin/sleep 360<variant>`), so that re-registrations also restart proxies.
#[derive(Debug, Clone)]
enum Operation {
    Register { id: String, variant: u8 },
    Deregister { id: String },
}

impl Operation {
    fn id(&self) -> &str {
        match self {
            Self::Register { id, .. } | Self::Deregister { id } => id,
        }
    }

    /// What the operation leaves behind: the service's variant, or nothing.
    fn outcome(&self) -> Option<u8> {
        match self {
            Self::Register { variant, .. } => Some(*variant),
            Self::Deregister { .. } => None,
        }
    }

    fn send(&self, socket: &Path) -> std::io::Result<Response> {
        match self {
            Self::Register { id, variant } => {
                let body = format!(
                    r#"{{"name": "{id}", "proxy": {{"command": ["/bin/sleep", "360{variant}"], "kill_timeout": "1s"}}}}"#
                );
                put(socket, "/v1/agent/service/register", Some(&body))
            }
            Self::Deregister { id } => put(socket, &format!("/v1/agent/service/deregister/{id}"), None),
        }
    }
}

/// What the client knows: the variant of every service whose registration was acknowledged
/// and not deregistered since.
type Wanted = BTreeMap<String, u8>;

/// Applies an acknowledged answer to `wanted`, checking it against what the client knows.
/// `retry` marks the repetition of an operation whose first attempt was cut off by the kill:
/// a deregistration may then find the service already gone.
#[track_caller]
fn apply(wanted: &mut Wanted, operation: &Operation, response: &Response, retry: bool) {
    match (operation, response.status) {
        (Operation::Register { id, variant }, 200) => {
            wanted.insert(id.clone(), *variant);
        }
        (Operation::Deregister { id }, 200) => {
            assert!(wanted.remove(id).is_some() || retry, "deregistered {id}, which the client never saw registered");
        }
        (Operation::Deregister { id }, 404) => {
            assert!(
                retry || !wanted.contains_key(id),
                "{id} was acknowledged as registered, and the agent no longer knows it: {}",
                response.body
            );
            wanted.remove(id);
        }
        (operation, status) => panic!("{operation:?}: unexpected answer {status}: {}", response.body),
    }
}

/// The registrations on disk: service id to file text.
fn registrations_on_disk(data: &Path) -> BTreeMap<String, String> {
    let mut found = BTreeMap::new();
    let Ok(entries) = std::fs::read_dir(data.join("registrations")) else { return found };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if let Some(id) = name.strip_suffix(".json").filter(|_| !name.starts_with('.')) {
            found.insert(id.to_owned(), std::fs::read_to_string(entry.path()).unwrap_or_default());
        }
    }
    found
}

/// Whether the agent and the processes on the machine agree with `wanted`: every wanted
/// proxy listed `running` with the pid of the one process that carries its id and runs its
/// variant; no other proxy listed, no other process. `maybe` is the one service whose last
/// operation was cut off by the kill: it may be in either of the two given states.
fn storm_converged(socket: &Path, wanted: &Wanted, maybe: Option<(&str, [Option<u8>; 2])>) -> Result<usize, String> {
    let response = get(socket, "/v1/agent/proxies").map_err(|err| format!("the agent does not answer: {err}"))?;
    let listed: Vec<serde_json::Value> = serde_json::from_str(&response.body).map_err(|err| err.to_string())?;
    let listed: BTreeMap<String, &serde_json::Value> =
        listed.iter().map(|p| (p["id"].as_str().unwrap_or("?").to_owned(), p)).collect();
    let processes = processes_by_proxy_id(socket);
    let mut wrong = Vec::new();
    let mut running = 0;
    for index in 0..STORM_SERVICES {
        let service = format!("storm-{index:02}");
        let proxy_id = format!("{service}-proxy");
        let allowed: Vec<Option<u8>> = match maybe {
            Some((id, states)) if id == service => states.to_vec(),
            _ => vec![wanted.get(&service).copied()],
        };
        let pids = processes.get(&proxy_id).cloned().unwrap_or_default();
        let status = listed.get(&proxy_id);
        let actual = match (status, pids.as_slice()) {
            (None, []) => None,
            (Some(status), [pid])
                if status["state"] == "running" && status["pid"].as_i64() == Some(i64::from(*pid)) =>
            {
                let args = cmdline(*pid);
                match args.as_slice() {
                    [sleep, arg] if sleep == "/bin/sleep" && arg.starts_with("360") => arg[3..].parse::<u8>().ok(),
                    _ => {
                        wrong.push(format!("{proxy_id}: process {pid} runs {args:?}"));
                        continue;
                    }
                }
            }
            (status, pids) => {
                let state = status.map(|s| format!("{} pid {}", s["state"], s["pid"]));
                wrong.push(format!("{proxy_id}: listed {state:?}, processes {pids:?}"));
                continue;
            }
        };
        if !allowed.contains(&actual) {
            wrong.push(format!("{proxy_id}: runs variant {actual:?}, wanted one of {allowed:?}"));
        }
        running += usize::from(actual.is_some());
    }
    let strangers: Vec<_> = processes.keys().filter(|id| !id.starts_with("storm-")).collect();
    if !strangers.is_empty() {
        wrong.push(format!("processes of unknown proxies: {strangers:?}"));
    }
    let unknown: Vec<_> = listed.keys().filter(|id| !id.starts_with("storm-")).collect();
    if !unknown.is_empty() {
        wrong.push(format!("unknown proxies listed: {unknown:?}"));
    }
    if wrong.is_empty() { Ok(running) } else { Err(wrong.join("; ")) }
}

#[test]
fn a_storm_of_registrations_survives_a_sigkill_of_the_agent_and_every_proxy_runs_once() {
    let started = Instant::now();
    let seed = seed();
    eprintln!("storm seed {seed}: rerun with TETHER_FAULT_SEED={seed} to replay the same operations and kill point");
    let mut random = SplitMix(seed);
    let operations: Vec<Operation> = (0..STORM_OPERATIONS)
        .map(|_| {
            let id = format!("storm-{:02}", random.below(STORM_SERVICES));
            // Registrations outnumber deregistrations, so that most services run at any time.
            if random.below(5) < 3 {
                Operation::Register { id, variant: u8::try_from(random.below(2)).unwrap() }
            } else {
                Operation::Deregister { id }
            }
        })
        .collect();
    // The kill lands while operation `kill_after` (0-based) is under way or just after it.
    let kill_after = 100 + random.below(STORM_OPERATIONS - 200);
    eprintln!("the agent is killed once {kill_after} operations have been acknowledged");

    let dirs = Dirs::new();
    let _sweep = SweepOnDrop(dirs.socket());
    let mut flags = root_flags();
    flags.push("--allow-api-commands");
    // The first agent's guard is kept until the end (dropping it would kill every proxy),
    // and dropped after the live agent's, which must die first.
    let mut retired = Vec::new();
    let mut agent = Agent::start(&dirs, &flags);
    let socket = dirs.socket();

    let acknowledged = Arc::new(AtomicUsize::new(0));
    let killer = std::thread::spawn({
        let acknowledged = acknowledged.clone();
        let agent_pid = agent.pid();
        move || {
            // Spins rather than sleeps: the kill must land wherever the agent happens to be.
            let start = Instant::now();
            while acknowledged.load(Ordering::SeqCst) < kill_after {
                if start.elapsed() > DEADLINE {
                    return false;
                }
                std::thread::yield_now();
            }
            kill(agent_pid, Signal::SIGKILL).is_ok()
        }
    });
    let mut killer = Some(killer);

    let mut wanted = Wanted::new();
    let mut retry = false;
    let mut index = 0;
    while index < operations.len() {
        let operation = &operations[index];
        match operation.send(&socket) {
            Ok(response) => {
                apply(&mut wanted, operation, &response, retry);
                retry = false;
                index += 1;
                acknowledged.fetch_add(1, Ordering::SeqCst);
            }
            Err(err) => {
                let killer =
                    killer.take().unwrap_or_else(|| panic!("operation {index} failed after the restart: {err}"));
                assert!(killer.join().unwrap(), "operation {index} failed, and not because of the kill: {err}");
                let status = agent.wait();
                assert_eq!(status.signal(), Some(Signal::SIGKILL as i32), "the agent died of the SIGKILL: {status:?}");
                eprintln!("killed during operation {index} ({operation:?}) after {:?}", started.elapsed());

                // Registrations are persisted before the API answers: every acknowledged
                // one is on disk, and every acknowledged deregistration is gone from it.
                // The operation in flight may have been applied or not.
                let before = wanted.get(operation.id()).copied();
                let after = operation.outcome();
                let mut on_disk = registrations_on_disk(&dirs.data);
                let in_flight = on_disk.remove(operation.id());
                let mut expected = wanted.clone();
                expected.remove(operation.id());
                assert_eq!(
                    on_disk.keys().collect::<Vec<_>>(),
                    expected.keys().collect::<Vec<_>>(),
                    "the registrations on disk are the acknowledged ones"
                );
                for (id, text) in &on_disk {
                    assert!(
                        text.contains(&format!("360{}", expected[id])),
                        "{id} on disk has its last variant: {text}"
                    );
                }
                let variant_on_disk = in_flight.map(|text| u8::from(text.contains("3601")));
                assert!(
                    [before, after].contains(&variant_on_disk),
                    "{}: on disk {variant_on_disk:?}, before {before:?}, after {after:?}",
                    operation.id()
                );

                let restarted = Agent::start(&dirs, &flags);
                retired.push(std::mem::replace(&mut agent, restarted));
                let running = wait_until("the restarted agent to converge on the acknowledged state", || {
                    storm_converged(&socket, &wanted, Some((operation.id(), [before, after])))
                });
                eprintln!("restarted agent converged with {running} proxies after {:?}", started.elapsed());
                // Repeat the operation that was cut off, so that its outcome is known.
                retry = true;
            }
        }
    }
    assert!(killer.is_none(), "the agent was killed during the storm");

    let running =
        wait_until("the agent to converge after the last operation", || storm_converged(&socket, &wanted, None));
    assert_eq!(running, wanted.len());
    assert_eq!(
        registrations_on_disk(&dirs.data).keys().collect::<Vec<_>>(),
        wanted.keys().collect::<Vec<_>>(),
        "the registrations on disk are the wanted ones"
    );
    // The pid files follow the processes (written and removed by a background writer,
    // shortly after each start and stop): one for every running proxy, naming its pid.
    wait_until("a pid file for every running proxy and no other", || {
        let listed: BTreeMap<String, Option<i64>> =
            agent.proxies().iter().map(|p| (p["id"].as_str().unwrap().to_owned(), p["pid"].as_i64())).collect();
        let pid_files: BTreeMap<String, Option<i64>> = std::fs::read_dir(dirs.data.join("pids"))
            .unwrap()
            .flatten()
            .filter_map(|entry| {
                let id = entry.file_name().to_str()?.strip_suffix(".pid")?.to_owned();
                let text = std::fs::read_to_string(entry.path()).unwrap_or_default();
                Some((id, text.trim().parse().ok()))
            })
            .collect();
        if listed == pid_files { Ok(()) } else { Err(format!("listed {listed:?}, pid files {pid_files:?}")) }
    });
    eprintln!("{} operations, {running} proxies running, in {:?}", operations.len(), started.elapsed());
}

// ---------------------------------------------------------------------------------------
// Hostile proxies.

/// Proxy `id`'s processes whose command line is `args`.
fn processes_running(socket: &Path, id: &str, args: &[&str]) -> Vec<i32> {
    let processes = processes_by_proxy_id(socket);
    let pids = processes.get(id).cloned().unwrap_or_default();
    pids.into_iter().filter(|pid| cmdline(*pid) == args).collect()
}

#[test]
fn a_daemonising_a_mute_and_an_always_exiting_proxy_do_not_harm_each_other() {
    let dirs = Dirs::new();
    let _sweep = SweepOnDrop(dirs.socket());
    let proxy = |name: &str, script: &str| {
        format!(
            "[[service]]\nname = \"{name}\"\n[service.proxy]\ncommand = [\"/bin/sh\", \"-c\", {script:?}]\nkill_timeout = \"1s\"\n"
        )
    };
    let config = [
        sleeper("steady"),
        // Double fork: the inner shell backgrounds a `setsid` child and exits, so the child is
        // reparented and leads a session (and group) of its own; the proxy itself stays.
        proxy("daemon", "sh -c 'setsid /bin/sleep 3601 &'; exec /bin/sleep 3600"),
        // Closes stdout and stderr, then keeps running.
        proxy("mute", "exec >&- 2>&-; exec /bin/sleep 3600"),
        // Exits at once, every time. Backoff 1s, 2s, 4s ... after one free restart.
        proxy("crash", "exit 7") + "[service.proxy.restart]\nfree_attempts = 1\nmax_delay = \"30s\"\n",
    ]
    .concat();
    dirs.write_config("a.toml", &config);
    // Process groups only: what a proxy's restart does without a cgroup (`cgroups.rs` shows
    // the same escaped child killed with one).
    let mut flags = root_flags();
    flags.push("--no-cgroups");
    let mut agent = Agent::start(&dirs, &flags);
    let socket = dirs.socket();
    let steady = pid_of(&agent.wait_state("steady-proxy", "running"));
    let daemon = pid_of(&agent.wait_state("daemon-proxy", "running"));
    let mute = pid_of(&agent.wait_state("mute-proxy", "running"));

    // The escaped child carries the proxy's environment, but not its process group.
    let escaped = wait_for("the daemonised child", || {
        processes_running(&socket, "daemon-proxy", &["/bin/sleep", "3601"]).first().copied()
    });
    let (escaped_pgid, escaped_sid) = pgid_and_sid(escaped).unwrap();
    assert_eq!((escaped_pgid, escaped_sid), (escaped, escaped), "setsid made it lead its own session and group");
    assert_eq!(pgid_and_sid(i32::try_from(daemon).unwrap()).unwrap().0, i32::try_from(daemon).unwrap());

    // The always-exiting proxy backs off with its exit recorded: exits 1 and 2 are
    // restarted at once and after 1s; after exit 3 it waits 2s, in `backoff`.
    let crash = wait_for("crash-proxy in backoff after its third exit", || {
        agent.proxy("crash-proxy").filter(|p| p["state"] == "backoff" && p["restarts"].as_u64() >= Some(2))
    });
    assert_eq!(crash["last_exit"], serde_json::json!({ "code": 7 }), "{crash}");
    assert!(crash["pid"].is_null(), "no process while backing off: {crash}");
    assert!(agent.logs().contains("process exited; restarting"), "{}", agent.logs());
    assert!(processes_by_proxy_id(&socket).get("crash-proxy").is_none_or(|pids| pids.len() <= 1));

    // Meanwhile nobody else was touched.
    for (id, pid) in [("steady-proxy", steady), ("daemon-proxy", daemon), ("mute-proxy", mute)] {
        let status = agent.proxy(id).unwrap();
        assert_eq!((status["state"].as_str(), status["pid"].as_i64()), (Some("running"), Some(pid)), "{status}");
        assert_eq!(status["restarts"], 0, "{status}");
        assert!(alive(pid));
    }
    assert!(alive(i64::from(escaped)));

    // A restart of the daemonising proxy sweeps its group, which the escaped child has left:
    // without cgroups tether does not see it, and it survives.
    sigkill(daemon);
    let restarted = wait_for("daemon-proxy to run anew", || {
        agent
            .proxy("daemon-proxy")
            .filter(|p| p["state"] == "running" && p["pid"].as_i64().is_some_and(|p| p != daemon))
    });
    assert_eq!(restarted["restarts"], 1);
    let escaped_again = wait_for("the new instance's daemonised child", || {
        let children = processes_running(&socket, "daemon-proxy", &["/bin/sleep", "3601"]);
        (children.len() == 2).then_some(children)
    });
    assert!(escaped_again.contains(&escaped), "the first escaped child outlived the restart: {escaped_again:?}");
    assert_eq!(pid_of(&agent.proxy("steady-proxy").unwrap()), steady);
    assert_eq!(pid_of(&agent.proxy("mute-proxy").unwrap()), mute);

    // `leave` stops every proxy it knows; the escaped children are not among them.
    tether().arg("leave").arg("--data-dir").arg(&dirs.data).assert().code(0);
    assert!(agent.wait().success());
    let left = wait_for("the proxies' processes to end", || {
        let left = processes_by_proxy_id(&socket);
        let known_gone = ["steady-proxy", "mute-proxy", "crash-proxy"].iter().all(|id| !left.contains_key(*id));
        (known_gone && left.get("daemon-proxy").is_some_and(|pids| pids.len() == 2)).then_some(left)
    });
    assert_eq!(left["daemon-proxy"], {
        let mut escaped = escaped_again.clone();
        escaped.sort_unstable();
        escaped
    });
    assert!(!alive(steady) && !alive(mute) && !alive(pid_of(&restarted)));
    // The guard sweeps what tether left behind.
    drop(agent);
    wait_for("the escaped children to be swept", || proxies_of(&socket).is_empty().then_some(()));
}

// ---------------------------------------------------------------------------------------
// A hostile config dir.

/// Every path under `root` with its kind and size, except under `skip`: what a test compares
/// before and after to prove that nothing was written there.
fn listing(root: &Path, skip: &Path) -> BTreeMap<PathBuf, String> {
    let mut found = BTreeMap::new();
    let mut pending = vec![root.to_owned()];
    while let Some(dir) = pending.pop() {
        for entry in std::fs::read_dir(&dir).unwrap().flatten() {
            let path = entry.path();
            if path == skip {
                continue;
            }
            let metadata = std::fs::symlink_metadata(&path).unwrap();
            let modified = metadata.modified().ok();
            found.insert(path.clone(), format!("{:?} {} {modified:?}", metadata.file_type(), metadata.len()));
            if metadata.is_dir() {
                pending.push(path);
            }
        }
    }
    found
}

/// A config dir with one of each hostile file, and what each must be reported as.
fn hostile_config_dir(dirs: &Dirs) -> Vec<(String, &'static str)> {
    let config = &dirs.config;
    let outside = dirs.temp.path().join("outside");
    std::fs::create_dir(&outside).unwrap();
    // Sparse: larger than the limit without costing the disk anything.
    std::fs::File::create(config.join("huge.toml")).unwrap().set_len(17 << 20).unwrap();
    let depth = 100_000;
    let nested = format!("{}{}", "[".repeat(depth), "]".repeat(depth));
    std::fs::write(
        config.join("deep.json"),
        format!(r#"{{"service": [{{"name": "deep", "proxy": {{"config": {{"a": {nested}}}}}}}]}}"#),
    )
    .unwrap();
    std::fs::write(
        config.join("deep.toml"),
        format!("[[service]]\nname = \"deept\"\n[service.proxy]\nconfig = {{ a = {nested} }}\n"),
    )
    .unwrap();
    std::fs::write(config.join("binary.toml"), b"[[service]]\nname = \"bin\xff\xfe\"\n").unwrap();
    std::os::unix::fs::symlink("/etc/passwd", config.join("passwd.toml")).unwrap();
    std::os::unix::fs::symlink("/", config.join("root.json")).unwrap();
    // A FIFO outside, reached through a symlink: opening it for reading would block forever.
    let fifo = outside.join("fifo");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
    std::os::unix::fs::symlink(&fifo, config.join("fifo.toml")).unwrap();
    std::fs::write(config.join("evil\x1b[2J\nname.toml"), "[[service]]\nname = \"evil\"\nbogus = 1\n").unwrap();
    std::fs::write(config.join("escape.toml"), "[[service]]\nname = \"../../escape\"\n[service.proxy]\n").unwrap();
    let named = |file: &str| config.join(file).display().to_string();
    vec![
        (named("huge.toml"), "file is larger than 16777216 bytes"),
        // The JSON parser reaches the limit on `config`; TOML's own parser stops first.
        (named("deep.json"), "`config` nests tables and arrays more than 32 deep"),
        (named("deep.toml"), "cannot recurse further"),
        (named("binary.toml"), ":2:12: not valid UTF-8"),
        // Followed like any symlink (config dirs are often links into a volume), read, refused.
        (named("passwd.toml"), "expected"),
        (named("root.json"), "not a regular file"),
        (named("fifo.toml"), "not a regular file"),
        (named("evil\\u{1b}[2J\\nname.toml"), ":3:1: field `service[0].bogus`: unknown field `bogus`"),
        (named("escape.toml"), ":1:1: field `service[0]`: no `id` is given, so the name must be a valid id"),
    ]
}

/// Runs `command` to its end, or fails the test when it takes longer than [`DEADLINE`].
#[track_caller]
fn bounded(command: std::process::Command) -> std::process::Output {
    let output = assert_cmd::Command::from_std(command).timeout(DEADLINE).output();
    output.unwrap_or_else(|err| panic!("the command did not finish: {err}"))
}

#[track_caller]
fn assert_reports_every_hostile_file(stderr: &str, expected: &[(String, &str)]) {
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert!(!stderr.contains('\x1b'), "control characters are escaped: {stderr:?}");
    for (file, error) in expected {
        let line = stderr.lines().find(|line| line.contains(&format!("{file}:")));
        let line = line.unwrap_or_else(|| panic!("{file} is not named in:\n{stderr}"));
        let (_, rest) = line.split_once(file.as_str()).unwrap();
        assert!(rest.starts_with(':') && rest.contains(error), "{file}: expected `{error}` in {line:?}");
    }
}

#[test]
fn a_hostile_config_dir_gets_clear_errors_no_panic_and_no_write_outside_the_data_dir() {
    let dirs = Dirs::new();
    let expected = hostile_config_dir(&dirs);
    let cwd = dirs.temp.path().join("cwd");
    std::fs::create_dir(&cwd).unwrap();
    let passwd_before = std::fs::metadata("/etc/passwd").unwrap().modified().unwrap();
    let before = listing(dirs.temp.path(), &dirs.data);

    let mut validate = tether();
    validate.arg("validate").arg(&dirs.config).current_dir(&cwd);
    let validate = bounded(validate);
    let stderr = String::from_utf8_lossy(&validate.stderr);
    assert_eq!(validate.status.code(), Some(2), "{stderr}");
    assert_reports_every_hostile_file(&stderr, &expected);
    assert!(stderr.contains(&format!("{} error(s)", expected.len())), "{stderr}");
    assert!(!dirs.data.exists(), "validate writes nothing");

    let mut agent = tether();
    agent
        .arg("agent")
        .arg("--config-dir")
        .arg(&dirs.config)
        .arg("--data-dir")
        .arg(&dirs.data)
        .args(root_flags())
        .current_dir(&cwd);
    let agent = bounded(agent);
    let stderr = String::from_utf8_lossy(&agent.stderr);
    assert_eq!(agent.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("invalid config"), "{stderr}");
    assert_reports_every_hostile_file(&stderr, &expected);

    assert_eq!(listing(dirs.temp.path(), &dirs.data), before, "nothing changed outside the data dir");
    assert!(!dirs.temp.path().join("escape").exists() && !cwd.join("escape").exists());
    assert_eq!(std::fs::metadata("/etc/passwd").unwrap().modified().unwrap(), passwd_before);
    if dirs.data.exists() {
        let inside = listing(&dirs.data, Path::new(""));
        // The data dir's skeleton and its lock: nothing was started, registered or written.
        let files: Vec<_> = inside.keys().filter(|path| !path.is_dir() && !path.ends_with("agent.lock")).collect();
        assert!(files.is_empty(), "an agent that refused its config wrote nothing: {files:?}");
    }
}

#[test]
fn a_reload_into_a_hostile_config_dir_is_refused_and_the_agent_carries_on() {
    let dirs = Dirs::new();
    let _sweep = SweepOnDrop(dirs.socket());
    dirs.write_config("a.toml", &sleeper("web"));
    let agent = Agent::start(&dirs, &root_flags());
    let web = pid_of(&agent.wait_state("web-proxy", "running"));
    let expected = hostile_config_dir(&dirs);
    agent.signal(Signal::SIGHUP);
    wait_for("the reload to be refused", || {
        agent.logs().contains("config reload refused; the previous config stays in force").then_some(())
    });
    let logs = agent.logs();
    assert!(!logs.contains("panicked"), "{logs}");
    for (file, _) in &expected {
        // JSON logs escape the escapes once more.
        let file = file.replace('\\', "\\\\");
        assert!(logs.contains(&file), "{file} is not named in:\n{logs}");
    }
    assert_eq!(pid_of(&agent.wait_state("web-proxy", "running")), web);
    assert_eq!(agent.proxies().len(), 1, "nothing started, nothing stopped");
}

// ---------------------------------------------------------------------------------------
// The data dir's file system full.

/// The value of the first sample of `name` (labels ignored) in Prometheus text.
fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .find(|line| line.starts_with(name) && line[name.len()..].starts_with(['{', ' ']))
        .and_then(|line| line.rsplit(' ').next())
        .and_then(|value| value.parse().ok())
}

/// Why a tmpfs cannot be mounted in a private mount namespace here, if it cannot.
fn private_tmpfs_unavailable(dir: &Path) -> Option<String> {
    if !is_root() {
        return Some("needs root to mount a tmpfs in a private mount namespace".to_owned());
    }
    let mut probe = command(Path::new("unshare"));
    probe.args(["--mount", "--propagation", "private", "mount", "-t", "tmpfs", "-o", "size=64k", "tether-probe"]);
    match probe.arg(dir).stdin(Stdio::null()).output() {
        Err(err) => Some(format!("cannot run unshare(1): {err}")),
        Ok(output) if !output.status.success() => Some(format!(
            "cannot mount a tmpfs in a private mount namespace: {}",
            String::from_utf8_lossy(&output.stderr).trim()
        )),
        Ok(_) => None,
    }
}

/// `command` with the arguments of an agent on `dirs`, its stderr to `log`.
fn agent_command(mut command: std::process::Command, dirs: &Dirs, log: &Path) -> std::process::Command {
    command
        .arg(env!("CARGO_BIN_EXE_tether"))
        .arg("agent")
        .arg("--config-dir")
        .arg(&dirs.config)
        .arg("--data-dir")
        .arg(&dirs.data)
        .args(["--sync-quiescent", "20ms", "--sync-max-delay", "200ms", "--log-format", "json", "--log-level", "debug"])
        .args(root_flags())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).unwrap());
    command
}

/// Starts an agent in a mount namespace of its own, on a 256 KiB tmpfs mounted over its
/// data dir, and waits for its socket. Returns the agent and its data dir as seen through
/// its root. `unshare` and `sh` exec, so the child's pid is the agent's. The guard kills the
/// agent and, by the socket path in their environment, its proxies; with them gone the
/// namespace and its tmpfs go too.
fn agent_on_tmpfs(dirs: &Dirs, log: &str) -> (Agent, PathBuf) {
    let log = dirs.temp.path().join(log);
    let mut unshare = command(Path::new("unshare"));
    unshare
        .args(["--mount", "--propagation", "private", "sh", "-c"])
        .arg(r#"mount -t tmpfs -o size=256k,mode=0700 tether-faults "$1" && shift && exec "$@""#)
        .arg("sh")
        .arg(&dirs.data);
    let agent = agent_command(unshare, dirs, &log).spawn().unwrap();
    started_inside(Agent { child: Some(agent), socket: dirs.socket(), log }, dirs)
}

/// Waits for the socket of `agent`, which may run in a mount namespace of its own, and
/// returns it with its data dir as seen through its root.
fn started_inside(mut agent: Agent, dirs: &Dirs) -> (Agent, PathBuf) {
    let inside = Path::new(&format!("/proc/{}/root", agent.pid())).join(dirs.data.strip_prefix("/").unwrap());
    let socket = inside.join("agent.sock");
    wait_until("the agent's socket, in its mount namespace", || {
        if let Some(status) = agent.child.as_mut().unwrap().try_wait().unwrap() {
            panic!("the agent exited with {status}: {}", agent.logs());
        }
        get(&socket, "/v1/agent/health").map_err(|err| err.to_string()).map(drop)
    });
    (agent, inside)
}

/// The proxies as an agent answers on `socket`, or why not.
fn proxies_at(socket: &Path) -> Result<Vec<serde_json::Value>, String> {
    let response = get(socket, "/v1/agent/proxies").map_err(|err| err.to_string())?;
    serde_json::from_str(&response.body).map_err(|err| format!("{err}: {}", response.body))
}

/// Waits until `id` runs with a pid other than `not`, and returns that pid.
#[track_caller]
fn wait_running(socket: &Path, id: &str, not: Option<i64>) -> i64 {
    wait_until(&format!("{id} to run (not as {not:?})"), || {
        let proxies = proxies_at(socket)?;
        let status = proxies.iter().find(|p| p["id"] == id).ok_or_else(|| format!("{id} not listed: {proxies:?}"))?;
        match status["pid"].as_i64() {
            Some(pid) if status["state"] == "running" && Some(pid) != not => Ok(pid),
            _ => Err(status.to_string()),
        }
    })
}

#[track_caller]
fn metric_at(socket: &Path, name: &str) -> f64 {
    let body = get(socket, "/metrics").expect("the agent answers").body;
    metric(&body, name).unwrap_or_else(|| panic!("no {name} in:\n{body}"))
}

#[test]
fn a_full_data_dir_file_system_fails_snapshot_writes_loudly_and_supervision_carries_on() {
    let dirs = Dirs::new();
    let _sweep = SweepOnDrop(dirs.socket());
    std::fs::create_dir(&dirs.data).unwrap();
    if let Some(reason) = private_tmpfs_unavailable(&dirs.data) {
        eprintln!("skipped: {reason}");
        return;
    }
    dirs.write_config("a.toml", &sleeper("web"));
    let (agent, inside) = agent_on_tmpfs(&dirs, "agent.log");
    let socket = inside.join("agent.sock");
    let mountinfo = std::fs::read_to_string(format!("/proc/{}/mountinfo", agent.pid())).unwrap();
    let data = dirs.data.display().to_string();
    assert!(
        mountinfo.lines().any(|line| line.split(' ').nth(4) == Some(&data) && line.contains(" - tmpfs tether-faults ")),
        "the data dir is the tmpfs in the agent's namespace:\n{mountinfo}"
    );
    assert_eq!(std::fs::read_dir(&dirs.data).unwrap().count(), 0, "and only there");

    let first = wait_running(&socket, "web-proxy", None);
    let snapshot = inside.join("snapshot.json");
    wait_for("the first snapshot", || {
        std::fs::read_to_string(&snapshot).ok().filter(|text| text.contains(&format!("\"pid\":{first},")))
    });
    let failures = metric_at(&socket, "tether_snapshot_write_failures_total");
    let writes = metric_at(&socket, "tether_snapshot_writes_total");

    // Fill the file system, a page at a time, until it is full.
    let filler = inside.join("filler");
    let mut file = std::fs::File::create(&filler).unwrap();
    let page = vec![0_u8; 4096];
    let full = (0..=64 + 16)
        .find_map(|_| std::io::Write::write_all(&mut file, &page).err())
        .expect("a 256 KiB file system is full after 80 pages");
    assert_eq!(full.raw_os_error(), Some(nix::errno::Errno::ENOSPC as i32), "{full}");

    // Supervision goes on: a killed proxy is restarted, though neither its pid file nor the
    // snapshot can be written. A failed pid-file write removes the stale file, which frees a
    // page that the snapshot write may take: the filler takes freed pages back, and the
    // proxy is killed again until a snapshot write has failed.
    let mut second = first;
    wait_for("the failed snapshot write in the log", || {
        let _full_again = (0..16).find_map(|_| std::io::Write::write_all(&mut file, &page).err());
        let failed =
            agent.logs().lines().any(|l| l.contains("cannot write the snapshot") && l.contains("No space left"));
        if !failed {
            sigkill(second);
            second = wait_running(&socket, "web-proxy", Some(second));
        }
        failed.then_some(())
    });
    drop(file);
    wait_for("the failure counted", || {
        (metric_at(&socket, "tether_snapshot_write_failures_total") > failures).then_some(())
    });
    let intact = std::fs::read_to_string(&snapshot).unwrap();
    serde_json::from_str::<serde_json::Value>(&intact).expect("the previous snapshot is intact");
    assert!(intact.contains("\"pid\":"), "{intact}");
    assert!(!intact.contains(&format!("\"pid\":{second},")), "the failed write named {second}: {intact}");
    // A registration, which must be persisted first, is refused and changes nothing.
    let refused = put(&socket, "/v1/agent/service/register", Some(r#"{"name": "late", "proxy": {}}"#)).unwrap();
    assert_eq!(refused.status, 500, "{}", refused.body);
    assert!(refused.body.contains("cannot persist the registration"), "{}", refused.body);
    assert!(proxies_at(&socket).unwrap().iter().all(|p| p["id"] != "late-proxy"));
    assert_eq!(wait_running(&socket, "web-proxy", None), second, "still the restarted process");

    // Space returns. The failed write is retried on its own (1 s, 2 s, 4 s, ... up to 30 s),
    // without waiting for another change, so the snapshot soon names the running process.
    std::fs::remove_file(&filler).unwrap();
    wait_for("the snapshot to be retried and name the running process", || {
        std::fs::read_to_string(&snapshot).ok().filter(|text| text.contains(&format!("\"pid\":{second},")))
    });
    assert!(metric_at(&socket, "tether_snapshot_writes_total") > writes);
    // And the next change is written as usual.
    sigkill(second);
    let third = wait_running(&socket, "web-proxy", Some(second));
    wait_for("a snapshot with the new process", || {
        std::fs::read_to_string(&snapshot).ok().filter(|text| text.contains(&format!("\"pid\":{third},")))
    });
    assert!(metric_at(&socket, "tether_snapshot_writes_total") > writes);
    wait_for("the pid file to follow", || {
        let text = std::fs::read_to_string(inside.join("pids/web-proxy.pid")).ok()?;
        (text.trim() == third.to_string()).then_some(())
    });
    let logs = agent.logs();
    let failed_at = logs.find("cannot write the snapshot").unwrap();
    assert!(logs[failed_at..].contains("snapshot written"), "a write succeeded after the failure:\n{logs}");
}

// ---------------------------------------------------------------------------------------
// The crash window the storm can land in: a proxy started, its pid file written, and the
// agent SIGKILLed before the next snapshot write. Made deterministic by writing the
// snapshot that such an agent leaves behind.

#[test]
fn a_proxy_started_after_the_last_snapshot_write_is_adopted_after_a_crash_not_run_twice() {
    let dirs = Dirs::new();
    let _sweep = SweepOnDrop(dirs.socket());
    dirs.write_config("a.toml", &sleeper("web"));
    let mut first = Agent::start(&dirs, &root_flags());
    let web = pid_of(&first.wait_state("web-proxy", "running"));
    let snapshot = dirs.data.join("snapshot.json");
    let mut saved: serde_json::Value = wait_for("web-proxy in the snapshot", || {
        let text = std::fs::read_to_string(&snapshot).ok()?;
        text.contains("web-proxy").then(|| serde_json::from_str(&text).unwrap())
    });
    wait_for("web-proxy's pid file", || dirs.data.join("pids/web-proxy.pid").exists().then_some(()));
    first.signal(Signal::SIGKILL);
    first.wait();
    // The snapshot as it was before web-proxy started: valid, and without it.
    saved["proxies"] = serde_json::json!([]);
    std::fs::write(&snapshot, serde_json::to_vec(&saved).unwrap()).unwrap();

    let second = Agent::start(&dirs, &root_flags());
    let listed = wait_running(&dirs.socket(), "web-proxy", None);
    let processes = wait_for("web-proxy's processes to settle", || {
        let processes = processes_by_proxy_id(&dirs.socket()).remove("web-proxy").unwrap_or_default();
        let listed_runs = processes.contains(&i32::try_from(listed).unwrap());
        listed_runs.then_some(processes)
    });
    // The snapshot does not know `web`, but its pid file does, and the proxy's id and
    // token in its environment prove it: it is adopted, not started a second time.
    assert_eq!(listed, web, "the listed process is the first instance");
    assert_eq!(processes, vec![i32::try_from(web).unwrap()], "exactly one process runs web-proxy");
    assert_eq!(second.proxy("web-proxy").unwrap()["restarts"], 0);
    drop(second);
}

// ---------------------------------------------------------------------------------------
// SIGKILL during start-up: the first agent has spawned some proxies, maybe without their
// pid files or a snapshot, when it dies. The next one must find every instance.

const STARTUP_SERVICES: usize = 50;
const STARTUP_KILLS: usize = 30;

/// The pids of `id`'s processes that lead their own group: instances, not their children.
fn instances(socket: &Path) -> BTreeMap<String, Vec<i32>> {
    let mut by_id = processes_by_proxy_id(socket);
    for (_, pids) in by_id.iter_mut() {
        pids.retain(|&pid| pgid_and_sid(pid).is_some_and(|(pgid, _)| pgid == pid));
    }
    by_id.retain(|_, pids| !pids.is_empty());
    by_id
}

#[test]
fn an_agent_killed_at_random_moments_of_start_up_never_runs_a_proxy_twice_and_leaves_no_orphan() {
    let seed = seed();
    eprintln!("TETHER_FAULT_SEED={seed}");
    let mut random = SplitMix(seed);
    let dirs = Dirs::new();
    let _sweep = SweepOnDrop(dirs.socket());
    let services: String = (0..STARTUP_SERVICES).map(|n| sleeper(&format!("s{n:02}"))).collect();
    dirs.write_config("many.toml", &services);
    let mut spawned_before_kill = Vec::new();
    for round in 0..STARTUP_KILLS {
        let kill_after = Duration::from_millis(3 + random.below(48) as u64);
        let mut first = Agent::spawn(&dirs, &root_flags());
        // Every third round counts its moment from the first proxy seen running, so that
        // kills land after spawns however slowly a loaded machine starts the agent; the
        // others count from the agent's own start, and may land before anything runs.
        if round % 3 == 2 {
            wait_for(&format!("round {round}: a first proxy"), || {
                (!proxies_of(&dirs.socket()).is_empty()).then_some(())
            });
        }
        std::thread::sleep(kill_after); // the fault's moment, not a synchronisation
        first.signal(Signal::SIGKILL);
        first.wait();
        spawned_before_kill.push(proxies_of(&dirs.socket()).len());

        let second = Agent::start(&dirs, &root_flags());
        let listed: BTreeMap<String, i32> = wait_for(&format!("round {round}: every proxy running"), || {
            let proxies = second.proxies();
            let running: BTreeMap<String, i32> = proxies
                .iter()
                .filter(|p| p["state"] == "running")
                .map(|p| (p["id"].as_str().unwrap().to_owned(), i32::try_from(pid_of(p)).unwrap()))
                .collect();
            (running.len() == STARTUP_SERVICES).then_some(running)
        });
        // Duplicates are stopped while the second agent restores, before it lists anything as
        // running; what runs now is what it lists, once each.
        let running = instances(&dirs.socket());
        let expected: BTreeMap<String, Vec<i32>> = listed.iter().map(|(id, pid)| (id.clone(), vec![*pid])).collect();
        assert_eq!(
            running,
            expected,
            "round {round} (killed after {kill_after:?}, seed {seed}): every proxy runs once, as listed\n{}",
            second.logs()
        );

        let left = assert_cmd::Command::from_std(tether())
            .arg("leave")
            .arg("--data-dir")
            .arg(&dirs.data)
            .timeout(DEADLINE)
            .output()
            .unwrap();
        assert!(left.status.success(), "round {round}: {}", String::from_utf8_lossy(&left.stderr));
        let mut second = second;
        assert!(second.wait().success());
        assert_eq!(proxies_of(&dirs.socket()), Vec::<i32>::new(), "round {round}: leave leaves nothing");
        assert!(!dirs.data.join("snapshot.json").exists());
    }
    // The rounds covered both sides of the window: kills before any spawn and after some.
    eprintln!("processes alive at each kill: {spawned_before_kill:?}");
    assert!(spawned_before_kill.iter().any(|&n| n > 0), "some kills landed after spawns: {spawned_before_kill:?}");
}

// ---------------------------------------------------------------------------------------
// A restart whose pid-file write fails on a full disk, then a crash of the agent: the pid
// file must not name the dead instance alone, and the next agent must find the live one.

#[test]
fn a_pid_file_write_lost_to_a_full_disk_then_a_crash_runs_no_proxy_twice() {
    let dirs = Dirs::new();
    let _sweep = SweepOnDrop(dirs.socket());
    std::fs::create_dir(&dirs.data).unwrap();
    if let Some(reason) = private_tmpfs_unavailable(&dirs.data) {
        eprintln!("skipped: {reason}");
        return;
    }
    dirs.write_config("a.toml", &sleeper("web"));
    let (mut first, inside) = agent_on_tmpfs(&dirs, "first.log");
    let socket = inside.join("agent.sock");
    let before = wait_running(&socket, "web-proxy", None);
    let pid_file = inside.join("pids/web-proxy.pid");
    wait_for("the pid file", || (std::fs::read_to_string(&pid_file).ok()?.trim() == before.to_string()).then_some(()));

    // Fill the file system, then kill the proxy: the restart's pid-file write fails.
    let mut file = std::fs::File::create(inside.join("filler")).unwrap();
    let page = vec![0_u8; 4096];
    let full = (0..=64 + 16).find_map(|_| std::io::Write::write_all(&mut file, &page).err()).expect("full");
    assert_eq!(full.raw_os_error(), Some(nix::errno::Errno::ENOSPC as i32), "{full}");
    drop(file);
    sigkill(before);
    let live = wait_running(&socket, "web-proxy", Some(before));
    wait_until("the failed pid-file write in the log", || {
        let logs = first.logs();
        match logs.lines().any(|l| l.contains("failed to write pid file") && l.contains("No space left")) {
            true => Ok(()),
            false => Err(logs.lines().filter(|l| l.contains("pid")).collect::<Vec<_>>().join("\n")),
        }
    });
    let named = std::fs::read_to_string(&pid_file).ok();
    assert_ne!(named.as_deref().map(str::trim), Some(before.to_string().as_str()), "no stale pid is left alone");
    let temporaries: Vec<_> =
        std::fs::read_dir(inside.join("pids")).unwrap().flatten().map(|e| e.file_name()).collect();
    assert!(temporaries.iter().all(|name| !name.to_string_lossy().ends_with(".tmp")), "{temporaries:?}");

    // The agent crashes with the disk still full. The next one runs in the same mount
    // namespace, which the live proxy keeps; `nsenter` execs, so its pid is the agent's.
    first.signal(Signal::SIGKILL);
    first.wait();
    let log = dirs.temp.path().join("second.log");
    let mut nsenter = command(Path::new("nsenter"));
    nsenter.args(["--target", &live.to_string(), "--mount", "--"]);
    let second = agent_command(nsenter, &dirs, &log).spawn().unwrap();
    let (mut second, inside) = started_inside(Agent { child: Some(second), socket: dirs.socket(), log }, &dirs);
    let socket = inside.join("agent.sock");
    let listed = wait_running(&socket, "web-proxy", None);
    assert_eq!(listed, live, "the live instance is adopted:\n{}", second.logs());
    eprintln!("pid file after the failed write: {named:?}; the live instance: {live}");
    let running = instances(&dirs.socket());
    assert_eq!(running.get("web-proxy"), Some(&vec![i32::try_from(live).unwrap()]), "exactly one instance runs");
    assert_eq!(running.len(), 1, "{running:?}");
    let answer = put(&socket, "/v1/agent/leave", None).unwrap();
    assert_eq!(answer.status, 200, "{}", answer.body);
    second.wait();
    wait_for("no proxy left", || proxies_of(&dirs.socket()).is_empty().then_some(()));
}

// ---------------------------------------------------------------------------------------
// leave with proxies that cannot run: one whose program is missing, one whose program
// vanished after it started. Neither holds leave up.

#[test]
fn leave_with_failed_proxies_stops_the_rest_and_removes_the_snapshot() {
    let dirs = Dirs::new();
    let _sweep = SweepOnDrop(dirs.socket());
    let vanishing = dirs.temp.path().join("vanishing-sleep");
    std::fs::copy("/bin/sleep", &vanishing).unwrap();
    dirs.write_config(
        "a.toml",
        &format!(
            "{}[[service]]\nname = \"missing\"\n[service.proxy]\ncommand = [\"/nonexistent/proxy\"]\n\
             [[service]]\nname = \"vanishing\"\n[service.proxy]\ncommand = [\"{}\", \"3600\"]\n\
             [service.proxy.restart]\nfree_attempts = 0\n",
            sleeper("web"),
            vanishing.display()
        ),
    );
    let mut agent = Agent::start(&dirs, &root_flags());
    let web = pid_of(&agent.wait_state("web-proxy", "running"));
    let missing = agent.wait_state("missing-proxy", "failed");
    assert!(missing["error"].as_str().unwrap().contains("/nonexistent/proxy"), "{missing}");
    let vanishing_pid = pid_of(&agent.wait_state("vanishing-proxy", "running"));
    wait_for("the snapshot", || dirs.data.join("snapshot.json").exists().then_some(()));
    std::fs::remove_file(&vanishing).unwrap();
    sigkill(vanishing_pid);
    let backoff = wait_for("the failed restart", || {
        agent.proxy("vanishing-proxy").filter(|p| p["state"] == "backoff" && p["error"].is_string())
    });
    assert!(backoff["error"].as_str().unwrap().starts_with("cannot restart (failed attempts: 1): "), "{backoff}");

    let left = assert_cmd::Command::from_std(tether())
        .arg("leave")
        .arg("--data-dir")
        .arg(&dirs.data)
        .timeout(DEADLINE)
        .output()
        .unwrap();
    assert!(left.status.success(), "{}", String::from_utf8_lossy(&left.stderr));
    assert!(agent.wait().success());
    assert!(!alive(web));
    assert_eq!(proxies_of(&dirs.socket()), Vec::<i32>::new(), "leave leaves nothing");
    assert!(!dirs.data.join("snapshot.json").exists());
}

// ---------------------------------------------------------------------------------------
// The id rule at its boundary: a 128-byte service id has a 134-byte proxy id, which names
// its process, its pid file and its log files.

#[test]
fn a_service_with_the_longest_valid_id_runs() {
    let dirs = Dirs::new();
    let _sweep = SweepOnDrop(dirs.socket());
    let id = format!("l{}", "o".repeat(127));
    assert_eq!(id.len(), 128);
    dirs.write_config("long.toml", &sleeper(&id));
    let agent = Agent::start(&dirs, &root_flags());
    let proxy_id = format!("{id}-proxy");
    let status = agent.wait_state(&proxy_id, "running");
    assert_eq!(status["error"], serde_json::Value::Null);
    let pid = pid_of(&status);
    wait_for("its pid file", || {
        let text = std::fs::read_to_string(dirs.data.join(format!("pids/{proxy_id}.pid"))).ok()?;
        (text.trim() == pid.to_string()).then_some(())
    });
    assert!(dirs.data.join(format!("logs/{proxy_id}-stdout.log")).exists());
}

// ---------------------------------------------------------------------------------------
// Overlapping updates, each with the agent SIGKILLed at a random moment of it: the old
// instance may still serve, be draining, or be gone, and the new one may be starting,
// ready, or the only one left; the snapshot and the pid file may name either, or (on a full
// disk) one long dead. Each next agent must take the listener from an instance that is
// alive, keep the one that serves, and run the proxy once, without refusing or cutting a
// connection.

const OVERLAP_ROUNDS: u32 = 16;
/// The kill lands this long (at most) after the reload that starts an update: the update
/// itself, the old instance's drain of the slow client's connections, and a little after.
const OVERLAP_KILL_WINDOW_MS: usize = 800;
/// How long the slow client holds each connection before its request: an old instance told
/// to stop finishes them, so it stays alive without serving for about that long.
const SLOW_CLIENT_HOLD: Duration = Duration::from_millis(300);
/// How long the new instance's readiness probe takes: both instances serve meanwhile.
const READINESS_PROBE: Duration = Duration::from_millis(250);

/// Where a test's agents run: on the data dir as it is, or (`full`) on a tmpfs filled up,
/// in a mount namespace of their own that the next agent joins through a live proxy.
struct Site<'a> {
    dirs: &'a Dirs,
    full: bool,
    /// The data dir, as the running agent sees it.
    inside: PathBuf,
    started: usize,
}

impl<'a> Site<'a> {
    fn new(dirs: &'a Dirs, full: bool) -> Self {
        Self { dirs, full, inside: dirs.data.clone(), started: 0 }
    }

    fn socket(&self) -> PathBuf {
        self.inside.join("agent.sock")
    }

    /// Starts an agent and waits for its socket.
    fn start(&mut self) -> Agent {
        self.started += 1;
        if !self.full {
            return Agent::start(self.dirs, &root_flags());
        }
        let log = format!("agent-{}.log", self.started);
        let (agent, inside) = match web_instances(self.dirs).first() {
            None => agent_on_tmpfs(self.dirs, &log),
            Some(live) => {
                // The namespace lives on in the proxies; `nsenter` execs, so its pid is the agent's.
                let mut nsenter = command(Path::new("nsenter"));
                nsenter.args(["--target", &live.to_string(), "--mount", "--"]);
                let log = self.dirs.temp.path().join(log);
                let child = agent_command(nsenter, self.dirs, &log).spawn().unwrap();
                started_inside(Agent { child: Some(child), socket: self.dirs.socket(), log }, self.dirs)
            }
        };
        self.inside = inside;
        agent
    }

    /// Fills the tmpfs up again (a failed pid-file write frees the page of the file it
    /// removes), so that the next snapshot and pid-file writes fail.
    fn fill(&self) {
        if !self.full {
            return;
        }
        let mut file = std::fs::OpenOptions::new().create(true).append(true).open(self.inside.join("filler")).unwrap();
        let page = vec![0_u8; 4096];
        let full = (0..=64 + 16).find_map(|_| std::io::Write::write_all(&mut file, &page).err()).expect("full");
        assert_eq!(full.raw_os_error(), Some(nix::errno::Errno::ENOSPC as i32), "{full}");
    }
}

/// The instances of `web-proxy` on the machine: processes that lead their own group and carry
/// its token (an exec probe carries the proxy's id, not its token).
fn web_instances(dirs: &Dirs) -> Vec<i32> {
    let mut found = instances(&dirs.socket()).remove("web-proxy").unwrap_or_default();
    found.retain(|&pid| environ_var(pid, "TETHER_PROXY_TOKEN").is_some());
    found
}

/// Waits until `web-proxy` is listed running, with no update in flight, as the one instance
/// of the proxy on the machine, started from `generation`; returns its pid.
#[track_caller]
fn one_instance_of(site: &Site<'_>, generation: u32, what: &str) -> i32 {
    wait_until(what, || {
        let proxies = proxies_at(&site.socket())?;
        let status = proxies.iter().find(|p| p["id"] == "web-proxy").ok_or("web-proxy not listed")?;
        let pid = status["pid"].as_i64().and_then(|pid| i32::try_from(pid).ok());
        let Some(pid) = pid.filter(|_| status["state"] == "running" && status["update"].is_null()) else {
            return Err(format!("listed {status}"));
        };
        let running = web_instances(site.dirs);
        let others: Vec<String> = instances(&site.dirs.socket()).into_keys().filter(|id| id != "web-proxy").collect();
        if running != [pid] || !others.is_empty() {
            return Err(format!("listed pid {pid}, instances {running:?}, of other proxies {others:?}"));
        }
        match environ_var(pid, "GENERATION") {
            Some(found) if found == generation.to_string() => Ok(pid),
            found => Err(format!("pid {pid} runs generation {found:?}")),
        }
    })
}

fn overlapping_updates_with_the_agent_killed_at_random_moments(full: bool) {
    use crate::zero_downtime::{Load, config, upstream};

    let started = Instant::now();
    let dirs = Dirs::new();
    let _sweep = SweepOnDrop(dirs.socket());
    if full {
        std::fs::create_dir(&dirs.data).unwrap();
        if let Some(reason) = private_tmpfs_unavailable(&dirs.data) {
            eprintln!("skipped: {reason}");
            return;
        }
    }
    let seed = seed();
    eprintln!("TETHER_FAULT_SEED={seed} replays the kill moments");
    let mut random = SplitMix(seed);
    let (listen, upstream) = (free_loopback_addr(), upstream());
    // Ready after a probe of a few hundred milliseconds rather than at its first notice, so
    // that the kill also lands while both instances serve, the new one not ready yet.
    let make = |generation| {
        config(&listen, &upstream, "overlap", true, generation).replace(
            "[service.proxy.readiness]\nnotify = true\n",
            &format!(
                "[service.proxy.readiness]\nexec = [\"/bin/sh\", \"-c\", \"sleep {}\"]\ninterval = \"50ms\"\n",
                READINESS_PROBE.as_secs_f64()
            ),
        )
    };
    dirs.write_config("web.toml", &make(0));
    assert!(std::fs::read_to_string(dirs.config.join("web.toml")).unwrap().contains("exec = "));
    let mut site = Site::new(&dirs, full);
    // Every agent's guard is kept to the end: dropping one kills the proxies.
    let mut retired = Vec::new();
    let mut agent = site.start();
    one_instance_of(&site, 0, "the first instance");
    let load = Load::start(&listen);
    let slow = Load::holding(&listen, SLOW_CLIENT_HOLD);
    site.fill();

    let mut alive_at_kill = Vec::new();
    for generation in 1..=OVERLAP_ROUNDS {
        let kill_after = Duration::from_millis(random.below(OVERLAP_KILL_WINDOW_MS) as u64);
        dirs.write_config("web.toml", &make(generation));
        agent.signal(Signal::SIGHUP);
        std::thread::sleep(kill_after); // the fault's moment, not a synchronisation
        agent.signal(Signal::SIGKILL);
        agent.wait();
        let alive = web_instances(&dirs);
        alive_at_kill.push(alive.len());
        retired.push(std::mem::replace(&mut agent, site.start()));
        site.fill();
        let pid = one_instance_of(
            &site,
            generation,
            &format!("round {generation} (killed {kill_after:?} into the update, instances {alive:?}, seed {seed})"),
        );
        let (requests, refused, failed) = load.counts();
        let (slow_requests, slow_refused, slow_failed) = slow.counts();
        eprintln!(
            "round {generation}: killed after {kill_after:?} with instances {alive:?}; {pid} serves; \
             {requests} requests ({refused} refused, {failed} failed), slow {slow_requests} \
             ({slow_refused} refused, {slow_failed} failed), at {:?}",
            started.elapsed()
        );
    }
    // The last instance serves: more requests go through it.
    let served = load.counts().0;
    wait_for("requests after the last round", || (load.counts().0 > served + 20).then_some(()));
    let (requests, refused, failed) = load.counts();
    let (slow_requests, slow_refused, slow_failed) = slow.counts();
    drop((load, slow));
    eprintln!(
        "{OVERLAP_ROUNDS} rounds in {:?}; instances alive at each kill: {alive_at_kill:?}; \
         {requests} requests ({refused} refused, {failed} failed), slow {slow_requests} ({slow_refused} refused, \
         {slow_failed} failed)",
        started.elapsed()
    );
    if full {
        // The agents did meet the full disk: snapshot and pid-file writes failed.
        let logs: Vec<String> = (1..=site.started)
            .map(|n| std::fs::read_to_string(dirs.temp.path().join(format!("agent-{n}.log"))).unwrap_or_default())
            .collect();
        let failed = |what: &str| {
            logs.iter().filter(|log| log.lines().any(|l| l.contains(what) && l.contains("No space left"))).count()
        };
        let (snapshots, pid_files) = (failed("cannot write the snapshot"), failed("failed to write pid file"));
        eprintln!("of {} agents, {snapshots} failed to write the snapshot, {pid_files} a pid file", logs.len());
        assert!(snapshots > 0 && pid_files > 0, "the disk was not full for the agents");
    }
    assert!(alive_at_kill.contains(&2), "no kill landed while two instances ran: {alive_at_kill:?}");
    assert_eq!(
        (refused, failed, slow_refused, slow_failed),
        (0, 0, 0, 0),
        "refused and failed connections, of {requests} and {slow_requests} slow ones (seed {seed})"
    );
    drop(retired);
}

#[test]
fn overlapping_updates_with_the_agent_killed_at_random_moments_refuse_no_connection_and_run_once() {
    overlapping_updates_with_the_agent_killed_at_random_moments(false);
}

#[test]
fn overlapping_updates_with_the_agent_killed_at_random_moments_on_a_full_disk_refuse_no_connection() {
    overlapping_updates_with_the_agent_killed_at_random_moments(true);
}
