//! A process's output sent to the system journal (`log_target = "journal"` or `"both"`),
//! through journald's native protocol: one datagram per line on its socket, each a list of
//! `KEY=value` fields, so that every entry carries who wrote it (the identifier, the
//! caller's fields such as the service, the stream, the pid of the instance).
//!
//! Why not the journal's stream socket (what systemd connects a service's stdout to): it
//! carries no field but the identifier and the priority, and a descriptor connected to it
//! would make journald, not the log file, the place where output waits while no agent
//! runs. Here the process keeps appending to its log files, which outlive the agent; the
//! rotation thread ([`crate::rotate`]) reads each line it finds appended there, sends it to
//! the journal, and reads up to the end of a file before it truncates it. The journal's own
//! `_PID` is the agent's (the sender of the datagram): the instance's is `SYSLOG_PID`.
//!
//! This module builds entries and sends them; it opens no log file.

use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::spec::LogFile;

/// Where journald listens for native entries.
pub const DEFAULT_JOURNAL_SOCKET: &str = "/run/systemd/journal/socket";

/// The field that names the stream a line was written to, `stdout` or `stderr`.
pub const STREAM_FIELD: &str = "TETHER_STREAM";

/// The longest piece of a line sent as one entry: a longer line is sent in pieces, so that
/// no datagram passes what a Unix socket takes at once.
const MAX_MESSAGE: usize = 48 * 1024;

/// How long a send may wait for a journal that does not read: after that the line is
/// dropped (and said so), so that a stuck journal never holds up rotation.
const SEND_TIMEOUT: Duration = Duration::from_millis(100);

/// Where a process's lines go in the journal, and the fields every one of them carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JournalSink {
    /// The journal's native socket ([`DEFAULT_JOURNAL_SOCKET`] unless told otherwise).
    pub socket: PathBuf,
    /// `SYSLOG_IDENTIFIER`: the name `journalctl -t` finds the lines by.
    pub identifier: String,
    /// Further fields of every entry, such as `TETHER_SERVICE`: names of capitals, digits
    /// and `_`, not starting with `_` (journald drops others).
    pub fields: Vec<(String, String)>,
}

impl JournalSink {
    /// Lines of `identifier` on the default socket, with no further field.
    pub fn new(identifier: impl Into<String>) -> Self {
        Self { socket: PathBuf::from(DEFAULT_JOURNAL_SOCKET), identifier: identifier.into(), fields: Vec::new() }
    }

    /// Whether a journal listens at [`JournalSink::socket`] ([`journal_listens`]).
    ///
    /// # Errors
    ///
    /// The refusal.
    pub(crate) fn reachable(&self) -> io::Result<()> {
        journal_listens(&self.socket)
    }
}

/// Whether a journal listens at `socket`: a datagram socket connects to it (a missing
/// file, or one that no journal reads, is refused). What a proxy's start checks when its
/// output goes to the journal.
///
/// # Errors
///
/// The refusal.
pub fn journal_listens(socket: &Path) -> io::Result<()> {
    UnixDatagram::unbound()?.connect(socket)
}

impl JournalSink {}

/// The journal's priority of a line of a stream: info for stdout, error for stderr.
fn priority(stream: u8) -> &'static str {
    if stream == 0 { "6" } else { "3" }
}

fn stream_name(stream: u8) -> &'static str {
    if stream == 0 { "stdout" } else { "stderr" }
}

/// Appends the field `key` = `value` to `entry`: `KEY=value\n`, or for a value with a
/// newline, the binary-safe `KEY\n<length, u64 little endian><value>\n`.
fn push_field(entry: &mut Vec<u8>, key: &str, value: &[u8]) {
    entry.extend_from_slice(key.as_bytes());
    if value.contains(&b'\n') {
        entry.push(b'\n');
        entry.extend_from_slice(&(value.len() as u64).to_le_bytes());
    } else {
        entry.push(b'=');
    }
    entry.extend_from_slice(value);
    entry.push(b'\n');
}

/// The fields every entry of one stream of one instance carries, before its `MESSAGE`.
fn header(sink: &JournalSink, stream: u8, pid: u32) -> Vec<u8> {
    let mut header = Vec::new();
    push_field(&mut header, "PRIORITY", priority(stream).as_bytes());
    push_field(&mut header, "SYSLOG_IDENTIFIER", sink.identifier.as_bytes());
    push_field(&mut header, "SYSLOG_PID", pid.to_string().as_bytes());
    push_field(&mut header, STREAM_FIELD, stream_name(stream).as_bytes());
    for (key, value) in &sink.fields {
        push_field(&mut header, key, value.as_bytes());
    }
    header
}

/// The sending side, one for the rotation thread: an unbound datagram socket.
#[derive(Debug)]
pub(crate) struct Sender {
    socket: Option<UnixDatagram>,
}

