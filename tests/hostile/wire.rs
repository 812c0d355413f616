//! Raw protobuf for the attacks: payloads written byte by byte (the decoded form of an
//! amplifying request is what must never exist, so the test does not build it either),
//! and a codec that sends such bytes as a gRPC message as they are, past any client-side
//! size limit. Each builder is checked by decoding a small instance with prost.

use std::marker::PhantomData;

use prost::bytes::BufMut;
use prost::encoding::{WireType, encode_key, encode_varint};
use tonic::Status;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::codegen::http::uri::PathAndQuery;
use tonic::transport::Channel;

/// Sends `Vec<u8>` as the message as is; decodes replies as `D`.
pub struct Raw<D>(PhantomData<D>);

impl<D> Default for Raw<D> {
    fn default() -> Self {
        Raw(PhantomData)
    }
}

pub struct RawEncoder;
pub struct ProstDecoder<D>(PhantomData<D>);

impl<D: prost::Message + Default + Send + 'static> Codec for Raw<D> {
    type Encode = Vec<u8>;
    type Decode = D;
    type Encoder = RawEncoder;
    type Decoder = ProstDecoder<D>;

    fn encoder(&mut self) -> RawEncoder {
        RawEncoder
    }

    fn decoder(&mut self) -> ProstDecoder<D> {
        ProstDecoder(PhantomData)
    }
}

impl Encoder for RawEncoder {
    type Item = Vec<u8>;
    type Error = Status;

    fn encode(&mut self, item: Vec<u8>, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.put_slice(&item);
        Ok(())
    }
}

impl<D: prost::Message + Default> Decoder for ProstDecoder<D> {
    type Item = D;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<D>, Status> {
        D::decode(src)
            .map(Some)
            .map_err(|e| Status::internal(format!("reply does not decode: {e}")))
    }
}

fn grpc(channel: Channel) -> tonic::client::Grpc<Channel> {
    tonic::client::Grpc::new(channel)
        .max_encoding_message_size(usize::MAX)
        .max_decoding_message_size(usize::MAX)
}

/// A unary call of `method` (`/compactd.v1.Sessions/OpenSession`) with `body` as the
/// request message.
pub async fn unary<D: prost::Message + Default + Send + 'static>(
    channel: Channel,
    method: &'static str,
    body: Vec<u8>,
) -> Result<D, Status> {
    let mut grpc = grpc(channel);
    grpc.ready()
        .await
        .map_err(|e| Status::unavailable(format!("channel not ready: {e}")))?;
    grpc.unary(
        tonic::Request::new(body),
        PathAndQuery::from_static(method),
        Raw::<D>::default(),
    )
    .await
    .map(tonic::Response::into_inner)
}

/// `Sessions/Stream` with `updates` (raw `ClientUpdate`s) as the request stream.
pub async fn stream(
    channel: Channel,
    updates: Vec<Vec<u8>>,
) -> Result<tonic::Streaming<compactd::server::pb::ServerEvent>, Status> {
    let mut grpc = grpc(channel);
    grpc.ready()
        .await
        .map_err(|e| Status::unavailable(format!("channel not ready: {e}")))?;
    grpc.streaming(
        tonic::Request::new(tokio_stream::iter(updates)),
        PathAndQuery::from_static("/compactd.v1.Sessions/Stream"),
        Raw::<compactd::server::pb::ServerEvent>::default(),
    )
    .await
    .map(tonic::Response::into_inner)
}

// ---- protobuf by hand ----

/// A length-delimited field.
fn ld(tag: u32, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(body.len() + 16);
    encode_key(tag, WireType::LengthDelimited, &mut out);
    encode_varint(body.len() as u64, &mut out);
    out.extend_from_slice(body);
    out
}

fn string(tag: u32, s: &str) -> Vec<u8> {
    ld(tag, s.as_bytes())
}

fn varint(tag: u32, v: u64) -> Vec<u8> {
    let mut out = Vec::new();
    encode_key(tag, WireType::Varint, &mut out);
    encode_varint(v, &mut out);
    out
}

/// `n` empty messages in repeated field `tag` (< 16): two bytes each on the wire.
fn empties(tag: u32, n: usize) -> Vec<u8> {
    assert!(tag < 16, "a one-byte key");
    let mut key = Vec::new();
    encode_key(tag, WireType::LengthDelimited, &mut key);
    let mut out = Vec::with_capacity(2 * n);
    for _ in 0..n {
        out.push(key[0]);
        out.push(0);
    }
    out
}

fn cat(fields: &[Vec<u8>]) -> Vec<u8> {
    fields.concat()
}

/// `SessionInfo { id, todos: [Todo {}; n] }`.
fn session_with_todos(id: &str, n: usize) -> Vec<u8> {
    cat(&[string(1, id), empties(6, n)])
}

