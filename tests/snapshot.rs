//! Snapshots and the change log over every real trace: each trace fed through
//! `engine::step` message by message (as `compactd replay` and a live host do) with the
//! default config, automatic compactions committed with a stand-in summary, and
//! - snapshots taken at a few cut points, decoded and fed the rest: every result and the
//!   final session equal the original's;
//! - a snapshot of the empty session plus every change, replayed from its encoded form:
//!   the live session exactly.
//!
//! `snapshot_throughput` prints encode/decode speed and size on the largest trace (run it
//! with `cargo test --release --test all snapshot_throughput -- --nocapture`).

use std::path::PathBuf;
use std::time::Instant;

use compactd::config::EngineConfig;
use compactd::domain::{ModelLimits, PartKind, Role};
use compactd::engine::{
    Change, CommitIds, CompactionRequest, ContextCache, Event, Message, Performed, Session,
    SummaryOutcome, TailOptions, Trigger, Update, decode_change, decode_session,
    default_tail_tokens, encode_change, encode_session,
};
use compactd::trace::{self, Export};

fn traces() -> Vec<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/traces");
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .expect("tests/data/traces is readable")
        .map(|e| e.expect("dir entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no traces");
    files
}

/// `c` as the change log holds it (encoded and decoded): a compaction plan without the
/// session value it was made on.
fn logged(c: Change) -> Change {
    decode_change(&encode_change(&c)).unwrap_or_else(|e| panic!("the change decodes: {e}"))
}

