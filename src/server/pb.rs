//! Generated protobuf types and service stubs for `compactd.v1`, and the encoded
//! descriptor set served by reflection.
#![allow(missing_docs, clippy::all)]

tonic::include_proto!("compactd.v1");
/// `compactd.v1.Context`, written by hand so a reply can carry its native messages and its
/// JSON text as the chunks of the session's context cache.
pub type Context = super::context_message::Context<Message, super::list_value::ListValue>;
include!(concat!(env!("OUT_DIR"), "/compactd_proto_names.rs"));

/// Encoded `FileDescriptorSet` of the compactd protos, for server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/compactd_descriptor.bin"));
