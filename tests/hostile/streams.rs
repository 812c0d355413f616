//! `Stream` clients that pipeline or stop reading. Each update goes out in its own
//! HTTP/2 DATA frame, as from a client that sends each update when its host produces it
//! (tonic would otherwise pack ready messages into 32 KiB frames).
//!
//! - A client that asks 1,300 times for a 2.5 MiB session's context and never reads:
//!   its answers must not pile up; the stream ends RESOURCE_EXHAUSTED naming the `seq`
//!   where the unsent answers start.
//! - A client that pipelines 12,000 small updates while reading its acks: every update
//!   is acked (flow control, not an error) and its connection survives (no GOAWAY):
//!   unary calls on the same channel succeed during and after.
//! - A client that pipelines 12,000 context requests and never reads: its connection
//!   survives (unary calls on the same channel succeed); its stream ends
//!   RESOURCE_EXHAUSTED naming a `seq`, or is only flow-controlled (every answer still
//!   arrives, in order, once it reads).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use compactd::server::pb;
use compactd::server::pb::client_update::Update;
use compactd::server::pb::server_event::Event;
use futures::StreamExt as _;
use tonic::transport::Channel;

use super::*;

/// How long a pipelining client gets to send and read everything.
const PIPELINE_LIMIT: Duration = Duration::from_secs(90);
/// How long a client that does not read waits before looking (the server's grace plus
/// time to notice).
const NOT_READING: Duration = Duration::from_secs(GRACE_SECS + 4);
/// How long reading what a non-reading client was sent may take once it reads.
const DRAIN_LIMIT: Duration = Duration::from_secs(90);

/// `updates` as a request stream that yields between items, so tonic flushes each one
/// as its own DATA frame.
fn one_frame_each(
    updates: Vec<pb::ClientUpdate>,
) -> impl futures::Stream<Item = pb::ClientUpdate> + Send + 'static {
    futures::stream::iter(updates).then(|u| async move {
        tokio::task::yield_now().await;
        u
    })
}

fn get_context_update(seq: u64, sid: &str) -> pb::ClientUpdate {
    pb::ClientUpdate {
        seq,
        session_id: sid.into(),
        update: Some(Update::GetContext(pb::ContextOptions::default())),
    }
}

/// Unary calls on `channel` every 200 ms until stopped: the attacker's other calls,
/// which a GOAWAY on its connection would fail.
struct Prober {
    stop: Arc<std::sync::atomic::AtomicBool>,
    calls: Arc<AtomicU64>,
    failures: Arc<Mutex<Vec<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Prober {
    fn start(channel: Channel) -> Prober {
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let calls = Arc::new(AtomicU64::new(0));
        let failures = Arc::new(Mutex::new(Vec::new()));
        let task = {
            let (stop, calls, failures) = (stop.clone(), calls.clone(), failures.clone());
            tokio::spawn(async move {
                let mut client = client_on(channel);
                while !stop.load(Ordering::Relaxed) {
                    let call = client.list_sessions(pb::ListSessionsRequest::default());
                    match tokio::time::timeout(Duration::from_secs(15), call).await {
                        Ok(Ok(_)) => {}
                        Ok(Err(s)) => failures.lock().unwrap().push(format!("{s:?}")),
                        Err(_) => failures
                            .lock()
                            .unwrap()
                            .push("no answer within 15 s".into()),
                    }
                    calls.fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            })
        };
        Prober {
            stop,
            calls,
            failures,
            task,
        }
    }

    /// Stops; returns the calls made and the failures.
    async fn finish(self) -> (u64, Vec<String>) {
        self.stop.store(true, Ordering::Relaxed);
        let _ = tokio::time::timeout(Duration::from_secs(20), self.task).await;
        let failures = self.failures.lock().unwrap().clone();
        (self.calls.load(Ordering::Relaxed), failures)
    }
}

/// One unary call on `channel` after the attack.
async fn unary_after(channel: Channel) -> Result<(), String> {
    let mut client = client_on(channel);
    let call = client.list_sessions(pb::ListSessionsRequest::default());
    match tokio::time::timeout(Duration::from_secs(15), call).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(s)) => Err(format!("{s:?}")),
        Err(_) => Err("no answer within 15 s".into()),
    }
}

/// How a non-reading client's stream ended once it read: events read (ack or error
/// each ending one update), the last seq answered, and the end.
struct Drained {
    answered: u64,
    last_seq: u64,
    end: Result<(), tonic::Status>,
    /// The seqs were answered in order, each once.
    in_order: bool,
}

