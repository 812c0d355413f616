//! Running a compaction: claim the session's slot, plan inside the session actor, stream
//! the summary from the summarizer in a task of its own (so the session keeps applying
//! updates), then commit inside the actor and announce `session.compacted`.
//!
//! Every event goes to the `Subscribe` bus and to the caller's sink (the `Compact` response
//! or the main stream); `session.compacted` goes on the bus from the commit itself, in the
//! session's order. A failure at any point commits nothing: the session is exactly as it
//! was, plus whatever updates arrived meanwhile.

use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::{mpsc, oneshot};
use tonic::Code;

use super::clock::now_ms;
use super::hub::{Claim, Hub, Running};
use super::pb;
use super::pb::compaction_event::Event as Ce;
use super::reply;
use super::status::Rejection;
use crate::engine::{
    CommitIds, CompactionError, CompactionPlan, CompactionRequest, ContextView, Event, PruneReport,
    SummaryOutcome,
};
use crate::store::StoreError;
use crate::summarize::{Progress, SummarizeError, Summarizer, SummaryRequest, Window, chunk};
use crate::tokens::Tokenizer;

/// One item a compaction hands its caller: an event and, with `compacted`, what its
/// commit applied of the held decisions (an automatic prune, heard of right after it).
#[derive(Debug)]
pub struct Handed {
    /// The event.
    pub event: pb::CompactionEvent,
    /// The prune that follows it: a `Stream` sends it as `pruned`; a `Compact` call has
    /// no place for it (`Subscribe` has it).
    pub pruned: Option<Box<pb::PruneReport>>,
}

impl From<pb::CompactionEvent> for Handed {
    fn from(event: pb::CompactionEvent) -> Handed {
        Handed {
            event,
            pruned: None,
        }
    }
}

/// Where a compaction's events go besides the bus.
#[derive(Debug, Clone)]
pub struct Sink {
    tx: mpsc::Sender<Handed>,
    /// The caller owns the compaction: when it stops listening, the compaction stops.
    cancel_on_drop: bool,
    /// Where the outcome waits when the owner took no event for the slow-reader grace
    /// (see [`Sink::until_outcome`]).
    outcome: Outcome,
}

/// The outcome of a compaction whose `Compact` caller read too slowly to be handed it:
/// the call ends with it once it has read what came before.
type Outcome = Arc<std::sync::Mutex<Option<pb::CompactionEvent>>>;

impl Sink {
    /// A sink whose closing cancels the compaction (the `Compact` RPC).
    pub fn owning(tx: mpsc::Sender<Handed>) -> Sink {
        Sink {
            tx,
            cancel_on_drop: true,
            outcome: Outcome::default(),
        }
    }

    /// A sink that only listens (the main stream).
    pub fn listening(tx: mpsc::Sender<Handed>) -> Sink {
        Sink {
            tx,
            cancel_on_drop: false,
            outcome: Outcome::default(),
        }
    }

    /// A `Compact` call's events from `rx`, the receiver of this (owning) sink's
    /// channel, up to and including its outcome. Its sink dropped for a slow reader, the
    /// call reads what was sent, then the outcome when the compaction had reached one
    /// (it was not cancelled then: a commit is not undone), else a status saying it was
    /// cancelled.
    pub fn until_outcome(
        &self,
        rx: mpsc::Receiver<Handed>,
    ) -> impl tokio_stream::Stream<Item = Result<pb::CompactionEvent, tonic::Status>> + Send + 'static
    {
        let outcome = self.outcome.clone();
        futures::stream::unfold((rx, false), move |(mut rx, ended)| {
            let outcome = outcome.clone();
            async move {
                if ended {
                    return None;
                }
                let e = match rx.recv().await {
                    Some(handed) => handed.event,
                    None => {
                        let kept = outcome.lock().unwrap_or_else(|e| e.into_inner()).take();
                        return Some((kept.ok_or_else(slow_reader_cancelled), (rx, true)));
                    }
                };
                let last = matches!(e.event, Some(Ce::Compacted(_) | Ce::Failed(_)));
                Some((Ok(e), (rx, last)))
            }
        })
    }
}

