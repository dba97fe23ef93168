//! The command line: every subcommand and flag of `tether`, as clap structs
//! (`docs/reference.md` documents them).
//!
//! Parsing only: no command runs here.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

/// The subcommand that runs the built-in proxy: the agent starts its own binary with it.
pub(crate) const CONNECT_PROXY: &str = "connect-proxy";

/// The subcommand that runs the keeper of the proxies: the agent starts its own binary with it.
pub(crate) const KEEPER: &str = "keeper";

/// The key prefix of the fleet's keys in etcd when none is given.
pub(crate) const DEFAULT_ETCD_PREFIX: &str = "/tether";

/// The environment variable that gives `--data-dir`, to the agent and every command.
pub(crate) const DATA_DIR_ENV: &str = "TETHER_DATA_DIR";

/// The address of `--xds-address` given without one: Consul's gRPC port, on the loopback.
pub(crate) const DEFAULT_XDS_ADDRESS: &str = "127.0.0.1:8502";

/// Where the agent keeps its state when `--data-dir` is not given.
pub(crate) const DEFAULT_DATA_DIR: &str = "/var/lib/tether";

/// tether: keeps managed proxy processes in step with a catalog of services.
#[derive(Debug, Parser)]
#[command(name = "tether", version, propagate_version = true)]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Run the agent: load config, adopt running proxies, keep them in step.
    Agent(AgentArgs),
    /// Show every proxy: id, service, state, pid, restarts, uptime, last exit, error.
    Status(StatusArgs),
    /// Register the services in FILE (same schema as a config file).
    Register(RegisterArgs),
    /// Deregister a service registered through the API, stopping its proxy.
    Deregister(DeregisterArgs),
    /// Stop every proxy and the agent.
    Leave(SocketArgs),
    /// Show the last lines of a proxy's stdout (or stderr) log; -f follows it, across rotations.
    Logs(LogsArgs),
    /// Reload the config dirs like SIGHUP, and wait for the result: 0 applied, 2 and every error otherwise.
    /// With PROXY_ID, reload that proxy in place, and wait for the verdict: 0 applied or signalled,
    /// 1 refused, failed or timed out, 2 when it has no reload table.
    Reload(ReloadArgs),
    /// Restart one proxy now (it keeps its restart count); returns once the new process runs.
    Restart(ProxyArgs),
    /// Hold one proxy down: stopped, across agent restarts and reloads, until `start`.
    Stop(ProxyArgs),
    /// Release a proxy held down by `stop`: it starts again.
    Start(ProxyArgs),
    /// Stream what happens to proxies (started, exited, restarted, stopped, ...) until interrupted.
    Events(EventsArgs),
    /// Check config dirs without an agent: exit 0 if valid, 2 and every error otherwise.
    Validate(ValidateArgs),
    /// Intentions: which services may connect to which, as the config dirs say.
    #[command(subcommand)]
    Intention(IntentionCommand),
    /// The built-in TCP proxy; normally started by the agent.
    #[command(name = CONNECT_PROXY)]
    ConnectProxy,
    /// The keeper: the parent of the proxies, which outlives the agent; only the agent
    /// starts it.
    #[command(name = KEEPER, hide = true)]
    Keeper,
    /// The fleet in etcd: put, list and remove a node's services, see every node's status.
    #[command(subcommand)]
    Fleet(FleetCommand),
    /// Envoy: the bootstrap with which an Envoy gets its whole config from the agent (xDS).
    #[command(subcommand)]
    Envoy(EnvoyCommand),
    /// Write shell completions or the man page, from this command line's own definition.
    #[command(hide = true, subcommand)]
    Generate(GenerateCommand),
}

/// What `tether generate` writes to stdout.
#[derive(Debug, Subcommand)]
pub(crate) enum GenerateCommand {
    /// The completion script of a shell.
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// The man page, tether(1), in roff.
    Man,
}

