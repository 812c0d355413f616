//! A stream's updates built before an ingest case's clock starts, so that the load
//! generator's own work (formatting ids and prefixes, lengthening outputs, cloning tool
//! inputs: about 2 µs of the client's CPU per update on the bench machine) is not spent on
//! the cores the server under test shares with it. The raw BPE reference
//! (`stats::raw_bpe`) always built its updates before timing; the echo and compactd cases
//! now do the same. Past a byte budget the rest are built on demand, as before.

use super::workload::Updates;
use crate::server::pb;
use crate::server::pb::client_update::Update;

/// Encoded bytes of updates built ahead, all streams of a case together: enough for the
/// default case at the largest default part size (20,000 updates of 20 KB outputs are
/// about 150 MB), bounded so a larger `--updates` cannot take the machine's memory.
pub const BUDGET: usize = 256 << 20;

/// Updates handed out in order: first those built ahead, then the rest of the sequence.
#[derive(Debug)]
pub struct Prepared {
    ready: std::vec::IntoIter<pb::ClientUpdate>,
    rest: Updates,
    /// Sessions whose opening update was handed out (only those exist on the server).
    opened: Vec<String>,
}

impl Prepared {
    /// Builds up to `count` updates of `updates`, stopping early once their encoded size
    /// passes `budget` bytes.
    pub fn new(mut updates: Updates, count: usize, budget: usize) -> Prepared {
        let mut ready = Vec::with_capacity(count.min(budget / 64));
        let mut bytes = 0usize;
        while ready.len() < count && bytes < budget {
            let Some(u) = updates.next() else { break };
            bytes = bytes.saturating_add(prost::Message::encoded_len(&u));
            ready.push(u);
        }
        Prepared {
            ready: ready.into_iter(),
            rest: updates,
            opened: Vec::new(),
        }
    }

    /// Updates built ahead and not handed out yet (what the tests check the budget by).
    #[cfg(test)]
    fn ready(&self) -> usize {
        self.ready.len()
    }

    /// Ids of the sessions opened by the updates handed out so far (to delete after the
    /// case; a session built ahead but never sent does not exist).
    pub fn sessions(&self) -> &[String] {
        &self.opened
    }
}

impl Iterator for Prepared {
    type Item = pb::ClientUpdate;

    fn next(&mut self) -> Option<pb::ClientUpdate> {
        let u = self.ready.next().or_else(|| self.rest.next())?;
        if let Some(Update::Open(info)) = &u.update {
            self.opened.push(info.id.clone());
        }
        Some(u)
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::sync::Arc;

    use super::*;
    use crate::cli::bench::workload::{self, Plan, Pool, Sizing};

    fn updates() -> Updates {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/traces");
        let pool = Arc::new(Pool::load(&dir).expect("the traces load"));
        pool.updates(Plan {
            prefix: "t".into(),
            sizing: Sizing::Exact(4096),
            tokenizer: String::new(),
            keep_everything: false,
            first_trace: 0,
        })
    }

    /// What identifies an update apart from its timestamps (taken when it is built).
    fn key(u: &pb::ClientUpdate) -> (u64, String, &'static str, Vec<String>) {
        let texts = workload::counted_texts(u).map(String::from).collect();
        (u.seq, u.session_id.clone(), workload::kind(u), texts)
    }

    #[test]
    fn hands_out_the_same_sequence_as_building_on_demand() {
        let lazy: Vec<_> = updates().take(3000).map(|u| key(&u)).collect();
        // Built ahead in full, and cut short by the budget (the rest on demand).
        for budget in [usize::MAX, 100_000] {
            let mut p = Prepared::new(updates(), 2000, budget);
            assert!(p.ready() <= 2000);
            if budget < usize::MAX {
                assert!(p.ready() < 100, "{}", p.ready());
            }
            let got: Vec<_> = p.by_ref().take(3000).map(|u| key(&u)).collect();
            assert_eq!(got, lazy);
        }
    }

    #[test]
    fn names_only_the_sessions_whose_opening_was_handed_out() {
        let mut p = Prepared::new(updates(), 5000, usize::MAX);
        assert!(p.sessions().is_empty(), "nothing handed out yet");
        let first = p.next().expect("an update");
        assert!(matches!(first.update, Some(Update::Open(_))));
        assert_eq!(p.sessions(), ["t-0"]);
        // Enough updates for a second session: it is named once its opening is handed out.
        let mut opens = 1;
        for _ in 0..4000 {
            let u = p.next().expect("an update");
            if let Some(Update::Open(info)) = &u.update {
                opens += 1;
                assert_eq!(p.sessions().last(), Some(&info.id));
            }
        }
        assert!(opens > 1, "the sessions rotate");
        assert_eq!(p.sessions().len(), opens);
    }
}
