//! The `compactd.v1.Sessions` service: the main stream and its unary twins. Handlers
//! only decode, call `ops`, and encode; every decision is the engine's.

use std::pin::Pin;
use std::sync::Arc;

use tokio::sync::mpsc;
use tokio_stream::Stream;
use tonic::{Request, Response, Status, Streaming};

use super::compaction::{self, Sink};
use super::convert;
use super::held_reply;
use super::hub::Hub;
use super::import::{self, Importer};
use super::ops;
use super::pb;
use super::reply::{self, Reply};
use super::request::{
    self, check_size, context_format, delete_update, pin_update, recall_key, usage_update,
};
use super::status::Rejection;
use crate::domain::HeapSize;
use crate::engine::Update;
use crate::store::{Reservation, Store, StoreError};

pub use super::stream::EventStream;

/// The service state: the shared hub and the per-update size limit.
#[derive(Debug, Clone)]
pub struct SessionsService {
    hub: Arc<Hub>,
    store: Arc<Store>,
    max_update_bytes: usize,
    /// ImportSession and ImportSessionChunked.
    importer: Importer,
}

impl SessionsService {
    /// A service over `hub`.
    pub fn new(hub: Arc<Hub>, max_update_bytes: usize) -> Self {
        SessionsService {
            store: hub.store.clone(),
            importer: Importer::new(hub.clone(), max_update_bytes),
            hub,
            max_update_bytes,
        }
    }

    /// Waits for a unary op's reply, or turns its rejection into a status.
    async fn answer<T>(
        &self,
        session_id: &str,
        kind: &str,
        pending: ops::Pending<T>,
    ) -> Result<T, Status> {
        let outcome = pending.outcome(session_id).await;
        if let Err(r) = &outcome {
            tracing::debug!(session_id, kind, code = ?r.code, field = %r.field, "rejected");
        }
        outcome.map_err(Status::from)
    }

    /// Applies an update and answers its events and ack; an automatic compaction it asks
    /// for runs on its own (no stream to follow it: Subscribe watchers see its events).
    async fn update(
        &self,
        session_id: &str,
        update: Update,
    ) -> Result<Response<pb::UpdateResponse>, Status> {
        let kind = update.kind();
        let pending = ops::apply(&self.hub, session_id, update).await;
        let report = self.answer(session_id, kind, pending).await?;
        if reply::needs_compaction(&report) {
            let hub = self.hub.clone();
            let sid = session_id.to_string();
            tokio::spawn(async move { compaction::start_automatic(&hub, &sid, None).await });
        }
        let events = reply::to_server_events(0, session_id, kind, Ok(Reply::Stepped(report)));
        // Its events may carry a prune's list: a large reply is held until read when the
        // share has room (the update is applied; a refusal now would read as the
        // update's). An ordinary one (an ack) is not worth a watchdog per call.
        let reply = pb::UpdateResponse { events };
        if prost::Message::encoded_len(&reply) < HELD_UPDATE_REPLY {
            return Ok(Response::new(reply));
        }
        Ok(self.held_if_room(reply, "update replies"))
    }

    /// Refuses a request over `max_update_bytes`; otherwise counts its bytes in flight
    /// until the returned reservation is dropped (when the call ends).
    fn check_size<T: prost::Message>(&self, req: &T) -> Result<Reservation, Status> {
        let len = req.encoded_len();
        check_size(len, self.max_update_bytes).map_err(Status::from)?;
        let bytes = u64::try_from(len).unwrap_or(u64::MAX);
        Ok(self
            .store
            .ledger()
            .reserve(bytes, "updates")
            .map_err(Rejection::from)?)
    }

    /// `reply` as a response whose encoded bytes stay counted in flight (as `what`) until
    /// it is sent; past the in-flight share, `RESOURCE_EXHAUSTED`, unless nothing else is
    /// in flight (a session larger than the share can still be read back, alone).
    fn held_until_sent<T: prost::Message>(
        &self,
        reply: T,
        what: &'static str,
    ) -> Result<Response<T>, Status> {
        let held = self.reserve_reply(&reply, what).map_err(Rejection::from)?;
        Ok(held_response(reply, Some(held)))
    }

