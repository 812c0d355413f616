//! `ImportSessionChunked`: a document past `max_update_bytes`, which ImportSession must
//! refuse, imports in chunks exactly as ImportSession imports it; a malformed call is
//! refused naming the field and leaves the session it would replace as it was.

use compactd::server::ServerOptions;
use compactd::server::pb;
use compactd::store::Limits;
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

#[tokio::test]
async fn a_chunked_document_past_the_in_flight_share_is_refused_and_given_back() {
    // In flight may hold an eighth of the budget: 512 KiB here.
    let budget: u64 = 4 << 20;
    let server = start_server_with_limits(Limits {
        memory_budget: budget,
        ..Limits::default()
    })
    .await;
    let mut c = server.client().await;
    let big = vec![b' '; 64 << 10];
    let call = chunks(request("s"), vec![big; 16]);
    let status = assert_status(
        c.import_session_chunked(tokio_stream::iter(call)).await,
        Code::ResourceExhausted,
        "an imported document",
    );
    assert!(status.message().contains("in flight"), "{status:?}");
    // Nothing stays reserved: a document that fits imports right after.
    let doc = example_import("t").export_json.into_bytes();
    let summary = c
        .import_session_chunked(tokio_stream::iter(chunks(request("t"), vec![doc])))
        .await
        .expect("a document within the share")
        .into_inner();
    assert_eq!(summary.id, "t");
}

#[tokio::test]
async fn a_chunked_import_that_pauses_past_the_grace_is_refused_and_given_back() {
    // In flight may hold 512 KiB; a paused import holding 300 KiB would leave no room
    // for another of that size.
    let store =
        compactd::store::Store::new(chars4_unless_named(Default::default())).with_limits(Limits {
            memory_budget: 4 << 20,
            ..Limits::default()
        });
    let server = start_server_on(
        store,
        ServerOptions {
            slow_reader_grace: std::time::Duration::from_millis(300),
            ..ServerOptions::default()
        },
    )
    .await;
    let mut c = server.client().await;
    let piece = vec![b' '; 300 << 10];
    let first = chunks(request("s"), vec![piece.clone()]);
    let paused = tokio_stream::StreamExt::chain(
        tokio_stream::iter(first),
        futures::stream::pending::<pb::ImportSessionChunk>(),
    );
    let began = std::time::Instant::now();
    let status = assert_status(
        c.import_session_chunked(paused).await,
        Code::ResourceExhausted,
        "no chunk of the import for 300 ms",
    );
    assert!(
        began.elapsed() < std::time::Duration::from_secs(10),
        "{status:?}"
    );
    let mut doc = example_import("t").export_json.into_bytes();
    doc.extend_from_slice(&piece);
    let summary = c
        .import_session_chunked(tokio_stream::iter(chunks(request("t"), vec![doc])))
        .await
        .expect("the paused import's bytes were given back")
        .into_inner();
    assert_eq!(summary.id, "t");
}
