//! The engine as a crate that uses it would test it: through its public API, its mocks and
//! its test kit (`tether_manager::testing`) only.

mod contract;
mod mock_failures;
mod mocks;
mod recording;
mod support;
mod waits;
