//! Compiles the etcd API (`proto/etcd.proto`) into the fleet's gRPC client.
//!
//! The compiler is `protox`, written in Rust, so that building tether needs nothing but a
//! Rust toolchain: no `protoc`, and no `PROTOC` to set.

fn main() {
    println!("cargo:rerun-if-changed=proto/etcd.proto");
    let files = match protox::compile(["etcd.proto"], ["proto"]) {
        Ok(files) => files,
        Err(error) => panic!("proto/etcd.proto: {error}"),
    };
    if let Err(error) = tonic_prost_build::configure().build_server(false).build_transport(false).compile_fds(files) {
        panic!("generating the etcd client from proto/etcd.proto: {error}");
    }
}