/// A `Compact` call's end when its compaction was cancelled for its slow reading.
fn slow_reader_cancelled() -> tonic::Status {
    tonic::Status::resource_exhausted(
        "the compaction ended without its outcome reaching this call: its events were not \
         read for the slow-reader grace (--slow-reader-grace-secs), so it was cancelled",
    )
}

/// What the caller asked for.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// Appended to the prompt.
    pub instructions: String,
    /// Replaces the summary prompt (empty: the session's, else the server's).
    pub prompt: String,
    /// Replaces the compaction agent's system prompt (empty: inherited as `prompt`).
    pub system: String,
    /// Replaces the summary template (empty: inherited as `prompt`).
    pub template: String,
    /// Model for this compaction (wins over the session's `compaction_model`).
    pub model: String,
    /// User turns kept verbatim.
    pub tail_turns: Option<u32>,
    /// Started automatically.
    pub auto: bool,
    /// Started because the context overflowed.
    pub overflow: bool,
}

impl Options {
    /// An automatic compaction, started because the session overflows (only
    /// [`start_automatic`] starts one).
    fn automatic() -> Options {
        Options {
            auto: true,
            overflow: true,
            ..Options::default()
        }
    }
}

impl TryFrom<pb::CompactOptions> for Options {
    type Error = Rejection;

    /// A request's own prompts and model, held to the rules a session's are (they stay
    /// in memory for the whole compaction); the field is named within the options. A
    /// blank prompt, system prompt or template is not given, as in a session's config.
    fn try_from(o: pb::CompactOptions) -> Result<Self, Rejection> {
        let given = |v: String| {
            if crate::config::compaction_text_given(&v) {
                v
            } else {
                String::new()
            }
        };
        let (prompt, system, template) = (given(o.prompt), given(o.system), given(o.template));
        for (key, v) in [
            ("instructions", &o.instructions),
            ("prompt", &prompt),
            ("system", &system),
            ("template", &template),
        ] {
            crate::config::compaction_text(key, v)?;
        }
        crate::config::model_name("model", &o.model)?;
        Ok(Options {
            instructions: o.instructions,
            prompt,
            system,
            template,
            model: o.model,
            tail_turns: o.tail_turns,
            auto: false,
            overflow: false,
        })
    }
}

/// Starts the automatic compaction an update asked for (the engine's `CompactionNeeded`):
/// the one place automatic compactions begin. The stream passes a sink to follow its
/// events; the unary twins pass none (Subscribe watchers still see them). A compaction that
/// cannot start (none configured, one already running, draining) is only logged: the
/// update that asked for it has succeeded.
pub async fn start_automatic(
    hub: &Arc<Hub>,
    session_id: &str,
    sink: Option<Sink>,
) -> Option<pb::CompactionEvent> {
    match start(hub, session_id, Options::automatic(), sink, None).await {
        Ok(started) => Some(started),
        Err(r) => {
            tracing::debug!(session_id, reason = %r.message, "automatic compaction not started");
            None
        }
    }
}

/// Bytes in flight per head token while a compaction runs: the head view (about four
/// bytes a token) and the request built from it.
const PROMPT_BYTES_PER_TOKEN: u64 = 8;