/// How to reach etcd and where the fleet's keys are: the shape of etcdctl's flags.
#[derive(Debug, Args)]
pub(crate) struct EtcdArgs {
    /// The key prefix of the fleet: keys are PREFIX/nodes/NODE/services/ID.
    #[arg(long, value_name = "PREFIX", env = "TETHER_ETCD_PREFIX", default_value = DEFAULT_ETCD_PREFIX)]
    pub(crate) etcd_prefix: String,
    /// Verify etcd's server certificate with this CA bundle (PEM); turns on TLS.
    #[arg(long, value_name = "FILE")]
    pub(crate) etcd_cacert: Option<PathBuf>,
    /// Present this client certificate (PEM) to etcd; needs --etcd-key.
    #[arg(long, value_name = "FILE", requires = "etcd_key")]
    pub(crate) etcd_cert: Option<PathBuf>,
    /// The client certificate's private key (PEM); needs --etcd-cert.
    #[arg(long, value_name = "FILE", requires = "etcd_cert")]
    pub(crate) etcd_key: Option<PathBuf>,
    /// Authenticate as this etcd user: NAME, or NAME:PASSWORD as etcdctl's --user.
    #[arg(long, value_name = "NAME[:PASSWORD]", env = "TETHER_ETCD_USER", hide_env_values = true)]
    pub(crate) etcd_user: Option<String>,
    /// The etcd user's password; prefer the environment variable, which other users cannot read.
    #[arg(long, value_name = "PASSWORD", env = "TETHER_ETCD_PASSWORD", hide_env_values = true)]
    pub(crate) etcd_password: Option<String>,
}

/// The etcd endpoints of a `fleet` command, and how to reach them.
#[derive(Debug, Args)]
pub(crate) struct FleetEtcdArgs {
    /// etcd's client URLs, comma-separated (http://127.0.0.1:2379 or https://...).
    #[arg(long = "etcd", value_name = "ENDPOINTS", env = "TETHER_ETCD", value_delimiter = ',', required = true)]
    pub(crate) endpoints: Vec<String>,
    #[command(flatten)]
    pub(crate) etcd: EtcdArgs,
}

#[derive(Debug, Subcommand)]
pub(crate) enum FleetCommand {
    /// Put every service in FILE (.toml or .json, as a config file) under NODE, one key each.
    Put {
        #[command(flatten)]
        etcd: FleetEtcdArgs,
        /// The node whose services these are.
        #[arg(value_name = "NODE")]
        node: String,
        /// A .toml or .json file of services.
        #[arg(value_name = "FILE")]
        file: PathBuf,
    },
    /// List NODE's services in etcd, and whether each value is valid.
    Ls {
        #[command(flatten)]
        etcd: FleetEtcdArgs,
        /// The node.
        #[arg(value_name = "NODE")]
        node: String,
    },
    /// Show every node's proxies as their agents publish them, and the desired revisions:
    /// exit 0 when every desired proxy of every up node runs its desired revision and is ready.
    Status {
        #[command(flatten)]
        etcd: FleetEtcdArgs,
        /// Only this node.
        #[arg(long, value_name = "NODE")]
        node: Option<String>,
        /// Only this service (its id).
        #[arg(long, value_name = "SERVICE_ID")]
        service: Option<String>,
        /// Print {"nodes": [{"node", "state", "revision", "proxies": [...]}]}.
        #[arg(long)]
        json: bool,
    },
    /// Write the services of FILE to the given nodes, a batch at a time: each batch once the
    /// one before runs the new revision and is ready. Exit 0 done, 1 failed, 2 bad input.
    Rollout {
        #[command(flatten)]
        etcd: FleetEtcdArgs,
        /// A .toml or .json file of services.
        #[arg(value_name = "FILE", required_unless_present = "resume", conflicts_with = "resume")]
        file: Option<PathBuf>,
        /// The nodes, in the order to roll out to, comma-separated.
        #[arg(
            long,
            value_name = "N1,N2,...",
            value_delimiter = ',',
            required_unless_present = "resume",
            conflicts_with = "resume"
        )]
        nodes: Vec<String>,
        /// How many nodes are written at once.
        #[arg(long, value_name = "K", default_value_t = 1, conflicts_with = "resume")]
        max_parallel: usize,
        /// How long a node may take to run the new revision and be ready.
        #[arg(long, value_name = "DUR", default_value = "60s", value_parser = humantime::parse_duration, conflicts_with = "resume")]
        wait: Duration,
        /// On a failed node: stop there, or also write the failed batch's previous values back.
        #[arg(long, value_enum, default_value = "stop", conflicts_with = "resume")]
        on_failure: OnFailure,
        /// Continue the rollout of SERVICE_ID whose command died, from the batch it reached.
        #[arg(long, value_name = "SERVICE_ID")]
        resume: Option<String>,
    },
    /// Print the etcdctl commands that create the etcd role of NODE's agent: read its
    /// services and every service's instances, write only its own status and instances.
    Roles {
        #[command(flatten)]
        etcd: FleetEtcdArgs,
        /// The node.
        #[arg(value_name = "NODE")]
        node: String,
        /// Also let it publish the instances of a service of this name, which NODE does not
        /// have in etcd yet (repeatable).
        #[arg(long = "service-name", value_name = "NAME")]
        service_names: Vec<String>,
    },
    /// Remove service ID from NODE.
    Rm {
        #[command(flatten)]
        etcd: FleetEtcdArgs,
        /// The node.
        #[arg(value_name = "NODE")]
        node: String,
        /// The service's id.
        #[arg(value_name = "ID")]
        id: String,
    },
}

