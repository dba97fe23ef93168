//! `GET /v1/agent/proxy/{id}/logs`: the last lines of a proxy's stdout or stderr log, and,
//! with `follow=true`, what is appended after them, across copy-truncate rotations.
//!
//! Socket only: a proxy's output may hold secrets. This module reads log files through the
//! data dir's `logs/` handle, never following a link, and never writes or rotates them
//! (`tether-proxy-daemon` does). File reads run on the blocking pool; a follower wakes on a
//! short timer only while a client follows. With `format=json`, each line is a
//! [`LogLineDto`], timed when the agent read it.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use axum::Extension;
use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use tether_state::persist::{DataDir, PrivateDir};
use tokio::sync::mpsc;

use super::dto::LogLineDto;
use super::{ApiError, ApiState, ChannelBody};

/// Lines shown when the request names no count: 20, as `tether logs` without `-n`.
const DEFAULT_LINES: usize = 20;

/// The most of a log that one answer starts with, whatever the line count asked for.
const MAX_TAIL_BYTES: u64 = 16 << 20;

/// How often a follower looks for new output.
const FOLLOW_POLL: Duration = Duration::from_millis(100);

/// The most a follower reads at once.
const CHUNK: u64 = 256 << 10;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct LogsQuery {
    stream: Option<String>,
    lines: Option<usize>,
    follow: Option<bool>,
    format: Option<String>,
}

/// The longest part of a line held while its end is not written yet: past it, the part is
/// sent as a line of its own.
const MAX_PARTIAL_LINE: usize = 64 << 10;

/// Turns a log's bytes into JSON lines ([`LogLineDto`]), holding a line whose end has not
/// come yet.
struct JsonLines {
    proxy: String,
    stream: &'static str,
    partial: Vec<u8>,
}

impl JsonLines {
    /// The whole lines of what `bytes` completes, read at `now`.
    fn lines(&mut self, bytes: &[u8], now: SystemTime) -> Vec<u8> {
        let mut out = Vec::new();
        let mut rest = bytes;
        while let Some(at) = rest.iter().position(|byte| *byte == b'\n') {
            self.partial.extend_from_slice(&rest[..at]);
            rest = &rest[at + 1..];
            self.line(now, &mut out);
        }
        self.partial.extend_from_slice(rest);
        if self.partial.len() > MAX_PARTIAL_LINE {
            self.line(now, &mut out);
        }
        out
    }

    /// The last line, if it has no newline yet.
    fn rest(&mut self, now: SystemTime) -> Vec<u8> {
        let mut out = Vec::new();
        if !self.partial.is_empty() {
            self.line(now, &mut out);
        }
        out
    }

    fn line(&mut self, now: SystemTime, out: &mut Vec<u8>) {
        let bytes = std::mem::take(&mut self.partial);
        let text = String::from_utf8_lossy(bytes.strip_suffix(b"\r").unwrap_or(&bytes)).into_owned();
        let line = LogLineDto {
            time: humantime::format_rfc3339_millis(now).to_string(),
            proxy: self.proxy.clone(),
            stream: self.stream.to_owned(),
            text,
        };
        // A struct of strings always serialises.
        if serde_json::to_writer(&mut *out, &line).is_ok() {
            out.push(b'\n');
        }
    }
}

pub(crate) async fn get_logs(
    State(state): State<ApiState>,
    Path(id): Path<String>,
    Query(query): Query<LogsQuery>,
    Extension(slots): Extension<super::StreamSlots>,
) -> Result<Response, ApiError> {
    let id = super::known_proxy(&state, &id)?;
    let (stdout, stderr) = DataDir::log_file_names(&id);
    let (name, stream) = match query.stream.as_deref().unwrap_or("stdout") {
        "stdout" => (stdout, "stdout"),
        "stderr" => (stderr, "stderr"),
        other => {
            let message = format!("stream must be `stdout` or `stderr`, not {other:?}");
            return Err(ApiError::new(StatusCode::BAD_REQUEST, message));
        }
    };
    let mut json = match query.format.as_deref().unwrap_or("text") {
        "text" => None,
        "json" => Some(JsonLines { proxy: id.as_str().to_owned(), stream, partial: Vec::new() }),
        other => {
            let message = format!("format must be `text` or `json`, not {other:?}");
            return Err(ApiError::new(StatusCode::BAD_REQUEST, message));
        }
    };
    let lines = query.lines.unwrap_or(DEFAULT_LINES);
    let dir = state.sources.data().logs().clone();
    let opened = {
        let (dir, name) = (dir.clone(), name.clone());
        blocking(move || open_and_tail(&dir, &name, lines)).await?
    };
    let (file, tail, end) = match opened {
        Some((file, tail, end)) => (Some(Arc::new(file)), tail, end),
        None => (None, Vec::new(), 0),
    };
    let follow = query.follow.unwrap_or(false);
    let (content_type, tail) = match &mut json {
        None => ("text/plain; charset=utf-8", tail),
        Some(json) => {
            let now = SystemTime::now();
            let mut lines = json.lines(&tail, now);
            if !follow {
                lines.extend(json.rest(now));
            }
            ("application/x-ndjson", lines)
        }
    };
    let content_type = [(header::CONTENT_TYPE, content_type)];
    if !follow {
        return Ok((content_type, tail).into_response());
    }
    let slot = slots.take()?;
    let (chunks, receiver) = mpsc::channel(16);
    if !tail.is_empty() {
        let _unreachable = chunks.try_send(Bytes::from(tail));
    }
    let follower = Follower { dir, name, file, offset: end, chunks, json, _slot: slot };
    tokio::spawn(follower.run(state.shutdown.clone()));
    Ok((content_type, Body::new(ChannelBody(receiver))).into_response())
}

