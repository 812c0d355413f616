//! The `tokenizer` setting over the wire: what each choice counts, a Configure that
//! changes it, a refused name, and cache writes in the prediction.

use compactd::server::pb;
use compactd::server::pb::client_update::Update;
use tonic::Code;

use crate::common::*;

/// A build log: where chars ÷ 4 and a real tokenizer disagree most.
fn log(lines: usize) -> String {
    (0..lines)
        .map(|i| {
            format!(
                "[INFO] {i:05} Compiling module-{} (0x{:08x}) in {}.{:03}s /srv/app/target/m{}/classes\n",
                i % 97,
                i * 2_654_435_761usize % 4_294_967_296,
                i % 13,
                i * 7 % 1000,
                i % 31
            )
        })
        .collect()
}

fn with_tokenizer(id: &str, tokenizer: &str) -> pb::SessionInfo {
    pb::SessionInfo {
        config: Some(pb::SessionConfig {
            tokenizer: tokenizer.to_string(),
            ..Default::default()
        }),
        ..session(id)
    }
}

async fn context_tokens_of(c: &mut Client, sid: &str, tokenizer: &str, text: &str) -> u64 {
    open_session(c, with_tokenizer(sid, tokenizer)).await;
    put_message(c, sid, user_msg("u1")).await;
    put_part(c, sid, text_part("u1", "t1", "run the build")).await;
    put_message(c, sid, assistant_msg("a1", "u1")).await;
    put_part(c, sid, tool_part("a1", "b1", "bash", text)).await;
    get_context(c, sid).await.estimated_tokens
}

#[tokio::test]
async fn each_tokenizer_counts_what_it_names_and_a_configure_recounts() {
    let server = start_server_with_config(compactd::config::EngineConfig::default()).await;
    let mut c = server.client().await;
    let text = log(300);
    let chars4 = context_tokens_of(&mut c, "t-c4", "chars4", &text).await;
    let o200k = context_tokens_of(&mut c, "t-o2", "o200k", &text).await;
    let cl100k = context_tokens_of(&mut c, "t-cl", "cl100k", &text).await;
    assert!(o200k > chars4 * 13 / 10, "o200k {o200k} vs chars4 {chars4}");
    assert!(
        cl100k > chars4 * 13 / 10,
        "cl100k {cl100k} vs chars4 {chars4}"
    );
    assert_ne!(o200k, cl100k);
    // Switching the session to chars4 recounts every part it holds.
    open_session(&mut c, with_tokenizer("t-o2", "chars4")).await;
    assert_eq!(get_context(&mut c, "t-o2").await.estimated_tokens, chars4);
    // `auto` picks by model family: GPT-4 counts with cl100k.
    let gpt4 = pb::SessionInfo {
        model: Some(pb::ModelRef {
            provider_id: "openai".into(),
            model_id: "gpt-4-0613".into(),
        }),
        ..with_tokenizer("t-auto", "auto")
    };
    open_session(&mut c, gpt4).await;
    put_message(&mut c, "t-auto", user_msg("u1")).await;
    put_part(&mut c, "t-auto", text_part("u1", "t1", "run the build")).await;
    put_message(&mut c, "t-auto", assistant_msg("a1", "u1")).await;
    put_part(&mut c, "t-auto", tool_part("a1", "b1", "bash", &text)).await;
    assert_eq!(get_context(&mut c, "t-auto").await.estimated_tokens, cl100k);
}

#[tokio::test]
async fn an_unknown_tokenizer_is_refused_naming_the_field_and_changes_nothing() {
    let server = start_server().await;
    let mut c = server.client().await;
    open_session(&mut c, with_tokenizer("t-bad", "o200k")).await;
    let err = c
        .open_session(pb::OpenSessionRequest {
            session: Some(with_tokenizer("t-bad", "gpt2")),
        })
        .await
        .expect_err("refused");
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(
        err.message().contains("session.config.tokenizer") && err.message().contains("gpt2"),
        "{}",
        err.message()
    );
    let s = c
        .get_session(pb::GetSessionRequest {
            session_id: "t-bad".into(),
        })
        .await
        .expect("kept")
        .into_inner();
    let config = s.info.and_then(|i| i.config).unwrap_or_default();
    assert_eq!(config.tokenizer, "o200k");
}

