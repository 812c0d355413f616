//! The codec of every RPC: prost's, behind a guard that refuses amplifying requests
//! before they are decoded, and with each reply's length reserved before it is encoded
//! ([`SizedEncoder`]).
//!
//! Protobuf decodes small wire bytes into large values: an empty repeated message entry
//! is 2 bytes on the wire and a whole struct in memory, so a 16 MiB request of them
//! decodes to about a gigabyte. The guard walks the wire bytes once against the schema
//! (the compiled-in descriptor set, no allocation per field) and estimates the decoded
//! size: every message instance at its struct size, every string or bytes field at its
//! length plus a header, every repeated scalar at its element size. A request too short
//! to pass the limit however it decodes (at most 141 bytes per wire byte) is not walked at
//! all, which is every ordinary update at the default limit. A request estimated
//! over [`decoded_limit`] is refused with `RESOURCE_EXHAUSTED` naming `max_update_bytes`,
//! and at most [`MAX_LARGE_DECODES`] requests over [`LARGE`] bytes decode at once: as
//! many more wait for a slot (at most [`LARGE_DECODE_WAIT`], off the runtime's worker;
//! decodes never wait on anything else, so a slot always frees), and only past that
//! wait, or past those waiting, is one refused (a refusal in the codec ends a `Stream`,
//! for a load other clients cause).
//!
//! Only requests are guarded (`ProtoName::GUARDED`, set by `build.rs` for every RPC's
//! input type); responses decoded by clients built from the same stubs are not.

use std::marker::PhantomData;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, OnceLock};

use prost::Message;
use prost_types::field_descriptor_proto::{Label, Type};
use tonic::Status;
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic_prost::ProstDecoder;

use super::pb;
use crate::domain::FastMap;

/// The protobuf name of a generated message (implemented by `build.rs`'s output).
pub trait ProtoName {
    /// Full name, e.g. `compactd.v1.ClientUpdate`.
    const NAME: &'static str;
    /// Whether an RPC receives it (only those are guarded).
    const GUARDED: bool;
}

/// A request's decoded size may be this multiple of `max_update_bytes`...
pub const DECODED_FACTOR: usize = 2;
/// ... plus this: every string costs a header in memory, so under a small
/// `max_update_bytes` an ordinary update (one text part of a few KB) would otherwise read
/// as amplifying, and be refused in a way that ends its stream.
pub const DECODED_ALLOWANCE: usize = 1 << 20;
/// Requests at least this large on the wire count as large decodes.
pub const LARGE: usize = 1 << 20;
/// Large requests decoding at once; more wait until one finishes.
pub const MAX_LARGE_DECODES: usize = 4;
/// How long a large request waits for a decode slot before it is refused. A 16 MiB
/// decode takes tens of milliseconds, so only a machine far behind waits this long.
pub const LARGE_DECODE_WAIT: std::time::Duration = std::time::Duration::from_secs(2);
/// Nesting the walk follows: past prost's own recursion limit (100), which refuses the
/// request anyway.
const MAX_DEPTH: usize = 100;

/// Estimated decoded bytes allowed per request: `DECODED_FACTOR` × `max_update_bytes` +
/// `DECODED_ALLOWANCE` of
/// the servers in this process (the largest, when tests run several).
static DECODED_LIMIT: AtomicUsize =
    AtomicUsize::new(super::request::DEFAULT_MAX_UPDATE_BYTES * DECODED_FACTOR + DECODED_ALLOWANCE);
/// Large requests decoding now, and those waiting for a slot; where one waits.
static LARGE_DECODES: Mutex<Slots> = Mutex::new(Slots {
    running: 0,
    waiting: 0,
});
static SLOT_FREED: Condvar = Condvar::new();

