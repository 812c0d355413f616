//! `compactd.v1.Context` as the generated messages hold it (`build.rs` maps the type to
//! `pb::Context`, this type over the generated message and list types): its fields as
//! prost decodes or builds them, and the native messages and JSON text as the chunks
//! they are made of.
//!
//! GetContext keeps each context message rendered in the session's context cache
//! (`engine::ContextCache`): its native `Message` body encoded, or its JSON. A reply
//! carries those chunks and writes them as they are, the way `ListValue` writes its
//! entries: no `Message` value per message (each several hundred bytes to build, walk
//! and drop) and no `String` joined from the JSON chunks only for prost to copy it again.
//! Anything decoded fills the fields, as with the generated type. Generic over the field
//! types so that this file does not depend on the generated module that depends on it.

use std::sync::Arc;

use prost::bytes::{Buf, BufMut};
use prost::encoding::{
    DecodeContext, WireType, encode_key, encode_varint, encoded_len_varint, key_len, message,
    skip_field, string, uint32, uint64,
};

use crate::engine::JsonArray;

/// The field `messages` is.
const MESSAGES_FIELD: u32 = 1;
/// The field `openai_messages_json` is.
const JSON_FIELD: u32 = 7;

/// A `compactd.v1.Context` (`messages`: `M`, `openai_messages`: `L`).
#[derive(Clone)]
pub struct Context<M, L> {
    /// Native messages (`CONTEXT_FORMAT_NATIVE`), as decoded or built.
    pub messages: Vec<M>,
    /// Native messages as their encoded bodies (each a `Message`'s fields), written as
    /// `messages` entries after those of `messages` (decoding never sets it).
    pub messages_encoded: Vec<Arc<[u8]>>,
    /// OpenAI messages as protobuf values (`CONTEXT_FORMAT_OPENAI`).
    pub openai_messages: Option<L>,
    /// Estimated tokens of the context.
    pub estimated_tokens: u64,
    /// First message of the context (the last compaction boundary), or empty.
    pub boundary_message_id: String,
    /// Messages held in the session.
    pub session_messages: u32,
    /// Messages the context keeps.
    pub context_messages: u32,
    /// OpenAI messages as JSON text (`CONTEXT_FORMAT_OPENAI_JSON`), as decoded or built
    /// whole.
    pub openai_messages_json: String,
    /// The same text as its elements: when set, written as `openai_messages_json` in its
    /// place (decoding never sets it).
    pub openai_messages_json_array: Option<JsonArray>,
}

impl<M, L> Default for Context<M, L> {
    fn default() -> Self {
        Context {
            messages: Vec::new(),
            messages_encoded: Vec::new(),
            openai_messages: None,
            estimated_tokens: 0,
            boundary_message_id: String::new(),
            session_messages: 0,
            context_messages: 0,
            openai_messages_json: String::new(),
            openai_messages_json_array: None,
        }
    }
}

/// What the fields must be: generated protobuf messages.
pub trait Field: prost::Message + Default + PartialEq {}

impl<T: prost::Message + Default + PartialEq> Field for T {}

impl<M: Field, L: Field> Context<M, L> {
    /// The JSON text's bytes on the wire (without its key and length), or None when the
    /// field is empty and not written.
    fn json_len(&self) -> Option<usize> {
        match &self.openai_messages_json_array {
            Some(array) => Some(array.text_len()),
            None => Some(self.openai_messages_json.len()).filter(|n| *n > 0),
        }
    }
}

impl<M: Field, L: Field> PartialEq for Context<M, L> {
    /// The same fields; a context carrying encoded messages or its JSON as an array equals
    /// any context that encodes to the same bytes.
    fn eq(&self, other: &Self) -> bool {
        use prost::Message as _;
        let built =
            |c: &Self| c.messages_encoded.is_empty() && c.openai_messages_json_array.is_none();
        if built(self) && built(other) {
            self.messages == other.messages
                && self.openai_messages == other.openai_messages
                && self.estimated_tokens == other.estimated_tokens
                && self.boundary_message_id == other.boundary_message_id
                && self.session_messages == other.session_messages
                && self.context_messages == other.context_messages
                && self.openai_messages_json == other.openai_messages_json
        } else {
            self.encode_to_vec() == other.encode_to_vec()
        }
    }
}

impl<M: std::fmt::Debug, L: std::fmt::Debug> std::fmt::Debug for Context<M, L> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("Context");
        d.field("messages", &self.messages)
            .field("messages_encoded", &self.messages_encoded.len())
            .field("openai_messages", &self.openai_messages)
            .field("estimated_tokens", &self.estimated_tokens)
            .field("boundary_message_id", &self.boundary_message_id)
            .field("session_messages", &self.session_messages)
            .field("context_messages", &self.context_messages);
        match &self.openai_messages_json_array {
            Some(array) => d.field("openai_messages_json_bytes", &array.text_len()),
            None => d.field("openai_messages_json", &self.openai_messages_json),
        };
        d.finish()
    }
}

