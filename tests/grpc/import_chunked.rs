//! `ImportSessionChunked`: a document past `max_update_bytes`, which ImportSession must
//! refuse, imports in chunks exactly as ImportSession imports it; a malformed call is
//! refused naming the field and leaves the session it would replace as it was.

use compactd::server::ServerOptions;
use compactd::server::pb;
use compactd::store::Ledger;
use compactd::store::Limits;
use std::sync::Arc;
use std::time::Duration;
use tonic::Code;

use crate::common::*;

const TRACE: &str = "claudecode-subagent-6633a783";
const SMALL_CAP: usize = 64 << 10;

fn trace_json() -> String {
    let path = trace_files()
        .into_iter()
        .find(|p| p.file_stem().is_some_and(|s| s == TRACE))
        .expect("the shared trace");
    std::fs::read_to_string(path).expect("trace readable")
}

fn request(session_id: &str) -> pb::ImportSessionRequest {
    pb::ImportSessionRequest {
        session_id: session_id.into(),
        limits: Some(limits(200_000, 32_000)),
        replace: true,
        ..Default::default()
    }
}

/// `json` cut every `size` bytes, and once inside its first multi-byte character: chunks
/// are bytes, split anywhere.
fn pieces(json: &str, size: usize) -> Vec<Vec<u8>> {
    let bytes = json.as_bytes();
    let inside = bytes
        .iter()
        .position(|b| *b >= 0x80)
        .expect("the trace holds a non-ASCII character")
        + 1;
    let mut cuts: Vec<usize> = (size..bytes.len()).step_by(size).collect();
    cuts.push(inside);
    cuts.sort_unstable();
    cuts.dedup();
    let mut out = Vec::new();
    let mut from = 0;
    for cut in cuts.into_iter().chain([bytes.len()]) {
        out.push(bytes[from..cut].to_vec());
        from = cut;
    }
    out
}

/// The chunks of an import: the request rides on the first.
fn chunks(req: pb::ImportSessionRequest, pieces: Vec<Vec<u8>>) -> Vec<pb::ImportSessionChunk> {
    let mut req = Some(req);
    pieces
        .into_iter()
        .map(|p| pb::ImportSessionChunk {
            request: req.take(),
            export_json: p,
        })
        .collect()
}

async fn context(c: &mut Client, id: &str) -> pb::Context {
    c.get_context(pb::GetContextRequest {
        session_id: id.into(),
        format: pb::ContextFormat::Native as i32,
    })
    .await
    .expect("context")
    .into_inner()
}

#[tokio::test]
async fn a_document_past_max_update_bytes_imports_in_chunks_as_importsession_imports_it() {
    let json = trace_json();
    assert!(
        json.len() > 4 * SMALL_CAP,
        "the trace must be well past the cap"
    );
    let small = start_server_with_options(ServerOptions {
        max_update_bytes: SMALL_CAP,
        ..ServerOptions::default()
    })
    .await;
    let mut c = small.client().await;
    let whole = pb::ImportSessionRequest {
        export_json: json.clone(),
        ..request("s")
    };
    assert_status(
        c.import_session(whole.clone()).await,
        Code::ResourceExhausted,
        "max_update_bytes",
    );

    let parts = pieces(&json, SMALL_CAP / 2);
    assert!(parts.len() > 8);
    let summary = c
        .import_session_chunked(tokio_stream::iter(chunks(request("s"), parts)))
        .await
        .expect("a chunked import of the whole trace")
        .into_inner();

    // The reference: the same document through ImportSession, on a server that takes it.
    let large = start_server().await;
    let mut r = large.client().await;
    let reference = r
        .import_session(whole)
        .await
        .expect("unary import")
        .into_inner();
    assert_eq!(summary, reference);
    assert!(summary.messages > 10, "{summary:?}");
    assert_eq!(context(&mut c, "s").await, context(&mut r, "s").await);
}

