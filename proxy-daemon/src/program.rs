//! Finding the program a process runs, as `execvp` does: a path with a `/` is run as it is;
//! a bare name is looked for in each directory of the `PATH` of the process's own
//! environment, in order, skipping a place where the file is missing, where a directory
//! of the path is not one, or where the file may not be executed (which is remembered, to
//! say so when nothing is found).
//!
//! This module owns that rule and creates no process. The spawn path uses it twice:
//! [`find_program`] looks on this host, as this process's user, before anything is made
//! (and its answer is what a plain `posix_spawn` runs, where no code runs in the child);
//! [`candidates`] lists the places in order, prepared in the parent, so that a child that
//! runs code before its exec (born by `clone3`, or between fork and exec) tries `execve`
//! on each as `execvpe` does, as the user it has become, without allocating. The warnings
//! of `tether validate` and of the agent's start use [`find_program`] too.
//!
//! Two differences from `execvp`, both on purpose. An empty or relative directory in
//! `PATH` (`/usr/bin:`, `.:/usr/bin`) is skipped, where `execvp` would look in the working
//! directory: a proxy's working directory is often its own data, writable by its user,
//! and a stray `:` at the end of a `PATH` must not make a file there the program; a
//! directory that is meant is named absolutely. And a file without `#!` is not run through
//! `/bin/sh`: `execve` refuses it, and that error is the answer.

use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};

use crate::error::ProgramNotFound;

/// The `PATH` searched when the environment has none: `execvp`'s own default.
pub(crate) const DEFAULT_PATH: &str = "/bin:/usr/bin";

/// Finds `program` as a process whose environment is `env` would find it, looking as this
/// process's user: a path with a `/` is returned as it is (whether it runs is for `execve`
/// to say); a bare name is looked for in the directories of `env`'s `PATH` (its last
/// entry, as in [`ProcessSpec::env`](crate::ProcessSpec::env); `/bin:/usr/bin` when it has
/// none), and the first place that holds a file of that name that may be executed is
/// returned.
///
/// A process that switches to another user finds its program again, as that user, when
/// it starts.
///
/// # Errors
///
/// [`ProgramNotFound`] when no directory holds such a file: it names the program and the
/// `PATH` searched, and says whether some directory held a file of that name that may not
/// be executed.
///
/// # Examples
///
/// ```
/// use std::ffi::OsString;
/// use std::path::Path;
///
/// use tether_proxy_daemon::find_program;
///
/// let env: Vec<(OsString, OsString)> = vec![("PATH".into(), "/nonexistent:/bin:/usr/bin".into())];
/// let sh = find_program(Path::new("sh"), &env).unwrap();
/// assert!(sh.is_absolute() && sh.ends_with("sh"), "{}", sh.display());
///
/// let missing = find_program(Path::new("no-such-program-xyz"), &env).unwrap_err();
/// assert_eq!(missing.to_string(), "program `no-such-program-xyz` not found in PATH `/nonexistent:/bin:/usr/bin`");
/// ```
pub fn find_program(program: &Path, env: &[(OsString, OsString)]) -> Result<PathBuf, ProgramNotFound> {
    find_in(program, &search_path(env))
}

/// [`find_program`] with the `PATH` to search.
pub(crate) fn find_in(program: &Path, path: &OsStr) -> Result<PathBuf, ProgramNotFound> {
    if !is_bare_name(program) {
        return Ok(program.to_owned());
    }
    let mut denied = false;
    for candidate in candidates(program, path) {
        match look(&candidate) {
            Ok(()) => return Ok(candidate),
            Err(errno) => match after_failure(errno) {
                Next::Absent => {}
                Next::Denied => denied = true,
                // `execve` would fail there with this error and end the search: that is
                // the place, and the error of running it will say what is wrong with it.
                Next::Stop => return Ok(candidate),
            },
        }
    }
    Err(ProgramNotFound { program: program.to_owned(), path: path.to_owned(), denied })
}

/// The `PATH` that a process with the environment `env` searches: the value of its last
/// `PATH` entry, or [`DEFAULT_PATH`].
pub(crate) fn search_path(env: &[(OsString, OsString)]) -> OsString {
    env.iter().rev().find(|(key, _)| key == "PATH").map_or_else(|| DEFAULT_PATH.into(), |(_, value)| value.clone())
}

/// Whether `program` is looked for in `PATH`: a name without `/`.
pub(crate) fn is_bare_name(program: &Path) -> bool {
    !program.as_os_str().as_encoded_bytes().contains(&b'/')
}

/// Where a process looks for `program`, in order: `program` itself when it has a `/`;
/// else `<dir>/<program>` for each absolute directory `dir` of `path`. An empty name has
/// no place.
pub(crate) fn candidates(program: &Path, path: &OsStr) -> Vec<PathBuf> {
    if !is_bare_name(program) {
        return vec![program.to_owned()];
    }
    if program.as_os_str().is_empty() {
        return Vec::new();
    }
    std::env::split_paths(path).filter(|dir| dir.is_absolute()).map(|dir| dir.join(program)).collect()
}

/// What a failure at one place means for the search, as `execvpe` reads `execve`'s errno.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Next {
    /// Nothing there (or a directory of the path is missing or not one): the next place.
    Absent,
    /// Something there that this user may not execute: the next place, remembered.
    Denied,
    /// Any other failure ends the search with its error.
    Stop,
}

