//! One integration-test binary (keeps link time down on a 2-core CI).

mod common;
mod config_cli;
mod conformance;
mod durable;
mod fuzz;
mod grpc;
mod hostile;
mod snapshot;
mod walkthrough;
