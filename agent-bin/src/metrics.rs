//! `GET /metrics`: the agent's Prometheus metrics.
//!
//! Values are read from the manager's published view at scrape time, so that nothing is
//! counted twice and an idle agent does no work for metrics. This module only reads.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::NoLabelSet as NoLabels;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;
use tether_manager::{BackendStats, ExitReason, ManagerHandle, PASS_BUCKETS, ProxyState, ProxyStatus, ResourceUsage};
use tether_state::ReloadResult;

/// The agent's metrics registry.
#[derive(Debug)]
pub(crate) struct Metrics {
    registry: Registry,
}

impl Metrics {
    /// The metrics of `manager`'s proxies and backend; with `measured` (the backend measures
    /// usage: it has cgroups), also each proxy's CPU, memory and tasks.
    pub(crate) fn new(manager: ManagerHandle, measured: bool) -> Self {
        let mut registry = Registry::default();
        registry.register_collector(Box::new(ManagerCollector { manager, measured }));
        Self { registry }
    }

    /// Adds another source of metrics, read at scrape time like the manager's.
    pub(crate) fn register(&mut self, collector: Box<dyn Collector>) {
        self.registry.register_collector(collector);
    }

    /// The Prometheus text exposition of every metric.
    pub(crate) fn render(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::prometheus_text::encode(&mut out, &self.registry);
        out
    }
}

/// One figure of a proxy's usage, where the backend measures it.
type UsageField = fn(&ResourceUsage) -> Option<u64>;

/// What each proxy has used, as its status carries it: CPU time, and memory and tasks where
/// the backend measures them (their cgroup controllers are on).
fn encode_usage(statuses: &[ProxyStatus], encoder: &mut DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
    let usages: Vec<_> =
        statuses.iter().filter_map(|status| Some((&status.id, &status.service, status.usage.as_deref()?))).collect();
    let counter = ConstCounter::new(0.0f64);
    let mut family = encoder.encode_descriptor(
        "tether_proxy_cpu_seconds",
        "CPU time (user and system) of a proxy's running instance and everything in its cgroup",
        None,
        counter.metric_type(),
    )?;
    for (id, service, usage) in &usages {
        let labels = [("proxy", id.as_str()), ("service", service.as_str())];
        ConstCounter::new(usage.cpu.as_secs_f64()).encode(family.encode_family(&labels)?)?;
    }
    let gauges: [(&str, &str, UsageField); 2] = [
        ("tether_proxy_memory_bytes", "Memory of a proxy's cgroup (memory.current)", |u| u.memory_bytes),
        ("tether_proxy_tasks", "Processes and threads in a proxy's cgroup (pids.current)", |u| u.tasks),
    ];
    for (name, help, value) in gauges {
        let gauge = ConstGauge::new(0i64);
        let mut family = encoder.encode_descriptor(name, help, None, gauge.metric_type())?;
        for (id, service, usage) in &usages {
            if let Some(value) = value(usage) {
                let labels = [("proxy", id.as_str()), ("service", service.as_str())];
                ConstGauge::new(i64::try_from(value).unwrap_or(i64::MAX)).encode(family.encode_family(&labels)?)?;
            }
        }
    }
    Ok(())
}

/// The backend's own figures: probe durations and ignored notifications.
fn encode_backend(stats: &BackendStats, encoder: &mut DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
    if let Some(durations) = &stats.probe_durations {
        let histogram_type = prometheus_client::metrics::MetricType::Histogram;
        let mut metric = encoder.encode_descriptor(
            "tether_probe_duration_seconds",
            "Readiness and liveness probes (tcp, http, exec) by duration",
            None,
            histogram_type,
        )?;
        // Counts per bucket; the encoder makes them cumulative.
        let buckets: Vec<(f64, u64)> = durations
            .bounds
            .iter()
            .copied()
            .chain(std::iter::once(f64::INFINITY))
            .zip(durations.counts.iter().copied())
            .collect();
        metric.encode_histogram::<NoLabels>(durations.sum_seconds, durations.count(), &buckets, None)?;
    }
    let counter = ConstCounter::new(stats.foreign_notifications);
    let metric = encoder.encode_descriptor(
        "tether_notify_foreign",
        "sd_notify datagrams ignored because their sender was no proxy's instance",
        None,
        counter.metric_type(),
    )?;
    counter.encode(metric)
}

/// The states a proxy can be in, all reported (zero included) so that dashboards and
/// alerts see every series.
const STATES: [ProxyState; 9] = [
    ProxyState::Pending,
    ProxyState::Waiting,
    ProxyState::Starting,
    ProxyState::Running,
    ProxyState::Backoff,
    ProxyState::Stopping,
    ProxyState::Stopped,
    ProxyState::Blocked,
    ProxyState::Failed,
];

#[derive(Debug)]
struct ManagerCollector {
    manager: ManagerHandle,
    /// Whether the backend measures usage, so that the usage families are shown.
    measured: bool,
}

