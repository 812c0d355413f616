//! Applying [`super::Update::Pin`]: the message and part are checked first, then the pin
//! is set or cleared (`Session::set_pin` moves the bytes and the indexes). A new pin
//! restores the parts it covers that prune or a strategy already reduced, through
//! [`Session::rerender`], so they read verbatim; an unpin lets the next run decide about
//! them again.

use super::error::ApplyError;
use super::session::{Rendering, Session};
use super::update::Applied;
use crate::domain::PartKind;

impl Session {
    /// Applies [`super::Update::Pin`] (validated first); a new pin restores what it covers.
    /// Pinning what is pinned, or unpinning what is not, changes nothing.
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
        if self.set_pin(msg, part_id, pinned)? && pinned {
            self.restore(msg, part_id);
        }
        Ok(Applied::default())
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