#[tokio::test]
async fn a_malformed_chunked_import_names_its_field_and_leaves_the_session_as_it_was() {
    let server = start_server().await;
    let mut c = server.client().await;
    c.import_session(example_import("s")).await.expect("import");
    let before = context(&mut c, "s").await;
    let doc = example_import("s").export_json.into_bytes();
    let half = doc.len() / 2;
    let two = vec![doc[..half].to_vec(), doc[half..].to_vec()];

    let mut no_request = chunks(request("s"), two.clone());
    no_request[0].request = None;
    let mut twice = chunks(request("s"), two.clone());
    twice[1].request = Some(request("s"));
    let inline = chunks(
        pb::ImportSessionRequest {
            export_json: "{}".into(),
            ..request("s")
        },
        two.clone(),
    );
    let mut not_utf8 = two.clone();
    not_utf8[1].insert(0, 0xff);
    let cases: Vec<(&str, Vec<pb::ImportSessionChunk>, Code, &str)> = vec![
        ("no request", no_request, Code::InvalidArgument, "request"),
        (
            "two requests",
            twice,
            Code::InvalidArgument,
            "only the first chunk",
        ),
        (
            "document in the request",
            inline,
            Code::InvalidArgument,
            "request.export_json",
        ),
        ("no chunk", Vec::new(), Code::InvalidArgument, "request"),
        (
            "no document",
            chunks(request("s"), vec![Vec::new()]),
            Code::InvalidArgument,
            "export_json",
        ),
        (
            "not UTF-8",
            chunks(request("s"), not_utf8),
            Code::InvalidArgument,
            "not UTF-8",
        ),
        (
            "not an export",
            chunks(request("s"), vec![b"{\"info\": 3}".to_vec()]),
            Code::InvalidArgument,
            "export_json",
        ),
    ];
    for (what, call, code, needle) in cases {
        let status = assert_status(
            c.import_session_chunked(tokio_stream::iter(call)).await,
            code,
            needle,
        );
        assert_eq!(context(&mut c, "s").await, before, "{what}: {status:?}");
    }
}

/// A server whose in-flight share is 512 KiB (a budget of 4 MiB): one import may send at
/// most 256 KiB (a request at most 64 KiB, so the share binds); and a slow-reader grace
/// of `grace`.
async fn tight(grace: Duration) -> TestServer {
    tight_with_ledger(grace).await.0
}

/// [`tight`], and its store's ledger (to see what the imports hold in flight).
async fn tight_with_ledger(grace: Duration) -> (TestServer, Arc<Ledger>) {
    let limits = Limits {
        memory_budget: 4 << 20,
        ..Limits::default()
    };
    serve_with_ledger(limits, SMALL_CAP, grace).await
}

/// A server whose store holds to `limits`, taking requests up to `max_update_bytes`, with
/// a slow-reader grace of `grace`.
async fn serve(limits: Limits, max_update_bytes: usize, grace: Duration) -> TestServer {
    serve_with_ledger(limits, max_update_bytes, grace).await.0
}

/// [`serve`], and its store's ledger.
async fn serve_with_ledger(
    limits: Limits,
    max_update_bytes: usize,
    grace: Duration,
) -> (TestServer, Arc<Ledger>) {
    let store =
        compactd::store::Store::new(chars4_unless_named(Default::default())).with_limits(limits);
    let ledger = store.ledger().clone();
    let options = ServerOptions {
        slow_reader_grace: grace,
        max_update_bytes,
        ..ServerOptions::default()
    };
    (start_server_on(store, options).await, ledger)
}

/// `doc` in pieces of 32 KiB, under the tight server's request cap.
fn cut(doc: Vec<u8>) -> Vec<Vec<u8>> {
    doc.chunks(32 << 10).map(<[u8]>::to_vec).collect()
}

/// `bytes` of the example export (spaces after it: still one JSON document).
fn padded(id: &str, bytes: usize) -> Vec<u8> {
    let mut doc = example_import(id).export_json.into_bytes();
    doc.resize(bytes, b' ');
    doc
}

/// A chunked import of `first` that then sends nothing, left running.
fn paused(c: &Client, id: &str, first: Vec<u8>) -> tokio::task::JoinHandle<tonic::Status> {
    let mut c = c.clone();
    let stream = tokio_stream::StreamExt::chain(
        tokio_stream::iter(chunks(request(id), cut(first))),
        futures::stream::pending::<pb::ImportSessionChunk>(),
    );
    tokio::spawn(async move {
        c.import_session_chunked(stream)
            .await
            .expect_err("a paused import ends refused")
    })
}

