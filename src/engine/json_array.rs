//! A JSON array kept as its elements' texts: GetContext's JSON shape, one chunk per
//! context message, shared with the context cache. The reply writes the pieces one after
//! the other (`server/context_message.rs`); nothing joins them into one text first.

use std::sync::Arc;

/// A JSON array as its elements, each already JSON text and none empty (one context
/// message's chat messages, `,`-separated).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct JsonArray {
    elements: Vec<Arc<[u8]>>,
    /// Bytes of the whole array text: brackets, elements and the commas between them.
    len: usize,
}

impl JsonArray {
    /// The array of these elements (each non-empty JSON text).
    pub fn new(elements: Vec<Arc<[u8]>>) -> JsonArray {
        let commas = elements.len().saturating_sub(1);
        let len = elements.iter().fold(2usize.saturating_add(commas), |n, e| {
            n.saturating_add(e.len())
        });
        JsonArray { elements, len }
    }

    /// Bytes of the array's text (what a reply holds in flight; elements it shares with
    /// a cache count whole, as the reply keeps them alive).
    pub fn text_len(&self) -> usize {
        self.len
    }

    /// The array's text in order: `[`, each element with `,` between, `]`.
    pub fn pieces(&self) -> impl Iterator<Item = &[u8]> {
        let elements = self.elements.iter().enumerate().flat_map(|(k, e)| {
            let comma: &[u8] = if k > 0 { b"," } else { b"" };
            [comma, &e[..]]
        });
        std::iter::once(&b"["[..])
            .chain(elements)
            .chain(std::iter::once(&b"]"[..]))
    }

    /// The array's text, joined.
    pub fn to_text(&self) -> String {
        let mut text = Vec::with_capacity(self.len);
        for piece in self.pieces() {
            text.extend_from_slice(piece);
        }
        // The elements are JSON written from Rust strings.
        String::from_utf8(text).unwrap_or_else(|_| "[]".to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::JsonArray;

    #[test]
    fn pieces_make_the_array_text_of_its_length() {
        for (elements, text) in [
            (
                &["{\"a\":1}", "{\"b\":2},{\"c\":3}"][..],
                "[{\"a\":1},{\"b\":2},{\"c\":3}]",
            ),
            (&["{\"é\":\"ü\"}"][..], "[{\"é\":\"ü\"}]"),
            (&[][..], "[]"),
        ] {
            let array = JsonArray::new(elements.iter().map(|e| e.as_bytes().into()).collect());
            assert_eq!(array.to_text(), text);
            assert_eq!(array.text_len(), text.len());
            assert_eq!(array.pieces().map(<[u8]>::len).sum::<usize>(), text.len());
        }
    }
}
