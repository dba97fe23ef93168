//! The binary's error vocabulary: [`UsageError`], the one error that `main` maps to exit
//! code 2 (bad input or config), and `error_chain`, which prints an error with its causes.
//!
//! Every other error is a runtime failure, exit code 1. This module decides nothing else.

/// An error that is the user's input, not a runtime failure: exit code 2.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub(crate) struct UsageError(pub(crate) String);

pub(crate) use tether_state::error_chain;
