//! The operating-system backend of tether.
//!
//! It spawns proxy processes, supervises them, restarts them with backoff, stops them
//! gracefully and adopts them again after an agent restart.

#![deny(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]
