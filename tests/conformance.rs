//! Conformance with the real OpenCode, and the engine over every real trace.
//!
//! `opencode-silent-panda.json` carries OpenCode 1.2.5's own prune decisions (31 tool
//! parts with `time.compacted`). Stripping those marks and replaying the session through
//! compactd must mark exactly the same parts.

use std::collections::BTreeSet;
use std::path::PathBuf;

use compactd::config::EngineConfig;
use compactd::domain::{ModelLimits, PartKind};
use compactd::engine::{PruneMode, reference_scan};
use compactd::trace::{self, Export, replay::replay};

fn traces_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/traces")
}

fn traces() -> Vec<PathBuf> {
    let mut files: Vec<_> = std::fs::read_dir(traces_dir())
        .expect("tests/data/traces is readable")
        .map(|e| e.expect("dir entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    files.sort();
    assert_eq!(files.len(), 10, "expected the ten shared traces");
    files
}

fn load(path: &PathBuf) -> Export {
    let json = std::fs::read_to_string(path).expect("trace readable");
    trace::parse_export(&json).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn compacted_ids(export: &Export) -> BTreeSet<String> {
    export
        .messages
        .iter()
        .flat_map(|(_, parts)| parts)
        .filter(|p| matches!(&p.kind, PartKind::Tool(t) if t.state.time.compacted.is_some()))
        .map(|p| p.id.clone())
        .collect()
}

#[test]
fn silent_panda_prunes_exactly_what_opencode_pruned() {
    let mut export = load(&traces_dir().join("opencode-silent-panda.json"));
    let opencode = compacted_ids(&export);
    assert_eq!(opencode.len(), 31, "the trace README promises 31 marks");
    assert_eq!(trace::strip_compacted(&mut export), 31);

    // Feed it as a live host would; prune runs after every finished assistant message.
    // Overflow (and so the limits) plays no part in prune: use an unlimited context.
    let mut session = trace::load(
        Export {
            info: export.info.clone(),
            messages: Vec::new(),
        },
        ModelLimits::default(),
        Default::default(),
        &opencode_config(),
    )
    .expect("empty session");
    let config = opencode_config();
    for (info, parts) in &export.messages {
        let mut first = info.clone();
        first.finish.clear();
        first.time.completed = None;
        compactd::engine::step(
            &mut session,
            compactd::engine::Update::UpsertMessage(first),
            &config,
            1,
        )
        .expect("message");
        for p in parts {
            compactd::engine::step(
                &mut session,
                compactd::engine::Update::UpsertPart(p.clone()),
                &config,
                1,
            )
            .expect("part");
        }
        compactd::engine::step(
            &mut session,
            compactd::engine::Update::UpsertMessage(info.clone()),
            &config,
            1,
        )
        .expect("finish");
    }
    let ours: BTreeSet<String> = session
        .messages()
        .iter()
        .flat_map(|m| &m.parts)
        .filter(|p| p.is_compacted())
        .map(|p| p.part.id.clone())
        .collect();
    assert_eq!(ours, opencode);
}

/// OpenCode's prune alone, as the `OPENCODE` preset resolves it: OpenCode's own counts
/// (JavaScript length ÷ 4), applied as soon as it decides (no prompt cache to protect),
/// the strategies off.
fn opencode_config() -> EngineConfig {
    let opencode = compactd::config::SessionOverrides {
        preset: Some(compactd::config::OverflowPreset::OpenCode),
        ..Default::default()
    };
    let config = EngineConfig {
        strategies: compactd::config::StrategySet::NONE,
        ..EngineConfig::default().resolve(&opencode)
    };
    assert_eq!(config.tokenizer, compactd::tokens::Tokenizer::Chars4);
    assert_eq!(config.cache_model, compactd::config::CacheModel::NONE);
    config
}

#[test]
fn silent_panda_replay_reports_the_same_31() {
    let mut export = load(&traces_dir().join("opencode-silent-panda.json"));
    trace::strip_compacted(&mut export);
    let report = replay(
        &export,
        ModelLimits {
            context: 128_000,
            input: 0,
            output: 32_000,
        },
        &opencode_config(),
    );
    assert_eq!(report.total_pruned().0, 31);
    assert!(
        report.overflow_steps().count() > 0,
        "silent-panda peaks near 124k reported tokens"
    );
}

#[test]
fn every_trace_imports_and_replays() {
    for path in traces() {
        let export = load(&path);
        let n = export.messages.len();
        let parts: usize = export.messages.iter().map(|(_, p)| p.len()).sum();
        let session = trace::load(
            export.clone(),
            ModelLimits {
                context: 128_000,
                input: 0,
                output: 32_000,
            },
            Default::default(),
            &EngineConfig::default(),
        )
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert_eq!(session.messages().len(), n, "{}", path.display());
        assert_eq!(session.part_count(), parts, "{}", path.display());
        let ctx = session.build_context();
        assert!(ctx.tokens > 0, "{}", path.display());
        assert_eq!(ctx.tokens, session.context_tokens(), "{}", path.display());

        let report = replay(
            &export,
            ModelLimits {
                context: 128_000,
                input: 0,
                output: 32_000,
            },
            &EngineConfig::default(),
        );
        let finished = export
            .messages
            .iter()
            .filter(|(m, _)| m.is_finished())
            .count();
        assert_eq!(report.rows.len(), finished, "{}", path.display());
        for row in &report.rows {
            assert!(
                row.pruned <= row.baseline,
                "{} step {}",
                path.display(),
                row.step
            );
        }
    }
}

#[test]
fn imported_session_prune_matches_reference_scan() {
    // After an import (no automatic prune) the incremental index must agree with the
    // seed's literal algorithm on every real trace.
    for path in traces() {
        let mut export = load(&path);
        trace::strip_compacted(&mut export);
        let config = EngineConfig::default();
        let mut session =
            trace::load(export, ModelLimits::default(), Default::default(), &config).expect("load");
        let report = session.prune(PruneMode::DryRun, 0);
        let users: Vec<usize> = session
            .messages()
            .iter()
            .enumerate()
            .filter(|(_, m)| m.info.role == compactd::domain::Role::User)
            .map(|(i, _)| i)
            .collect();
        let end = compactd::engine::eligible_end(&users, session.messages().len(), 2);
        let plan = reference_scan(session.messages(), end, session.settings());
        let expected: Vec<String> = plan
            .prune
            .iter()
            .map(|c| session.messages()[c.msg].parts[c.part].part.id.clone())
            .collect();
        let got: Vec<String> = report.parts.iter().map(|p| p.part_id.clone()).collect();
        assert_eq!(got, expected, "{}", path.display());
        assert_eq!(report.tokens_saved, plan.pruned, "{}", path.display());
    }
}

#[test]
fn unknown_export_fields_are_kept() {
    let export = load(&traces_dir().join("opencode-silent-panda.json"));
    // Session, message and part fields compactd does not model survive in `extra`.
    assert_eq!(export.info.extra["slug"], "silent-panda");
    assert!(export.info.extra.contains_key("projectID"));
    let (user, user_parts) = &export.messages[0];
    assert_eq!(user.extra["variant"], "xhigh");
    // A user message's `summary` is OpenCode's UI object, not the compaction flag.
    assert!(!user.summary);
    assert!(user.extra["summary"]["title"].is_string());
    let file = user_parts
        .iter()
        .find(|p| p.kind.type_name() == "file")
        .expect("a file part");
    match &file.kind {
        PartKind::File(f) => assert_eq!(
            f.source.as_ref().expect("source")["path"],
            "docs/external/duckdb/"
        ),
        _ => unreachable!("filtered on type"),
    }
    let (assistant, _) = &export.messages[1];
    assert_eq!(
        assistant.extra["path"]["cwd"],
        "/Users/alex/repos/vfp/dark-factory"
    );
    let t = assistant.tokens.expect("tokens");
    assert_eq!(
        (t.total, t.input, t.output, t.reasoning),
        (Some(17969), 17490, 479, 341)
    );
}
