//! The wire shapes of the control API, owned by the binary so that a change to the wire
//! format never forces a change in a library crate.
//!
//! `ProxyStatusDto` is exactly the `status --json` object that `docs/reference.md`
//! documents; the figures of a proxy's process in it are `ProcessFigures`' own serde form,
//! so that a figure the supervisor adds is shown without a change here; `ProxyConfigDto` is what a proxy reads about itself (and what the built-in
//! proxy parses); `EventDto` is a line of the events stream; `FleetDto` the etcd follower's
//! status. Nothing here holds a secret but `LeafDto`, which only a proxy's own token reads: a
//! proxy's token travels only in its own header.

use std::time::SystemTime;

use serde::{Deserialize, Serialize};
use tether_state::{ProcessFigures, ProxyConfigMap};

/// One proxy, as `GET /v1/agent/proxies` and `tether status --json` show it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub(crate) struct ProxyStatusDto {
    pub(crate) id: String,
    pub(crate) service: String,
    pub(crate) state: String,
    /// `pid`, `restarts`, `started_at` (RFC 3339, UTC, seconds), `last_exit` (`{"code": n}`
    /// or `{"signal": n}`) and `error`, then any figure added to `ProcessFigures`: its serde
    /// form, which the test below pins, so that a new figure shows without a change here.
    #[serde(flatten)]
    pub(crate) figures: ProcessFigures,
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
    /// The new instance of an overlapping update (or the new generation of a hot restart)
    /// while it starts beside the one above; `null` otherwise.
    #[serde(default)]
    pub(crate) update: Option<UpdateDto>,
    /// The last reload in place; `null` before the first. Older agents did not send it.
    #[serde(default)]
    pub(crate) last_reload: Option<ReloadDto>,
    /// For `update = "epoch"`: every live generation, the current one first; empty for
    /// other proxies. Older agents did not send it.
    #[serde(default)]
    pub(crate) generations: Vec<GenerationDto>,
    /// The service's leaf certificate, when `[connect]` is set; never its key. Older agents
    /// did not send it.
    #[serde(default)]
    pub(crate) certificate: Option<CertificateDto>,
    /// What its Envoy said of the agent's last xDS response; `null` if no Envoy of this
    /// proxy got one since the agent started. Older agents did not send it.
    #[serde(default)]
    pub(crate) last_xds: Option<XdsDto>,
    /// What it waits for before it starts (its `depends_on`), each with the proxy that
    /// stands for it now. Older agents did not send it.
    #[serde(default)]
    pub(crate) depends_on: Vec<DependencyDto>,
    /// Its templates' last renders, by destination; empty before the first. Older agents
    /// did not send it.
    #[serde(default)]
    pub(crate) templates: Vec<TemplateRenderDto>,
}

/// `{"dependency", "condition", "proxy"}`: one of a proxy's `depends_on` as the config
/// names it, the condition it must reach (`started` or `ready`), and the proxy it stands
/// for now (`null` while none does).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct DependencyDto {
    pub(crate) dependency: String,
    pub(crate) condition: String,
    pub(crate) proxy: Option<String>,
}

/// `{"destination", "at", "result", "error"}`: a template's last render (`rendered`: a new
/// file is in place; `unchanged`; `failed`, with its error, the previous file kept).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct TemplateRenderDto {
    pub(crate) destination: String,
    /// RFC 3339, UTC.
    pub(crate) at: String,
    pub(crate) result: String,
    pub(crate) error: Option<String>,
}

/// `{"serial", "spiffe_id", "not_after", "next_renewal", "error"}`: a service's leaf
/// certificate in a status (strings or null; times RFC 3339). No private key, ever.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct CertificateDto {
    pub(crate) serial: Option<String>,
    pub(crate) spiffe_id: Option<String>,
    pub(crate) not_after: Option<String>,
    pub(crate) next_renewal: Option<String>,
    pub(crate) error: Option<String>,
}

/// `GET /v1/agent/connect/ca/roots`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct CaRootsDto {
    pub(crate) trust_domain: String,
    pub(crate) active_root_id: Option<String>,
    pub(crate) roots: Vec<CaRootDto>,
    pub(crate) index: u64,
}

/// One trusted root: `id` is its serial, as Consul names a root by it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct CaRootDto {
    pub(crate) id: String,
    pub(crate) serial: String,
    pub(crate) not_after: String,
    pub(crate) root_cert: String,
    pub(crate) active: bool,
}

