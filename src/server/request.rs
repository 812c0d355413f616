//! What a client asked, decoded: a stream update (or a unary request's payload) becomes
//! an [`Op`] with domain types inside, or a [`Rejection`] naming the field at fault.
//! Nothing here touches a session; `ops.rs` runs the ops.

use super::compaction;
use super::convert;
use super::pb;
use super::status::Rejection;
use crate::domain::{HeapSize, SessionInfo, check_id};
use crate::engine::{RecallKey, Update};
use crate::store::{Ledger, Reservation};

/// Default largest update accepted (`max_update_bytes`).
pub const DEFAULT_MAX_UPDATE_BYTES: usize = 16 * 1024 * 1024;

/// A decoded request for one session.
#[derive(Debug)]
pub enum Op {
    /// Open or reconfigure (boxed, like `Apply`: a session's info is the largest payload).
    Open(Box<SessionInfo>),
    /// Change the session (boxed: an update is several hundred bytes, and it travels by
    /// value through the nested futures that queue it on its session's actor).
    Apply(Box<Update>),
    /// Build the context.
    Context(pb::ContextFormat),
    /// Run prune.
    Prune {
        /// Report only.
        dry_run: bool,
    },
    /// Run the overflow check.
    CheckOverflow,
    /// Start a manual compaction (the stream starts it itself, with its own sink).
    Compact(compaction::Options),
    /// Stop the running compaction.
    CancelCompaction,
}

impl Op {
    /// Name used in acks, logs and metrics; on the stream, also the field a rejection's
    /// field name sits under (`upsert_part.message_id`).
    pub fn kind(&self) -> &'static str {
        match self {
            Op::Open(_) => "open",
            Op::Apply(u) => u.kind(),
            Op::Context(_) => "get_context",
            Op::Prune { .. } => "prune",
            Op::CheckOverflow => "check_overflow",
            Op::Compact(_) => "compact",
            Op::CancelCompaction => "cancel_compaction",
        }
    }
}

/// Heap bytes of what an op holds once decoded: its strings about as on the wire, its
/// JSON trees (a tool's input, `extra`, metadata) as much as 40 times more (`[null, …]`
/// is 2 bytes an element on the wire, a `serde_json::Value` each decoded). Strings are
/// counted by capacity, JSON by walking it: no more work than the decoding did.
pub fn decoded_bytes(op: &Op) -> u64 {
    let bytes = match op {
        Op::Open(info) => info.heap_bytes(),
        Op::Apply(u) => match &**u {
            Update::UpsertPart(p) => p.heap_bytes(),
            Update::UpsertMessage(m) => m.heap_bytes(),
            Update::Configure(info) => info.heap_bytes(),
            _ => 0,
        },
        _ => 0,
    };
    u64::try_from(bytes).unwrap_or(u64::MAX)
}

/// Counts a request's decoded bytes in flight where they pass the `held` wire bytes: it
/// waits decoded in its session's mailbox, and a stream may hold hundreds. Refused
/// (`RESOURCE_EXHAUSTED`) when they do not fit the in-flight share.
pub fn hold_decoded(
    held: &mut Reservation,
    ledger: &std::sync::Arc<Ledger>,
    decoded: impl TryInto<u64>,
) -> Result<(), Rejection> {
    let decoded = decoded.try_into().unwrap_or(u64::MAX);
    if decoded <= held.bytes() {
        return Ok(());
    }
    held.resize(ledger, decoded, "updates")
        .map_err(Rejection::from)
}

/// Rejects an update larger than `max` bytes, naming the limit.
pub fn check_size(len: usize, max: usize) -> Result<(), Rejection> {
    if len > max {
        return Err(Rejection::too_large(
            "",
            format!("update is {len} bytes, over the max_update_bytes limit of {max} bytes"),
        ));
    }
    Ok(())
}

