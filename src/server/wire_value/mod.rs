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
//! structs are `Struct`s (keys strings, integers or bools), sequences and tuples
//! `ListValue`s, enum variants externally tagged as serde_json writes them
//! (`{"Variant": …}`). `sink.rs` holds the two passes, `value.rs` the serializer and
//! `key.rs` the map keys'.

use serde::Serialize;
use serde::ser;

use sink::{Sink, Sizer, Writer};
use value::ValueSer;

mod key;
mod sink;
mod value;

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
/// empty list, as `serde_json::to_value` failing does in the other shapes. (The server
/// writes a context's list message by message, with [`list_body`]; tests make whole ones.)
#[cfg(test)]
pub fn list_value<T: Serialize>(items: &[T]) -> super::list_value::ListValue {
    use super::list_value::ListValue;
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
    if sizer.too_large {
        return Err(Error("a nested message would exceed 4 GiB".to_string()));
    }
    let total = sizer.total;
    let mut writer = Writer {
        out: Vec::with_capacity(total),
        lens: sizer.lens.into_iter(),
    };
    elements(&mut writer, items)?;
    // A value whose `Serialize` walked differently the second time would leave lengths
    // that do not match the bytes: refused rather than sent corrupt.
    if writer.out.len() != total || writer.lens.next().is_some() {
        return Err(Error(
            "the value serialized differently on its second walk".to_string(),
        ));
    }
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
    sink.put(&[ENTRY]);
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

#[cfg(test)]
mod tests;
