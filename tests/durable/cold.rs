//! The cold-session test (issue 14): with an 8 MiB memory budget and a data dir, ten
//! times more sessions than fit in memory are created and read back correctly, while the
//! held bytes stay under the budget.
//!
//! Each session is a 100-200 KB prefix of one of the larger shared traces, imported,
//! then given a user message with a 4 KB text part on the Stream (so it is stored as a
//! snapshot plus log entries). Right after it is created it is read once (`GetSession`
//! and `GetContext`): that read must hold what was sent (the export's messages, parts,
//! texts and tool outputs, and the streamed message). How many fit is measured from the
//! first sessions' `held_bytes`.
//!
//! Then every session is read back in creation order (least recently used first, so
//! nearly every read loads a cold session and sends another one cold) and must equal its
//! first read (`held_bytes` and `created` cleared). Throughout, `/metrics` is sampled
//! every 20 ms: `compactd_bytes_held` must never exceed the budget. The metrics must show
//! sessions sent cold for memory and at least one load per session that was cold when
//! read. Last, a cold session is deleted: it is no longer listed nor readable, also
//! after a restart on the same data dir.
//!
//! A second test sends one small session cold (idle TTL) right after a part delete and
//! loads it back.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use compactd::server::pb;

use super::*;

const BUDGET: u64 = 8 << 20;
/// Sessions created: this many times what fits in the budget.
const FACTOR: usize = 10;

fn session_id(i: usize) -> String {
    format!("cold-{i:04}")
}

/// Session `i`'s import: a 100-200 KB prefix of one of `traces`.
fn export_of(i: usize, traces: &[Trace]) -> String {
    let cap = (100 + (i * 37) % 100) << 10;
    traces[i % traces.len()].prefix(cap).0
}

/// Creates session `i`: the import, then a user message with a 4 KB text part.
async fn create(c: &mut Client, pipe: &mut Pipe, i: usize, export_json: &str) {
    let sid = session_id(i);
    c.import_session(pb::ImportSessionRequest {
        export_json: export_json.to_string(),
        session_id: sid.clone(),
        limits: Some(limits(400_000, 32_000)),
        ..Default::default()
    })
    .await
    .unwrap_or_else(|s| panic!("import {sid}: {s:?}"));
    let mut user = user_msg("cold-u");
    user.time = Some(pb::MessageTime {
        created: now_ms(),
        completed: None,
    });
    for u in [
        upsert_message(user),
        upsert_part(text_part("cold-u", "cold-u-t", &output_of(&sid, 4_096))),
    ] {
        match pipe.request(&sid, u).await {
            Answer::Ack => {}
            other => panic!("{sid}: {other:?}"),
        }
    }
}

/// The first read of a fresh session: it must hold what was sent.
fn check_sent(state: &State, i: usize, export_json: &str) {
    let sid = session_id(i);
    assert_holds_export(&state.session, export_json, 1, &sid);
    let last = state.session.messages.last().expect("messages");
    assert_eq!(last.info.as_ref().map(|m| m.id.as_str()), Some("cold-u"));
    assert_eq!(
        text_of(last),
        output_of(&sid, 4_096),
        "{sid}: the streamed text"
    );
}

async fn list(c: &mut Client) -> Vec<pb::SessionSummary> {
    c.list_sessions(pb::ListSessionsRequest::default())
        .await
        .expect("ListSessions")
        .into_inner()
        .sessions
}

/// Every session's id, listed `page_size` at a time; each page's token is its last id.
async fn paged_ids(c: &mut Client, page_size: i32) -> Vec<String> {
    let mut ids = Vec::new();
    let mut token = String::new();
    loop {
        let r = c
            .list_sessions(pb::ListSessionsRequest {
                page_size,
                page_token: token,
            })
            .await
            .expect("ListSessions page")
            .into_inner();
        assert!(r.sessions.len() <= page_size as usize, "a page too long");
        ids.extend(r.sessions.into_iter().map(|s| s.id));
        if r.next_page_token.is_empty() {
            return ids;
        }
        assert_eq!(
            Some(&r.next_page_token),
            ids.last(),
            "the token is the page's last id"
        );
        token = r.next_page_token;
    }
}

