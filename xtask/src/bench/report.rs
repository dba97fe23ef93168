//! The end-to-end figures as rows of a Markdown table, the statistics behind them, and
//! `BENCHMARKS.md`.

use std::fmt::Write as _;
use std::fs;
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Whether a row's target was met.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Met {
    Yes,
    No,
    /// No target: the row informs.
    Info,
}

/// One row: figure, baseline, tether's value, their ratio, the target, met or not.
#[derive(Debug, Clone)]
pub(crate) struct Row {
    pub(crate) figure: String,
    pub(crate) baseline: String,
    pub(crate) value: String,
    pub(crate) ratio: String,
    pub(crate) target: String,
    pub(crate) met: Met,
}

impl Row {
    pub(crate) fn new(figure: &str, baseline: String, value: String, ratio: String, target: &str, met: Met) -> Self {
        Self { figure: figure.to_owned(), baseline, value, ratio, target: target.to_owned(), met }
    }

    /// A figure that could not be measured.
    pub(crate) fn failed(figure: &str, error: &str) -> Self {
        Self::new(figure, "—".into(), format!("not measured: {error}"), "—".into(), "—", Met::No)
    }
}

pub(crate) fn met(ok: bool) -> Met {
    if ok { Met::Yes } else { Met::No }
}

/// `a / b` to two decimals, or `—` when `b` is zero.
pub(crate) fn ratio(a: f64, b: f64) -> String {
    if b > 0.0 { format!("{:.2}", a / b) } else { "—".to_owned() }
}

/// Milliseconds, three decimals.
pub(crate) fn ms(duration: Duration) -> String {
    format!("{:.3} ms", duration.as_secs_f64() * 1e3)
}

/// Seconds, three decimals.
pub(crate) fn secs(duration: Duration) -> String {
    format!("{:.3} s", duration.as_secs_f64())
}

/// The `p`-th percentile (nearest rank) of `samples`; zero for none.
pub(crate) fn percentile(samples: &[Duration], p: f64) -> Duration {
    let mut sorted = samples.to_vec();
    sorted.sort();
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss, clippy::cast_precision_loss)]
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

pub(crate) fn median(samples: &[Duration]) -> Duration {
    percentile(samples, 50.0)
}

/// The table, in Markdown.
pub(crate) fn table(rows: &[Row]) -> String {
    let mut out = String::from("| figure | baseline (same run) | tether | ratio | target | met? |\n");
    out.push_str("| --- | --- | --- | --- | --- | --- |\n");
    for row in rows {
        let met = match row.met {
            Met::Yes => "yes",
            Met::No => "**no**",
            Met::Info => "—",
        };
        let cell = |text: &str| text.replace('|', "\\|").replace('\n', " ");
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {met} |",
            cell(&row.figure),
            cell(&row.baseline),
            cell(&row.value),
            cell(&row.ratio),
            cell(&row.target)
        );
    }
    out
}

/// The machine the figures were measured on.
pub(crate) struct Machine {
    pub(crate) date: String,
    pub(crate) nproc: usize,
    pub(crate) kernel: String,
    pub(crate) load_before: String,
    pub(crate) load_after: String,
}

impl Machine {
    pub(crate) fn now() -> Self {
        let seconds = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        Self {
            date: utc_date(seconds),
            nproc: std::thread::available_parallelism().map_or(1, usize::from),
            kernel: fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default().trim().to_owned(),
            load_before: load_average(),
            load_after: String::new(),
        }
    }
}

/// The 1, 5 and 15 minute load averages.
pub(crate) fn load_average() -> String {
    let text = fs::read_to_string("/proc/loadavg").unwrap_or_default();
    text.split_whitespace().take(3).collect::<Vec<_>>().join(" ")
}

/// `seconds` since the epoch as `YYYY-MM-DD HH:MM UTC`.
pub(crate) fn utc_date(seconds: u64) -> String {
    let days = i64::try_from(seconds / 86_400).unwrap_or(0);
    let rest = seconds % 86_400;
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02} {:02}:{:02} UTC", rest / 3_600, rest % 3_600 / 60)
}

/// The rows of one section of a run, with when and under what load they were measured.
#[derive(Debug)]
pub(crate) struct Section {
    pub(crate) name: &'static str,
    date: String,
    load_before: String,
    load_after: String,
    pub(crate) rows: Vec<Row>,
}

/// A run's sections, in the order they ran.
#[derive(Debug, Default)]
pub(crate) struct Report {
    sections: Vec<Section>,
}