#[tokio::test]
async fn one_import_may_send_half_the_in_flight_share_and_several_no_more_than_all_of_it() {
    let (server, ledger) = tight_with_ledger(Duration::from_secs(5)).await;
    let mut c = server.client().await;
    let call = chunks(request("s"), vec![vec![b' '; 32 << 10]; 10]);
    let status = assert_status(
        c.import_session_chunked(tokio_stream::iter(call)).await,
        Code::ResourceExhausted,
        "over the 262144 bytes one import may send (half the in-flight share of memory_budget",
    );
    assert!(status.message().starts_with("export_json"), "{status:?}");
    // Two imports of 200 KiB hold 400 KiB while they pause: a third finds no room. Each
    // holds at least what it received and only grows until it is refused for its pause,
    // so once 400 KiB are held the 112 KiB left of the 512 KiB share cannot take a third.
    let a = paused(&c, "a", padded("a", 200 << 10));
    let b = paused(&c, "b", padded("b", 200 << 10));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while ledger.in_flight() < 400 << 10 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the two paused imports hold 400 KiB within 20 s: {}",
            ledger.in_flight()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let third = c
        .import_session_chunked(tokio_stream::iter(chunks(
            request("c"),
            cut(padded("c", 200 << 10)),
        )))
        .await;
    assert_status(third, Code::ResourceExhausted, "an imported document");
    // Once they are refused for their pause, what they held is given back.
    for paused in [a, b] {
        let status = paused.await.expect("joined");
        assert!(
            status.message().contains("no chunk of the import"),
            "{status:?}"
        );
    }
    let summary = c
        .import_session_chunked(tokio_stream::iter(chunks(
            request("c"),
            cut(padded("c", 200 << 10)),
        )))
        .await
        .expect("room again")
        .into_inner();
    assert_eq!(summary.id, "c");
}

#[tokio::test]
async fn a_chunked_import_that_pauses_past_the_grace_is_refused_and_given_back() {
    // A grace far longer than a stall of a loaded machine between two chunks sent at once
    // (with 300 ms, the import below that must go through could be refused for one).
    let server = tight(Duration::from_secs(2)).await;
    let mut c = server.client().await;
    let began = std::time::Instant::now();
    let status = paused(&c, "s", padded("s", 250 << 10))
        .await
        .expect("joined");
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(
        status
            .message()
            .contains("no chunk of the import for 2000 ms"),
        "{status:?}"
    );
    // Ended by the grace, not left waiting for the client.
    assert!(began.elapsed() < Duration::from_secs(30), "{status:?}");
    let summary = c
        .import_session_chunked(tokio_stream::iter(chunks(
            request("t"),
            cut(padded("t", 250 << 10)),
        )))
        .await
        .expect("the paused import's bytes were given back")
        .into_inner();
    assert_eq!(summary.id, "t");
}

#[tokio::test]
async fn a_chunked_import_that_trickles_is_refused() {
    // A chunk every 200 ms, far under the rate; the grace (3 s) is far longer than a gap
    // between two chunks, even on a loaded machine, so the rate rule is what refuses it
    // (3 s of grace, then ~1 s more at 100 bytes a chunk: about chunk 20 of 41), not the
    // pause rule.
    let server = tight(Duration::from_secs(3)).await;
    let mut c = server.client().await;
    let doc = padded("s", 4 << 10);
    let pieces: Vec<Vec<u8>> = doc.chunks(100).map(<[u8]>::to_vec).collect();
    let slow = tokio_stream::StreamExt::throttle(
        tokio_stream::iter(chunks(request("s"), pieces)),
        Duration::from_millis(200),
    );
    assert_status(
        c.import_session_chunked(slow).await,
        Code::ResourceExhausted,
        "bytes per second",
    );
}

#[tokio::test]
async fn a_chunked_import_is_checked_at_its_first_chunk_and_refuses_empty_ones() {
    let server = tight(Duration::from_secs(2)).await;
    let mut c = server.client().await;
    let bad = pb::ImportSessionRequest {
        config: Some(pb::SessionConfig {
            threshold: Some(7.0),
            ..Default::default()
        }),
        ..request("s")
    };
    // Refused at once: the rest of the call never comes.
    let first_only = tokio_stream::StreamExt::chain(
        tokio_stream::iter(chunks(bad, vec![b"{".to_vec()])),
        futures::stream::pending::<pb::ImportSessionChunk>(),
    );
    let status = assert_status(
        c.import_session_chunked(first_only).await,
        Code::InvalidArgument,
        "threshold",
    );
    assert!(
        status.message().starts_with("request.config.threshold"),
        "{status:?}"
    );
    let object = pb::ImportSessionRequest {
        export: Some(Default::default()),
        ..request("s")
    };
    assert_status(
        c.import_session_chunked(tokio_stream::iter(chunks(object, vec![b"{}".to_vec()])))
            .await,
        Code::InvalidArgument,
        "request.export:",
    );
    let doc = padded("s", 2 << 10);
    let empty = chunks(request("s"), vec![doc.clone(), Vec::new(), doc]);
    assert_status(
        c.import_session_chunked(tokio_stream::iter(empty)).await,
        Code::InvalidArgument,
        "chunk 1 is empty",
    );
}

