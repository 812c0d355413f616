//! `google.protobuf.ListValue` as the generated messages hold it (`build.rs` maps the type
//! here): prost's values when decoded or built, or a body already in wire form.
//!
//! GetContext's protobuf OpenAI shape is written straight to wire bytes
//! ([`super::wire_value`]); carrying them in the reply as they are spares building a
//! tree of values that prost would only walk again to encode. Clients built from these
//! stubs decode into `values`, as with prost's own type.

use prost::bytes::{Buf, BufMut};
use prost::encoding::{DecodeContext, WireType, message, skip_field};

/// A `google.protobuf.ListValue`: `values` as prost decodes them, or a wire-form body.
#[derive(Clone, Default, PartialEq)]
pub struct ListValue {
    /// The list's values (decoded, or built as values).
    pub values: Vec<prost_types::Value>,
    /// The encoded `values` field, written in place of `values` when not empty.
    encoded: Vec<u8>,
}

impl ListValue {
    /// A list whose body is already encoded: repeated `values` entries (field 1), as
    /// [`super::wire_value::list_body`] writes them. Encodes as exactly these bytes.
    pub fn from_encoded(body: Vec<u8>) -> ListValue {
        ListValue {
            values: Vec::new(),
            encoded: body,
        }
    }

    /// Bytes held by the encoded body (what a reply holds in flight).
    pub fn held_bytes(&self) -> usize {
        self.encoded.capacity()
    }
}

impl std::fmt::Debug for ListValue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ListValue")
            .field("values", &self.values)
            .field("encoded_bytes", &self.encoded.len())
            .finish()
    }
}

impl prost::Message for ListValue {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        if self.encoded.is_empty() {
            message::encode_repeated(1, &self.values, buf);
        } else {
            buf.put_slice(&self.encoded);
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
        if self.encoded.is_empty() {
            message::encoded_len_repeated(1, &self.values)
        } else {
            self.encoded.len()
        }
    }

    fn clear(&mut self) {
        self.values.clear();
        self.encoded.clear();
    }
}
