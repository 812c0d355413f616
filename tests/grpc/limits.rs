//! Limits: each returns RESOURCE_EXHAUSTED naming the limit and its value, and leaves the
//! server and the other sessions working; idle sessions are evicted with an event.

use std::sync::Arc;
use std::time::Duration;

use compactd::config::EngineConfig;
use compactd::server::{ServerOptions, pb};
use compactd::store::{Ledger, Limits, Store};
use tokio_stream::StreamExt;

use crate::common::*;

#[tokio::test]
async fn max_sessions_refuses_one_more_and_the_others_keep_working() {
    let store = Store::new(EngineConfig::default()).with_max_sessions(2);
    let server = start_server_on(store, ServerOptions::default()).await;
    let mut c = server.client().await;
    open_session(&mut c, session("s1")).await;
    open_session(&mut c, session("s2")).await;
    let third = c
        .open_session(pb::OpenSessionRequest {
            session: Some(session("s3")),
        })
        .await;
    let status = assert_status(third, tonic::Code::ResourceExhausted, "max_sessions (2)");
    assert!(status.message().contains("--max-sessions"), "{status:?}");
    // An import is a new session too.
    let import = c.import_session(example_import("s4")).await;
    assert_status(import, tonic::Code::ResourceExhausted, "max_sessions");
    // Existing sessions still take updates; reopening one is not a new session.
    put_message(&mut c, "s1", user_msg("u1")).await;
    open_session(&mut c, session("s2")).await;
    // Deleting one makes room.
    c.delete_session(pb::DeleteSessionRequest {
        session_id: "s2".into(),
    })
    .await
    .expect("delete");
    open_session(&mut c, session("s3")).await;
}

/// Adds 10 kB text parts to `sid` until one is refused; returns that status and the
/// session as it was just before.
async fn fill(c: &mut Client, sid: &str, msg: &str) -> (tonic::Status, pb::GetSessionResponse) {
    for i in 0..200 {
        let before = get_session(c, sid).await;
        let r = c
            .upsert_part(pb::UpsertPartRequest {
                session_id: sid.into(),
                part: Some(text_part(
                    msg,
                    &format!("{msg}-t{i}"),
                    &output_of("f", 10_000),
                )),
            })
            .await;
        if let Err(status) = r {
            return (status, before);
        }
    }
    panic!("{sid}: 2 MB of parts and no limit reached");
}

fn held(s: &pb::GetSessionResponse) -> u64 {
    s.summary.as_ref().expect("summary").held_bytes
}

#[tokio::test]
async fn max_session_bytes_refuses_growth_past_it_and_leaves_the_session_as_it_was() {
    let limits = Limits {
        max_session_bytes: 64 * 1024,
        ..Limits::default()
    };
    let server = start_server_with_limits(limits).await;
    let mut c = server.client().await;
    open_session(&mut c, session("big")).await;
    open_session(&mut c, session("other")).await;
    put_message(&mut c, "big", user_msg("u1")).await;
    let (status, before) = fill(&mut c, "big", "u1").await;
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    assert!(
        status.message().contains("max_session_bytes (65536 bytes)"),
        "{status:?}"
    );
    assert!(
        status.message().contains("--max-session-bytes"),
        "{status:?}"
    );
    let after = get_session(&mut c, "big").await;
    assert_eq!(after, before, "the refused part changed nothing");
    assert!(held(&after) <= 64 * 1024, "{}", held(&after));
    assert!(held(&after) > 40 * 1024, "{}", held(&after));
    // Shrinking is always allowed: the host can clean up a full session.
    put_part(&mut c, "big", text_part("u1", "u1-t0", "short now")).await;
    assert!(held(&get_session(&mut c, "big").await) < held(&after));
    // The same update over the stream is an error event; the stream goes on.
    let mut stream = server.stream().await;
    let events = stream
        .request(
            "big",
            upsert_part(text_part("u1", "u1-huge", &output_of("h", 70_000))),
        )
        .await;
    assert!(
        error(&events).message.contains("max_session_bytes"),
        "{events:?}"
    );
    stream
        .expect_ack("other", upsert_message(user_msg("o1")))
        .await;
    // Other sessions are not affected.
    put_part(
        &mut c,
        "other",
        text_part("o1", "o-t", &output_of("o", 10_000)),
    )
    .await;
}

