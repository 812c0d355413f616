//! ImportSession and ImportSessionChunked: an `opencode export` document becomes a
//! session. The chunked call exists for documents over `max_update_bytes` (a long
//! session a host reloads): its chunks are gathered, counted in flight as they arrive,
//! and the whole document then goes the unary call's way, so both import alike.
//!
//! What an import holds is reserved in the ledger until it is let go: the document as it
//! arrives, then twice its size while it is parsed (its text and what it becomes), then
//! once until the session is built. The parse tasks own the reservation and the import
//! slot, so a caller that goes away mid-parse frees neither before the parse ends.

use std::sync::Arc;
use std::time::Instant;

use tonic::{Status, Streaming};

use super::convert;
use super::hub::Hub;
use super::ops;
use super::pb;
use super::status::Rejection;
use crate::config::SessionOverrides;
use crate::domain::ModelLimits;
use crate::engine::ByteLimit;
use crate::engine::Trail;
use crate::store::{Ledger, Reservation, Store};
use crate::trace;

/// The slowest pace a chunked import may arrive at (after its first grace period): a
/// client trickling bytes would otherwise hold what it sent for as long as it liked.
const MIN_UPLOAD_BYTES_PER_SEC: u64 = 256 * 1024;

/// Imports parsed at once: parsing is CPU work on the blocking pool, and each holds its
/// document and what it built so far.
pub const MAX_CONCURRENT_IMPORTS: usize = 2;

/// What imports need of the server: the hub (the store, running compactions) and the
/// turns of the parse.
#[derive(Debug, Clone)]
pub(super) struct Importer {
    hub: Arc<Hub>,
    store: Arc<Store>,
    /// What one ImportSession may carry: a chunked import may always send as much.
    max_update_bytes: usize,
    /// Imports parsing at once; more wait their turn.
    imports: Arc<tokio::sync::Semaphore>,
}

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

/// The import's settings, checked: its config overrides and the model limits.
fn settings(
    service: &Importer,
    req: &pb::ImportSessionRequest,
) -> Result<(SessionOverrides, ModelLimits), Rejection> {
    let overrides = match req.config.clone() {
        Some(c) => convert::overrides_from_pb(c).map_err(|r| r.within("config"))?,
        None => SessionOverrides::default(),
    };
    if let Some(m) = &overrides.compaction_model {
        service
            .hub
            .compaction
            .check_model("config.compaction_model", m)?;
    }
    let limits = req.limits.map(convert::limits_from_pb).unwrap_or_default();
    limits.validate()?;
    Ok((overrides, limits))
}

/// A document past `limit` (at least `bytes`): refused, naming the limit.
fn too_large(bytes: usize, limit: ByteLimit) -> Status {
    let why = match limit.name {
        "memory_budget" => format!(
            "half the in-flight share of memory_budget ({} bytes)",
            limit.value
        ),
        "max_update_bytes" => "max_update_bytes: what one ImportSession may carry".to_string(),
        name => format!(
            "{} times {name} ({} bytes)",
            crate::store::LOAD_EXPANSION,
            limit.value
        ),
    };
    Rejection {
        code: tonic::Code::ResourceExhausted,
        field: "export_json".into(),
        message: format!(
            "the document is at least {bytes} bytes, over the {} bytes one import may send ({why})",
            limit.bytes
        ),
    }
    .into()
}

impl Importer {
    /// An importer over `hub`'s store.
    pub(super) fn new(hub: Arc<Hub>, max_update_bytes: usize) -> Importer {
        Importer {
            store: hub.store.clone(),
            hub,
            max_update_bytes,
            imports: Arc::new(tokio::sync::Semaphore::new(MAX_CONCURRENT_IMPORTS)),
        }
    }

    /// The compactions of the session an import replaces (`keep_compactions`). Whatever
    /// keeps them from being read (no such session, a stored copy that does not load, the
    /// memory budget) leaves the import as the host sent it: a replace must still repair
    /// a session that cannot be read.
    async fn compaction_trail(&self, session_id: &str) -> Option<Trail> {
        match ops::compaction_trail(&self.hub, session_id)
            .await
            .outcome(session_id)
            .await
        {
            Ok(trail) => Some(trail),
            Err(r) if r.code == tonic::Code::NotFound => None,
            Err(r) => {
                tracing::warn!(session_id, error = %r.message, "import keeps no compaction: the replaced session could not be read");
                None
            }
        }
    }

