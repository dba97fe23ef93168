//! Readiness by a log line (process-compose's ready log line): what an instance appended
//! to its stdout and stderr log files since it started, read line by line, across a
//! rotation (the rest of the file before it was truncated is in `<file>.1`; a file that
//! a late rotation found more than a tenth past its cap is copied in pieces, and only the
//! newest, `<file>.1`, is read).
//!
//! This module reads log files and matches lines; it never writes or rotates them.

use std::io::{self, Read, Seek, SeekFrom};

use tether_state::LinePattern;

use crate::rotate::rotated_name;
use crate::spec::{LogFile, ProcessSpec};

/// The most read from one file per look: a proxy that writes faster than this is looked at
/// again at the next interval.
const MAX_READ: u64 = 1 << 20;
/// The longest partial line kept between two looks; a longer line is matched in pieces.
const MAX_CARRY: usize = 64 * 1024;

/// Where an instance's output starts in one log file: the file's size before it was
/// spawned, and which rotated copy existed then.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Start {
    offset: u64,
    /// The inode of `<file>.1`: each rotation writes a new copy, so another inode there
    /// means a rotation happened since.
    rotated: Option<u64>,
}

/// Where an instance's output starts in its stdout and stderr log files.
pub(super) fn offsets(spec: &ProcessSpec) -> [Start; 2] {
    [&spec.logs.stdout, &spec.logs.stderr]
        .map(|log| Start { offset: size(log).unwrap_or(0), rotated: rotated_inode(log) })
}

fn size(log: &LogFile) -> io::Result<u64> {
    match log.dir().open_read(log.name()).map_err(io::Error::other)? {
        Some(file) => Ok(file.metadata()?.len()),
        None => Ok(0),
    }
}

fn rotated_inode(log: &LogFile) -> Option<u64> {
    use std::os::unix::fs::MetadataExt;
    let copy = log.dir().open_read(rotated_name(log.name(), 1)).ok()??;
    Some(copy.metadata().ok()?.ino())
}

/// One instance's two output streams, read from where it started.
pub(super) struct LineWatch {
    pattern: LinePattern,
    streams: [Stream; 2],
}

struct Stream {
    log: LogFile,
    start: Start,
    carry: Vec<u8>,
}

impl LineWatch {
    pub(super) fn new(spec: &ProcessSpec, pattern: LinePattern, offsets: [Start; 2]) -> Self {
        let [stdout, stderr] = offsets;
        let stream = |log: &LogFile, start| Stream { log: log.clone(), start, carry: Vec::new() };
        Self { pattern, streams: [stream(&spec.logs.stdout, stdout), stream(&spec.logs.stderr, stderr)] }
    }

    /// Reads what was appended since the last look; `true` when a whole line matches.
    ///
    /// # Errors
    ///
    /// When a log file cannot be read.
    pub(super) fn matched(&mut self) -> io::Result<bool> {
        let mut found = false;
        for stream in &mut self.streams {
            let appended = stream.read()?;
            stream.carry.extend_from_slice(&appended);
            let mut lines = stream.carry.split(|byte| *byte == b'\n').collect::<Vec<_>>();
            let rest = lines.pop().unwrap_or_default().to_vec();
            found |=
                lines.iter().any(|line| self.pattern.matches(String::from_utf8_lossy(line).trim_end_matches('\r')));
            stream.carry = rest;
            if stream.carry.len() > MAX_CARRY {
                found |= self.pattern.matches(&String::from_utf8_lossy(&stream.carry));
                stream.carry.clear();
            }
        }
        Ok(found)
    }
}

impl Stream {
    fn read(&mut self) -> io::Result<Vec<u8>> {
        let mut appended = Vec::new();
        let Some(mut live) = self.log.dir().open_read(self.log.name()).map_err(io::Error::other)? else {
            return Ok(appended);
        };
        let rotated = rotated_inode(&self.log);
        if rotated != self.start.rotated || live.metadata()?.len() < self.start.offset {
            // Rotated since the last look: the copy holds what followed our offset (up to
            // the rotation), and the file starts anew.
            let copy = self.log.dir().open_read(rotated_name(self.log.name(), 1)).map_err(io::Error::other)?;
            if let Some(mut copy) = copy {
                copy.seek(SeekFrom::Start(self.start.offset))?;
                copy.take(MAX_READ).read_to_end(&mut appended)?;
            }
            self.start = Start { offset: 0, rotated };
        }
        live.seek(SeekFrom::Start(self.start.offset))?;
        let read = (&mut live).take(MAX_READ).read_to_end(&mut appended)?;
        self.start.offset += read as u64;
        Ok(appended)
    }
}
