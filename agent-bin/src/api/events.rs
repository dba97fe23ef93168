//! `GET /v1/agent/events`: what happens to proxies, as a stream of JSON lines, one per
//! event: `{"time", "proxy", "event", "pid", "detail"}`.
//!
//! The events are told from the engine's status changes, compared with the last status seen
//! of each proxy: a new pid is `started` (or `restarted`, when the restart count grew), a
//! pid that is gone is `exited` (or `stopped`, during a stop), and a proxy entering
//! `backoff`, `failed`, `blocked` or `waiting` says so, and a new last reload is `reloaded`
//! (applied or signalled) or `reload-failed` (refused, failed or timed out; the detail says
//! why); a service's leaf certificate tells `leaf-issued`, `leaf-renewed`, `leaf-failed` and
//! `leaf-expired` as events of its proxy, and a connection that its built-in proxy refused or
//! closed, `connection-refused` (the detail starts with the reason); the templates' and the xDS server's own events
//! (`template-*`, `xds-refused`, `xds-invalid`) pass through. With `--etcd`, the fleet
//! follower's `store-unreachable` and `store-reachable` pass through too, as the agent's own
//! events (no proxy). This module keeps one map per reader, of what the events are told
//! from in the last status seen of each proxy ([`Seen`]), and nothing else; it never decides
//! or changes anything. `history.rs` keeps what one such reader told during the
//! last hour.

use std::collections::HashMap;
use std::time::SystemTime;

use axum::Extension;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use tether_manager::{ExitReason, LeafEvent, ProxyEvent, ProxyState, ProxyStatus};
use tether_state::{ProxyId, ReloadOutcome};
use tokio::sync::{OwnedSemaphorePermit, broadcast, mpsc};

use super::dto::EventDto;
use super::{ApiError, ApiState, ChannelBody, StreamSlots, send_chunk};
use crate::fleet::follow::StoreEvent;
use crate::templates::TemplateEvent;
use crate::xds::XdsEvent;

pub(crate) async fn get_events(
    State(state): State<ApiState>,
    Extension(slots): Extension<StreamSlots>,
) -> Result<Response, ApiError> {
    let slot = slots.take()?;
    let follower = Follower::new(&state);
    let (lines, receiver) = mpsc::channel(64);
    tokio::spawn(stream(follower, lines, state.clone(), slot));
    Ok(([(header::CONTENT_TYPE, "application/x-ndjson")], Body::new(ChannelBody(receiver))).into_response())
}

/// Feeds one client's stream until it goes away, reads nothing for
/// [`super::STREAM_STALL`], or the API stops; `_slot` is its listener's stream slot.
async fn stream(mut follower: Follower, lines: mpsc::Sender<Bytes>, state: ApiState, _slot: OwnedSemaphorePermit) {
    loop {
        let found = tokio::select! {
            () = state.shutdown.cancelled() => return,
            () = lines.closed() => return,
            found = follower.next(&state) => match found {
                Some(found) => found,
                None => return,
            },
        };
        for event in found {
            let Ok(mut line) = serde_json::to_vec(&event) else { continue };
            line.push(b'\n');
            if !send_chunk(&lines, Bytes::from(line)).await {
                return;
            }
        }
    }
}

/// What tells events: the engine's status changes, compared with the last status seen of
/// each proxy, and the templates', the leaves' and the xDS server's own events. One per
/// client stream, and one for the agent's history.
pub(crate) struct Follower {
    events: Events,
    changes: broadcast::Receiver<ProxyEvent>,
    templates: broadcast::Receiver<TemplateEvent>,
    leaves: broadcast::Receiver<LeafEvent>,
    xds: broadcast::Receiver<XdsEvent>,
    /// The store lost or back, when the agent follows etcd.
    store: Option<broadcast::Receiver<StoreEvent>>,
    /// Connections that the built-in proxies refused or closed.
    refusals: broadcast::Receiver<crate::connect::Refusal>,
}