/// Starts a compaction of `session_id` and returns its `started` event. The rest of the
/// events follow on `sink` (once `go` fires, when given) and on the bus. A refusal names
/// its field within the options (`model`): the caller puts them where its request has
/// them ([`Rejection::within_payload`]).
pub async fn start(
    hub: &Arc<Hub>,
    session_id: &str,
    mut options: Options,
    sink: Option<Sink>,
    go: Option<oneshot::Receiver<()>>,
) -> Result<pb::CompactionEvent, Rejection> {
    let Some(summarizer) = hub.compaction.summarizer.clone() else {
        return Err(precondition(SummarizeError::NotConfigured.to_string()));
    };
    // A model the request names is checked first: refused before the session is loaded,
    // claimed or planned (the field is named within the options; each entry point names
    // where they sit).
    if !options.model.is_empty() {
        hub.compaction.check_model("model", &options.model)?;
    }
    let handle = hub.store.get(session_id).await?;
    // Held by this call until the job takes it: every early return below frees it.
    let claim = hub.claim(session_id).map_err(|refused| match refused {
        super::hub::Refused::Draining => Rejection {
            code: tonic::Code::Unavailable,
            field: String::new(),
            message: "compactd is draining and starts no new compactions".into(),
        },
        super::hub::Refused::Busy(r) => precondition(format!(
            "compaction {} is already running for session {session_id}",
            r.id
        )),
    })?;
    let running = claim.running().clone();
    let cfg = hub.compaction.clone();
    let (auto, overflow, turns) = (options.auto, options.overflow, options.tail_turns);
    let planned = handle
        .call(move |s, _| {
            let tail = cfg.tail(turns, s.info().limits.usable_input());
            let plan = s.plan_compaction(CompactionRequest {
                tail,
                auto,
                overflow,
            })?;
            let head = s.head_view(&plan);
            let tail_id = plan.tail_start_id().unwrap_or_default().to_string();
            Ok::<_, CompactionError>((plan, head, tail_id, s.info().config.clone()))
        })
        .await;
    let (plan, head, tail_id, session) = match planned {
        Ok(Ok(p)) => p,
        Ok(Err(e)) => return Err(precondition(e.to_string())),
        Err(e) => return Err(e.into()),
    };
    // Deleted or replaced while planning, and planned on a value the id no longer holds:
    // cancelled now, so the job ends "cancelled" (its request ends at once).
    if let Some(generation) = plan.generation()
        && claim.planned_on(generation)
    {
        tracing::info!(session_id, compaction_id = %running.id, "compaction cancelled: its session was replaced while it was planned");
    }
    // The request's model and prompts win over the session's, which win over the server's.
    for (field, session) in [
        (&mut options.system, session.compaction_system),
        (&mut options.prompt, session.compaction_prompt),
        (&mut options.template, session.compaction_template),
    ] {
        if field.is_empty()
            && let Some(v) = session
        {
            *field = v;
        }
    }
    // The request's model was checked above. The session's was checked when it was
    // set, but the operator may have changed the allow-list since (a restart on the same
    // data): then the server's model compacts it, as for a session that names none,
    // rather than every compaction of it, automatic ones too, failing on a field the
    // request never set.
    let model = if options.model.is_empty() {
        session.compaction_model.filter(|m| {
            let allowed = hub.compaction.check_model("model", m);
            if let Err(refused) = &allowed {
                tracing::warn!(session_id, model = %m, reason = %refused.message, "the session's compaction_model is no longer allowed: the server's model compacts it");
            }
            allowed.is_ok()
        })
    } else {
        Some(options.model.clone())
    };
    // The head copied out of the session and the prompts built from it are held until
    // the compaction ends: counted in flight (about 4 bytes per token, twice).
    let prompt = hub.store.ledger().reserve(
        plan.head_tokens.saturating_mul(PROMPT_BYTES_PER_TOKEN),
        "compaction prompt",
    )?;
    let started = event(
        session_id,
        &running.id,
        Ce::Started(pb::CompactionStarted {
            auto,
            tokens_in: plan.head_tokens,
            head_messages: u32::try_from(plan.head.len()).unwrap_or(u32::MAX),
            tail_start_id: tail_id,
            model: model
                .clone()
                .unwrap_or_else(|| summarizer.model().to_string()),
            tokens_before: plan.tokens_before,
        }),
    );
    hub.publish(
        session_id,
        pb::session_event::Event::Compaction(started.clone()),
    );
    tracing::info!(session_id, compaction_id = %running.id, auto, tokens_in = plan.head_tokens, "compaction started");
    let job = Job {
        plan,
        head,
        _prompt: prompt,
        options,
        link: Link {
            hub: hub.clone(),
            session_id: session_id.to_string(),
            running,
            _claim: claim,
            sink,
            summarizer,
            model,
            deltas: 0,
            paid: SummaryOutcome::default(),
        },
    };
    tokio::spawn(async move {
        if let Some(go) = go {
            let _ = go.await;
        }
        job.run().await;
    });
    Ok(started)
}