#[tokio::test]
async fn cache_writes_count_in_the_prediction_not_in_used() {
    let server = start_server().await;
    let mut c = server.client().await;
    let sid = "t-write";
    open_session(&mut c, session_with_limits(sid, 200_000, 32_000)).await;
    put_usage(
        &mut c,
        sid,
        pb::TokenUsage {
            input: 1_000,
            output: 500,
            cache: Some(pb::CacheTokens {
                read: 20_000,
                write: 30_000,
            }),
            ..Default::default()
        },
    )
    .await;
    let check = check_overflow(&mut c, sid).await;
    // OpenCode's `used` leaves cache writes out; the next request carries them.
    assert_eq!(check.used, 21_500);
    assert_eq!(check.predicted, 51_500);
}

/// A stream counts the next updates' long texts ahead, on the counting threads, while
/// earlier ones wait their turn: each session still sees its updates in the order sent (a
/// second version of a part right behind the first, a cheap part behind a counted one),
/// the acks come in that order, and the counts equal those of the same updates sent one
/// by one.
#[tokio::test]
async fn a_stream_counting_ahead_keeps_each_sessions_order_and_counts() {
    let server = start_server().await;
    let mut s = server.stream().await;
    let mut c = server.client().await;
    let ids = ["ahead-0", "ahead-1", "ahead-2"];
    let steps = |n: usize| -> Vec<(Update, &'static str)> {
        vec![
            (upsert_message(user_msg("u1")), "upsert_message"),
            (
                upsert_part(text_part("u1", "t1", "run the build")),
                "upsert_part",
            ),
            (upsert_message(assistant_msg("a1", "u1")), "upsert_message"),
            (
                upsert_part(tool_part("a1", "b1", "bash", &log(60 + n))),
                "upsert_part",
            ),
            (
                upsert_part(tool_part("a1", "b1", "bash", &log(90 + n))),
                "upsert_part",
            ),
            (upsert_part(text_part("a1", "t2", "done")), "upsert_part"),
        ]
    };
    let mut sent = Vec::new();
    for id in ids {
        sent.push((s.send(id, open(with_tokenizer(id, "o200k"))).await, "open"));
        open_session(&mut c, with_tokenizer(&format!("{id}-ref"), "o200k")).await;
    }
    // Interleaved across sessions and sent before anything is read.
    for step in 0..steps(0).len() {
        for (n, id) in ids.iter().enumerate() {
            let (update, kind) = steps(n).swap_remove(step);
            sent.push((s.send(id, update.clone()).await, kind));
            let reference = format!("{id}-ref");
            match update {
                Update::UpsertMessage(m) => {
                    put_message(&mut c, &reference, m).await;
                }
                Update::UpsertPart(p) => {
                    put_part(&mut c, &reference, p).await;
                }
                other => panic!("unexpected step {other:?}"),
            }
        }
    }
    for (seq, kind) in sent {
        let events = s.reply(seq).await;
        assert_eq!(ack(&events).kind, kind, "seq {seq}: {events:?}");
    }
    for (n, id) in ids.iter().enumerate() {
        let got = get_session(&mut c, id).await;
        let parts: Vec<(String, String)> = got
            .messages
            .iter()
            .flat_map(|m| m.parts.iter())
            .map(|p| {
                let output = match &p.kind {
                    Some(pb::part::Kind::Tool(t)) => t.state.as_ref().map(|s| s.output.clone()),
                    _ => None,
                };
                (p.id.clone(), output.unwrap_or_default())
            })
            .collect();
        let want = [
            ("t1", String::new()),
            ("b1", log(90 + n)),
            ("t2", String::new()),
        ]
        .map(|(id, out)| (id.to_string(), out));
        assert_eq!(
            parts, want,
            "{id}: parts in the order sent, the last version kept"
        );
        let streamed = get_context(&mut c, id).await.estimated_tokens;
        let one_by_one = get_context(&mut c, &format!("{id}-ref"))
            .await
            .estimated_tokens;
        assert_eq!(streamed, one_by_one, "{id}");
        assert!(streamed > tokens_of(&log(90 + n)), "{id}: {streamed}");
    }
}
