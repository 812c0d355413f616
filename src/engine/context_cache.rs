//! The context's OpenAI messages kept rendered between calls, one chunk per message.
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

use super::context::{Keep, OpenAiContext};
use super::openai::{ChatMessage, chat_messages};
use super::render::Copying;
use super::session::Session;

/// Each context message's rendering in one shape, by message position, with the figures
/// the reply carries.
#[derive(Debug, Default)]
pub struct ContextCache {
    /// The shape the chunks are in (the caller's name for its renderer).
    shape: &'static str,
    /// By message position; `None` where nothing is cached.
    entries: Vec<Option<Entry>>,
    /// Calls so far: entries a call did not use are dropped at its end.
    calls: u64,
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

impl ContextCache {
    /// Bytes the cache holds: its slots and every chunk (what the memory budget counts).
    pub fn held_bytes(&self) -> u64 {
        let slots = self.entries.capacity() * size_of::<Option<Entry>>();
        (slots as u64).saturating_add(self.chunk_bytes)
    }

    /// Drops every rendering (memory pressure; the next call renders everything).
    pub fn clear(&mut self) {
        self.entries = Vec::new();
        self.chunk_bytes = 0;
    }

    /// Messages with a rendering kept.
    pub fn len(&self) -> usize {
        self.entries.iter().flatten().count()
    }

    /// True when nothing is kept.
    pub fn is_empty(&self) -> bool {
        self.chunk_bytes == 0 && self.entries.iter().all(Option::is_none)
    }

    fn chunk_cost(chunk: &[u8]) -> u64 {
        if chunk.is_empty() {
            0 // an empty Arc<[u8]> still allocates its counts; small enough to leave out
        } else {
            (chunk.len() as u64).saturating_add(ARC_HEADER)
        }
    }
}

impl Session {
    /// The context's OpenAI messages as chunks, one per message that renders to any, in
    /// order: each is `render`'s bytes for the message's chat messages, taken from
    /// `cache` when the message has not changed since (`shape` names `render`'s output;
    /// a cache holding another shape starts over). Reads as
    /// [`Self::context_openai_as`] with `render` applied message by message.
    pub(crate) fn context_openai_chunks(
        &self,
        cache: &mut ContextCache,
        shape: &'static str,
        mut render: impl FnMut(&[ChatMessage<'_>], &mut Vec<u8>),
    ) -> OpenAiContext<Vec<Arc<[u8]>>> {
        if cache.shape != shape {
            cache.clear();
            cache.shape = shape;
        }
        cache.calls = cache.calls.wrapping_add(1);
        let call = cache.calls;
        let len = self.messages().len();
        if cache.entries.len() > len {
            // Only a different session state is shorter: nothing of it is reused.
            cache.clear();
        }
        cache.entries.resize_with(len, || None);
        let slots = self.context_slots();
        let mut chunks = Vec::with_capacity(slots.len());
        let (mut tokens, mut context_messages) = (0u64, 0usize);
        let mut scratch = Vec::new();
        for (i, keep) in slots {
            let rev = self.revision(i);
            let fresh = matches!(&cache.entries[i], Some(e) if e.rev == rev && e.keep == keep);
            if !fresh {
                let entry = self.render_entry(i, keep, rev, &mut scratch, &mut render);
                let old = cache.entries[i].replace(entry);
                let freed = old.map_or(0, |e| ContextCache::chunk_cost(&e.chunk));
                let added = cache.entries[i]
                    .as_ref()
                    .map_or(0, |e| ContextCache::chunk_cost(&e.chunk));
                cache.chunk_bytes = cache
                    .chunk_bytes
                    .saturating_sub(freed)
                    .saturating_add(added);
            }
            let Some(e) = cache.entries[i].as_mut() else {
                continue;
            };
            e.used = call;
            if e.sent {
                tokens = tokens.saturating_add(e.tokens);
                context_messages += 1;
                if !e.chunk.is_empty() {
                    chunks.push(e.chunk.clone());
                }
            }
        }
        // Messages the context no longer sends (summarized by a compaction): let go.
        for slot in &mut cache.entries {
            if slot.as_ref().is_some_and(|e| e.used != call) {
                let freed = slot
                    .take()
                    .map_or(0, |e| ContextCache::chunk_cost(&e.chunk));
                cache.chunk_bytes = cache.chunk_bytes.saturating_sub(freed);
            }
        }
        OpenAiContext {
            json: chunks,
            tokens,
            context_messages,
            boundary_message_id: self
                .boundary()
                .map(|b| self.messages()[b.start].info.id.clone()),
        }
    }

    /// Renders message `i` as the context sends it under `keep`.
    fn render_entry(
        &self,
        i: usize,
        keep: Keep,
        rev: u64,
        scratch: &mut Vec<u8>,
        render: &mut impl FnMut(&[ChatMessage<'_>], &mut Vec<u8>),
    ) -> Entry {
        let Some((msg, parts)) = self.sent(std::iter::once((i, keep)), Copying::Sent).next() else {
            return Entry {
                rev,
                keep,
                used: 0,
                tokens: 0,
                sent: false,
                chunk: Arc::from(&[][..]),
            };
        };
        let tokens = parts.iter().fold(0u64, |t, (stored, _)| {
            t.saturating_add(stored.context_tokens())
        });
        let mut chat = Vec::new();
        chat_messages(
            msg.info.role,
            parts.iter().map(|(_, p)| p.read()),
            &mut chat,
        );
        scratch.clear();
        if !chat.is_empty() {
            render(&chat, scratch);
        }
        Entry {
            rev,
            keep,
            used: 0,
            tokens,
            sent: true,
            chunk: Arc::from(&scratch[..]),
        }
    }

    /// [`Self::context_openai`] from `cache` (see [`Self::context_openai_chunks`]): the
    /// same JSON text, rendering only the messages that changed since the cache last saw
    /// them.
    pub fn context_openai_cached(&self, cache: &mut ContextCache) -> OpenAiContext {
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
        let len = c.json.iter().map(|x| x.len() + 1).sum::<usize>() + 2;
        let mut text = Vec::with_capacity(len);
        text.push(b'[');
        for (k, chunk) in c.json.iter().enumerate() {
            if k > 0 {
                text.push(b',');
            }
            text.extend_from_slice(chunk);
        }
        text.push(b']');
        OpenAiContext {
            json: String::from_utf8(text).unwrap_or_else(|_| "[]".to_string()),
            tokens: c.tokens,
            context_messages: c.context_messages,
            boundary_message_id: c.boundary_message_id,
        }
    }
}