impl Report {
    /// Ends the section that runs (if any) and starts `name`'s; returns its rows to fill.
    pub(crate) fn begin(&mut self, name: &'static str) -> &mut Vec<Row> {
        self.end();
        let seconds = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        self.sections.push(Section {
            name,
            date: utc_date(seconds),
            load_before: load_average(),
            load_after: String::new(),
            rows: Vec::new(),
        });
        &mut self.sections.last_mut().expect("just pushed").rows
    }

    /// The rows of the section that runs.
    pub(crate) fn current(&mut self) -> &mut Vec<Row> {
        &mut self.sections.last_mut().expect("a section runs").rows
    }

    /// Ends the section that runs: its load after.
    pub(crate) fn end(&mut self) {
        if let Some(last) = self.sections.last_mut().filter(|last| last.load_after.is_empty()) {
            last.load_after = load_average();
        }
    }

    /// Every row of the run, in order.
    pub(crate) fn rows(&self) -> impl Iterator<Item = &Row> {
        self.sections.iter().flat_map(|section| &section.rows)
    }
}

/// The line that opens a section's block in `BENCHMARKS.md`; a partial run replaces the
/// blocks of the sections it ran and keeps the others.
fn marker(name: &str) -> String {
    format!("<!-- section: {name} -->")
}

/// One section's block: marker, heading, when it was measured, its table.
fn block(section: &Section, title: &str) -> String {
    let rows: Vec<Row> = section.rows.clone();
    format!(
        "{}\n### {title} (`{}`)\n\nMeasured {}; load average (1, 5, 15 min) {} before, {} after.\n\n{}",
        marker(section.name),
        section.name,
        section.date,
        section.load_before,
        section.load_after,
        table(&rows)
    )
}

/// What `BENCHMARKS.md` says before its sections.
const PREAMBLE: &str = "# Benchmarks\n\n\
    End-to-end figures of the release `tether` binary with real processes, written by\n\
    `cargo xtask bench` (which first runs every crate's own benchmarks). Each figure sits\n\
    next to a baseline measured in the same run on the same machine. A whole run rewrites\n\
    this file; `XTASK_BENCH_ONLY=SECTION,...` replaces only the sections it names, so each\n\
    section says when it was measured and under what load.\n\n\
    Bring-up is counted two ways. *Seen from outside* (section `bring-up`) runs from the\n\
    start of each peer (a raw spawn loop, s6, tether) until a scan of `/proc` every 2 ms\n\
    finds every child running its own program: what a user's monitoring sees, the same\n\
    method for all, the scan's own cost included for all. *As the agent counts it* runs\n\
    from the agent's start until its API lists every proxy `running`, and its baseline is a\n\
    raw spawn loop that is timed until its last `spawn` returns, with no scan beside it.\n\
    The two differ in what ends the clock (an exec seen in `/proc` against the agent's own\n\
    record of each start) and in what runs meanwhile (the scan takes a share of the CPU\n\
    from every peer alike), so their ratios are not interchangeable.\n\n";

/// Writes `BENCHMARKS.md` at `root` for a whole run: every section of `report`, in
/// `order` (name and title of each section).
pub(crate) fn write(
    root: &Path,
    machine: &Machine,
    report: &Report,
    order: &[(&str, &str)],
    notes: &[String],
) -> Result<(), String> {
    let mut text = String::from(PREAMBLE);
    text.push_str("The last whole run:\n\n");
    let _ = writeln!(text, "- date: {}", machine.date);
    let _ = writeln!(text, "- nproc: {}", machine.nproc);
    let _ = writeln!(text, "- kernel: {}", machine.kernel);
    let _ =
        writeln!(text, "- load average (1, 5, 15 min): {} before, {} after", machine.load_before, machine.load_after);
    for note in notes {
        let _ = writeln!(text, "- {note}");
    }
    text.push('\n');
    for (name, title) in order {
        if let Some(section) = report.sections.iter().find(|section| section.name == *name) {
            text.push_str(&block(section, title));
            text.push('\n');
        }
    }
    let path = root.join("BENCHMARKS.md");
    fs::write(&path, text.trim_end().to_owned() + "\n").map_err(|err| format!("{}: {err}", path.display()))
}

/// Replaces, in `BENCHMARKS.md` at `root`, the blocks of the sections `report` ran, and
/// adds those it did not hold; the others and the lines before them stay as they were.
pub(crate) fn merge(root: &Path, report: &Report, order: &[(&str, &str)]) -> Result<(), String> {
    let path = root.join("BENCHMARKS.md");
    let old = fs::read_to_string(&path).map_err(|err| format!("{}: {err}", path.display()))?;
    let text = merged(&old, report, order).ok_or_else(|| {
        format!("{}: no `<!-- section: … -->` blocks to replace; a whole run writes them", path.display())
    })?;
    fs::write(&path, text).map_err(|err| format!("{}: {err}", path.display()))
}

