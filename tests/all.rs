//! One integration-test binary (keeps link time down on a 2-core CI).

mod common;
mod config_cli;
mod conformance;
mod grpc;
mod hostile;
mod walkthrough;