/// Decodes a stream update of `len` encoded bytes (the caller has the length already: the
/// stream reader counts it in flight first). Field names in errors are relative to the
/// update (`upsert_part.tool.state.status`).
pub fn decode_update(u: pb::ClientUpdate, len: usize, max: usize) -> Result<Op, Rejection> {
    use pb::client_update::Update as U;
    check_size(len, max)?;
    check_id("session_id", &u.session_id)?;
    let Some(update) = u.update else {
        return Err(Rejection::invalid(
            "update",
            "required: one of open, upsert_message, upsert_part, delete_part, report_usage, get_context, prune, check_overflow, compact, cancel_compaction, pin",
        ));
    };
    Ok(match update {
        U::Open(info) => Op::Open(Box::new(
            convert::session_from_pb(info, &u.session_id).map_err(|r| r.within("open"))?,
        )),
        U::UpsertMessage(m) => Op::Apply(Box::new(Update::UpsertMessage(
            convert::message_from_pb(m).map_err(|r| r.within("upsert_message"))?,
        ))),
        U::UpsertPart(p) => Op::Apply(Box::new(Update::UpsertPart(
            convert::part_from_pb(p).map_err(|r| r.within("upsert_part"))?,
        ))),
        U::DeletePart(r) => Op::Apply(Box::new(
            delete_update(r.message_id, r.part_id).map_err(|e| e.within("delete_part"))?,
        )),
        U::ReportUsage(r) => Op::Apply(Box::new(
            usage_update(r).map_err(|e| e.within("report_usage"))?,
        )),
        U::GetContext(c) => {
            Op::Context(context_format(c.format).map_err(|r| r.within("get_context"))?)
        }
        U::Prune(p) => Op::Prune { dry_run: p.dry_run },
        U::CheckOverflow(_) => Op::CheckOverflow,
        U::Compact(o) => Op::Compact(o.try_into().map_err(|r: Rejection| r.within("compact"))?),
        U::CancelCompaction(_) => Op::CancelCompaction,
        U::Pin(p) => Op::Apply(Box::new(
            pin_update(p.message_id, p.part_id, p.pinned).map_err(|e| e.within("pin"))?,
        )),
    })
}

/// Decodes a delete.
pub fn delete_update(message_id: String, part_id: String) -> Result<Update, Rejection> {
    check_id("message_id", &message_id)?;
    check_id("part_id", &part_id)?;
    Ok(Update::DeletePart {
        message_id,
        part_id,
    })
}

/// Decodes a pin: `message_id` is required, an empty `part_id` pins the whole message,
/// and an absent `pinned` pins.
pub fn pin_update(
    message_id: String,
    part_id: String,
    pinned: Option<bool>,
) -> Result<Update, Rejection> {
    check_id("message_id", &message_id)?;
    let part_id = (!part_id.is_empty()).then_some(part_id);
    if let Some(id) = &part_id {
        check_id("part_id", id)?;
    }
    Ok(Update::Pin {
        message_id,
        part_id,
        pinned: pinned.unwrap_or(true),
    })
}

/// Decodes which part a recall asks for: a call id or a part id, non-empty and bounded.
pub fn recall_key(key: Option<pb::recall_request::Key>) -> Result<RecallKey, Rejection> {
    use pb::recall_request::Key;
    let key = match key {
        Some(Key::CallId(id)) => RecallKey::CallId(id),
        Some(Key::PartId(id)) => RecallKey::PartId(id),
        None => {
            return Err(Rejection::invalid(
                "call_id",
                "required: call_id or part_id",
            ));
        }
    };
    check_id(key.field(), key.id())?;
    Ok(key)
}

/// Decodes a usage report.
pub fn usage_update(r: pb::UsageReport) -> Result<Update, Rejection> {
    let Some(tokens) = r.tokens else {
        return Err(Rejection::invalid("tokens", "required"));
    };
    let message_id = (!r.message_id.is_empty()).then_some(r.message_id);
    if let Some(id) = &message_id {
        check_id("message_id", id)?;
    }
    Ok(Update::ReportUsage {
        message_id,
        tokens: convert::usage_from_pb(tokens),
    })
}

/// Validates a context format value.
pub fn context_format(v: i32) -> Result<pb::ContextFormat, Rejection> {
    pb::ContextFormat::try_from(v)
        .map_err(|_| Rejection::invalid("format", format!("unknown context format {v}")))
}

