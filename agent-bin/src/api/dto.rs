//! The wire shapes of the control API, owned by the binary so that a change to the wire
//! format never forces a change in a library crate.
//!
//! `ProxyStatusDto` is exactly the `status --json` object that `docs/reference.md`
//! documents. Nothing here holds a secret.

use std::time::SystemTime;

use serde::{Deserialize, Serialize};
use tether_state::ExitReason;

/// One proxy, as `GET /v1/agent/proxies` and `tether status --json` show it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct ProxyStatusDto {
    pub(crate) id: String,
    pub(crate) service: String,
    pub(crate) state: String,
    pub(crate) pid: Option<u32>,
    pub(crate) restarts: u64,
    /// RFC 3339, UTC, seconds.
    pub(crate) started_at: Option<String>,
    /// `{"code": n}` or `{"signal": n}`: tether-state's one exit vocabulary, whose wire
    /// form the tests below pin.
    pub(crate) last_exit: Option<ExitReason>,
    pub(crate) error: Option<String>,
    /// Whether it is ready (`running`); older agents did not send it.
    #[serde(default)]
    pub(crate) ready: bool,
    /// Its own account of itself (sd_notify's `STATUS=`).
    #[serde(default)]
    pub(crate) status_text: Option<String>,
    /// What it uses, read from its cgroup; `null` without cgroups, or while no instance
    /// runs.
    #[serde(default)]
    pub(crate) resources: Option<ResourcesDto>,
    /// The new instance of an overlapping update while it starts beside the one above;
    /// `null` otherwise.
    #[serde(default)]
    pub(crate) update: Option<UpdateDto>,
}

/// `{"state": "starting", "pid": n or null, "started_at": RFC 3339 or null}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct UpdateDto {
    pub(crate) state: String,
    pub(crate) pid: Option<u32>,
    pub(crate) started_at: Option<String>,
}

/// `{"cpu_seconds": f, "memory_bytes": n or null, "tasks": n or null}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct ResourcesDto {
    pub(crate) cpu_seconds: f64,
    pub(crate) memory_bytes: Option<u64>,
    pub(crate) tasks: Option<u64>,
}

/// `{"error": "..."}`.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct ErrorDto {
    pub(crate) error: String,
}

/// `{"status": "ok"}`.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct HealthDto {
    pub(crate) status: String,
}

/// RFC 3339 in UTC to the second, as `started_at` is shown.
pub(crate) fn rfc3339(time: SystemTime) -> String {
    humantime::format_rfc3339_seconds(time).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_serializes_exactly_as_spec() {
        let dto = ProxyStatusDto {
            id: "web-proxy".into(),
            service: "web".into(),
            state: "running".into(),
            pid: Some(42),
            restarts: 1,
            started_at: Some(rfc3339(SystemTime::UNIX_EPOCH)),
            last_exit: Some(ExitReason::Signal(9)),
            error: None,
            ready: true,
            status_text: Some("serving".into()),
            resources: None,
            update: Some(UpdateDto { state: "starting".into(), pid: Some(43), started_at: None }),
        };
        assert_eq!(
            serde_json::to_string(&dto).unwrap(),
            r#"{"id":"web-proxy","service":"web","state":"running","pid":42,"restarts":1,"started_at":"1970-01-01T00:00:00Z","last_exit":{"signal":9},"error":null,"ready":true,"status_text":"serving","resources":null,"update":{"state":"starting","pid":43,"started_at":null}}"#
        );
        assert_eq!(serde_json::to_string(&ExitReason::Code(3)).unwrap(), r#"{"code":3}"#);
    }
}
