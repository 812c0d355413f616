//! compactd: a gRPC sidecar that keeps LLM agent conversations inside their context window.
//!
//! # Tour (layers, lowest first; ARCHITECTURE.md has the full map)
//! - [`config`]: settings. Seed constants, server defaults, per-session overrides, strategy
//!   names and presets, and `validate()`, the one home of every range rule.
//! - [`tokens`]: the one [`tokens::TokenCounter`] every figure comes from.
//! - [`domain`]: the wire/domain model mirroring OpenCode (session info, messages, parts,
//!   marks) and its own `validate()` (ids, call ids, JSON depth).
//! - [`engine`]: the pure core. The [`engine::Session`] value, overflow detection, OpenCode's
//!   prune and the aggressive strategies, the context view, compaction planning and commit,
//!   and [`engine::step`], which runs them after every update. No I/O.
//! - [`store`]: in-memory sessions, one actor (ordered writer) per session.
//! - [`summarize`]: the compaction agent's LLM side (prompts, chunking and folding, streaming).
//! - [`server`]: the tonic services; the only place that knows protobuf.
//! - [`trace`]: import of `opencode export` JSON and the replay report.
//! - [`cli`]: flags, environment and config file, layered.
//! - [`telemetry`]: Prometheus metrics.
//!
//! A module imports only from its own layer or below:
//! `config, tokens < domain < engine < store, summarize < server, trace, cli, telemetry`
//! (checked in CI by `scripts/rust_imports.py`).

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
