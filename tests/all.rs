//! One integration-test binary (keeps link time down on a 2-core CI).

mod conformance;
mod walkthrough;