    /// The in-flight reservation of `reply`'s encoded bytes (alone past the share).
    fn reserve_reply<T: prost::Message>(
        &self,
        reply: &T,
        what: &'static str,
    ) -> Result<crate::store::Reservation, crate::store::StoreError> {
        let bytes = u64::try_from(reply.encoded_len()).unwrap_or(u64::MAX);
        self.store.ledger().reserve_or_alone(bytes, what)
    }

    /// [`Self::held_until_sent`] for the reply to a change already made (an import that
    /// created or replaced its session, an open that created or reconfigured it): held
    /// when the in-flight share has room, else sent unheld. A refusal now would read as
    /// the change's, whose retry would then find the session there (an import's
    /// ALREADY_EXISTS, an open's `created: false`, so a host that sends the history only
    /// to a session it created would skip it). The request it follows was held and given
    /// back just before, so this is rare: traffic that took the room meanwhile.
    fn held_if_room<T: prost::Message>(&self, reply: T, what: &'static str) -> Response<T> {
        let held = self.reserve_reply(&reply, what).ok();
        held_response(reply, held)
    }
}

/// Bytes from which a unary update's reply is held in flight until read.
const HELD_UPDATE_REPLY: usize = 64 << 10;

/// `reply` as a response, its bytes held in flight until sent when `held` is given.
fn held_response<T>(reply: T, held: Option<crate::store::Reservation>) -> Response<T> {
    let mut response = Response::new(reply);
    if let Some(held) = held {
        held_reply::hold(&mut response, held);
    }
    response
}

/// Outbound stream of `Compact`.
pub type CompactionStream = Pin<Box<dyn Stream<Item = Result<pb::CompactionEvent, Status>> + Send>>;
pub use super::watch::WatchStream;

#[tonic::async_trait]
impl pb::sessions_server::Sessions for SessionsService {
    type StreamStream = EventStream;
    type CompactStream = CompactionStream;
    type SubscribeStream = WatchStream;

    async fn compact(
        &self,
        request: Request<pb::CompactRequest>,
    ) -> Result<Response<CompactionStream>, Status> {
        if self.hub.is_draining() {
            return Err(super::drain::refused());
        }
        let req = request.into_inner();
        require_session(&req.session_id)?;
        let (tx, rx) = mpsc::channel(256);
        let options = compaction::Options::try_from(req.options.unwrap_or_default())
            .map_err(|r| Status::from(r.within("options")))?;
        let sink = Sink::owning(tx.clone());
        let events = sink.until_outcome(rx);
        // The job waits for `started` to be first in the channel.
        let (go, gone) = tokio::sync::oneshot::channel();
        let started =
            compaction::start(&self.hub, &req.session_id, options, Some(sink), Some(gone))
                .await
                .map_err(|r| r.within_payload("options"))?;
        // The receiver is ours until we return it; this send cannot fail.
        let _ = tx.send(started.into()).await;
        drop(tx);
        let _ = go.send(());
        Ok(Response::new(Box::pin(events)))
    }

    async fn subscribe(
        &self,
        request: Request<pb::SubscribeRequest>,
    ) -> Result<Response<WatchStream>, Status> {
        if self.hub.is_draining() {
            return Err(super::drain::refused());
        }
        let only = request.into_inner().session_id;
        if !only.is_empty() {
            require_session(&only)?;
        }
        // Following the bus before the check: a delete after it reaches this watcher.
        let events = super::watch::run(&self.hub, only.clone());
        // Watching needs nothing of the session: a cold one stays on disk.
        if !only.is_empty() && !self.store.holds(&only) {
            return Err(Rejection::from(StoreError::NotFound(only)).into());
        }
        Ok(Response::new(super::drain::until_closed(
            events,
            self.hub.closing(),
        )))
    }

