//! The one place errors become gRPC statuses. Every message names the field or the
//! limit at fault, and never carries a secret.

use tonic::{Code, Status};

use super::pb;
use crate::config::shown::capped;
use crate::engine::{ApplyError, ErrorKind};
use crate::store::{BackendError, StoreError};
use crate::telemetry::code_name;
use crate::trace::ImportError;

/// A rejected request, before it becomes a `Status` (unary) or an error event (stream).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rejection {
    /// Status code.
    pub code: Code,
    /// The offending field, dotted, when one is to blame.
    pub field: String,
    /// Human message.
    pub message: String,
}

impl Rejection {
    /// A malformed or missing field.
    pub fn invalid(field: impl Into<String>, message: impl Into<String>) -> Self {
        Rejection {
            code: Code::InvalidArgument,
            field: field.into(),
            message: message.into(),
        }
    }

    /// An update over a size limit.
    pub fn too_large(field: impl Into<String>, message: impl Into<String>) -> Self {
        Rejection {
            code: Code::ResourceExhausted,
            field: field.into(),
            message: message.into(),
        }
    }

    /// Same rejection with `prefix.` put before the field (stream updates name the oneof).
    pub fn within(mut self, prefix: &str) -> Self {
        if !self.field.is_empty() && !prefix.is_empty() {
            self.field = format!("{prefix}.{}", self.field);
        }
        self
    }

    /// [`Self::within`] the request's payload, unless the field is the `session_id`,
    /// which sits beside the payload, not in it.
    pub fn within_payload(self, prefix: &str) -> Self {
        if self.field == "session_id" {
            return self;
        }
        self.within(prefix)
    }
}

impl Rejection {
    /// Replaces the leading `export_json` of an import error's field with `root`.
    pub fn within_root(mut self, root: &str) -> Self {
        if let Some(rest) = self.field.strip_prefix("export_json") {
            self.field = format!("{root}{rest}");
        }
        self
    }
}

impl From<ApplyError> for Rejection {
    fn from(e: ApplyError) -> Self {
        let code = match e.kind {
            ErrorKind::InvalidArgument => Code::InvalidArgument,
            ErrorKind::NotFound => Code::NotFound,
            ErrorKind::FailedPrecondition => Code::FailedPrecondition,
            ErrorKind::ResourceExhausted => Code::ResourceExhausted,
        };
        Rejection {
            code,
            field: e.field,
            message: e.message,
        }
    }
}

impl From<StoreError> for Rejection {
    fn from(e: StoreError) -> Self {
        let code = match e {
            StoreError::NotFound(_) => Code::NotFound,
            StoreError::AlreadyExists(_) => Code::AlreadyExists,
            StoreError::Closed(_) => Code::Aborted,
            StoreError::Full(_)
            | StoreError::SessionTooLarge { .. }
            | StoreError::TooLargeToLoad { .. }
            | StoreError::OverBudget { .. }
            | StoreError::InFlightOverBudget { .. } => Code::ResourceExhausted,
            // Disk full: retry once space is freed. Any other I/O failure: retry later.
            StoreError::Storage(BackendError::Full(_)) => Code::ResourceExhausted,
            StoreError::Storage(BackendError::Corrupt { .. }) => Code::DataLoss,
            StoreError::Storage(BackendError::Io(_) | BackendError::Closed) => Code::Unavailable,
            // Shutting down: the client sends it again (to this server's successor).
            StoreError::Closing => Code::Unavailable,
            StoreError::LoadPanicked(_) => Code::Internal,
        };
        let field = match e {
            // Not the session's fault: the server is holding too much for everyone.
            StoreError::InFlightOverBudget { .. } => "",
            StoreError::Storage(BackendError::Corrupt { .. }) => "session_id",
            StoreError::Storage(_) | StoreError::Closing => "",
            _ => "session_id",
        };
        Rejection {
            code,
            field: field.into(),
            message: e.to_string(),
        }
    }
}

impl From<ImportError> for Rejection {
    fn from(e: ImportError) -> Self {
        Rejection::invalid(format!("export_json.{}", e.path), e.message)
    }
}

impl From<Rejection> for Status {
    fn from(r: Rejection) -> Status {
        crate::telemetry::rejected(r.code);
        // Every path's values are clipped where quoted; the cap is the backstop for one
        // that was not (a trailer past 8-16 KiB fails at the client as a transport error).
        let message = if r.field.is_empty() {
            r.message
        } else {
            format!("{}: {}", r.field, r.message)
        };
        Status::new(r.code, capped(message))
    }
}

/// A rejection as the stream reports it: an error event in place of the update's ack.
impl From<Rejection> for pb::Error {
    fn from(r: Rejection) -> pb::Error {
        crate::telemetry::rejected(r.code);
        pb::Error {
            code: code_name(r.code).to_string(),
            message: capped(r.message),
            field: capped(r.field),
        }
    }
}
