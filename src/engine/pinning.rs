//! Applying [`super::Update::Pin`]: the message and part are checked first, then the pin
//! is set or cleared (`Session::set_pin` moves the bytes and the indexes). A new pin
//! restores the parts it covers that prune or a strategy already reduced, through
//! [`Session::rerender`], so they read verbatim; an unpin lets the next run decide about
//! them again.

use super::anchors::{carries, split_carried};
use super::error::ApplyError;
use super::session::{Rendering, Session};
use super::update::Applied;
use crate::domain::PartKind;

impl Session {
    /// Applies [`super::Update::Pin`] (validated first); a new pin restores what it covers.
    /// Pinning what is pinned, or unpinning what is not, changes nothing; unpinning a
    /// part its message's pin covers is refused (it would stay pinned).
    pub(super) fn pin(
        &mut self,
        message_id: &str,
        part_id: Option<&str>,
        pinned: bool,
    ) -> Result<Applied, ApplyError> {
        let Some(msg) = self.position(message_id) else {
            return Err(ApplyError::not_found(
                "message_id",
                format!("message {message_id} does not exist"),
            ));
        };
        if let Some(id) = part_id
            && !self.messages()[msg].parts.iter().any(|p| p.part.id == id)
        {
            return Err(ApplyError::not_found(
                "part_id",
                format!("part {id} does not exist in message {message_id}"),
            ));
        }
        // A part with no pin of its own that its message's pin covers stays pinned: an
        // unpin of it would be acknowledged and change nothing. Not on replay: the log
        // holds what was admitted once (as an older build's summary may hold what this
        // one's would not).
        if !pinned
            && !self.replaying
            && let Some(id) = part_id
            && self.pins().holds(msg, None)
            && !self.pins().holds(msg, Some(id))
        {
            return Err(ApplyError::precondition(
                "part_id",
                format!(
                    "part {id} is pinned through its message {message_id}: unpin the \
                     message (no part_id), then pin the parts to keep"
                ),
            ));
        }
        if !pinned
            && !self.replaying
            && let Some(lost) = self.unpin_would_drop(msg, part_id)
        {
            return Err(ApplyError::precondition(
                "pinned",
                format!(
                    "part {lost} of message {message_id} holds protected tool output that only \
                     this pin keeps in the context (the summary after it left it to the \
                     pin): unpinning it would drop it"
                ),
            ));
        }
        if self.set_pin(msg, part_id, pinned)? && pinned {
            self.restore(msg, part_id);
        }
        Ok(Applied::default())
    }

    /// The id of a part that removing this pin would drop from the context for good: a
    /// protected tool output of a summarized message, or the text of an earlier summary
    /// holding protected outputs, carried by the pin alone (a later summary leaves what a
    /// pin carries to the pin, `anchors.rs`) and covered by no other pin.
    fn unpin_would_drop(&self, msg: usize, part_id: Option<&str>) -> Option<String> {
        let b = self.boundary()?;
        if self.in_context(msg) || !self.messages()[msg].is_sent() {
            return None;
        }
        let summary = self.text_of(b.summary);
        let (_, carried) = split_carried(&summary);
        // Still covered once this pin goes: the message's pin, or the part's own.
        let keeps = |id: &str| match part_id {
            Some(_) => self.pins().holds(msg, None),
            None => self.pins().holds(msg, Some(id)),
        };
        let goes = |id: &str| part_id.is_none_or(|want| want == id) && !keeps(id);
        // An earlier summary a pin keeps whole: the later one left its outputs to it.
        let earlier = self.text_of(msg);
        let (_, earlier_carried) = split_carried(&earlier);
        if !earlier_carried.is_empty() && !carried.contains(earlier_carried) {
            let text = self.messages()[msg].parts.iter().find(|p| {
                matches!(&p.part.kind, PartKind::Text(t) if !t.ignored)
                    && self.pins().holds(msg, part_id)
                    && goes(&p.part.id)
            });
            if let Some(p) = text {
                return Some(p.part.id.clone());
            }
        }
        self.messages()[msg].parts.iter().find_map(|p| {
            let PartKind::Tool(t) = &p.part.kind else {
                return None;
            };
            let id = p.part.id.as_str();
            let lost = self.pins().holds(msg, part_id)
                && goes(id)
                && self.settings().is_protected_tool(&t.tool)
                && !t.state.output.is_empty()
                && !carries(carried, &t.tool, &t.state.output);
            lost.then(|| id.to_string())
        })
    }

    /// Removes every mark and prune stamp from the parts of message `msg` (only the part
    /// `part_id` when given), so they read verbatim.
    fn restore(&mut self, msg: usize, part_id: Option<&str>) {
        for pi in 0..self.messages()[msg].parts.len() {
            let part = &self.messages()[msg].parts[pi].part;
            if part_id.is_some_and(|id| id != part.id) {
                continue;
            }
            let stamped =
                matches!(&part.kind, PartKind::Tool(t) if t.state.time.compacted.is_some());
            if part.mark.is_some() {
                self.rerender(msg, pi, Rendering::Mark(None), false);
            }
            if stamped {
                self.rerender(msg, pi, Rendering::Restored, false);
            }
        }
    }
}