impl Collector for ManagerCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let statuses = self.manager.status();
        let stats = self.manager.stats();

        let gauge = ConstGauge::new(0i64);
        let mut family =
            encoder.encode_descriptor("tether_proxies", "Managed proxies by state", None, gauge.metric_type())?;
        for state in STATES {
            let count = statuses.iter().filter(|s| s.state == state).count();
            let labels = [("state", state.as_str())];
            ConstGauge::new(i64::try_from(count).unwrap_or(i64::MAX)).encode(family.encode_family(&labels)?)?;
        }

        let counter = ConstCounter::new(0u64);
        let mut family = encoder.encode_descriptor(
            "tether_proxy_restarts",
            "Restarts of a proxy's process after it exited",
            None,
            counter.metric_type(),
        )?;
        for status in &statuses {
            let labels = [("proxy", status.id.as_str()), ("service", status.service.as_str())];
            ConstCounter::new(status.figures.restarts).encode(family.encode_family(&labels)?)?;
        }

        let mut family = encoder.encode_descriptor(
            "tether_proxy_probe_failures",
            "Failed readiness and liveness checks of a proxy",
            None,
            counter.metric_type(),
        )?;
        for status in &statuses {
            let labels = [("proxy", status.id.as_str()), ("service", status.service.as_str())];
            ConstCounter::new(status.figures.probe_failures).encode(family.encode_family(&labels)?)?;
        }

        // Reloads in place, of the proxies that had one since the agent started.
        let mut family = encoder.encode_descriptor(
            "tether_proxy_reloads",
            "Reloads of a proxy in place, by result",
            None,
            counter.metric_type(),
        )?;
        for status in &statuses {
            let Some(reloads) = &status.figures.reloads else { continue };
            for result in ReloadResult::ALL {
                let labels = [("proxy", status.id.as_str()), ("result", result.as_str())];
                ConstCounter::new(reloads.counts.get(result)).encode(family.encode_family(&labels)?)?;
            }
        }
        let seconds = ConstGauge::new(0.0f64);
        let mut family = encoder.encode_descriptor(
            "tether_proxy_last_reload_success_timestamp_seconds",
            "When a proxy's last reload in place that succeeded (applied or signalled) ended, in Unix seconds",
            None,
            seconds.metric_type(),
        )?;
        for status in &statuses {
            let Some(at) = status.figures.reloads.as_ref().and_then(|reloads| reloads.last_success) else { continue };
            let unix = at.duration_since(std::time::UNIX_EPOCH).map_or(0.0, |since| since.as_secs_f64());
            ConstGauge::new(unix).encode(family.encode_family(&[("proxy", status.id.as_str())])?)?;
        }

        let mut family = encoder.encode_descriptor(
            "tether_proxy_ready",
            "Whether a proxy is ready: 1 while running (its readiness check, if any, passed), else 0",
            None,
            gauge.metric_type(),
        )?;
        for status in &statuses {
            let labels = [("proxy", status.id.as_str()), ("service", status.service.as_str())];
            ConstGauge::new(i64::from(status.ready())).encode(family.encode_family(&labels)?)?;
        }

        {
            let histogram_type = prometheus_client::metrics::MetricType::Histogram;
            let mut metric = encoder.encode_descriptor(
                "tether_reconcile_duration_seconds",
                "Reconcile passes by duration",
                None,
                histogram_type,
            )?;
            let buckets: Vec<(f64, u64)> = PASS_BUCKETS
                .iter()
                .copied()
                .chain(std::iter::once(f64::INFINITY))
                .zip(stats.pass_buckets.iter().copied())
                .collect();
            metric.encode_histogram::<NoLabels>(stats.total_duration.as_secs_f64(), stats.passes, &buckets, None)?;
        }
        {
            let counter = ConstCounter::new(0u64);
            let mut family = encoder.encode_descriptor(
                "tether_actions",
                "Actions run on proxies, by kind and result",
                None,
                counter.metric_type(),
            )?;
            for ((kind, succeeded), count) in &stats.actions_by_kind {
                let labels = [("kind", kind.as_str()), ("result", if *succeeded { "ok" } else { "error" })];
                ConstCounter::new(*count).encode(family.encode_family(&labels)?)?;
            }
        }
        {
            let counter = ConstCounter::new(0u64);
            let mut family = encoder.encode_descriptor(
                "tether_proxy_exits",
                "Exits of proxy processes, by exit code or signal",
                None,
                counter.metric_type(),
            )?;
            for (exit, count) in &stats.exits {
                let (how, value) = match exit {
                    ExitReason::Code(code) => ("code", code.to_string()),
                    ExitReason::Signal(signal) => ("signal", signal.to_string()),
                };
                let labels = [("exit", how), ("value", value.as_str())];
                ConstCounter::new(*count).encode(family.encode_family(&labels)?)?;
            }
        }
        {
            let counter = ConstCounter::new(0u64);
            let mut family = encoder.encode_descriptor(
                "tether_adoptions",
                "Proxies from an earlier agent: adopted on proof, or dropped as unprovable",
                None,
                counter.metric_type(),
            )?;
            ConstCounter::new(stats.adopted).encode(family.encode_family(&[("result", "adopted")])?)?;
            ConstCounter::new(stats.dropped).encode(family.encode_family(&[("result", "dropped")])?)?;
        }
        for (name, help, value) in [
            ("tether_reconcile_passes", "Reconcile passes", stats.passes),
            ("tether_action_failures", "Actions that failed", stats.failures),
            ("tether_snapshot_writes", "Snapshots written", stats.snapshot_writes),
            ("tether_snapshot_write_failures", "Snapshot writes that failed", stats.snapshot_failures),
        ] {
            let counter = ConstCounter::new(value);
            counter.encode(encoder.encode_descriptor(name, help, None, counter.metric_type())?)?;
        }
        for (name, help, value) in [
            ("tether_actions_in_flight", "Actions running now", stats.in_flight),
            (
                "tether_reconcile_deferred",
                "Proxies whose latest change is held back because they keep changing",
                stats.deferred,
            ),
        ] {
            let gauge = ConstGauge::new(i64::try_from(value).unwrap_or(i64::MAX));
            gauge.encode(encoder.encode_descriptor(name, help, None, gauge.metric_type())?)?;
        }
        encode_backend(&self.manager.backend_stats(), &mut encoder)?;
        if self.measured {
            encode_usage(&statuses, &mut encoder)?;
        }
        Ok(())
    }
}
