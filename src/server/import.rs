//! ImportSession and ImportSessionChunked: an `opencode export` document becomes a
//! session. The chunked call exists for documents over `max_update_bytes` (a long
//! session a host reloads): its chunks are gathered, counted in flight as they arrive,
//! and the whole document then goes the unary call's way, so both import alike.

use std::time::Duration;

use tonic::{Status, Streaming};

use super::convert;
use super::ops;
use super::pb;
use super::service::SessionsService;
use super::status::Rejection;
use crate::store::{Ledger, Reservation};
use crate::trace;

/// The export document as the client sent it.
pub(super) enum Document {
    Text(String),
    Object(serde_json::Value),
}

impl Document {
    /// The request field the document came in, which its errors are named under.
    fn root(&self) -> &'static str {
        match self {
            Document::Text(_) => "export_json",
            Document::Object(_) => "export",
        }
    }
}

/// Takes the document out of a unary request (its `export_json` or its `export`).
pub(super) fn document(req: &mut pb::ImportSessionRequest) -> Result<Document, Status> {
    let text = std::mem::take(&mut req.export_json);
    match (text.is_empty(), req.export.take()) {
        (false, None) => Ok(Document::Text(text)),
        (true, Some(s)) => Ok(Document::Object(serde_json::Value::Object(
            convert::struct_from_pb(s),
        ))),
        (false, Some(_)) => {
            Err(Rejection::invalid("export", "set export_json or export, not both").into())
        }
        (true, None) => Err(Rejection::invalid(
            "export_json",
            "required: an `opencode export` JSON document (export_json as text or export as an object)",
        )
        .into()),
    }
}

/// Gathers an ImportSessionChunked call: its request (first chunk) and its document
/// (every chunk's bytes, joined), counted in flight as they arrive; a client that sends
/// more than the in-flight share allows is refused before it is held, and one that sends
/// no chunk for `grace` is refused too (what it sent would otherwise pin the in-flight
/// share every client shares, for as long as its connection lives).
pub(super) async fn collect(
    mut chunks: Streaming<pb::ImportSessionChunk>,
    ledger: &std::sync::Arc<Ledger>,
    grace: Duration,
) -> Result<(pb::ImportSessionRequest, Document, Reservation), Status> {
    let mut request: Option<pb::ImportSessionRequest> = None;
    let mut text: Vec<u8> = Vec::new();
    let mut held = Reservation::default();
    let mut index: u64 = 0;
    loop {
        let Ok(next) = tokio::time::timeout(grace, chunks.message()).await else {
            return Err(Rejection {
                code: tonic::Code::ResourceExhausted,
                field: String::new(),
                message: format!(
                    "no chunk of the import for {} ms after chunk {index} ({} bytes of the document held in flight): send the chunks without pausing",
                    grace.as_millis(),
                    text.len()
                ),
            }
            .into());
        };
        let Some(chunk) = next? else { break };
        match (chunk.request, &request) {
            (Some(r), None) => {
                if !r.export_json.is_empty() || r.export.is_some() {
                    return Err(Rejection::invalid(
                        "request.export_json",
                        "the document goes in the chunks' export_json, not in the request",
                    )
                    .into());
                }
                request = Some(r);
            }
            (Some(_), Some(_)) => {
                return Err(Rejection::invalid(
                    "request",
                    format!("only the first chunk carries the request (chunk {index} does too)"),
                )
                .into());
            }
            (None, None) => {
                return Err(Rejection::invalid(
                    "request",
                    "required in the first chunk (the session's id, limits and config)",
                )
                .into());
            }
            (None, Some(_)) => {}
        }
        // What is counted is the buffer's capacity, grown as a Vec would grow it.
        let needed = text.len().saturating_add(chunk.export_json.len());
        if needed > text.capacity() {
            let capacity = needed.max(text.capacity().saturating_mul(2));
            let bytes = u64::try_from(capacity).unwrap_or(u64::MAX);
            held.resize(ledger, bytes, "an imported document")
                .map_err(Rejection::from)?;
            text.reserve_exact(capacity.saturating_sub(text.len()));
        }
        text.extend_from_slice(&chunk.export_json);
        index = index.saturating_add(1);
    }
    let Some(request) = request else {
        return Err(Rejection::invalid("request", "required: the call sent no chunk").into());
    };
    if text.is_empty() {
        return Err(Rejection::invalid(
            "export_json",
            "required: the chunks carried no document (an `opencode export` JSON text)",
        )
        .into());
    }
    let text = String::from_utf8(text).map_err(|e| {
        Status::from(Rejection::invalid(
            "export_json",
            format!(
                "the joined chunks are not UTF-8 text (at byte {})",
                e.utf8_error().valid_up_to()
            ),
        ))
    })?;
    Ok((request, Document::Text(text), held))
}

