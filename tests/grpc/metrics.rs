//! `/metrics` of the real binary (its own process, so every counter starts at zero):
//! scraped over HTTP before and after updates, a strategy run, an overflow, a rejected
//! request and a compaction.

use compactd::server::pb;
use tokio_stream::StreamExt;

use crate::common::binary::Binary;
use crate::common::fake_llm::{FakeLlm, Reply};
use crate::common::metrics::{metric, scrape};
use crate::common::*;

const SID: &str = "m";

fn call(message: &str, id: &str, tool: &str, input: serde_json::Value) -> pb::Part {
    let mut p = tool_part(message, id, tool, &output_of(id, 8_000));
    if let Some(pb::part::Kind::Tool(t)) = &mut p.kind {
        t.state.as_mut().expect("state").input = Some(json_to_struct(&input));
    }
    p
}

#[tokio::test]
async fn counters_move_as_updates_prunes_overflows_rejections_and_compactions_happen() {
    let fake = FakeLlm::start(vec![Reply::text(["short summary"])]).await;
    let mut bin = Binary::start(
        &[
            "--metrics-listen",
            "127.0.0.1:0",
            "--cache-model",
            "none",
            "--strategy-preset",
            "compact",
            // The figures below are reasoned in chars ÷ 4.
            "--tokenizer",
            "chars4",
        ],
        &[
            ("COMPACTD_LLM_BASE_URL", &fake.base_url()),
            ("COMPACTD_LLM_MODEL", "fake-model"),
        ],
    );
    let (grpc, metrics) = (
        bin.addr.clone(),
        bin.metrics.clone().expect("metrics address"),
    );
    let before = scrape(&metrics).await;
    assert_eq!(metric(&before, "compactd_sessions"), 0.0);
    assert_eq!(metric(&before, "compactd_bytes_held"), 0.0, "{before}");

    let mut c = pb::sessions_client::SessionsClient::connect(format!("http://{grpc}"))
        .await
        .expect("connect");
    open_session(&mut c, session_with_limits(SID, 100_000, 20_000)).await;
    // Opened again: a reconfiguration, counted as an `open` update.
    open_session(&mut c, session_with_limits(SID, 100_000, 20_000)).await;
    let file = serde_json::json!({"filePath": "src/lib.rs"});
    for (u, a) in [("u1", "a1"), ("u2", "a2"), ("u3", "a3")] {
        put_message(&mut c, SID, user_msg(u)).await;
        put_part(&mut c, SID, text_part(u, &format!("{u}-t"), "again")).await;
        put_message(&mut c, SID, assistant_msg(a, u)).await;
        put_part(
            &mut c,
            SID,
            call(a, &format!("{a}-r"), "read", file.clone()),
        )
        .await;
        put_message(&mut c, SID, finished(assistant_msg(a, u))).await;
    }
    // Usage over the threshold (0.92 × 80,000): one overflow detection.
    let mut last = finished(assistant_msg("a3", "u3"));
    last.tokens = Some(usage(75_000));
    put_message(&mut c, SID, last).await;
    // An update the engine refuses: a part of a message the session never got.
    let orphan = c
        .upsert_part(pb::UpsertPartRequest {
            session_id: SID.into(),
            part: Some(text_part("ghost", "ghost-t", "no message")),
        })
        .await
        .expect_err("a part of an unknown message");
    assert_eq!(orphan.code(), tonic::Code::FailedPrecondition, "{orphan:?}");
    // A rejected request.
    let missing = c
        .get_context(pb::GetContextRequest {
            session_id: "nope".into(),
            ..Default::default()
        })
        .await
        .expect_err("no such session");
    assert_eq!(missing.code(), tonic::Code::NotFound);
    // A manual compaction.
    let mut stream = c
        .compact(pb::CompactRequest {
            session_id: SID.into(),
            options: None,
        })
        .await
        .expect("compact")
        .into_inner();
    while stream.next().await.is_some() {}
    // The context, which the session then keeps rendered.
    c.get_context(pb::GetContextRequest {
        session_id: SID.into(),
        format: pb::ContextFormat::OpenaiJson.into(),
    })
    .await
    .expect("context");

    let after = scrape(&metrics).await;
    assert_eq!(metric(&after, "compactd_sessions"), 1.0, "{after}");
    // Three 8 kB outputs and the rest of the session are held; the budget is the
    // default 2 GiB.
    let held = metric(&after, "compactd_bytes_held");
    assert!((24_000.0..1_000_000.0).contains(&held), "{after}");
    assert_eq!(
        metric(&after, "compactd_memory_budget_bytes"),
        2_147_483_648.0,
        "{after}"
    );
    // Of what is held, the rendered context: about the context's text.
    let cached = metric(&after, "compactd_bytes_cached");
    assert!(cached > 8_000.0 && cached < held, "{after}");
    // Every update was answered: nothing is left in flight. (The last reply's bytes are
    // given back when the server drops its body, which may come just after the client
    // read the reply's end.)
    let mut in_flight = metric(&after, "compactd_bytes_in_flight");
    for _ in 0..100 {
        if in_flight == 0.0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        in_flight = metric(&scrape(&metrics).await, "compactd_bytes_in_flight");
    }
    assert_eq!(in_flight, 0.0, "{after}");
    assert_eq!(
        metric(
            &after,
            "compactd_updates_total{kind=\"upsert_message\",result=\"ok\"}"
        ),
        10.0,
        "{after}"
    );
    // Refused updates are counted apart (the refused part is timed too).
    assert_eq!(
        metric(
            &after,
            "compactd_updates_total{kind=\"upsert_part\",result=\"rejected\"}"
        ),
        1.0,
        "{after}"
    );
    assert_eq!(
        metric(
            &after,
            "compactd_update_duration_seconds_count{kind=\"upsert_part\"}"
        ),
        7.0,
        "{after}"
    );
    assert_eq!(
        metric(
            &after,
            "compactd_updates_total{kind=\"open\",result=\"ok\"}"
        ),
        1.0,
        "{after}"
    );
    // The store's timings are histograms as the README lists them (buckets, not a
    // summary's quantiles, which cannot be summed across replicas).
    for name in [
        "compactd_store_commit_seconds",
        "compactd_update_duration_seconds",
    ] {
        assert!(
            after.contains(&format!("{name}_bucket{{")),
            "{name}: {after}"
        );
        assert!(
            !after.contains(&format!("{name}{{quantile=")),
            "{name}: {after}"
        );
    }
    assert_eq!(
        metric(
            &after,
            "compactd_overflow_detections_total{crossed=\"used\"}"
        ),
        1.0,
        "{after}"
    );
    // The reads of one file: each newer read supersedes the older.
    assert_eq!(
        metric(&after, "compactd_prune_runs_total{trigger=\"auto\"}"),
        2.0,
        "{after}"
    );
    assert!(
        metric(
            &after,
            "compactd_tokens_saved_total{layer=\"aggressiveFilePrune\"}"
        ) > 3_000.0,
        "{after}"
    );
    assert_eq!(
        metric(
            &after,
            "compactd_rejected_requests_total{code=\"NOT_FOUND\"}"
        ),
        1.0,
        "{after}"
    );
    assert_eq!(
        metric(
            &after,
            "compactd_compactions_total{outcome=\"compacted\",auto=\"false\"}"
        ),
        1.0,
        "{after}"
    );
    assert_eq!(
        metric(
            &after,
            "compactd_compaction_duration_seconds_count{outcome=\"compacted\"}"
        ),
        1.0,
        "{after}"
    );
    assert!(
        metric(
            &after,
            "compactd_compaction_llm_tokens_total{direction=\"input\"}"
        ) > 0.0,
        "{after}"
    );
    assert!(after.contains("# HELP compactd_updates_total"));

    bin.sigterm();
    assert!(bin.wait_exit().await.success());
}

