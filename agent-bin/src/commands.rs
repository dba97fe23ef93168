//! The CLI commands that talk to a running agent: `status`, `register`, `deregister`,
//! `leave`, `logs`, `reload`, `events`, `restart`, `stop`, `start`. Each validates its input locally first (exit 2), then asks the agent (exit 1
//! when the agent is unreachable or refuses).

use std::io::Write;
use std::path::Path;
use std::process::ExitCode;
use std::time::{Duration, SystemTime};

use anyhow::Context;
use hyper::{Method, StatusCode};
use tether_state::ServiceId;
use tether_state::config::{self, Format, Origin};

use crate::api::dto::{FleetDto, ProxyStatusDto, ReloadDto};
use crate::client::{self, Response};
use crate::error::UsageError;
use tether_state::ExitReason;

fn refused(what: &str, response: &Response) -> anyhow::Error {
    anyhow::anyhow!("{what}: the agent answered {}: {}", response.status, response.error_message())
}

/// `tether status [--json]`. When the agent follows etcd and has no watch on it, a line
/// says so after the table (on stderr with `--json`, whose output stays the list).
pub(crate) async fn status(socket: &Path, json: bool) -> anyhow::Result<ExitCode> {
    let response = client::request(socket, Method::GET, "/v1/agent/proxies", None).await?;
    if response.status != StatusCode::OK {
        return Err(refused("status", &response));
    }
    let proxies: Vec<ProxyStatusDto> =
        serde_json::from_slice(&response.body).context("the agent sent a status this version cannot read")?;
    let fleet = client::request(socket, Method::GET, "/v1/agent/fleet", None).await?;
    let store = match fleet.status {
        StatusCode::OK => {
            let fleet: FleetDto = serde_json::from_slice(&fleet.body)
                .context("the agent sent a fleet status this version cannot read")?;
            store_line(&fleet, SystemTime::now())
        }
        // The agent follows no etcd.
        StatusCode::NOT_FOUND => None,
        _ => return Err(refused("status", &fleet)),
    };
    let mut stdout = std::io::stdout().lock();
    if json {
        serde_json::to_writer_pretty(&mut stdout, &proxies)?;
        writeln!(stdout)?;
        if let Some(line) = store {
            writeln!(std::io::stderr(), "{line}")?;
        }
    } else {
        stdout.write_all(table(&proxies, SystemTime::now()).as_bytes())?;
        if let Some(line) = store {
            writeln!(stdout, "{line}")?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// What `status` says of the store when the agent has no watch on it: since when it is
/// unreachable, at which endpoints, and why; `None` while the watch stands.
fn store_line(fleet: &FleetDto, now: SystemTime) -> Option<String> {
    if fleet.connected {
        return None;
    }
    let endpoints = fleet.endpoints.join(",");
    let Some(since) = &fleet.unreachable_since else {
        return Some(format!("fleet: connecting to etcd at {endpoints} (node {})", fleet.node));
    };
    let ago = humantime::parse_rfc3339(since)
        .ok()
        .and_then(|since| now.duration_since(since).ok())
        .map(|ago| format!(" ({} ago)", humantime::format_duration(Duration::from_secs(ago.as_secs()))))
        .unwrap_or_default();
    let why = fleet.last_error.as_deref().map(|error| format!(": {error}")).unwrap_or_default();
    Some(format!(
        "fleet: etcd unreachable since {since}{ago} at {endpoints}{why}; every proxy runs on, on the last known \
         set of node {}",
        fleet.node
    ))
}

/// `bytes` in the largest binary unit that keeps a number of at least 1, such as `12.3MiB`.
fn binary_size(bytes: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < units.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 { format!("{bytes}B") } else { format!("{value:.1}{}", units[unit]) }
}

/// The human-readable `status` table.
pub(crate) fn table(proxies: &[ProxyStatusDto], now: SystemTime) -> String {
    let header = ["ID", "SERVICE", "STATE", "READY", "PID", "RESTARTS", "UPTIME", "CPU", "MEM", "LAST EXIT", "ERROR"]
        .map(str::to_owned);
    let rows: Vec<[String; 11]> = proxies
        .iter()
        .map(|p| {
            let uptime = p
                .figures
                .started_at
                .filter(|_| p.state == "running")
                .and_then(|t| now.duration_since(t).ok())
                .map(|d| humantime::format_duration(Duration::from_secs(d.as_secs())).to_string());
            let last_exit = match p.figures.last_exit {
                Some(ExitReason::Code(code)) => format!("code {code}"),
                Some(ExitReason::Signal(signal)) => format!("signal {signal}"),
                None => "-".to_owned(),
            };
            let mut state = p.state.clone();
            let mut pid = p.figures.pid.map_or_else(|| "-".to_owned(), |pid| pid.to_string());
            // An overlapping update: the new instance beside the one that serves.
            if let Some(update) = &p.update {
                state.push_str(&format!(" (new: {})", update.state));
                pid.push_str(&format!(" (new: {})", update.pid.map_or_else(|| "-".to_owned(), |pid| pid.to_string())));
            }
            // A hot restart by the proxy itself: the old generations that drain.
            let draining: Vec<String> = p
                .generations
                .iter()
                .filter(|generation| generation.role == "draining")
                .map(|generation| generation.pid.map_or_else(|| "-".to_owned(), |pid| pid.to_string()))
                .collect();
            if !draining.is_empty() {
                pid.push_str(&format!(" (draining: {})", draining.join(", ")));
            }
            [
                p.id.clone(),
                p.service.clone(),
                state,
                if p.ready { "yes" } else { "no" }.to_owned(),
                pid,
                p.figures.restarts.to_string(),
                uptime.unwrap_or_else(|| "-".to_owned()),
                p.resources.as_ref().map_or_else(|| "-".to_owned(), |r| format!("{:.2}s", r.cpu_seconds)),
                p.resources.as_ref().and_then(|r| r.memory_bytes).map_or_else(|| "-".to_owned(), binary_size),
                last_exit,
                p.figures.error.clone().unwrap_or_else(|| "-".to_owned()),
            ]
        })
        .collect();
    let mut widths = header.clone().map(|h| h.len());
    for row in &rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    for row in std::iter::once(&header).chain(&rows) {
        let mut line = String::new();
        for (index, (cell, width)) in row.iter().zip(widths).enumerate() {
            if index + 1 == row.len() {
                line.push_str(cell);
            } else {
                line.push_str(&format!("{cell:<width$}  "));
            }
        }
        out.push_str(line.trim_end());
        out.push('\n');
    }
    out
}

/// `tether register FILE`: every service in FILE, one request each.
pub(crate) async fn register(socket: &Path, file: &Path) -> anyhow::Result<ExitCode> {
    let format = Format::of_path(file)
        .ok_or_else(|| UsageError(format!("{}: a service file ends in .toml or .json", file.display())))?;
    let text =
        std::fs::read_to_string(file).map_err(|err| UsageError(format!("{}: cannot read: {err}", file.display())))?;
    let services = config::parse_file(&text, format, &Origin::File(file.to_owned()))
        .map_err(|err| UsageError(crate::error::error_chain(&err)))?;
    if services.is_empty() {
        return Err(UsageError(format!("{}: no [[service]] to register", file.display())).into());
    }
    let mut stdout = std::io::stdout().lock();
    for service in &services {
        let body = config::to_service_text(service, Format::Json)?;
        let response =
            client::request(socket, Method::PUT, "/v1/agent/service/register", Some(body.into_bytes())).await?;
        if response.status != StatusCode::OK {
            return Err(refused(&format!("register {}", service.id), &response));
        }
        writeln!(stdout, "registered {}", service.id)?;
    }
    Ok(ExitCode::SUCCESS)
}

/// `tether deregister SERVICE_ID`.
pub(crate) async fn deregister(socket: &Path, id: &str) -> anyhow::Result<ExitCode> {
    let id = ServiceId::new(id).map_err(|err| UsageError(err.to_string()))?;
    let path = format!("/v1/agent/service/deregister/{id}");
    let response = client::request(socket, Method::PUT, &path, None).await?;
    if response.status != StatusCode::OK {
        return Err(refused(&format!("deregister {id}"), &response));
    }
    writeln!(std::io::stdout(), "deregistered {id}")?;
    Ok(ExitCode::SUCCESS)
}

/// `tether leave`: returns once the agent has stopped every proxy.
pub(crate) async fn leave(socket: &Path) -> anyhow::Result<ExitCode> {
    let response = client::request(socket, Method::PUT, "/v1/agent/leave", None).await?;
    if response.status != StatusCode::OK {
        return Err(refused("leave", &response));
    }
    writeln!(std::io::stdout(), "left: every proxy stopped, agent exiting")?;
    Ok(ExitCode::SUCCESS)
}

/// `tether events [--json]`: every event until interrupted, as JSON lines or as a line of
/// text each (time, proxy, event, pid, detail).
pub(crate) async fn events(socket: &Path, json: bool) -> anyhow::Result<ExitCode> {
    let mut stdout = std::io::stdout().lock();
    let mut pending = Vec::new();
    let response = client::stream(socket, "/v1/agent/events", |chunk| {
        if json {
            stdout.write_all(chunk)?;
            return stdout.flush();
        }
        pending.extend_from_slice(chunk);
        while let Some(end) = pending.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = pending.drain(..=end).collect();
            let Ok(event) = serde_json::from_slice::<serde_json::Value>(&line) else { continue };
            let field = |key: &str| match &event[key] {
                serde_json::Value::String(text) => text.clone(),
                serde_json::Value::Null => "-".to_owned(),
                other => other.to_string(),
            };
            writeln!(
                stdout,
                "{}  {}  {}  {}  {}",
                field("time"),
                field("proxy"),
                field("event"),
                field("pid"),
                field("detail")
            )?;
        }
        stdout.flush()
    })
    .await?;
    if response.status != StatusCode::OK {
        return Err(refused("events", &response));
    }
    Ok(ExitCode::SUCCESS)
}

/// `tether restart PROXY_ID`: returns once the new process runs.
pub(crate) async fn restart(socket: &Path, id: &str) -> anyhow::Result<ExitCode> {
    crate::catalog::names::proxies_named(id).map_err(|err| UsageError(err.to_string()))?;
    let path = format!("/v1/agent/proxy/{id}/restart");
    let response = client::request(socket, Method::PUT, &path, None).await?;
    if response.status != StatusCode::OK {
        return Err(refused(&format!("restart {id}"), &response));
    }
    let status: ProxyStatusDto =
        serde_json::from_slice(&response.body).context("the agent sent a status this version cannot read")?;
    let pid = status.figures.pid.map_or_else(|| "-".to_owned(), |pid| pid.to_string());
    writeln!(std::io::stdout(), "restarted {id}: pid {pid}, {} restarts", status.figures.restarts)?;
    Ok(ExitCode::SUCCESS)
}

/// How long `tether stop` and `tether start` wait for the proxy to get there.
const HOLD_WAIT: Duration = Duration::from_secs(120);

/// `tether stop PROXY_ID` (`hold`) and `tether start PROXY_ID`: returns once the proxy is
/// `stopped`, or has left `stopped` and `pending`.
pub(crate) async fn hold(socket: &Path, id: &str, hold: bool) -> anyhow::Result<ExitCode> {
    crate::catalog::names::proxies_named(id).map_err(|err| UsageError(err.to_string()))?;
    let verb = if hold { "stop" } else { "start" };
    let response = client::request(socket, Method::PUT, &format!("/v1/agent/proxy/{id}/{verb}"), None).await?;
    if response.status != StatusCode::OK {
        return Err(refused(&format!("{verb} {id}"), &response));
    }
    let deadline = tokio::time::Instant::now() + HOLD_WAIT;
    loop {
        let response = client::request(socket, Method::GET, &format!("/v1/agent/proxy/{id}"), None).await?;
        if response.status != StatusCode::OK {
            return Err(refused(&format!("{verb} {id}"), &response));
        }
        let status: ProxyStatusDto =
            serde_json::from_slice(&response.body).context("the agent sent a status this version cannot read")?;
        let there =
            if hold { status.state == "stopped" } else { !matches!(status.state.as_str(), "stopped" | "pending") };
        if there {
            writeln!(std::io::stdout(), "{id}: {}", status.state)?;
            return Ok(ExitCode::SUCCESS);
        }
        if tokio::time::Instant::now() >= deadline {
            anyhow::bail!("{verb} {id}: still {} after {}", status.state, humantime::format_duration(HOLD_WAIT));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `tether reload`: the config dirs reloaded as SIGHUP does; exit 0 when applied, 2 with
/// every error when a file is invalid (then nothing changed).
pub(crate) async fn reload(socket: &Path) -> anyhow::Result<ExitCode> {
    let response = client::request(socket, Method::PUT, "/v1/agent/reload", None).await?;
    match response.status {
        StatusCode::OK => {
            let report: serde_json::Value = serde_json::from_slice(&response.body).unwrap_or_default();
            let count = |key: &str| report.get(key).and_then(serde_json::Value::as_u64).unwrap_or(0);
            writeln!(
                std::io::stdout(),
                "reloaded: {} added, {} changed, {} removed ({} files read, {} unchanged)",
                count("added"),
                count("changed"),
                count("removed"),
                count("files_read"),
                count("files_unchanged")
            )?;
            Ok(ExitCode::SUCCESS)
        }
        StatusCode::BAD_REQUEST => Err(UsageError(format!(
            "reload refused; the previous config stays in force:\n{}",
            response.error_message()
        ))
        .into()),
        _ => Err(refused("reload", &response)),
    }
}

/// `tether reload PROXY_ID`: one proxy reloaded in place; exit 0 when applied or signalled,
/// 1 with the reason when refused, failed or timed out, 2 when it has no reload table.
pub(crate) async fn reload_proxy(socket: &Path, id: &str) -> anyhow::Result<ExitCode> {
    crate::catalog::names::proxies_named(id).map_err(|err| UsageError(err.to_string()))?;
    let path = format!("/v1/agent/proxy/{id}/reload");
    let response = client::request(socket, Method::PUT, &path, None).await?;
    match response.status {
        StatusCode::OK => {}
        StatusCode::BAD_REQUEST => return Err(UsageError(format!("reload {id}: {}", response.error_message())).into()),
        _ => return Err(refused(&format!("reload {id}"), &response)),
    }
    let verdict: ReloadDto =
        serde_json::from_slice(&response.body).context("the agent sent a verdict this version cannot read")?;
    if matches!(verdict.result.as_str(), "applied" | "signalled") {
        writeln!(std::io::stdout(), "reload {id}: {}", verdict.result)?;
        return Ok(ExitCode::SUCCESS);
    }
    let reason = verdict.error.as_deref().unwrap_or("no reason given");
    anyhow::bail!("reload {id}: {}: {reason}", verdict.result)
}

/// `tether logs PROXY_ID [--stderr] [-n N] [-f] [--json]`: the log's last lines, then,
/// with `follow`, what the proxy writes until interrupted; with `json`, as JSON lines.
pub(crate) async fn logs(socket: &Path, args: &crate::cli::LogsArgs) -> anyhow::Result<ExitCode> {
    let id = args.id.as_str();
    crate::catalog::names::proxies_named(id).map_err(|err| UsageError(err.to_string()))?;
    let stream = if args.stderr { "stderr" } else { "stdout" };
    let format = if args.json { "json" } else { "text" };
    let path = format!(
        "/v1/agent/proxy/{id}/logs?stream={stream}&lines={}&follow={}&format={format}",
        args.lines, args.follow
    );
    let mut stdout = std::io::stdout().lock();
    let response = client::stream(socket, &path, |chunk| {
        stdout.write_all(chunk)?;
        stdout.flush()
    })
    .await?;
    if response.status != StatusCode::OK {
        return Err(refused(&format!("logs {id}"), &response));
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use tether_state::ProcessFigures;

    use super::*;

    #[test]
    fn status_names_since_when_and_where_the_store_is_unreachable_and_is_silent_while_it_is_not() {
        let now = humantime::parse_rfc3339("2026-01-01T00:01:05Z").unwrap();
        let mut fleet = FleetDto {
            node: "n1".into(),
            prefix: "/tether".into(),
            endpoints: vec!["http://127.0.0.1:2379".into(), "http://127.0.0.1:2479".into()],
            connected: true,
            unreachable_since: None,
            revision: 7,
            services: 2,
            invalid: Default::default(),
            last_error: None,
        };
        assert_eq!(store_line(&fleet, now), None);
        fleet.connected = false;
        assert_eq!(
            store_line(&fleet, now).as_deref(),
            Some("fleet: connecting to etcd at http://127.0.0.1:2379,http://127.0.0.1:2479 (node n1)")
        );
        fleet.unreachable_since = Some("2026-01-01T00:00:00Z".into());
        fleet.last_error = Some("etcd has no leader".into());
        assert_eq!(
            store_line(&fleet, now).as_deref(),
            Some(
                "fleet: etcd unreachable since 2026-01-01T00:00:00Z (1m 5s ago) at \
                 http://127.0.0.1:2379,http://127.0.0.1:2479: etcd has no leader; every proxy runs on, on the last \
                 known set of node n1"
            )
        );
    }

    #[test]
    fn table_aligns_columns_and_shows_uptime_only_when_running() {
        let started = humantime::parse_rfc3339("2026-01-01T00:00:00Z").unwrap();
        let now = started + Duration::from_secs(3725);
        let proxies = [
            ProxyStatusDto {
                id: "web-proxy".into(),
                service: "web".into(),
                state: "running".into(),
                figures: ProcessFigures {
                    pid: Some(4242),
                    restarts: 2,
                    started_at: Some(started),
                    last_exit: Some(ExitReason::Code(3)),
                    ..ProcessFigures::default()
                },
                ready: true,
                status_text: None,
                resources: Some(crate::api::dto::ResourcesDto {
                    cpu_seconds: 1.234,
                    memory_bytes: Some(12_900_000),
                    tasks: Some(3),
                }),
                update: None,
                last_reload: None,
                generations: Vec::new(),
                certificate: None,
                last_xds: None,
                depends_on: Vec::new(),
                templates: Vec::new(),
            },
            ProxyStatusDto {
                id: "db-proxy".into(),
                service: "db".into(),
                state: "blocked".into(),
                figures: ProcessFigures { error: Some("refusing to run as root".into()), ..ProcessFigures::default() },
                ready: false,
                status_text: None,
                resources: None,
                update: None,
                last_reload: None,
                generations: Vec::new(),
                certificate: None,
                last_xds: None,
                depends_on: Vec::new(),
                templates: Vec::new(),
            },
        ];
        let mut hot = proxies[0].clone();
        hot.generations = vec![
            crate::api::dto::GenerationDto { epoch: 2, pid: Some(4242), role: "current".into() },
            crate::api::dto::GenerationDto { epoch: 1, pid: Some(4100), role: "draining".into() },
            crate::api::dto::GenerationDto { epoch: 0, pid: None, role: "draining".into() },
        ];
        assert!(table(&[hot], now).contains(" 4242 (draining: 4100, -) "), "{}", table(&[proxies[0].clone()], now));
        assert_eq!(
            table(&proxies, now),
            "\
ID         SERVICE  STATE    READY  PID   RESTARTS  UPTIME    CPU    MEM      LAST EXIT  ERROR
web-proxy  web      running  yes    4242  2         1h 2m 5s  1.23s  12.3MiB  code 3     -
db-proxy   db       blocked  no     -     0         -         -      -        -          refusing to run as root
"
        );
    }
}
