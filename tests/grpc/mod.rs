//! The gRPC API end to end: a real server on 127.0.0.1:0 and real tonic clients.
//!
//! The modules live in this directory (not as `tests/<name>.rs`) so Cargo does not also
//! build each of them as a separate test binary that cannot see `common`.

mod auth;
mod bench_cli;
mod cache_model;
mod compaction;
mod concurrency;
mod disk_full;
mod drain;
mod e2e_llm;
mod fake_llm_selftest;
mod health;
mod import;
mod import_chunked;
mod limits;
mod log_injection;
mod metrics;
mod overflow;
mod pins_recall;
mod prune;
mod replay_cli;
mod rss_load;
mod secrets;
mod strategies;
mod stream;
mod tls;
mod tokenizer;
mod transport;
mod unary;
mod validation;
