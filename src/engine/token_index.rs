//! Context tokens per message in a Fenwick tree, so the tokens before any message (where
//! a prompt-cache prefix ends) are known in O(log n) while parts keep changing. The session
//! moves it with every change of a part's context tokens, next to [`super::totals`].

use serde::{Deserialize, Serialize};

/// Context tokens of each message, summable by prefix.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct TokenIndex {
    /// 1-based Fenwick nodes, stored 0-based: node `i` sums messages `(i - lowbit(i), i]`.
    tree: Vec<i64>,
}

fn lowbit(i: usize) -> usize {
    i & i.wrapping_neg()
}

impl TokenIndex {
    /// Appends a message holding no tokens yet. O(log n).
    pub(crate) fn push(&mut self) {
        let i = self.tree.len() + 1;
        let value = self.prefix(i - 1) - self.prefix(i - lowbit(i));
        self.tree.push(value);
    }

    /// Message `msg`'s tokens changed by `delta`. O(log n).
    pub(crate) fn add(&mut self, msg: usize, delta: i64) {
        let mut i = msg + 1;
        while i <= self.tree.len() {
            self.tree[i - 1] = self.tree[i - 1].saturating_add(delta);
            i += lowbit(i);
        }
    }

    /// Moves message `msg` from `old` to `new` tokens.
    pub(crate) fn moved(&mut self, msg: usize, old: u64, new: u64) {
        let delta = i64::try_from(new)
            .unwrap_or(i64::MAX)
            .saturating_sub(i64::try_from(old).unwrap_or(i64::MAX));
        if delta != 0 {
            self.add(msg, delta);
        }
    }

    /// Tokens of the first `n` messages. O(log n).
    pub(crate) fn prefix(&self, n: usize) -> i64 {
        let mut i = n.min(self.tree.len());
        let mut sum = 0i64;
        while i > 0 {
            sum = sum.saturating_add(self.tree[i - 1]);
            i -= lowbit(i);
        }
        sum
    }

    /// Tokens of the messages `from..to`, never negative.
    pub(crate) fn range(&self, from: usize, to: usize) -> u64 {
        u64::try_from(self.prefix(to).saturating_sub(self.prefix(from))).unwrap_or(0)
    }

    /// Entries and allocated slots.
    pub(crate) fn len_capacity(&self) -> (usize, usize) {
        (self.tree.len(), self.tree.capacity())
    }

    /// Bytes the index holds.
    pub(crate) fn capacity_bytes(&self) -> u64 {
        (self.tree.capacity() * std::mem::size_of::<i64>()) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_match_a_plain_sum_under_pushes_and_changes() {
        let mut idx = TokenIndex::default();
        let mut plain: Vec<i64> = Vec::new();
        for step in 0..300usize {
            idx.push();
            plain.push(0);
            let at = (step * 7) % plain.len();
            let delta = (step as i64 * 13) % 50 - 10;
            idx.add(at, delta);
            plain[at] += delta;
            if step % 5 == 0 {
                idx.add(step, 3);
                plain[step] += 3;
            }
            for n in [0, plain.len() / 3, plain.len() / 2, plain.len()] {
                assert_eq!(idx.prefix(n), plain[..n].iter().sum::<i64>(), "n {n}");
            }
        }
        assert_eq!(
            idx.range(10, 20),
            plain[10..20].iter().sum::<i64>().max(0) as u64
        );
    }
}