impl<M: Field, L: Field> prost::Message for Context<M, L> {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        message::encode_repeated(MESSAGES_FIELD, &self.messages, buf);
        for body in &self.messages_encoded {
            encode_key(MESSAGES_FIELD, WireType::LengthDelimited, buf);
            encode_varint(body.len() as u64, buf);
            buf.put_slice(body);
        }
        if let Some(list) = &self.openai_messages {
            message::encode(2, list, buf);
        }
        if self.estimated_tokens != 0 {
            uint64::encode(3, &self.estimated_tokens, buf);
        }
        if !self.boundary_message_id.is_empty() {
            string::encode(4, &self.boundary_message_id, buf);
        }
        if self.session_messages != 0 {
            uint32::encode(5, &self.session_messages, buf);
        }
        if self.context_messages != 0 {
            uint32::encode(6, &self.context_messages, buf);
        }
        match &self.openai_messages_json_array {
            Some(array) => {
                encode_key(JSON_FIELD, WireType::LengthDelimited, buf);
                encode_varint(array.text_len() as u64, buf);
                for piece in array.pieces() {
                    buf.put_slice(piece);
                }
            }
            None if !self.openai_messages_json.is_empty() => {
                string::encode(JSON_FIELD, &self.openai_messages_json, buf);
            }
            None => {}
        }
    }

    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
    ) -> Result<(), prost::DecodeError> {
        let (field, merged) = match tag {
            MESSAGES_FIELD => (
                "messages",
                message::merge_repeated(wire_type, &mut self.messages, buf, ctx),
            ),
            2 => (
                "openai_messages",
                message::merge(
                    wire_type,
                    self.openai_messages.get_or_insert_with(Default::default),
                    buf,
                    ctx,
                ),
            ),
            3 => (
                "estimated_tokens",
                uint64::merge(wire_type, &mut self.estimated_tokens, buf, ctx),
            ),
            4 => (
                "boundary_message_id",
                string::merge(wire_type, &mut self.boundary_message_id, buf, ctx),
            ),
            5 => (
                "session_messages",
                uint32::merge(wire_type, &mut self.session_messages, buf, ctx),
            ),
            6 => (
                "context_messages",
                uint32::merge(wire_type, &mut self.context_messages, buf, ctx),
            ),
            JSON_FIELD => (
                "openai_messages_json",
                string::merge(wire_type, &mut self.openai_messages_json, buf, ctx),
            ),
            _ => return skip_field(wire_type, tag, buf, ctx),
        };
        merged.map_err(|mut e| {
            e.push("Context", field);
            e
        })
    }

    fn encoded_len(&self) -> usize {
        let mut n = message::encoded_len_repeated(MESSAGES_FIELD, &self.messages);
        for body in &self.messages_encoded {
            n += key_len(MESSAGES_FIELD) + encoded_len_varint(body.len() as u64) + body.len();
        }
        if let Some(list) = &self.openai_messages {
            n += message::encoded_len(2, list);
        }
        if self.estimated_tokens != 0 {
            n += uint64::encoded_len(3, &self.estimated_tokens);
        }
        if !self.boundary_message_id.is_empty() {
            n += string::encoded_len(4, &self.boundary_message_id);
        }
        if self.session_messages != 0 {
            n += uint32::encoded_len(5, &self.session_messages);
        }
        if self.context_messages != 0 {
            n += uint32::encoded_len(6, &self.context_messages);
        }
        if let Some(len) = self.json_len() {
            n += key_len(JSON_FIELD) + encoded_len_varint(len as u64) + len;
        }
        n
    }

    fn clear(&mut self) {
        *self = Context::default();
    }
}

#[cfg(test)]
mod tests {
    use prost::Message as _;

    use crate::engine::JsonArray;
    use crate::server::pb;

    fn array(elements: &[&str]) -> JsonArray {
        JsonArray::new(elements.iter().map(|e| e.as_bytes().into()).collect())
    }

    /// A context carrying its JSON as elements encodes as the context holding the joined
    /// text, and decodes into that text; so does the empty array.
    #[test]
    fn a_json_array_encodes_as_its_joined_text_and_decodes_into_it() {
        let elements = [
            r#"{"role":"user","content":"héllo"}"#,
            r#"{"role":"assistant","content":"ok"},{"role":"tool","content":"x"}"#,
        ];
        for (elements, text) in [
            (&elements[..], format!("[{},{}]", elements[0], elements[1])),
            (&elements[..1], format!("[{}]", elements[0])),
            (&[][..], "[]".to_string()),
        ] {
            let context = |json: String, array: Option<JsonArray>| pb::Context {
                estimated_tokens: 42,
                boundary_message_id: "m7".into(),
                session_messages: 9,
                context_messages: 3,
                openai_messages_json: json,
                openai_messages_json_array: array,
                ..Default::default()
            };
            let whole = context(text.clone(), None);
            let carried = context(String::new(), Some(array(elements)));
            assert_eq!(
                carried
                    .openai_messages_json_array
                    .as_ref()
                    .map(JsonArray::text_len),
                Some(text.len())
            );
            assert_eq!(carried.encoded_len(), whole.encoded_len(), "{text}");
            let bytes = carried.encode_to_vec();
            assert_eq!(bytes, whole.encode_to_vec(), "{text}");
            assert_eq!(carried, whole);
            let back = pb::Context::decode(bytes.as_slice()).expect("decodes");
            assert_eq!(back.openai_messages_json, text);
            assert!(back.openai_messages_json_array.is_none());
            assert_eq!((back.estimated_tokens, back.context_messages), (42, 3));
            assert_eq!(back, whole);
        }
    }