/// Where a `ListSessions` page starts and how many sessions it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListPage {
    /// The listing goes on after this id (the previous page's last).
    pub after: Option<String>,
    /// At most this many sessions; `None` lists them all.
    pub size: Option<usize>,
}

/// A `ListSessions` request's page, its fields checked.
pub fn list_page(r: pb::ListSessionsRequest) -> Result<ListPage, Rejection> {
    let size = match usize::try_from(r.page_size) {
        Ok(0) => None,
        Ok(n) => Some(n),
        Err(_) => {
            return Err(Rejection::invalid(
                "page_size",
                format!("{} is negative; 0 lists every session", r.page_size),
            ));
        }
    };
    // Any text: it is only compared with ids (a store may hold ids longer than a new
    // session's may be, from before ids were bounded), and the request's size is bounded.
    let after = (!r.page_token.is_empty()).then_some(r.page_token);
    Ok(ListPage { after, size })
}

/// The page of `entries` (keyed by session id, in any order) that `page` asks for, in id
/// order, and the token of the page after it (empty when none follows).
pub fn take_page<T>(mut entries: Vec<(String, T)>, page: &ListPage) -> (Vec<(String, T)>, String) {
    if let Some(after) = &page.after {
        entries.retain(|(id, _)| id > after);
    }
    let cut = page.size.filter(|&n| n > 0 && entries.len() > n);
    if let Some(n) = cut {
        // The page's sessions first (linear), then only they are sorted: a walk through
        // every page does not sort every session once per page.
        entries.select_nth_unstable_by(n - 1, |a, b| a.0.cmp(&b.0));
        entries.truncate(n);
    }
    entries.sort_unstable_by(|a, b| a.0.cmp(&b.0));
    let next = match cut {
        Some(_) => entries.last().map(|(id, _)| id.clone()).unwrap_or_default(),
        None => String::new(),
    };
    (entries, next)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use prost::Message as _;
    use prost_types::value::Kind;

    use super::*;

    /// An update whose tool input is `{"a": [null × n]}`: 2 bytes an element on the wire.
    fn nulls(n: usize) -> pb::ClientUpdate {
        let null = prost_types::Value {
            kind: Some(Kind::NullValue(0)),
        };
        let input = prost_types::Struct {
            fields: [(
                "a".to_string(),
                prost_types::Value {
                    kind: Some(Kind::ListValue(prost_types::ListValue {
                        values: vec![null; n],
                    })),
                },
            )]
            .into(),
        };
        pb::ClientUpdate {
            seq: 1,
            session_id: "s".into(),
            update: Some(pb::client_update::Update::UpsertPart(pb::Part {
                id: "p1".into(),
                message_id: "m1".into(),
                kind: Some(pb::part::Kind::Tool(pb::ToolPart {
                    call_id: "c1".into(),
                    tool: "read".into(),
                    state: Some(pb::ToolState {
                        status: "running".into(),
                        input: Some(input),
                        ..Default::default()
                    }),
                    metadata: None,
                })),
                extra: None,
                mark: None,
            })),
        }
    }

    /// A JSON tree decodes to many times its wire size: what waits decoded in a session's
    /// mailbox is counted as decoded, and refused past the in-flight share. Before, 240 KB
    /// was counted for about 10 MB held, and a stream could hold hundreds of such updates.
    #[test]
    fn an_update_is_counted_in_flight_as_decoded() {
        let update = nulls(120_000);
        let wire = update.encoded_len();
        let op = decode_update(update, wire, DEFAULT_MAX_UPDATE_BYTES).expect("decodes");
        let decoded = decoded_bytes(&op);
        let wire = u64::try_from(wire).expect("fits");
        assert!(
            decoded > 16 * wire,
            "{decoded} decoded for {wire} on the wire"
        );

        let ledger = Arc::new(Ledger::new(1 << 30));
        let mut held = ledger.reserve(wire, "updates").expect("room");
        hold_decoded(&mut held, &ledger, decoded).expect("room");
        assert_eq!(ledger.in_flight(), decoded);
        drop(held);
        assert_eq!(ledger.in_flight(), 0);

        // A budget whose in-flight share the wire bytes fit, the decoded ones not.
        let ledger = Arc::new(Ledger::new(32 << 20));
        assert!(ledger.in_flight_limit() > wire && ledger.in_flight_limit() < decoded);
        let mut held = ledger.reserve(wire, "updates").expect("the wire bytes fit");
        let refused = hold_decoded(&mut held, &ledger, decoded).expect_err("past the share");
        assert_eq!(refused.code, tonic::Code::ResourceExhausted, "{refused:?}");
    }

    fn entries(ids: &[&str]) -> Vec<(String, usize)> {
        ids.iter()
            .enumerate()
            .map(|(i, id)| (id.to_string(), i))
            .collect()
    }

    /// Pages come in id order whatever the store's order, each page's token its last id;
    /// the one that reaches the end has none.
    #[test]
    fn pages_go_in_id_order_after_the_token() {
        let all = entries(&["d", "a", "c", "b", "e"]);
        let ask = |after: Option<&str>, size| ListPage {
            after: after.map(str::to_string),
            size,
        };
        let (p, next) = take_page(all.clone(), &ask(None, Some(2)));
        assert_eq!(
            (p, next.as_str()),
            (vec![("a".into(), 1), ("b".into(), 3)], "b")
        );
        let (p, next) = take_page(all.clone(), &ask(Some("b"), Some(3)));
        assert_eq!(
            p.iter().map(|e| e.0.as_str()).collect::<Vec<_>>(),
            ["c", "d", "e"]
        );
        assert_eq!(next, "", "exactly what is left: the last page");
        let (p, next) = take_page(all.clone(), &ask(Some("bb"), None));
        assert_eq!(p.len(), 3);
        assert_eq!(next, "");
        assert_eq!(
            take_page(all, &ask(Some("e"), Some(1))),
            (vec![], String::new())
        );
    }

    /// Walking every page, for every page size and number of sessions up to 12, lists each
    /// session once, in id order, and the last page alone has no token.
    #[test]
    fn a_walk_through_every_page_lists_each_session_once() {
        for len in 0..12usize {
            // A fixed shuffle of the ids (7 is prime to 12, so each appears once).
            let ids: Vec<String> = (0..len).map(|i| format!("s{:02}", (i * 7) % 12)).collect();
            let mut sorted = ids.clone();
            sorted.sort();
            let all: Vec<(String, ())> = ids.into_iter().map(|id| (id, ())).collect();
            for size in 1..=len + 1 {
                let (mut walked, mut after) = (Vec::new(), None);
                loop {
                    let page = ListPage {
                        after,
                        size: Some(size),
                    };
                    let (p, next) = take_page(all.clone(), &page);
                    assert!(p.len() <= size);
                    assert!(!p.is_empty() || len == 0, "a token led to an empty page");
                    walked.extend(p.into_iter().map(|e| e.0));
                    if next.is_empty() {
                        break;
                    }
                    assert_eq!(
                        Some(&next),
                        walked.last(),
                        "the token is the page's last id"
                    );
                    after = Some(next);
                }
                assert_eq!(walked, sorted, "{len} sessions, {size} a page");
            }
        }
    }

    #[test]
    fn a_page_request_names_its_bad_field() {
        let req = |page_size, page_token: &str| pb::ListSessionsRequest {
            page_size,
            page_token: page_token.into(),
        };
        assert_eq!(
            list_page(req(0, "")),
            Ok(ListPage {
                after: None,
                size: None
            })
        );
        assert_eq!(
            list_page(req(5, "s1")),
            Ok(ListPage {
                after: Some("s1".into()),
                size: Some(5)
            })
        );
        let e = list_page(req(-3, "")).expect_err("negative");
        assert_eq!(
            (e.code, e.field.as_str()),
            (tonic::Code::InvalidArgument, "page_size")
        );
        // A token is only compared with ids: one longer than a new id may be (an id from
        // before ids were bounded) goes on after it.
        let long = "x".repeat(300);
        assert_eq!(list_page(req(1, &long)).map(|p| p.after), Ok(Some(long)));
    }
}