/// `old` with the sections of `report` in place of theirs, or `None` when `old` has none.
fn merged(old: &str, report: &Report, order: &[(&str, &str)]) -> Option<String> {
    let first = old.find("<!-- section: ")?;
    let (head, mut rest) = old.split_at(first);
    let mut blocks: Vec<(String, String)> = Vec::new();
    while let Some(body) = rest.strip_prefix("<!-- section: ") {
        let name = body[..body.find(" -->")?].to_owned();
        let end = body.find("\n<!-- section: ").map_or(rest.len(), |at| at + 1 + "<!-- section: ".len());
        blocks.push((name, rest[..end].trim_end().to_owned() + "\n"));
        rest = &rest[end..];
    }
    for section in &report.sections {
        let title = order.iter().find(|(name, _)| *name == section.name).map_or(section.name, |(_, title)| title);
        let new = block(section, title);
        match blocks.iter_mut().find(|(name, _)| name == section.name) {
            Some(existing) => existing.1 = new,
            None => blocks.push((section.name.to_owned(), new)),
        }
    }
    let rank = |name: &str| order.iter().position(|(known, _)| *known == name).unwrap_or(usize::MAX);
    blocks.sort_by_key(|(name, _)| rank(name));
    let mut text = head.to_owned();
    for (_, block) in &blocks {
        text.push_str(block);
        text.push('\n');
    }
    Some(text.trim_end().to_owned() + "\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_use_the_nearest_rank() {
        let samples: Vec<Duration> = (1..=200).rev().map(Duration::from_millis).collect();
        assert_eq!(median(&samples), Duration::from_millis(100));
        assert_eq!(percentile(&samples, 99.0), Duration::from_millis(198));
        assert_eq!(percentile(&samples, 100.0), Duration::from_millis(200));
        assert_eq!(median(&[]), Duration::ZERO);
    }

    #[test]
    fn dates_are_civil_utc() {
        assert_eq!(utc_date(0), "1970-01-01 00:00 UTC");
        assert_eq!(utc_date(951_782_400 + 3_661), "2000-02-29 01:01 UTC");
        assert_eq!(utc_date(1_767_225_600), "2026-01-01 00:00 UTC");
    }

    #[test]
    fn a_partial_run_replaces_its_sections_and_keeps_the_others() {
        let order = [("many", "1 000 proxies"), ("health", "health checks"), ("xds", "xDS")];
        let row = |figure: &str| Row::new(figure, "b".into(), "v".into(), "—".into(), "—", Met::Info);
        let mut whole = Report::default();
        whole.begin("many").push(row("old many"));
        whole.begin("health").push(row("old health"));
        whole.end();
        let dir = tempdir();
        let machine = Machine::now();
        write(&dir, &machine, &whole, &order, &["a note".to_owned()]).unwrap();
        let mut partial = Report::default();
        partial.begin("xds").push(row("new xds"));
        partial.begin("many").push(row("new many"));
        partial.end();
        merge(&dir, &partial, &order).unwrap();
        let text = fs::read_to_string(dir.join("BENCHMARKS.md")).unwrap();
        assert!(text.starts_with(PREAMBLE) && text.contains("- a note"), "{text}");
        let at = |needle: &str| text.find(needle).unwrap_or_else(|| panic!("no {needle} in {text}"));
        assert!(!text.contains("old many"), "{text}");
        assert!(at("new many") < at("old health") && at("old health") < at("new xds"), "in order: {text}");
        assert_eq!(text.matches("<!-- section: ").count(), 3, "{text}");
        // Merged again, nothing grows.
        merge(&dir, &partial, &order).unwrap();
        assert_eq!(fs::read_to_string(dir.join("BENCHMARKS.md")).unwrap(), text);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_file_without_sections_is_not_merged_into() {
        let mut partial = Report::default();
        partial.begin("xds");
        assert_eq!(merged("# Benchmarks\n\n| figure |\n", &partial, &[]), None);
    }

    /// A fresh directory under the system's temp dir.
    fn tempdir() -> std::path::PathBuf {
        let dir =
            std::env::temp_dir().join(format!("xtask-report-{}-{:?}", std::process::id(), std::thread::current().id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn the_table_escapes_cells() {
        let rows = [Row::new("a|b", "1".into(), "2".into(), ratio(2.0, 1.0), "≤ 3", Met::Yes)];
        let table = table(&rows);
        assert!(table.contains("| a\\|b | 1 | 2 | 2.00 | ≤ 3 | yes |"), "{table}");
    }
}
