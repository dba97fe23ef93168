//! The `tether` binary.
fn main() {}
