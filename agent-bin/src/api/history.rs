//! `GET /v1/agent/history`: the events of the last hour, oldest first, so that a page or a
//! command opened now can show what happened before it looked.
//!
//! One [`Follower`] (the same reader that feeds each client of the events stream) runs for
//! the agent's life and keeps what it tells in memory, never on disk: an hour at most, the
//! last [`PER_PROXY`] events of each proxy and [`TOTAL`] in all, the oldest dropped first.
//! An agent started again starts with an empty history.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use axum::Json;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use serde::Deserialize;
use tether_state::lock;

use super::dto::EventDto;
use super::events::Follower;
use super::{ApiError, ApiState};

/// The longest the history reaches back.
pub(crate) const SPAN: Duration = Duration::from_secs(3600);

/// The most events kept of one proxy: a proxy that keeps crashing cannot push the others out.
const PER_PROXY: usize = 256;

/// The most events kept in all: about 50 MiB at most, whatever the number of proxies.
const TOTAL: usize = 100_000;

/// What the agent told during the last hour.
#[derive(Clone, Default)]
pub(crate) struct History(Arc<Mutex<Kept>>);

#[derive(Default)]
struct Kept {
    /// Every kept event, oldest first.
    all: VecDeque<KeptEvent>,
    /// How many of `all` each proxy has, under the name its events share.
    counts: HashMap<Arc<str>, usize>,
    /// How many of `all` are the agent's own.
    own: usize,
}

/// An event as the history keeps it: [`EventDto`] with its proxy's name shared by every
/// event of the proxy, and its time not yet written out (at 10 000 proxies, the history of
/// a start holds about 16 000 events).
struct KeptEvent {
    time: SystemTime,
    proxy: Option<Arc<str>>,
    event: &'static str,
    pid: Option<u32>,
    detail: Option<Box<str>>,
}

impl KeptEvent {
    fn told(&self) -> EventDto {
        EventDto {
            time: self.time,
            proxy: self.proxy.as_deref().map(str::to_owned),
            event: self.event,
            pid: self.pid,
            detail: self.detail.as_deref().map(str::to_owned),
        }
    }
}

impl History {
    /// Keeps `found`, and forgets what is older than [`SPAN`] at `now` or over the bounds.
    fn keep(&self, found: Vec<EventDto>, now: SystemTime) {
        let mut kept = lock(&self.0);
        for event in found {
            let proxy = event.proxy.as_deref().map(|proxy| kept.name(proxy));
            let count = kept.count(proxy.as_ref());
            *count += 1;
            let over = *count > PER_PROXY;
            kept.all.push_back(KeptEvent {
                time: event.time,
                proxy: proxy.clone(),
                event: event.event,
                pid: event.pid,
                detail: event.detail.map(String::into_boxed_str),
            });
            if over {
                // The proxy's oldest event goes; the others keep theirs.
                if let Some(at) = kept.all.iter().position(|event| event.proxy == proxy) {
                    kept.all.remove(at);
                    kept.forget_one(proxy.as_ref());
                }
            }
        }
        while let Some(oldest) = kept.all.front() {
            let old = now.duration_since(oldest.time).is_ok_and(|age| age > SPAN);
            if !old && kept.all.len() <= TOTAL {
                break;
            }
            if let Some(event) = kept.all.pop_front() {
                kept.forget_one(event.proxy.as_ref());
            }
        }
    }

    /// The kept events seen within `span` before `now`, of `proxy` alone when given, oldest
    /// first.
    fn since(&self, now: SystemTime, span: Duration, proxy: Option<&str>) -> Vec<EventDto> {
        let kept = lock(&self.0);
        let from = now.checked_sub(span).unwrap_or(SystemTime::UNIX_EPOCH);
        kept.all
            .iter()
            .filter(|event| event.time >= from && proxy.is_none_or(|proxy| event.proxy.as_deref() == Some(proxy)))
            .map(KeptEvent::told)
            .collect()
    }
}

impl Kept {
    /// `proxy`'s name as its kept events share it.
    fn name(&self, proxy: &str) -> Arc<str> {
        match self.counts.get_key_value(proxy) {
            Some((name, _)) => Arc::clone(name),
            None => Arc::from(proxy),
        }
    }

    fn count(&mut self, proxy: Option<&Arc<str>>) -> &mut usize {
        match proxy {
            Some(proxy) => self.counts.entry(Arc::clone(proxy)).or_default(),
            None => &mut self.own,
        }
    }

