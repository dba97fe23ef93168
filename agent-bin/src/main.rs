//! The `tether` binary: parses the command line and hands each command to its module.
//!
//! This is the only place that maps errors to exit codes: 0 success, 1 runtime failure,
//! 2 usage or config error, for every command.

mod agent;
mod api;
mod catalog;
mod cli;
mod client;
mod commands;
mod connect;
mod connect_proxy;
mod error;
mod etcd;
mod fleet;
mod intention;
mod logging;
mod metrics;
mod templates;
mod validate;
mod xds;

use std::process::ExitCode;

use clap::Parser;

use crate::cli::{Cli, Command, LogFormat};

use crate::error::UsageError;

fn main() -> ExitCode {
    let cli = Cli::parse();
    // Everything tether creates is private to its user: the socket, pid files, logs.
    nix::sys::stat::umask(nix::sys::stat::Mode::from_bits_truncate(0o077));
    match run(cli) {
        Ok(code) => code,
        Err(err) => {
            #[allow(clippy::print_stderr)] // The one place that reports a failed command.
            {
                eprintln!("tether: {err:#}");
            }
            ExitCode::from(if err.is::<UsageError>() { 2 } else { 1 })
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Validate(args) => validate::run(&args),
        Command::Intention(cli::IntentionCommand::Check(args)) => intention::check(&args),
        Command::Agent(args) => {
            tune_malloc();
            logging::install(&args.log_level, args.log_format)?;
            let fleet = fleet::FleetOptions::of_agent(&args)?;
            let cgroups = match (args.no_cgroups, args.cgroup_root) {
                (true, _) => agent::CgroupChoice::Off,
                (false, Some(root)) => agent::CgroupChoice::Under(root),
                (false, None) => agent::CgroupChoice::Own,
            };
            runtime()?.block_on(async move {
                if args.dev {
                    agent::dev::run(
                        args.http_addr,
                        args.http_logs,
                        args.sync_quiescent,
                        args.sync_max_delay,
                        cgroups,
                        args.journal_socket,
                    )
                    .await
                } else {
                    agent::run(agent::AgentOptions {
                        config_dirs: args.config_dirs,
                        data_dir: args.data_dir,
                        http_addr: args.http_addr,
                        http_logs: args.http_logs,
                        xds_address: args.xds_address,
                        allow_root: args.allow_root,
                        allow_api_commands: args.allow_api_commands,
                        sync_quiescent: args.sync_quiescent,
                        sync_max_delay: args.sync_max_delay,
                        stop_proxies_on_exit: false,
                        fleet,
                        cgroups,
                        journal_socket: args.journal_socket,
                    })
                    .await
                }
            })
        }
        Command::ConnectProxy => {
            logging::install("info", LogFormat::Text)?;
            // One thread: the kernel moves the bytes (splice), so the proxy's own work is
            // readiness and syscalls, which one thread does without the cross-thread
            // wake-ups that a worker pool adds to every round trip.
            current_thread()?.block_on(connect_proxy::run())
        }
        Command::Keeper => {
            // No runtime and no other thread: the keeper's children are created by this one.
            tether_proxy_daemon::keeper::serve_inherited()?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Status(args) => current_thread()?.block_on(commands::status(&args.socket.socket(), args.json)),
        Command::Register(args) => current_thread()?.block_on(commands::register(&args.socket.socket(), &args.file)),
        Command::Deregister(args) => current_thread()?.block_on(commands::deregister(&args.socket.socket(), &args.id)),
        Command::Leave(args) => current_thread()?.block_on(commands::leave(&args.socket())),
        Command::Logs(args) => current_thread()?.block_on(commands::logs(&args.socket.socket(), &args)),
        Command::Reload(args) => match &args.id {
            Some(id) => current_thread()?.block_on(commands::reload_proxy(&args.socket.socket(), id)),
            None => current_thread()?.block_on(commands::reload(&args.socket.socket())),
        },
        Command::Restart(args) => current_thread()?.block_on(commands::restart(&args.socket.socket(), &args.id)),
        Command::Stop(args) => current_thread()?.block_on(commands::hold(&args.socket.socket(), &args.id, true)),
        Command::Start(args) => current_thread()?.block_on(commands::hold(&args.socket.socket(), &args.id, false)),
        Command::Events(args) => current_thread()?.block_on(commands::events(&args.socket.socket(), args.json)),
        Command::Generate(what) => generate(what),
        Command::Envoy(cli::EnvoyCommand::Bootstrap(args)) => xds::bootstrap::run(&xds::bootstrap::BootstrapRequest {
            proxy: args.id,
            data_dir: args.data_dir,
            xds_address: args.xds_address,
            admin_address: args.admin_address,
            output: args.output,
            delta: args.delta,
        }),
        Command::Fleet(command) => current_thread()?.block_on(fleet::cli::run(command)),
    }
}

/// Tunes glibc's malloc for a long-running agent whose memory is mostly many small,
/// long-lived pieces, unless the operator tuned it (`MALLOC_ARENA_MAX`,
/// `MALLOC_MMAP_THRESHOLD_`, `GLIBC_TUNABLES`). Called before any thread exists.
///
/// - One arena for every thread. glibc gives a thread that allocates under contention an
///   arena of its own, and memory freed in one arena serves only that arena: a bring-up's
///   temporaries, freed in one, left holes that the per-proxy state allocated in the others
///   never filled (15 MB at 10 000 proxies). The agent's threads allocate little and rarely
///   at once, and glibc's per-thread cache keeps small allocations off the arena's lock.
/// - A fixed mmap threshold (glibc's initial 128 KiB). By default glibc raises it to the
///   size of each large block freed, so that a status listing of every proxy, once served,
///   leaves its megabytes in the heap for good; fixed, such blocks are mapped and given
///   back when freed.
fn tune_malloc() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let tuned = |name: &str| std::env::var_os(name).is_some();
        let tunables = std::env::var("GLIBC_TUNABLES").unwrap_or_default();
        let settings = [
            (libc::M_ARENA_MAX, 1, tuned("MALLOC_ARENA_MAX") || tunables.contains("arena_max")),
            (
                libc::M_MMAP_THRESHOLD,
                128 * 1024,
                tuned("MALLOC_MMAP_THRESHOLD_") || tunables.contains("mmap_threshold"),
            ),
        ];
        for (parameter, value, operator_set) in settings {
            if !operator_set {
                #[allow(unsafe_code)]
                // SAFETY: mallopt(3) takes two integers; called while this is the only thread.
                let _accepted = unsafe { libc::mallopt(parameter, value) };
            }
        }
    }
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread().enable_all().build()?)
}

fn current_thread() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread().enable_all().build()?)
}

/// `tether generate completions SHELL` and `tether generate man`: written from the CLI's own
/// definition, so that they never drift from it.
fn generate(what: cli::GenerateCommand) -> anyhow::Result<ExitCode> {
    use clap::CommandFactory;
    let mut command = cli::Cli::command();
    let mut stdout = std::io::stdout().lock();
    match what {
        cli::GenerateCommand::Completions { shell } => {
            clap_complete::generate(shell, &mut command, "tether", &mut stdout)
        }
        cli::GenerateCommand::Man => clap_mangen::Man::new(command).render(&mut stdout)?,
    }
    Ok(ExitCode::SUCCESS)
}