#[tokio::test]
async fn the_memory_budget_refuses_growth_and_new_sessions_until_memory_is_freed() {
    let limits = Limits {
        memory_budget: 100 * 1024,
        ..Limits::default()
    };
    let server = start_server_with_limits(limits).await;
    let mut c = server.client().await;
    open_session(&mut c, session("a")).await;
    open_session(&mut c, session("b")).await;
    put_message(&mut c, "a", user_msg("ua")).await;
    put_message(&mut c, "b", user_msg("ub")).await;
    let (status, before) = fill(&mut c, "a", "ua").await;
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    assert!(
        status.message().contains("memory_budget (102400 bytes)"),
        "{status:?}"
    );
    assert_eq!(get_session(&mut c, "a").await, before, "nothing changed");
    let sessions = c
        .list_sessions(pb::ListSessionsRequest::default())
        .await
        .expect("list")
        .into_inner()
        .sessions;
    let total: u64 = sessions.iter().map(|s| s.held_bytes).sum();
    assert!(total <= 100 * 1024, "{total}");
    // The budget is shared: `b` cannot grow by 10 kB either, nor can `c` open with more
    // than is left.
    let grow = c
        .upsert_part(pb::UpsertPartRequest {
            session_id: "b".into(),
            part: Some(text_part("ub", "b-t", &output_of("b", 10_000))),
        })
        .await;
    assert_status(grow, tonic::Code::ResourceExhausted, "memory_budget");
    // Deleting `a` gives its memory back to the others.
    c.delete_session(pb::DeleteSessionRequest {
        session_id: "a".into(),
    })
    .await
    .expect("delete");
    let mut grown = false;
    for _ in 0..100 {
        let r = c
            .upsert_part(pb::UpsertPartRequest {
                session_id: "b".into(),
                part: Some(text_part("ub", "b-t", &output_of("b", 10_000))),
            })
            .await;
        if r.is_ok() {
            grown = true;
            break;
        }
        // The deleted session's actor hands its bytes back when its last job is done.
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(grown, "b could not grow after a was deleted");
}

#[tokio::test]
async fn a_spent_memory_budget_refuses_new_sessions_and_imports() {
    let limits = Limits {
        memory_budget: 1024,
        ..Limits::default()
    };
    let server = start_server_with_limits(limits).await;
    let mut c = server.client().await;
    let open = c
        .open_session(pb::OpenSessionRequest {
            session: Some(session("s")),
        })
        .await;
    assert_status(
        open,
        tonic::Code::ResourceExhausted,
        "memory_budget (1024 bytes)",
    );
    let import = c.import_session(example_import("i")).await;
    assert_status(import, tonic::Code::ResourceExhausted, "memory_budget");
    // The server still answers.
    let list = c
        .list_sessions(pb::ListSessionsRequest::default())
        .await
        .expect("list");
    assert!(list.into_inner().sessions.is_empty());
}

#[tokio::test]
async fn max_parts_per_message_refuses_one_more_and_keeps_the_session() {
    let server = start_server_with_config(EngineConfig {
        max_parts_per_message: 3,
        ..EngineConfig::default()
    })
    .await;
    let mut c = server.client().await;
    open_session(&mut c, session("p")).await;
    put_message(&mut c, "p", user_msg("u1")).await;
    for i in 0..3 {
        put_part(&mut c, "p", text_part("u1", &format!("t{i}"), "x")).await;
    }
    let before = get_session(&mut c, "p").await;
    let fourth = c
        .upsert_part(pb::UpsertPartRequest {
            session_id: "p".into(),
            part: Some(text_part("u1", "t3", "x")),
        })
        .await;
    assert_status(
        fourth,
        tonic::Code::ResourceExhausted,
        "max_parts_per_message",
    );
    assert_eq!(get_session(&mut c, "p").await, before, "nothing changed");
    // Updating an existing part is still fine, and so is another message.
    put_part(&mut c, "p", text_part("u1", "t0", "edited")).await;
    put_message(&mut c, "p", user_msg("u2")).await;
    put_part(&mut c, "p", text_part("u2", "t9", "y")).await;
}

#[tokio::test]
async fn idle_sessions_are_evicted_with_an_event_and_busy_ones_stay() {
    // A TTL far longer than a stall of a loaded machine between two uses of `busy` 60 ms
    // apart (with 400 ms, one stall could evict it too).
    const TTL: Duration = Duration::from_secs(2);
    let server = start_server_with_options(ServerOptions {
        idle_ttl: Some(TTL),
        ..Default::default()
    })
    .await;
    let mut c = server.client().await;
    let mut watch = c
        .subscribe(pb::SubscribeRequest {
            session_id: String::new(),
        })
        .await
        .expect("subscribe")
        .into_inner();
    open_session(&mut c, session("idle")).await;
    open_session(&mut c, session("busy")).await;
    // Keep `busy` in use until an eviction comes (past the TTL), at most 20 s.
    let evicted = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            tokio::select! {
                e = watch.next() => {
                    let e = e.expect("event").expect("ok");
                    if let Some(pb::session_event::Event::Evicted(ev)) = e.event {
                        break (e.session_id, ev);
                    }
                }
                () = tokio::time::sleep(Duration::from_millis(60)) => {
                    get_context(&mut c, "busy").await;
                }
            }
        }
    })
    .await
    .expect("an eviction event");
    assert_eq!(evicted.0, "idle");
    assert_eq!(evicted.1.reason, "idle");
    assert!(
        u128::from(evicted.1.idle_ms) >= TTL.as_millis(),
        "{:?}",
        evicted.1
    );
    let gone = c
        .get_context(pb::GetContextRequest {
            session_id: "idle".into(),
            ..Default::default()
        })
        .await;
    assert_status(gone, tonic::Code::NotFound, "idle");
    get_context(&mut c, "busy").await;
}

