//! Engine cost of one update on sessions of 100, 1,000 and 10,000 messages built from the
//! shared real traces (messages cycled with fresh ids). The figures must not grow with
//! session length: estimates are cached per part, usage is a running sum, and the prune
//! decision is an incremental window.
//!
//! Run: `cargo bench --bench engine`. Each session keeps growing while it is measured (as
//! a live one does), so automatic prune commits happen at their natural rate and their cost
//! is included, amortized.
//!
//! Each sample's updates are built before it is timed (`with_inputs`), as the server's
//! decoder builds them before the engine sees them: what is timed is `engine::step`.
//! Building them inside the timed region counted the page faults of each fresh 4 KB
//! output copy, a third of a tool-part upsert at 10,000 messages.
//!
//! The engine's own cost is measured counting chars ÷ 4 (a few nanoseconds per text); the
//! `_o200k` benches count with real BPE, the outputs (the same 4 KB each time) from the
//! count cache as the server's precount leaves them, the short texts (inputs, placeholders)
//! counted in place.

use std::cell::{Cell, RefCell};

#[path = "common/traces.rs"]
mod traces;

use compactd::config::EngineConfig;
use compactd::domain::{
    MessageInfo, ModelLimits, Part, PartKind, Role, TextPart, TokenUsage, ToolPart, ToolState,
    ToolStatus,
};
use compactd::engine::{ContextCache, Session, Update, step};
use compactd::trace::{self, Export};

// The binary's allocator (src/main.rs), so the figures are those of the engine inside
// compactd: under glibc's malloc, growing part vectors and 4 KB outputs made `_int_malloc`
// over half of a strategy turn's instructions.
#[cfg(not(target_env = "msvc"))]
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

// And its options, so the engine is timed under the allocator settings `compactd serve`
// runs with. Callgrind counts fewer instructions per strategy turn under them (62.6-64.0k
// at 10,000 messages, 67.4k under jemalloc's defaults); timed, one set of rounds made
// them slower and ten later rounds showed no difference beyond the machine's spread
// (README "One optimization unit").
#[cfg(not(target_env = "msvc"))]
#[unsafe(export_name = "_rjem_malloc_conf")]
static MALLOC_CONF: &[u8; 69] = compactd::cli::JEMALLOC_CONF;

fn main() {
    divan::main();
}

const SIZES: &[usize] = &[100, 1_000, 10_000];

/// The session sizes to run: [`SIZES`], or those `COMPACTD_BENCH_SIZES` lists
/// (comma-separated), to profile one size alone (e.g. under callgrind).
fn sizes() -> Vec<usize> {
    std::env::var("COMPACTD_BENCH_SIZES")
        .ok()
        .map(|v| v.split(',').filter_map(|n| n.trim().parse().ok()).collect())
        .filter(|v: &Vec<usize>| !v.is_empty())
        .unwrap_or_else(|| SIZES.to_vec())
}

