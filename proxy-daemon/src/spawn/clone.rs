//! Creating a process straight into its cgroup: `clone3` with `CLONE_INTO_CGROUP`, in the
//! way `posix_spawn` creates one (`CLONE_VM | CLONE_VFORK`: no copy of the address space,
//! the caller suspended until the child's exec).
//!
//! The standard library can only enter a cgroup from a `pre_exec` hook, which makes it
//! `fork` (a copy of the page tables, and copy-on-write faults in a multi-threaded parent
//! afterwards) and move the child (`cgroup.procs`) after its birth. Here the child is born
//! in its cgroup. Everything the child touches is prepared by the caller: it only makes
//! system calls, on a stack of its own, and reports a failure through memory it shares with
//! the suspended caller.
//!
//! Only on x86-64 (the child's first instructions are a few lines of assembly); elsewhere,
//! or where `clone3` is refused (`ENOSYS`: an old kernel or a seccomp filter), the caller
//! falls back to the standard library's way.

use std::ffi::CString;
use std::io;
use std::os::fd::RawFd;

/// What the child does between its birth and its exec, all prepared by the caller.
pub(super) struct ChildPlan {
    /// Where the program may be, in order: pointers into strings the caller keeps. The
    /// child tries each, as `execvpe` does, as the user it has become.
    pub(super) candidates: Vec<*const libc::c_char>,
    /// `char *const argv[]`: pointers into strings the caller keeps, then null.
    pub(super) argv: Vec<*const libc::c_char>,
    /// `char *const envp[]`, likewise; the `LISTEN_PID` slot is filled in by the child.
    pub(super) envp: Vec<*const libc::c_char>,
    pub(super) dir: CString,
    pub(super) dev_null: CString,
    pub(super) stdout: RawFd,
    pub(super) stderr: RawFd,
    /// Descriptors to place: (source, target).
    pub(super) handed: Vec<(RawFd, RawFd)>,
    /// Room for the copies of the sources, made above every target first.
    pub(super) copies: Vec<RawFd>,
    pub(super) credentials: Option<(libc::uid_t, libc::gid_t, Vec<libc::gid_t>)>,
    /// `LISTEN_PID=` and room for the pid, and its slot in `envp`.
    pub(super) listen_pid: Option<(Box<[u8; 32]>, usize)>,
    /// Set by the child when a step failed: its errno.
    pub(super) failed: i32,
}

/// `struct clone_args` of `clone3(2)`.
#[repr(C)]
#[derive(Default)]
struct CloneArgs {
    flags: u64,
    pidfd: u64,
    child_tid: u64,
    parent_tid: u64,
    exit_signal: u64,
    stack: u64,
    stack_size: u64,
    tls: u64,
    set_tid: u64,
    set_tid_size: u64,
    cgroup: u64,
}

/// The child's stack: it runs a few system calls, never Rust code that allocates or
/// unwinds.
const STACK_SIZE: usize = 64 * 1024;

/// Why [`spawn_into`] did not start the program.
pub(super) enum CloneError {
    /// `clone3` (or one of its flags) is not available: use another way.
    Unsupported,
    /// The process could not be created, or its setup or exec failed (it has been reaped).
    Failed(io::Error),
}

