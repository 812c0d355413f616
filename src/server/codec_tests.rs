//! The decode guard: amplifying requests are refused before decoding, ordinary ones
//! (large text, realistic structures) pass, and no byte string makes the walk panic.

use prost::Message as _;
use prost_types::value::Kind;

use super::*;
use crate::server::pb;

const UPDATE: &str = "compactd.v1.ClientUpdate";

fn encoded(u: &pb::ClientUpdate) -> Vec<u8> {
    u.encode_to_vec()
}

fn open_with_todos(n: usize) -> pb::ClientUpdate {
    pb::ClientUpdate {
        seq: 1,
        session_id: "s".into(),
        update: Some(pb::client_update::Update::Open(pb::SessionInfo {
            todos: vec![pb::Todo::default(); n],
            ..Default::default()
        })),
    }
}

fn tool_part(output: String, input: prost_types::Struct) -> pb::ClientUpdate {
    pb::ClientUpdate {
        seq: 2,
        session_id: "s".into(),
        update: Some(pb::client_update::Update::UpsertPart(pb::Part {
            id: "p".into(),
            message_id: "m".into(),
            kind: Some(pb::part::Kind::Tool(pb::ToolPart {
                call_id: "c".into(),
                tool: "bash".into(),
                state: Some(pb::ToolState {
                    status: "completed".into(),
                    input: Some(input),
                    output,
                    ..Default::default()
                }),
                ..Default::default()
            })),
            ..Default::default()
        })),
    }
}

#[test]
fn empty_repeated_entries_are_refused_before_decoding() {
    let wire = encoded(&open_with_todos(100_000));
    // 2 bytes per entry on the wire, a whole Todo each in memory.
    assert!(wire.len() < 250_000, "{}", wire.len());
    let limit = 2 * wire.len();
    let refused = check(UPDATE, &wire, limit).expect_err("amplifies far past 2×");
    let Refused::Amplifying { estimate, .. } = &refused else {
        panic!("{refused:?}");
    };
    assert!(*estimate > limit);
    assert!(
        refused.to_string().contains("max_update_bytes"),
        "{refused}"
    );
}

#[test]
fn empty_values_inside_a_struct_are_counted_too() {
    let list = prost_types::ListValue {
        values: vec![prost_types::Value { kind: None }; 100_000],
    };
    let input = prost_types::Struct {
        fields: [(
            "k".to_string(),
            prost_types::Value {
                kind: Some(Kind::ListValue(list)),
            },
        )]
        .into(),
    };
    let wire = encoded(&tool_part(String::new(), input));
    assert!(check(UPDATE, &wire, 4 * wire.len()).is_err());
}

#[test]
fn a_large_text_output_passes_at_the_default_factor() {
    let output = "x".repeat(4 << 20);
    let input = prost_types::Struct {
        fields: (0..50)
            .map(|i| {
                (
                    format!("key{i}"),
                    prost_types::Value {
                        kind: Some(Kind::StringValue("some value".into())),
                    },
                )
            })
            .collect(),
    };
    let wire = encoded(&tool_part(output, input));
    check(UPDATE, &wire, DECODED_FACTOR * wire.len()).expect("text decodes to its own size");
}

#[test]
fn the_estimate_grows_with_nested_messages_not_only_bytes() {
    let small = encoded(&open_with_todos(10));
    let big = encoded(&open_with_todos(1_000));
    let e_small = estimate(schema(), UPDATE, &small, usize::MAX);
    let e_big = estimate(schema(), UPDATE, &big, usize::MAX);
    // 990 more todos: at least an instance each.
    assert!(e_big - e_small >= 990 * INSTANCE_BYTES, "{e_small} {e_big}");
}

#[test]
fn every_request_type_is_guarded_and_known_to_the_schema() {
    fn known<T: ProtoName>() {
        assert!(T::GUARDED, "{} is an RPC input", T::NAME);
        assert!(schema().by_name.contains_key(T::NAME), "{}", T::NAME);
    }
    known::<pb::ClientUpdate>();
    known::<pb::OpenSessionRequest>();
    known::<pb::UpsertPartRequest>();
    known::<pb::ImportSessionRequest>();
    known::<pb::GetContextRequest>();
    known::<pb::CompactRequest>();
    known::<pb::SubscribeRequest>();
    fn guarded<T: ProtoName>() -> bool {
        T::GUARDED
    }
    assert!(!guarded::<pb::Context>(), "responses are not guarded");
    assert!(!guarded::<pb::ServerEvent>());
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(512))]

    /// Any bytes: the walk ends, never panics, and its estimate is at least the wire size.
    #[test]
    fn any_bytes_are_walked_without_panic(bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..512)) {
        let e = estimate(schema(), UPDATE, &bytes, usize::MAX);
        proptest::prop_assert!(e >= bytes.len());
        proptest::prop_assert!(e <= most_decoded(bytes.len()), "{e} over the bound");
        let _ = check(UPDATE, &bytes, 1024);
    }
}