    /// Messages carried as their encoded bodies encode as the messages they were encoded
    /// from, after any built ones, and decode back into fields.
    #[test]
    fn encoded_messages_encode_as_their_fields_and_decode_into_them() {
        let m = |id: &str| pb::Message {
            info: Some(pb::MessageInfo {
                id: id.into(),
                role: "user".into(),
                ..Default::default()
            }),
            parts: vec![pb::Part {
                id: format!("{id}-p1"),
                message_id: id.into(),
                kind: Some(pb::part::Kind::Text(pb::TextPart {
                    text: "hello".into(),
                    ..Default::default()
                })),
                ..Default::default()
            }],
        };
        let (a, b) = (m("m1"), m("m2"));
        let built = pb::Context {
            messages: vec![a.clone(), b.clone()],
            estimated_tokens: 7,
            ..Default::default()
        };
        let mut carried = pb::Context {
            messages: vec![a.clone()],
            messages_encoded: vec![b.encode_to_vec().into()],
            estimated_tokens: 7,
            ..Default::default()
        };
        let bytes = carried.encode_to_vec();
        assert_eq!(bytes, built.encode_to_vec());
        assert_eq!(carried.encoded_len(), built.encoded_len());
        assert_eq!(carried, built);
        carried.messages.clear();
        carried.messages_encoded.insert(0, a.encode_to_vec().into());
        assert_eq!(carried.encode_to_vec(), bytes);
        let back = pb::Context::decode(bytes.as_slice()).expect("decodes");
        assert_eq!(back.messages, [a, b]);
        assert!(back.messages_encoded.is_empty());
        assert_eq!(back.messages[1].parts[0].id, "m2-p1");
        assert_ne!(back, pb::Context::default());
    }

    /// Every field encodes where prost's generated type puts it: a context with each
    /// field set decodes as the standard protobuf fields of the schema.
    #[test]
    fn fields_keep_their_numbers() {
        let context = pb::Context {
            messages: vec![pb::Message::default()],
            messages_encoded: Vec::new(),
            openai_messages: Some(Default::default()),
            estimated_tokens: 1,
            boundary_message_id: "b".into(),
            session_messages: 2,
            context_messages: 3,
            openai_messages_json: "[]".into(),
            openai_messages_json_array: None,
        };
        let bytes = context.encode_to_vec();
        let mut buf = bytes.as_slice();
        let mut seen = Vec::new();
        while !buf.is_empty() {
            let (tag, wire_type) = prost::encoding::decode_key(&mut buf).expect("key");
            seen.push(tag);
            prost::encoding::skip_field(wire_type, tag, &mut buf, Default::default())
                .expect("field");
        }
        assert_eq!(seen, [1, 2, 3, 4, 5, 6, 7]);
        assert_eq!(
            pb::Context::decode(bytes.as_slice()).expect("decodes"),
            context
        );
        // The numbers and types are the schema's.
        let set = prost_types::FileDescriptorSet::decode(pb::FILE_DESCRIPTOR_SET).expect("set");
        let schema = set
            .file
            .iter()
            .filter(|f| f.package() == "compactd.v1")
            .flat_map(|f| &f.message_type)
            .find(|m| m.name() == "Context")
            .expect("compactd.v1.Context");
        let fields: Vec<_> = schema
            .field
            .iter()
            .map(|f| (f.name(), f.number(), f.type_name()))
            .collect();
        assert_eq!(
            fields,
            [
                ("messages", 1, ".compactd.v1.Message"),
                ("openai_messages", 2, ".google.protobuf.ListValue"),
                ("estimated_tokens", 3, ""),
                ("boundary_message_id", 4, ""),
                ("session_messages", 5, ""),
                ("context_messages", 6, ""),
                ("openai_messages_json", 7, ""),
            ]
        );
        use prost_types::field_descriptor_proto::Type;
        let types: Vec<_> = schema.field.iter().map(|f| f.r#type()).collect();
        assert_eq!(
            types,
            [
                Type::Message,
                Type::Message,
                Type::Uint64,
                Type::String,
                Type::Uint32,
                Type::Uint32,
                Type::String,
            ]
        );
    }
}