impl Sender {
    pub(crate) fn new() -> Self {
        Self { socket: None }
    }

    /// Sends one entry to `path`.
    fn send(&mut self, path: &Path, entry: &[u8]) -> io::Result<()> {
        let socket = match &self.socket {
            Some(socket) => socket,
            None => {
                let socket = UnixDatagram::unbound()?;
                socket.set_write_timeout(Some(SEND_TIMEOUT))?;
                self.socket.insert(socket)
            }
        };
        socket.send_to(entry, path).map(|_| ())
    }
}

/// One log file's lines on their way to the journal: how far it was read, and the end of
/// a line not yet complete.
#[derive(Debug)]
pub(crate) struct Tee {
    sink: Arc<JournalSink>,
    stream: u8,
    /// The fields before `MESSAGE`, for the instance that writes now.
    header: Vec<u8>,
    /// How far the file was read (sent, or held in `carry`).
    offset: u64,
    carry: Vec<u8>,
    /// Where the lines of the instance that wrote so far end, once it is gone.
    handover: Arc<Handover>,
    /// The last send failed: the next failure is not reported again.
    failing: bool,
}

/// Where one instance's lines end and the next one's begin, told by the supervising task
/// before it starts the next instance and read by the rotation thread before each read:
/// the thread may learn of the new instance (and its pid) only later, and sends nothing
/// past the end of the last one's lines meanwhile.
#[derive(Debug, Default)]
pub(crate) struct Handover(Mutex<HandoverState>);

#[derive(Debug, Default)]
struct HandoverState {
    /// Counts the instances started after the first.
    generation: u64,
    /// The sizes of the stdout and stderr files when the last instance was gone, until the
    /// next one is known.
    ends: Option<[u64; 2]>,
}

impl Handover {
    /// The instance that wrote the files is gone, and its lines end at `sizes`: returns the
    /// generation of the next instance, which [`Handover::release`] names.
    pub(crate) fn hold(&self, sizes: [u64; 2]) -> u64 {
        let mut state = tether_state::lock(&self.0);
        state.generation += 1;
        state.ends = Some(sizes);
        state.generation
    }

    /// The instance of `generation` writes now: unless a later one was announced since,
    /// its lines are sent without bound.
    pub(crate) fn release(&self, generation: u64) {
        let mut state = tether_state::lock(&self.0);
        if state.generation == generation {
            state.ends = None;
        }
    }

    fn end(&self, stream: u8) -> u64 {
        tether_state::lock(&self.0).ends.map_or(u64::MAX, |ends| ends[usize::from(stream)])
    }
}

impl Tee {
    /// The lines of `stream` (0 for stdout, 1 for stderr) of the instance `pid`, from
    /// `offset` of its log file on, within what `handover` allows.
    pub(crate) fn new(sink: Arc<JournalSink>, stream: u8, pid: u32, offset: u64, handover: Arc<Handover>) -> Self {
        let header = header(&sink, stream, pid);
        Self { sink, stream, header, offset, carry: Vec::new(), handover, failing: false }
    }

    /// The lines from here on are of the instance `pid`.
    pub(crate) fn set_pid(&mut self, pid: u32) {
        self.header = header(&self.sink, self.stream, pid);
    }

    /// Whether the lines go to `sink` already.
    pub(crate) fn is_for(&self, sink: &JournalSink) -> bool {
        *self.sink == *sink
    }

    /// The file was truncated (rotated): it is read again from its start.
    pub(crate) fn truncated(&mut self) {
        self.offset = 0;
    }

    /// How far the file was read.
    pub(crate) fn offset(&self) -> u64 {
        self.offset
    }

    /// [`Tee::forward`], and says in the agent's log when lines of `log` stop reaching the
    /// journal and when they reach it again (once each, not at every read).
    pub(crate) fn forward_reported(&mut self, sender: &mut Sender, live: &File, end: u64, log: &LogFile) {
        match (self.forward(sender, live, end), self.failing) {
            (Err(error), false) => {
                tracing::warn!(path = %log.path().display(), journal = %self.sink.socket.display(), %error,
                    "lines not sent to the journal; they are in the log file");
                self.failing = true;
            }
            (Ok(()), true) => {
                tracing::info!(path = %log.path().display(), "lines reach the journal again");
                self.failing = false;
            }
            _ => {}
        }
    }

