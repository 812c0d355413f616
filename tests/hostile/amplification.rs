//! Decode amplification: requests made of empty repeated entries (two bytes each on the
//! wire) that would decode to ~50 times their size. Four such requests of 15.9 MiB, each
//! under `max_update_bytes` on the wire and each through a different door (OpenSession's
//! todos, a Stream `open`'s todos, a tool part's input `ListValue`, an import's `export`
//! object), sent at once on four connections: compactd must refuse every one with
//! RESOURCE_EXHAUSTED naming `max_update_bytes`, stay up under the cap and keep serving
//! a bystander.

use std::time::{Duration, Instant};

use compactd::server::pb;
use compactd::server::pb::server_event::Event;

use super::wire;
use super::*;

/// Wire size of each request: just under the default `max_update_bytes` (16 MiB).
const REQUEST_BYTES: usize = 159 * (1 << 20) / 10;
/// How long the four requests get together.
const ATTACK_LIMIT: Duration = Duration::from_secs(90);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_amplifying_requests_at_once_are_refused_naming_max_update_bytes() {
    wire::check_builders();
    let n = wire::entries_for(REQUEST_BYTES);
    let server = Capped::start(&[]).await;
    // The part's session and message exist, so only its input is at fault.
    let mut setup = server.client().await;
    open_session(&mut setup, session("amp")).await;
    put_message(&mut setup, "amp", user_msg("m1")).await;
    let bystander = Bystander::start(&server).await;

    let channels = [
        server.channel().await,
        server.channel().await,
        server.channel().await,
        server.channel().await,
    ];
    let [c1, c2, c3, c4] = channels;
    let started = Instant::now();
    let open_session = async {
        let body = wire::open_session_with_todos("amp-open", n);
        match wire::unary::<pb::SessionSummary>(c1, "/compactd.v1.Sessions/OpenSession", body).await
        {
            Ok(s) => Outcome::Answered(format!("session {} opened", s.id)),
            Err(s) => Outcome::from_status(&s),
        }
    };
    let stream_open = async {
        let update = wire::stream_open_with_todos(1, "amp-stream", n);
        let mut events = match wire::stream(c2, vec![update]).await {
            Ok(events) => events,
            Err(s) => return Outcome::from_status(&s),
        };
        loop {
            match events.message().await {
                Ok(Some(e)) => match e.event {
                    Some(Event::Ack(a)) => return Outcome::Answered(format!("acked {a:?}")),
                    Some(Event::Error(err)) => return Outcome::from_error_event(&err),
                    _ => {}
                },
                Ok(None) => {
                    return Outcome::Failed {
                        code: Code::Unknown,
                        message: "the stream ended without an answer".into(),
                    };
                }
                Err(s) => return Outcome::from_status(&s),
            }
        }
    };
    let tool_input = async {
        let body = wire::upsert_tool_part_with_list("amp", "m1", "p1", n);
        match wire::unary::<pb::UpdateResponse>(c3, "/compactd.v1.Sessions/UpsertPart", body).await
        {
            Ok(r) => Outcome::Answered(format!("{} events", r.events.len())),
            Err(s) => Outcome::from_status(&s),
        }
    };
    let import = async {
        let body = wire::import_with_list("amp-import", n);
        match wire::unary::<pb::SessionSummary>(c4, "/compactd.v1.Sessions/ImportSession", body)
            .await
        {
            Ok(s) => Outcome::Answered(format!("session {} imported", s.id)),
            Err(s) => Outcome::from_status(&s),
        }
    };
    let (a, b, c, d) = tokio::join!(
        within(ATTACK_LIMIT, open_session),
        within(ATTACK_LIMIT, stream_open),
        within(ATTACK_LIMIT, tool_input),
        within(ATTACK_LIMIT, import),
    );
    let elapsed = started.elapsed();
    let outcomes = [
        ("OpenSession todos", a),
        ("Stream open todos", b),
        ("UpsertPart input list", c),
        ("ImportSession export list", d),
    ];

    let bystander = bystander.finish().await;
    let finished = server.finish();
    let refused = outcomes
        .iter()
        .filter(|(_, o)| o.is_resource_exhausted())
        .count();
    let attacker = format!(
        "4 x {:.1} MiB ({n} empty entries each), {refused}/4 RESOURCE_EXHAUSTED; {}",
        REQUEST_BYTES as f64 / (1 << 20) as f64,
        outcomes
            .iter()
            .map(|(what, o)| format!("{what}: {}", o.brief()))
            .collect::<Vec<_>>()
            .join("; ")
    );
    report(
        "decode amplification x4",
        &finished,
        elapsed,
        &attacker,
        &bystander,
    );
    assert_survived(&finished, &bystander);
    for (what, outcome) in &outcomes {
        assert_refused(what, outcome, &["max_update_bytes"]);
    }
}