#[tokio::test]
async fn without_a_budget_a_document_is_bounded_by_the_session_limit() {
    let limits = Limits {
        max_session_bytes: 64 << 10,
        ..Limits::default()
    };
    let server = serve(limits, SMALL_CAP, Duration::from_secs(10)).await;
    let mut c = server.client().await;
    let call = chunks(request("s"), vec![vec![b' '; 32 << 10]; 16]);
    assert_status(
        c.import_session_chunked(tokio_stream::iter(call)).await,
        Code::ResourceExhausted,
        "(6 times max_session_bytes (65536 bytes))",
    );
}

#[tokio::test]
async fn a_chunked_import_may_leave_the_session_id_to_the_document() {
    let server = start_server().await;
    let mut c = server.client().await;
    let doc = example_import("ignored").export_json;
    let id = serde_json::from_str::<serde_json::Value>(&doc).expect("json")["info"]["id"]
        .as_str()
        .expect("the example has an id")
        .to_string();
    let summary = c
        .import_session_chunked(tokio_stream::iter(chunks(
            request(""),
            vec![doc.into_bytes()],
        )))
        .await
        .expect("the document's own id")
        .into_inner();
    assert_eq!(summary.id, id);
}

#[tokio::test]
async fn a_chunked_import_may_always_send_what_one_importsession_may() {
    // Half the in-flight share is 1 MiB here, under the 1.5 MiB one request may carry: a
    // document ImportSession would take is not refused in chunks, and one past both is
    // refused naming the request's limit.
    const CAP: usize = 3 << 19;
    let limits = Limits {
        memory_budget: 16 << 20,
        ..Limits::default()
    };
    let server = serve(limits, CAP, Duration::from_secs(10)).await;
    let mut c = server.client().await;
    let pieces = |doc: Vec<u8>| doc.chunks(400 << 10).map(<[u8]>::to_vec).collect();
    let summary = c
        .import_session_chunked(tokio_stream::iter(chunks(
            request("s"),
            pieces(padded("s", 1200 << 10)),
        )))
        .await
        .expect("within what one ImportSession may carry")
        .into_inner();
    assert_eq!(summary.id, "s");
    let status = assert_status(
        c.import_session_chunked(tokio_stream::iter(chunks(
            request("t"),
            pieces(padded("t", 1800 << 10)),
        )))
        .await,
        Code::ResourceExhausted,
        "over the 1572864 bytes one import may send (max_update_bytes: what one ImportSession may carry)",
    );
    assert!(status.message().starts_with("export_json"), "{status:?}");
}

#[tokio::test]
async fn a_collected_document_is_counted_by_its_length_not_by_the_buffer_it_grew_in() {
    // A budget of 32 MiB: an in-flight share of 4 MiB, of which one import may send 2 MiB.
    // A document of 1,781,075 bytes sent in 200 KiB chunks grows its buffer to 2 MiB;
    // counted by that capacity its parse needs 4 MiB, which the 200 KiB another import
    // holds leaves no room for. Counted by its length it needs 3,562,150 bytes: room.
    const CHUNK: usize = 200 << 10;
    const DOCUMENT: usize = 1_781_075;
    let limits = Limits {
        memory_budget: 32 << 20,
        ..Limits::default()
    };
    let (server, ledger) = serve_with_ledger(limits, 256 << 10, Duration::from_secs(30)).await;
    let mut c = server.client().await;
    let holder = {
        let mut c = c.clone();
        let stream = tokio_stream::StreamExt::chain(
            tokio_stream::iter(chunks(request("h"), vec![padded("h", CHUNK)])),
            futures::stream::pending::<pb::ImportSessionChunk>(),
        );
        tokio::spawn(async move { c.import_session_chunked(stream).await })
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while ledger.in_flight() < CHUNK as u64 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the paused import holds its chunk within 20 s: {}",
            ledger.in_flight()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        ledger.in_flight(),
        CHUNK as u64,
        "the paused import's chunk"
    );
    let pieces: Vec<Vec<u8>> = padded("s", DOCUMENT)
        .chunks(CHUNK)
        .map(<[u8]>::to_vec)
        .collect();
    let summary = c
        .import_session_chunked(tokio_stream::iter(chunks(request("s"), pieces)))
        .await
        .expect("twice the document's length fits beside the paused import")
        .into_inner();
    assert_eq!(summary.id, "s");
    assert_eq!(
        ledger.in_flight(),
        CHUNK as u64,
        "all but the paused chunk given back"
    );
    holder.abort();
}
