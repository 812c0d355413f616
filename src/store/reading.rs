//! Reads of cold sessions in flight, so a read that the id's deletion or re-creation
//! overtook is not installed.
//!
//! A load reads a cold session from disk, then admits it under the map lock. Meanwhile
//! the id may be deleted and created again (a new incarnation) and even sent cold: the
//! id is in `cold` again, yet the copy read is the deleted incarnation. Installed, it
//! would be served, and its writes (filtered by incarnation) would land on no row, though
//! acknowledged. `Store::place` and `Store::remove` mark the id's read stale; the load
//! then reads again (or answers with what the id now names).

use super::Shared;

/// A read of `id` registered in the map; unregistered when dropped (also when the load's
/// caller gave up mid-read). Loads of one id are serialized (`Store::load`'s per-id lock),
/// so one entry per id suffices.
pub(super) struct Reading<'a> {
    shared: &'a Shared,
    id: &'a str,
}

impl<'a> Reading<'a> {
    /// Registers a read of `id` beginning now (not stale). Call without the map lock.
    pub(super) fn start(shared: &'a Shared, id: &'a str) -> Reading<'a> {
        shared.write().reading.insert(id.to_string(), false);
        Reading { shared, id }
    }
}

impl Drop for Reading<'_> {
    fn drop(&mut self) {
        // Never dropped under the map lock: the load admits, releases it, then returns.
        self.shared.write().reading.remove(self.id);
    }
}
