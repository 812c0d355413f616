//! How a value a client sent is shown in an error: its beginning only. An error message
//! travels in a gRPC trailer (clients cap those at 8-16 KiB) and in events; a value
//! echoed whole would make a 16 MiB update's refusal 16 MiB again (more, escaped).

use std::borrow::Cow;

/// Characters of a value an error shows.
pub const SHOWN_CHARS: usize = 64;

/// `v`, or its first [`SHOWN_CHARS`] characters and `…` when longer: for an error
/// message to quote (`{:?}` of it stays bounded).
pub fn clipped(v: &str) -> Cow<'_, str> {
    match v.char_indices().nth(SHOWN_CHARS) {
        None => Cow::Borrowed(v),
        Some((end, _)) => Cow::Owned(format!("{}…", &v[..end])),
    }
}

/// Bytes of an error's message a client is sent at most: a backstop behind [`clipped`],
/// so a message that quotes a client's value whole still fits the trailer clients accept.
pub const MAX_ERROR_BYTES: usize = 2048;

/// `message`, cut to [`MAX_ERROR_BYTES`] at a character boundary (ending in `…`).
pub fn capped(message: String) -> String {
    cut_to(message, MAX_ERROR_BYTES)
}

/// `text`, or its beginning and `…` in at most `max` bytes (cut at a character boundary):
/// the one way a value too long for where it goes is shortened.
pub fn cut_to(mut text: String, max: usize) -> String {
    if text.len() <= max {
        return text;
    }
    let mut end = max.saturating_sub('…'.len_utf8());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text.truncate(end);
    text.push('…');
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_value_shows_its_beginning_only() {
        assert_eq!(clipped("user"), "user");
        let exact = "é".repeat(SHOWN_CHARS);
        assert_eq!(clipped(&exact), exact);
        let long = "é".repeat(SHOWN_CHARS + 1);
        assert_eq!(clipped(&long), format!("{exact}…"));
        assert!(format!("{:?}", clipped(&"\u{1}".repeat(1 << 20))).len() < 1024);
    }

    #[test]
    fn a_long_message_is_cut_at_a_character_boundary() {
        assert_eq!(capped("short".into()), "short");
        let long = capped("é".repeat(MAX_ERROR_BYTES));
        assert!(long.len() <= MAX_ERROR_BYTES, "{}", long.len());
        assert!(long.ends_with("é…"), "{long}");
    }
}