async fn drain(events: &mut tonic::Streaming<pb::ServerEvent>) -> Option<Drained> {
    let mut d = Drained {
        answered: 0,
        last_seq: 0,
        end: Ok(()),
        in_order: true,
    };
    let read = async {
        loop {
            match events.message().await {
                Ok(Some(e)) => {
                    if matches!(e.event, Some(Event::Ack(_)) | Some(Event::Error(_))) {
                        d.in_order &= e.seq == d.last_seq + 1;
                        d.last_seq = e.seq;
                        d.answered += 1;
                    }
                }
                Ok(None) => break,
                Err(s) => {
                    d.end = Err(s);
                    break;
                }
            }
        }
    };
    tokio::time::timeout(DRAIN_LIMIT, read).await.ok()?;
    Some(d)
}

/// Asserts a non-reading client's stream ended RESOURCE_EXHAUSTED naming a seq, or
/// (flow control only) with every one of `sent` updates answered in order.
fn assert_closed_or_flow_controlled(what: &str, drained: &Option<Drained>, sent: u64) {
    let Some(d) = drained else {
        panic!("{what}: reading the stream did not end within {DRAIN_LIMIT:?}");
    };
    assert!(d.in_order, "{what}: answers out of order");
    match &d.end {
        Err(s) => {
            assert_eq!(
                s.code(),
                Code::ResourceExhausted,
                "{what}: the stream failed after {} answers: {s:?}",
                d.answered
            );
            assert!(
                s.message().contains("seq"),
                "{what}: RESOURCE_EXHAUSTED does not name a seq: {s:?}"
            );
        }
        Ok(()) => assert_eq!(
            d.answered, sent,
            "{what}: the stream ended without a status before every update was answered"
        ),
    }
}