/// How the agent finds its data dir, and so its socket.
#[derive(Debug, Args)]
pub(crate) struct SocketArgs {
    /// The agent's data dir (its socket is DIR/agent.sock).
    #[arg(long, value_name = "DIR", env = DATA_DIR_ENV, default_value = DEFAULT_DATA_DIR)]
    pub(crate) data_dir: PathBuf,
}

impl SocketArgs {
    pub(crate) fn socket(&self) -> PathBuf {
        self.data_dir.join("agent.sock")
    }
}

#[derive(Debug, Args)]
pub(crate) struct StatusArgs {
    #[command(flatten)]
    pub(crate) socket: SocketArgs,
    /// Print a JSON array instead of a table.
    #[arg(long)]
    pub(crate) json: bool,
}

#[derive(Debug, Args)]
pub(crate) struct RegisterArgs {
    #[command(flatten)]
    pub(crate) socket: SocketArgs,
    /// A .toml or .json file of services.
    #[arg(value_name = "FILE")]
    pub(crate) file: PathBuf,
}

#[derive(Debug, Args)]
pub(crate) struct DeregisterArgs {
    #[command(flatten)]
    pub(crate) socket: SocketArgs,
    /// The service's id.
    #[arg(value_name = "SERVICE_ID")]
    pub(crate) id: String,
}

#[derive(Debug, Args)]
pub(crate) struct ProxyArgs {
    #[command(flatten)]
    pub(crate) socket: SocketArgs,
    /// The proxy's id (`<service id>-proxy`).
    #[arg(value_name = "PROXY_ID")]
    pub(crate) id: String,
}

#[derive(Debug, Args)]
pub(crate) struct ReloadArgs {
    #[command(flatten)]
    pub(crate) socket: SocketArgs,
    /// Reload this proxy in place (`<service id>-proxy`, or its service id) instead of the config dirs.
    #[arg(value_name = "PROXY_ID")]
    pub(crate) id: Option<String>,
}

#[derive(Debug, Args)]
pub(crate) struct EventsArgs {
    #[command(flatten)]
    pub(crate) socket: SocketArgs,
    /// One JSON object a line: {"time", "proxy", "event", "pid", "detail"}.
    #[arg(long)]
    pub(crate) json: bool,
}

#[derive(Debug, Args)]
pub(crate) struct LogsArgs {
    #[command(flatten)]
    pub(crate) socket: SocketArgs,
    /// The proxy's id (`<service id>-proxy`).
    #[arg(value_name = "PROXY_ID")]
    pub(crate) id: String,
    /// Show the stderr log instead of stdout.
    #[arg(long)]
    pub(crate) stderr: bool,
    /// How many lines to show.
    #[arg(short = 'n', long = "lines", value_name = "N", default_value_t = 20)]
    pub(crate) lines: usize,
    /// Keep showing what the proxy writes, until interrupted.
    #[arg(short = 'f', long)]
    pub(crate) follow: bool,
    /// One JSON object a line: {"time", "proxy", "stream", "text"}, timed when the agent
    /// read the line.
    #[arg(long)]
    pub(crate) json: bool,
}

