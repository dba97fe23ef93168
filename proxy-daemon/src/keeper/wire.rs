//! The messages between a supervisor and its keeper, and their encoding.
//!
//! One message is one packet of a `SOCK_SEQPACKET` Unix socket: a kind byte, then its fields,
//! little-endian, byte strings and lists prefixed by their length; descriptors travel beside
//! it (`SCM_RIGHTS`). This module encodes and decodes; it never touches a socket.
//!
//! The messages that let any agent find and retire any keeper (`Hello`, `Welcome`, `Exited`,
//! `Retire`) keep their layout across versions, so that an agent of the next version can
//! learn the exits of an older keeper's children and retire it; a `Spawn` is sent only to a
//! keeper of the agent's own build.

use std::ffi::OsString;
use std::io;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::PathBuf;

use crate::spawn::{Birth, Creation, Credentials};

/// The version of the `Spawn` message and its answers; the rest never change.
pub(crate) const PROTOCOL: u32 = 1;

/// What tells one build of the keeper from another: a keeper spawns only for an agent of
/// the same build, so that both agree on what a [`Creation`] holds. One literal, so that it
/// stands once in a binary.
const BUILD: &str = concat!("tether keeper ", env!("CARGO_PKG_VERSION"), " protocol 1");

pub(crate) fn build() -> String {
    BUILD.to_owned()
}

/// The largest message either side sends or reads: a command line and environment of up
/// to about this size (Linux's own limit for both is larger, but no proxy comes close).
pub(crate) const MAX_MESSAGE: usize = 192 * 1024;

/// A process the keeper is the parent of, as the kernel tells one instance from another.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Kept {
    pub(crate) pid: u32,
    /// Its start time, in clock ticks after boot (`/proc/<pid>/stat`).
    pub(crate) start_time: u64,
}

/// The exit of a kept process: its raw wait status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Exit {
    pub(crate) process: Kept,
    pub(crate) status: i32,
}

/// A message from a supervisor to its keeper.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Request {
    /// The first message of a connection.
    Hello,
    /// Create a process. The descriptors beside it: `held` ones that the child holds until
    /// its exec (the agent's lock), then what [`crate::spawn::create`] takes.
    Spawn { seq: u64, held: u32, creation: Box<Creation> },
    /// Take no more spawns; exit once no child is left.
    Retire,
}

/// A message from a keeper to a supervisor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Answer {
    /// The answer to `Hello`: who the keeper is, its live children, and the exits that no
    /// supervisor was connected to hear.
    Welcome { build: String, pid: u32, children: Vec<Kept>, exits: Vec<Exit> },
    /// A process was created; its pidfd is beside this.
    Spawned { seq: u64, process: Kept },
    /// A process could not be created.
    Failed { seq: u64, errno: i32, message: String },
    /// A child exited and was reaped (its process group swept first).
    Exited(Exit),
}

const HELLO: u8 = b'H';
const SPAWN: u8 = b'S';
const RETIRE: u8 = b'R';
const WELCOME: u8 = b'w';
const SPAWNED: u8 = b's';
const FAILED: u8 = b'f';
const EXITED: u8 = b'x';

impl Request {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut out = Writer::default();
        match self {
            Self::Hello => out.u8(HELLO),
            Self::Retire => out.u8(RETIRE),
            Self::Spawn { seq, held, creation } => {
                out.u8(SPAWN);
                out.u32(PROTOCOL);
                out.u64(*seq);
                out.u32(*held);
                out.creation(creation);
            }
        }
        out.0
    }

    pub(crate) fn decode(bytes: &[u8]) -> io::Result<Self> {
        let mut input = Reader(bytes);
        let message = match input.u8()? {
            HELLO => Self::Hello,
            RETIRE => Self::Retire,
            SPAWN => {
                let protocol = input.u32()?;
                if protocol != PROTOCOL {
                    return Err(malformed("a spawn of another protocol version"));
                }
                Self::Spawn { seq: input.u64()?, held: input.u32()?, creation: Box::new(input.creation()?) }
            }
            _ => return Err(malformed("an unknown request")),
        };
        input.end()?;
        Ok(message)
    }
}