impl Follower {
    /// Follows from now on: the statuses as they are now are what the next ones are
    /// compared with.
    pub(crate) fn new(state: &ApiState) -> Self {
        // Subscribe before reading the statuses: no change falls between the two.
        let changes = state.manager.subscribe();
        let templates = state.templates.subscribe();
        let leaves = state.connect.events();
        let xds = state.xds.subscribe();
        let store = state.fleet.as_ref().map(crate::fleet::follow::SharedStatus::subscribe);
        let refusals = state.connect.refusals();
        let seen: HashMap<ProxyId, Seen> = state
            .manager
            .status_unmeasured()
            .into_iter()
            .map(|status| (status.id.clone(), Seen::of(&status)))
            .collect();
        Self { events: Events { seen }, changes, templates, leaves, xds, store, refusals }
    }

    /// The next events, once there are some; `None` once the engine is gone. Cancel-safe:
    /// an event is taken from its channel only in the call that returns it.
    pub(crate) async fn next(&mut self, state: &ApiState) -> Option<Vec<EventDto>> {
        // An event of a template, a leaf or xDS that a slow reader missed is not told again:
        // the status shows the error, the certificate or `last_xds`.
        loop {
            let found = tokio::select! {
                change = self.changes.recv() => match change {
                    Ok(change) => self.events.on(&change, SystemTime::now()),
                    // Too slow a reader: compare with the statuses as they are now.
                    Err(broadcast::error::RecvError::Lagged(_)) => {
                        self.events.resync(state.manager.status_unmeasured(), SystemTime::now())
                    }
                    Err(broadcast::error::RecvError::Closed) => return None,
                },
                template = self.templates.recv() => match template {
                    Ok(told) => vec![event(told.time, &told.proxy, told.event, None, Some(told.detail))],
                    Err(broadcast::error::RecvError::Lagged(_)) => continue,
                    Err(broadcast::error::RecvError::Closed) => std::future::pending().await,
                },
                leaf = self.leaves.recv() => match leaf {
                    Ok(leaf) => vec![leaf_event(&leaf, SystemTime::now())],
                    Err(broadcast::error::RecvError::Lagged(_)) => continue,
                    Err(broadcast::error::RecvError::Closed) => std::future::pending().await,
                },
                xds = self.xds.recv() => match xds {
                    Ok(told) => vec![event(told.time, &told.proxy, told.event, None, Some(told.detail))],
                    Err(broadcast::error::RecvError::Lagged(_)) => continue,
                    Err(broadcast::error::RecvError::Closed) => std::future::pending().await,
                },
                refusal = self.refusals.recv() => match refusal {
                    Ok(told) => {
                        let detail = format!("{}: {}", told.reason, told.detail);
                        vec![event(told.time, &told.service.proxy_id(), "connection-refused", None, Some(detail))]
                    }
                    Err(broadcast::error::RecvError::Lagged(_)) => continue,
                    Err(broadcast::error::RecvError::Closed) => std::future::pending().await,
                },
                // A store event that a slow reader missed: `GET /v1/agent/fleet` says where it is.
                told = recv_store(self.store.as_mut()) => match told {
                    Ok(told) => vec![store_event(&told)],
                    Err(broadcast::error::RecvError::Lagged(_)) => continue,
                    Err(broadcast::error::RecvError::Closed) => std::future::pending().await,
                },
            };
            if !found.is_empty() {
                return Some(found);
            }
        }
    }
}

/// The last status seen of each proxy, and the events that a new status makes.
pub(crate) struct Events {
    seen: HashMap<ProxyId, Seen>,
}

/// Of the last status seen of a proxy, what [`diff`] compares the next one with. Every reader
/// (the history's always) keeps one per proxy: the whole status would be a second copy of
/// the engine's board.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Seen {
    state: ProxyState,
    pid: Option<u32>,
    restarts: u64,
    error: Option<Box<str>>,
    /// Boxed: most proxies never reload.
    last_reload: Option<Box<ReloadOutcome>>,
}

impl Seen {
    pub(crate) fn of(status: &ProxyStatus) -> Self {
        Self {
            state: status.state,
            pid: status.figures.pid,
            restarts: status.figures.restarts,
            error: status.figures.error.as_deref().map(Box::from),
            last_reload: status.figures.reloads.as_ref().map(|reloads| Box::new(reloads.last.clone())),
        }
    }
}

