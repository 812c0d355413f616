//! compactd: a gRPC sidecar that keeps LLM agent conversations inside their context window.
//!
//! # Layout (read in this order)
//! - [`session`]: the domain types (session info, messages, parts), mirroring OpenCode.
//! - [`tokens`]: the one [`tokens::TokenCounter`] every figure comes from.
//! - [`config`]: seed constants, server defaults, per-session overrides.
//! - [`engine`]: the pure core. Overflow detection, OpenCode's prune, the context view,
//!   and [`engine::step`], which runs them after every update. No I/O.
//! - [`trace`]: import of `opencode export` JSON and the replay report.
//! - [`store`]: in-memory sessions, one actor (ordered writer) per session.
//! - [`server`]: the tonic services; the only place that knows protobuf.
//!
//! The engine never depends on `store` or `server`; `store` never depends on `server`.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod cli;
pub mod config;
pub mod domain;
pub mod engine;
pub mod server;
pub mod store;
pub mod summarize;
pub mod telemetry;
pub mod tokens;
pub mod trace;