/// `GET /v1/agent/connect/ca/leaf/{service}`: for the service's own proxy alone, the one
/// wire shape that carries a private key.
#[derive(Serialize, Deserialize)]
pub(crate) struct LeafDto {
    pub(crate) service: String,
    pub(crate) service_id: String,
    pub(crate) spiffe_id: String,
    pub(crate) serial: String,
    pub(crate) cert_pem: String,
    pub(crate) private_key_pem: String,
    pub(crate) valid_after: String,
    pub(crate) valid_before: String,
    pub(crate) index: u64,
}

/// `GET /v1/agent/connect/intentions/{service}`: the intentions that may decide a connection
/// to the service (those whose destination is the service or `*`), and the default.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct IntentionsDto {
    pub(crate) default_intention: String,
    pub(crate) intentions: Vec<IntentionDto>,
    pub(crate) index: u64,
}

/// `{"source", "destination", "action"}`: one intention, `*` for every service.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct IntentionDto {
    pub(crate) source: String,
    pub(crate) destination: String,
    pub(crate) action: String,
}

/// `GET /v1/agent/connect/upstream/{service}/{destination}`: the ready instances of an
/// upstream's destination that its built-in proxy connects to over mutual TLS.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct UpstreamDto {
    pub(crate) destination: String,
    /// The identity every instance must prove.
    pub(crate) spiffe_id: String,
    pub(crate) instances: Vec<MeshInstanceDto>,
    pub(crate) index: u64,
}

/// `{"service_id", "address", "port"}`: where one instance's proxy takes mutual TLS.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct MeshInstanceDto {
    pub(crate) service_id: String,
    pub(crate) address: String,
    pub(crate) port: u16,
}

/// `PUT /v1/agent/connect/refused/{service}`: a connection that the service's built-in proxy
/// refused (or closed), for the metric and the events.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct RefusalDto {
    pub(crate) reason: String,
    pub(crate) detail: String,
}

/// `{"at": RFC 3339 to the millisecond, "type": "cluster" | "endpoint" | "listener" | null,
/// "version": string or null, "result": "applied" | "refused" | "invalid", "error": string
/// or null}`: a proxy's last xDS verdict.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct XdsDto {
    pub(crate) at: String,
    #[serde(rename = "type")]
    pub(crate) kind: Option<String>,
    pub(crate) version: Option<String>,
    pub(crate) result: String,
    pub(crate) error: Option<String>,
}

impl From<&crate::xds::Verdict> for XdsDto {
    fn from(verdict: &crate::xds::Verdict) -> Self {
        Self {
            at: humantime::format_rfc3339_millis(verdict.at).to_string(),
            kind: verdict.kind.map(str::to_owned),
            version: verdict.version.clone(),
            result: verdict.result.as_str().to_owned(),
            error: verdict.error.clone(),
        }
    }
}

/// `{"epoch": n, "pid": n or null, "role": "current" | "new" | "draining"}`: one live
/// generation of a proxy with `update = "epoch"`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct GenerationDto {
    pub(crate) epoch: u32,
    pub(crate) pid: Option<u32>,
    pub(crate) role: String,
}

/// One reload's verdict: `{"at": RFC 3339 to the millisecond (reloads come closer together
/// than a second), "result": "applied" | "signalled" | "refused" |
/// "failed" | "timed out", "error": string or null}`; the answer of
/// `PUT /v1/agent/proxy/{id}/reload`, and a status's `last_reload`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct ReloadDto {
    pub(crate) at: String,
    pub(crate) result: String,
    pub(crate) error: Option<String>,
}

impl From<&tether_state::ReloadOutcome> for ReloadDto {
    fn from(outcome: &tether_state::ReloadOutcome) -> Self {
        Self {
            at: humantime::format_rfc3339_millis(outcome.at).to_string(),
            result: outcome.result.as_str().to_owned(),
            error: outcome.error.clone(),
        }
    }
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

/// RFC 3339 in UTC to the second, as `started_at` is shown: the format of etcd's records too.
pub(crate) use crate::etcd::rfc3339;

/// The header that carries a proxy's token.
pub(crate) const TOKEN_HEADER: &str = "x-tether-proxy-token";

/// The header that carries the config's index, as in the body.
pub(crate) const INDEX_HEADER: &str = "x-tether-index";

/// What a proxy learns about itself.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct ProxyConfigDto {
    pub(crate) proxy_id: String,
    pub(crate) service: ServiceDto,
    pub(crate) config: ProxyConfigMap,
    /// Passes when the service or its proxy changes: the `index` of the next blocking query.
    pub(crate) index: u64,
}