impl SessionsService {
    /// Imports `document` as `req` asks (its document fields already taken out); `held`
    /// counts the document in flight until it is parsed.
    pub(super) async fn import(
        &self,
        req: pb::ImportSessionRequest,
        document: Document,
        mut held: Reservation,
    ) -> Result<pb::SessionSummary, Status> {
        let overrides = match req.config {
            Some(c) => {
                convert::overrides_from_pb(c).map_err(|r| Status::from(r.within("config")))?
            }
            None => Default::default(),
        };
        if let Some(m) = &overrides.compaction_model {
            self.hub
                .compaction
                .check_model("config.compaction_model", m)
                .map_err(Status::from)?;
        }
        let limits = req.limits.map(convert::limits_from_pb).unwrap_or_default();
        let store = self.store.clone();
        let id_override = req.session_id;
        let _turn = self
            .imports
            .acquire()
            .await
            .map_err(|_| Status::unavailable("compactd is closing"))?;

        let root = document.root();
        // Built no further than the limit it will be held to: the first message past it
        // ends the parse. Taken once, before a replaced session is read for its
        // compactions (reading a cold one would count it twice). The document's own
        // reservation is not counted against the session it becomes.
        let counted = store.ledger().counted().saturating_sub(held.bytes());
        let byte_limit = store.limits().byte_limit(0, counted);
        // Parsing a multi-megabyte export is CPU work: keep it off the async workers.
        let mut export = tokio::task::spawn_blocking(move || -> Result<_, Rejection> {
            let parsed = match document {
                Document::Text(t) => trace::parse_export_limited(&t, byte_limit),
                Document::Object(v) => trace::from_value_limited(v, byte_limit),
            };
            let mut export = parsed.map_err(|e| limited(e, root))?;
            if !id_override.is_empty() {
                export.info.id = id_override;
            }
            crate::domain::check_id("session_id", &export.info.id)?;
            Ok(export)
        })
        .await
        .map_err(|e| Status::internal(format!("import task failed: {e}")))??;
        // The document is read and dropped: what it became is counted when it is admitted.
        held.resize(store.ledger(), 0, "updates")
            .map_err(Rejection::from)?;
        let trail = if req.replace && req.keep_compactions {
            // A compaction still running on the replaced session would commit after its
            // trail is read and be lost with it: cancelled first, as the replace would.
            ops::cancel_replaced(
                &self.hub,
                &export.info.id,
                None,
                "session replaced by an import",
            );
            self.compaction_trail(&export.info.id).await
        } else {
            None
        };
        let session = tokio::task::spawn_blocking(move || -> Result<_, Rejection> {
            let carried = trail.map_or(0, |t| t.carry_into(&mut export.messages));
            if carried > 0 {
                tracing::info!(session_id = %export.info.id, carried, "import keeps the replaced session's compactions");
            }
            let session = trace::load_within(export, limits, overrides, store.config(), byte_limit)
                .map_err(|e| Rejection::from(e).within(root))?;
            Ok(session)
        })
        .await
        .map_err(|e| Status::internal(format!("import task failed: {e}")))??;
        let id = session.info().id.clone();
        let (messages, parts) = (session.messages().len(), session.part_count());
        let generation = session.generation();
        self.store
            .insert(session, req.replace)
            .await
            .map_err(Rejection::from)?;
        if req.replace {
            // Not a compaction of the imported session, started while it was written.
            ops::cancel_replaced(
                &self.hub,
                &id,
                Some(generation),
                "session replaced by an import",
            );
        }
        tracing::info!(session_id = %id, messages, parts, "session imported");
        self.summary(&id, true).await
    }
}

/// A limited import's refusal: an invalid document names its JSON path under `root`;
/// one past the limit is `RESOURCE_EXHAUSTED` naming the limit.
fn limited(e: trace::LimitedError, root: &str) -> Rejection {
    match e {
        trace::LimitedError::Invalid(e) => Rejection::from(e).within_root(root),
        trace::LimitedError::TooLarge { ref path, .. } => Rejection {
            code: tonic::Code::ResourceExhausted,
            field: format!("{root}.{path}"),
            message: e.to_string(),
        },
    }
}