#[test]
fn the_bound_that_skips_the_walk_holds_for_the_most_amplifying_request() {
    // Empty todos: two bytes on the wire each, the most a request can amplify.
    let wire = encoded(&open_with_todos(10_000));
    let e = estimate(schema(), UPDATE, &wire, usize::MAX);
    assert!(
        e <= most_decoded(wire.len()),
        "{e} over {}",
        most_decoded(wire.len())
    );
    assert!(
        e * 10 >= most_decoded(wire.len()) * 9,
        "the bound is tight enough to skip only short requests: {e} vs {}",
        most_decoded(wire.len())
    );
    // At the bound the walk is skipped; one byte under it, it runs and refuses.
    assert!(check(UPDATE, &wire, most_decoded(wire.len())).is_ok());
    assert!(check(UPDATE, &wire, e - 1).is_err());
}

#[test]
fn an_instance_costs_at_least_any_repeated_request_element() {
    // The element types a request can repeat: todos, attachments, list values, and
    // struct/map entries (a key and a value).
    for (name, size) in [
        ("Todo", std::mem::size_of::<pb::Todo>()),
        ("FilePart", std::mem::size_of::<pb::FilePart>()),
        ("Value", std::mem::size_of::<prost_types::Value>()),
        (
            "Struct entry",
            std::mem::size_of::<(String, prost_types::Value)>(),
        ),
    ] {
        assert!(size <= INSTANCE_BYTES, "{name} is {size} bytes");
    }
}

#[test]
fn an_unknown_group_does_not_hide_what_follows_it() {
    // Field 1000 as a start group, its end, then the amplifying todos: prost skips the
    // group and decodes the rest, so the walk must too.
    let mut wire = Vec::new();
    prost::encoding::encode_key(1000, prost::encoding::WireType::StartGroup, &mut wire);
    prost::encoding::encode_key(1000, prost::encoding::WireType::EndGroup, &mut wire);
    wire.extend(encoded(&open_with_todos(100_000)));
    assert!(
        pb::ClientUpdate::decode(wire.as_slice()).is_ok(),
        "prost reads past it"
    );
    assert!(check(UPDATE, &wire, 4 * wire.len()).is_err());
}

/// A large request past the decode slots waits for one rather than being refused: a
/// refusal in the codec ends the client's whole stream, for a load other clients cause.
#[test]
fn a_large_decode_waits_for_a_slot_and_is_refused_only_past_the_wait() {
    use std::time::{Duration, Instant};
    let mut held: Vec<LargeDecode> = (0..MAX_LARGE_DECODES)
        .map(|_| LargeDecode::enter(Duration::from_secs(30)).expect("a free slot"))
        .collect();
    // Past a short wait with every slot held: refused.
    let started = Instant::now();
    let refused = LargeDecode::enter(Duration::from_millis(50));
    assert_eq!(refused.map(|_| ()), Err(Refused::Busy));
    assert!(started.elapsed() >= Duration::from_millis(50));
    // Within the wait: it gets the slot a finished decode frees.
    let waiting = std::thread::spawn(|| LargeDecode::enter(Duration::from_secs(30)));
    std::thread::sleep(Duration::from_millis(50));
    assert!(!waiting.is_finished(), "every slot is held: it waits");
    held.pop();
    let entered = waiting.join().expect("no panic");
    assert!(entered.is_ok(), "{entered:?}");
    // Waiters hold a thread each: past as many waiting as there are slots, one more is
    // refused at once.
    held.extend(entered);
    let waiters: Vec<_> = (0..MAX_LARGE_DECODES)
        .map(|_| std::thread::spawn(|| LargeDecode::enter(Duration::from_secs(30))))
        .collect();
    let deadline = Instant::now() + Duration::from_secs(5);
    while large_decodes().waiting < MAX_LARGE_DECODES && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    let started = Instant::now();
    let refused = LargeDecode::enter(Duration::from_secs(30));
    assert_eq!(refused.map(|_| ()), Err(Refused::Busy));
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "refused at once"
    );
    held.clear();
    for w in waiters {
        assert!(w.join().expect("no panic").is_ok());
    }
}
