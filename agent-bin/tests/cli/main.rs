//! Black-box tests of the `tether` binary: real processes, temp dirs, the real socket.

// Skipped tests say why on stderr.
#![allow(clippy::print_stderr)]

mod api;
mod builtin;
mod cgroups;
mod connect;
mod datadir;
mod envoy;
mod envoy_hot;
mod envoy_mesh;
mod epoch;
mod faults;
mod fleet;
mod health;
mod intentions;
mod keeper;
mod lifecycle;
mod limits;
mod lookup;
mod mesh;
mod operations;
mod operator;
mod ordering;
mod page;
mod policy;
mod reload;
mod scale;
mod support;
mod templates;
mod validate;
mod xds;
mod xds_garbage;
mod zero_downtime;
