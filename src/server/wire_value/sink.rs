//! The serializer's two passes over one value: [`Sizer`] sums lengths, [`Writer`] writes.

use super::varint_len;

/// Where the serializer puts bytes: the sizing pass counts them, the writing pass writes.
pub(super) trait Sink {
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

/// First pass: the total size, and each nested message's length in opening order (as
/// `u32`: a large context opens tens of thousands of messages, and this table is built
/// on every call).
#[derive(Default)]
pub(super) struct Sizer {
    pub(super) total: usize,
    pub(super) lens: Vec<u32>,
    /// A nested message reached 4 GiB (no reply can hold it).
    pub(super) too_large: bool,
}

impl Sink for Sizer {
    /// Where the message's length goes in `lens`, and the total when it opened.
    type Frame = (usize, usize);

    fn put(&mut self, bytes: &[u8]) {
        self.total = self.total.saturating_add(bytes.len());
    }

    fn varint(&mut self, v: u64) {
        self.total = self.total.saturating_add(varint_len(v));
    }

    fn open(&mut self) -> (usize, usize) {
        self.lens.push(0);
        (self.lens.len() - 1, self.total)
    }

    fn close(&mut self, (slot, start): (usize, usize)) {
        let len = self.total.saturating_sub(start);
        match (self.lens.get_mut(slot), u32::try_from(len)) {
            (Some(slot), Ok(len)) => *slot = len,
            _ => self.too_large = true,
        }
        // The prefix belongs to the enclosing message.
        self.total = self.total.saturating_add(varint_len(len as u64));
    }
}

/// Second pass: the bytes, each nested message prefixed with the length the first pass
/// found (the same value walked the same way opens its messages in the same order).
pub(super) struct Writer {
    pub(super) out: Vec<u8>,
    pub(super) lens: std::vec::IntoIter<u32>,
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
        // here rather than a panic, and `list_body` refuses the result.
        let len = self.lens.next().unwrap_or(0);
        self.varint(u64::from(len));
    }

    fn close(&mut self, (): ()) {}
}