/// The service a proxy fronts.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct ServiceDto {
    pub(crate) id: String,
    pub(crate) name: String,
    pub(crate) address: String,
    pub(crate) port: Option<u16>,
}

/// One line of a proxy's log, as `GET /v1/agent/proxy/{id}/logs?format=json` and
/// `tether logs --json` write it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct LogLineDto {
    /// When the agent read the line (the log files carry no times), RFC 3339 with
    /// milliseconds.
    pub(crate) time: String,
    pub(crate) proxy: String,
    /// `stdout` or `stderr`.
    pub(crate) stream: String,
    /// The line, without its newline; bytes that are not UTF-8 become U+FFFD.
    pub(crate) text: String,
}

fn rfc3339_millis<S: serde::Serializer>(time: &SystemTime, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.collect_str(&humantime::format_rfc3339_millis(*time))
}

/// One event, as a line of the stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct EventDto {
    /// When it was seen; RFC 3339 with milliseconds on the wire.
    #[serde(serialize_with = "rfc3339_millis")]
    pub(crate) time: SystemTime,
    /// The proxy it happened to; `None` for the agent's own events (the store lost or back).
    pub(crate) proxy: Option<String>,
    pub(crate) event: &'static str,
    pub(crate) pid: Option<u32>,
    pub(crate) detail: Option<String>,
}

/// The etcd follower's status, as `GET /v1/agent/fleet` shows it (and `tether status`
/// reads it).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct FleetDto {
    pub(crate) node: String,
    pub(crate) prefix: String,
    /// The etcd client URLs the agent was given.
    pub(crate) endpoints: Vec<String>,
    /// Whether a watch on etcd is established now.
    pub(crate) connected: bool,
    /// Since when the store is unreachable (RFC 3339); `None` while it is reachable, or
    /// before the first attempt ended.
    pub(crate) unreachable_since: Option<String>,
    /// The etcd revision the applied set reflects (0: none read yet).
    pub(crate) revision: i64,
    /// Services applied to the catalog.
    pub(crate) services: usize,
    /// Keys skipped, with why: invalid values, or ids that another source owns.
    pub(crate) invalid: std::collections::BTreeMap<String, String>,
    /// The last connection or watch error, while disconnected.
    pub(crate) last_error: Option<String>,
}

/// `GET /v1/agent/fleet/nodes`: every node as `tether fleet status --json` shows it,
/// whether the fleet converged (what that command's exit code says), and the rollouts in
/// progress.
#[derive(Debug, Serialize)]
pub(crate) struct FleetNodesDto {
    pub(crate) nodes: Vec<crate::fleet::status::NodeRow>,
    pub(crate) ok: bool,
    pub(crate) rollouts: Vec<RolloutDto>,
}

/// A rollout in progress: nodes before `next` are done, the `max_parallel` from `next` in
/// progress, the others pending.
#[derive(Debug, Serialize)]
pub(crate) struct RolloutDto {
    pub(crate) services: Vec<String>,
    pub(crate) nodes: Vec<String>,
    pub(crate) next: usize,
    pub(crate) max_parallel: usize,
    pub(crate) started_at: String,
}

impl From<crate::fleet::status::FleetReport> for FleetNodesDto {
    fn from(report: crate::fleet::status::FleetReport) -> Self {
        let rollouts = report
            .rollouts
            .into_iter()
            .map(|rollout| RolloutDto {
                services: rollout.services,
                nodes: rollout.nodes,
                next: rollout.next,
                max_parallel: rollout.max_parallel,
                started_at: rollout.started_at,
            })
            .collect();
        Self { nodes: report.nodes, ok: report.converged, rollouts }
    }
}

#[cfg(test)]
mod tests {
    use std::time::SystemTime;

    use tether_state::{ExitReason, ReloadOutcome, ReloadResult, Reloads};

    use super::*;

