//! Why the engine refused an update. The server maps each kind to one gRPC code in one
//! place (`server/status.rs`); the engine never knows about gRPC.

use thiserror::Error;

/// What kind of mistake the update made; decides the status code the client sees.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// A field is missing or malformed (`INVALID_ARGUMENT`). Fix the request.
    InvalidArgument,
    /// The referenced message or part does not exist (`NOT_FOUND`).
    NotFound,
    /// The session is not in a state that allows the update (`FAILED_PRECONDITION`),
    /// e.g. a part for a message that was never sent. Send the missing piece first.
    FailedPrecondition,
    /// A configured limit would be exceeded (`RESOURCE_EXHAUSTED`).
    ResourceExhausted,
}

/// A rejected update. The session is unchanged when this is returned.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{field}: {message}")]
pub struct ApplyError {
    /// Which status the client gets.
    pub kind: ErrorKind,
    /// The offending field, dotted, relative to the update's payload (`message_id` of a
    /// part); the server prefixes it with the request field (`part.` or `upsert_part.`).
    pub field: String,
    /// What is wrong, for a human.
    pub message: String,
}

impl ApplyError {
    /// A malformed field.
    pub fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        ApplyError {
            kind: ErrorKind::InvalidArgument,
            field: field.into(),
            message: message.into(),
        }
    }

    /// A missing referent.
    pub fn not_found(field: impl Into<String>, message: impl Into<String>) -> Self {
        ApplyError {
            kind: ErrorKind::NotFound,
            field: field.into(),
            message: message.into(),
        }
    }

    /// A limit reached.
    pub fn exhausted(field: impl Into<String>, message: impl Into<String>) -> Self {
        ApplyError {
            kind: ErrorKind::ResourceExhausted,
            field: field.into(),
            message: message.into(),
        }
    }

    /// A state conflict.
    pub fn precondition(field: impl Into<String>, message: impl Into<String>) -> Self {
        ApplyError {
            kind: ErrorKind::FailedPrecondition,
            field: field.into(),
            message: message.into(),
        }
    }
}