impl Events {
    fn on(&mut self, change: &ProxyEvent, now: SystemTime) -> Vec<EventDto> {
        match change {
            ProxyEvent::Changed(status) => {
                let before = self.seen.insert(status.id.clone(), Seen::of(status));
                diff(before.as_ref(), status, now)
            }
            ProxyEvent::Removed(id) => match self.seen.remove(id) {
                Some(before) => vec![event(now, id, "removed", before.pid, None)],
                None => Vec::new(),
            },
            _ => Vec::new(),
        }
    }

    fn resync(&mut self, now_statuses: Vec<ProxyStatus>, now: SystemTime) -> Vec<EventDto> {
        let mut found = Vec::new();
        let current: HashMap<&ProxyId, &ProxyStatus> = now_statuses.iter().map(|status| (&status.id, status)).collect();
        for (id, before) in &self.seen {
            if !current.contains_key(id) {
                found.push(event(now, id, "removed", before.pid, None));
            }
        }
        for status in current.values() {
            found.extend(diff(self.seen.get(&status.id), status, now));
        }
        self.seen = now_statuses.iter().map(|status| (status.id.clone(), Seen::of(status))).collect();
        found
    }
}

fn event(now: SystemTime, id: &ProxyId, name: &'static str, pid: Option<u32>, detail: Option<String>) -> EventDto {
    EventDto { time: now, proxy: Some(id.as_str().to_owned()), event: name, pid, detail }
}

/// The next store event, or never when the agent follows no etcd.
async fn recv_store(
    store: Option<&mut broadcast::Receiver<StoreEvent>>,
) -> Result<StoreEvent, broadcast::error::RecvError> {
    match store {
        Some(store) => store.recv().await,
        None => std::future::pending().await,
    }
}

/// The store lost or back: an event of the agent's own, with no proxy.
fn store_event(told: &StoreEvent) -> EventDto {
    EventDto { time: told.time, proxy: None, event: told.event, pid: None, detail: Some(told.detail.clone()) }
}

/// A leaf certificate's event, told as an event of the service's proxy: `leaf-issued`,
/// `leaf-renewed` (the detail names the serial and the expiry), `leaf-failed` (the error),
/// `leaf-expired`. Never the key.
fn leaf_event(leaf: &LeafEvent, now: SystemTime) -> EventDto {
    let detail = match (&leaf.error, &leaf.serial, leaf.not_after) {
        (Some(error), _, _) => Some(error.clone()),
        (None, Some(serial), Some(not_after)) => {
            Some(format!("serial {serial}, valid until {}", humantime::format_rfc3339_seconds(not_after)))
        }
        _ => None,
    };
    event(now, &leaf.service.proxy_id(), leaf.kind.as_str(), None, detail)
}

fn exit_text(exit: Option<ExitReason>) -> String {
    match exit {
        Some(exit) => exit.to_string(),
        None => "exit status unknown (an adopted process)".to_owned(),
    }
}