    #[test]
    fn status_serializes_exactly_as_spec() {
        let dto = ProxyStatusDto {
            id: "web-proxy".into(),
            service: "web".into(),
            state: "running".into(),
            figures: ProcessFigures {
                pid: Some(42),
                restarts: 1,
                started_at: Some(SystemTime::UNIX_EPOCH),
                last_exit: Some(ExitReason::Signal(9)),
                // Shown at places of their own, or not at all: never twice.
                status_text: Some("not shown here".into()),
                probe_failures: 3,
                reloads: Some(Box::new(Reloads::after(None, ReloadOutcome::now(ReloadResult::Applied, None)))),
                ..ProcessFigures::default()
            },
            ready: true,
            status_text: Some("serving".into()),
            resources: None,
            update: Some(UpdateDto { state: "starting".into(), pid: Some(43), started_at: None }),
            last_reload: Some(ReloadDto {
                at: rfc3339(SystemTime::UNIX_EPOCH),
                result: "timed out".into(),
                error: Some("no READY=1".into()),
            }),
            generations: vec![
                GenerationDto { epoch: 1, pid: Some(42), role: "current".into() },
                GenerationDto { epoch: 0, pid: Some(41), role: "draining".into() },
            ],
            certificate: Some(CertificateDto {
                serial: Some("3a:01".into()),
                spiffe_id: Some("spiffe://example.org/ns/default/dc/dc1/svc/web".into()),
                not_after: Some(rfc3339(SystemTime::UNIX_EPOCH)),
                next_renewal: None,
                error: None,
            }),
            last_xds: Some(XdsDto {
                at: rfc3339(SystemTime::UNIX_EPOCH),
                kind: Some("listener".into()),
                version: Some("00ff".into()),
                result: "refused".into(),
                error: Some("cannot bind".into()),
            }),
            depends_on: vec![DependencyDto {
                dependency: "db".into(),
                condition: "ready".into(),
                proxy: Some("db-proxy".into()),
            }],
            templates: vec![TemplateRenderDto {
                destination: "/etc/web.conf".into(),
                at: rfc3339(SystemTime::UNIX_EPOCH),
                result: "failed".into(),
                error: Some("line 1: unknown filter".into()),
            }],
        };
        assert_eq!(
            serde_json::to_string(&dto).unwrap(),
            r#"{"id":"web-proxy","service":"web","state":"running","pid":42,"restarts":1,"started_at":"1970-01-01T00:00:00Z","last_exit":{"signal":9},"error":null,"ready":true,"status_text":"serving","resources":null,"update":{"state":"starting","pid":43,"started_at":null},"last_reload":{"at":"1970-01-01T00:00:00Z","result":"timed out","error":"no READY=1"},"generations":[{"epoch":1,"pid":42,"role":"current"},{"epoch":0,"pid":41,"role":"draining"}],"certificate":{"serial":"3a:01","spiffe_id":"spiffe://example.org/ns/default/dc/dc1/svc/web","not_after":"1970-01-01T00:00:00Z","next_renewal":null,"error":null},"last_xds":{"at":"1970-01-01T00:00:00Z","type":"listener","version":"00ff","result":"refused","error":"cannot bind"},"depends_on":[{"dependency":"db","condition":"ready","proxy":"db-proxy"}],"templates":[{"destination":"/etc/web.conf","at":"1970-01-01T00:00:00Z","result":"failed","error":"line 1: unknown filter"}]}"#
        );
        assert_eq!(serde_json::to_string(&ExitReason::Code(3)).unwrap(), r#"{"code":3}"#);
    }

    #[test]
    fn status_reads_back_what_it_wrote() {
        let figures = ProcessFigures {
            pid: Some(7),
            restarts: 2,
            started_at: Some(SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_767_225_600)),
            last_exit: Some(ExitReason::Code(3)),
            error: Some("exited".into()),
            ..ProcessFigures::default()
        };
        let text = format!(
            r#"{{"id":"web-proxy","service":"web","state":"backoff",{},"ready":false,"status_text":null,"resources":null,"update":null}}"#,
            serde_json::to_string(&figures).unwrap().trim_matches(['{', '}'])
        );
        let dto: ProxyStatusDto = serde_json::from_str(&text).unwrap();
        assert_eq!(dto.figures, figures);
        assert_eq!(dto.state, "backoff");
        let bad = text.replace("2026-01-01T00:00:00Z", "yesterday");
        let error = serde_json::from_str::<ProxyStatusDto>(&bad).unwrap_err().to_string();
        assert!(error.contains("started_at \"yesterday\""), "{error}");
    }
}
