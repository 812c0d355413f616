//! Engine cost of one update on sessions of 100, 1,000 and 10,000 messages built from the
//! shared real traces (messages cycled with fresh ids). The figures must not grow with
//! session length: estimates are cached per part, usage is a running sum, and the prune
//! decision is an incremental window.
//!
//! Run: `cargo bench --bench engine`. Each session keeps growing while it is measured (as
//! a live one does), so automatic prune commits happen at their natural rate and their cost
//! is included, amortized.
//!
//! The engine's own cost is measured counting chars ÷ 4 (a few nanoseconds per text); the
//! `_o200k` benches count with real BPE, the outputs (the same 4 KB each time) from the
//! count cache as the server's precount leaves them, the short texts (inputs, placeholders)
//! counted in place.

use std::cell::Cell;
use std::path::PathBuf;

use compactd::config::EngineConfig;
use compactd::domain::{
    MessageInfo, ModelLimits, Part, PartKind, Role, TextPart, TokenUsage, ToolPart, ToolState,
    ToolStatus,
};
use compactd::engine::{Session, Update, step};
use compactd::trace::{self, Export};

// The binary's allocator (src/main.rs), so the figures are those of the engine inside
// compactd: under glibc's malloc, growing part vectors and 4 KB outputs made `_int_malloc`
// over half of a strategy turn's instructions.
#[cfg(not(target_env = "msvc"))]
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() {
    divan::main();
}

const SIZES: &[usize] = &[100, 1_000, 10_000];

/// All messages of all traces, in file order.
fn corpus() -> Vec<(MessageInfo, Vec<Part>)> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/traces");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .expect("tests/data/traces readable")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    files.sort();
    let mut all = Vec::new();
    for f in files {
        let mut export =
            trace::parse_export(&std::fs::read_to_string(&f).expect("read")).expect("parse");
        trace::strip_compacted(&mut export);
        all.extend(export.messages);
    }
    all
}

/// A session of exactly `n` messages, cycling the corpus with unique ids.
fn session_of(n: usize) -> Session {
    let corpus = corpus();
    let mut messages = Vec::with_capacity(n);
    for i in 0..n {
        let (info, parts) = &corpus[i % corpus.len()];
        let round = i / corpus.len();
        let mut info = info.clone();
        info.id = format!("{}~{round}", info.id);
        let parts = parts
            .iter()
            .map(|p| {
                let mut p = p.clone();
                p.id = format!("{}~{round}", p.id);
                p.message_id = info.id.clone();
                p
            })
            .collect();
        messages.push((info, parts));
    }
    let export = Export {
        info: Default::default(),
        messages,
    };
    let mut export = export;
    export.info.id = format!("bench-{n}");
    let limits = ModelLimits {
        context: 200_000,
        input: 0,
        output: 32_000,
    };
    let mut s = trace::load(export, limits, Default::default(), &chars4()).expect("load");
    // Settle: the first prune after an import scans the whole history once.
    let _ = s.prune(compactd::engine::PruneMode::Commit, 0);
    s
}

fn output_of(bytes: usize) -> String {
    let line =
        "src/engine/prune.rs:42:    let tokens = stored.est.output; // realistic grep-ish line\n";
    line.repeat(bytes / line.len() + 1)
}

struct Feeder {
    session: Session,
    config: EngineConfig,
    next: Cell<u64>,
    output: String,
}

impl Feeder {
    fn new(n: usize) -> Feeder {
        Feeder::with_config(n, chars4())
    }

    /// A feeder whose session and updates run with `config` (same session content).
    fn with_config(n: usize, config: EngineConfig) -> Feeder {
        let mut session = session_of(n);
        // Re-resolve the settings from `config` (a Configure with no changes does that).
        let info = session.info().clone();
        let _ = session.apply(Update::Configure(info), &config);
        let _ = session.prune(compactd::engine::PruneMode::Commit, 0);
        Feeder {
            session,
            config,
            next: Cell::new(0),
            output: output_of(4_096),
        }
    }

    /// A completed call of `tool` with `input` and a 4 KB output.
    fn call(&mut self, message_id: &str, tool: &str, input: serde_json::Value) {
        let mut state = ToolState::new(ToolStatus::Completed);
        state.output = self.output.clone();
        state.input = input;
        let call = self.id("call");
        self.apply(Update::UpsertPart(Part {
            id: self.id("prt"),
            message_id: message_id.to_string(),
            kind: PartKind::Tool(Box::new(ToolPart {
                call_id: call,
                tool: tool.into(),
                state,
                metadata: None,
            })),
            mark: None,
            extra: Default::default(),
        }));
    }

    fn id(&self, kind: &str) -> String {
        let n = self.next.get();
        self.next.set(n + 1);
        format!("bench_{kind}_{n}")
    }

    // Not inlined, so a profiler can single out the engine's share (callgrind
    // `--toggle-collect='engine::Feeder::apply'`).
    #[inline(never)]
    fn apply(&mut self, u: Update) {
        let r = step(&mut self.session, u, &self.config, 1);
        divan::black_box(r.expect("bench update applies"));
    }