/// Sets the decoded-size limit from `max_update_bytes` (called when a server starts;
/// a process serving twice keeps the larger).
pub fn set_max_update_bytes(max_update_bytes: usize) {
    static CONFIGURED: std::sync::Once = std::sync::Once::new();
    let limit = max_update_bytes
        .saturating_mul(DECODED_FACTOR)
        .saturating_add(DECODED_ALLOWANCE);
    let mut first = false;
    CONFIGURED.call_once(|| {
        DECODED_LIMIT.store(limit, Ordering::Relaxed);
        first = true;
    });
    if !first {
        DECODED_LIMIT.fetch_max(limit, Ordering::Relaxed);
    }
}

/// The decoded-size limit in force.
pub fn decoded_limit() -> usize {
    DECODED_LIMIT.load(Ordering::Relaxed)
}

/// prost's codec with the guard in front of its decoder and replies written into a buffer
/// of their length.
#[derive(Debug)]
pub struct GuardedCodec<T, U>(PhantomData<(T, U)>);

impl<T, U> Default for GuardedCodec<T, U> {
    fn default() -> Self {
        GuardedCodec(PhantomData)
    }
}

impl<T, U> Codec for GuardedCodec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + ProtoName + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = SizedEncoder<T>;
    type Decoder = GuardedDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        SizedEncoder(PhantomData)
    }

    fn decoder(&mut self) -> Self::Decoder {
        GuardedDecoder(ProstDecoder::new(BufferSettings::default()))
    }
}

/// prost's encoder, with the reply's whole length reserved before it is written.
///
/// tonic's buffer starts at 8 KiB and prost writes into it field by field, so a large
/// reply of many fields (a context's messages) grew it by doubling: about seven
/// reallocations and copies of a 1 MB reply, each into fresh pages. A reply of one large
/// field (the echo's payload) reserved once. Reserving the exact length up front makes
/// every reply one allocation, written once.
#[derive(Debug)]
pub struct SizedEncoder<T>(PhantomData<T>);

impl<T: Message> Encoder for SizedEncoder<T> {
    type Item = T;
    type Error = Status;

    fn encode(&mut self, item: T, buf: &mut EncodeBuf<'_>) -> Result<(), Status> {
        // `encode` would measure the message again to check the room it now has.
        buf.reserve(item.encoded_len());
        item.encode_raw(buf);
        Ok(())
    }

    fn buffer_settings(&self) -> BufferSettings {
        BufferSettings::default()
    }
}

/// prost's decoder, after [`check`].
#[derive(Debug)]
pub struct GuardedDecoder<U>(ProstDecoder<U>);

impl<U: Message + Default + ProtoName> Decoder for GuardedDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        use prost::bytes::Buf as _;
        if !U::GUARDED {
            return self.0.decode(buf);
        }
        let wire = buf.chunk();
        // The buffer is one contiguous allocation; were it ever split, prost's own
        // limits still apply and only the estimate is skipped.
        if wire.len() == buf.remaining() {
            check(U::NAME, wire, decoded_limit()).map_err(Status::from)?;
        }
        let _large = (buf.remaining() >= LARGE)
            .then(|| LargeDecode::enter(LARGE_DECODE_WAIT))
            .transpose()
            .map_err(Status::from)?;
        self.0.decode(buf)
    }

    fn buffer_settings(&self) -> BufferSettings {
        self.0.buffer_settings()
    }
}

/// Why a request was refused before decoding.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    /// The request would decode to more than the limit.
    #[error(
        "request of {wire} bytes would decode to about {estimate} bytes in memory, over the limit of {limit} bytes ({DECODED_FACTOR} × max_update_bytes + {DECODED_ALLOWANCE}); send large content as text rather than as many small repeated entries"
    )]
    Amplifying {
        /// Wire size.
        wire: usize,
        /// Estimated decoded size (the walk stops once past the limit).
        estimate: usize,
        /// The limit.
        limit: usize,
    },
    /// Too many large requests were decoding for the whole wait.
    #[error(
        "{MAX_LARGE_DECODES} requests over {LARGE} bytes were being decoded for {} ms (max_update_bytes traffic is throttled); retry shortly",
        LARGE_DECODE_WAIT.as_millis()
    )]
    Busy,
}

