//! The serializer: one value as the fields of a `google.protobuf.Value`, its sequences,
//! maps, structs and enum variants as serde_json shapes them.

use serde::Serialize;
use serde::ser;

use super::key::KeySer;
use super::sink::Sink;
use super::{BOOL, ENTRY, ENTRY_VALUE, Error, LIST, NULL, NUMBER, STRING, STRUCT, element};

/// Serializes one value as the fields of a `google.protobuf.Value`.
pub(super) struct ValueSer<'s, S>(pub(super) &'s mut S);

impl<'s, S: Sink> ValueSer<'s, S> {
    fn null(self) -> Result<(), Error> {
        self.0.put(&[NULL, 0]);
        Ok(())
    }

    fn number(self, n: f64) -> Result<(), Error> {
        self.0.put(&[NUMBER]);
        self.0.put(&n.to_le_bytes());
        Ok(())
    }

    fn string(self, s: &str) -> Result<(), Error> {
        self.0.put(&[STRING]);
        self.0.string(s.as_bytes());
        Ok(())
    }

    /// Opens a `Struct` value.
    fn open_struct(self) -> Compound<'s, S> {
        self.0.put(&[STRUCT]);
        let outer = self.0.open();
        Compound {
            sink: self.0,
            outer,
            tagged: None,
            open_entry: None,
        }
    }

    /// Opens `{"variant": <…>}`: a `Struct` of one entry whose value is being written.
    fn open_variant(self, variant: &str) -> Tagged<S::Frame> {
        self.0.put(&[STRUCT]);
        let object = self.0.open();
        self.0.put(&[ENTRY]);
        let entry = self.0.open();
        self.0.put(&[ENTRY]);
        self.0.string(variant.as_bytes());
        self.0.put(&[ENTRY_VALUE]);
        let value = self.0.open();
        Tagged {
            object,
            entry,
            value,
        }
    }

    /// Opens `{"variant": <compound>}`: the compound `open` starts closes the variant's
    /// frames after its own.
    fn open_tagged(
        self,
        variant: &str,
        open: fn(ValueSer<'s, S>) -> Compound<'s, S>,
    ) -> Compound<'s, S> {
        let sink = self.0;
        let tagged = ValueSer(&mut *sink).open_variant(variant);
        let mut compound = open(ValueSer(sink));
        compound.tagged = Some(tagged);
        compound
    }

    /// Opens a `ListValue` value.
    fn open_list(self) -> Compound<'s, S> {
        self.0.put(&[LIST]);
        let outer = self.0.open();
        Compound {
            sink: self.0,
            outer,
            tagged: None,
            open_entry: None,
        }
    }
}

/// The frames of an externally tagged variant, closed innermost first.
pub(super) struct Tagged<F> {
    object: F,
    entry: F,
    value: F,
}

impl<F> Tagged<F> {
    fn close<S: Sink<Frame = F>>(self, sink: &mut S) {
        sink.close(self.value);
        sink.close(self.entry);
        sink.close(self.object);
    }
}

/// A sequence, map or struct being written: its elements or entries go into `outer`,
/// and a tagged variant's frames close after it.
pub(super) struct Compound<'s, S: Sink> {
    sink: &'s mut S,
    outer: S::Frame,
    tagged: Option<Tagged<S::Frame>>,
    /// A map entry whose key is written and whose value is not yet.
    open_entry: Option<S::Frame>,
}

impl<S: Sink> Compound<'_, S> {
    fn end(self) -> Result<(), Error> {
        self.sink.close(self.outer);
        if let Some(tagged) = self.tagged {
            tagged.close(self.sink);
        }
        Ok(())
    }

    /// A `Struct` entry: key, then the value.
    fn entry<T: Serialize + ?Sized>(&mut self, k: &str, v: &T) -> Result<(), Error> {
        self.sink.put(&[ENTRY]);
        let entry = self.sink.open();
        self.sink.put(&[ENTRY]);
        self.sink.string(k.as_bytes());
        self.value_field(v)?;
        self.sink.close(entry);
        Ok(())
    }

    /// A map entry's value (field 2), a nested `Value`.
    fn value_field<T: Serialize + ?Sized>(&mut self, v: &T) -> Result<(), Error> {
        self.sink.put(&[ENTRY_VALUE]);
        let value = self.sink.open();
        v.serialize(ValueSer(&mut *self.sink))?;
        self.sink.close(value);
        Ok(())
    }
}

/// Integers a double holds exactly.
macro_rules! exact_number {
    ($($method:ident: $t:ty),*) => {$(
        fn $method(self, v: $t) -> Result<(), Error> {
            self.number(f64::from(v))
        }
    )*};
}

impl<'s, S: Sink> ser::Serializer for ValueSer<'s, S> {
    type Ok = ();
    type Error = Error;
    type SerializeSeq = Compound<'s, S>;
    type SerializeTuple = Compound<'s, S>;
    type SerializeTupleStruct = Compound<'s, S>;
    type SerializeTupleVariant = Compound<'s, S>;
    type SerializeMap = Compound<'s, S>;
    type SerializeStruct = Compound<'s, S>;
    type SerializeStructVariant = Compound<'s, S>;