/// Runs `read` on the blocking pool; an I/O error becomes a 500 naming it.
async fn blocking<T: Send + 'static>(read: impl FnOnce() -> io::Result<T> + Send + 'static) -> Result<T, ApiError> {
    let failed = |err: &dyn std::fmt::Display| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, format!("{err}"));
    match tokio::task::spawn_blocking(read).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(err)) => Err(failed(&err)),
        Err(join) => Err(failed(&join)),
    }
}

/// Opens `name` and reads its last `lines` lines; `None` when the file does not exist yet.
/// Returns the file, the lines, and the offset they end at.
fn open_and_tail(dir: &PrivateDir, name: &str, lines: usize) -> io::Result<Option<(File, Vec<u8>, u64)>> {
    let Some(file) = dir.open_read(name).map_err(io::Error::other)? else { return Ok(None) };
    let end = file.metadata()?.len();
    let tail = tail(&file, end, lines)?;
    Ok(Some((file, tail, end)))
}

/// The last `lines` lines of the first `end` bytes of `file` (a last line without its
/// newline counts as a line), at most [`MAX_TAIL_BYTES`] of them.
fn tail(file: &File, end: u64, lines: usize) -> io::Result<Vec<u8>> {
    if lines == 0 || end == 0 {
        return Ok(Vec::new());
    }
    let floor = end.saturating_sub(MAX_TAIL_BYTES);
    // Newlines to pass, reading backwards: one more than the lines wanted, unless the file
    // ends in one, which ends the last line rather than starting another.
    let mut last = [0_u8; 1];
    file.read_exact_at(&mut last, end - 1)?;
    let mut newlines_left = if last[0] == b'\n' { lines + 1 } else { lines };
    let mut start = end;
    let mut block = vec![0_u8; 64 << 10];
    'scan: while start > floor {
        let size = (start - floor).min(block.len() as u64);
        let at = start - size;
        let block = &mut block[..usize::try_from(size).unwrap_or(0)];
        file.read_exact_at(block, at)?;
        for (index, byte) in block.iter().enumerate().rev() {
            if *byte == b'\n' {
                newlines_left -= 1;
                if newlines_left == 0 {
                    start = at + index as u64 + 1;
                    break 'scan;
                }
            }
        }
        start = at;
    }
    let mut text = vec![0_u8; usize::try_from(end - start).unwrap_or(0)];
    file.read_exact_at(&mut text, start)?;
    Ok(text)
}

/// Sends what is appended to a log file to one client, until the client goes away or the
/// API stops.
struct Follower {
    dir: PrivateDir,
    name: String,
    file: Option<Arc<File>>,
    offset: u64,
    chunks: mpsc::Sender<Bytes>,
    /// The lines as JSON, when asked for.
    json: Option<JsonLines>,
    /// Its listener's stream slot, held while it runs.
    _slot: tokio::sync::OwnedSemaphorePermit,
}