    async fn stream(
        &self,
        request: Request<Streaming<pb::ClientUpdate>>,
    ) -> Result<Response<EventStream>, Status> {
        if self.hub.is_draining() {
            return Err(super::drain::refused());
        }
        let peer = request
            .remote_addr()
            .map(|a| a.to_string())
            .unwrap_or_default();
        let inbound = request.into_inner();
        let events = super::stream::run(self.hub.clone(), inbound, self.max_update_bytes, peer);
        Ok(Response::new(super::drain::after_closed(
            events,
            self.hub.closing(),
        )))
    }

    async fn open_session(
        &self,
        request: Request<pb::OpenSessionRequest>,
    ) -> Result<Response<pb::SessionSummary>, Status> {
        let req = request.into_inner();
        let mut held = self.check_size(&req)?;
        let Some(info) = req.session else {
            return Err(Rejection::invalid("session", "required").into());
        };
        let info =
            convert::session_from_pb(info, "").map_err(|r| Status::from(r.within("session")))?;
        request::hold_decoded(&mut held, self.store.ledger(), info.heap_bytes())?;
        let id = info.id.clone();
        let pending = ops::open_summary(&self.hub, info).await;
        let summary = self.answer(&id, "open", pending).await?;
        // The request is applied: its bytes are the session's now. The summary carries
        // the title (bounded by --max-update-bytes only): held in flight until the
        // client reads it when the share has room, else sent unheld, as an import's:
        // the open is made, and a refusal now would tell the client it was not.
        drop(held);
        Ok(self.held_if_room(summary, "sessions"))
    }

    async fn upsert_message(
        &self,
        request: Request<pb::UpsertMessageRequest>,
    ) -> Result<Response<pb::UpdateResponse>, Status> {
        let req = request.into_inner();
        let mut held = self.check_size(&req)?;
        require_session(&req.session_id)?;
        let Some(m) = req.message else {
            return Err(Rejection::invalid("message", "required").into());
        };
        let info = convert::message_from_pb(m).map_err(|r| Status::from(r.within("message")))?;
        request::hold_decoded(&mut held, self.store.ledger(), info.heap_bytes())?;
        self.update(&req.session_id, Update::UpsertMessage(info))
            .await
    }

    async fn upsert_part(
        &self,
        request: Request<pb::UpsertPartRequest>,
    ) -> Result<Response<pb::UpdateResponse>, Status> {
        let req = request.into_inner();
        let mut held = self.check_size(&req)?;
        require_session(&req.session_id)?;
        let Some(p) = req.part else {
            return Err(Rejection::invalid("part", "required").into());
        };
        let part = convert::part_from_pb(p).map_err(|r| Status::from(r.within("part")))?;
        request::hold_decoded(&mut held, self.store.ledger(), part.heap_bytes())?;
        self.update(&req.session_id, Update::UpsertPart(part)).await
    }

    async fn delete_part(
        &self,
        request: Request<pb::DeletePartRequest>,
    ) -> Result<Response<pb::UpdateResponse>, Status> {
        let req = request.into_inner();
        require_session(&req.session_id)?;
        let update = delete_update(req.message_id, req.part_id)?;
        self.update(&req.session_id, update).await
    }

    async fn report_usage(
        &self,
        request: Request<pb::ReportUsageRequest>,
    ) -> Result<Response<pb::UpdateResponse>, Status> {
        let req = request.into_inner();
        require_session(&req.session_id)?;
        let Some(usage) = req.usage else {
            return Err(Rejection::invalid("usage", "required").into());
        };
        let update = usage_update(usage).map_err(|r| Status::from(r.within("usage")))?;
        self.update(&req.session_id, update).await
    }

    async fn get_context(
        &self,
        request: Request<pb::GetContextRequest>,
    ) -> Result<Response<pb::Context>, Status> {
        let req = request.into_inner();
        require_session(&req.session_id)?;
        let format = context_format(req.format)?;
        let pending = ops::context(&self.hub, &req.session_id, format).await;
        let context = self.answer(&req.session_id, "get_context", pending).await?;
        let (context, held) = context.into_parts();
        let mut response = Response::new(context);
        held_reply::hold(&mut response, held);
        Ok(response)
    }