/// A compaction in its own task: what it summarizes, and its link to the world.
struct Job {
    plan: CompactionPlan,
    head: ContextView,
    /// The head's and the prompts' bytes, counted until the job ends.
    _prompt: crate::store::Reservation,
    options: Options,
    link: Link,
}

/// Where a compaction's requests go (the summarizer) and its events come out (the bus
/// and the caller's sink).
struct Link {
    hub: Arc<Hub>,
    session_id: String,
    running: Running,
    /// The session's compaction slot, freed when the job ends, however it ends.
    _claim: Claim,
    sink: Option<Sink>,
    summarizer: Arc<dyn Summarizer>,
    /// Model override for the endpoint (None: the summarizer's own).
    model: Option<String>,
    deltas: u32,
    /// What the requests answered so far cost (usage and price): a compaction that fails
    /// after some chunks were summarized still reports their spend.
    paid: SummaryOutcome,
}

impl Job {
    async fn run(mut self) {
        let began = Instant::now();
        let outcome = self.summarize().await;
        let mut held_applied = None;
        let result = match outcome {
            // Cancelled once the summary was written (its session deleted or replaced,
            // CancelCompaction, the drain's deadline): a cancelled compaction commits
            // nothing.
            Ok(_) if self.link.running.cancel.is_cancelled() => {
                Err(spent(failed(&SummarizeError::Cancelled), &self.link.paid))
            }
            Ok(summary) => self.commit(summary, began).await.map(|(done, pruned)| {
                held_applied = pruned;
                done
            }),
            Err(e) => Err(spent(failed(&e), &self.link.paid)),
        };
        let paused = match &result {
            Ok(_) => self.record(true).await,
            Err(f) if counts_for_breaker(f) => self.record(false).await,
            Err(_) => false,
        };
        let link = &mut self.link;
        match &result {
            Ok(done) => crate::telemetry::compaction(
                "compacted",
                self.plan.request.auto,
                began.elapsed(),
                done.usage.as_ref().map(|u| (u.input, u.output)),
            ),
            Err(f) => crate::telemetry::compaction(
                &f.kind,
                self.plan.request.auto,
                began.elapsed(),
                f.usage.as_ref().map(|u| (u.input, u.output)),
            ),
        }
        let ev = match result {
            Ok(done) => {
                tracing::info!(session_id = %link.session_id, compaction_id = %link.running.id, tokens_before = done.tokens_before, tokens_after = done.tokens_after, duration_ms = done.duration_ms, "session.compacted");
                Ce::Compacted(done)
            }
            Err(mut f) => {
                f.auto_compaction_paused = paused;
                tracing::warn!(session_id = %link.session_id, compaction_id = %link.running.id, kind = %f.kind, reason = %f.reason, paused, "compaction failed");
                Ce::Failed(f)
            }
        };
        // What the commit applied of the held decisions, heard of after the compaction
        // as any automatic prune (the commit is durable: the store answered): by the
        // caller's sink with the outcome (on the bus, the commit put it right after it).
        link.emit_with(
            ev,
            held_applied
                .as_ref()
                .map(|r| Box::new(super::convert::prune_to_pb(r))),
        )
        .await;
        if let Some(report) = held_applied {
            crate::telemetry::pruned(&report, "auto");
        }
        // The slot is freed as the job drops (`Link::_claim`), after its last event.
    }