/// All messages of all traces, in file order.
fn corpus() -> Vec<(MessageInfo, Vec<Part>)> {
    let mut all = Vec::new();
    for f in traces::files() {
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

/// A session being fed, and the builder of its updates.
struct Feeder {
    session: Session,
    config: EngineConfig,
    build: Builder,
}

/// Builds the updates a host would send: fresh ids, a 4 KB tool output. Kept apart from
/// the session so a bench builds its updates outside the timed region, as the server's
/// decoder builds them before the engine sees them.
struct Builder {
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
        let mut f = Feeder {
            session,
            config,
            build: Builder {
                next: Cell::new(0),
                output: output_of(4_096),
            },
        };
        // Settle: the settings change above makes the strategies rebuild their state from
        // the whole history at the next finished turn, once (as after an import).
        let (user, user_text) = f.build.user();
        let info = f.build.assistant(&user);
        let settle = [
            user_text.0,
            user_text.1,
            Update::UpsertMessage(info.clone()),
            f.build.finish(info),
        ];
        f.apply_all(settle);
        f
    }

    // Not inlined, so a profiler can single out the engine's share (callgrind
    // `--toggle-collect='engine::Feeder::apply'`).
    #[inline(never)]
    fn apply(&mut self, u: Update) {
        let r = step(&mut self.session, u, &self.config, 1);
        divan::black_box(r.expect("bench update applies"));
    }

    fn apply_all(&mut self, updates: impl IntoIterator<Item = Update>) {
        for u in updates {
            self.apply(u);
        }
    }
}

impl Builder {
    fn id(&self, kind: &str) -> String {
        let n = self.next.get();
        self.next.set(n + 1);
        format!("bench_{kind}_{n}")
    }

    /// A new user message and its text part: the message's id and the two updates.
    fn user(&self) -> (String, (Update, Update)) {
        let id = self.id("msg");
        let message = Update::UpsertMessage(MessageInfo::new(id.clone(), Role::User));
        let text = Update::UpsertPart(Part {
            id: self.id("prt"),
            message_id: id.clone(),
            kind: PartKind::Text(TextPart {
                text: "continue with the next file".into(),
                ..Default::default()
            }),
            mark: None,
            extra: Default::default(),
        });
        (id, (message, text))
    }

    /// A new, still open, assistant message answering `parent`.
    fn assistant(&self, parent: &str) -> MessageInfo {
        let mut info = MessageInfo::new(self.id("msg"), Role::Assistant);
        info.parent_id = parent.to_string();
        info
    }

    /// A completed call of `tool` with `input` and a 4 KB output.
    fn call(&self, message_id: &str, tool: &str, input: serde_json::Value) -> Update {
        Update::UpsertPart(self.call_part(message_id, tool, input))
    }

    /// The part [`Builder::call`] upserts.
    fn call_part(&self, message_id: &str, tool: &str, input: serde_json::Value) -> Part {
        let mut state = ToolState::new(ToolStatus::Completed);
        state.output = self.output.clone();
        state.input = input;
        Part {
            id: self.id("prt"),
            message_id: message_id.to_string(),
            kind: PartKind::Tool(Box::new(ToolPart {
                call_id: self.id("call"),
                tool: tool.into(),
                state,
                metadata: None,
            })),
            mark: None,
            extra: Default::default(),
        }
    }

    /// A `write` call of the 4 KB output as a file's content, sent running and then
    /// completed (the same part: same id and input).
    fn resent_write(&self, message_id: &str) -> (Update, Update) {
        let input = serde_json::json!({"filePath": "src/generated.rs", "content": self.output});
        let mut done = self.call_part(message_id, "write", input);
        let mut running = done.clone();
        if let PartKind::Tool(t) = &mut running.kind {
            t.state.status = ToolStatus::Running;
            t.state.output.clear();
        }
        if let PartKind::Tool(t) = &mut done.kind {
            t.state.output = "Wrote file successfully.".into();
        }
        (Update::UpsertPart(running), Update::UpsertPart(done))
    }

    /// A completed `grep` call with no input and a 4 KB output.
    fn tool(&self, message_id: &str) -> Update {
        self.call(message_id, "grep", serde_json::Value::Null)
    }

    /// The update finishing `info` with a usage report.
    fn finish(&self, mut info: MessageInfo) -> Update {
        info.finish = "tool-calls".into();
        info.tokens = Some(TokenUsage {
            input: 50_000,
            output: 300,
            ..Default::default()
        });
        Update::UpsertMessage(info)
    }

    /// A turn the strategies act on (7 updates, see [`strategy_turn`]); `i` numbers it.
    fn strategy_turn(&self, i: usize) -> Vec<Update> {
        let (user, (message, text)) = self.user();
        let info = self.assistant(&user);
        let file = |k: usize| serde_json::json!({"filePath": format!("src/module_{}.rs", k % 50)});
        let mut edit = file(i + 1);
        edit["oldString"] = "fn old() {}".into();
        edit["newString"] = "fn new() {}".into();
        vec![
            message,
            text,
            Update::UpsertMessage(info.clone()),
            self.call(&info.id, "read", file(i)),
            self.call(
                &info.id,
                "bash",
                serde_json::json!({"command": "git status"}),
            ),
            self.call(&info.id, "edit", edit),
            self.finish(info),
        ]
    }

    /// A whole turn: user message + text, assistant message, one tool call, finish.
    fn full_turn(&self) -> Vec<Update> {
        let (user, (message, text)) = self.user();
        let info = self.assistant(&user);
        vec![
            message,
            text,
            Update::UpsertMessage(info.clone()),
            self.tool(&info.id),
            self.finish(info),
        ]
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

/// One tool part with a 4 KB output written into an open assistant message. Each sample's
/// update is built before it is timed: only the engine's `step` is measured.
#[divan::bench(args = sizes())]
fn upsert_tool_part(bencher: divan::Bencher, n: usize) {
    upsert(bencher, Feeder::new(n));
}

/// [`upsert_tool_part`] counting with o200k.
#[divan::bench(args = sizes())]
fn upsert_tool_part_o200k(bencher: divan::Bencher, n: usize) {
    upsert(bencher, Feeder::with_config(n, o200k()));
}

/// A `write` call with 4 KB of content, resent completed after it was sent running
/// (counting with o200k): how hosts send a tool part as it runs. Only the resend is timed.
#[divan::bench(args = sizes())]
fn resend_tool_part_o200k(bencher: divan::Bencher, n: usize) {
    let mut f = Feeder::with_config(n, o200k());
    let (user, (message, text)) = f.build.user();
    let open = f.build.assistant(&user);
    f.apply_all([message, text, Update::UpsertMessage(open.clone())]);
    let f = RefCell::new(f);
    bencher
        .with_inputs(|| {
            let (running, done) = f.borrow().build.resent_write(&open.id);
            f.borrow_mut().apply(running);
            done
        })
        .bench_local_values(|u| f.borrow_mut().apply(u));
}

fn upsert(bencher: divan::Bencher, mut f: Feeder) {
    let (user, (message, text)) = f.build.user();
    let open = f.build.assistant(&user);
    f.apply_all([message, text, Update::UpsertMessage(open.clone())]);
    let f = RefCell::new(f);
    bencher
        .with_inputs(|| f.borrow().build.tool(&open.id))
        .bench_local_values(|u| f.borrow_mut().apply(u));
}

/// An assistant message finishing: usage recorded, overflow check, prune decision (and
/// the occasional commit).
#[divan::bench(args = sizes())]
fn finish_assistant_message(bencher: divan::Bencher, n: usize) {
    let mut f = Feeder::new(n);
    let (user, (message, text)) = f.build.user();
    f.apply_all([message, text]);
    let f = RefCell::new(f);
    bencher
        .with_inputs(|| {
            let b = &f.borrow().build;
            let info = b.assistant(&user);
            [
                Update::UpsertMessage(info.clone()),
                b.tool(&info.id),
                b.finish(info),
            ]
        })
        .bench_local_values(|turn| f.borrow_mut().apply_all(turn));
}

/// A turn the strategies act on: read one of 50 files, `git status`, edit the next file,
/// finish (7 updates: user message and text, assistant message, three calls, finish);
/// reads and edits of a file supersede its earlier operations, each `git status` the
/// previous one. Compare with `strategy_turn_off` for their cost.
#[divan::bench(args = sizes())]
fn strategy_turn(bencher: divan::Bencher, n: usize) {
    turns(bencher, Feeder::new(n));
}

/// [`strategy_turn`] counting with o200k.
#[divan::bench(args = sizes())]
fn strategy_turn_o200k(bencher: divan::Bencher, n: usize) {
    turns(bencher, Feeder::with_config(n, o200k()));
}

/// `strategy_turn` with every strategy off (OpenCode's prune alone).
#[divan::bench(args = sizes())]
fn strategy_turn_off(bencher: divan::Bencher, n: usize) {
    let config = EngineConfig {
        strategies: compactd::config::StrategySet::NONE,
        ..chars4()
    };
    turns(bencher, Feeder::with_config(n, config));
}

/// Strategy turns, each built before it is timed.
fn turns(bencher: divan::Bencher, f: Feeder) {
    let f = RefCell::new(f);
    let i = Cell::new(0usize);
    bencher
        .with_inputs(|| {
            i.set(i.get() + 1);
            f.borrow().build.strategy_turn(i.get())
        })
        .bench_local_values(|turn| strategy_step(&mut f.borrow_mut(), turn));
}

#[inline(never)]
fn strategy_step(f: &mut Feeder, turn: Vec<Update>) {
    f.apply_all(turn);
}

/// A whole turn: user message + text, assistant message, one tool call, finish (6 updates).
#[divan::bench(args = sizes())]
fn full_turn(bencher: divan::Bencher, n: usize) {
    let f = RefCell::new(Feeder::new(n));
    bencher
        .with_inputs(|| f.borrow().build.full_turn())
        .bench_local_values(|turn| f.borrow_mut().apply_all(turn));
}

/// GetContext's engine share on the whole session: the context view (each part rendered).
#[divan::bench(args = sizes())]
fn context_view(bencher: divan::Bencher, n: usize) {
    let s = session_of(n);
    bencher.bench_local(|| divan::black_box(s.build_context()));
}

/// The view turned into OpenAI `messages` values (`CONTEXT_FORMAT_OPENAI` then encodes
/// them as protobuf values).
#[divan::bench(args = sizes())]
fn context_to_openai(bencher: divan::Bencher, n: usize) {
    let view = session_of(n).build_context();
    bencher.bench_local(|| divan::black_box(view.to_openai()));
}

/// The OpenAI `messages` as JSON text (`CONTEXT_FORMAT_OPENAI_JSON`), from the view.
#[divan::bench(args = sizes())]
fn context_openai_json(bencher: divan::Bencher, n: usize) {
    let view = session_of(n).build_context();
    bencher.bench_local(|| divan::black_box(serde_json::to_string(&view.to_openai())));
}

/// What GetContext does for `CONTEXT_FORMAT_OPENAI_JSON`: the OpenAI messages built from
/// parts borrowed from the session, then serialized.
#[divan::bench(args = sizes())]
fn context_openai_json_borrowed(bencher: divan::Bencher, n: usize) {
    let s = session_of(n);
    bencher.bench_local(|| divan::black_box(s.context_openai().json));
}

/// What GetContext does for `CONTEXT_FORMAT_OPENAI_JSON` as a host calls it: right after
/// a change (the last message's text rewritten, untimed), from the session's context
/// cache, so only the changed message is rendered again and the rest is copied. One call
/// per sample, so every timed call follows its own change.
#[divan::bench(args = sizes(), sample_size = 1, sample_count = 200)]
fn context_openai_json_cached(bencher: divan::Bencher, n: usize) {
    let s = RefCell::new(session_of(n));
    let cache = RefCell::new(ContextCache::default());
    let config = chars4();
    let last = s
        .borrow()
        .messages()
        .last()
        .expect("a message")
        .info
        .id
        .clone();
    let _ = s.borrow().context_openai_cached(&mut cache.borrow_mut());
    let next = Cell::new(0u64);
    bencher
        .with_inputs(|| {
            next.set(next.get() + 1);
            let part = Part {
                id: "bench-live-text".into(),
                message_id: last.clone(),
                kind: PartKind::Text(TextPart {
                    text: format!("prompt {:010}: run the tests again", next.get()),
                    ..Default::default()
                }),
                mark: None,
                extra: Default::default(),
            };
            s.borrow_mut()
                .apply(Update::UpsertPart(part), &config)
                .expect("the text applies");
        })
        .bench_local_values(|()| {
            divan::black_box(
                s.borrow()
                    .context_openai_cached(&mut cache.borrow_mut())
                    .json,
            )
        });
}
