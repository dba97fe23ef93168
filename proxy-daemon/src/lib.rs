//! The operating-system backend of tether.
//!
//! It spawns proxy processes, supervises them, restarts them with backoff, stops them
//! gracefully and adopts them again after an agent restart. It owns every OS process the
//! agent starts, and it is the only code that signals them. It never reaps processes it
//! did not spawn (no `waitpid(-1)`), never touches SIGCHLD, never signals a process whose
//! identity it has not proven, and its public API holds no `tether-manager` types, so that
//! the supervisor can be reused without the engine.
//!
//! The entry point is [`Supervisor`]: [`Supervisor::spawn`] turns a [`ProcessSpec`] into a
//! [`ProcessHandle`], through which the caller observes ([`ProcessStatus`]), updates, stops
//! or detaches the process; [`Supervisor::processes`] lists every process it supervises.
//! [`Supervisor::adopt`] takes a detached process back on proof of its [`Identity`].
//!
//! [`ProcessSpec::builder`] describes a process: its program, arguments and environment,
//! where its output goes ([`LogTarget`]: a directory of the caller's) and, only if asked, its
//! pid file. It needs no data dir; [`ProcessSpec::new`] is the agent's data-dir layout.
//!
//! With the default feature `manager`, [`OsProcessBackend`] adapts it to `tether-manager`'s
//! backend traits; without it, the crate does not depend on the engine.
//!
//! ```no_run
//! use tether_proxy_daemon::{LogTarget, ProcessName, ProcessSpec, Supervisor};
//!
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! let spec = ProcessSpec::builder(ProcessName::new("web-proxy")?, "/usr/bin/envoy")
//!     .args(["-c", "/etc/envoy/web.yaml"])
//!     .env("PATH", "/usr/bin:/bin")
//!     // web-proxy-stdout.log and web-proxy-stderr.log, rotated at their size limit.
//!     .logs(LogTarget::Dir("/var/log/web-proxy".into()))
//!     .pid_file("/run/web-proxy.pid")
//!     .build()?;
//!
//! let supervisor = Supervisor::new()?;
//! let handle = supervisor.spawn(spec).await?;
//! println!("running as pid {:?}", handle.status().figures.pid);
//! for process in supervisor.processes() {
//!     println!("{}: {}", process.name, process.status.state);
//! }
//! let last = handle.stop().await;
//! println!("stopped: {:?}, ready: {}", last.figures.last_exit, last.ready);
//! # Ok(())
//! # }
//! ```
//!
//! # Cargo features
//!
//! | feature | default | what it does |
//! |---|---|---|
//! | `manager` | on | `OsProcessBackend`, the implementation of `tether-manager`'s backend traits (`ProxyBackend`, `ProxyHandle`); turns on `serde`. Without it (`default-features = false`), the crate does not depend on the engine |
//! | `serde` | with `manager` | `Serialize` and `Deserialize` for [`Identity`], so that a tool that detaches processes can store what proves them |
//!
//! With `manager`, the engine runs OS processes through [`OsProcessBackend`] (not run
//! here: it would supervise real processes):
//!
#![cfg_attr(feature = "manager", doc = "```no_run")]
#![cfg_attr(not(feature = "manager"), doc = "```ignore")]
//! use std::sync::Arc;
//!
//! use tether_manager::{FileSnapshotStore, Manager, ManagerConfig};
//! use tether_proxy_daemon::{AgentEnvironment, OsProcessBackend};
//! use tether_state::LocalState;
//! use tether_state::persist::DataDir;
//!
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! let data = DataDir::open("/var/lib/tether")?;
//! // What every proxy is told about the agent (`TETHER_SOCKET`, `TETHER_HTTP_ADDR`), and
//! // what runs the built-in proxy: here, another program of the agent's.
//! let built_in = ("/usr/libexec/my-agent/proxy".into(), Vec::new());
//! let environment = AgentEnvironment {
//!     socket: data.socket_path(),
//!     http_addr: None,
//!     built_in,
//!     before_start: None,
//!     journal_socket: tether_proxy_daemon::DEFAULT_JOURNAL_SOCKET.into(),
//! };
//! let backend = Arc::new(OsProcessBackend::new(data.clone(), environment)?);
//! let store = Arc::new(FileSnapshotStore::in_data_dir(&data));
//! let catalog = Arc::new(LocalState::new());
//! let manager = Manager::new(catalog, backend, store, ManagerConfig::default());
//! # drop(manager);
//! # Ok(())
//! # }
//! ```
//!
//! With `serde`, an [`Identity`] (what [`ProcessHandle::detach`] returns) can be written
//! anywhere and read back for [`Supervisor::adopt`]:
//!
#![cfg_attr(feature = "serde", doc = "```")]
#![cfg_attr(not(feature = "serde"), doc = "```ignore")]
//! fn storable<T: serde::Serialize + serde::de::DeserializeOwned>() {}
//! storable::<tether_proxy_daemon::Identity>();
//! ```
//!
//! # Testing
//!
//! The crate has no mocks: its behaviour is tested against real processes. To test code
//! that drives a backend, enable `tether-manager`'s `mock` feature from
//! `[dev-dependencies]`; its `MockProxyBackend` and `MockProxyHandle` stand in for
//! [`OsProcessBackend`] and its handles.
//!
// Without `manager` there is no `OsProcessBackend` to link to: its name then leads to the
// feature that brings it.
#![cfg_attr(not(feature = "manager"), doc = "[`OsProcessBackend`]: #cargo-features")]
#![deny(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]