/// Starts `plan` in a new process born in the cgroup whose directory is `cgroup`. Returns
/// its pid once it has exec'd. (No `CLONE_PIDFD`: a pidfd made here would be in the spawn
/// thread's descriptor table; the caller opens one in its own, before any reap.)
#[cfg(target_arch = "x86_64")]
pub(super) fn spawn_into(plan: &mut ChildPlan, cgroup: RawFd) -> Result<u32, CloneError> {
    // `u128`s: 16-byte aligned, so that the top is too, as the ABI wants at the child's
    // first call.
    let mut stack = vec![0u128; STACK_SIZE / 16];
    let args = CloneArgs {
        flags: (libc::CLONE_VM | libc::CLONE_VFORK) as u64 | CLONE_INTO_CGROUP,
        exit_signal: libc::SIGCHLD as u64,
        stack: stack.as_mut_ptr() as u64,
        stack_size: STACK_SIZE as u64,
        cgroup: cgroup as u64,
        ..CloneArgs::default()
    };
    // No signal handler of this process may run in the child, on the caller's memory: every
    // signal is blocked on this thread around the clone (the child resets the handlers, then
    // unblocks).
    let mut old_mask = std::mem::MaybeUninit::<libc::sigset_t>::uninit();
    #[allow(unsafe_code)]
    // SAFETY: sigfillset and pthread_sigmask write into sigsets owned here.
    unsafe {
        let mut all = std::mem::MaybeUninit::<libc::sigset_t>::uninit();
        libc::sigfillset(all.as_mut_ptr());
        libc::pthread_sigmask(libc::SIG_SETMASK, all.as_ptr(), old_mask.as_mut_ptr());
    }
    let result: i64;
    let plan_ptr: *mut ChildPlan = plan;
    #[allow(unsafe_code)]
    // SAFETY: clone3 with CLONE_VM | CLONE_VFORK suspends this thread until the child execs
    // or exits, so the child has `stack`, `plan` and `args` to itself meanwhile, and they
    // outlive it. The child starts on its own stack at the instruction after `syscall`,
    // with this thread's registers: it clears the frame pointer and calls `child` (which
    // never returns) with `plan` from a callee-saved register. The parent goes on at `2:`.
    unsafe {
        std::arch::asm!(
            "syscall",
            "test rax, rax",
            "jnz 2f",
            "xor ebp, ebp",
            "mov rdi, r12",
            "call r13",
            "ud2",
            "2:",
            inlateout("rax") libc::SYS_clone3 => result,
            in("rdi") std::ptr::addr_of!(args),
            in("rsi") std::mem::size_of::<CloneArgs>(),
            in("r12") plan_ptr,
            in("r13") child as extern "C" fn(*mut ChildPlan) -> ! as usize,
            lateout("rcx") _,
            lateout("r11") _,
        );
        libc::pthread_sigmask(libc::SIG_SETMASK, old_mask.as_ptr(), std::ptr::null_mut());
    }
    drop(stack);
    if result < 0 {
        let errno = i32::try_from(-result).unwrap_or(libc::EINVAL);
        return Err(match errno {
            libc::ENOSYS | libc::E2BIG => CloneError::Unsupported,
            _ => CloneError::Failed(io::Error::from_raw_os_error(errno)),
        });
    }
    let pid = u32::try_from(result).unwrap_or(0);
    // Written by the child, through a pointer the compiler does not see.
    #[allow(unsafe_code)]
    // SAFETY: a read of an `i32` field of a live, exclusively borrowed plan.
    let failed = unsafe { std::ptr::read_volatile(std::ptr::addr_of!(plan.failed)) };
    if failed != 0 {
        // It exited without exec: reap it, so that it leaves no zombie.
        let mut status = 0;
        #[allow(unsafe_code)]
        // SAFETY: waitpid on our own child, with a status integer owned here.
        let _reaped = unsafe { libc::waitpid(result as libc::pid_t, &mut status, 0) };
        return Err(CloneError::Failed(io::Error::from_raw_os_error(failed)));
    }
    Ok(pid)
}

/// Elsewhere than x86-64: always the standard library's way.
#[cfg(not(target_arch = "x86_64"))]
pub(super) fn spawn_into(_plan: &mut ChildPlan, _cgroup: RawFd) -> Result<u32, CloneError> {
    Err(CloneError::Unsupported)
}

/// `CLONE_INTO_CGROUP` (Linux 5.7).
const CLONE_INTO_CGROUP: u64 = 0x2_0000_0000;