impl From<Refused> for Status {
    fn from(r: Refused) -> Status {
        crate::telemetry::rejected(tonic::Code::ResourceExhausted);
        tracing::debug!(reason = %r, "request refused before decoding");
        Status::resource_exhausted(r.to_string())
    }
}

/// A large decode in progress, counted until dropped.
#[derive(Debug)]
pub(super) struct LargeDecode;

/// The count's lock (poisoned only by a panic between two integer operations).
fn large_decodes() -> std::sync::MutexGuard<'static, Slots> {
    LARGE_DECODES.lock().unwrap_or_else(|e| e.into_inner())
}

/// The large decodes' slots.
#[derive(Debug)]
struct Slots {
    running: usize,
    /// Waiting for a slot: each holds a thread (`block_in_place` hands its worker's
    /// tasks to another), so at most [`MAX_LARGE_DECODES`] wait; one more is refused.
    waiting: usize,
}

impl LargeDecode {
    /// Takes a decode slot, waiting at most `wait` for one. The wait blocks the calling
    /// thread (decoding is synchronous); the slots' holders are decoding, on other
    /// threads, and free them without waiting on anything. On a multi-thread runtime
    /// the wait is `block_in_place`: the worker's other tasks move to another thread
    /// meanwhile, so waiting decodes cannot stall health checks and small updates.
    pub(super) fn enter(wait: std::time::Duration) -> Result<LargeDecode, Refused> {
        {
            // Taken at once when free (under the lock: no other decode takes it between).
            let mut slots = large_decodes();
            if slots.running < MAX_LARGE_DECODES {
                slots.running += 1;
                return Ok(LargeDecode);
            }
            if slots.waiting >= MAX_LARGE_DECODES {
                return Err(Refused::Busy);
            }
            slots.waiting += 1;
        }
        // Counted as waiting until `wait_for_slot` lowers it, under the lock it takes the
        // slot under (a waiter that panics before lowers it as it unwinds).
        let mut waiter = Waiter { counted: true };
        let multi_thread = tokio::runtime::Handle::try_current()
            .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread);
        if multi_thread {
            tokio::task::block_in_place(|| Self::wait_for_slot(wait, &mut waiter))
        } else {
            Self::wait_for_slot(wait, &mut waiter)
        }
    }

    fn wait_for_slot(
        wait: std::time::Duration,
        waiter: &mut Waiter,
    ) -> Result<LargeDecode, Refused> {
        let deadline = std::time::Instant::now() + wait;
        let mut slots = large_decodes();
        let taken = loop {
            if slots.running < MAX_LARGE_DECODES {
                slots.running += 1;
                break Ok(LargeDecode);
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                break Err(Refused::Busy);
            }
            slots = SLOT_FREED
                .wait_timeout(slots, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        };
        slots.waiting = slots.waiting.saturating_sub(1);
        waiter.counted = false;
        taken
    }
}

/// A place among those waiting for a slot, given back by `wait_for_slot` (or on a panic
/// before it did).
struct Waiter {
    counted: bool,
}

impl Drop for Waiter {
    fn drop(&mut self) {
        if self.counted {
            let mut slots = large_decodes();
            slots.waiting = slots.waiting.saturating_sub(1);
        }
    }
}

impl Drop for LargeDecode {
    fn drop(&mut self) {
        let mut slots = large_decodes();
        slots.running = slots.running.saturating_sub(1);
        drop(slots);
        SLOT_FREED.notify_one();
    }
}

/// Refuses `wire`, a `message` on the wire, when its decoded estimate passes `limit`.
/// Malformed bytes are left to prost, which refuses them with its own error.
pub fn check(message: &str, wire: &[u8], limit: usize) -> Result<(), Refused> {
    // Most updates are far too short to amplify past the limit: no walk for them (it was
    // about 5% of the server's instructions per 4 KB update).
    if most_decoded(wire.len()) <= limit {
        return Ok(());
    }
    let estimate = estimate(schema(), message, wire, limit);
    if estimate > limit {
        return Err(Refused::Amplifying {
            wire: wire.len(),
            estimate,
            limit,
        });
    }
    Ok(())
}