    async fn prune(
        &self,
        request: Request<pb::PruneRequest>,
    ) -> Result<Response<pb::PruneReport>, Status> {
        let req = request.into_inner();
        require_session(&req.session_id)?;
        let pending = ops::prune(&self.hub, &req.session_id, req.dry_run).await;
        let report = self.answer(&req.session_id, "prune", pending).await?;
        // A report lists every output it cleared (a dry run every candidate): held in
        // flight until read, as every large reply. A dry run changed nothing and is
        // refused past the share; a commit's reply follows a change already made.
        let report = convert::prune_to_pb(&report);
        if req.dry_run {
            self.held_until_sent(report, "prune reports")
        } else {
            Ok(self.held_if_room(report, "prune reports"))
        }
    }

    async fn check_overflow(
        &self,
        request: Request<pb::CheckOverflowRequest>,
    ) -> Result<Response<pb::OverflowCheck>, Status> {
        let req = request.into_inner();
        require_session(&req.session_id)?;
        let pending = ops::check_overflow(&self.hub, &req.session_id).await;
        let check = self
            .answer(&req.session_id, "check_overflow", pending)
            .await?;
        Ok(Response::new(convert::overflow_to_pb(&check)))
    }

    async fn get_session(
        &self,
        request: Request<pb::GetSessionRequest>,
    ) -> Result<Response<pb::GetSessionResponse>, Status> {
        let req = request.into_inner();
        require_session(&req.session_id)?;
        let handle = self
            .store
            .get(&req.session_id)
            .await
            .map_err(Rejection::from)?;
        let ledger = self.store.ledger().clone();
        let (resp, held) = handle
            .call(move |s, _| {
                // Reserved before the copy is built, at what the session holds (about
                // what the copy takes: its JSON expands into `Struct`s as the session's
                // does into `Value`s) or the whole share, then set to the reply's bytes:
                // readers of large sessions are refused past the share instead of each
                // building a copy, and one read alone pushes no further past it than its
                // reply did before.
                let estimate = s.held_bytes().min(ledger.in_flight_limit());
                let mut held = ledger.reserve_or_alone(estimate, "sessions")?;
                let resp = pb::GetSessionResponse {
                    info: Some(convert::session_to_pb(s.info())),
                    messages: s.messages().iter().map(convert::message_to_pb).collect(),
                    summary: Some(convert::summary_to_pb(s, false)),
                };
                let bytes = u64::try_from(prost::Message::encoded_len(&resp)).unwrap_or(u64::MAX);
                held.resize_or_alone(&ledger, bytes, "sessions")?;
                Ok::<_, StoreError>((resp, held))
            })
            .await
            .and_then(|built| built)
            .map_err(Rejection::from)?;
        Ok(held_response(resp, Some(held)))
    }

    async fn list_sessions(
        &self,
        request: Request<pb::ListSessionsRequest>,
    ) -> Result<Response<pb::ListSessionsResponse>, Status> {
        let page = request::list_page(request.into_inner()).map_err(Status::from)?;
        // Both sides read at one moment: a session sent cold (or loaded) while the
        // summaries are built is listed once, not twice or not at all.
        let (hot, cold) = self.store.listing();
        let entries = hot
            .into_iter()
            .map(|h| (h.id().to_string(), Some(h)))
            .chain(cold.into_iter().map(|id| (id, None)))
            .collect();
        // Only the page's sessions are looked at.
        let (entries, next_page_token) = request::take_page(entries, &page);
        // Cold sessions by id only: listing must not load every session into memory.
        let cold_summary = |id: String| pb::SessionSummary {
            id,
            cold: true,
            ..Default::default()
        };
        // Queue every request first, then collect: one slow session does not serialize the rest.
        let mut pending = Vec::with_capacity(entries.len());
        for (id, h) in entries {
            // A look, not a use: listing keeps no session in memory past its idle TTL.
            let rx = match h {
                Some(h) => Some(h.look(|s, _| convert::summary_to_pb(s, false)).await.ok()),
                None => None,
            };
            pending.push((id, rx));
        }
        let mut sessions = Vec::with_capacity(pending.len());
        for (id, rx) in pending {
            match rx {
                None => sessions.push(cold_summary(id)),
                Some(Some(rx)) => match rx.await {
                    Ok(Ok(s)) => sessions.push(s),
                    // Sent cold before its turn (a deleted one is gone from disk too).
                    _ if self.store.holds(&id) => sessions.push(cold_summary(id)),
                    _ => {}
                },
                Some(None) if self.store.holds(&id) => sessions.push(cold_summary(id)),
                Some(None) => {}
            }
        }
        // Every session's title: as large as the sessions make it, so held in flight
        // until read (an unread listing is dropped after the slow-reader grace).
        self.held_until_sent(
            pb::ListSessionsResponse {
                sessions,
                next_page_token,
            },
            "session lists",
        )
    }