    /// Gathers an ImportSessionChunked call: its request (first chunk, checked at once)
    /// and its document (every chunk's bytes, joined), counted in flight as they arrive
    /// (by the buffer's capacity) and, once joined, by the document's length.
    /// Refused: a document past the store's import limit or the in-flight share, an empty
    /// chunk after the first, and a client that sends no chunk for the slow-reader grace
    /// or falls under [`MIN_UPLOAD_BYTES_PER_SEC`]: what it sent would otherwise pin the
    /// in-flight share every client shares, for as long as its connection lived.
    pub(super) async fn collect(
        &self,
        mut chunks: Streaming<pb::ImportSessionChunk>,
    ) -> Result<(pb::ImportSessionRequest, Document, Reservation), Status> {
        let ledger = self.store.ledger();
        let mut limit = self.store.limits().import_limit();
        // Never under what one ImportSession may carry: the chunked call is for larger
        // documents, not fewer.
        let floor = u64::try_from(self.max_update_bytes).unwrap_or(u64::MAX);
        if limit.bytes < floor {
            limit = ByteLimit {
                bytes: floor,
                name: "max_update_bytes",
                value: floor,
            };
        }
        let grace = self.hub.slow_reader_grace;
        let began = Instant::now();
        let mut request: Option<pb::ImportSessionRequest> = None;
        let mut text: Vec<u8> = Vec::new();
        let mut held = Reservation::default();
        let mut index: u64 = 0;
        loop {
            let Ok(next) = tokio::time::timeout(grace, chunks.message()).await else {
                return Err(slow(format!(
                    "no chunk of the import for {} ms after chunk {index} ({} bytes of the document held in flight): send the chunks without pausing",
                    grace.as_millis(),
                    text.len()
                )));
            };
            let Some(chunk) = next? else { break };
            match (chunk.request, &request) {
                (Some(r), None) => {
                    if !r.export_json.is_empty() || r.export.is_some() {
                        let field = if r.export.is_some() {
                            "request.export"
                        } else {
                            "request.export_json"
                        };
                        return Err(Rejection::invalid(
                            field,
                            "the document goes in the chunks' export_json, not in the request",
                        )
                        .into());
                    }
                    // Optional: it overrides the document's own id (checked once parsed).
                    crate::domain::check_optional_id("session_id", &r.session_id)
                        .map_err(|e| Rejection::from(e).within("request"))?;
                    settings(self, &r).map_err(|e| Status::from(e.within("request")))?;
                    request = Some(r);
                }
                (Some(_), Some(_)) => {
                    return Err(Rejection::invalid(
                        "request",
                        format!(
                            "only the first chunk carries the request (chunk {index} does too)"
                        ),
                    )
                    .into());
                }
                (None, None) => {
                    return Err(Rejection::invalid(
                        "request",
                        "required in the first chunk (the session's limits, config and optional id)",
                    )
                    .into());
                }
                (None, Some(_)) => {
                    if chunk.export_json.is_empty() {
                        return Err(Rejection::invalid(
                            "export_json",
                            format!("chunk {index} is empty: every chunk after the first carries bytes of the document"),
                        )
                        .into());
                    }
                }
            }
            let needed = text.len().saturating_add(chunk.export_json.len());
            if u64::try_from(needed).unwrap_or(u64::MAX) > limit.bytes {
                return Err(too_large(needed, limit));
            }
            let allowed = grace.as_secs().saturating_add(
                u64::try_from(text.len()).unwrap_or(u64::MAX) / MIN_UPLOAD_BYTES_PER_SEC,
            );
            if began.elapsed().as_secs() > allowed {
                return Err(slow(format!(
                    "the import sent {} bytes in {} s, under {MIN_UPLOAD_BYTES_PER_SEC} bytes per second: send the chunks without pausing",
                    text.len(),
                    began.elapsed().as_secs()
                )));
            }
            if needed > text.capacity() {
                grow(&mut text, &mut held, ledger, needed, limit)?;
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
        // Collected: from here on the document is counted by its length, not by the
        // capacity its buffer grew to (up to twice it), which the parse would count twice.
        text.shrink_to_fit();
        held.resize(
            ledger,
            u64::try_from(text.len()).unwrap_or(u64::MAX),
            "an imported document",
        )
        .map_err(Rejection::from)?;
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

    /// Imports `document` as `req` asks (its document fields already taken out); `held`
    /// counts the document in flight.
    pub(super) async fn import(
        &self,
        req: pb::ImportSessionRequest,
        document: Document,
        mut held: Reservation,
    ) -> Result<pb::SessionSummary, Status> {
        let (overrides, limits) = settings(self, &req)?;
        let store = self.store.clone();
        let id_override = req.session_id;
        // Optional: it stands in for the document's own id, which is then not checked.
        crate::domain::check_optional_id("session_id", &id_override).map_err(Rejection::from)?;
        let turn = self
            .imports
            .clone()
            .acquire_owned()
            .await
            .map_err(|_| Status::unavailable("compactd is closing"))?;

        let root = document.root();
        // A text is counted by its length; an object (no text to measure) by the request
        // that carried it.
        let document_bytes = match &document {
            Document::Text(t) => u64::try_from(t.len()).unwrap_or(u64::MAX),
            Document::Object(_) => held.bytes(),
        };
        // Built no further than the limit it will be held to: the first message past it
        // ends the parse. Taken once, before a replaced session is read for its
        // compactions (reading a cold one would count it twice). The document's own
        // reservation is not counted against the session it becomes.
        let counted = store.ledger().counted().saturating_sub(held.bytes());
        // A session it replaces gives back what it holds (in memory: one on disk is not
        // counted), as `Store::insert` does. Known only when the request names the id (as
        // hosts do): a document's own id is read with the document, under this limit.
        let replaced = match req.replace && !id_override.is_empty() {
            true => store.hot(&id_override).map_or(0, |h| h.held_bytes()),
            false => 0,
        };
        let byte_limit = store.limits().byte_limit(replaced, counted);
        // While it is parsed the document is held twice: its text and what it becomes
        // (past the in-flight share only alone, so that one large import still can).
        held.resize_or_alone(
            store.ledger(),
            document_bytes.saturating_mul(2),
            "an import being parsed",
        )
        .map_err(Rejection::from)?;
        // Parsing a multi-megabyte export is CPU work: keep it off the async workers.
        let (mut export, mut held, turn) = tokio::task::spawn_blocking(move || {
            let parsed = match document {
                Document::Text(t) => trace::parse_export_limited(&t, byte_limit, &id_override),
                Document::Object(v) => trace::from_value_limited(v, byte_limit, &id_override),
            };
            parsed
                .map_err(|e| limited(e, root))
                .map(|export| (export, held, turn))
        })
        .await
        .map_err(|e| Status::internal(format!("import task failed: {e}")))??;
        // The text is dropped: what it became is held until it is a session.
        held.resize(store.ledger(), document_bytes, "an import being built")
            .map_err(Rejection::from)?;
        let keeping = req.replace && req.keep_compactions;
        let trail = if keeping {
            self.compaction_trail(&export.info.id).await
        } else {
            None
        };
        // Which compactions the build carries: a compaction still running on the
        // replaced session goes on while the document is built (a document refused
        // there leaves it be) and is checked for below.
        let carried: Option<Vec<String>> = trail
            .as_ref()
            .map(|t| t.commit_ids().into_iter().map(str::to_string).collect());
        let session = tokio::task::spawn_blocking(move || -> Result<_, Rejection> {
            let mut trail = trail;
            let carried = trail
                .as_mut()
                .map_or(0, |t| t.carry_into(&mut export.messages));
            if carried > 0 {
                tracing::info!(session_id = %export.info.id, carried, "import keeps the replaced session's compactions");
            }
            let session = trace::load_within(export, limits, overrides, store.config(), byte_limit)
                .map_err(|e| Rejection::from(e).within(root))
                .map(|mut session| {
                    let pinned = trail.map_or(0, |t| t.repin(&mut session, store.config()));
                    if pinned > 0 {
                        tracing::info!(session_id = %session.info().id, pinned, "import keeps the replaced session's pins");
                    }
                    session
                });
            // Let go only once the build has ended, whether or not its caller still waits.
            drop((held, turn));
            session
        })
        .await
        .map_err(|e| Status::internal(format!("import task failed: {e}")))??;
        let id = session.info().id.clone();
        if keeping {
            // Built: the replace goes through, and what runs on the replaced session would
            // be lost with it. A compaction that committed meanwhile is not in the build:
            // refused, so the caller imports again and keeps it too.
            ops::cancel_replaced(&self.hub, &id, None, "session replaced by an import");
            // Compared when this read finds the session: one deleted meanwhile has nothing
            // to lose. One the first read missed (created meanwhile, or not readable then)
            // carried nothing, so any compaction it holds now would be lost.
            let now = self.compaction_trail(&id).await;
            let now: Option<Vec<&str>> = now.as_ref().map(Trail::commit_ids);
            let then: Vec<&str> = carried
                .as_ref()
                .map(|c| c.iter().map(String::as_str).collect())
                .unwrap_or_default();
            if now.is_some_and(|now| now != then) {
                return Err(Status::aborted(format!(
                    "session {id} was compacted while the import was built, which would \
                     lose that compaction: import again (keep_compactions keeps it)"
                )));
            }
        }
        let (messages, parts) = (session.messages().len(), session.part_count());
        let generation = session.generation();
        // On a task of its own, as a delete: a caller that stops waiting while the
        // session is written must not leave a replace landed with the replaced session's
        // compaction still running (and paid for) until it finds itself stale.
        let (hub, replace, sid) = (self.hub.clone(), req.replace, id.clone());
        let placing = tokio::spawn(async move {
            let handle = hub
                .store
                .insert(session, replace)
                .await
                .map_err(Rejection::from)?;
            if replace {
                // Not a compaction of the imported session, started while it was written.
                ops::cancel_replaced(
                    &hub,
                    &sid,
                    Some(generation),
                    "session replaced by an import",
                );
            }
            tracing::info!(session_id = %sid, messages, parts, "session imported");
            Ok::<_, Rejection>(handle)
        });
        let handle = placing
            .await
            .map_err(|e| Status::internal(format!("import task failed: {e}")))??;
        Ok(ops::summary_of(&self.hub, &handle, true).await?)
    }
}

/// Grows the document's buffer to hold `needed` bytes, reserving its capacity first: as
/// a Vec would grow it (doubling, within `limit`), or exactly when the doubled size is
/// refused.
fn grow(
    text: &mut Vec<u8>,
    held: &mut Reservation,
    ledger: &Arc<Ledger>,
    needed: usize,
    limit: ByteLimit,
) -> Result<(), Status> {
    let cap = usize::try_from(limit.bytes).unwrap_or(usize::MAX);
    let doubled = needed.max(text.capacity().saturating_mul(2)).min(cap);
    let bytes = |n: usize| u64::try_from(n).unwrap_or(u64::MAX);
    let capacity = if held
        .resize(ledger, bytes(doubled), "an imported document")
        .is_ok()
    {
        doubled
    } else {
        held.resize(ledger, bytes(needed), "an imported document")
            .map_err(Rejection::from)?;
        needed
    };
    text.reserve_exact(capacity.saturating_sub(text.len()));
    Ok(())
}

/// A chunked import refused for its pace.
fn slow(message: String) -> Status {
    Rejection {
        code: tonic::Code::ResourceExhausted,
        field: String::new(),
        message,
    }
    .into()
}

/// A limited import's refusal: an invalid document names its JSON path under `root`;
/// one past the limit is `RESOURCE_EXHAUSTED` naming the limit.
fn limited(e: trace::LimitedError, root: &str) -> Rejection {
    match e {
        trace::LimitedError::Invalid(e) => Rejection::from(e).within_root(root),
        trace::LimitedError::TooLarge { ref path, .. } => {
            // The field names the path: the text does not say it twice.
            let text = e.to_string();
            let message = text
                .strip_prefix(&format!("{path}: "))
                .map_or_else(|| text.clone(), str::to_string);
            Rejection {
                code: tonic::Code::ResourceExhausted,
                field: format!("{root}.{path}"),
                message,
            }
        }
    }
}