/// What a field decodes to.
#[derive(Debug, Clone, Copy)]
enum Field {
    /// A nested message (index into `Schema::messages`); `repeated` adds a vector slot.
    Message { index: usize, repeated: bool },
    /// A string or bytes field: its length plus a header.
    Text,
    /// A scalar: nothing beyond its struct slot unless repeated (then `size` per element).
    Scalar { size: usize, repeated: bool },
}

/// One message type: its fields by number and what one instance costs.
#[derive(Debug, Default)]
struct MessageSchema {
    fields: FastMap<u32, Field>,
    instance: usize,
}

/// Every message type of the compiled-in descriptor set.
#[derive(Debug, Default)]
struct Schema {
    messages: Vec<MessageSchema>,
    by_name: FastMap<String, usize>,
}

/// Bytes one instance of a message costs beyond its fields' contents. Generous: the
/// largest compactd struct is a few hundred bytes, a map entry or a `Value` far less.
const INSTANCE_BYTES: usize = 256;
/// Heap header of a `String`/`Vec<u8>` (pointer, length, capacity).
const TEXT_HEADER: usize = 24;

fn schema() -> &'static Schema {
    static SCHEMA: OnceLock<Schema> = OnceLock::new();
    SCHEMA.get_or_init(|| {
        // The descriptor set is compiled in by build.rs; it always decodes. Were it ever
        // unreadable, an empty schema only turns the guard off.
        let fds =
            prost_types::FileDescriptorSet::decode(pb::FILE_DESCRIPTOR_SET).unwrap_or_default();
        build_schema(&fds)
    })
}

fn build_schema(fds: &prost_types::FileDescriptorSet) -> Schema {
    let mut schema = Schema::default();
    // Two passes: names first, so fields can refer to any message by index.
    let mut all = Vec::new();
    for file in &fds.file {
        let package = file.package.as_deref().unwrap_or_default();
        for m in &file.message_type {
            collect(package, m, &mut all);
        }
    }
    for (i, (name, _)) in all.iter().enumerate() {
        schema.by_name.insert(name.clone(), i);
    }
    for (_, m) in &all {
        let mut fields = FastMap::default();
        for f in &m.field {
            let (Some(number), Some(ty)) = (f.number, f.r#type) else {
                continue;
            };
            let repeated = f.label == Some(Label::Repeated as i32);
            let ty = Type::try_from(ty).unwrap_or(Type::Bytes);
            let field = match ty {
                Type::Message | Type::Group => {
                    let name = f.type_name.as_deref().unwrap_or_default();
                    match schema.by_name.get(name.trim_start_matches('.')) {
                        Some(&index) => Field::Message { index, repeated },
                        None => Field::Text,
                    }
                }
                Type::String | Type::Bytes => Field::Text,
                Type::Double | Type::Fixed64 | Type::Sfixed64 | Type::Int64 | Type::Uint64 => {
                    Field::Scalar { size: 8, repeated }
                }
                Type::Sint64 => Field::Scalar { size: 8, repeated },
                Type::Bool => Field::Scalar { size: 1, repeated },
                _ => Field::Scalar { size: 4, repeated },
            };
            if let Ok(n) = u32::try_from(number) {
                fields.insert(n, field);
            }
        }
        schema.messages.push(MessageSchema {
            fields,
            instance: INSTANCE_BYTES,
        });
    }
    schema
}

fn collect<'a>(
    scope: &str,
    m: &'a prost_types::DescriptorProto,
    out: &mut Vec<(String, &'a prost_types::DescriptorProto)>,
) {
    let name = format!("{scope}.{}", m.name.as_deref().unwrap_or_default());
    for nested in &m.nested_type {
        collect(&name, nested, out);
    }
    out.push((name, m));
}

