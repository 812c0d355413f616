//! Any `Serialize` value written straight to `google.protobuf.Value` wire bytes, as
//! `serde_json::to_value` and then prost would encode it, without building either tree.
//!
//! GetContext's protobuf OpenAI shape is a `ListValue` of nearly a megabyte on a large
//! session; going through JSON values and then prost values allocated every string twice
//! and a node per field, and prost sized each nested message again at every level.
//! Protobuf prefixes every nested message with its length, so the value is walked twice
//! by the same serializer: once summing lengths (each nested message's length recorded in
//! the order it opens), then writing into a buffer of exactly the total size.
//!
//! The mapping is serde_json's: `None` and unit are null, every number a double, maps and
//! structs are `Struct`s (keys strings, integers or bools), sequences and tuples `ListValue`s, enum
//! variants externally tagged as serde_json writes them (`{"Variant": …}`).

use serde::Serialize;
use serde::ser::{self, Impossible};

use super::list_value::ListValue;

/// Why a value cannot be written: a map key that is not a string, or an error the value's
/// own `Serialize` raised.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Error(String);

impl ser::Error for Error {
    fn custom<T: std::fmt::Display>(msg: T) -> Self {
        Error(msg.to_string())
    }
}

/// `items` as a `google.protobuf.ListValue` in wire form. Every item serializes (the
/// OpenAI messages hold strings, options and lists of them); one that does not leaves an
/// empty list, as `serde_json::to_value` failing does in the other shapes.
pub fn list_value<T: Serialize>(items: &[T]) -> ListValue {
    match list_body(items) {
        Ok(body) => ListValue::from_encoded(body),
        Err(e) => {
            tracing::warn!(error = %e, "a list could not be written as protobuf values");
            ListValue::default()
        }
    }
}

/// The body of a `google.protobuf.ListValue` holding `items` (its repeated `values`
/// field, without an outer length), in exactly as many bytes as it needs.
pub fn list_body<T: Serialize>(items: &[T]) -> Result<Vec<u8>, Error> {
    let mut sizer = Sizer::default();
    elements(&mut sizer, items)?;
    let mut writer = Writer {
        out: Vec::with_capacity(sizer.total),
        lens: sizer.lens.into_iter(),
    };
    elements(&mut writer, items)?;
    Ok(writer.out)
}

fn elements<S: Sink, T: Serialize>(sink: &mut S, items: &[T]) -> Result<(), Error> {
    for item in items {
        element(sink, item)?;
    }
    Ok(())
}

/// One `values` entry of a `ListValue` (field 1): a nested `Value`.
fn element<S: Sink, T: Serialize + ?Sized>(sink: &mut S, item: &T) -> Result<(), Error> {
    sink.put(&[key(1, LEN)]);
    let frame = sink.open();
    item.serialize(ValueSer(&mut *sink))?;
    sink.close(frame);
    Ok(())
}

// ---- wire format ----

/// Wire types used here.
const VARINT: u8 = 0;
const I64: u8 = 1;
const LEN: u8 = 2;

/// A field's key byte (every field number here is below 16).
const fn key(field: u8, wire: u8) -> u8 {
    (field << 3) | wire
}

/// `Value` fields.
const NULL: u8 = key(1, VARINT);
const NUMBER: u8 = key(2, I64);
const STRING: u8 = key(3, LEN);
const BOOL: u8 = key(4, VARINT);
const STRUCT: u8 = key(5, LEN);
const LIST: u8 = key(6, LEN);
/// `Struct.fields` entries, `ListValue.values` and a map entry's key: field 1.
const ENTRY: u8 = key(1, LEN);
/// A map entry's value: field 2.
const ENTRY_VALUE: u8 = key(2, LEN);

fn varint_len(mut v: u64) -> usize {
    let mut n = 1;
    while v >= 0x80 {
        v >>= 7;
        n += 1;
    }
    n
}

// ---- the two passes ----

/// Where the serializer puts bytes: the sizing pass counts them, the writing pass writes.
trait Sink {
    /// A nested message's token between `open` and `close`.
    type Frame;
    /// Appends raw bytes.
    fn put(&mut self, bytes: &[u8]);
    /// Appends a varint.
    fn varint(&mut self, v: u64);
    /// Starts a nested message (its length prefix comes first on the wire).
    fn open(&mut self) -> Self::Frame;
    /// Ends the message `open` started.
    fn close(&mut self, frame: Self::Frame);

    /// A length-delimited string.
    fn string(&mut self, s: &[u8]) {
        self.varint(s.len() as u64);
        self.put(s);
    }
}

/// First pass: the total size, and each nested message's length in opening order.
#[derive(Default)]
struct Sizer {
    total: usize,
    lens: Vec<usize>,
}

impl Sink for Sizer {
    /// Where the message's length goes in `lens`, and the total when it opened.
    type Frame = (usize, usize);

    fn put(&mut self, bytes: &[u8]) {
        self.total += bytes.len();
    }

    fn varint(&mut self, v: u64) {
        self.total += varint_len(v);
    }

    fn open(&mut self) -> (usize, usize) {
        self.lens.push(0);
        (self.lens.len() - 1, self.total)
    }

    fn close(&mut self, (slot, start): (usize, usize)) {
        let len = self.total - start;
        self.lens[slot] = len;
        // The prefix belongs to the enclosing message.
        self.total += varint_len(len as u64);
    }
}