    fn forget_one(&mut self, proxy: Option<&Arc<str>>) {
        match proxy {
            Some(proxy) => {
                if let Some(count) = self.counts.get_mut(proxy) {
                    *count -= 1;
                    if *count == 0 {
                        self.counts.remove(proxy);
                    }
                }
            }
            None => self.own = self.own.saturating_sub(1),
        }
    }
}

/// Keeps what a [`Follower`] tells until the API stops.
pub(crate) async fn record(state: ApiState) {
    let mut follower = Follower::new(&state);
    loop {
        let found = tokio::select! {
            () = state.shutdown.cancelled() => return,
            found = follower.next(&state) => match found {
                Some(found) => found,
                None => return,
            },
        };
        state.history.keep(found, SystemTime::now());
    }
}

#[derive(Debug, Deserialize)]
pub(crate) struct HistoryQuery {
    /// How far back, as a duration (`10m`); an hour when not given, at most an hour.
    since: Option<String>,
    /// One proxy's events only.
    proxy: Option<String>,
}

pub(crate) async fn get_history(
    State(state): State<ApiState>,
    Query(query): Query<HistoryQuery>,
) -> Result<Json<Vec<EventDto>>, ApiError> {
    let span = match query.since.as_deref() {
        Some(since) => humantime::parse_duration(since)
            .map_err(|err| ApiError::new(StatusCode::BAD_REQUEST, format!("invalid since {since:?}: {err}")))?,
        None => SPAN,
    };
    Ok(Json(state.history.since(SystemTime::now(), span.min(SPAN), query.proxy.as_deref())))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn told(at: SystemTime, proxy: &str, name: &'static str) -> EventDto {
        EventDto { time: at, proxy: Some(proxy.to_owned()), event: name, pid: None, detail: None }
    }

    fn names(events: &[EventDto]) -> Vec<(&str, &str)> {
        events.iter().map(|event| (event.proxy.as_deref().unwrap_or(""), event.event)).collect()
    }

    #[test]
    fn events_older_than_the_span_are_forgotten() {
        let history = History::default();
        let start = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        history.keep(vec![told(start, "a", "started")], start);
        let half = start + Duration::from_secs(1800);
        history.keep(vec![told(half, "a", "exited"), told(half, "b", "started")], half);
        let later = start + SPAN + Duration::from_secs(1);
        history.keep(vec![told(later, "b", "ready")], later);
        assert_eq!(names(&history.since(later, SPAN, None)), [("a", "exited"), ("b", "started"), ("b", "ready")]);
        assert_eq!(names(&history.since(later, Duration::from_secs(60), None)), [("b", "ready")]);
        assert_eq!(names(&history.since(later, SPAN, Some("a"))), [("a", "exited")]);
    }

    #[test]
    fn a_proxy_over_its_share_loses_its_own_oldest_events_not_the_others() {
        let history = History::default();
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        history.keep(vec![told(now, "quiet", "started")], now);
        history.keep((0..PER_PROXY + 10).map(|_| told(now, "noisy", "restarted")).collect(), now);
        let kept = history.since(now, SPAN, None);
        assert_eq!(kept.len(), PER_PROXY + 1);
        assert_eq!(names(&kept[..1]), [("quiet", "started")]);
        assert_eq!(history.since(now, SPAN, Some("noisy")).len(), PER_PROXY);
        // One name per proxy, shared by its events.
        let kept = lock(&history.0);
        let names: Vec<_> = kept.all.iter().filter_map(|event| event.proxy.as_ref()).collect();
        assert!(names[1..].iter().all(|name| Arc::ptr_eq(name, names[1])));
        assert_eq!(kept.counts.len(), 2);
    }

    #[test]
    fn the_agents_own_events_count_apart_and_the_time_is_written_in_milliseconds() {
        let history = History::default();
        let now = SystemTime::UNIX_EPOCH + Duration::from_millis(1_767_225_600_123);
        let own = EventDto { time: now, proxy: None, event: "store-lost", pid: None, detail: Some("gone".into()) };
        history.keep(vec![own.clone(), told(now, "a", "started")], now);
        assert_eq!(history.since(now, SPAN, None), [own, told(now, "a", "started")]);
        assert_eq!(lock(&history.0).own, 1);
        let line = serde_json::to_value(&history.since(now, SPAN, None)[0]).unwrap();
        assert_eq!(line["time"], "2026-01-01T00:00:00.123Z");
    }
}
