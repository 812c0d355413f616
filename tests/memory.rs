//! Memory test: 1,000 sessions of realistic size, built from the real traces in
//! `tests/data/traces/`, held in one store under the default memory budget.
//!
//! Its own test binary because it installs a counting global allocator: the bytes the
//! store says it holds are checked against the bytes the process really allocated for
//! them, and the report (printed; run with `--nocapture` to see it) sets both against the
//! raw text the sessions carry.
//!
//! `COMPACTD_MEMORY_SESSIONS` changes the number of sessions (default 1,000).

#[path = "support/counting_alloc.rs"]
mod counting_alloc;

use std::path::PathBuf;

use compactd::config::EngineConfig;
use compactd::domain::{ModelLimits, Part, PartKind};
use compactd::engine::{PruneMode, Update};
use compactd::store::{DEFAULT_MAX_SESSION_BYTES, DEFAULT_MEMORY_BUDGET, Limits, Store};
use compactd::trace::{Export, load, parse_export};
use counting_alloc::allocated;

fn traces() -> Vec<(String, String)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/traces");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("tests/data/traces")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    files.sort();
    files
        .into_iter()
        .map(|p| {
            let name = p
                .file_stem()
                .unwrap_or_default()
                .to_string_lossy()
                .into_owned();
            (name, std::fs::read_to_string(&p).expect("trace"))
        })
        .collect()
}

/// The text a part carries for the model: what an agent host would have to keep anyway.
fn text_bytes(p: &Part) -> usize {
    match &p.kind {
        PartKind::Text(t) => t.text.len(),
        PartKind::Reasoning(r) => r.text.len(),
        PartKind::Tool(t) => {
            let s = &t.state;
            s.input.to_string().len() + s.output.len() + s.error.len() + s.title.len()
        }
        PartKind::Subtask(s) => s.prompt.len() + s.description.len(),
        _ => 0,
    }
}

struct Template {
    name: String,
    export: Export,
    json_bytes: usize,
    text_bytes: usize,
}

fn mib(b: usize) -> f64 {
    b as f64 / (1024.0 * 1024.0)
}

