//! GetContext with its reply taken as protobuf bytes, the way the echo's client takes the
//! echo's reply (a `bytes` payload, split off the receive buffer without a copy).
//!
//! Timing GetContext through the generated client would also time decoding the reply
//! into a tree of prost values on the client, work the echo's client never does: it is the
//! host's cost, whatever server sent the bytes, and it differs by host language. The
//! bench times the call this way and decodes each reply afterwards, timed on its own.

use std::marker::PhantomData;

use prost::bytes::{Buf as _, Bytes};
use tonic::Status;
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder};
use tonic::codegen::http::uri::PathAndQuery;
use tonic::transport::Channel;
use tonic_prost::ProstEncoder;

use crate::server::pb;

/// The RPC's path, as the generated client calls it.
const GET_CONTEXT: &str = "/compactd.v1.Sessions/GetContext";

/// A gRPC client of compactd that receives GetContext's reply as bytes.
#[derive(Debug, Clone)]
pub struct RawClient {
    grpc: tonic::client::Grpc<Channel>,
}

impl RawClient {
    /// Over `channel`, allowed to receive large contexts.
    pub fn new(channel: Channel) -> RawClient {
        RawClient {
            grpc: tonic::client::Grpc::new(channel).max_decoding_message_size(1 << 30),
        }
    }

    /// Calls GetContext; the reply is its encoded `compactd.v1.Context`.
    pub async fn get_context(&mut self, request: pb::GetContextRequest) -> Result<Bytes, Status> {
        self.grpc
            .ready()
            .await
            .map_err(|e| Status::unavailable(format!("channel not ready: {e}")))?;
        let reply = self
            .grpc
            .unary(
                tonic::Request::new(request),
                PathAndQuery::from_static(GET_CONTEXT),
                RawReply::default(),
            )
            .await?;
        Ok(reply.into_inner())
    }
}

/// Encodes the request with prost; hands the reply over as its bytes.
#[derive(Debug)]
struct RawReply<T>(PhantomData<T>);

impl<T> Default for RawReply<T> {
    fn default() -> Self {
        RawReply(PhantomData)
    }
}

impl<T: prost::Message + Send + 'static> Codec for RawReply<T> {
    type Encode = T;
    type Decode = Bytes;
    type Encoder = ProstEncoder<T>;
    type Decoder = BytesDecoder;

    fn encoder(&mut self) -> Self::Encoder {
        ProstEncoder::new(BufferSettings::default())
    }

    fn decoder(&mut self) -> Self::Decoder {
        BytesDecoder
    }
}

/// A message's bytes, split off tonic's buffer.
#[derive(Debug)]
struct BytesDecoder;

impl Decoder for BytesDecoder {
    type Item = Bytes;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<Bytes>, Status> {
        Ok(Some(buf.copy_to_bytes(buf.remaining())))
    }
}
