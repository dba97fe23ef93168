//! Output sent to the journal through its native protocol, received by a socket of the
//! test's that reads datagrams as journald does.

use std::collections::HashMap;
use std::os::unix::net::UnixDatagram;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use tether_proxy_daemon::{JournalSink, LogOutput, LogPolicy, SpawnError};

use crate::support::*;

/// The fields of one native entry: `KEY=value` lines, or `KEY`, a little-endian u64
/// length, the value and a newline.
fn fields(mut datagram: &[u8]) -> HashMap<String, String> {
    let mut fields = HashMap::new();
    while !datagram.is_empty() {
        let end = datagram.iter().position(|byte| *byte == b'\n').expect("a field ends with a newline");
        let line = &datagram[..end];
        datagram = &datagram[end + 1..];
        let (key, value) = match line.iter().position(|byte| *byte == b'=') {
            Some(at) => (&line[..at], line[at + 1..].to_vec()),
            None => {
                let length = u64::from_le_bytes(datagram[..8].try_into().unwrap()) as usize;
                let value = datagram[8..8 + length].to_vec();
                assert_eq!(datagram[8 + length], b'\n', "a binary value ends with a newline");
                datagram = &datagram[9 + length..];
                (line, value)
            }
        };
        fields.insert(String::from_utf8(key.to_vec()).unwrap(), String::from_utf8(value).unwrap());
    }
    fields
}

/// A journal of the test's: a datagram socket at `path`.
struct Journal(UnixDatagram);

impl Journal {
    fn bind(path: &Path) -> Self {
        let socket = UnixDatagram::bind(path).unwrap();
        socket.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
        Self(socket)
    }

    /// The next entry whose `MESSAGE` is `message`, failing the test past the deadline.
    fn entry(&self, message: &str) -> HashMap<String, String> {
        let deadline = Instant::now() + DEADLINE;
        let mut buffer = vec![0; 1 << 16];
        while Instant::now() < deadline {
            if let Ok(length) = self.0.recv(&mut buffer) {
                let entry = fields(&buffer[..length]);
                if entry.get("MESSAGE").map(String::as_str) == Some(message) {
                    return entry;
                }
            }
        }
        panic!("no journal entry {message:?} within {DEADLINE:?}");
    }
}

#[tokio::test]
async fn each_line_reaches_the_journal_with_its_identifier_stream_pid_and_fields() {
    let fx = Fixture::new();
    let socket = fx.data_dir().join("journal.socket");
    let journal = Journal::bind(&socket);
    let mut spec = fx.spec("journal-proxy", &["--print", "hello", "--eprint", "trouble"]);
    spec.logs.limits = LogPolicy { output: LogOutput::Both, ..LogPolicy::default() };
    spec.logs.journal = Some(Arc::new(JournalSink {
        socket: socket.clone(),
        fields: vec![("TETHER_SERVICE".to_owned(), "journal".to_owned())],
        ..JournalSink::new("journal-proxy")
    }));
    let stdout = spec.logs.stdout.path();
    let handle = fx.supervisor.spawn(spec).await.unwrap();
    let pid = handle.status().figures.pid.unwrap();

    let line = journal.entry("hello");
    assert_eq!(line["SYSLOG_IDENTIFIER"], "journal-proxy");
    assert_eq!(line["SYSLOG_PID"], pid.to_string());
    assert_eq!(line["TETHER_STREAM"], "stdout");
    assert_eq!(line["TETHER_SERVICE"], "journal");
    assert_eq!(line["PRIORITY"], "6");
    let error = journal.entry("trouble");
    assert_eq!(error["TETHER_STREAM"], "stderr");
    assert_eq!(error["PRIORITY"], "3");
    // "both": the file has the line too.
    assert_eq!(std::fs::read_to_string(&stdout).unwrap(), "hello\n");

    // The next instance's lines carry its own pid. (The helper exits once it printed, so
    // that instances follow each other quickly: no line may go out under the pid of the
    // one before.)
    send(pid, Signal::SIGKILL);
    let next = restarted(&handle, pid).await;
    let line = journal.entry("hello");
    assert_eq!(line["SYSLOG_PID"], next.to_string());
    within("stop", handle.stop()).await;
}

#[tokio::test]
async fn a_journal_that_does_not_listen_fails_the_start_naming_the_process_and_the_socket() {
    let fx = Fixture::new();
    let socket = fx.data_dir().join("no-journal.socket");
    let mut spec = fx.spec("deaf-proxy", &["--print", "hello"]);
    spec.logs.limits = LogPolicy { output: LogOutput::Journal, ..LogPolicy::default() };
    spec.logs.journal = Some(Arc::new(JournalSink { socket: socket.clone(), ..JournalSink::new("deaf-proxy") }));
    let Err(error) = fx.supervisor.spawn(spec).await else { panic!("started with no journal") };
    assert!(matches!(&error, SpawnError::Journal { name, socket: at, .. } if name == "deaf-proxy" && *at == socket));
    let message = error.to_string();
    assert!(message.starts_with("deaf-proxy: log_target sends its output to the journal"), "{message}");
    assert!(fx.marked_processes().is_empty(), "a process started: {:?}", fx.marked_processes());
}
