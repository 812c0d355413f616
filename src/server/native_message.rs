//! `compactd.v1.Message` as the generated messages hold it (`build.rs` maps the type to
//! `pb::Message`, this type over the generated info and part): its fields as prost
//! decodes or builds them, or its whole body already in wire form.
//!
//! GetContext's native shape keeps each message rendered in the session's context cache
//! (`engine::ContextCache`) as its encoded body. A reply carries those bytes as they are,
//! shared with the cache, instead of building the message's protobuf tree again for
//! prost to walk. Anything decoded (a request, a client reading a reply) fills the
//! fields, as with the generated type. Generic over the two field types so that this file
//! does not depend on the generated module that depends on it.

use std::sync::Arc;

use prost::bytes::{Buf, BufMut};
use prost::encoding::{DecodeContext, WireType, message, skip_field};

/// A `compactd.v1.Message` (`info`: `I`, `parts`: `P`): info and parts, or a body already
/// encoded.
#[derive(Clone)]
pub struct Message<I, P> {
    /// The message's info.
    pub info: Option<I>,
    /// Its parts, in order.
    pub parts: Vec<P>,
    /// The encoded body, written in place of the fields when set.
    encoded: Option<Arc<[u8]>>,
}

/// What the fields must be: generated protobuf messages.
pub trait Field: prost::Message + Default + PartialEq {}

impl<T: prost::Message + Default + PartialEq> Field for T {}

impl<I, P> Default for Message<I, P> {
    fn default() -> Self {
        Message {
            info: None,
            parts: Vec::new(),
            encoded: None,
        }
    }
}

impl<I: Field, P: Field> Message<I, P> {
    /// A message of these fields.
    pub fn new(info: Option<I>, parts: Vec<P>) -> Self {
        Message {
            info,
            parts,
            encoded: None,
        }
    }

    /// A message whose body is already encoded (its fields 1 and 2, as
    /// `prost::Message::encode_raw` writes them). Encodes as exactly these bytes.
    pub fn from_encoded(body: Arc<[u8]>) -> Self {
        Message {
            info: None,
            parts: Vec::new(),
            encoded: Some(body),
        }
    }
}

impl<I: Field, P: Field> PartialEq for Message<I, P> {
    /// The same fields; a message carrying its encoded body equals any message that
    /// encodes to the same bytes.
    fn eq(&self, other: &Self) -> bool {
        use prost::Message as _;
        if self.encoded.is_none() && other.encoded.is_none() {
            self.info == other.info && self.parts == other.parts
        } else {
            self.encode_to_vec() == other.encode_to_vec()
        }
    }
}

impl<I: std::fmt::Debug, P: std::fmt::Debug> std::fmt::Debug for Message<I, P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("Message");
        match &self.encoded {
            Some(body) => d.field("encoded_bytes", &body.len()),
            None => d.field("info", &self.info).field("parts", &self.parts),
        };
        d.finish()
    }
}

impl<I: Field, P: Field> prost::Message for Message<I, P> {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        match &self.encoded {
            Some(body) => buf.put_slice(body),
            None => {
                if let Some(info) = &self.info {
                    message::encode(1, info, buf);
                }
                message::encode_repeated(2, &self.parts, buf);
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
        match tag {
            1 => message::merge(
                wire_type,
                self.info.get_or_insert_with(Default::default),
                buf,
                ctx,
            )
            .map_err(|mut e| {
                e.push("Message", "info");
                e
            }),
            2 => message::merge_repeated(wire_type, &mut self.parts, buf, ctx).map_err(|mut e| {
                e.push("Message", "parts");
                e
            }),
            _ => skip_field(wire_type, tag, buf, ctx),
        }
    }

    fn encoded_len(&self) -> usize {
        match &self.encoded {
            Some(body) => body.len(),
            None => {
                self.info
                    .as_ref()
                    .map_or(0, |info| message::encoded_len(1, info))
                    + message::encoded_len_repeated(2, &self.parts)
            }
        }
    }

    fn clear(&mut self) {
        self.info = None;
        self.parts.clear();
        self.encoded = None;
    }
}

#[cfg(test)]
mod tests {
    use prost::Message as _;

    use crate::server::pb::{self, Message};

    fn sample() -> Message {
        Message::new(
            Some(pb::MessageInfo {
                id: "m1".into(),
                role: "user".into(),
                ..Default::default()
            }),
            vec![pb::Part {
                id: "p1".into(),
                message_id: "m1".into(),
                kind: Some(pb::part::Kind::Text(pb::TextPart {
                    text: "hello".into(),
                    ..Default::default()
                })),
                ..Default::default()
            }],
        )
    }

    /// A message carrying its body encodes as the message it was encoded from, inside a
    /// context too, and decodes back into fields.
    #[test]
    fn an_encoded_body_encodes_as_its_fields_and_decodes_into_them() {
        let m = sample();
        let mut body = Vec::new();
        m.encode_raw(&mut body);
        let carried = Message::from_encoded(body.into());
        assert_eq!(carried.encode_to_vec(), m.encode_to_vec());
        assert_eq!(carried.encoded_len(), m.encoded_len());
        assert_eq!(carried, m);
        let context = |messages| pb::Context {
            messages,
            estimated_tokens: 7,
            ..Default::default()
        };
        let bytes = context(vec![carried.clone(), carried]).encode_to_vec();
        assert_eq!(bytes, context(vec![m.clone(), m.clone()]).encode_to_vec());
        let back = pb::Context::decode(bytes.as_slice()).expect("decodes");
        assert_eq!(back.messages, [m.clone(), m.clone()]);
        assert_eq!(back.messages[0].parts[0].id, "p1");
        assert_ne!(Message::default(), m);
    }
}