/// The largest estimate [`estimate`] can reach for `wire_len` bytes: the root instance and
/// the wire bytes, plus per field at most one instance and a vector slot, and a field takes
/// at least two bytes (key and length) when it adds that much. Every other field adds
/// less per byte: a scalar at most 8 bytes for 2 on the wire, a string a header for 2, a
/// packed element 8 for 1, a group marker nothing.
fn most_decoded(wire_len: usize) -> usize {
    const PER_BYTE: usize = 1 + (INSTANCE_BYTES + TEXT_HEADER) / 2;
    wire_len
        .saturating_mul(PER_BYTE)
        .saturating_add(INSTANCE_BYTES)
}

/// The decoded size of `wire` read as `message`, stopping as soon as it passes `limit`
/// (so the walk itself is bounded by the limit, not by what the client sent).
fn estimate(schema: &Schema, message: &str, wire: &[u8], limit: usize) -> usize {
    let Some(&root) = schema.by_name.get(message) else {
        return 0;
    };
    let mut total = schema.messages[root].instance.saturating_add(wire.len());
    // (message index, end offset) of each message being read.
    let mut stack: Vec<(usize, usize)> = vec![(root, wire.len())];
    let mut pos = 0usize;
    while let Some(&(current, end)) = stack.last() {
        if pos >= end {
            stack.pop();
            continue;
        }
        if total > limit {
            return total;
        }
        let Some((key, next)) = varint(wire, pos) else {
            return total;
        };
        pos = next;
        let number = u32::try_from(key >> 3).unwrap_or(0);
        let field = schema.messages[current].fields.get(&number).copied();
        match key & 7 {
            0 => {
                let Some((_, next)) = varint(wire, pos) else {
                    return total;
                };
                pos = next;
                total = total.saturating_add(repeated_scalar(field));
            }
            1 => {
                pos = pos.saturating_add(8);
                total = total.saturating_add(repeated_scalar(field));
            }
            5 => {
                pos = pos.saturating_add(4);
                total = total.saturating_add(repeated_scalar(field));
            }
            2 => {
                let Some((len, next)) = varint(wire, pos) else {
                    return total;
                };
                let Some(body_end) = usize::try_from(len)
                    .ok()
                    .and_then(|l| next.checked_add(l))
                    .filter(|&e| e <= end)
                else {
                    return total; // truncated: prost refuses it
                };
                pos = next;
                match field {
                    Some(Field::Message { index, repeated }) => {
                        let slot = if repeated { TEXT_HEADER } else { 0 };
                        total = total
                            .saturating_add(schema.messages[index].instance)
                            .saturating_add(slot);
                        if stack.len() > MAX_DEPTH {
                            // Deeper than prost decodes: it refuses the request; the walk
                            // skips the body and goes on.
                            pos = body_end;
                        } else {
                            stack.push((index, body_end));
                        }
                    }
                    Some(Field::Text) => {
                        total = total.saturating_add(TEXT_HEADER);
                        pos = body_end;
                    }
                    Some(Field::Scalar { size, .. }) => {
                        // Packed: at least one byte per element on the wire.
                        let elements = body_end - pos;
                        total = total.saturating_add(elements.saturating_mul(size));
                        pos = body_end;
                    }
                    None => pos = body_end, // unknown fields are skipped by prost
                }
            }
            // Group markers: prost skips an unknown group's contents (holding nothing),
            // but what follows the group is decoded, so the walk goes on. Fields inside
            // a group are read as the current message's: over-counted, never missed.
            3 | 4 => {}
            _ => return total, // invalid wire types: prost refuses them
        }
        if pos > end {
            return total;
        }
    }
    total
}

/// What one more element of a repeated scalar costs (nothing for a singular one).
fn repeated_scalar(field: Option<Field>) -> usize {
    match field {
        Some(Field::Scalar {
            size,
            repeated: true,
        }) => size,
        _ => 0,
    }
}

/// A base-128 varint at `pos`: its value and the position after it.
fn varint(wire: &[u8], mut pos: usize) -> Option<(u64, usize)> {
    let mut value = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = *wire.get(pos)?;
        pos += 1;
        value |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return Some((value, pos));
        }
    }
    None
}

#[cfg(test)]
#[path = "codec_tests.rs"]
mod tests;