    fn serialize_bool(self, v: bool) -> Result<(), Error> {
        self.0.put(&[BOOL, u8::from(v)]);
        Ok(())
    }
    exact_number!(
        serialize_i8: i8,
        serialize_i16: i16,
        serialize_i32: i32,
        serialize_u8: u8,
        serialize_u16: u16,
        serialize_u32: u32
    );
    fn serialize_i64(self, v: i64) -> Result<(), Error> {
        // Protobuf's Value holds every number as a double, as serde_json's `as_f64`.
        self.number(v as f64)
    }
    fn serialize_u64(self, v: u64) -> Result<(), Error> {
        self.number(v as f64)
    }
    fn serialize_f32(self, v: f32) -> Result<(), Error> {
        ser::Serializer::serialize_f64(self, f64::from(v))
    }
    fn serialize_f64(self, v: f64) -> Result<(), Error> {
        // serde_json writes non-finite numbers as null.
        if v.is_finite() {
            self.number(v)
        } else {
            self.null()
        }
    }
    fn serialize_char(self, v: char) -> Result<(), Error> {
        self.string(v.encode_utf8(&mut [0; 4]))
    }
    fn serialize_str(self, v: &str) -> Result<(), Error> {
        self.string(v)
    }
    fn serialize_bytes(self, v: &[u8]) -> Result<(), Error> {
        // serde_json writes bytes as an array of numbers.
        let mut list = self.open_list();
        for b in v {
            ser::SerializeSeq::serialize_element(&mut list, b)?;
        }
        list.end()
    }
    fn serialize_none(self) -> Result<(), Error> {
        self.null()
    }
    fn serialize_some<T: Serialize + ?Sized>(self, value: &T) -> Result<(), Error> {
        value.serialize(self)
    }
    fn serialize_unit(self) -> Result<(), Error> {
        self.null()
    }
    fn serialize_unit_struct(self, _: &'static str) -> Result<(), Error> {
        self.null()
    }
    fn serialize_unit_variant(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
    ) -> Result<(), Error> {
        self.string(variant)
    }
    fn serialize_newtype_struct<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        value: &T,
    ) -> Result<(), Error> {
        value.serialize(self)
    }
    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        value: &T,
    ) -> Result<(), Error> {
        let sink = self.0;
        let tagged = ValueSer(&mut *sink).open_variant(variant);
        value.serialize(ValueSer(&mut *sink))?;
        tagged.close(sink);
        Ok(())
    }
    fn serialize_seq(self, _: Option<usize>) -> Result<Compound<'s, S>, Error> {
        Ok(self.open_list())
    }
    fn serialize_tuple(self, _: usize) -> Result<Compound<'s, S>, Error> {
        Ok(self.open_list())
    }
    fn serialize_tuple_struct(self, _: &'static str, _: usize) -> Result<Compound<'s, S>, Error> {
        Ok(self.open_list())
    }
    fn serialize_tuple_variant(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        _: usize,
    ) -> Result<Compound<'s, S>, Error> {
        Ok(self.open_tagged(variant, ValueSer::open_list))
    }
    fn serialize_map(self, _: Option<usize>) -> Result<Compound<'s, S>, Error> {
        Ok(self.open_struct())
    }
    fn serialize_struct(self, _: &'static str, _: usize) -> Result<Compound<'s, S>, Error> {
        Ok(self.open_struct())
    }
    fn serialize_struct_variant(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        _: usize,
    ) -> Result<Compound<'s, S>, Error> {
        Ok(self.open_tagged(variant, ValueSer::open_struct))
    }
}

/// The list-shaped serde traits: each element is a `values` entry of the list.
macro_rules! list_like {
    ($($trait:ident :: $method:ident),*) => {$(
        impl<S: Sink> ser::$trait for Compound<'_, S> {
            type Ok = ();
            type Error = Error;
            fn $method<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Error> {
                element(self.sink, value)
            }
            fn end(self) -> Result<(), Error> {
                Compound::end(self)
            }
        }
    )*};
}

list_like!(
    SerializeSeq::serialize_element,
    SerializeTuple::serialize_element,
    SerializeTupleStruct::serialize_field,
    SerializeTupleVariant::serialize_field
);

impl<S: Sink> ser::SerializeMap for Compound<'_, S> {
    type Ok = ();
    type Error = Error;
    fn serialize_key<T: Serialize + ?Sized>(&mut self, key: &T) -> Result<(), Error> {
        // The entry opens with its key and stays open until its value is written.
        self.sink.put(&[ENTRY]);
        let entry = self.sink.open();
        self.sink.put(&[ENTRY]);
        key.serialize(KeySer(&mut *self.sink))?;
        self.open_entry = Some(entry);
        Ok(())
    }
    fn serialize_value<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Error> {
        self.value_field(value)?;
        if let Some(entry) = self.open_entry.take() {
            self.sink.close(entry);
        }
        Ok(())
    }
    fn serialize_entry<K: Serialize + ?Sized, V: Serialize + ?Sized>(
        &mut self,
        key: &K,
        value: &V,
    ) -> Result<(), Error> {
        ser::SerializeMap::serialize_key(self, key)?;
        ser::SerializeMap::serialize_value(self, value)
    }
    fn end(self) -> Result<(), Error> {
        Compound::end(self)
    }
}

/// The struct-shaped serde traits: each field is an entry of the `Struct`.
macro_rules! struct_like {
    ($($trait:ident),*) => {$(
        impl<S: Sink> ser::$trait for Compound<'_, S> {
            type Ok = ();
            type Error = Error;
            fn serialize_field<T: Serialize + ?Sized>(
                &mut self,
                key: &'static str,
                value: &T,
            ) -> Result<(), Error> {
                self.entry(key, value)
            }
            fn end(self) -> Result<(), Error> {
                Compound::end(self)
            }
        }
    )*};
}

struct_like!(SerializeStruct, SerializeStructVariant);