#[cfg(feature = "manager")]
mod backend;
mod cgroup;
mod control;
mod error;
mod journal;
pub mod keeper;
mod listen;
mod notify;
mod pidfile;
mod probe;
pub use probe::{PROBE_BUCKETS, ProbeDurations};
mod proc;
mod program;
mod rotate;
mod spawn;
mod spec;
mod status;
mod supervisor;

#[cfg(feature = "manager")]
pub use backend::{AgentEnvironment, BeforeStart, MissingProgram, OsProcessBackend, missing_programs};
pub use cgroup::{CgroupError, CgroupUnavailable, Cgroups, Usage};
pub use error::{DetachError, InvalidName, ProgramNotFound, SpawnError, SpecError};
pub use journal::{DEFAULT_JOURNAL_SOCKET, JournalSink, STREAM_FIELD, journal_listens};
pub use listen::{ListenAddress, ListenError, bind as bind_listener, listens_on};
pub use proc::Identity;
pub use program::find_program;
pub use spec::{
    Backoff, CommandLine, CpuLimit, Durability, Environment, HealthChecks, HttpTarget, InheritedSocket, KillPolicy,
    KillSignal, LinePattern, Liveness, LogFile, LogOutput, LogPolicy, LogSpec, LogTarget, PersistError, PrivateDir,
    Probe, ProcessName, ProcessSpec, ProcessSpecBuilder, ProcessUpdate, Readiness, ReloadAction, ReloadCounts,
    ReloadOutcome, ReloadPolicy, ReloadResult, Reloads, ResourceLimits, RestartPolicy, Restarted, TcpTarget,
    UnsafeEntry, WATCH_DEBOUNCE,
};
pub use status::{ExitReason, ProcessFigures, ProcessState, ProcessStatus, SupervisedProcess};
pub use supervisor::{ProcessHandle, Supervisor};

// The agent's own vocabulary, which signatures above name: the catalog's proxies (read by
// the engine adapter), a proxy id (`ProcessName::of_proxy`) and the data dir
// (`ProcessSpec::new`). Reachable from here, documented in tether-state, where they live.
#[cfg(feature = "manager")]
#[doc(no_inline)]
pub use tether_state::{ManagedProxy, ProxySpec};
#[doc(no_inline)]
pub use tether_state::{ProxyId, persist::DataDir};

// The README is the crate's page on crates.io: its example is compiled as a doctest too.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
