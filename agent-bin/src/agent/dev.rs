//! `tether agent --dev`: the agent on an embedded demo, in a temporary data dir.
//!
//! The agent serves a demo upstream on loopback itself, and runs two demo services with
//! built-in proxies: `demo` in front of that upstream, taking mutual TLS, and `web`, whose
//! upstream listener reaches `demo` over mutual TLS as an intention allows, so that one
//! command shows the mesh working with nothing else installed. Nothing persists: the proxies stop and the temp dir goes on exit.

use std::io::Write;
use std::net::{Ipv4Addr, SocketAddr};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::task::JoinSet;

use super::AgentOptions;

/// The demo upstream's answer to every request.
const GREETING: &str = "hello from the tether demo upstream, through the built-in proxy\n";

/// Runs the agent on the demo config until SIGINT, SIGTERM or `leave`.
pub(crate) async fn run(
    http_addr: Option<SocketAddr>,
    http_logs: bool,
    sync_quiescent: Duration,
    sync_max_delay: Duration,
    cgroups: super::CgroupChoice,
    journal_socket: std::path::PathBuf,
) -> anyhow::Result<ExitCode> {
    let temp = tempfile::Builder::new().prefix("tether-dev-").tempdir().context("creating the temporary data dir")?;
    let config_dir = temp.path().join("config");
    std::fs::create_dir(&config_dir).context("creating the demo config dir")?;

    let upstream = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await.context("binding the demo upstream")?;
    let upstream_port = upstream.local_addr()?.port();
    let proxy_port = free_port().context("finding a free port for the demo proxy")?;
    let web_port = free_port().context("finding a free port for web's proxy")?;
    let web_upstream = free_port().context("finding a free port for web's upstream")?;
    let trust_domain = dev_trust_domain();
    let demo = format!(
        "# The embedded demo of `tether agent --dev`.\n\
         [[service]]\nname = \"demo\"\naddress = \"127.0.0.1\"\nport = {upstream_port}\ntags = [\"dev\"]\n\n\
         # The new instance starts beside the old one on a change (or `tether restart`),\n\
         # and the agent holds the listener: no connection is refused meanwhile.\n\
         [service.proxy]\nupdate = \"overlap\"\n\n\
         [[service.proxy.listener]]\nname = \"demo\"\naddress = \"127.0.0.1:{proxy_port}\"\n\n\
         # Running means ready: the built-in proxy says so once it listens.\n\
         [service.proxy.readiness]\nnotify = true\n\n\
         # web has no port of its own: its proxy's upstream listener reaches demo over mutual TLS.\n\
         [[service]]\nname = \"web\"\naddress = \"127.0.0.1\"\n\n\
         [service.proxy]\nconfig = {{ bind_port = {web_port}, upstreams = [{{ destination_name = \"demo\", local_bind_port = {web_upstream} }}] }}\n\n\
         [service.proxy.readiness]\nnotify = true\n\n\
         # Connections are denied unless an intention allows them.\n\
         [[intention]]\nsource = \"web\"\ndestination = \"demo\"\naction = \"allow\"\n\n\
         # Every service gets an identity: a leaf certificate from a CA the agent makes in its data dir.\n\
         [connect]\ntrust_domain = \"{trust_domain}\"\n\n[connect.ca]\nprovider = \"dev\"\n"
    );
    std::fs::write(config_dir.join("demo.toml"), demo).context("writing the demo config")?;

    let mut tasks = JoinSet::new();
    tasks.spawn(serve_demo_upstream(upstream));

    let data_dir = temp.path().join("data");
    let tether = std::env::current_exe().map_or_else(|_| "tether".to_owned(), |exe| exe.display().to_string());
    let mut out = std::io::stdout().lock();
    writeln!(out, "tether dev agent")?;
    writeln!(out, "  data dir:       {} (removed on exit)", data_dir.display())?;
    writeln!(out, "  demo upstream:  127.0.0.1:{upstream_port}, served by the agent")?;
    writeln!(
        out,
        "  demo proxy:     127.0.0.1:{proxy_port} (mutual TLS) -> 127.0.0.1:{upstream_port} (built-in proxy, on a listener the agent holds)"
    )?;
    writeln!(
        out,
        "  web's upstream: 127.0.0.1:{web_upstream} -> mutual TLS as web -> demo's proxy (intention web -> demo: allow)"
    )?;
    writeln!(out, "  connect:        trust domain {trust_domain}, dev CA in the data dir")?;
    writeln!(out, "try, once the proxies run (about a second):")?;
    writeln!(out, "  curl http://127.0.0.1:{web_upstream}/")?;
    writeln!(out, "  {tether} status --data-dir {}", data_dir.display())?;
    writeln!(out, "stop with Ctrl-C: the demo proxy stops with the agent")?;
    drop(out);

    let options = AgentOptions {
        config_dirs: vec![config_dir],
        data_dir,
        http_addr,
        http_logs,
        xds_address: None,
        allow_root: true,
        allow_api_commands: false,
        sync_quiescent,
        sync_max_delay,
        stop_proxies_on_exit: true,
        fleet: None,
        cgroups,
        journal_socket,
    };
    let result = super::run(options).await;
    tasks.abort_all();
    drop(temp);
    result
}

/// A trust domain of its own for each dev agent, as Consul's dev agents have: 16 random hex
/// digits under `.tether`.
fn dev_trust_domain() -> String {
    let mut bytes = [0u8; 8];
    // Without randomness, a fixed domain still works: it is a demo's.
    let _ = getrandom::fill(&mut bytes);
    let hex: String = bytes.iter().map(|byte| format!("{byte:02x}")).collect();
    format!("{hex}.tether")
}

/// A port that was free a moment ago on loopback.
fn free_port() -> std::io::Result<u16> {
    let probe = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
    Ok(probe.local_addr()?.port())
}

/// Answers every HTTP request with [`GREETING`].
async fn serve_demo_upstream(listener: TcpListener) {
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((mut stream, _)) = accepted else { continue };
                connections.spawn(async move {
                    let mut request = [0u8; 4096];
                    // One read is enough for a demo request line and headers.
                    let _ = stream.read(&mut request).await;
                    let response = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{GREETING}",
                        GREETING.len()
                    );
                    let _ = stream.write_all(response.as_bytes()).await;
                    let _ = stream.shutdown().await;
                });
            }
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}