    /// Feeds the outcome to the session's loop protection; true when it paused
    /// auto-compaction.
    async fn record(&self, ok: bool) -> bool {
        let auto = self.plan.request.auto;
        let Ok(handle) = self.link.hub.store.get(&self.link.session_id).await else {
            return false;
        };
        handle
            .call(move |s, _| s.record_compaction(auto, ok))
            .await
            .unwrap_or(false)
    }

    /// Summarizes the head with the request's prompts (over the server's), chunked and
    /// folded as `summarize::chunk` decides.
    async fn summarize(&mut self) -> Result<chunk::Summary, SummarizeError> {
        let mut prompts = self.link.hub.compaction.prompts.clone();
        for (field, over) in [
            (&mut prompts.prompt, &self.options.prompt),
            (&mut prompts.system, &self.options.system),
            (&mut prompts.template, &self.options.template),
        ] {
            if !over.is_empty() {
                field.clone_from(over);
            }
        }
        // Counted for the compaction model, which may not be the session's: its family's
        // tokenizer (o200k for all but the GPT-3.5/4 family).
        let model = self
            .link
            .model
            .as_deref()
            .unwrap_or(self.link.summarizer.model());
        let options = chunk::Options {
            previous_summary: self.plan.previous_summary.as_deref(),
            prompts: &prompts,
            instructions: &self.options.instructions,
            counter: Tokenizer::Auto.resolve(model).counter(),
        };
        chunk::summarize_head(&self.head, options, &mut self.link).await
    }

    async fn commit(
        &self,
        summary: chunk::Summary,
        began: Instant,
    ) -> Result<(pb::SessionCompacted, Option<PruneReport>), pb::CompactionFailed> {
        let link = &self.link;
        let handle = link
            .hub
            .store
            .get(&link.session_id)
            .await
            .map_err(|e| unreachable_session(&e))?;
        let plan = self.plan.clone();
        let ids = CommitIds {
            prefix: link.running.id.clone(),
        };
        // What the summary cost: every answer paid for, the dropped ones too (the chunks
        // only sum the answers they kept). Kept for a failure to report (not its text).
        let paid = SummaryOutcome {
            text: String::new(),
            usage: link.paid.usage.or(summary.outcome.usage),
            cost: link.paid.cost,
            model: None,
        };
        let mut outcome = summary.outcome;
        outcome.usage = paid.usage;
        outcome.cost = paid.cost;
        let usage = outcome.usage;
        let cost = outcome.cost;
        let (cancel, me) = (link.running.cancel.clone(), handle.clone());
        let announce = Announce {
            hub: link.hub.clone(),
            session_id: link.session_id.clone(),
            compaction_id: link.running.id.clone(),
            began,
            auto: self.plan.request.auto,
            usage: usage.as_ref().map(super::convert::usage_to_pb),
            cost,
            chunks: summary.chunks,
            dropped_chars: summary.dropped_chars,
        };
        let committed = handle
            .call(move |s, _| {
                // Asked where the commit lands, as it lands: a cancel acknowledged
                // meanwhile (CancelCompaction, the drain's deadline, a delete or a
                // replacement that cancelled it) commits nothing, nor does a session
                // deleted or replaced while this job waited its turn (before its cancel).
                if cancel.is_cancelled() {
                    return Err(true);
                }
                if !me.in_store() {
                    return Err(false);
                }
                Ok(s.commit_compaction(plan, outcome, ids, now_ms())
                    .map(|done| announce.on_commit(s, done)))
            })
            .await
            .map_err(|e| spent(unreachable_session(&e), &paid))?
            .map_err(|cancelled| {
                let f = match cancelled {
                    true => failed(&SummarizeError::Cancelled),
                    false => fail(
                        "session_gone",
                        format!(
                            "session {} was deleted or replaced while its summary was written",
                            link.session_id
                        ),
                        false,
                    ),
                };
                spent(f, &paid)
            })?;
        let (compacted, pruned) = committed.map_err(|e| {
            let kind = match e {
                CompactionError::EmptySummary => "empty_summary",
                CompactionError::NotSmaller { .. } => "not_smaller",
                CompactionError::NothingToCompact => "nothing_to_compact",
                CompactionError::Apply(_) => "commit",
                CompactionError::Stale(_) => "stale",
            };
            // A compaction planned afresh summarizes what the session holds now.
            let retryable = matches!(e, CompactionError::Stale(_));
            spent(fail(kind, e.to_string(), retryable), &paid)
        })?;
        Ok((compacted, pruned))
    }
}