/// `Struct` with one field `key`: a `ListValue` of `n` empty `Value`s.
fn struct_with_list(key: &str, n: usize, more: &[Vec<u8>]) -> Vec<u8> {
    let list = empties(1, n); // ListValue.values
    let value = ld(6, &list); // Value.list_value
    let entry = cat(&[string(1, key), ld(2, &value)]);
    let mut fields = vec![ld(1, &entry)]; // Struct.fields
    fields.extend_from_slice(more);
    cat(&fields)
}

/// `OpenSessionRequest` whose session carries `n` empty todos.
pub fn open_session_with_todos(id: &str, n: usize) -> Vec<u8> {
    ld(1, &session_with_todos(id, n))
}

/// A `ClientUpdate` (`open`) whose session carries `n` empty todos.
pub fn stream_open_with_todos(seq: u64, id: &str, n: usize) -> Vec<u8> {
    cat(&[
        varint(1, seq),
        string(2, id),
        ld(10, &session_with_todos(id, n)),
    ])
}

/// `UpsertPartRequest` of a completed tool part whose `state.input` holds a list of `n`
/// empty values.
pub fn upsert_tool_part_with_list(session: &str, message: &str, part: &str, n: usize) -> Vec<u8> {
    let state = cat(&[
        string(1, "completed"),
        ld(2, &struct_with_list("k", n, &[])),
    ]);
    let tool = cat(&[string(1, "call_1"), string(2, "bash"), ld(3, &state)]);
    let part = cat(&[string(1, part), string(2, message), ld(12, &tool)]);
    cat(&[string(1, session), ld(2, &part)])
}

/// `ImportSessionRequest` whose `export` object has an `info` and `messages`: a list of
/// `n` empty values.
pub fn import_with_list(session: &str, n: usize) -> Vec<u8> {
    // info: { "id": session }
    let id_value = string(3, session); // Value.string_value
    let id_entry = cat(&[string(1, "id"), ld(2, &id_value)]);
    let info_struct = ld(1, &id_entry);
    let info_value = ld(5, &info_struct); // Value.struct_value
    let info_entry = cat(&[string(1, "info"), ld(2, &info_value)]);
    let export = struct_with_list("messages", n, &[ld(1, &info_entry)]);
    cat(&[ld(6, &export), string(2, session)])
}

/// The number of two-byte entries that make a request of about `bytes`.
pub fn entries_for(bytes: usize) -> usize {
    (bytes - 512) / 2
}

/// Checks every builder by decoding a small instance (called by the tests before they
/// send the big ones).
pub fn check_builders() {
    use compactd::server::pb;
    use prost::Message;
    use prost_types::value::Kind;

    let open = pb::OpenSessionRequest::decode(&open_session_with_todos("s", 3)[..]).unwrap();
    let info = open.session.unwrap();
    assert_eq!((info.id.as_str(), info.todos.len()), ("s", 3));

    let update = pb::ClientUpdate::decode(&stream_open_with_todos(7, "s", 4)[..]).unwrap();
    assert_eq!((update.seq, update.session_id.as_str()), (7, "s"));
    let Some(pb::client_update::Update::Open(info)) = update.update else {
        panic!("not an open: {update:?}")
    };
    assert_eq!(info.todos.len(), 4);

    let list_len = |s: &prost_types::Struct, key: &str| match &s.fields[key].kind {
        Some(Kind::ListValue(l)) => l.values.len(),
        other => panic!("{key} is not a list: {other:?}"),
    };
    let part =
        pb::UpsertPartRequest::decode(&upsert_tool_part_with_list("s", "m", "p", 5)[..]).unwrap();
    assert_eq!(part.session_id, "s");
    let part = part.part.unwrap();
    assert_eq!((part.id.as_str(), part.message_id.as_str()), ("p", "m"));
    let Some(pb::part::Kind::Tool(tool)) = part.kind else {
        panic!("not a tool part")
    };
    let state = tool.state.unwrap();
    assert_eq!(state.status, "completed");
    assert_eq!(list_len(state.input.as_ref().unwrap(), "k"), 5);

    let import = pb::ImportSessionRequest::decode(&import_with_list("s", 6)[..]).unwrap();
    assert_eq!(import.session_id, "s");
    let export = import.export.unwrap();
    assert_eq!(list_len(&export, "messages"), 6);
    assert!(
        matches!(&export.fields["info"].kind, Some(Kind::StructValue(i))
        if matches!(&i.fields["id"].kind, Some(Kind::StringValue(id)) if id == "s"))
    );

    let n = entries_for(1 << 20);
    let len = open_session_with_todos("s", n).len();
    assert!(len < 1 << 20 && len > (1 << 20) - 600, "{len}");
}
