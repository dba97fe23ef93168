//! Integration tests of the supervisor with real processes.
//!
//! They own nothing outside their temporary directories, and they never leave a
//! process behind: every process they start carries a per-test marker in its
//! environment, and a drop guard SIGKILLs whatever still carries it, pass or fail.

mod adopt;
mod fixture;
mod health;
mod journal;
mod listen;
mod logs;
mod reload;
mod restart;
mod root;
mod spawn;
mod standalone;
mod stop;
mod support;
mod ways;