/// What a commit needs to announce itself: `session.compacted`, and the prune the commit
/// applied, go on the bus from inside the session's actor, once the commit is durable.
/// Watchers then hear of it before any later update of the session, as of every
/// update's events. Published after the commit returned (the job first asks the actor to
/// record the outcome), it came after the events of updates queued meanwhile: an
/// overflow of the compacted context read as one from before the compaction.
struct Announce {
    hub: Arc<Hub>,
    session_id: String,
    compaction_id: String,
    began: Instant,
    auto: bool,
    usage: Option<pb::TokenUsage>,
    cost: f64,
    chunks: u32,
    dropped_chars: u64,
}

impl Announce {
    /// The `compacted` event of `done`, published (with its prune) once durable.
    fn on_commit(
        self,
        s: &mut crate::store::Tx<'_>,
        done: crate::engine::Committed,
    ) -> (pb::SessionCompacted, Option<PruneReport>) {
        let compacted = pb::SessionCompacted {
            user_message_id: done.user_message_id,
            summary_message_id: done.summary_message_id,
            tokens_before: done.tokens_before,
            tokens_after: done.tokens_after,
            summary_tokens: done.summary_tokens,
            usage: self.usage,
            cost: self.cost,
            duration_ms: millis(self.began.elapsed()),
            auto: self.auto,
            chunks: self.chunks,
            dropped_chars: self.dropped_chars,
        };
        let on_bus = event(
            &self.session_id,
            &self.compaction_id,
            Ce::Compacted(compacted.clone()),
        );
        let pruned = done
            .pruned
            .as_ref()
            .and_then(|r| reply::bus_event(&Event::Pruned(r.clone())));
        let (hub, sid) = (self.hub, self.session_id);
        s.announce_when_durable(move || {
            hub.publish(&sid, pb::session_event::Event::Compaction(on_bus));
            if let Some(p) = pruned {
                hub.publish(&sid, p);
            }
        });
        (compacted, done.pruned)
    }
}

impl chunk::Requester for Link {
    fn request(
        &mut self,
        request: SummaryRequest,
        last: bool,
    ) -> impl Future<Output = Result<SummaryOutcome, SummarizeError>> + Send {
        self.send(request, last)
    }

    fn window(&mut self) -> impl Future<Output = Option<Window>> + Send {
        let summarizer = self.summarizer.clone();
        let model = self.model.clone();
        let session_id = self.session_id.clone();
        let compaction_id = self.running.id.clone();
        let cancel = self.running.cancel.clone();
        async move {
            // Asking the endpoint takes up to two bounded requests; a cancel does not wait
            // for them (the next request then ends as cancelled).
            let window = tokio::select! {
                w = summarizer.window(model.as_deref()) => w,
                _ = cancel.cancelled() => None,
            };
            if let Some(w) = window {
                tracing::debug!(%session_id, %compaction_id, window = w.tokens, source = w.source.as_str(), ratio = w.ratio, "compaction model's window");
            }
            window
        }
    }

    fn splitting(&mut self, room_tokens: u64, reason: &str) {
        crate::telemetry::compaction_split();
        tracing::info!(session_id = %self.session_id, compaction_id = %self.running.id, room_tokens, reason, "compaction request too long; cutting the rest of the head smaller");
    }
}