impl Follower {
    async fn run(mut self, stop: tokio_util::sync::CancellationToken) {
        let mut ticker = tokio::time::interval(FOLLOW_POLL);
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                () = self.chunks.closed() => return,
                _ = ticker.tick() => {}
            }
            let read = match (self.read_new().await, &mut self.json) {
                (Ok(Some(chunk)), Some(json)) => {
                    let lines = json.lines(&chunk, SystemTime::now());
                    Ok((!lines.is_empty()).then(|| Bytes::from(lines)))
                }
                (read, _) => read,
            };
            match read {
                Ok(Some(chunk)) => {
                    if !super::send_chunk(&self.chunks, chunk).await {
                        return;
                    }
                }
                Ok(None) => {}
                Err(error) => {
                    tracing::debug!(file = %self.name, %error, "cannot follow the log");
                    return;
                }
            }
        }
    }

    /// What was appended since the last read. A file shorter than what was read has been
    /// truncated by a rotation (copy, then truncate): the end of the copy that was not read
    /// yet comes first, then the file from its start.
    async fn read_new(&mut self) -> io::Result<Option<Bytes>> {
        let file = match &self.file {
            Some(file) => file.clone(),
            None => {
                // Not written yet when the client came: open it once it exists.
                let (dir, name) = (self.dir.clone(), self.name.clone());
                let opened = tokio::task::spawn_blocking(move || dir.open_read(&name).map_err(io::Error::other))
                    .await
                    .map_err(io::Error::other)??;
                let Some(file) = opened else { return Ok(None) };
                let file = Arc::new(file);
                self.file = Some(file.clone());
                file
            }
        };
        let (offset, dir, rotated) = (self.offset, self.dir.clone(), format!("{}.1", self.name));
        let read = tokio::task::spawn_blocking(move || -> io::Result<(u64, Vec<u8>)> {
            let len = file.metadata()?.len();
            if len >= offset {
                let size = (len - offset).min(CHUNK);
                let mut chunk = vec![0_u8; usize::try_from(size).unwrap_or(0)];
                file.read_exact_at(&mut chunk, offset)?;
                return Ok((offset + size, chunk));
            }
            // Truncated by a rotation: what was written since the last read, up to the
            // copy, is at the end of the copy (`<log>.1`); then the live file from its start.
            let mut chunk = missed_in_copy(&dir, &rotated, offset).unwrap_or_default();
            let size = len.min(CHUNK);
            let start = chunk.len();
            chunk.resize(start + usize::try_from(size).unwrap_or(0), 0);
            file.read_exact_at(&mut chunk[start..], 0)?;
            Ok((size, chunk))
        });
        let (next, chunk) = read.await.map_err(io::Error::other)??;
        self.offset = next;
        Ok((!chunk.is_empty()).then(|| Bytes::from(chunk)))
    }
}

/// The bytes of the rotated copy `rotated` past `offset` (where the follower had read the
/// live file up to), if there is such a copy and it is that long.
fn missed_in_copy(dir: &PrivateDir, rotated: &str, offset: u64) -> Option<Vec<u8>> {
    let copy = dir.open_read(rotated).ok()??;
    let len = copy.metadata().ok()?.len();
    let size = len.checked_sub(offset)?.min(CHUNK);
    let mut missed = vec![0_u8; usize::try_from(size).ok()?];
    copy.read_exact_at(&mut missed, offset).ok()?;
    Some(missed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn tail_of(text: &str, lines: usize) -> String {
        let mut file = tempfile::tempfile().unwrap();
        file.write_all(text.as_bytes()).unwrap();
        String::from_utf8(tail(&file, text.len() as u64, lines).unwrap()).unwrap()
    }

    #[test]
    fn the_tail_counts_lines_from_the_end() {
        assert_eq!(tail_of("a\nb\nc\n", 2), "b\nc\n");
        assert_eq!(tail_of("a\nb\nc\n", 3), "a\nb\nc\n");
        assert_eq!(tail_of("a\nb\nc\n", 9), "a\nb\nc\n");
        assert_eq!(tail_of("a\nb\nc", 1), "c", "a last line without its newline counts");
        assert_eq!(tail_of("a\nb\nc", 2), "b\nc");
        assert_eq!(tail_of("a\nb\n", 0), "");
        assert_eq!(tail_of("", 5), "");
        let long: String = (0..20_000).map(|n| format!("line {n}\n")).collect();
        assert_eq!(tail_of(&long, 2), "line 19998\nline 19999\n");
    }

    #[test]
    fn json_lines_hold_a_line_until_its_newline_and_keep_its_text_whole() {
        let now = humantime::parse_rfc3339("2026-01-01T00:00:00.250Z").unwrap();
        let mut json = JsonLines { proxy: "web-proxy".into(), stream: "stderr", partial: Vec::new() };
        let parse = |bytes: Vec<u8>| -> Vec<LogLineDto> {
            String::from_utf8(bytes).unwrap().lines().map(|line| serde_json::from_str(line).unwrap()).collect()
        };
        let lines = parse(json.lines(b"first \"quoted\"\r\nsec", now));
        assert_eq!(
            lines,
            [LogLineDto {
                time: "2026-01-01T00:00:00.250Z".into(),
                proxy: "web-proxy".into(),
                stream: "stderr".into(),
                text: "first \"quoted\"".into(),
            }]
        );
        assert!(json.lines(b"ond", now).is_empty(), "no newline yet");
        let lines = parse(json.lines(b"\n\xff\n", now));
        assert_eq!(lines.iter().map(|line| line.text.as_str()).collect::<Vec<_>>(), ["second", "\u{fffd}"]);
        assert!(json.rest(now).is_empty());
        assert_eq!(parse(json.lines(b"last", now)).len(), 0);
        assert_eq!(parse(json.rest(now))[0].text, "last");
    }
}
