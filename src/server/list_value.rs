//! `google.protobuf.ListValue` as the generated messages hold it (`build.rs` maps the type
//! here): prost's values when decoded or built, or a body already in wire form.
//!
//! GetContext's protobuf OpenAI shape is written straight to wire bytes
//! (`super::wire_value`); carrying them in the reply as they are spares building a
//! tree of values that prost would only walk again to encode. The body may come in
//! chunks, one per context message, shared with the session's context cache
//! (`engine::ContextCache`): they are written one after the other, never joined first.
//! Clients built from these stubs decode into `values`, as with prost's own type.

use std::sync::Arc;

use prost::bytes::{Buf, BufMut};
use prost::encoding::{DecodeContext, WireType, message, skip_field};

/// A `google.protobuf.ListValue`: `values` as prost decodes them, or a wire-form body.
#[derive(Clone, Default)]
pub struct ListValue {
    /// The list's values (decoded, or built as values).
    pub values: Vec<prost_types::Value>,
    /// The encoded `values` field in order, written in place of `values` when not empty.
    encoded: Vec<Arc<[u8]>>,
    /// Bytes of `encoded`.
    encoded_len: usize,
}

impl ListValue {
    /// A list whose body is already encoded: repeated `values` entries (field 1), as
    /// `super::wire_value::list_body` writes them. Encodes as exactly these bytes.
    pub fn from_encoded(body: Vec<u8>) -> ListValue {
        ListValue::from_chunks(vec![Arc::from(body)])
    }

    /// A list whose body is these chunks one after the other (each whole `values`
    /// entries).
    pub fn from_chunks(chunks: Vec<Arc<[u8]>>) -> ListValue {
        let encoded_len = chunks.iter().map(|c| c.len()).sum();
        ListValue {
            values: Vec::new(),
            encoded: chunks,
            encoded_len,
        }
    }

    /// Bytes held by the encoded body (what a reply holds in flight; chunks it shares
    /// with a cache count whole, as the reply keeps them alive).
    pub fn held_bytes(&self) -> usize {
        self.encoded_len
    }
}

impl PartialEq for ListValue {
    /// The same values and the same body bytes, however the body is chunked.
    fn eq(&self, other: &ListValue) -> bool {
        self.values == other.values
            && self.encoded_len == other.encoded_len
            && self.encoded.concat() == other.encoded.concat()
    }
}

impl std::fmt::Debug for ListValue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ListValue")
            .field("values", &self.values)
            .field("encoded_bytes", &self.encoded_len)
            .finish()
    }
}

impl prost::Message for ListValue {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        if self.encoded_len == 0 {
            message::encode_repeated(1, &self.values, buf);
        } else {
            for chunk in &self.encoded {
                buf.put_slice(chunk);
            }
        }
    }

    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
    ) -> Result<(), prost::DecodeError> {
        if tag == 1 {
            message::merge_repeated(wire_type, &mut self.values, buf, ctx)
        } else {
            skip_field(wire_type, tag, buf, ctx)
        }
    }

    fn encoded_len(&self) -> usize {
        if self.encoded_len == 0 {
            message::encoded_len_repeated(1, &self.values)
        } else {
            self.encoded_len
        }
    }

    fn clear(&mut self) {
        self.values.clear();
        self.encoded.clear();
        self.encoded_len = 0;
    }
}