/// The tests compare the process's allocations with the store's figures: one at a time.
static ALONE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_real_sessions_fit_the_default_budget_and_the_count_matches_the_allocator() {
    let _alone = ALONE.lock().await;
    let n: usize = std::env::var("COMPACTD_MEMORY_SESSIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000);
    let templates: Vec<Template> = traces()
        .into_iter()
        .map(|(name, json)| {
            let export = parse_export(&json).expect("trace parses");
            let text_bytes = export
                .messages
                .iter()
                .flat_map(|(_, parts)| parts)
                .map(text_bytes)
                .sum();
            Template {
                name,
                json_bytes: json.len(),
                text_bytes,
                export,
            }
        })
        .collect();
    assert_eq!(templates.len(), 10, "the ten shared traces");

    let config = EngineConfig::default();
    // The tokenizer's tables and count cache are the process's, loaded once (the server
    // loads them at start): not what a session holds.
    compactd::tokens::warm_up(config.tokenizer.resolve(""));
    let limits = Limits {
        max_sessions: 10_000,
        max_session_bytes: DEFAULT_MAX_SESSION_BYTES,
        memory_budget: DEFAULT_MEMORY_BUDGET,
    };
    let store = Store::new(config.clone()).with_limits(limits);

    // One row per trace: bytes the store counts for one session of it, bytes the
    // allocator saw that session take, and what the session carries.
    let mut rows = Vec::new();
    let (mut json_total, mut text_total) = (0usize, 0usize);
    let before = allocated();
    for i in 0..n {
        let t = &templates[i % templates.len()];
        let start = allocated();
        let mut export = t.export.clone();
        export.info.id = format!("{}-{i}", t.name);
        let session = load(
            export,
            ModelLimits {
                context: 200_000,
                input: 0,
                output: 32_000,
            },
            Default::default(),
            &config,
        )
        .expect("trace loads");
        let counted = session.held_bytes();
        let real = allocated() - start;
        store
            .insert(session, false)
            .await
            .unwrap_or_else(|e| panic!("session {i} of {n} refused: {e}"));
        json_total += t.json_bytes;
        text_total += t.text_bytes;
        if i < templates.len() {
            rows.push((t.name.clone(), t.json_bytes, t.text_bytes, counted, real));
        }
    }
    // Let the actors start and report their figures (they add them as they spawn).
    tokio::task::yield_now().await;
    let real_total = allocated() - before;
    let held = store.held_bytes();

    println!(
        "\n{:<32} {:>10} {:>10} {:>12} {:>12} {:>7} {:>7}",
        "trace (one session)", "json", "text", "held", "allocated", "held/t", "held/a"
    );
    for (name, json, text, counted, real) in &rows {
        println!(
            "{:<32} {:>10} {:>10} {:>12} {:>12} {:>7.2} {:>7.2}",
            name,
            json,
            text,
            counted,
            real,
            *counted as f64 / *text as f64,
            *counted as f64 / *real as f64
        );
    }
    println!(
        "\n{n} sessions: raw json {:.1} MiB, raw text {:.1} MiB, held {:.1} MiB ({:.2}x text), \
         allocated {:.1} MiB (held/allocated {:.2}), budget {:.0} MiB",
        mib(json_total),
        mib(text_total),
        mib(held as usize),
        held as f64 / text_total as f64,
        mib(real_total),
        held as f64 / real_total as f64,
        mib(DEFAULT_MEMORY_BUDGET as usize),
    );

    assert_eq!(store.len(), n);
    assert!(
        held <= DEFAULT_MEMORY_BUDGET,
        "{held} bytes held > budget {DEFAULT_MEMORY_BUDGET}"
    );
    // The figure the limits act on is honest: within 20% of what was really allocated,
    // per trace and in total.
    for (name, _, _, counted, real) in &rows {
        let ratio = *counted as f64 / *real as f64;
        assert!(
            (0.8..=1.2).contains(&ratio),
            "{name}: counted {counted} vs allocated {real} ({ratio:.2})"
        );
    }
    let ratio = held as f64 / real_total as f64;
    assert!(
        (0.8..=1.2).contains(&ratio),
        "store counts {held} bytes, the allocator saw {real_total} ({ratio:.2})"
    );
    // Every session is held once: deleting them all gives the memory back.
    let ids: Vec<String> = store.list().iter().map(|h| h.id().to_string()).collect();
    for id in ids {
        store.remove(&id).await.expect("removed");
    }
    for _ in 0..100 {
        if store.held_bytes() == 0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert_eq!(
        store.held_bytes(),
        0,
        "bytes still counted after every delete"
    );
}

/// The strategies' keys copy client text (a search's other input fields as JSON, where a
/// control character takes six bytes): a session of such calls must still be counted at
/// what it allocates, so the limits hold.
#[test]
fn searches_with_escaped_input_are_counted_at_what_they_allocate() {
    let _alone = ALONE.blocking_lock();
    let config = EngineConfig::default();
    compactd::tokens::warm_up(config.tokenizer.resolve(""));
    let (_, json) = traces()
        .into_iter()
        .find(|(name, _)| name == "opencode-jolly-eagle")
        .expect("the trace");
    let export = parse_export(&json).expect("trace parses");
    let template = export
        .messages
        .iter()
        .flat_map(|(_, parts)| parts)
        .find(|p| matches!(p.kind, PartKind::Tool(_)))
        .expect("a tool part")
        .clone();
    let message_id = export
        .messages
        .iter()
        .rev()
        .find(|(m, _)| m.role == compactd::domain::Role::Assistant)
        .expect("an assistant message")
        .0
        .id
        .clone();
    let limits = ModelLimits {
        context: 200_000,
        input: 0,
        output: 32_000,
    };
    let mut session = load(export, limits, Default::default(), &config).expect("loads");
    // A commit builds the strategies' state a load leaves to the first one.
    session.prune(PruneMode::Commit, 0);
    let (held_before, start) = (session.held_bytes(), allocated());
    // Written as a host writes them: each call as an update.
    for i in 0..16 {
        let mut p = template.clone();
        p.id = format!("prt_escaped_{i}");
        p.message_id = message_id.clone();
        if let PartKind::Tool(t) = &mut p.kind {
            t.tool = if i % 2 == 0 { "grep" } else { "webfetch" }.into();
            t.call_id = format!("call_escaped_{i}");
            t.state.status = compactd::domain::ToolStatus::Completed;
            t.state.input = serde_json::json!({
                "pattern": format!("p{i}"),
                "url": format!("https://example.com/{i}"),
                "path": "/",
                "z": "\u{1}".repeat(128 * 1024),
            });
            t.state.output = "x".into();
        }
        session
            .apply(Update::UpsertPart(p), &config)
            .expect("the call is written");
    }
    let counted = session.held_bytes() - held_before;
    let real = allocated() - start;
    let ratio = counted as f64 / real as f64;
    println!("16 calls with escaped input: counted {counted}, allocated {real} ({ratio:.2})");
    assert!(
        (0.8..=1.2).contains(&ratio),
        "counted {counted} vs allocated {real} ({ratio:.2})"
    );
}
