//! The reconcile engine of tether.
//!
//! It keeps the proxies that run equal to the proxies the catalog asks for, through traits,
//! and never touches an operating-system process itself.

#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]