/// Second pass: the bytes, each nested message prefixed with the length the first pass
/// found (the same value walked the same way opens its messages in the same order).
struct Writer {
    out: Vec<u8>,
    lens: std::vec::IntoIter<usize>,
}

impl Sink for Writer {
    type Frame = ();

    fn put(&mut self, bytes: &[u8]) {
        self.out.extend_from_slice(bytes);
    }

    fn varint(&mut self, mut v: u64) {
        while v >= 0x80 {
            self.out.push((v as u8) | 0x80);
            v >>= 7;
        }
        self.out.push(v as u8);
    }

    fn open(&mut self) {
        // A value whose `Serialize` walked differently the second time gets length 0
        // here rather than a panic; `list_body`'s tests pin the normal case.
        let len = self.lens.next().unwrap_or(0);
        self.varint(len as u64);
    }

    fn close(&mut self, (): ()) {}
}

// ---- the serializer ----

/// Serializes one value as the fields of a `google.protobuf.Value`.
struct ValueSer<'s, S>(&'s mut S);

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
struct Tagged<F> {
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
struct Compound<'s, S: Sink> {
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
    fn serialize_i8(self, v: i8) -> Result<(), Error> {
        self.number(f64::from(v))
    }
    fn serialize_i16(self, v: i16) -> Result<(), Error> {
        self.number(f64::from(v))
    }
    fn serialize_i32(self, v: i32) -> Result<(), Error> {
        self.number(f64::from(v))
    }
    fn serialize_i64(self, v: i64) -> Result<(), Error> {
        // Protobuf's Value holds every number as a double, as serde_json's `as_f64`.
        self.number(v as f64)
    }
    fn serialize_u8(self, v: u8) -> Result<(), Error> {
        self.number(f64::from(v))
    }
    fn serialize_u16(self, v: u16) -> Result<(), Error> {
        self.number(f64::from(v))
    }
    fn serialize_u32(self, v: u32) -> Result<(), Error> {
        self.number(f64::from(v))
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
        let sink = self.0;
        let tagged = ValueSer(&mut *sink).open_variant(variant);
        let mut list = ValueSer(sink).open_list();
        list.tagged = Some(tagged);
        Ok(list)
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
        let sink = self.0;
        let tagged = ValueSer(&mut *sink).open_variant(variant);
        let mut object = ValueSer(sink).open_struct();
        object.tagged = Some(tagged);
        Ok(object)
    }
}

impl<S: Sink> ser::SerializeSeq for Compound<'_, S> {
    type Ok = ();
    type Error = Error;
    fn serialize_element<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Error> {
        element(self.sink, value)
    }
    fn end(self) -> Result<(), Error> {
        Compound::end(self)
    }
}

impl<S: Sink> ser::SerializeTuple for Compound<'_, S> {
    type Ok = ();
    type Error = Error;
    fn serialize_element<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Error> {
        element(self.sink, value)
    }
    fn end(self) -> Result<(), Error> {
        Compound::end(self)
    }
}

impl<S: Sink> ser::SerializeTupleStruct for Compound<'_, S> {
    type Ok = ();
    type Error = Error;
    fn serialize_field<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Error> {
        element(self.sink, value)
    }
    fn end(self) -> Result<(), Error> {
        Compound::end(self)
    }
}

impl<S: Sink> ser::SerializeTupleVariant for Compound<'_, S> {
    type Ok = ();
    type Error = Error;
    fn serialize_field<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Error> {
        element(self.sink, value)
    }
    fn end(self) -> Result<(), Error> {
        Compound::end(self)
    }
}

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

impl<S: Sink> ser::SerializeStruct for Compound<'_, S> {
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

impl<S: Sink> ser::SerializeStructVariant for Compound<'_, S> {
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

/// A map key: a string, or an integer or bool written as one (as serde_json, which
/// refuses other keys too; it also writes finite floats, refused here).
struct KeySer<'s, S>(&'s mut S);

impl<S: Sink> KeySer<'_, S> {
    fn key(self, s: &str) -> Result<(), Error> {
        self.0.string(s.as_bytes());
        Ok(())
    }
}

fn not_a_string() -> Error {
    Error("a map key is not a string".to_string())
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
    fn serialize_bool(self, v: bool) -> Result<(), Error> {
        self.key(&v.to_string())
    }
    fn serialize_i8(self, v: i8) -> Result<(), Error> {
        self.key(&v.to_string())
    }
    fn serialize_i16(self, v: i16) -> Result<(), Error> {
        self.key(&v.to_string())
    }
    fn serialize_i32(self, v: i32) -> Result<(), Error> {
        self.key(&v.to_string())
    }
    fn serialize_i64(self, v: i64) -> Result<(), Error> {
        self.key(&v.to_string())
    }
    fn serialize_u8(self, v: u8) -> Result<(), Error> {
        self.key(&v.to_string())
    }
    fn serialize_u16(self, v: u16) -> Result<(), Error> {
        self.key(&v.to_string())
    }
    fn serialize_u32(self, v: u32) -> Result<(), Error> {
        self.key(&v.to_string())
    }
    fn serialize_u64(self, v: u64) -> Result<(), Error> {
        self.key(&v.to_string())
    }
    fn serialize_f32(self, _: f32) -> Result<(), Error> {
        Err(not_a_string())
    }
    fn serialize_f64(self, _: f64) -> Result<(), Error> {
        Err(not_a_string())
    }
    fn serialize_bytes(self, _: &[u8]) -> Result<(), Error> {
        Err(not_a_string())
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

#[cfg(test)]
#[path = "wire_value_tests.rs"]
mod tests;