#[derive(Debug, Args)]
pub(crate) struct ValidateArgs {
    /// Config dirs to check (every *.toml and *.json file directly in each).
    #[arg(value_name = "DIR", required = true)]
    pub(crate) dirs: Vec<PathBuf>,
    /// The journal's native socket that the agent will be given, checked for the proxies
    /// whose output goes to the journal.
    #[arg(long, value_name = "PATH", env = "TETHER_JOURNAL_SOCKET", default_value = tether_proxy_daemon::DEFAULT_JOURNAL_SOCKET)]
    pub(crate) journal_socket: PathBuf,
}

#[derive(Debug, Subcommand)]
pub(crate) enum EnvoyCommand {
    /// Print the bootstrap of an Envoy that gets its config from the agent over ADS: its
    /// node, the agent's xDS socket (or --xds-address), the proxy's token, its admin address.
    /// It holds the token: print it to a file of mode 0600 (--output does).
    Bootstrap(EnvoyBootstrapArgs),
}

#[derive(Debug, Args)]
pub(crate) struct EnvoyBootstrapArgs {
    /// The proxy (`<service id>-proxy`, or its service id); default: TETHER_PROXY_ID, when
    /// this runs as the proxy.
    #[arg(value_name = "PROXY_ID")]
    pub(crate) id: Option<String>,
    /// The agent's data dir, where its xDS socket and the proxies' tokens are (default: the
    /// dir of TETHER_SOCKET when this runs as the proxy, else /var/lib/tether).
    #[arg(long, value_name = "DIR", env = DATA_DIR_ENV)]
    pub(crate) data_dir: Option<PathBuf>,
    /// Reach the agent's xDS server on this TCP address (its --xds-address) instead of its socket.
    #[arg(long, value_name = "ADDR")]
    pub(crate) xds_address: Option<SocketAddr>,
    /// Envoy's admin interface (keep it on the loopback: it can stop Envoy).
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:19000")]
    pub(crate) admin_address: SocketAddr,
    /// Write the bootstrap to this file (mode 0600, replaced atomically) instead of stdout.
    #[arg(long, short = 'o', value_name = "FILE")]
    pub(crate) output: Option<PathBuf>,
    /// Ask for incremental ADS (api_type DELTA_GRPC) instead of state of the world (GRPC).
    #[arg(long)]
    pub(crate) delta: bool,
}

#[derive(Debug, Subcommand)]
pub(crate) enum IntentionCommand {
    /// Say whether SRC may connect to DST, and which intention decided (or that the default
    /// did), reading the config dirs without an agent: exit 0 allow, 1 deny, 2 bad input.
    Check(IntentionCheckArgs),
}

#[derive(Debug, Args)]
pub(crate) struct IntentionCheckArgs {
    /// The service that opens the connection (its name).
    #[arg(value_name = "SRC")]
    pub(crate) source: String,
    /// The service connected to (its name).
    #[arg(value_name = "DST")]
    pub(crate) destination: String,
    /// A directory of *.toml and *.json config files, as the agent's (repeatable).
    #[arg(long = "config-dir", value_name = "DIR")]
    pub(crate) config_dirs: Vec<PathBuf>,
}

/// What a rollout does when a node fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum OnFailure {
    /// Stop: no further node is touched.
    Stop,
    /// Stop, and write the failed batch's keys back to their previous values.
    Rollback,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Args)]
