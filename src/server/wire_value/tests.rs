use std::collections::BTreeMap;

use prost::Message as _;
use serde::Serialize;
use serde_json::{Value, json};

use super::{list_body, list_value};
use crate::server::convert::value_to_pb;

/// What prost decodes from `items` written by [`list_body`].
fn decoded<T: Serialize>(items: &[T]) -> prost_types::ListValue {
    let body = list_body(items).expect("writes");
    prost_types::ListValue::decode(body.as_slice()).expect("decodes as a ListValue")
}

/// The reference: `serde_json::to_value`, then the copying JSON → protobuf conversion.
fn via_json<T: Serialize>(items: &[T]) -> prost_types::ListValue {
    prost_types::ListValue {
        values: items
            .iter()
            .map(|i| value_to_pb(&serde_json::to_value(i).expect("serde_json serializes")))
            .collect(),
    }
}

#[test]
fn json_values_decode_as_the_values_they_were() {
    let long = "x".repeat(200);
    let longer = "é".repeat(10_000);
    let items = vec![
        Value::Null,
        json!(true),
        json!(false),
        json!(0),
        json!(-7),
        json!(u64::MAX),
        json!(2.5),
        json!("line\nline \u{1F600}"),
        json!(long),
        json!(longer),
        json!([]),
        json!({}),
        json!([1, "two", [], {}, [null, [true]]]),
        json!({"role": "assistant", "content": null, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": "{\"a\":1}"}}
        ]}),
        json!({"nested": {"deeper": {"deepest": [{"k": longer}]}}}),
    ];
    assert_eq!(decoded(&items), via_json(&items));
    // Exactly prost's size (no key here is empty, which prost leaves out of a map entry):
    // every length prefix is as short as it can be.
    let body = list_body(&items).expect("writes");
    assert_eq!(body.len(), via_json(&items).encoded_len());
}

#[derive(Serialize)]
enum External {
    Unit,
    Newtype(u32),
    Tuple(u8, String),
    Struct { a: Option<String>, b: Vec<u16> },
}

#[derive(Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
enum Internal {
    First { text: String },
    Second { n: f64, skipped: Option<u8> },
}

#[derive(Serialize)]
#[serde(untagged)]
enum Untagged {
    Text(String),
    Many(Vec<Internal>),
}

#[derive(Serialize)]
struct Everything {
    unit: (),
    none: Option<String>,
    some: Option<char>,
    not_a_number: f64,
    infinite: f32,
    tuple: (i8, i16, i64),
    external: Vec<External>,
    internal: Internal,
    untagged: Vec<Untagged>,
    int_keys: BTreeMap<u32, bool>,
    str_keys: BTreeMap<String, Vec<()>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    absent: Option<u8>,
}

#[test]
fn every_serde_shape_reads_as_serde_json_writes_it() {
    let item = Everything {
        unit: (),
        none: None,
        some: Some('ß'),
        not_a_number: f64::NAN,
        infinite: f32::INFINITY,
        tuple: (-1, 300, -5_000_000_000),
        external: vec![
            External::Unit,
            External::Newtype(9),
            External::Tuple(1, "t".into()),
            External::Struct {
                a: Some("a".into()),
                b: vec![1, 2],
            },
        ],
        internal: Internal::First { text: "hi".into() },
        untagged: vec![
            Untagged::Text("plain".into()),
            Untagged::Many(vec![Internal::Second {
                n: -0.5,
                skipped: None,
            }]),
        ],
        int_keys: BTreeMap::from([(1, true), (20, false)]),
        str_keys: BTreeMap::from([("".to_string(), vec![()]), ("k".to_string(), vec![])]),
        absent: None,
    };
    let items = [item];
    assert_eq!(decoded(&items), via_json(&items));
}

#[test]
fn a_key_that_is_not_a_string_is_refused_and_leaves_an_empty_list() {
    let items = [BTreeMap::from([((1, 2), "pair key")])];
    assert!(
        serde_json::to_value(&items[0]).is_err(),
        "serde_json refuses it too"
    );
    let err = list_body(&items).expect_err("a tuple key is refused");
    assert!(err.to_string().contains("not a string"), "{err}");
    let list = list_value(&items);
    assert_eq!(list.held_bytes(), 0);
    assert_eq!(prost::Message::encoded_len(&list), 0);
}

#[test]
fn an_encoded_list_is_sent_as_its_bytes_and_decodes_into_values() {
    let items = vec![json!({"role": "user", "content": "hi"}), json!([1, 2])];
    let body = list_body(&items).expect("writes");
    let list = list_value(&items);
    assert_eq!(list.encode_to_vec(), body);
    let back = crate::server::list_value::ListValue::decode(body.as_slice()).expect("decodes");
    assert_eq!(back.values, via_json(&items).values);
    // A decoded list encodes from its values, to the same values.
    let again = prost_types::ListValue::decode(back.encode_to_vec().as_slice()).expect("decodes");
    assert_eq!(again.values, back.values);
}

/// The GetContext shape on every shared trace, as loaded and pruned: the OpenAI messages
/// written as protobuf bytes decode to what `serde_json::to_value` of the same messages
/// converts to.
#[test]
fn every_trace_context_writes_as_its_json_values() {
    crate::server::test_traces::each_trace_session(|name, session| {
        let context = session.context_openai_as(|m| (decoded(m), via_json(m), m.len()));
        let (written, reference, messages) = context.json;
        assert!(messages > 0, "{name}: no messages");
        assert_eq!(written, reference, "{name}");
    });
}

/// A value that serializes differently each time it is walked (the two passes would
/// disagree on lengths): refused, never written with wrong lengths.
#[test]
fn a_value_that_walks_differently_twice_is_refused() {
    use std::cell::Cell;
    struct Shifty(Cell<usize>);
    impl Serialize for Shifty {
        fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            let n = self.0.get();
            self.0.set(n + 1);
            s.serialize_str(&"x".repeat(n * 10))
        }
    }
    let items = [Shifty(Cell::new(1))];
    let err = list_body(&items).expect_err("the second walk differs");
    assert!(err.to_string().contains("second walk"), "{err}");
}