    /// Sends the whole lines of `live` between the last read and `end`, keeping an
    /// incomplete last line for later (sent as it is once it passes [`MAX_MESSAGE`]). A file
    /// shorter than what was read was truncated by someone else: it is read from its start.
    ///
    /// # Errors
    ///
    /// When the file cannot be read, or the journal does not take a line (the lines after
    /// it in this read are dropped: they are in the log file).
    fn forward(&mut self, sender: &mut Sender, mut live: &File, end: u64) -> io::Result<()> {
        if end < self.offset {
            self.offset = 0;
            self.carry.clear();
        }
        // Read after the size: an end told before the next instance wrote is seen here.
        let end = end.min(self.handover.end(self.stream));
        if end <= self.offset {
            return Ok(());
        }
        live.seek(SeekFrom::Start(self.offset))?;
        let mut chunk = vec![0; usize::try_from(end - self.offset).unwrap_or(usize::MAX).min(64 * 1024)];
        let mut result = Ok(());
        while self.offset < end {
            let wanted = usize::try_from(end - self.offset).unwrap_or(usize::MAX).min(chunk.len());
            let read = live.read(&mut chunk[..wanted])?;
            if read == 0 {
                break;
            }
            self.offset += read as u64;
            let mut rest = &chunk[..read];
            while let Some(at) = rest.iter().position(|byte| *byte == b'\n') {
                self.carry.extend_from_slice(&rest[..at]);
                rest = &rest[at + 1..];
                let line = std::mem::take(&mut self.carry);
                result = result.and(self.send(sender, &line));
            }
            self.carry.extend_from_slice(rest);
            while self.carry.len() >= MAX_MESSAGE {
                let piece: Vec<u8> = self.carry.drain(..MAX_MESSAGE).collect();
                result = result.and(self.send(sender, &piece));
            }
        }
        result
    }

    /// Sends what is left of an incomplete line once its writer is gone (the file was
    /// read up to where its lines end).
    pub(crate) fn finish(&mut self, sender: &mut Sender) -> io::Result<()> {
        if self.carry.is_empty() {
            return Ok(());
        }
        let line = std::mem::take(&mut self.carry);
        self.send(sender, &line)
    }

    fn send(&self, sender: &mut Sender, line: &[u8]) -> io::Result<()> {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let mut entry = Vec::with_capacity(self.header.len() + line.len() + 16);
        entry.extend_from_slice(&self.header);
        push_field(&mut entry, "MESSAGE", line);
        sender.send(&self.sink.socket, &entry)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_field_with_a_newline_takes_the_binary_safe_form() {
        let mut entry = Vec::new();
        push_field(&mut entry, "MESSAGE", b"plain");
        push_field(&mut entry, "MESSAGE", b"two\nlines");
        let mut expected = b"MESSAGE=plain\nMESSAGE\n".to_vec();
        expected.extend_from_slice(&9u64.to_le_bytes());
        expected.extend_from_slice(b"two\nlines\n");
        assert_eq!(entry, expected);
    }

    #[test]
    fn lines_written_while_the_journal_is_away_are_dropped_and_the_next_ones_reach_it_when_it_is_back() {
        use std::io::Write;

        let temp = tempfile::tempdir().unwrap();
        let data = tether_state::persist::DataDir::open(temp.path()).unwrap();
        let log = LogFile::new(data.logs().clone(), "web-proxy-stdout.log");
        let socket = temp.path().join("journal.socket");
        let sink = Arc::new(JournalSink { socket: socket.clone(), ..JournalSink::new("web-proxy") });
        let mut tee = Tee::new(sink, 0, 42, 0, Arc::default());
        let mut sender = Sender::new();
        let mut file = std::fs::OpenOptions::new().create(true).append(true).open(log.path()).unwrap();
        let live = File::open(log.path()).unwrap();
        let size = |file: &File| file.metadata().unwrap().len();

        file.write_all(b"while away\n").unwrap();
        tee.forward_reported(&mut sender, &live, size(&live), &log);
        assert!(tee.failing, "no journal listens");

        let journal = UnixDatagram::bind(&socket).unwrap();
        journal.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        file.write_all(b"back\n").unwrap();
        tee.forward_reported(&mut sender, &live, size(&live), &log);
        assert!(!tee.failing, "the journal is back");
        let mut buffer = vec![0; 4096];
        let length = journal.recv(&mut buffer).unwrap();
        let entry = String::from_utf8_lossy(&buffer[..length]).into_owned();
        assert!(entry.ends_with("\nMESSAGE=back\n"), "{entry:?}");
        assert!(entry.contains("\nSYSLOG_PID=42\n"), "{entry:?}");
    }

    #[test]
    fn the_header_names_the_identifier_the_pid_the_stream_and_the_callers_fields() {
        let sink = JournalSink {
            fields: vec![("TETHER_SERVICE".to_owned(), "web".to_owned())],
            ..JournalSink::new("web-proxy")
        };
        let text = String::from_utf8(header(&sink, 1, 42)).unwrap();
        assert_eq!(
            text,
            "PRIORITY=3\nSYSLOG_IDENTIFIER=web-proxy\nSYSLOG_PID=42\nTETHER_STREAM=stderr\nTETHER_SERVICE=web\n"
        );
    }
}