    fn user(&mut self) -> String {
        let id = self.id("msg");
        self.apply(Update::UpsertMessage(MessageInfo::new(
            id.clone(),
            Role::User,
        )));
        let pid = self.id("prt");
        self.apply(Update::UpsertPart(Part {
            id: pid,
            message_id: id.clone(),
            kind: PartKind::Text(TextPart {
                text: "continue with the next file".into(),
                ..Default::default()
            }),
            mark: None,
            extra: Default::default(),
        }));
        id
    }

    fn assistant(&mut self, parent: &str) -> MessageInfo {
        let mut info = MessageInfo::new(self.id("msg"), Role::Assistant);
        info.parent_id = parent.to_string();
        self.apply(Update::UpsertMessage(info.clone()));
        info
    }

    fn tool(&mut self, message_id: &str) {
        let mut state = ToolState::new(ToolStatus::Completed);
        state.output = self.output.clone();
        let call = self.id("call");
        self.apply(Update::UpsertPart(Part {
            id: self.id("prt"),
            message_id: message_id.to_string(),
            kind: PartKind::Tool(Box::new(ToolPart {
                call_id: call,
                tool: "grep".into(),
                state,
                metadata: None,
            })),
            mark: None,
            extra: Default::default(),
        }));
    }

    fn finish(&mut self, mut info: MessageInfo) {
        info.finish = "tool-calls".into();
        info.tokens = Some(TokenUsage {
            input: 50_000,
            output: 300,
            ..Default::default()
        });
        self.apply(Update::UpsertMessage(info));
    }
}

/// The server defaults, counting chars ÷ 4.
fn chars4() -> EngineConfig {
    EngineConfig {
        tokenizer: compactd::tokens::Tokenizer::Chars4,
        ..EngineConfig::default()
    }
}

/// The server defaults, counting with o200k.
fn o200k() -> EngineConfig {
    EngineConfig {
        tokenizer: compactd::tokens::Tokenizer::O200k,
        ..EngineConfig::default()
    }
}

/// One tool part with a 4 KB output written into an open assistant message.
#[divan::bench(args = SIZES)]
fn upsert_tool_part(bencher: divan::Bencher, n: usize) {
    let mut f = Feeder::new(n);
    let user = f.user();
    let open = f.assistant(&user);
    bencher.bench_local(|| f.tool(&open.id));
}

/// [`upsert_tool_part`] counting with o200k.
#[divan::bench(args = SIZES)]
fn upsert_tool_part_o200k(bencher: divan::Bencher, n: usize) {
    let mut f = Feeder::with_config(n, o200k());
    let user = f.user();
    let open = f.assistant(&user);
    bencher.bench_local(|| f.tool(&open.id));
}

/// An assistant message finishing: usage recorded, overflow check, prune decision (and
/// the occasional commit).
#[divan::bench(args = SIZES)]
fn finish_assistant_message(bencher: divan::Bencher, n: usize) {
    let mut f = Feeder::new(n);
    let user = f.user();
    bencher.bench_local(|| {
        let info = f.assistant(&user);
        f.tool(&info.id);
        f.finish(info);
    });
}

/// A turn the strategies act on: read one of 50 files, `git status`, edit the next file,
/// finish (8 updates); reads and edits of a file supersede its earlier operations, each
/// `git status` the previous one. Compare with `strategy_turn_off` for their cost.
#[divan::bench(args = SIZES)]
fn strategy_turn(bencher: divan::Bencher, n: usize) {
    let mut f = Feeder::new(n);
    let mut i = 0usize;
    bencher.bench_local(|| strategy_step(&mut f, &mut i));
}

/// [`strategy_turn`] counting with o200k.
#[divan::bench(args = SIZES)]
fn strategy_turn_o200k(bencher: divan::Bencher, n: usize) {
    let mut f = Feeder::with_config(n, o200k());
    let mut i = 0usize;
    bencher.bench_local(|| strategy_step(&mut f, &mut i));
}

/// `strategy_turn` with every strategy off (OpenCode's prune alone).
#[divan::bench(args = SIZES)]
fn strategy_turn_off(bencher: divan::Bencher, n: usize) {
    let config = EngineConfig {
        strategies: compactd::config::StrategySet::NONE,
        ..chars4()
    };
    let mut f = Feeder::with_config(n, config);
    let mut i = 0usize;
    bencher.bench_local(|| strategy_step(&mut f, &mut i));
}

#[inline(never)]
fn strategy_step(f: &mut Feeder, i: &mut usize) {
    *i += 1;
    let user = f.user();
    let info = f.assistant(&user);
    let file = |k: usize| serde_json::json!({"filePath": format!("src/module_{}.rs", k % 50)});
    f.call(&info.id, "read", file(*i));
    f.call(
        &info.id,
        "bash",
        serde_json::json!({"command": "git status"}),
    );
    let mut edit = file(*i + 1);
    edit["oldString"] = "fn old() {}".into();
    edit["newString"] = "fn new() {}".into();
    f.call(&info.id, "edit", edit);
    f.finish(info);
}

/// A whole turn: user message + text, assistant message, one tool call, finish (6 updates).
#[divan::bench(args = SIZES)]
fn full_turn(bencher: divan::Bencher, n: usize) {
    let mut f = Feeder::new(n);
    bencher.bench_local(|| {
        let user = f.user();
        let info = f.assistant(&user);
        f.tool(&info.id);
        f.finish(info);
    });
}