    async fn delete_session(
        &self,
        request: Request<pb::DeleteSessionRequest>,
    ) -> Result<Response<pb::DeleteSessionResponse>, Status> {
        let req = request.into_inner();
        require_session(&req.session_id)?;
        // On a task of its own: a caller that stops waiting (its deadline, a hang-up)
        // while the delete is written must not leave it half done, landed on disk with
        // its watchers never told and its compaction still paid for.
        let hub = self.hub.clone();
        let deleting = tokio::spawn(async move {
            let id = req.session_id;
            let removed = hub.store.remove(&id).await.map_err(Rejection::from)?;
            if !removed {
                return Err(Rejection::from(crate::store::StoreError::NotFound(id)));
            }
            hub.gone(&id);
            let now = ops::generation_held(&hub, &id).await;
            ops::cancel_replaced(&hub, &id, now, "session deleted");
            tracing::info!(session_id = %id, "session deleted");
            Ok(())
        });
        deleting
            .await
            .map_err(|e| Status::internal(format!("delete task failed: {e}")))??;
        Ok(Response::new(pb::DeleteSessionResponse { deleted: true }))
    }

    async fn import_session(
        &self,
        request: Request<pb::ImportSessionRequest>,
    ) -> Result<Response<pb::SessionSummary>, Status> {
        let mut req = request.into_inner();
        let held = self.check_size(&req)?;
        let document = import::document(&mut req)?;
        // The document's bytes are given back once it is a session; its summary (the
        // title, bounded by the document only) is held until read, as OpenSession's.
        let summary = self.importer.import(req, document, held).await?;
        Ok(self.held_if_room(summary, "sessions"))
    }

    async fn import_session_chunked(
        &self,
        request: Request<Streaming<pb::ImportSessionChunk>>,
    ) -> Result<Response<pb::SessionSummary>, Status> {
        let (req, document, held) = self.importer.collect(request.into_inner()).await?;
        let summary = self.importer.import(req, document, held).await?;
        Ok(self.held_if_room(summary, "sessions"))
    }

    async fn pin(
        &self,
        request: Request<pb::PinRequest>,
    ) -> Result<Response<pb::UpdateResponse>, Status> {
        let req = request.into_inner();
        require_session(&req.session_id)?;
        let update = pin_update(req.message_id, req.part_id, req.pinned)?;
        self.update(&req.session_id, update).await
    }

    async fn recall(
        &self,
        request: Request<pb::RecallRequest>,
    ) -> Result<Response<pb::Recalled>, Status> {
        let req = request.into_inner();
        require_session(&req.session_id)?;
        let key = recall_key(req.key)?;
        let pending = ops::recall(&self.hub, &req.session_id, key).await;
        let recalled = self.answer(&req.session_id, "recall", pending).await?;
        self.held_until_sent(convert::recalled_to_pb(&recalled), "recalled parts")
    }

    async fn get_recall_tool(
        &self,
        _request: Request<pb::GetRecallToolRequest>,
    ) -> Result<Response<pb::RecallTool>, Status> {
        Ok(Response::new(pb::RecallTool {
            name: crate::engine::RECALL_TOOL.to_string(),
            json: crate::engine::recall_tool_json(),
        }))
    }
}

/// A session id a call names: present, and bounded like every id (a longer one names no
/// session, and would be echoed whole in the NOT_FOUND).
fn require_session(id: &str) -> Result<(), Status> {
    crate::domain::check_id("session_id", id).map_err(|e| Status::from(Rejection::from(e)))
}