/// A server with the default engine config and `grace`, and its store's ledger (to see
/// what its streams hold in flight).
async fn server_with_grace(grace: Duration) -> (TestServer, Arc<Ledger>) {
    let store = Store::new(chars4_unless_named(EngineConfig::default()));
    let ledger = store.ledger().clone();
    let options = ServerOptions {
        slow_reader_grace: grace,
        ..Default::default()
    };
    (start_server_on(store, options).await, ledger)
}

/// In-flight bytes that show a stream's event buffer filling for a client that reads
/// nothing: ~330 of its 1,024 answers of ~12 KB. Far more than the writer can buffer
/// between two turns of the connection that takes events while HTTP/2's windows are
/// open, and far less than the full buffer.
const BUFFER_FILLING: u64 = 4 << 20;

/// Waits up to 30 s for `ledger`'s in-flight bytes to satisfy `ok`; panics naming `what`
/// otherwise.
async fn in_flight_until(ledger: &Ledger, what: &str, ok: impl Fn(u64) -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !ok(ledger.in_flight()) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{what} within 30 s: {} bytes in flight",
            ledger.in_flight()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Session "slow" with a ~12 KB context (each answer to a context request is that big),
/// and a Stream asking for it `asked` times, none of it read; returns once the answers
/// fill the server's event buffer ([`BUFFER_FILLING`] in flight on `ledger`). Returns the
/// stream's events and the task sending (it blocks once the server stops reading).
async fn contexts_asked_unread(
    c: &mut Client,
    ledger: &Ledger,
    asked: u64,
) -> (
    tonic::Streaming<pb::ServerEvent>,
    tokio::task::JoinHandle<()>,
) {
    open_session(c, session("slow")).await;
    put_message(c, "slow", user_msg("u0")).await;
    put_part(c, "slow", text_part("u0", "big", &output_of("big", 12_000))).await;
    let (tx, rx) = tokio::sync::mpsc::channel::<pb::ClientUpdate>(64);
    let events = c
        .stream(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .expect("stream")
        .into_inner();
    let sender = tokio::spawn(async move {
        for i in 0..asked {
            let update = pb::ClientUpdate {
                seq: i + 1,
                session_id: "slow".into(),
                update: Some(pb::client_update::Update::GetContext(
                    pb::ContextOptions::default(),
                )),
            };
            if tx.send(update).await.is_err() {
                break;
            }
        }
    });
    in_flight_until(ledger, "the unread answers fill the event buffer", |b| {
        b >= BUFFER_FILLING
    })
    .await;
    (events, sender)
}

#[tokio::test]
async fn a_stream_client_that_stops_reading_is_disconnected_and_its_session_kept() {
    // A grace long enough that the buffer is seen filling before it is dropped, on a
    // loaded machine too.
    let (server, ledger) = server_with_grace(Duration::from_secs(3)).await;
    let mut c = server.client().await;
    // Ask for far more than the event buffer and the HTTP/2 windows hold, reading
    // nothing back. The sender blocks once the server stops reading from this stream.
    let (mut events, sender) = contexts_asked_unread(&mut c, &ledger, 5_000).await;

    // Another client is not held up meanwhile.
    let mut other = server.client().await;
    open_session(&mut other, session("other")).await;
    put_message(&mut other, "other", user_msg("x")).await;

    // After the grace the buffered answers are dropped and their bytes given back (the
    // stream ended, nothing more is read from it): only then may the client read, or it
    // would take them all.
    in_flight_until(&ledger, "the unread answers dropped after the grace", |b| {
        b == 0
    })
    .await;

    // Reading now: what HTTP/2 held, then the closing status.
    let (mut acked, mut last_seq) = (0u64, 0u64);
    let status = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match events.next().await {
                Some(Ok(e)) => {
                    acked += 1;
                    last_seq = e.seq;
                }
                Some(Err(status)) => break status,
                None => panic!("the stream ended without a status"),
            }
        }
    })
    .await
    .expect("the stream ends");
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains("not reading"), "{status:?}");
    // It says where the unsent answers start: at the last update some of whose events
    // were delivered, or the one after it.
    let from: u64 = status
        .message()
        .split("Events of seq ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no seq in {status:?}"));
    assert!(
        from == last_seq || from == last_seq + 1,
        "{status:?} after seq {last_seq}"
    );
    // What HTTP/2 held came first; the events still buffered after the grace were
    // dropped (their bytes given back), so far fewer than were asked for arrive.
    assert!(acked >= 1, "what HTTP/2 held came first: {acked}");
    assert!(
        acked < 5_000,
        "the stream ended before every request was answered"
    );
    sender.abort();

    // The session is intact and takes more.
    assert_eq!(get_session(&mut c, "slow").await.messages.len(), 1);
    put_message(&mut c, "slow", user_msg("after")).await;
    assert_eq!(get_session(&mut c, "slow").await.messages.len(), 2);
}

