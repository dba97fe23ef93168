//! Catalog costs at 10 000 proxies: loading config files, taking the desired set, and
//! applying one change. Plain `Instant` timing, median of repeated runs.

#![allow(clippy::print_stdout)]

use std::fmt::Write as _;
use std::time::{Duration, Instant};

use tether_state::config::load_dirs;
use tether_state::{Catalog, LocalState, Source, SourceKind};

const PROXIES: usize = 10_000;
const FILES: usize = 10;

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

fn measure<T>(runs: usize, mut f: impl FnMut() -> T) -> Duration {
    let samples = (0..runs)
        .map(|_| {
            let start = Instant::now();
            std::hint::black_box(f());
            start.elapsed()
        })
        .collect();
    median(samples)
}

fn main() {
    let dir = tempfile::tempdir().expect("temp dir");
    for file in 0..FILES {
        let mut text = String::new();
        for n in 0..PROXIES / FILES {
            let id = file * (PROXIES / FILES) + n;
            writeln!(
                text,
                "[[service]]\nname = \"svc-{id}\"\nport = {}\ntags = [\"v1\"]\n[service.proxy]\ncommand = [\"/usr/bin/envoy\", \"-c\", \"/etc/envoy/svc-{id}.yaml\"]\nkill_timeout = \"2s\"\nconfig = {{ bind_port = {} }}\n",
                10_000 + id % 50_000,
                20_000 + id % 40_000,
            )
            .expect("write to string");
        }
        std::fs::write(dir.path().join(format!("{file:02}.toml")), text).expect("write config");
    }

    let load = measure(5, || load_dirs(&[dir.path()]).expect("valid config").services);
    let entries = load_dirs(&[dir.path()]).expect("valid config").services;
    let into_catalog = measure(5, || {
        let state = LocalState::new();
        let services = entries.iter().map(|e| (e.service.clone(), Source::Config { file: e.file.clone() })).collect();
        state.replace_source(&SourceKind::Config, services).expect("no conflicts");
        state
    });

    let state = LocalState::new();
    let services = entries.iter().map(|e| (e.service.clone(), Source::Config { file: e.file.clone() })).collect();
    state.replace_source(&SourceKind::Config, services).expect("no conflicts");
    let desired = measure(21, || state.changes_since(None));
    assert_eq!(state.changes_since(None).upserted.len(), PROXIES);

    // One change: an API service registered and changed, read back as a delta.
    let mut service = entries[0].service.clone();
    service.id = tether_state::ServiceId::new("api-changed").expect("valid id");
    let mut port = 0u16;
    let mut last = state.revision();
    let one_change = measure(1001, || {
        port = port.wrapping_add(1);
        service.port = Some(port);
        state.upsert(service.clone(), Source::Api).expect("upsert");
        let delta = state.changes_since(Some(last));
        last = delta.revision;
        assert_eq!(delta.upserted.len(), 1);
        delta
    });

    println!("tether-state catalog, {PROXIES} proxies in {FILES} TOML files (median)");
    println!("| operation | time |");
    println!("|---|---|");
    println!("| load config files (parse + validate) | {load:.2?} |");
    println!("| replace the config source in LocalState | {into_catalog:.2?} |");
    println!("| take the desired set (complete) | {desired:.2?} |");
    println!("| apply one change and read it as a delta | {one_change:.2?} |");
}
