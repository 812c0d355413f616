//! BPE counting speed over real agent text: every string of 256 bytes or more in the
//! shared traces (tool outputs, file contents, prose), counted without the count cache,
//! as the server's counting threads count a new long text.
//!
//! Run: `cargo bench --bench tokens`; divan prints bytes per second.

#[path = "common/traces.rs"]
mod traces;

use compactd::tokens::bpe::{Bpe, CL100K, O200K};

// The binary's allocator (src/main.rs): the BPE encoder allocates per piece it merges.
#[cfg(not(target_env = "msvc"))]
#[global_allocator]
static GLOBAL: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() {
    divan::main();
}

/// Every string value of 256 bytes or more of every trace, in file order.
fn corpus() -> Vec<String> {
    let mut texts = Vec::new();
    for f in traces::files() {
        let text = std::fs::read_to_string(&f).expect("trace readable");
        let json: serde_json::Value = serde_json::from_str(&text).expect("trace is JSON");
        collect(&json, &mut texts);
    }
    texts
}

fn collect(v: &serde_json::Value, out: &mut Vec<String>) {
    match v {
        serde_json::Value::String(s) if s.len() >= 256 => out.push(s.clone()),
        serde_json::Value::Array(a) => a.iter().for_each(|v| collect(v, out)),
        serde_json::Value::Object(o) => o.values().for_each(|v| collect(v, out)),
        _ => {}
    }
}

fn count_all(bencher: divan::Bencher, bpe: &Bpe) {
    let texts = corpus();
    let bytes: usize = texts.iter().map(String::len).sum();
    bpe.warm_up();
    bencher
        .counter(divan::counter::BytesCount::new(bytes))
        .bench(|| {
            texts
                .iter()
                .map(|t| bpe.count_uncached(divan::black_box(t)))
                .sum::<u64>()
        });
}

/// o200k_base over the whole corpus.
#[divan::bench(sample_count = 10, sample_size = 1)]
fn o200k(bencher: divan::Bencher) {
    count_all(bencher, &O200K);
}

/// cl100k_base over the whole corpus.
#[divan::bench(sample_count = 10, sample_size = 1)]
fn cl100k(bencher: divan::Bencher) {
    count_all(bencher, &CL100K);
}
