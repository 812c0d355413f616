//! Compaction over gRPC against a real OpenAI-compatible HTTP server (the fake in
//! `common::fake_llm`), by topic. The shared setup (servers, seeded sessions, readers of
//! compaction events) is in `common::compaction`.

mod automatic;
mod concurrency;
mod endpoint_limits;
mod failures;
mod folding;
mod manual;
mod reload;
mod settings;
mod stale;
mod subscribe;
mod window;
