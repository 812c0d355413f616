//! The context kept rendered between calls, one chunk per message.
//!
//! A host asks for the context before every model request, and between two requests only
//! a few messages change (the last step's parts, a prune or a strategy mark now and
//! then). Rendering every message again costs the whole context each time (about 0.3 ms
//! for 200K tokens). A [`ContextCache`] keeps each message's rendering under its
//! revision ([`super::stored::Message::rev`], renewed by every change the context reads),
//! so a call renders only the messages that changed and copies the rest.
//!
//! The engine holds no cache itself: its owner (the session's actor) keeps one beside the
//! session, counts its bytes with the session's, and may drop it at any time; a call
//! after that renders everything again and reads the same.

use std::mem::size_of;
use std::sync::Arc;

use super::context::{Keep, NativeContext, OpenAiContext};
use super::json_array::JsonArray;
use super::openai::{ChatMessage, chat_messages};
use super::render::{Copying, Reading};
use super::session::Session;
use super::stored::{Message, StoredPart};
use crate::domain::MessageInfo;

/// Shapes kept at once: a reply with both the native and the OpenAI messages needs two.
const SHAPES: usize = 2;

/// Each context message's rendering in the shapes last asked for, by message position,
/// with the figures the reply carries.
#[derive(Debug, Default)]
pub struct ContextCache {
    /// At most [`SHAPES`], the most recently used last.
    shapes: Vec<Shape>,
    /// Calls so far: entries a call did not use are dropped at its end.
    calls: u64,
    /// Messages rendered and messages reused, over every call.
    rendered: u64,
    reused: u64,
}

/// The renderings of one shape.
#[derive(Debug)]
struct Shape {
    /// The caller's name for its renderer.
    name: &'static str,
    /// By message position; `None` where nothing is kept.
    entries: Vec<Option<Entry>>,
    /// Bytes of the chunks held.
    chunk_bytes: u64,
}

/// One message's rendering as of one revision.
#[derive(Debug)]
struct Entry {
    rev: u64,
    keep: Keep,
    /// The call that last used it.
    used: u64,
    /// Context tokens of the parts the message sends.
    tokens: u64,
    /// False when the context drops the message (an errored step, only a step start).
    sent: bool,
    /// The rendering, shared with the replies that carry it.
    chunk: Arc<[u8]>,
}

/// Bytes of an `Arc<[u8]>` allocation beyond its data (the two counts).
const ARC_HEADER: u64 = 2 * size_of::<usize>() as u64;

/// Bytes a chunk's allocation holds.
fn chunk_cost(chunk: &[u8]) -> u64 {
    (chunk.len() as u64).saturating_add(ARC_HEADER)
}

impl ContextCache {
    /// Bytes the cache holds: its slots and every chunk (what the memory budget counts).
    pub fn held_bytes(&self) -> u64 {
        self.shapes.iter().fold(0u64, |sum, s| {
            let slots = (s.entries.capacity() * size_of::<Option<Entry>>()) as u64;
            sum.saturating_add(slots).saturating_add(s.chunk_bytes)
        })
    }

    /// Drops every rendering (memory pressure; the next call renders everything).
    pub fn clear(&mut self) {
        self.shapes = Vec::new();
    }

    /// Messages with a rendering kept, over every shape.
    pub fn len(&self) -> usize {
        self.shapes
            .iter()
            .map(|s| s.entries.iter().flatten().count())
            .sum()
    }

    /// True when nothing is kept.
    pub fn is_empty(&self) -> bool {
        self.shapes.is_empty()
    }

    /// Messages rendered and messages taken as kept, over every call so far: how much
    /// of the context the calls rendered again.
    pub fn rendered_reused(&self) -> (u64, u64) {
        (self.rendered, self.reused)
    }

