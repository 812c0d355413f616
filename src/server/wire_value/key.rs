//! Map keys: strings, and integers or bools written as strings.

use serde::Serialize;
use serde::ser::{self, Impossible};

use super::Error;
use super::sink::Sink;

/// A map key: a string, or an integer or bool written as one (as serde_json, which
/// refuses other keys too; it also writes finite floats, refused here).
pub(super) struct KeySer<'s, S>(pub(super) &'s mut S);

impl<S: Sink> KeySer<'_, S> {
    fn key(self, s: &str) -> Result<(), Error> {
        self.0.string(s.as_bytes());
        Ok(())
    }
}

fn not_a_string() -> Error {
    Error("a map key is not a string".to_string())
}

/// Keys serde_json writes as their decimal or `true`/`false` text.
macro_rules! as_string {
    ($($method:ident: $t:ty),*) => {$(
        fn $method(self, v: $t) -> Result<(), Error> {
            self.key(&v.to_string())
        }
    )*};
}

impl<S: Sink> ser::Serializer for KeySer<'_, S> {
    type Ok = ();
    type Error = Error;
    type SerializeSeq = Impossible<(), Error>;
    type SerializeTuple = Impossible<(), Error>;
    type SerializeTupleStruct = Impossible<(), Error>;
    type SerializeTupleVariant = Impossible<(), Error>;
    type SerializeMap = Impossible<(), Error>;
    type SerializeStruct = Impossible<(), Error>;
    type SerializeStructVariant = Impossible<(), Error>;

    as_string!(
        serialize_bool: bool,
        serialize_i8: i8,
        serialize_i16: i16,
        serialize_i32: i32,
        serialize_i64: i64,
        serialize_u8: u8,
        serialize_u16: u16,
        serialize_u32: u32,
        serialize_u64: u64
    );

    fn serialize_f32(self, _: f32) -> Result<(), Error> {
        Err(not_a_string())
    }
    fn serialize_f64(self, _: f64) -> Result<(), Error> {
        Err(not_a_string())
    }
    fn serialize_bytes(self, _: &[u8]) -> Result<(), Error> {
        Err(not_a_string())
    }
    fn serialize_str(self, v: &str) -> Result<(), Error> {
        self.key(v)
    }
    fn serialize_char(self, v: char) -> Result<(), Error> {
        self.key(v.encode_utf8(&mut [0; 4]))
    }
    fn serialize_unit_variant(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
    ) -> Result<(), Error> {
        self.key(variant)
    }
    fn serialize_newtype_struct<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        value: &T,
    ) -> Result<(), Error> {
        value.serialize(self)
    }
    fn serialize_none(self) -> Result<(), Error> {
        Err(not_a_string())
    }
    fn serialize_some<T: Serialize + ?Sized>(self, _: &T) -> Result<(), Error> {
        Err(not_a_string())
    }
    fn serialize_unit(self) -> Result<(), Error> {
        Err(not_a_string())
    }
    fn serialize_unit_struct(self, _: &'static str) -> Result<(), Error> {
        Err(not_a_string())
    }
    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: &T,
    ) -> Result<(), Error> {
        Err(not_a_string())
    }
    fn serialize_seq(self, _: Option<usize>) -> Result<Self::SerializeSeq, Error> {
        Err(not_a_string())
    }
    fn serialize_tuple(self, _: usize) -> Result<Self::SerializeTuple, Error> {
        Err(not_a_string())
    }
    fn serialize_tuple_struct(
        self,
        _: &'static str,
        _: usize,
    ) -> Result<Self::SerializeTupleStruct, Error> {
        Err(not_a_string())
    }
    fn serialize_tuple_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: usize,
    ) -> Result<Self::SerializeTupleVariant, Error> {
        Err(not_a_string())
    }
    fn serialize_map(self, _: Option<usize>) -> Result<Self::SerializeMap, Error> {
        Err(not_a_string())
    }
    fn serialize_struct(self, _: &'static str, _: usize) -> Result<Self::SerializeStruct, Error> {
        Err(not_a_string())
    }
    fn serialize_struct_variant(
        self,
        _: &'static str,
        _: u32,
        _: &'static str,
        _: usize,
    ) -> Result<Self::SerializeStructVariant, Error> {
        Err(not_a_string())
    }
}
