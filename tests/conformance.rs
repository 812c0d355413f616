//! Import of every trace and conformance with OpenCode's own prune. (Being written.)
