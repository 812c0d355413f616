//! Compiles `proto/compactd/v1/*.proto` in pure Rust (protox), so a fresh machine needs no
//! system `protoc`. Also writes the encoded descriptor set for server reflection.

use std::path::PathBuf;

use prost::Message;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    let files = [
        "proto/compactd/v1/session.proto",
        "proto/compactd/v1/sessions.proto",
    ];
    let fds = protox::compile(files, ["proto"])?;
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(out.join("compactd_descriptor.bin"), fds.encode_to_vec())?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)?;
    Ok(())
}
