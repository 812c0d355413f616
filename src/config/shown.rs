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
}
