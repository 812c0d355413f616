//! The byte limits: an update that would take a session past its limit is refused with
//! the limit's name and value and changes nothing; shrinking is always allowed.

use super::*;
use crate::engine::{ByteLimit, ErrorKind};

fn limited(bytes: u64) -> ByteLimit {
    ByteLimit {
        bytes,
        name: "max_session_bytes",
        value: bytes,
    }
}

#[test]
fn growth_past_the_limit_is_refused_and_changes_nothing() {
    let mut s = session("user u1 text:t1=10\nassistant a1 read:p1=100");
    let held = s.held_bytes();
    s.set_byte_limit(limited(held + 2_000));
    // 1 kB fits.
    apply(&mut s, Update::UpsertPart(text("u1", "t2", &chars(1_000))));
    let (before, bytes) = (s.messages().to_vec(), s.held_bytes());
    let err = s
        .apply(
            Update::UpsertPart(text("u1", "t3", &chars(4_000))),
            &config(),
        )
        .expect_err("4 kB more is over the limit");
    assert_eq!(err.kind, ErrorKind::ResourceExhausted);
    assert!(
        err.message.starts_with(&format!(
            "max_session_bytes ({} bytes) reached",
            held + 2_000
        )),
        "{err}"
    );
    assert_eq!(s.messages(), before);
    assert_eq!(s.held_bytes(), bytes);
    // A message is refused the same way (its info is big here).
    let mut big = user("u2");
    big.extra.insert("blob".into(), chars(4_000).into());
    assert!(s.apply(Update::UpsertMessage(big), &config()).is_err());
    assert_eq!(s.messages(), before);
    // Replacing a part with a smaller one, and deleting one, are always allowed.
    s.set_byte_limit(limited(0));
    apply(&mut s, Update::UpsertPart(text("u1", "t2", "short")));
    assert!(s.held_bytes() < bytes);
    apply(
        &mut s,
        Update::DeletePart {
            message_id: "u1".into(),
            part_id: "t2".into(),
        },
    );
    assert_eq!(s.held_bytes(), s.held_bytes_from_scratch());
}

#[test]
fn the_figure_follows_replacements_and_deletions_exactly() {
    let mut s = session("user u1 text:t1=10");
    let empty = s.held_bytes();
    apply(&mut s, Update::UpsertPart(text("u1", "t2", &chars(10_000))));
    let full = s.held_bytes();
    assert!(full >= empty + 10_000, "{empty} -> {full}");
    apply(&mut s, Update::UpsertPart(text("u1", "t2", &chars(100))));
    assert!(s.held_bytes() < full - 9_000);
    apply(
        &mut s,
        Update::DeletePart {
            message_id: "u1".into(),
            part_id: "t2".into(),
        },
    );
    // The slot the part took in the message's vector stays allocated, and counted.
    assert_eq!(s.held_bytes(), s.held_bytes_from_scratch());
    assert!(s.held_bytes() < empty + 2_000);
}
