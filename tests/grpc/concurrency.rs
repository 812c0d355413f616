//! Many clients at once: each session ends up with exactly its own updates.

use compactd::server::pb;
use tokio::task::JoinSet;

use crate::common::*;

const SESSIONS: usize = 100;
const TURNS: usize = 5;

fn sid(i: usize) -> String {
    format!("conc-{i:03}")
}

/// Content unique to session `i`, turn `n`.
fn text(i: usize, n: usize) -> String {
    format!("session {i} turn {n}")
}

/// The updates of session `i`: user and assistant messages with a text part and a tool
/// output each, all tagged with the session's number.
fn updates(i: usize) -> Vec<pb::client_update::Update> {
    let mut out = vec![open(session_with_limits(&sid(i), 1_000_000, 32_000))];
    for n in 0..TURNS {
        let (u, a) = (format!("u{n}"), format!("a{n}"));
        out.push(upsert_message(user_msg(&u)));
        out.push(upsert_part(text_part(&u, &format!("{u}-p"), &text(i, n))));
        out.push(upsert_message(assistant_msg(&a, &u)));
        out.push(upsert_part(tool_part(
            &a,
            &format!("{a}-t"),
            "read",
            &format!("output of {}", text(i, n)),
        )));
        out.push(upsert_message(finished(assistant_msg(&a, &u))));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hundred_clients_update_their_own_sessions_without_cross_talk() {
    let server = start_server().await;
    let url = server.url();

    let mut tasks = JoinSet::new();
    for i in 0..SESSIONS {
        let url = url.clone();
        tasks.spawn(async move {
            // Each client has its own connection; half stream, half use the unary twins.
            let channel = tonic::transport::Channel::from_shared(url)
                .unwrap()
                .connect()
                .await
                .expect("connect");
            let mut client = pb::sessions_client::SessionsClient::new(channel);
            let id = sid(i);
            if i % 2 == 0 {
                let mut s = EventStream::open(&mut client).await;
                // Pipeline every update, then read the answers in order.
                let mut seqs = Vec::new();
                for u in updates(i) {
                    seqs.push(s.send(&id, u).await);
                }
                for seq in seqs {
                    let events = s.reply(seq).await;
                    ack(&events);
                }
            } else {
                use pb::client_update::Update as U;
                for u in updates(i) {
                    match u {
                        U::Open(info) => {
                            open_session(&mut client, info).await;
                        }
                        U::UpsertMessage(m) => {
                            put_message(&mut client, &id, m).await;
                        }
                        U::UpsertPart(p) => {
                            put_part(&mut client, &id, p).await;
                        }
                        other => unreachable!("{other:?}"),
                    }
                }
            }
            i
        });
    }
    let mut done = Vec::new();
    while let Some(r) = tasks.join_next().await {
        done.push(r.expect("client task"));
    }
    assert_eq!(done.len(), SESSIONS);

    let mut c = server.client().await;
    let list = c
        .list_sessions(pb::ListSessionsRequest::default())
        .await
        .unwrap()
        .into_inner();
    let ids: Vec<_> = list.sessions.iter().map(|s| s.id.clone()).collect();
    let want: Vec<_> = (0..SESSIONS).map(sid).collect();
    assert_eq!(ids, want, "ListSessions lists all {SESSIONS}");

    // Read every session back, in parallel too (each reader on its own connection).
    let mut readers = JoinSet::new();
    for i in 0..SESSIONS {
        let mut c = server.client().await;
        readers.spawn(async move { (i, get_session(&mut c, &sid(i)).await) });
    }
    let mut read = 0;
    while let Some(r) = readers.join_next().await {
        let (i, got) = r.expect("reader task");
        assert_holds_only_its_own_content(i, &got);
        read += 1;
    }
    assert_eq!(read, SESSIONS);
}

fn assert_holds_only_its_own_content(i: usize, got: &pb::GetSessionResponse) {
    assert_eq!(got.info.as_ref().unwrap().id, sid(i));
    let summary = got.summary.as_ref().unwrap();
    assert_eq!(summary.messages as usize, 2 * TURNS, "{}", sid(i));
    assert_eq!(summary.parts as usize, 2 * TURNS, "{}", sid(i));
    let mut texts = Vec::new();
    for m in &got.messages {
        for p in &m.parts {
            match &p.kind {
                Some(pb::part::Kind::Text(t)) => texts.push(t.text.clone()),
                Some(pb::part::Kind::Tool(_)) => texts.push(tool_state(p).output.clone()),
                other => panic!("unexpected part {other:?}"),
            }
        }
    }
    let mut expected = Vec::new();
    for n in 0..TURNS {
        expected.push(text(i, n));
        expected.push(format!("output of {}", text(i, n)));
    }
    assert_eq!(texts, expected, "{} holds exactly its own content", sid(i));
    let finished = got
        .messages
        .iter()
        .filter(|m| m.info.as_ref().unwrap().finish == "stop")
        .count();
    assert_eq!(finished, TURNS, "{}", sid(i));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_writers_to_one_session_lose_no_update() {
    let server = start_server().await;
    let mut c = server.client().await;
    open_session(&mut c, session("shared")).await;
    put_message(&mut c, "shared", user_msg("u1")).await;

    const WRITERS: usize = 20;
    const PARTS: usize = 10;
    let mut tasks = JoinSet::new();
    for w in 0..WRITERS {
        let mut s = server.stream().await;
        tasks.spawn(async move {
            let mut seqs = Vec::new();
            for n in 0..PARTS {
                let id = format!("w{w}-p{n}");
                seqs.push(
                    s.send("shared", upsert_part(text_part("u1", &id, &id)))
                        .await,
                );
            }
            for seq in seqs {
                assert!(ack(&s.reply(seq).await).created);
            }
        });
    }
    while let Some(r) = tasks.join_next().await {
        r.expect("writer task");
    }
    let got = get_session(&mut c, "shared").await;
    let parts = &got.messages[0].parts;
    assert_eq!(parts.len(), WRITERS * PARTS);
    // Each writer's parts appear in the order that writer sent them.
    for w in 0..WRITERS {
        let mine: Vec<_> = parts
            .iter()
            .filter(|p| p.id.starts_with(&format!("w{w}-")))
            .map(|p| p.id.clone())
            .collect();
        let want: Vec<_> = (0..PARTS).map(|n| format!("w{w}-p{n}")).collect();
        assert_eq!(mine, want);
    }
}