/// Samples `compactd_bytes_held` every 20 ms until stopped; its largest value and the
/// number of samples.
fn sample_held(metrics: String, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<(f64, u32)> {
    tokio::spawn(async move {
        let (mut max, mut n) = (0f64, 0u32);
        while !stop.load(Ordering::SeqCst) {
            // A failed scrape ends the sampling: the server is gone and the test fails
            // elsewhere.
            let Some(text) = try_scrape(&metrics).await else {
                break;
            };
            max = max.max(metric(&text, "compactd_bytes_held"));
            n += 1;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        (max, n)
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_times_more_sessions_than_fit_are_created_and_read_back() {
    let traces: Vec<Trace> = Trace::all()
        .into_iter()
        .filter(|t| t.bytes() >= 200 << 10)
        .collect();
    assert!(traces.len() >= 4, "enough traces of 200 KB or more");
    let data = data_dir("cold");
    let budget = BUDGET.to_string();
    let args = [
        "--memory-budget",
        budget.as_str(),
        "--metrics-listen",
        "127.0.0.1:0",
    ];
    let server = start_on(data.path(), "sync", &args, &[]);
    let metrics = server.metrics.clone().expect("metrics address");
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = sample_held(metrics.clone(), stop.clone());

    let mut c = connect(&server.addr).await;
    let mut pipe = Pipe::open(&mut c).await.expect("stream");
    let mut exports = Vec::new();
    let mut first_reads = Vec::new();
    let began = Instant::now();

    // How many fit: the budget over the first sessions' mean held bytes.
    const PROBE: usize = 5;
    let mut probe_held = 0;
    for i in 0..PROBE {
        let export_json = export_of(i, &traces);
        create(&mut c, &mut pipe, i, &export_json).await;
        let state = read_state(&mut c, &session_id(i)).await.expect("created");
        check_sent(&state, i, &export_json);
        let summary = c
            .get_session(pb::GetSessionRequest {
                session_id: session_id(i),
            })
            .await
            .expect("GetSession")
            .into_inner()
            .summary
            .expect("summary");
        probe_held += summary.held_bytes;
        exports.push(export_json);
        first_reads.push(state);
    }
    let fit = (BUDGET / (probe_held / PROBE as u64)) as usize;
    let total = FACTOR * fit;
    assert!(
        fit >= 4,
        "a few sessions fit ({probe_held} bytes held by {PROBE})"
    );
    for i in PROBE..total {
        let export_json = export_of(i, &traces);
        create(&mut c, &mut pipe, i, &export_json).await;
        let state = read_state(&mut c, &session_id(i)).await.expect("created");
        check_sent(&state, i, &export_json);
        exports.push(export_json);
        first_reads.push(state);
    }
    let create_time = began.elapsed();
    let export_bytes: usize = exports.iter().map(String::len).sum();

    let listed = list(&mut c).await;
    assert_eq!(listed.len(), total, "every session is listed");
    assert_eq!(
        paged_ids(&mut c, 7).await,
        listed.iter().map(|s| s.id.clone()).collect::<Vec<_>>(),
        "paged, hot and cold sessions are listed alike, in id order"
    );
    let cold_before = listed.iter().filter(|s| s.cold).count();
    let held_listed: u64 = listed.iter().map(|s| s.held_bytes).sum();
    // Sessions differ in size, so `fit` is an estimate: most must be cold, all but about
    // what fits.
    assert!(
        cold_before >= total - 2 * fit,
        "about what fits is held: {cold_before} of {total} cold, {fit} fit"
    );
    assert!(
        held_listed <= BUDGET,
        "held {held_listed} > budget {BUDGET}"
    );
    let m0 = scrape(&metrics).await;
    let loads0 = metric(&m0, "compactd_session_loads_total{result=\"ok\"}");

    // Read everything back, least recently used first.
    let reading = Instant::now();
    for (i, first) in first_reads.iter().enumerate() {
        let sid = session_id(i);
        let again = read_state(&mut c, &sid).await;
        assert!(
            again.as_ref() == Some(first),
            "{sid} reads back as it was created: {}",
            first_difference(&again, &Some(first.clone()))
        );
    }
    let read_time = reading.elapsed();
    stop.store(true, Ordering::SeqCst);
    let (max_held, samples) = sampler.await.expect("sampler");
    let m1 = scrape(&metrics).await;
    let loads = metric(&m1, "compactd_session_loads_total{result=\"ok\"}") - loads0;
    let failed = metric(&m1, "compactd_session_loads_total{result=\"failed\"}");
    let evicted = metric(&m1, "compactd_sessions_evicted_total{reason=\"memory\"}");
    let held_after = metric(&m1, "compactd_bytes_held");
    assert!(
        max_held <= BUDGET as f64 && held_after <= BUDGET as f64,
        "compactd_bytes_held stays within the budget {BUDGET}: max sampled {max_held}, \
         after {held_after}"
    );
    assert_eq!(failed, 0.0, "no load failed:\n{m1}");
    assert!(
        loads >= cold_before as f64,
        "each of the {cold_before} cold sessions was loaded when read ({loads} loads)"
    );
    assert!(evicted > 0.0, "sessions were sent cold for memory:\n{m1}");
    assert!(
        metric(&m1, "compactd_sessions_cold") > 0.0,
        "compactd_sessions_cold counts the cold ones:\n{m1}"
    );
    assert!(
        metric(&m1, "compactd_sessions") < total as f64,
        "compactd_sessions counts the hot ones:\n{m1}"
    );

    // Delete a cold session: gone from the list, from reads, and from disk.
    let listed = list(&mut c).await;
    let victim = listed
        .iter()
        .find(|s| s.cold)
        .map(|s| s.id.clone())
        .expect("a cold session to delete");
    let deleted = c
        .delete_session(pb::DeleteSessionRequest {
            session_id: victim.clone(),
        })
        .await
        .expect("DeleteSession")
        .into_inner()
        .deleted;
    assert!(deleted, "DeleteSession of the cold {victim} deletes it");
    let ids = |l: &[pb::SessionSummary]| l.iter().map(|s| s.id.clone()).collect::<Vec<_>>();
    assert!(
        !ids(&list(&mut c).await).contains(&victim),
        "{victim} is no longer listed"
    );
    assert!(
        read_state(&mut c, &victim).await.is_none(),
        "{victim} is gone"
    );
    let _ = sigterm(server).await;

    let server = start_on(data.path(), "sync", &args, &[]);
    let mut c = connect(&server.addr).await;
    let relisted = ids(&list(&mut c).await);
    assert_eq!(
        relisted.len(),
        total - 1,
        "every other session is still there"
    );
    assert!(
        !relisted.contains(&victim),
        "the deleted cold session {victim} is not listed after a restart"
    );
    assert!(
        read_state(&mut c, &victim).await.is_none(),
        "the deleted cold session {victim} cannot be read after a restart"
    );
    // And the others still read as they were (a few of them).
    for i in [0, total / 2, total - 1] {
        let sid = session_id(i);
        if sid == victim {
            continue;
        }
        let again = read_state(&mut c, &sid).await;
        assert!(
            again.as_ref() == Some(&first_reads[i]),
            "{sid} after the restart: {}",
            first_difference(&again, &Some(first_reads[i].clone()))
        );
    }
    let _ = sigterm(server).await;

    eprintln!(
        "cold: budget {:.1} MiB, {fit} sessions fit ({:.0} KB held each), {total} created \
         ({:.1} MB of export JSON) in {:.1} s, {cold_before} of them cold; all read back in \
         {:.1} s with {loads} loads and {evicted} sent cold for memory; compactd_bytes_held \
         at most {:.2} MiB in {samples} samples",
        BUDGET as f64 / (1 << 20) as f64,
        probe_held as f64 / PROBE as f64 / 1e3,
        export_bytes as f64 / 1e6,
        create_time.as_secs_f64(),
        read_time.as_secs_f64(),
        max_held / (1 << 20) as f64,
    );
}

/// A session sent cold after one of its parts was deleted loads back as it was. (The
/// crash test's sessions, sent cold for memory, first showed a snapshot that would not
/// load: "the prune window points past the messages".) Three turns with two tool calls
/// each, so the first turn's outputs are prune candidates; its last output deleted; then
/// the session idles past a one-second TTL and leaves memory (awaited on `Subscribe`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_sent_cold_after_a_part_delete_loads_back() {
    let data = data_dir("cold-delete");
    let server = start_on(data.path(), "sync", &["--session-idle-ttl-secs", "1"], &[]);
    let mut c = connect(&server.addr).await;
    let sid = "cold-delete";
    open_session(&mut c, session_with_limits(sid, 200_000, 32_000)).await;
    let mut watch = subscribe(&mut c, sid).await;
    for t in 1..=3 {
        let (u, a) = (format!("u{t}"), format!("a{t}"));
        put_message(&mut c, sid, user_msg(&u)).await;
        put_part(&mut c, sid, text_part(&u, &format!("{u}-t"), "go on")).await;
        put_message(&mut c, sid, assistant_msg(&a, &u)).await;
        for j in 0..2 {
            let id = format!("{a}-c{j}");
            put_part(
                &mut c,
                sid,
                tool_part(&a, &id, "bash", &output_of(&id, 4_096)),
            )
            .await;
        }
        put_message(&mut c, sid, finished(assistant_msg(&a, &u))).await;
    }
    c.delete_part(pb::DeletePartRequest {
        session_id: sid.into(),
        message_id: "a1".into(),
        part_id: "a1-c1".into(),
    })
    .await
    .expect("DeletePart");
    let before = read_state(&mut c, sid).await.expect("the session");
    until_evicted(&mut watch).await;
    let listed = list(&mut c).await;
    assert!(
        listed.iter().any(|s| s.id == sid && s.cold),
        "{sid} is cold: {listed:?}"
    );
    let after = c
        .get_session(pb::GetSessionRequest {
            session_id: sid.into(),
        })
        .await;
    assert!(
        after.is_ok(),
        "{sid} loads back after it went cold: {after:?}\n{}",
        tail(&server.log_so_far(), 10)
    );
    let after = read_state(&mut c, sid).await;
    assert!(
        after.as_ref() == Some(&before),
        "{sid} reads as before: {}",
        first_difference(&after, &Some(before.clone()))
    );
    let _ = sigterm(server).await;
}

/// `Subscribe` naming a cold session watches it where it is: on disk. Found in review:
/// it loaded the session only to check it exists, so a dashboard watching idle sessions
/// kept each in memory (and, under pressure, pushed others out or was refused). An id
/// the store does not hold is still NOT_FOUND.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscribing_to_a_cold_session_leaves_it_cold() {
    let data = data_dir("cold-watch");
    let server = start_on(data.path(), "sync", &["--session-idle-ttl-secs", "1"], &[]);
    let mut c = connect(&server.addr).await;
    let sid = "cold-watch";
    open_session(&mut c, session_with_limits(sid, 200_000, 32_000)).await;
    let mut watch = subscribe(&mut c, sid).await;
    put_message(&mut c, sid, user_msg("u1")).await;
    put_part(&mut c, sid, text_part("u1", "u1-t", "go on")).await;
    until_evicted(&mut watch).await;
    let _second = subscribe(&mut c, sid).await;
    let listed = list(&mut c).await;
    assert!(
        listed.iter().any(|s| s.id == sid && s.cold),
        "{sid} stays cold while watched: {listed:?}"
    );
    let unknown = c
        .subscribe(pb::SubscribeRequest {
            session_id: "never-opened".into(),
        })
        .await
        .map(|_| ());
    assert_status(unknown, tonic::Code::NotFound, "never-opened");
    let _ = sigterm(server).await;
}

/// Reads the watch stream until its session's `evicted` event (within 20 s an event).
async fn until_evicted(watch: &mut tonic::Streaming<pb::SessionEvent>) {
    loop {
        let e = tokio::time::timeout(Duration::from_secs(20), watch.message())
            .await
            .expect("an event within 20 s")
            .expect("the watch stream")
            .expect("still open");
        if matches!(e.event, Some(pb::session_event::Event::Evicted(_))) {
            return;
        }
    }
}