/// A `Subscribe` watcher whose client hangs up ends at once, even when no event of its
/// session ever comes: before, its task and its place on the event bus stayed until one
/// did, so a client subscribing to a quiet session and hanging up in a loop grew both
/// without bound.
#[tokio::test]
async fn a_watcher_that_hung_up_ends_without_waiting_for_an_event() {
    let bin = Binary::start(&["--metrics-listen", "127.0.0.1:0"], &[]);
    let metrics = bin.metrics.clone().expect("metrics address");
    let mut c = pb::sessions_client::SessionsClient::connect(format!("http://{}", bin.addr))
        .await
        .expect("connect");
    open_session(&mut c, session_with_limits("quiet", 100_000, 20_000)).await;
    open_session(&mut c, session_with_limits("busy", 100_000, 20_000)).await;
    let watchers = || async { metric(&scrape(&metrics).await, "compactd_watchers") };

    let watcher = subscribe(&mut c, "quiet").await;
    assert_eq!(
        watchers().await,
        1.0,
        "the watcher is counted while it lives"
    );
    drop(watcher);
    // Events of another session keep coming; the quiet session's never do.
    put_message(&mut c, "busy", user_msg("u1")).await;
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
    while watchers().await != 0.0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the watcher of a hung-up client still runs after 10 s"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// Sends `message` (a unary call's request, encoded) to `path` on its own HTTP/2 connection with a
/// 64 KiB window and never reads the answer: the client that keeps a server's replies in
/// its send buffer. Returns the stream's two halves once the answer's headers came.
async fn unread_reply(
    addr: &str,
    path: &str,
    message: Vec<u8>,
) -> (h2::SendStream<tonic::codegen::Bytes>, h2::RecvStream) {
    unread_call(addr, path, vec![message]).await
}

/// [`unread_reply`] with `messages` sent one after another (a `Stream`'s updates).
async fn unread_call(
    addr: &str,
    path: &str,
    messages: Vec<Vec<u8>>,
) -> (h2::SendStream<tonic::codegen::Bytes>, h2::RecvStream) {
    let mut client = raw_h2::connect(
        addr,
        h2::client::Builder::new()
            .initial_window_size(65_535)
            .initial_connection_window_size(65_535),
    )
    .await;
    let (response, mut send) = client
        .send_request(raw_h2::grpc_head(addr, path), false)
        .expect("send");
    send.send_data(raw_h2::framed(&messages).into(), true)
        .expect("body");
    let response = tokio::time::timeout(std::time::Duration::from_secs(10), response)
        .await
        .expect("headers in time")
        .expect("response");
    assert_eq!(response.status(), 200);
    (send, response.into_body())
}

/// The slow-reader grace of the tests that wait for unread replies or events to be
/// dropped: short next to the default (10 s), long enough that what they check while the
/// replies are still held (scrapes, a refused update) fits in it on a slow, loaded machine
/// (with 1 s a scrape could come after the drop).
const SHORT_GRACE_SECS: &str = "5";

/// The binary with metrics on and a slow-reader grace of [`SHORT_GRACE_SECS`].
fn with_metrics_and_a_short_grace() -> Binary {
    Binary::start(
        &[
            "--metrics-listen",
            "127.0.0.1:0",
            "--slow-reader-grace-secs",
            SHORT_GRACE_SECS,
        ],
        &[],
    )
}

/// Waits up to 30 s (several graces) for `compactd_bytes_in_flight` to satisfy `ok`;
/// returns the last value read.
async fn in_flight_until(metrics: &str, ok: impl Fn(f64) -> bool) -> f64 {
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let now = metric(&scrape(metrics).await, "compactd_bytes_in_flight");
        if ok(now) || tokio::time::Instant::now() >= deadline {
            return now;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// A client of `bin` and its session "big": one user message whose text part "u1-t" is
/// 1 MiB.
async fn big_session(bin: &Binary) -> Client {
    let mut c = pb::sessions_client::SessionsClient::connect(format!("http://{}", bin.addr))
        .await
        .expect("connect");
    open_session(&mut c, session_with_limits("big", 2_000_000, 20_000)).await;
    put_message(&mut c, "big", user_msg("u1")).await;
    put_part(
        &mut c,
        "big",
        text_part("u1", "u1-t", &"0123456789abcdef".repeat(64 << 10)),
    )
    .await;
    c
}

/// Calls `rpc` with `request` and reads nothing: its reply of at least 1 MB stays
/// counted in flight until the client resets the stream, then is given back.
async fn held_until_reset(bin: &Binary, metrics: &str, rpc: &str, request: Vec<u8>) {
    let (mut send, recv) =
        unread_reply(&bin.addr, &format!("/compactd.v1.Sessions/{rpc}"), request).await;
    let held = in_flight_until(metrics, |b| b >= 1_000_000.0).await;
    assert!(
        held >= 1_000_000.0,
        "{rpc}: the unread 1 MiB reply is counted in flight: {held}"
    );
    send.send_reset(h2::Reason::CANCEL);
    drop(recv);
    let after = in_flight_until(metrics, |b| b == 0.0).await;
    assert_eq!(after, 0.0, "{rpc}: given back once its stream is reset");
}

/// A unary reply the client does not read stays in the server's HTTP/2 send buffer: its
/// bytes stay counted in flight (against `--memory-budget`) until the stream ends, for
/// GetContext, GetSession and Recall. Before, they were given back when the handler
/// returned, so many unread large replies held memory the budget never saw.
#[tokio::test]
async fn an_unread_unary_reply_stays_counted_in_flight_until_its_stream_ends() {
    use prost::Message as _;
    let bin = Binary::start(&["--metrics-listen", "127.0.0.1:0"], &[]);
    let metrics = bin.metrics.clone().expect("metrics address");
    let _client = big_session(&bin).await;
    assert_eq!(in_flight_until(&metrics, |b| b == 0.0).await, 0.0);

    let get_context = pb::GetContextRequest {
        session_id: "big".into(),
        ..Default::default()
    };
    let get_session = pb::GetSessionRequest {
        session_id: "big".into(),
    };
    let recall = pb::RecallRequest {
        session_id: "big".into(),
        key: Some(pb::recall_request::Key::PartId("u1-t".into())),
    };
    let calls = [
        ("GetContext", get_context.encode_to_vec()),
        ("GetSession", get_session.encode_to_vec()),
        ("Recall", recall.encode_to_vec()),
    ];
    for (rpc, request) in calls {
        held_until_reset(&bin, &metrics, rpc, request).await;
    }
}

/// A Prune report lists every output it cleared, a dry run every candidate (each with
/// its message, part and call ids and its tool name): left unread, it stays counted in
/// flight until its stream ends. Before, a Prune reply was never held, and a dry run,
/// which changes nothing, could be repeated without end.
#[tokio::test]
async fn an_unread_prune_report_stays_counted_in_flight() {
    use prost::Message as _;
    let bin = Binary::start(&["--metrics-listen", "127.0.0.1:0"], &[]);
    let metrics = bin.metrics.clone().expect("metrics address");
    let mut c = pb::sessions_client::SessionsClient::connect(format!("http://{}", bin.addr))
        .await
        .expect("connect");
    let config = pb::SessionConfig {
        prune_protect: Some(0),
        ..Default::default()
    };
    open_session(&mut c, session_with_config("pr", 2_000_000, 20_000, config)).await;
    put_message(&mut c, "pr", user_msg("u1")).await;
    put_message(&mut c, "pr", assistant_msg("a1", "u1")).await;
    // 1,600 outputs, each listed with about 770 bytes of ids and name: a 1.2 MB report.
    let tool = "t".repeat(250);
    for i in 0..1_600 {
        let id = format!("{i:0>250}");
        put_part(&mut c, "pr", tool_part("a1", &id, &tool, "output")).await;
    }
    for u in ["u2", "u3"] {
        put_message(&mut c, "pr", user_msg(u)).await;
        put_part(&mut c, "pr", text_part(u, &format!("{u}-t"), "Next.")).await;
    }
    assert_eq!(in_flight_until(&metrics, |b| b == 0.0).await, 0.0);
    let dry = pb::PruneRequest {
        session_id: "pr".into(),
        dry_run: true,
    };
    held_until_reset(&bin, &metrics, "Prune", dry.encode_to_vec()).await;
}

/// ListSessions carries every session's title: with 1,100 sessions of 1 KiB titles (the
/// most a title holds) its reply passes 1 MB, and left unread it stays counted in flight
/// until its stream ends. Before, it was not held (the review saw 40 unread listings of a
/// 12 MiB title take RSS from 78 to 595 MB under a 128 MB budget, for good). Titles are
/// now bounded, so OpenSession's and ImportSession's replies (one summary each) stay
/// small; they are held as every unary reply is.
#[tokio::test]
async fn unread_listings_stay_counted_in_flight() {
    use prost::Message as _;
    let bin = Binary::start(&["--metrics-listen", "127.0.0.1:0"], &[]);
    let metrics = bin.metrics.clone().expect("metrics address");
    let mut c = pb::sessions_client::SessionsClient::connect(format!("http://{}", bin.addr))
        .await
        .expect("connect");
    for i in 0..1_100 {
        let titled = pb::SessionInfo {
            title: "0123456789abcdef".repeat(64),
            ..session(&format!("titled-{i}"))
        };
        open_session(&mut c, titled).await;
    }
    assert_eq!(in_flight_until(&metrics, |b| b == 0.0).await, 0.0);
    let list = pb::ListSessionsRequest::default().encode_to_vec();
    held_until_reset(&bin, &metrics, "ListSessions", list).await;
}

/// A client that reads none of its replies cannot keep everyone's updates refused. With a
/// 48 MiB budget (6 MiB in flight), two unread GetContext replies of a 1 MiB text (2 MiB
/// each held) leave no room for a 2.5 MB update; after `--slow-reader-grace-secs` the replies are dropped (their bytes
/// given back while the client still holds their streams open), the update goes through,
/// and the client reading on finds its stream reset, not a reply cut short. Before, the
/// replies stayed counted until the client read them or hung up.
#[tokio::test]
async fn replies_left_unread_for_the_grace_are_dropped_and_free_the_share() {
    use prost::Message as _;
    let bin = Binary::start(
        &[
            "--metrics-listen",
            "127.0.0.1:0",
            "--memory-budget",
            "50331648",
            "--slow-reader-grace-secs",
            SHORT_GRACE_SECS,
        ],
        &[],
    );
    let metrics = bin.metrics.clone().expect("metrics address");
    let mut c = big_session(&bin).await;
    let request = pb::GetContextRequest {
        session_id: "big".into(),
        ..Default::default()
    }
    .encode_to_vec();
    let mut unread = Vec::new();
    for _ in 0..2 {
        unread.push(
            unread_reply(
                &bin.addr,
                "/compactd.v1.Sessions/GetContext",
                request.clone(),
            )
            .await,
        );
    }
    let held = in_flight_until(&metrics, |b| b >= 4_000_000.0).await;
    assert!(
        held >= 4_000_000.0,
        "both unread replies are counted: {held}"
    );
    let update = |id: &str| pb::UpsertPartRequest {
        session_id: "big".into(),
        part: Some(text_part("u1", id, &"x".repeat(2_500_000))),
    };
    let refused = c
        .upsert_part(update("u1-a"))
        .await
        .expect_err("no room in flight");
    assert_eq!(
        refused.code(),
        tonic::Code::ResourceExhausted,
        "{refused:?}"
    );

    let after = in_flight_until(&metrics, |b| b == 0.0).await;
    assert_eq!(
        after, 0.0,
        "the unread replies are given back after the grace"
    );
    assert_eq!(
        metric(&scrape(&metrics).await, "compactd_replies_abandoned_total"),
        2.0
    );
    c.upsert_part(update("u1-b")).await.expect("room again");

    for (_send, mut recv) in unread {
        let mut read = 0usize;
        let end = tokio::time::timeout(std::time::Duration::from_secs(10), async {
            loop {
                match recv.data().await {
                    Some(Ok(data)) => {
                        read += data.len();
                        let _ = recv.flow_control().release_capacity(data.len());
                    }
                    Some(Err(e)) => return Err(e),
                    None => return Ok(recv.trailers().await),
                }
            }
        })
        .await
        .expect("the stream ends in time");
        assert!(
            end.is_err(),
            "the dropped reply's stream is reset after {read} bytes, not ended: {end:?}"
        );
        assert!(
            read < 1_000_000,
            "only what HTTP/2 had buffered arrives: {read}"
        );
    }
}

/// A `Stream` client that asks for contexts and reads none of its events cannot keep them
/// counted against the budget: after `--slow-reader-grace-secs` with none taken, the
/// buffered events are dropped (their bytes given back while the client still holds the
/// call open) and the client reading on finds the stream ended, RESOURCE_EXHAUSTED.
/// Before, they stayed counted until the client read them or hung up, since the writer
/// had buffered them all without waiting.
#[tokio::test]
async fn stream_events_left_untaken_for_the_grace_are_dropped_and_free_the_share() {
    use prost::Message as _;
    let bin = with_metrics_and_a_short_grace();
    let metrics = bin.metrics.clone().expect("metrics address");
    let _c = big_session(&bin).await;
    let updates = (0..6u64)
        .map(|n| {
            pb::ClientUpdate {
                seq: n + 1,
                session_id: "big".into(),
                update: Some(pb::client_update::Update::GetContext(
                    pb::ContextOptions::default(),
                )),
            }
            .encode_to_vec()
        })
        .collect();
    let (_send, mut recv) = unread_call(&bin.addr, "/compactd.v1.Sessions/Stream", updates).await;
    let held = in_flight_until(&metrics, |b| b >= 3_000_000.0).await;
    assert!(
        held >= 3_000_000.0,
        "the buffered contexts are counted: {held}"
    );
    let after = in_flight_until(&metrics, |b| b == 0.0).await;
    assert_eq!(
        after, 0.0,
        "given back after the grace, the call still open"
    );
    // Reading on: what was handed to HTTP/2 before, then the stream's end.
    let end = tokio::time::timeout(std::time::Duration::from_secs(10), async {
        while let Some(chunk) = recv.data().await {
            let Ok(chunk) = chunk else { return None };
            let _ = recv.flow_control().release_capacity(chunk.len());
        }
        recv.trailers().await.ok().flatten()
    })
    .await
    .expect("the stream ends");
    let trailers = end.expect("trailers with a status");
    assert_eq!(
        trailers.get("grpc-status").map(|v| v.as_bytes()),
        Some(&b"8"[..]),
        "{trailers:?}"
    );
}

/// A `Compact` caller that reads none of its events for the grace is given up on (its
/// compaction cancelled, so nothing else waits on it); reading on, it finds the call
/// ended RESOURCE_EXHAUSTED. Before, the call ended cleanly (grpc-status 0) without the
/// compaction's outcome.
#[tokio::test]
async fn a_compact_call_given_up_on_ends_with_an_error_not_a_clean_end() {
    use crate::common::compaction::{SID, compaction_config, llm_config, seed_session};
    use compactd::server::ServerOptions;
    use prost::Message as _;
    // 3,000 deltas of 1 KB: far more than the call's channel and HTTP/2 windows hold.
    let fake = FakeLlm::start(vec![Reply::text(vec!["x".repeat(1_000); 3_000])]).await;
    let store = compactd::store::Store::new(chars4_unless_named(acp_config()));
    let ledger = store.ledger().clone();
    let server = start_server_on(
        store,
        ServerOptions {
            compaction: compaction_config(llm_config(&fake)),
            slow_reader_grace: std::time::Duration::from_millis(300),
            ..Default::default()
        },
    )
    .await;
    let mut client = server.client().await;
    seed_session(&mut client, SID).await;
    let request = pb::CompactRequest {
        session_id: SID.into(),
        ..Default::default()
    }
    .encode_to_vec();
    let (_send, mut recv) = unread_call(
        &server.addr.to_string(),
        "/compactd.v1.Sessions/Compact",
        vec![request],
    )
    .await;
    // The compaction holds its prompt in flight from its start (before the call's
    // headers) to its end, and cannot end while its caller reads nothing but by being
    // given up on: once nothing is in flight, it was. Reading before would take its events
    // and let it finish.
    let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(30);
    while ledger.in_flight() != 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the compaction was not given up on within 30 s: {} bytes in flight",
            ledger.in_flight()
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    let trailers = tokio::time::timeout(std::time::Duration::from_secs(10), async {
        while let Some(chunk) = recv.data().await {
            let Ok(chunk) = chunk else { return None };
            let _ = recv.flow_control().release_capacity(chunk.len());
        }
        recv.trailers().await.ok().flatten()
    })
    .await
    .expect("the call ends")
    .expect("trailers with a status");
    assert_eq!(
        trailers.get("grpc-status").map(|v| v.as_bytes()),
        Some(&b"8"[..]),
        "{trailers:?}"
    );
}

/// A `Subscribe` caller that reads none of its events cannot keep them buffered outside
/// the budget: the events waiting for it are counted in flight, and after
/// `--slow-reader-grace-secs` with none taken they are dropped (their bytes given back
/// while the call is still open) and the call ends RESOURCE_EXHAUSTED. Before, they were
/// never counted, and stayed until the caller hung up: up to 256 events per watcher,
/// each as large as a session's events can be.
#[tokio::test]
async fn subscribe_events_left_untaken_are_counted_and_dropped_after_the_grace() {
    let bin = with_metrics_and_a_short_grace();
    let metrics = bin.metrics.clone().expect("metrics address");
    // Events of at least 256 bytes: the client's HTTP/2 library (h2) ends a connection
    // that buffers too many smaller DATA frames unread.
    let sid = "w".repeat(250);
    let url = format!("http://{}", bin.addr);
    let mut client = pb::sessions_client::SessionsClient::connect(url.clone())
        .await
        .expect("connect");
    open_session(&mut client, session_with_limits(&sid, 20_000, 4_000)).await;
    // A watcher on its own connection with a small HTTP/2 window, which does not read.
    let mut slow = subscribe(&mut small_window_client(url).await, &sid).await;

    // Overflow events, a batch at a time, until some wait in compactd for the watcher
    // (HTTP/2's window takes the first 64 KB of them).
    let mut s = EventStream::open(&mut client).await;
    let mut held = 0.0;
    for batch in 0..100u64 {
        for i in 0..50 {
            let seq = s
                .send(&sid, report_usage(usage(19_000 + batch * 50 + i)))
                .await;
            s.reply(seq).await;
        }
        held = metric(&scrape(&metrics).await, "compactd_bytes_in_flight");
        if held > 0.0 {
            // Still held a second later (no event sent meanwhile, the grace is 5 s): they
            // wait for the watcher. An event the watcher's task had not yet taken off the
            // bus (a loaded machine) is counted too, for a moment: with HTTP/2's window
            // not yet full the watcher would read on, no event would wait, and the call
            // would never be given up on.
            tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            held = metric(&scrape(&metrics).await, "compactd_bytes_in_flight");
            if held > 0.0 {
                break;
            }
        }
    }
    assert!(held > 0.0, "the events waiting for the watcher are counted");
    let after = in_flight_until(&metrics, |b| b == 0.0).await;
    assert_eq!(
        after, 0.0,
        "given back after the grace, the call still open"
    );
    // Reading on: what HTTP/2 had taken, then the status.
    let status = loop {
        match tokio::time::timeout(std::time::Duration::from_secs(10), slow.message()).await {
            Ok(Ok(Some(_))) => {}
            Ok(Ok(None)) => panic!("the call ended without a status"),
            Ok(Err(status)) => break status,
            Err(_) => panic!("the call did not end"),
        }
    };
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains("took none"), "{status:?}");
}