impl Answer {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut out = Writer::default();
        match self {
            Self::Welcome { build, pid, children, exits } => {
                out.u8(WELCOME);
                out.bytes(build.as_bytes());
                out.u32(*pid);
                out.u32(len(children.len()));
                children.iter().for_each(|child| out.kept(*child));
                out.u32(len(exits.len()));
                exits.iter().for_each(|exit| out.exit(*exit));
            }
            Self::Spawned { seq, process } => {
                out.u8(SPAWNED);
                out.u64(*seq);
                out.kept(*process);
            }
            Self::Failed { seq, errno, message } => {
                out.u8(FAILED);
                out.u64(*seq);
                out.i32(*errno);
                out.bytes(message.as_bytes());
            }
            Self::Exited(exit) => {
                out.u8(EXITED);
                out.exit(*exit);
            }
        }
        out.0
    }

    pub(crate) fn decode(bytes: &[u8]) -> io::Result<Self> {
        let mut input = Reader(bytes);
        let message = match input.u8()? {
            WELCOME => {
                let build = input.string()?;
                let pid = input.u32()?;
                let children = input.list(Reader::kept)?;
                let exits = input.list(Reader::exit)?;
                Self::Welcome { build, pid, children, exits }
            }
            SPAWNED => Self::Spawned { seq: input.u64()?, process: input.kept()? },
            FAILED => Self::Failed { seq: input.u64()?, errno: input.i32()?, message: input.string()? },
            EXITED => Self::Exited(input.exit()?),
            _ => return Err(malformed("an unknown answer")),
        };
        input.end()?;
        Ok(message)
    }
}

fn len(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

fn malformed(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("malformed keeper message: {what}"))
}

#[derive(Default)]
struct Writer(Vec<u8>);

impl Writer {
    fn u8(&mut self, value: u8) {
        self.0.push(value);
    }
    fn u32(&mut self, value: u32) {
        self.0.extend_from_slice(&value.to_le_bytes());
    }
    fn i32(&mut self, value: i32) {
        self.0.extend_from_slice(&value.to_le_bytes());
    }
    fn u64(&mut self, value: u64) {
        self.0.extend_from_slice(&value.to_le_bytes());
    }
    fn bytes(&mut self, value: &[u8]) {
        self.u32(len(value.len()));
        self.0.extend_from_slice(value);
    }
    fn os(&mut self, value: &std::ffi::OsStr) {
        self.bytes(value.as_bytes());
    }
    fn kept(&mut self, kept: Kept) {
        self.u32(kept.pid);
        self.u64(kept.start_time);
    }
    fn exit(&mut self, exit: Exit) {
        self.kept(exit.process);
        self.i32(exit.status);
    }
    fn creation(&mut self, creation: &Creation) {
        self.os(creation.found.as_os_str());
        self.os(creation.program.as_os_str());
        self.u32(len(creation.args.len()));
        creation.args.iter().for_each(|arg| self.os(arg));
        self.u32(len(creation.env.len()));
        for (key, value) in &creation.env {
            self.os(key);
            self.os(value);
        }
        self.u32(len(creation.candidates.len()));
        creation.candidates.iter().for_each(|candidate| self.os(candidate.as_os_str()));
        self.os(creation.dir.as_os_str());
        self.u32(len(creation.listeners.len()));
        creation.listeners.iter().for_each(|name| self.bytes(name.as_bytes()));
        match &creation.credentials {
            None => self.u8(0),
            Some(Credentials { uid, gid, groups }) => {
                self.u8(1);
                self.u32(*uid);
                self.u32(*gid);
                self.u32(len(groups.len()));
                groups.iter().for_each(|group| self.u32(*group));
            }
        }
        self.u32(len(creation.targets.len()));
        creation.targets.iter().for_each(|target| self.i32(*target));
        self.u8(u8::from(creation.cgroup));
        self.u8(match creation.birth {
            Birth::IntoCgroup => 0,
            Birth::EnteringCgroup => 1,
        });
    }
}

struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take<const N: usize>(&mut self) -> io::Result<[u8; N]> {
        let (head, rest) = self.0.split_first_chunk::<N>().ok_or_else(|| malformed("cut short"))?;
        self.0 = rest;
        Ok(*head)
    }
    fn u8(&mut self) -> io::Result<u8> {
        Ok(self.take::<1>()?[0])
    }
    fn u32(&mut self) -> io::Result<u32> {
        Ok(u32::from_le_bytes(self.take()?))
    }
    fn i32(&mut self) -> io::Result<i32> {
        Ok(i32::from_le_bytes(self.take()?))
    }
    fn u64(&mut self) -> io::Result<u64> {
        Ok(u64::from_le_bytes(self.take()?))
    }
    fn bytes(&mut self) -> io::Result<Vec<u8>> {
        let n = usize::try_from(self.u32()?).map_err(|_| malformed("a length"))?;
        if n > self.0.len() {
            return Err(malformed("a length past the end"));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head.to_vec())
    }
    fn string(&mut self) -> io::Result<String> {
        String::from_utf8(self.bytes()?).map_err(|_| malformed("text that is not UTF-8"))
    }
    fn os(&mut self) -> io::Result<OsString> {
        Ok(OsString::from_vec(self.bytes()?))
    }
    fn list<T>(&mut self, item: impl Fn(&mut Self) -> io::Result<T>) -> io::Result<Vec<T>> {
        let n = self.u32()?;
        // Each item takes at least a byte: a count beyond what is left is a lie.
        if usize::try_from(n).map_or(true, |n| n > self.0.len()) {
            return Err(malformed("a count past the end"));
        }
        (0..n).map(|_| item(self)).collect()
    }
    fn kept(&mut self) -> io::Result<Kept> {
        Ok(Kept { pid: self.u32()?, start_time: self.u64()? })
    }
    fn exit(&mut self) -> io::Result<Exit> {
        Ok(Exit { process: self.kept()?, status: self.i32()? })
    }
    fn creation(&mut self) -> io::Result<Creation> {
        let found = PathBuf::from(self.os()?);
        let program = PathBuf::from(self.os()?);
        let args = self.list(Self::os)?;
        let env = self.list(|input| Ok((input.os()?, input.os()?)))?;
        let candidates = self.list(|input| input.os().map(PathBuf::from))?;
        let dir = PathBuf::from(self.os()?);
        let listeners = self.list(Self::string)?;
        let credentials = match self.u8()? {
            0 => None,
            1 => Some(Credentials { uid: self.u32()?, gid: self.u32()?, groups: self.list(Self::u32)? }),
            _ => return Err(malformed("credentials")),
        };
        let targets = self.list(Self::i32)?;
        let cgroup = match self.u8()? {
            0 => false,
            1 => true,
            _ => return Err(malformed("a cgroup flag")),
        };
        let birth = match self.u8()? {
            0 => Birth::IntoCgroup,
            1 => Birth::EnteringCgroup,
            _ => return Err(malformed("a birth")),
        };
        Ok(Creation { found, program, args, env, candidates, dir, listeners, credentials, targets, cgroup, birth })
    }
    fn end(&self) -> io::Result<()> {
        if self.0.is_empty() { Ok(()) } else { Err(malformed("bytes past the end")) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn creation() -> Creation {
        Creation {
            found: "/usr/bin/envoy".into(),
            program: "envoy".into(),
            args: vec!["-c".into(), OsString::from_vec(vec![0xff, b'x'])],
            env: vec![("PATH".into(), "/usr/bin".into()), ("TETHER_PROXY_ID".into(), "web-proxy".into())],
            candidates: vec!["/usr/local/bin/envoy".into(), "/usr/bin/envoy".into()],
            dir: "/".into(),
            listeners: vec!["public".into()],
            credentials: Some(Credentials { uid: 65534, gid: 65534, groups: vec![65534, 7] }),
            targets: vec![3, 4],
            cgroup: true,
            birth: Birth::EnteringCgroup,
        }
    }

    #[test]
    fn the_build_names_the_protocol() {
        assert!(BUILD.ends_with(&format!(" protocol {PROTOCOL}")));
    }

    #[test]
    fn every_message_decodes_to_what_was_encoded() {
        let requests =
            [Request::Hello, Request::Retire, Request::Spawn { seq: 7, held: 1, creation: Box::new(creation()) }];
        for request in requests {
            assert_eq!(Request::decode(&request.encode()).unwrap(), request);
        }
        let process = Kept { pid: 4242, start_time: 1 << 40 };
        let answers = [
            Answer::Welcome {
                build: build(),
                pid: 17,
                children: vec![process],
                exits: vec![Exit { process, status: 9 }],
            },
            Answer::Spawned { seq: u64::MAX, process },
            Answer::Failed { seq: 3, errno: libc::ENOENT, message: "no such file".into() },
            Answer::Exited(Exit { process, status: 256 }),
        ];
        for answer in answers {
            assert_eq!(Answer::decode(&answer.encode()).unwrap(), answer);
        }
    }

    #[test]
    fn a_message_cut_short_or_with_bytes_past_its_end_is_refused() {
        let encoded = Request::Spawn { seq: 1, held: 0, creation: Box::new(creation()) }.encode();
        for cut in 0..encoded.len() {
            assert!(Request::decode(&encoded[..cut]).is_err(), "cut at {cut}");
        }
        let mut longer = encoded;
        longer.push(0);
        assert!(Request::decode(&longer).is_err());
        assert!(Answer::decode(b"?").is_err());
    }

    #[test]
    fn a_count_larger_than_the_message_is_refused_before_anything_is_allocated() {
        let mut bytes = vec![WELCOME];
        bytes.extend_from_slice(&0u32.to_le_bytes());
        bytes.extend_from_slice(&1u32.to_le_bytes());
        bytes.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(Answer::decode(&bytes).is_err());
    }
}