/// How the search goes on after `errno` at one place. Only a comparison of integers: a
/// child that may not allocate calls it between its creation and its exec.
pub(crate) fn after_failure(errno: i32) -> Next {
    match errno {
        libc::EACCES => Next::Denied,
        libc::ENOENT | libc::ENOTDIR | libc::ESTALE | libc::ENODEV | libc::ETIMEDOUT => Next::Absent,
        _ => Next::Stop,
    }
}

/// What `execve` would answer at `candidate` before it reads the file, as errno: anything
/// but a regular file is refused (`EACCES`), and so is a file this user may not execute.
fn look(candidate: &Path) -> Result<(), i32> {
    let metadata = std::fs::metadata(candidate).map_err(|error| error.raw_os_error().unwrap_or(libc::ENOENT))?;
    if !metadata.is_file() {
        return Err(libc::EACCES);
    }
    nix::unistd::eaccess(candidate, nix::unistd::AccessFlags::X_OK).map_err(|errno| errno as i32)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    fn executable(path: &Path) {
        std::fs::write(path, "#!/bin/sh\nexit 0\n").unwrap();
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
    }

    fn path_of(dirs: &[&Path]) -> OsString {
        std::env::join_paths(dirs).unwrap()
    }

    #[test]
    fn the_last_path_entry_is_searched_and_none_means_the_default() {
        let env = |pairs: &[(&str, &str)]| -> Vec<(OsString, OsString)> {
            pairs.iter().map(|(key, value)| (OsString::from(key), OsString::from(value))).collect()
        };
        assert_eq!(search_path(&env(&[("PATH", "/usr/bin"), ("HOME", "/"), ("PATH", "/opt/bin")])), "/opt/bin");
        assert_eq!(search_path(&env(&[("HOME", "/")])), DEFAULT_PATH);
        assert_eq!(search_path(&env(&[("PATH", "")])), "");
    }

    #[test]
    fn only_absolute_directories_are_places_and_a_path_is_its_own() {
        let places = candidates(Path::new("envoy"), OsStr::new(":/usr/local/bin:.:bin::/usr/bin:"));
        assert_eq!(places, [PathBuf::from("/usr/local/bin/envoy"), PathBuf::from("/usr/bin/envoy")]);
        assert_eq!(candidates(Path::new("/opt/envoy"), OsStr::new("/usr/bin")), [PathBuf::from("/opt/envoy")]);
        assert!(candidates(Path::new(""), OsStr::new("/usr/bin")).is_empty());
    }

    #[test]
    fn the_first_executable_file_wins_past_missing_directories_files_and_directories() {
        let temp = tempfile::tempdir().unwrap();
        let (a, b, c, d) = (temp.path().join("a"), temp.path().join("b"), temp.path().join("c"), temp.path().join("d"));
        for dir in [&b, &c, &d] {
            std::fs::create_dir(dir).unwrap();
        }
        // `a` does not exist; `b/proxy` is a directory; `c/proxy` is not executable.
        std::fs::create_dir(b.join("proxy")).unwrap();
        std::fs::write(c.join("proxy"), "#!/bin/sh\n").unwrap();
        std::fs::set_permissions(c.join("proxy"), std::fs::Permissions::from_mode(0o644)).unwrap();
        executable(&d.join("proxy"));
        let path = path_of(&[&a, &b, &c, &d]);
        assert_eq!(find_in(Path::new("proxy"), &path).unwrap(), d.join("proxy"));

        // Without `d`, what is there may not be executed: said so.
        let path = path_of(&[&a, &b, &c]);
        let error = find_in(Path::new("proxy"), &path).unwrap_err();
        assert_eq!(error, ProgramNotFound { program: "proxy".into(), path: path.clone(), denied: true });
        assert!(error.to_string().ends_with("(a file of that name may not be executed)"), "{error}");
        let error = find_in(Path::new("proxy"), &path_of(&[&a])).unwrap_err();
        assert!(!error.denied);
        assert_eq!(error.to_string(), format!("program `proxy` not found in PATH `{}`", a.display()));
    }

    #[test]
    fn an_empty_or_relative_entry_never_finds_a_file_in_the_working_directory() {
        let temp = tempfile::tempdir().unwrap();
        executable(&temp.path().join("proxy"));
        let here = std::env::current_dir().unwrap();
        // Relative to this test's working directory, a file that would be found if `.`
        // counted.
        let relative = temp.path().strip_prefix("/").unwrap();
        let relative = std::iter::repeat_n("..", here.components().count() - 1).collect::<PathBuf>().join(relative);
        assert!(relative.join("proxy").exists());
        let path = std::env::join_paths([Path::new(""), &relative]).unwrap();
        assert!(find_in(Path::new("proxy"), &path).is_err());
    }

    #[test]
    fn a_path_with_a_slash_is_not_searched() {
        assert_eq!(
            find_in(Path::new("/nonexistent/proxy"), OsStr::new("/bin")).unwrap(),
            Path::new("/nonexistent/proxy")
        );
    }

    #[test]
    fn failures_continue_or_end_the_search_as_execvpe_reads_them() {
        assert_eq!(after_failure(libc::ENOENT), Next::Absent);
        assert_eq!(after_failure(libc::ENOTDIR), Next::Absent);
        assert_eq!(after_failure(libc::EACCES), Next::Denied);
        assert_eq!(after_failure(libc::ENOEXEC), Next::Stop);
        assert_eq!(after_failure(libc::E2BIG), Next::Stop);
    }
}