/// An OpenSession whose title is past 1 KiB is refused naming `title`, and creates
/// nothing. Before, a title was unbounded: one 4 MiB title past half the in-flight share
/// made every reply carrying it (the open's, each `ListSessions`) a large one, and a
/// few such sessions made every listing too large to send.
#[tokio::test]
async fn an_open_with_a_title_past_its_limit_is_refused_and_creates_nothing() {
    let store = Store::new(EngineConfig::default()).with_limits(Limits {
        memory_budget: 48 << 20,
        ..Limits::default()
    });
    let ledger = store.ledger().clone();
    let server = start_server_on(store, ServerOptions::default()).await;
    let mut c = server.client().await;
    let titled = |title: String| pb::OpenSessionRequest {
        session: Some(pb::SessionInfo {
            title,
            ..session("titled")
        }),
    };
    let refused = c
        .open_session(titled("t".repeat(4 << 20)))
        .await
        .expect_err("a 4 MiB title");
    assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
    assert!(
        refused.message().starts_with("session.title: "),
        "{refused:?}"
    );
    let listed = c
        .list_sessions(pb::ListSessionsRequest::default())
        .await
        .expect("listed")
        .into_inner();
    assert!(listed.sessions.is_empty(), "{listed:?}");
    let summary = c
        .open_session(titled("t".repeat(1024)))
        .await
        .expect("a title at the limit")
        .into_inner();
    assert_eq!(summary.title.len(), 1024);
    for _ in 0..500 {
        if ledger.in_flight() == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(ledger.in_flight(), 0);
}

/// A huge `--slow-reader-grace-secs` means "never give up on a slow reader". Before, a
/// full event buffer computed `now + grace`, which overflowed: the stream's writer
/// panicked and the client got a clean end (status OK) with answers missing.
#[tokio::test]
async fn a_huge_slow_reader_grace_waits_for_the_client_and_answers_every_update() {
    let (server, ledger) = server_with_grace(Duration::from_secs(u64::MAX)).await;
    let mut c = server.client().await;
    const ASKED: u64 = 2_000;
    // Not reading while the buffer fills towards its 1,024 events.
    let (mut events, sender) = contexts_asked_unread(&mut c, &ledger, ASKED).await;
    let mut answered = 0u64;
    let end = tokio::time::timeout(Duration::from_secs(60), async {
        while let Some(ev) = events.next().await {
            match ev {
                Ok(e) if matches!(e.event, Some(pb::server_event::Event::Context(_))) => {
                    answered += 1
                }
                Ok(_) => {}
                Err(status) => return Some(status),
            }
        }
        None
    })
    .await
    .expect("every answer within 60 s");
    sender.await.expect("sent");
    assert!(end.is_none(), "{end:?}");
    assert_eq!(answered, ASKED);
}

#[tokio::test]
async fn contexts_and_events_in_flight_stay_within_their_share_and_every_seq_is_answered() {
    // An 8 MiB budget: bytes in flight may take 1 MiB; each context is ~200 kB, and the
    // client asks for 200 of them (40 MB) without reading.
    let limits = Limits {
        memory_budget: 8 << 20,
        ..Limits::default()
    };
    let store = Store::new(EngineConfig::default()).with_limits(limits);
    let ledger = store.ledger().clone();
    assert_eq!(ledger.in_flight_limit(), 1 << 20);
    let server = start_server_on(
        store,
        ServerOptions {
            slow_reader_grace: Duration::from_secs(60),
            ..Default::default()
        },
    )
    .await;
    let mut c = server.client().await;
    open_session(&mut c, session("big")).await;
    put_message(&mut c, "big", user_msg("u0")).await;
    put_part(
        &mut c,
        "big",
        text_part("u0", "t", &output_of("big", 200_000)),
    )
    .await;
    let before = get_session(&mut c, "big").await;

    let (tx, rx) = tokio::sync::mpsc::channel::<pb::ClientUpdate>(256);
    let mut events = c
        .stream(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .expect("stream")
        .into_inner();
    for i in 0..200u64 {
        let update = pb::ClientUpdate {
            seq: i + 1,
            session_id: "big".into(),
            update: Some(pb::client_update::Update::GetContext(
                pb::ContextOptions::default(),
            )),
        };
        tx.send(update).await.expect("queued");
    }
    drop(tx);
    // Not reading for a second; the ledger never passes the share meanwhile.
    let mut peak = 0;
    for _ in 0..100 {
        peak = peak.max(ledger.in_flight());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(peak <= 1 << 20, "{peak}");

    // Reading now: each seq gets its context, or a refusal naming the budget, or the
    // stream ends naming the first seq whose events were lost.
    let (mut contexts, mut refused) = (Vec::new(), Vec::new());
    let mut lost = None;
    loop {
        match tokio::time::timeout(Duration::from_secs(30), events.next()).await {
            Ok(Some(Ok(ev))) => match ev.event {
                Some(pb::server_event::Event::Context(_)) => contexts.push(ev.seq),
                Some(pb::server_event::Event::Error(e)) => {
                    assert_eq!(e.code, "RESOURCE_EXHAUSTED", "{e:?}");
                    assert!(e.message.contains("memory_budget"), "{e:?}");
                    refused.push(ev.seq);
                }
                _ => {}
            },
            Ok(Some(Err(status))) => {
                assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
                assert!(status.message().contains("memory_budget"), "{status:?}");
                let seq: u64 = status
                    .message()
                    .split("events of seq ")
                    .nth(1)
                    .and_then(|rest| rest.split_whitespace().next())
                    .and_then(|n| n.parse().ok())
                    .unwrap_or_else(|| panic!("names the first lost seq: {status:?}"));
                lost = Some(seq);
                break;
            }
            Ok(None) => break,
            Err(_) => panic!("no answer within 30 s"),
        }
    }
    let answered = {
        let mut all: Vec<u64> = contexts.iter().chain(&refused).copied().collect();
        all.sort_unstable();
        all
    };
    let last = lost.map_or(200, |l| l - 1);
    assert_eq!(
        answered,
        (1..=last).collect::<Vec<_>>(),
        "every seq before the end"
    );
    // 40 MB were asked for: the share (1 MiB) cannot have held them all at once.
    assert!(!refused.is_empty() || lost.is_some(), "nothing was refused");
    assert!(
        !contexts.is_empty(),
        "some contexts were sent; refused: {refused:?}, lost: {lost:?}"
    );

    // Everything in flight was given back; the session is as it was.
    let mut released = false;
    for _ in 0..500 {
        if ledger.in_flight() == 0 {
            released = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        released,
        "in flight after the stream ended: {}",
        ledger.in_flight()
    );
    assert_eq!(get_session(&mut c, "big").await, before);
}

/// A context larger than the in-flight share is still read back when nothing else is in
/// flight, as GetSession's reply is, over unary and over Stream. Before, every shape was
/// refused for good ("0 bytes are in flight"): the session took updates, and its host
/// could never fetch what to send.
#[tokio::test]
async fn a_context_larger_than_the_in_flight_share_is_sent_alone() {
    let store = Store::new(EngineConfig::default()).with_limits(Limits {
        memory_budget: 8 << 20,
        ..Limits::default()
    });
    let ledger = store.ledger().clone();
    let server = start_server_on(store, ServerOptions::default()).await;
    let mut c = server.client().await;
    open_session(&mut c, session("big")).await;
    put_message(&mut c, "big", user_msg("u0")).await;
    for i in 0..4 {
        let text = output_of("big", 300_000);
        put_part(&mut c, "big", text_part("u0", &format!("t{i}"), &text)).await;
    }
    for format in [
        pb::ContextFormat::Unspecified,
        pb::ContextFormat::Native,
        pb::ContextFormat::OpenaiJson,
    ] {
        let reply = c
            .get_context(pb::GetContextRequest {
                session_id: "big".into(),
                format: format as i32,
            })
            .await
            .unwrap_or_else(|e| panic!("{format:?}: {e:?}"))
            .into_inner();
        assert!(
            prost::Message::encoded_len(&reply) > 1 << 20,
            "{format:?}: past the share"
        );
    }
    let (tx, rx) = tokio::sync::mpsc::channel::<pb::ClientUpdate>(1);
    let mut events = c
        .stream(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .expect("stream")
        .into_inner();
    tx.send(pb::ClientUpdate {
        seq: 1,
        session_id: "big".into(),
        update: Some(pb::client_update::Update::GetContext(
            pb::ContextOptions::default(),
        )),
    })
    .await
    .expect("queued");
    let ev = events.next().await.expect("an event").expect("ok");
    assert!(
        matches!(ev.event, Some(pb::server_event::Event::Context(_))),
        "{:?}",
        ev.event
            .map(|e| format!("{e:?}").chars().take(300).collect::<String>())
    );
    drop(tx);
    while events.next().await.is_some() {}
    for _ in 0..500 {
        if ledger.in_flight() == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(ledger.in_flight(), 0, "given back once sent");
}

#[tokio::test]
async fn a_request_that_would_amplify_when_decoded_is_refused_before_decoding() {
    let server = start_server().await;
    let mut c = server.client().await;
    // 1M empty todos: 2 bytes each on the wire (2 MiB), a whole struct each in memory.
    let mut info = session("amp");
    info.todos = vec![pb::Todo::default(); 1 << 20];
    let refused = c
        .open_session(pb::OpenSessionRequest {
            session: Some(info),
        })
        .await;
    assert_status(refused, tonic::Code::ResourceExhausted, "max_update_bytes");
    // Nothing was created, and the server answers the next request as usual.
    let missing = c
        .get_session(pb::GetSessionRequest {
            session_id: "amp".into(),
        })
        .await;
    assert_status(missing, tonic::Code::NotFound, "amp");
    open_session(&mut c, session("after")).await;
}

/// A server with `budget` as its memory budget, and the example export with a 90 kB
/// text in its first part.
async fn budget_and_document(budget: u64) -> (TestServer, serde_json::Value) {
    let limits = Limits {
        memory_budget: budget,
        ..Limits::default()
    };
    let server = start_server_with_limits(limits).await;
    let mut doc: serde_json::Value =
        serde_json::from_str(&example_import("x").export_json).expect("example");
    doc["messages"][0]["parts"][0]["text"] = serde_json::json!("word ".repeat(18_000));
    (server, doc)
}

/// Opens session "a" and adds 10 kB parts to it while it holds under `target` less one
/// part; returns what it holds.
async fn fill_a(c: &mut Client, target: u64) -> u64 {
    open_session(c, session("a")).await;
    put_message(c, "a", user_msg("ua")).await;
    let mut i = 0;
    loop {
        let a = held(&get_session(c, "a").await);
        if a + 12_000 > target {
            return a;
        }
        i += 1;
        put_part(
            c,
            "a",
            text_part("ua", &format!("a-t{i}"), &output_of("f", 10_000)),
        )
        .await;
    }
}

/// An import's document is reserved in flight while it is read, and becomes the session:
/// once read, it is not counted again beside the session it became. Before, it was: an
/// import that fits the budget (the session ~H, the rest held by another session) was
/// refused while its document (~90 kB) was still counted.
#[tokio::test]
async fn an_imported_document_is_not_counted_beside_the_session_it_became() {
    const BUDGET: u64 = 1 << 20;
    let (server, doc) = budget_and_document(BUDGET).await;
    let mut c = server.client().await;
    let import = |id: &str| pb::ImportSessionRequest {
        export_json: doc.to_string(),
        session_id: id.into(),
        ..Default::default()
    };
    let d = import("i").export_json.len() as u64;
    // The session the document becomes, measured alone (under an id as long as "i": the
    // id is part of what the session holds).
    let h = c
        .import_session(import("p"))
        .await
        .expect("fits alone")
        .into_inner()
        .held_bytes;
    c.delete_session(pb::DeleteSessionRequest {
        session_id: "p".into(),
    })
    .await
    .expect("delete");
    // Another session holds the rest but for half the document: A + H fits, A + H + D
    // does not.
    let a = fill_a(&mut c, BUDGET - h - d / 2).await;
    assert!(a + h + d > BUDGET && a + h <= BUDGET, "a {a} h {h} d {d}");
    // The deleted probe's bytes are given back when its actor's last job is done.
    let mut imported = Err(tonic::Status::unknown("not tried"));
    for _ in 0..100 {
        imported = c.import_session(import("i")).await;
        if imported.is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let summary = imported.expect("the import fits the budget").into_inner();
    assert_eq!(summary.held_bytes, h);
}

/// A session reloaded with `replace` gives back what the replaced session held: it
/// reloads into a budget that holds it once. Before, the import's limit counted the
/// replaced session beside the one replacing it and refused naming `memory_budget`, so a
/// host that reloads on every start (the OpenCode plugin) could not reload a session once
/// the others had taken the rest of the budget.
#[tokio::test]
async fn a_replacing_import_may_use_what_the_replaced_session_holds() {
    const BUDGET: u64 = 1 << 20;
    let (server, doc) = budget_and_document(BUDGET).await;
    let mut c = server.client().await;
    let import = |replace: bool| pb::ImportSessionRequest {
        export_json: doc.to_string(),
        session_id: "i".into(),
        replace,
        ..Default::default()
    };
    let h = c
        .import_session(import(false))
        .await
        .expect("fits")
        .into_inner()
        .held_bytes;
    // Another session takes the rest but for half of it: the reload fits only in what
    // the replaced session gives back.
    let a = fill_a(&mut c, BUDGET - h - h / 2).await;
    assert!(a + 2 * h > BUDGET && a + h <= BUDGET, "a {a} h {h}");
    let again = c
        .import_session(import(true))
        .await
        .expect("the reload fits in what the session gives back")
        .into_inner();
    assert_eq!(again.held_bytes, h);
}

/// An OpenSession that creates its session is answered with its outcome, though the
/// in-flight share has no room left for the summary it replies with. Before, the open was
/// applied and then refused RESOURCE_EXHAUSTED (the summary held with `reserve_or_alone`
/// while something else was in flight): the session existed, its retry answered
/// `created: false`, and a host that pushes history only on `created` skipped it.
#[tokio::test]
async fn an_applied_open_is_answered_though_the_share_has_no_room_for_its_summary() {
    use prost::Message;
    let store = Store::new(EngineConfig::default()).with_limits(Limits {
        memory_budget: 1 << 20,
        ..Limits::default()
    });
    let ledger = store.ledger().clone();
    let server = start_server_on(store, ServerOptions::default()).await;
    let mut c = server.client().await;
    let request = |id: &str| pb::OpenSessionRequest {
        session: Some(session(id)),
    };
    // The reply to an open like the one below, measured on another id of the same length.
    let probe = c
        .open_session(request("probe"))
        .await
        .expect("opened")
        .into_inner();
    assert!(probe.created);
    let reply = probe.encoded_len() as u64;
    let asked = request("fresh").encoded_len() as u64;
    assert!(reply > asked, "reply {reply} asked {asked}");
    for _ in 0..500 {
        if ledger.in_flight() == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(ledger.in_flight(), 0);
    // Something else in flight leaves room for the request, not for its reply.
    let other = ledger
        .reserve(ledger.in_flight_limit() - asked, "test")
        .expect("room");
    let opened = c.open_session(request("fresh")).await;
    let summary = opened.expect("the open was applied: answered").into_inner();
    assert!(summary.created);
    assert_eq!(summary.id, "fresh");
    drop(other);
    // Opened once: the next open finds it.
    let again = c
        .open_session(request("fresh"))
        .await
        .expect("opened")
        .into_inner();
    assert!(!again.created);
}

/// GetSession reserves before it builds its copy, at what the session holds: a session
/// whose JSON expands (4 × 50,000 numbers: about 2.2 MiB encoded, several times that as
/// the reply's `Value`s while it is built) is refused past the share while something
/// else is in flight, and answered alone. Before, every reader built its whole copy first,
/// uncounted, and only the encoded size was checked: N readers of N such sessions held
/// N copies past the budget.
#[tokio::test]
async fn get_session_reserves_what_it_builds_before_building_it() {
    let store = Store::new(EngineConfig::default()).with_limits(Limits {
        memory_budget: 32 << 20,
        ..Limits::default()
    });
    let ledger = store.ledger().clone();
    let server = start_server_on(store, ServerOptions::default()).await;
    let mut c = server.client().await;
    open_session(&mut c, session("wide")).await;
    put_message(&mut c, "wide", user_msg("u0")).await;
    let numbers = prost_types::ListValue {
        values: (0..50_000)
            .map(|i| prost_types::Value {
                kind: Some(prost_types::value::Kind::NumberValue(f64::from(i))),
            })
            .collect(),
    };
    let mut part = tool_part("u0", "k1", "read", "done");
    if let Some(pb::part::Kind::Tool(t)) = &mut part.kind
        && let Some(state) = &mut t.state
        && let Some(input) = &mut state.input
    {
        input.fields.insert(
            "numbers".into(),
            prost_types::Value {
                kind: Some(prost_types::value::Kind::ListValue(numbers)),
            },
        );
    }
    for k in ["k1", "k2", "k3", "k4"] {
        let mut part = part.clone();
        part.id = k.into();
        if let Some(pb::part::Kind::Tool(t)) = &mut part.kind {
            t.call_id = format!("call_{k}");
        }
        put_part(&mut c, "wide", part).await;
    }
    let ask = || pb::GetSessionRequest {
        session_id: "wide".into(),
    };

    let elsewhere = ledger.reserve(1, "elsewhere").expect("room for a byte");
    // Matched, not `expect_err`: a reply would print 200,000 numbers.
    let Err(refused) = c.get_session(ask()).await else {
        panic!("answered past the share, though something else is in flight");
    };
    assert_eq!(
        refused.code(),
        tonic::Code::ResourceExhausted,
        "{refused:?}"
    );
    assert!(refused.message().contains("sessions"), "{refused:?}");
    drop(elsewhere);

    let alone = c
        .get_session(ask())
        .await
        .expect("answered alone")
        .into_inner();
    let (encoded, held) = (
        prost::Message::encoded_len(&alone),
        alone.summary.as_ref().map_or(0, |s| s.held_bytes),
    );
    // The reply fits the share (4 MiB) encoded; what the session holds does not.
    assert!(encoded < 4 << 20 && held > 4 << 20, "{encoded} {held}");
    for _ in 0..500 {
        if ledger.in_flight() == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(ledger.in_flight(), 0, "given back once sent");
}