fn drained_brief(d: &Option<Drained>) -> String {
    match d {
        None => format!("still open after reading for {DRAIN_LIMIT:?}"),
        Some(d) => {
            let end = match &d.end {
                Ok(()) => "ended OK".to_string(),
                Err(s) => Outcome::from_status(s).brief(),
            };
            format!(
                "{} answered (last seq {}), then {end}",
                d.answered, d.last_seq
            )
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_asking_1300_times_for_a_big_context_and_never_reading_is_closed_naming_a_seq() {
    const REQUESTS: u64 = 1_300;
    let server = Capped::start(&[]).await;
    let channel = server.channel().await;
    let mut c = client_on(channel.clone());
    open_session(&mut c, session("big")).await;
    put_message(&mut c, "big", user_msg("u0")).await;
    for i in 0..5 {
        let text = output_of(&format!("t{i}"), 512 * 1024);
        put_part(&mut c, "big", text_part("u0", &format!("t{i}"), &text)).await;
    }
    let held = get_session(&mut c, "big")
        .await
        .summary
        .expect("summary")
        .held_bytes;
    let context_bytes = prost::Message::encoded_len(&get_context(&mut c, "big").await);
    let bystander = Bystander::start(&server).await;

    let started = Instant::now();
    let updates = (1..=REQUESTS)
        .map(|seq| get_context_update(seq, "big"))
        .collect();
    let opened = tokio::time::timeout(Duration::from_secs(15), c.stream(one_frame_each(updates)))
        .await
        .expect("the stream opens");
    let drained = match opened {
        Ok(events) => {
            let mut events = events.into_inner();
            // Not reading, for longer than the server's grace.
            let until = Instant::now() + NOT_READING;
            while Instant::now() < until && server.alive() {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            drain(&mut events).await
        }
        Err(s) => Some(Drained {
            answered: 0,
            last_seq: 0,
            end: Err(s),
            in_order: true,
        }),
    };
    let elapsed = started.elapsed();

    let bystander = bystander.finish().await;
    let finished = server.finish();
    let attacker = format!(
        "{REQUESTS} get_context of a session holding {:.1} MiB (context {:.1} MiB): {}",
        held as f64 / (1 << 20) as f64,
        context_bytes as f64 / (1 << 20) as f64,
        drained_brief(&drained)
    );
    report(
        "non-reading get_context stream",
        &finished,
        elapsed,
        &attacker,
        &bystander,
    );
    assert_survived(&finished, &bystander);
    let Some(d) = &drained else {
        panic!("reading the stream did not end within {DRAIN_LIMIT:?}");
    };
    let status = d
        .end
        .as_ref()
        .expect_err("the stream must end with a status");
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains("seq"), "{status:?}");
    assert!(
        d.answered < REQUESTS,
        "closed before every request was answered: {}",
        d.answered
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_pipelining_12000_updates_and_reading_its_acks_gets_them_all_and_keeps_its_connection()
 {
    const UPDATES: u64 = 12_000;
    let server = Capped::start(&[]).await;
    let channel = server.channel().await;
    let mut c = client_on(channel.clone());
    open_session(&mut c, session("pipe")).await;
    let bystander = Bystander::start(&server).await;
    let prober = Prober::start(channel.clone());

    let started = Instant::now();
    let updates = (1..=UPDATES)
        .map(|seq| pb::ClientUpdate {
            seq,
            session_id: "pipe".into(),
            update: Some(Update::ReportUsage(pb::UsageReport {
                message_id: String::new(),
                tokens: Some(usage(seq)),
            })),
        })
        .collect();
    let run = async {
        let mut events = c.stream(one_frame_each(updates)).await?.into_inner();
        let (mut acked, mut in_order) = (0u64, true);
        while let Some(e) = events.message().await? {
            match e.event {
                Some(Event::Ack(_)) => {
                    acked += 1;
                    in_order &= e.seq == acked;
                }
                Some(Event::Error(err)) => {
                    return Err(tonic::Status::new(
                        Code::Unknown,
                        format!("update {} got an error event: {err:?}", e.seq),
                    ));
                }
                _ => {}
            }
        }
        Ok::<_, tonic::Status>((acked, in_order))
    };
    let result = tokio::time::timeout(PIPELINE_LIMIT, run).await;
    let elapsed = started.elapsed();
    let (probes, probe_failures) = prober.finish().await;
    let after = unary_after(channel).await;

    let bystander = bystander.finish().await;
    let finished = server.finish();
    let attacker = format!(
        "{UPDATES} report_usage pipelined: {}; same channel: {probes} calls during ({} failed), after: {}",
        match &result {
            Ok(Ok((acked, in_order))) => format!("{acked} acked (in order: {in_order})"),
            Ok(Err(s)) => Outcome::from_status(s).brief(),
            Err(_) => format!("not over within {PIPELINE_LIMIT:?}"),
        },
        probe_failures.len(),
        after.as_ref().map_or_else(|e| e.clone(), |_| "OK".into()),
    );
    report(
        "pipelined 12,000 updates, reading",
        &finished,
        elapsed,
        &attacker,
        &bystander,
    );
    assert_survived(&finished, &bystander);
    let (acked, in_order) = result
        .unwrap_or_else(|_| panic!("the pipelined stream was not over within {PIPELINE_LIMIT:?}"))
        .unwrap_or_else(|s| panic!("the pipelined stream failed: {s:?}"));
    assert_eq!(acked, UPDATES, "every update is acked");
    assert!(in_order, "acks come in the order sent");
    assert!(
        probe_failures.is_empty(),
        "calls on the attacker's channel failed during the attack: {probe_failures:?}"
    );
    after.expect("a unary call on the attacker's channel after the attack");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_pipelining_12000_updates_and_never_reading_keeps_its_connection() {
    const UPDATES: u64 = 12_000;
    let server = Capped::start(&[]).await;
    let channel = server.channel().await;
    let mut c = client_on(channel.clone());
    open_session(&mut c, session("small")).await;
    put_message(&mut c, "small", user_msg("u0")).await;
    put_part(
        &mut c,
        "small",
        text_part("u0", "t0", &output_of("small", 2_000)),
    )
    .await;
    let context_bytes = prost::Message::encoded_len(&get_context(&mut c, "small").await);
    let bystander = Bystander::start(&server).await;
    let prober = Prober::start(channel.clone());

    let started = Instant::now();
    let updates = (1..=UPDATES)
        .map(|seq| get_context_update(seq, "small"))
        .collect();
    let opened = tokio::time::timeout(Duration::from_secs(15), c.stream(one_frame_each(updates)))
        .await
        .expect("the stream opens");
    let mut events = opened.map(tonic::Response::into_inner);
    // Not reading, for longer than the server's grace.
    let until = Instant::now() + NOT_READING;
    while Instant::now() < until && server.alive() {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (probes, probe_failures) = prober.finish().await;
    let after = unary_after(channel).await;
    let drained = match &mut events {
        Ok(events) => drain(events).await,
        Err(s) => Some(Drained {
            answered: 0,
            last_seq: 0,
            end: Err(s.clone()),
            in_order: true,
        }),
    };
    let elapsed = started.elapsed();

    let bystander = bystander.finish().await;
    let finished = server.finish();
    let attacker = format!(
        "{UPDATES} get_context (context {context_bytes} bytes) pipelined, read after {NOT_READING:?}: {}; same channel: {probes} calls during ({} failed), after: {}",
        drained_brief(&drained),
        probe_failures.len(),
        after.as_ref().map_or_else(|e| e.clone(), |_| "OK".into()),
    );
    report(
        "pipelined 12,000 updates, never reading",
        &finished,
        elapsed,
        &attacker,
        &bystander,
    );
    assert_survived(&finished, &bystander);
    assert!(
        probe_failures.is_empty(),
        "calls on the attacker's channel failed during the attack: {probe_failures:?}"
    );
    after.expect("a unary call on the attacker's channel after the attack");
    assert_closed_or_flow_controlled("the never-reading stream", &drained, UPDATES);
}
