//! The tiny agent of this crate tested as its authors would test it: the engine over the test
//! kit's recording backend and over the mocks, its own backend through the engine with real
//! processes, the supervisor alone, and its catalog watcher.

mod backend;
mod mocks;
mod must_fail;
mod recording;
mod supervisor;
mod support;
mod watcher;
