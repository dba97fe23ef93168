//! `tether fleet put|ls|rm`: the operators' side of the fleet catalog, straight to etcd
//! (no agent needed).
//!
//! Input is checked locally first (exit 2: a bad file, node, id or TLS option); a failure
//! to reach or ask etcd is exit 1. Values are written in the register API's JSON schema,
//! one service per key, so that every agent parses them exactly as the register API would.

use std::io::Write;
use std::process::ExitCode;

use tether_state::ServiceId;
use tether_state::config::{self, Format};

use super::{etcd_failure, key_id, parse_entry, read_services, usage};
use crate::cli::{FleetCommand, FleetEtcdArgs};
use crate::etcd::{self, EtcdOptions, Layout, timed};

fn setup(args: &FleetEtcdArgs, node: &str) -> anyhow::Result<(EtcdOptions, Layout)> {
    let layout = Layout::new(&args.etcd.etcd_prefix, node).map_err(|err| usage(err.to_string()))?;
    let options = EtcdOptions::from_args(args.endpoints.clone(), &args.etcd);
    // Bad TLS files or auth flags are usage errors, found before any connection attempt.
    options.connect_options().map_err(etcd_failure)?;
    Ok((options, layout))
}

/// Runs one `tether fleet` command.
pub(crate) async fn run(command: FleetCommand) -> anyhow::Result<ExitCode> {
    match command {
        FleetCommand::Put { etcd, node, file } => put(&etcd, &node, &file).await,
        FleetCommand::Ls { etcd, node } => ls(&etcd, &node).await,
        FleetCommand::Rm { etcd, node, id } => rm(&etcd, &node, &id).await,
        FleetCommand::Roles { etcd, node, service_names } => {
            let (options, layout) = setup(&etcd, &node)?;
            for name in &service_names {
                tether_state::ServiceName::new(name).map_err(|err| usage(format!("--service-name {name}: {err}")))?;
            }
            super::roles::run(&options, &layout, &service_names).await
        }
        FleetCommand::Rollout { etcd, file, nodes, max_parallel, wait, on_failure, resume } => {
            let layout = Layout::new(&etcd.etcd.etcd_prefix, "any").map_err(|err| usage(err.to_string()))?;
            let options = EtcdOptions::from_args(etcd.endpoints.clone(), &etcd.etcd);
            options.connect_options().map_err(etcd_failure)?;
            let request = super::rollout::Request {
                file: file.as_deref(),
                nodes: &nodes,
                max_parallel,
                wait,
                on_failure,
                resume: resume.as_deref(),
            };
            super::rollout::run(&options, layout.prefix(), request).await
        }
        FleetCommand::Status { etcd, node, service, json } => {
            // A node name or service id that cannot exist is a usage error, not an empty table.
            let layout = Layout::new(&etcd.etcd.etcd_prefix, node.as_deref().unwrap_or("any"))
                .map_err(|err| usage(err.to_string()))?;
            if let Some(service) = &service {
                ServiceId::new(service).map_err(|err| usage(format!("--service {service}: {err}")))?;
            }
            let options = EtcdOptions::from_args(etcd.endpoints.clone(), &etcd.etcd);
            options.connect_options().map_err(etcd_failure)?;
            super::status::run(&options, layout.prefix(), node.as_deref(), service.as_deref(), json).await
        }
    }
}

async fn put(args: &FleetEtcdArgs, node: &str, file: &std::path::Path) -> anyhow::Result<ExitCode> {
    let (options, layout) = setup(args, node)?;
    let services = read_services(file, "put")?;
    let client = options.connect().await.map_err(etcd_failure)?;
    let mut stdout = std::io::stdout().lock();
    for service in &services {
        let key = layout.key(&service.id);
        let value = config::to_service_text(service, Format::Json)?;
        let response = timed(&options, "put", client.put(&key, value.into_bytes())).await?;
        let revision = etcd::revision(response.header.as_ref());
        writeln!(stdout, "put {key} (revision {revision})")?;
    }
    Ok(ExitCode::SUCCESS)
}

async fn ls(args: &FleetEtcdArgs, node: &str) -> anyhow::Result<ExitCode> {
    let (options, layout) = setup(args, node)?;
    let client = options.connect().await.map_err(etcd_failure)?;
    let prefix = layout.services_prefix();
    let response = timed(&options, "read", client.get_prefix(&prefix)).await?;
    let mut rows = vec![["ID".to_owned(), "REVISION".to_owned(), "STATUS".to_owned()]];
    for kv in &response.kvs {
        let id = match key_id(&layout, &kv.key) {
            Ok(id) => id.to_string(),
            Err(_) => String::from_utf8_lossy(&kv.key).escape_default().to_string(),
        };
        let status = match parse_entry(&layout, &kv.key, &kv.value) {
            Ok(_) => "ok".to_owned(),
            Err(err) => format!("invalid: {}", crate::error::error_chain(&err)),
        };
        rows.push([id, kv.mod_revision.to_string(), status]);
    }
    let width = |column: usize| rows.iter().map(|row| row[column].len()).max().unwrap_or(0);
    let (id_width, revision_width) = (width(0), width(1));
    let mut stdout = std::io::stdout().lock();
    for [id, revision, status] in &rows {
        writeln!(stdout, "{id:<id_width$}  {revision:<revision_width$}  {status}")?;
    }
    Ok(ExitCode::SUCCESS)
}

async fn rm(args: &FleetEtcdArgs, node: &str, id: &str) -> anyhow::Result<ExitCode> {
    let (options, layout) = setup(args, node)?;
    let id = ServiceId::new(id).map_err(|err| usage(err.to_string()))?;
    let client = options.connect().await.map_err(etcd_failure)?;
    let key = layout.key(&id);
    let response = timed(&options, "delete", client.delete(&key)).await?;
    if response.deleted == 0 {
        return Err(anyhow::anyhow!("{key}: no such service in etcd"));
    }
    writeln!(std::io::stdout().lock(), "removed {key}")?;
    Ok(ExitCode::SUCCESS)
}