impl Link {
    /// One request; its deltas reach the caller only when `stream` is set (intermediate
    /// chunk summaries are not the committed text).
    async fn send(
        &mut self,
        mut request: SummaryRequest,
        stream: bool,
    ) -> Result<SummaryOutcome, SummarizeError> {
        let (ptx, mut prx) = mpsc::channel(64);
        let summarizer = self.summarizer.clone();
        let cancel = self.running.cancel.clone();
        request.model.clone_from(&self.model);
        let fut = summarizer.summarize(request, ptx, cancel);
        let owner = self.sink.clone().filter(|s| s.cancel_on_drop);
        let stop = self.running.cancel.clone();
        // Its progress is handed on beside the request, not in turns with it: while a slow
        // caller is waited on, the request still reads what the endpoint sends (joining
        // the deltas it cannot hand on), so nothing queues unread behind it. The progress
        // ends when the request does (it drops its sender); what it sent last is handed on
        // in order before that.
        let pump = async {
            loop {
                tokio::select! {
                    p = prx.recv() => match p {
                        Some(p) => self.progress(p, stream).await,
                        None => break,
                    },
                    // The caller hung up while the model is silent: stop the request now.
                    () = closed(&owner), if !stop.is_cancelled() => stop.cancel(),
                }
            }
        };
        let (result, ()) = tokio::join!(fut, pump);
        crate::telemetry::compaction_request(match &result {
            Ok(_) => "answered",
            Err(e) => failure_kind(e),
        });
        if let Ok(answered) = &result {
            self.paid.add_spend(answered);
        }
        result
    }

    async fn progress(&mut self, p: Progress, stream: bool) {
        let ev = match p {
            Progress::Voided(spent) => return self.paid.add_spend(&spent),
            Progress::Delta(_) if !stream => return,
            Progress::Delta(text) => {
                let index = self.deltas;
                self.deltas = self.deltas.saturating_add(1);
                Ce::Delta(pb::SummaryDelta { text, index })
            }
            Progress::Retrying {
                attempt,
                reason,
                delay,
            } => {
                // What was streamed before is void: the next delta starts again at 0.
                self.deltas = 0;
                Ce::Retrying(pb::CompactionRetrying {
                    attempt,
                    reason,
                    delay_ms: millis(delay),
                })
            }
        };
        self.emit(ev).await;
    }

    /// Publishes an event and hands it to the caller's sink. A `Compact` caller (it owns
    /// the compaction) that takes none for the slow-reader grace is given up on (its sink
    /// dropped, the compaction cancelled): waiting on it would hold the job, its slot and
    /// its reservations, deaf to a cancel, for as long as the caller kept the call open.
    /// A `Stream` (it listens) has a slow-reader grace of its own, and its writer may be
    /// busy answering updates: it is waited on, until the compaction is cancelled and a
    /// grace has passed.
    async fn emit(&mut self, ev: Ce) {
        self.emit_with(ev, None).await;
    }

    /// [`Self::emit`], handing the caller's sink the prune that follows the event.
    async fn emit_with(&mut self, ev: Ce, pruned: Option<Box<pb::PruneReport>>) {
        let last = matches!(ev, Ce::Compacted(_) | Ce::Failed(_));
        // `compacted` is on the bus already, from its commit (`Announce`).
        let on_bus = !matches!(ev, Ce::Compacted(_));
        let e = event(&self.session_id, &self.running.id, ev);
        if on_bus {
            self.hub.publish(
                &self.session_id,
                pb::session_event::Event::Compaction(e.clone()),
            );
        }
        let Some(sink) = &self.sink else { return };
        let ev_last = last.then(|| e.clone());
        let grace = self.hub.slow_reader_grace;
        let cancel = &self.running.cancel;
        let given_up = async {
            if !sink.cancel_on_drop {
                cancel.cancelled().await;
            }
            tokio::time::sleep(grace).await;
        };
        let sent = tokio::select! {
            biased;
            sent = sink.tx.send(Handed { event: e, pruned }) => sent.is_ok(),
            () = given_up => {
                tracing::warn!(session_id = %self.session_id, compaction_id = %self.running.id, grace_secs = grace.as_secs(), "the caller took no compaction event for the slow-reader grace; its events are dropped");
                false
            }
        };
        if !sent {
            match ev_last {
                // Nothing is left to cancel: the outcome waits for the owner to read
                // up to it (`Sink::until_outcome`).
                Some(e) if sink.cancel_on_drop => {
                    *sink.outcome.lock().unwrap_or_else(|e| e.into_inner()) = Some(e);
                }
                _ if sink.cancel_on_drop => self.running.cancel.cancel(),
                _ => {}
            }
            self.sink = None;
        }
    }
}

