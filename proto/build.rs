//! Compiles `proto/kvtier.proto` with the pure-Rust `protox` parser, so no system `protoc` is needed.
#[cfg(feature = "grpc")]
fn main() {
    println!("cargo:rerun-if-changed=proto/kvtier.proto");
    let fds = protox::compile(["proto/kvtier.proto"], ["proto"]).expect("parse proto/kvtier.proto");
    tonic_prost_build::configure().bytes(".").compile_fds(fds).expect("generate gRPC code from proto/kvtier.proto");
}

#[cfg(not(feature = "grpc"))]
fn main() {}