    /// The renderings of shape `name`, made the most recently used; the least recently
    /// used shape goes when there are too many.
    fn shape(&mut self, name: &'static str) -> &mut Shape {
        match self.shapes.iter().position(|s| s.name == name) {
            Some(i) => {
                let s = self.shapes.remove(i);
                self.shapes.push(s);
            }
            None => {
                if self.shapes.len() >= SHAPES {
                    self.shapes.remove(0);
                }
                self.shapes.push(Shape {
                    name,
                    entries: Vec::new(),
                    chunk_bytes: 0,
                });
            }
        }
        let last = self.shapes.len() - 1;
        &mut self.shapes[last]
    }
}

/// The chunks of one call, in order, with the context's figures.
struct Chunks {
    chunks: Vec<Arc<[u8]>>,
    tokens: u64,
    context_messages: usize,
}

impl Session {
    /// The context's OpenAI messages as chunks, one per message that renders to any, in
    /// order: each is `render`'s bytes for the message's chat messages, taken from
    /// `cache` when the message has not changed since (`shape` names `render`'s output).
    /// Reads as [`Self::context_openai_as`] with `render` applied message by message.
    pub(crate) fn context_openai_chunks(
        &self,
        cache: &mut ContextCache,
        shape: &'static str,
        mut render: impl FnMut(&[ChatMessage<'_>], &mut Vec<u8>),
    ) -> OpenAiContext<Vec<Arc<[u8]>>> {
        let c = self.chunks(cache, shape, Copying::Sent, |msg, parts, out| {
            let mut chat = Vec::new();
            chat_messages(
                msg.info.role,
                parts.iter().map(|(_, p)| p.read()),
                &mut chat,
            );
            if !chat.is_empty() {
                render(&chat, out);
            }
        });
        OpenAiContext {
            json: c.chunks,
            tokens: c.tokens,
            context_messages: c.context_messages,
            boundary_message_id: self.boundary_message_id(),
        }
    }

    /// The context's native messages as chunks, one per message, each `render`'s bytes
    /// for the message's info and parts as the view reads them, taken from `cache` when
    /// the message has not changed since. Reads as [`Self::build_context`]'s messages.
    pub(crate) fn context_native_chunks(
        &self,
        cache: &mut ContextCache,
        shape: &'static str,
        mut render: impl FnMut(&MessageInfo, &[(&StoredPart, Reading<'_>)], &mut Vec<u8>),
    ) -> NativeContext<Arc<[u8]>> {
        let c = self.chunks(cache, shape, Copying::Whole, |msg, parts, out| {
            render(&msg.info, parts, out);
        });
        // What a reply holds in flight: the chunks it keeps alive.
        let held_bytes = c.chunks.iter().map(|x| chunk_cost(x)).sum();
        NativeContext {
            messages: c.chunks,
            tokens: c.tokens,
            held_bytes,
            boundary_message_id: self.boundary_message_id(),
        }
    }

    /// The one walk behind both: every message the context sends, its chunk from the
    /// cache or rendered now (empty chunks are left out).
    fn chunks(
        &self,
        cache: &mut ContextCache,
        name: &'static str,
        copying: Copying,
        mut render: impl FnMut(&Message, &[(&StoredPart, Reading<'_>)], &mut Vec<u8>),
    ) -> Chunks {
        cache.calls = cache.calls.wrapping_add(1);
        let call = cache.calls;
        let (mut rendered, mut reused) = (0u64, 0u64);
        let shape = cache.shape(name);
        let len = self.messages().len();
        if shape.entries.len() > len {
            // Only another session state is shorter: nothing of it is reused.
            shape.entries = Vec::new();
            shape.chunk_bytes = 0;
        }
        shape.entries.resize_with(len, || None);
        let slots = self.context_slots();
        let mut out = Chunks {
            chunks: Vec::with_capacity(slots.len()),
            tokens: 0,
            context_messages: 0,
        };
        let mut scratch = Vec::new();
        for (i, keep) in slots {
            let rev = self.revision(i);
            let slot = &mut shape.entries[i];
            if matches!(slot, Some(e) if e.rev == rev && e.keep == keep) {
                reused += 1;
            } else {
                rendered += 1;
                let entry = self.render_entry(i, keep, rev, copying, &mut scratch, &mut render);
                let added = chunk_cost(&entry.chunk);
                let freed = slot.replace(entry).map_or(0, |e| chunk_cost(&e.chunk));
                shape.chunk_bytes = shape
                    .chunk_bytes
                    .saturating_sub(freed)
                    .saturating_add(added);
            }
            let Some(e) = shape.entries[i].as_mut() else {
                continue;
            };
            e.used = call;
            if e.sent {
                out.tokens = out.tokens.saturating_add(e.tokens);
                out.context_messages += 1;
                if !e.chunk.is_empty() {
                    out.chunks.push(e.chunk.clone());
                }
            }
        }
        // Messages the context no longer sends (summarized by a compaction): let go.
        for slot in &mut shape.entries {
            if slot.as_ref().is_some_and(|e| e.used != call) {
                let freed = slot.take().map_or(0, |e| chunk_cost(&e.chunk));
                shape.chunk_bytes = shape.chunk_bytes.saturating_sub(freed);
            }
        }
        cache.rendered = cache.rendered.saturating_add(rendered);
        cache.reused = cache.reused.saturating_add(reused);
        out
    }

    /// Renders message `i` as the context sends it under `keep`, under revision `rev`.
    fn render_entry(
        &self,
        i: usize,
        keep: Keep,
        rev: u64,
        copying: Copying,
        scratch: &mut Vec<u8>,
        render: &mut impl FnMut(&Message, &[(&StoredPart, Reading<'_>)], &mut Vec<u8>),
    ) -> Entry {
        let sent = self.sent(std::iter::once((i, keep)), copying).next();
        let mut entry = Entry {
            rev,
            keep,
            used: 0,
            tokens: 0,
            sent: sent.is_some(),
            chunk: Arc::from(&[][..]),
        };
        if let Some((msg, parts)) = sent {
            for (stored, _) in &parts {
                entry.tokens = entry.tokens.saturating_add(stored.context_tokens());
            }
            scratch.clear();
            render(msg, &parts, scratch);
            entry.chunk = Arc::from(&scratch[..]);
        }
        entry
    }

    /// The id of the message the context starts at, when a compaction boundary exists.
    fn boundary_message_id(&self) -> Option<String> {
        self.boundary()
            .map(|b| self.messages()[b.start].info.id.clone())
    }

    /// [`Self::context_openai`] from `cache` (see `Self::context_openai_chunks`): the
    /// same JSON text, rendering only the messages that changed since the cache last saw
    /// them.
    pub fn context_openai_cached(&self, cache: &mut ContextCache) -> OpenAiContext {
        let c = self.context_openai_json_array(cache);
        OpenAiContext {
            json: c.json.to_text(),
            tokens: c.tokens,
            context_messages: c.context_messages,
            boundary_message_id: c.boundary_message_id,
        }
    }

    /// The JSON array of [`Self::context_openai_cached`] as its elements, one chunk per
    /// message that renders to any (its chat messages as JSON, `,`-separated), shared
    /// with `cache`.
    pub fn context_openai_json_array(&self, cache: &mut ContextCache) -> OpenAiContext<JsonArray> {
        let c = self.context_openai_chunks(cache, "openai_json", |m, out| {
            // One message's chat messages as elements of the array. Strings, options and
            // vectors of them always serialize.
            for (k, chat) in m.iter().enumerate() {
                if k > 0 {
                    out.push(b',');
                }
                if sonic_rs::to_writer(&mut *out, chat).is_err() {
                    out.clear();
                    return;
                }
            }
        });
        OpenAiContext {
            json: JsonArray::new(c.json),
            tokens: c.tokens,
            context_messages: c.context_messages,
            boundary_message_id: c.boundary_message_id,
        }
    }
}