pub(crate) struct AgentArgs {
    /// A directory of *.toml and *.json service files (repeatable).
    #[arg(long = "config-dir", value_name = "DIR")]
    pub(crate) config_dirs: Vec<PathBuf>,
    /// Where the agent keeps its state (created 0700 if missing).
    #[arg(long, value_name = "DIR", env = DATA_DIR_ENV, default_value = DEFAULT_DATA_DIR)]
    pub(crate) data_dir: PathBuf,
    /// Serve the read endpoints on this loopback TCP address too.
    #[arg(long, value_name = "ADDR")]
    pub(crate) http_addr: Option<SocketAddr>,
    /// Serve the proxies' output (`GET /v1/agent/proxy/{id}/logs`) on --http-addr too, so
    /// that the page shows it; off by default, since a proxy's output may hold secrets.
    #[arg(long, requires = "http_addr")]
    pub(crate) http_logs: bool,
    /// Serve Envoy's xDS (ADS over gRPC) on this loopback TCP address too, besides the data
    /// dir's xds.sock; without ADDR, 127.0.0.1:8502.
    #[arg(long, value_name = "ADDR", num_args = 0..=1, default_missing_value = DEFAULT_XDS_ADDRESS)]
    pub(crate) xds_address: Option<SocketAddr>,
    /// Allow proxies without a `user` to run when the agent runs as root.
    #[arg(long)]
    pub(crate) allow_root: bool,
    /// Allow the register API to set a proxy's `command`.
    #[arg(long)]
    pub(crate) allow_api_commands: bool,
    /// A change to a proxy quiet for this long applies at once; further changes of the same
    /// proxy that keep coming apply once it has been quiet this long.
    #[arg(long, value_name = "DUR", default_value = "500ms", value_parser = humantime::parse_duration)]
    pub(crate) sync_quiescent: Duration,
    /// A proxy's changes that keep coming apply at most this long after the first held one.
    #[arg(long, value_name = "DUR", default_value = "5s", value_parser = humantime::parse_duration)]
    pub(crate) sync_max_delay: Duration,
    /// The least severe log level shown: error, warn, info, debug or trace.
    #[arg(long, value_name = "LEVEL", default_value = "info")]
    pub(crate) log_level: String,
    /// How log lines are written.
    #[arg(long, value_enum, default_value = "text")]
    pub(crate) log_format: LogFormat,
    /// The journal's native socket, where the output of proxies with `log_target =
    /// "journal"` or `"both"` goes.
    #[arg(long, value_name = "PATH", env = "TETHER_JOURNAL_SOCKET", default_value = tether_proxy_daemon::DEFAULT_JOURNAL_SOCKET)]
    pub(crate) journal_socket: PathBuf,
    /// Follow this node's services in etcd: its client URLs, comma-separated (needs --node).
    #[arg(long = "etcd", value_name = "ENDPOINTS", value_delimiter = ',', requires = "node")]
    pub(crate) etcd: Vec<String>,
    /// This host's name in the fleet: the agent follows PREFIX/nodes/NAME/services/.
    #[arg(long, value_name = "NAME", requires = "etcd")]
    pub(crate) node: Option<String>,
    #[command(flatten)]
    pub(crate) etcd_options: EtcdArgs,
    /// The TTL of the lease under which the agent publishes its node's status: the status
    /// of an agent that dies vanishes this long after (whole seconds).
    #[arg(long, value_name = "DUR", default_value = "10s", value_parser = humantime::parse_duration)]
    pub(crate) fleet_ttl: Duration,
    /// Put every proxy in a cgroup of its own under this cgroup2 directory (default: the
    /// agent's own cgroup, if writable).
    #[arg(long, value_name = "DIR", conflicts_with = "no_cgroups")]
    pub(crate) cgroup_root: Option<PathBuf>,
    /// Fence proxies with process groups only, not cgroups.
    #[arg(long)]
    pub(crate) no_cgroups: bool,
    /// Run on the embedded demo config in a temporary data dir; stop every proxy on exit.
    #[arg(long, conflicts_with_all = ["config_dirs", "data_dir", "etcd"])]
    pub(crate) dev: bool,
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    #[test]
    fn the_agent_starts_the_built_in_proxy_with_a_subcommand_that_exists() {
        let command = Cli::command();
        let found = command.find_subcommand(CONNECT_PROXY).map(|sub| sub.get_name().to_owned());
        assert_eq!(found.as_deref(), Some(CONNECT_PROXY));
        let parsed = Cli::try_parse_from(["tether", CONNECT_PROXY]).unwrap();
        assert!(matches!(parsed.command, Command::ConnectProxy));
    }
}