/// The events between two statuses of one proxy.
pub(crate) fn diff(before: Option<&Seen>, after: &ProxyStatus, now: SystemTime) -> Vec<EventDto> {
    let id = &after.id;
    let mut found = Vec::new();
    let (was_pid, was_state, was_restarts) = match before {
        Some(before) => (before.pid, Some(before.state), before.restarts),
        None => (None, None, after.figures.restarts),
    };
    if let Some(old) = was_pid.filter(|old| after.figures.pid != Some(*old)) {
        if was_state == Some(ProxyState::Stopping) || after.state == ProxyState::Stopping {
            found.push(event(now, id, "stopped", Some(old), after.figures.last_exit.map(|exit| exit_text(Some(exit)))));
        } else {
            found.push(event(now, id, "exited", Some(old), Some(exit_text(after.figures.last_exit))));
        }
    }
    if let Some(new) = after.figures.pid.filter(|new| was_pid != Some(*new)) {
        let name = if before.is_some() && after.figures.restarts > was_restarts { "restarted" } else { "started" };
        found.push(event(now, id, name, Some(new), None));
    }
    let same_instance = after.figures.pid.is_some() && was_pid == after.figures.pid;
    if same_instance && was_state == Some(ProxyState::Starting) && after.state == ProxyState::Running {
        // Its readiness check passed (without one, a proxy is running once it runs).
        found.push(event(now, id, "ready", after.figures.pid, None));
    }
    let was_error = before.and_then(|before| before.error.as_deref());
    if after.state == ProxyState::Running
        && after.figures.error.is_some()
        && after.figures.error.as_deref() != was_error
    {
        // A running proxy shows an error only when its liveness check fails.
        found.push(event(now, id, "unhealthy", after.figures.pid, after.figures.error.clone()));
    }
    let was_reload = before.and_then(|before| before.last_reload.as_deref());
    if let Some(reload) =
        after.figures.reloads.as_ref().map(|reloads| &reloads.last).filter(|last| Some(*last) != was_reload)
    {
        let (name, detail) = if reload.result.succeeded() {
            ("reloaded", Some(reload.result.to_string()))
        } else {
            let why = reload.error.as_deref().unwrap_or("no reason given");
            ("reload-failed", Some(format!("{}: {why}", reload.result)))
        };
        found.push(event(now, id, name, after.figures.pid, detail));
    }
    if was_state != Some(after.state) {
        let name = match after.state {
            ProxyState::Backoff => Some("backoff"),
            ProxyState::Failed => Some("failed"),
            ProxyState::Stopped => Some("held"),
            ProxyState::Blocked => Some("blocked"),
            ProxyState::Waiting => Some("waiting"),
            _ => None,
        };
        if let Some(name) = name {
            found.push(event(now, id, name, after.figures.pid, after.figures.error.clone()));
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use tether_state::ProcessFigures;

    use super::*;

    fn status(state: ProxyState, pid: Option<u32>, restarts: u64) -> ProxyStatus {
        let id = ProxyId::parse("web-proxy").unwrap();
        ProxyStatus {
            update: None,
            generations: None,
            service: id.service_id(),
            id,
            state,
            figures: ProcessFigures { pid, restarts, ..ProcessFigures::default() },
            usage: None,
            applied_revision: None,
        }
    }

    fn names(before: Option<&ProxyStatus>, after: &ProxyStatus) -> Vec<(&'static str, Option<u32>)> {
        diff(before.map(Seen::of).as_ref(), after, SystemTime::UNIX_EPOCH)
            .into_iter()
            .map(|event| (event.event, event.pid))
            .collect()
    }

    #[test]
    fn a_reader_compares_with_what_it_kept_of_each_proxy() {
        let mut events = Events { seen: HashMap::new() };
        let running = status(ProxyState::Running, Some(10), 0);
        let told = |events: Vec<EventDto>| events.into_iter().map(|event| (event.event, event.pid)).collect::<Vec<_>>();
        let now = SystemTime::UNIX_EPOCH;
        assert_eq!(told(events.on(&ProxyEvent::Changed(running.clone()), now)), [("started", Some(10))]);
        assert_eq!(events.seen[&running.id], Seen::of(&running));
        assert_eq!(told(events.on(&ProxyEvent::Changed(running.clone()), now)), []);
        // A reader that fell behind compares with the statuses as they are now.
        let restarted = status(ProxyState::Running, Some(11), 1);
        let mut other = status(ProxyState::Failed, None, 0);
        other.id = ProxyId::parse("db-proxy").unwrap();
        let found = told(events.resync(vec![restarted.clone(), other.clone()], now));
        assert_eq!(found.len(), 3);
        assert!(found.contains(&("exited", Some(10))) && found.contains(&("restarted", Some(11))));
        assert!(found.contains(&("failed", None)));
        assert_eq!(told(events.resync(vec![other.clone()], now)), [("removed", Some(11))]);
        assert_eq!(told(events.on(&ProxyEvent::Removed(other.id.clone()), now)), [("removed", None)]);
        assert!(events.seen.is_empty());
    }

    #[test]
    fn a_killed_proxy_exits_and_is_restarted() {
        let running = status(ProxyState::Running, Some(10), 0);
        assert_eq!(names(None, &running), [("started", Some(10))]);
        let mut exited = status(ProxyState::Starting, None, 0);
        exited.figures.last_exit = Some(ExitReason::Signal(9));
        let events = diff(Some(&Seen::of(&running)), &exited, SystemTime::UNIX_EPOCH);
        assert_eq!(events.len(), 1);
        assert_eq!((events[0].event, events[0].pid), ("exited", Some(10)));
        assert_eq!(events[0].detail.as_deref(), Some("killed by signal 9"));
        let restarted = status(ProxyState::Running, Some(11), 1);
        assert_eq!(names(Some(&exited), &restarted), [("restarted", Some(11))]);
        // Both in one change: the exit comes first.
        assert_eq!(names(Some(&running), &restarted), [("exited", Some(10)), ("restarted", Some(11))]);
    }

    #[test]
    fn stops_backoffs_and_failures_are_named() {
        let running = status(ProxyState::Running, Some(10), 0);
        let stopping = status(ProxyState::Stopping, Some(10), 0);
        assert_eq!(names(Some(&running), &stopping), []);
        let stopped = status(ProxyState::Stopping, None, 0);
        assert_eq!(names(Some(&stopping), &stopped), [("stopped", Some(10))]);
        let backoff = status(ProxyState::Backoff, None, 2);
        assert_eq!(names(Some(&running), &backoff), [("exited", Some(10)), ("backoff", None)]);
        let failed = status(ProxyState::Failed, None, 0);
        assert_eq!(names(None, &failed), [("failed", None)]);
        assert_eq!(names(Some(&failed), &failed), []);
    }

    #[test]
    fn waiting_for_dependencies_is_named_with_what_it_waits_for() {
        let pending = status(ProxyState::Pending, None, 0);
        let mut waiting = status(ProxyState::Waiting, None, 0);
        waiting.figures.error = Some("waiting for db-proxy to be ready (it is starting)".into());
        let events = diff(Some(&Seen::of(&pending)), &waiting, SystemTime::UNIX_EPOCH);
        assert_eq!((events.len(), events[0].event), (1, "waiting"));
        assert_eq!(events[0].detail, waiting.figures.error);
        assert_eq!(names(Some(&waiting), &waiting), []);
        let started = status(ProxyState::Starting, Some(10), 0);
        assert_eq!(names(Some(&waiting), &started), [("started", Some(10))]);
    }

    #[test]
    fn readiness_and_failing_liveness_are_named() {
        let starting = status(ProxyState::Starting, Some(10), 0);
        assert_eq!(names(None, &starting), [("started", Some(10))]);
        let running = status(ProxyState::Running, Some(10), 0);
        assert_eq!(names(Some(&starting), &running), [("ready", Some(10))]);
        let mut unhealthy = running.clone();
        unhealthy.figures.error = Some("liveness probe tcp 127.0.0.1:1: connect: refused".into());
        let events = diff(Some(&Seen::of(&running)), &unhealthy, SystemTime::UNIX_EPOCH);
        assert_eq!((events.len(), events[0].event), (1, "unhealthy"));
        assert_eq!(events[0].detail, unhealthy.figures.error);
        assert_eq!(names(Some(&unhealthy), &unhealthy), []);
        // Without a readiness check a proxy is running once it runs: started, not ready.
        assert_eq!(names(Some(&status(ProxyState::Starting, None, 0)), &running), [("started", Some(10))]);
    }

    #[test]
    fn a_new_last_reload_is_reloaded_or_reload_failed() {
        use tether_state::{ReloadOutcome, ReloadResult, Reloads};
        let running = status(ProxyState::Running, Some(10), 0);
        let applied = Reloads::after(None, ReloadOutcome::now(ReloadResult::Applied, None));
        let with = |reloads| ProxyStatus {
            figures: ProcessFigures { reloads: Some(Box::new(reloads)), ..running.figures.clone() },
            ..running.clone()
        };
        let reloaded = with(applied.clone());
        assert_eq!(names(Some(&running), &reloaded), [("reloaded", Some(10))]);
        assert_eq!(names(Some(&reloaded), &reloaded.clone()), [], "the same reload is told once");
        let refused =
            Reloads::after(Some(&applied), ReloadOutcome::now(ReloadResult::Refused, Some("bad line 3".into())));
        let failed = with(refused);
        let events = diff(Some(&Seen::of(&reloaded)), &failed, SystemTime::UNIX_EPOCH);
        assert_eq!((events.len(), events[0].event), (1, "reload-failed"));
        assert_eq!(events[0].detail.as_deref(), Some("refused: bad line 3"));
    }
}