/// A duration in whole milliseconds, saturating.
fn millis(d: std::time::Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Resolves when an owning caller stops listening; never for other callers.
async fn closed(owner: &Option<Sink>) {
    match owner {
        Some(sink) => sink.tx.closed().await,
        None => std::future::pending().await,
    }
}

fn event(session_id: &str, id: &str, ev: Ce) -> pb::CompactionEvent {
    pb::CompactionEvent {
        session_id: session_id.to_string(),
        compaction_id: id.to_string(),
        event: Some(ev),
    }
}

fn failed(e: &SummarizeError) -> pb::CompactionFailed {
    fail(failure_kind(e), e.to_string(), e.retryable())
}

/// The failure's `kind`, in events and metrics.
fn failure_kind(e: &SummarizeError) -> &'static str {
    match e {
        SummarizeError::NotConfigured => "not_configured",
        SummarizeError::Request { .. } => "request",
        SummarizeError::Broken(_) => "broken_stream",
        SummarizeError::Malformed(_) => "malformed",
        SummarizeError::Timeout(_) => "timeout",
        SummarizeError::TooLong(_) => "too_long",
        SummarizeError::Cancelled => "cancelled",
    }
}

/// `f` with what the summary it drops cost (its usage and price), so the spend of a
/// compaction that commits nothing is still reported.
fn spent(mut f: pb::CompactionFailed, paid: &SummaryOutcome) -> pb::CompactionFailed {
    f.usage = paid.usage.as_ref().map(super::convert::usage_to_pb);
    f.cost = paid.cost;
    f
}

/// The failure of a commit whose session could not be reached: gone (deleted, or its
/// actor closed with it) is final; a store that could not load or write it (the disk, the
/// memory budget) may take it later, and the paid-for summary was only lost this once.
fn unreachable_session(e: &StoreError) -> pb::CompactionFailed {
    match e {
        StoreError::NotFound(_) | StoreError::Closed(_) => {
            fail("session_gone", e.to_string(), false)
        }
        _ => fail("storage", e.to_string(), true),
    }
}

/// True when a failure counts toward the session's breaker: only a compaction that
/// failed of itself. A cancelled one (CancelCompaction, the drain's deadline, its session
/// deleted or replaced), a stale one (its session replaced), one whose session is gone
/// (its failure would land on a session created again under the id) or one the store
/// could not commit (a full disk, the memory budget) says nothing of the session's
/// compactions.
fn counts_for_breaker(f: &pb::CompactionFailed) -> bool {
    !matches!(
        f.kind.as_str(),
        "cancelled" | "stale" | "storage" | "session_gone"
    )
}

fn fail(kind: &str, reason: String, retryable: bool) -> pb::CompactionFailed {
    pb::CompactionFailed {
        reason,
        retryable,
        kind: kind.into(),
        auto_compaction_paused: false,
        usage: None,
        cost: 0.0,
    }
}

fn precondition(message: String) -> Rejection {
    Rejection {
        code: Code::FailedPrecondition,
        field: String::new(),
        message,
    }
}

#[cfg(test)]
#[path = "compaction_tests.rs"]
mod tests;