/// The child: from its birth to its exec. Only system calls on data the parent prepared;
/// on a failure, the errno in `plan.failed` and `_exit(127)`.
#[allow(unsafe_code)]
extern "C" fn child(plan: *mut ChildPlan) -> ! {
    // SAFETY: `plan` points to the parent's plan, which outlives this child (the parent is
    // suspended until it execs or exits); only this child touches it meanwhile. Every call
    // below is a system call on integers, on NUL-terminated strings and pointer arrays the
    // parent built, or on sigsets and sigactions on this stack.
    unsafe {
        let plan = &mut *plan;
        // Handlers of the parent are not this process's business: default for every handled
        // signal (ignored ones stay ignored, as exec keeps them), and SIGPIPE, which the
        // Rust runtime ignores, back to default as a new program expects.
        for signal in 1..=libc::SIGRTMAX() {
            let mut old = std::mem::MaybeUninit::<libc::sigaction>::zeroed();
            if libc::sigaction(signal, std::ptr::null(), old.as_mut_ptr()) != 0 {
                continue;
            }
            let handler = old.assume_init().sa_sigaction;
            if signal == libc::SIGPIPE || (handler != libc::SIG_DFL && handler != libc::SIG_IGN) {
                let mut default = std::mem::MaybeUninit::<libc::sigaction>::zeroed().assume_init();
                default.sa_sigaction = libc::SIG_DFL;
                libc::sigaction(signal, &default, std::ptr::null_mut());
            }
        }
        if libc::setpgid(0, 0) != 0 {
            fail(plan);
        }
        let null = libc::open(plan.dev_null.as_ptr(), libc::O_RDONLY);
        if null < 0 || (null != 0 && libc::dup2(null, 0) < 0) {
            fail(plan);
        }
        if null != 0 {
            libc::close(null);
        }
        if libc::dup2(plan.stdout, 1) < 0 || libc::dup2(plan.stderr, 2) < 0 {
            fail(plan);
        }
        let above = plan.handed.iter().map(|&(_, target)| target).max().unwrap_or(2).saturating_add(1);
        for index in 0..plan.handed.len() {
            let copy = libc::fcntl(plan.handed[index].0, libc::F_DUPFD_CLOEXEC, above);
            if copy < 0 {
                fail(plan);
            }
            plan.copies[index] = copy;
        }
        for index in 0..plan.handed.len() {
            if libc::dup2(plan.copies[index], plan.handed[index].1) < 0 {
                fail(plan);
            }
        }
        if libc::chdir(plan.dir.as_ptr()) != 0 {
            fail(plan);
        }
        if let Some((uid, gid, groups)) = &plan.credentials {
            if libc::setgroups(groups.len(), groups.as_ptr()) != 0 || libc::setgid(*gid) != 0 || libc::setuid(*uid) != 0
            {
                fail(plan);
            }
        }
        if let Some((buffer, slot)) = plan.listen_pid.as_mut() {
            // A raw getpid: the child shares the parent's thread-local state.
            super::write_listen_pid(buffer, libc::syscall(libc::SYS_getpid).unsigned_abs() as u32);
            let (address, slot) = (buffer.as_ptr().cast(), *slot);
            plan.envp[slot] = address;
        }
        let mut empty = std::mem::MaybeUninit::<libc::sigset_t>::uninit();
        libc::sigemptyset(empty.as_mut_ptr());
        libc::pthread_sigmask(libc::SIG_SETMASK, empty.as_ptr(), std::ptr::null_mut());
        let errno = super::exec_first(plan.candidates.iter().copied(), plan.argv.as_ptr(), plan.envp.as_ptr());
        fail_with(plan, errno)
    }
}

/// Records errno in `plan` and ends the child without running anything of the parent's.
///
/// # Safety
///
/// Only in the child of [`spawn_into`].
#[allow(unsafe_code)]
unsafe fn fail(plan: &mut ChildPlan) -> ! {
    // SAFETY: errno is this thread's; the caller's promise is passed on.
    unsafe { fail_with(plan, *libc::__errno_location()) }
}

/// Records `errno` in `plan` and ends the child without running anything of the parent's.
///
/// # Safety
///
/// Only in the child of [`spawn_into`].
#[allow(unsafe_code)]
unsafe fn fail_with(plan: &mut ChildPlan, errno: i32) -> ! {
    plan.failed = if errno == 0 { libc::EINVAL } else { errno };
    // SAFETY: `_exit` ends the child at once.
    unsafe {
        libc::syscall(libc::SYS_exit_group, 127);
        core::hint::unreachable_unchecked()
    }
}