fn load(path: &PathBuf) -> Export {
    let json = std::fs::read_to_string(path).expect("trace readable");
    trace::parse_export(&json).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A window small enough that the longer traces overflow and compact.
const LIMITS: ModelLimits = ModelLimits {
    context: 128_000,
    input: 0,
    output: 16_000,
};

fn fresh(export: &Export) -> Session {
    let mut info = export.info.clone();
    info.limits = LIMITS;
    Session::new(info, &EngineConfig::default())
}

/// The trace as the changes a live host would cause: each message unfinished, its parts,
/// then finished (host time: the message's), and on `CompactionNeeded` a compaction
/// committed with a short stand-in summary and its outcome recorded. Each change is
/// performed on a live session as it is made (a plan comes from the session as it is).
/// Returns the changes and what each returned.
fn changes_of(export: &Export) -> (Vec<Change>, Vec<Performed>) {
    let config = EngineConfig::default();
    let mut live = fresh(export);
    let mut changes = Vec::new();
    let mut results = Vec::new();
    let mut compactions = 0;
    for (info, parts) in &export.messages {
        let now = info.time.completed.unwrap_or(info.time.created);
        let mut first = info.clone();
        let assistant = info.role == Role::Assistant;
        if assistant {
            first.finish.clear();
            first.time.completed = None;
        }
        let mut updates = vec![Update::UpsertMessage(first)];
        updates.extend(parts.iter().cloned().map(Update::UpsertPart));
        if assistant && info.is_finished() {
            updates.push(Update::UpsertMessage(info.clone()));
        }
        for update in updates {
            let change = Change::Step {
                update,
                now_ms: now,
            };
            let performed = live.perform(change.clone(), &config);
            let needed = matches!(&performed, Performed::Step(Ok(r))
                if r.events.iter().any(|e| matches!(e, Event::CompactionNeeded(_))));
            changes.push(change);
            results.push(performed);
            if !needed {
                continue;
            }
            let request = CompactionRequest {
                tail: TailOptions {
                    turns: 2,
                    max_tokens: default_tail_tokens(live.info().limits.usable_input()),
                },
                auto: true,
                overflow: true,
            };
            let Ok(plan) = live.plan_compaction(request) else {
                continue;
            };
            compactions += 1;
            // As the log holds it: the changes are replayed on other session values than
            // `live`, and a live plan's commit on another value is stale.
            let commit = logged(Change::CommitCompaction {
                plan,
                outcome: SummaryOutcome {
                    text: format!("Summary {compactions}: the work so far, in brief."),
                    usage: None,
                    cost: 0.0,
                    model: None,
                },
                ids: CommitIds {
                    prefix: format!("cmp_{compactions}"),
                },
                now_ms: now,
            });
            let committed = live.perform(commit.clone(), &config);
            let ok = matches!(committed, Performed::CommitCompaction(Ok(_)));
            changes.push(commit);
            results.push(committed);
            let record = Change::RecordCompaction { auto: true, ok };
            results.push(live.perform(record.clone(), &config));
            changes.push(record);
        }
    }
    (changes, results)
}

/// A part's byte figure describes its allocation (a decoder's differs): cleared.
fn without_bytes(messages: &[Message]) -> Vec<Message> {
    let mut messages = messages.to_vec();
    for p in messages.iter_mut().flat_map(|m| &mut m.parts) {
        p.bytes = 0;
    }
    messages
}

/// The two sessions are the same: every stored figure, the context and the overflow check.
fn assert_same(a: &Session, b: &Session, what: &str) {
    assert!(
        encode_session(a) == encode_session(b),
        "{what}: the stored state differs"
    );
    let (ca, cb) = (a.build_context(), b.build_context());
    assert_eq!(ca.tokens, cb.tokens, "{what}: context tokens");
    assert_eq!(
        ca.boundary_message_id, cb.boundary_message_id,
        "{what}: boundary"
    );
    assert!(
        without_bytes(&ca.messages) == without_bytes(&cb.messages),
        "{what}: the context differs"
    );
    assert_eq!(
        a.check_overflow(Trigger::Request),
        b.check_overflow(Trigger::Request),
        "{what}: overflow check"
    );
    assert_eq!(
        (a.total_tokens(), a.compacted_count(), a.auto_state()),
        (b.total_tokens(), b.compacted_count(), b.auto_state()),
        "{what}: figures"
    );
}

#[test]
fn snapshots_taken_mid_trace_go_on_like_the_original() {
    let config = EngineConfig::default();
    for path in traces() {
        let name = path.file_name().map(|n| n.to_string_lossy().to_string());
        let name = name.unwrap_or_default();
        let export = load(&path);
        let (changes, results) = changes_of(&export);
        let n = changes.len();
        let cuts = [n / 5, n / 2, n * 4 / 5];
        let mut live = fresh(&export);
        let mut snapshots = Vec::new();
        for (i, c) in changes.iter().enumerate() {
            if cuts.contains(&i) {
                snapshots.push((i, encode_session(&live)));
            }
            live.perform(c.clone(), &config);
        }
        for (cut, bytes) in snapshots {
            let mut restored =
                decode_session(&bytes).unwrap_or_else(|e| panic!("{name}: snapshot at {cut}: {e}"));
            for (i, c) in changes.iter().enumerate().skip(cut) {
                let got = restored.perform(c.clone(), &config);
                assert!(
                    got == results[i],
                    "{name}: change {i} ({}) after a snapshot at {cut}: {got:?} vs {:?}",
                    c.kind(),
                    results[i]
                );
            }
            assert_same(&live, &restored, &format!("{name}, cut at {cut} of {n}"));
        }
    }
}

#[test]
fn a_snapshot_and_the_encoded_log_replay_every_trace() {
    let config = EngineConfig::default();
    let mut compacted = 0;
    for path in traces() {
        let name = path.display().to_string();
        let export = load(&path);
        let (changes, _) = changes_of(&export);
        let mut live = fresh(&export);
        let snapshot = encode_session(&live);
        let mut log = Vec::new();
        for c in &changes {
            let bytes = encode_change(c);
            if live.perform(c.clone(), &config).changed() {
                log.push(bytes);
            }
        }
        compacted += usize::from(live.build_context().boundary_message_id.is_some());
        let mut replayed = decode_session(&snapshot).expect("snapshot");
        for bytes in &log {
            let change = decode_change(bytes).unwrap_or_else(|e| panic!("{name}: {e}"));
            replayed.perform(change, &config);
        }
        assert_same(&live, &replayed, &name);
    }
    assert!(compacted > 0, "some trace compacts under {LIMITS:?}");
}

/// All along every trace (prunes, strategy marks and their rollbacks, usage reports,
/// compactions): `Session::context_openai` (parts borrowed; the protobuf shape is written
/// from the same walk) reads exactly as the view's `to_openai` (parts copied), checked
/// every 40 changes; and after every change, the context built from a cache kept across
/// the changes (each message rendered again only when it changed) is exactly that text.
#[test]
fn the_openai_context_equals_the_views_and_its_cached_rendering() {
    let config = EngineConfig::default();
    for path in traces() {
        let name = path.display().to_string();
        let export = load(&path);
        let (changes, _) = changes_of(&export);
        let mut live = fresh(&export);
        let mut cache = ContextCache::default();
        let n = changes.len();
        for (i, c) in changes.into_iter().enumerate() {
            live.perform(c, &config);
            let openai = live.context_openai();
            let cached = live.context_openai_cached(&mut cache);
            assert!(cached == openai, "{name}: cached, after change {i}");
            if i % 40 == 0 || i + 1 == n {
                let view = live.build_context();
                let parsed: serde_json::Value =
                    serde_json::from_str(&openai.json).expect("the JSON shape parses");
                assert_eq!(parsed, view.to_openai(), "{name}: after change {i}");
                assert_eq!(
                    (openai.tokens, openai.context_messages),
                    (view.tokens, view.messages.len()),
                    "{name}: after change {i}"
                );
                assert_eq!(openai.boundary_message_id, view.boundary_message_id);
            }
        }
        assert!(!cache.is_empty(), "{name}: the cache holds the context");
    }
}

#[test]
fn snapshot_throughput() {
    let path = traces()
        .into_iter()
        .max_by_key(|p| std::fs::metadata(p).map(|m| m.len()).unwrap_or(0))
        .expect("a trace");
    let export = load(&path);
    let export_bytes = std::fs::metadata(&path).map_or(0, |m| m.len());
    let (changes, _) = changes_of(&export);
    let config = EngineConfig::default();
    let mut live = fresh(&export);
    for c in &changes {
        live.perform(c.clone(), &config);
    }
    let text: usize = live
        .messages()
        .iter()
        .flat_map(|m| &m.parts)
        .map(|p| match &p.part.kind {
            PartKind::Text(t) => t.text.len(),
            PartKind::Reasoning(r) => r.text.len(),
            PartKind::Tool(t) => {
                t.state.output.len() + t.state.error.len() + t.state.input.to_string().len()
            }
            _ => 0,
        })
        .sum();
    let runs = 5;
    let began = Instant::now();
    let mut bytes = Vec::new();
    for _ in 0..runs {
        bytes = encode_session(&live);
    }
    let encode = began.elapsed().as_secs_f64() / f64::from(runs);
    let began = Instant::now();
    for _ in 0..runs {
        let restored = decode_session(&bytes).expect("decodes");
        assert_eq!(restored.messages().len(), live.messages().len());
    }
    let decode = began.elapsed().as_secs_f64() / f64::from(runs);
    let change_bytes: usize = changes.iter().map(|c| encode_change(c).len()).sum();
    let began = Instant::now();
    for c in &changes {
        let _ = decode_change(&encode_change(c)).expect("change");
    }
    let log = began.elapsed().as_secs_f64();
    let mb = bytes.len() as f64 / 1e6;
    println!(
        "{}: {} messages, {} parts; snapshot {:.2} MB ({:.2}x the export's {:.2} MB, {:.2}x \
         the {:.2} MB of part text: infos' extra fields and tool metadata are kept); \
         encode {:.1} ms ({:.0} MB/s), decode {:.1} ms ({:.0} MB/s); log of {} changes \
         {:.2} MB, encoded and decoded in {:.1} ms ({:.0} MB/s)",
        path.file_name()
            .map(|n| n.to_string_lossy())
            .unwrap_or_default(),
        live.messages().len(),
        live.part_count(),
        mb,
        bytes.len() as f64 / export_bytes.max(1) as f64,
        export_bytes as f64 / 1e6,
        bytes.len() as f64 / text.max(1) as f64,
        text as f64 / 1e6,
        encode * 1e3,
        mb / encode,
        decode * 1e3,
        mb / decode,
        changes.len(),
        change_bytes as f64 / 1e6,
        log * 1e3,
        change_bytes as f64 / 1e6 / log,
    );
}
