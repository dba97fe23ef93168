//! The catalog's inputs, and what the agent keeps about them: config dirs and API
//! registrations (`sources`), what the register API may set (`policy`), the proxies
//! held down by `tether stop` (`held`), which proxy a name or a token means (`names`), and
//! where a service's instances take mutual TLS (`mesh`).
//!
//! The agent's wiring, the API and the fleet follower use it; it uses none of them, and it
//! never starts a process.

pub(crate) mod held;
pub(crate) mod names;
pub(crate) mod policy;
pub(crate) mod sources;
