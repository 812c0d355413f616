//! What a sequence of requests costs under a provider's prompt cache: each request pays
//! the cache-read price for the longest prefix (at part granularity) it shares with the
//! previous request, and the write price (full price plus any write premium) for the rest;
//! nothing is cached when the gap since the previous request exceeds the TTL.
//!
//! Prices are in fresh-token units (one uncached, unwritten input token costs 1), so the
//! `none` model's cost equals the tokens sent.

use crate::config::CacheModel;

/// One element of a prompt: an identity (equal identity means equal rendered content)
/// and its tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// Identity of the rendered piece (a hash of the part and how it renders).
    pub key: u64,
    /// Its tokens.
    pub tokens: u64,
}

/// What one request cost.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RequestCost {
    /// Tokens sent.
    pub tokens: u64,
    /// Tokens read from the cache.
    pub cached: u64,
    /// Cost in fresh-token units.
    pub cost: f64,
    /// The cached prefix is shorter than the previous prompt (a change or an expiry made
    /// the provider re-write what it had cached); never under a flat model.
    pub broke: bool,
}

/// The cache as the provider holds it between requests of one conversation.
#[derive(Debug, Clone)]
pub struct CacheMeter {
    model: CacheModel,
    previous: Vec<Piece>,
    previous_tokens: u64,
    last_at: Option<i64>,
}

impl CacheMeter {
    /// An empty (cold) cache under `model`.
    pub fn new(model: CacheModel) -> CacheMeter {
        CacheMeter {
            model,
            previous: Vec::new(),
            previous_tokens: 0,
            last_at: None,
        }
    }

    /// Charges a request sent at `at_ms` with `prompt`, and remembers it as the cache.
    pub fn charge(&mut self, prompt: Vec<Piece>, at_ms: i64) -> RequestCost {
        let tokens = prompt.iter().fold(0u64, |t, p| t.saturating_add(p.tokens));
        let warm = self
            .last_at
            .is_some_and(|last| at_ms.saturating_sub(last) <= self.model.ttl_ms);
        let cached = if warm {
            common_prefix_tokens(&self.previous, &prompt)
        } else {
            0
        };
        let fresh = tokens.saturating_sub(cached);
        let cost = cached as f64 * self.model.read + fresh as f64 * self.model.write;
        // A flat model (`none`) holds no cache worth keeping: nothing to break.
        let broke =
            !self.model.is_flat() && self.last_at.is_some() && cached < self.previous_tokens;
        self.previous = prompt;
        self.previous_tokens = tokens;
        self.last_at = Some(at_ms);
        RequestCost {
            tokens,
            cached,
            cost,
            broke,
        }
    }
}

/// Tokens of the longest common prefix of two prompts, piece by piece.
pub fn common_prefix_tokens(a: &[Piece], b: &[Piece]) -> u64 {
    a.iter()
        .zip(b)
        .take_while(|(x, y)| x == y)
        .fold(0u64, |t, (x, _)| t.saturating_add(x.tokens))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(key: u64, tokens: u64) -> Piece {
        Piece { key, tokens }
    }

    const ANTHROPIC: CacheModel = CacheModel::ANTHROPIC;

    #[test]
    fn the_first_request_writes_everything() {
        let mut m = CacheMeter::new(ANTHROPIC);
        let c = m.charge(vec![p(1, 1000), p(2, 200)], 0);
        assert_eq!((c.tokens, c.cached), (1200, 0));
        assert!((c.cost - 1500.0).abs() < 1e-9, "1200 × 1.25 = {}", c.cost);
        assert!(!c.broke, "nothing was cached before");
    }

    #[test]
    fn a_grown_prompt_reads_its_prefix_and_writes_the_rest() {
        let mut m = CacheMeter::new(ANTHROPIC);
        m.charge(vec![p(1, 1000), p(2, 200)], 0);
        let c = m.charge(vec![p(1, 1000), p(2, 200), p(3, 300)], 60_000);
        assert_eq!(c.cached, 1200);
        // 1200 × 0.1 + 300 × 1.25 = 120 + 375
        assert!((c.cost - 495.0).abs() < 1e-9, "{}", c.cost);
        assert!(!c.broke);
    }

    #[test]
    fn a_change_in_the_middle_rewrites_everything_after_it() {
        let mut m = CacheMeter::new(ANTHROPIC);
        m.charge(vec![p(1, 1000), p(2, 200), p(3, 300)], 0);
        // Part 2 now renders as a placeholder (new key, fewer tokens).
        let c = m.charge(vec![p(1, 1000), p(9, 10), p(3, 300), p(4, 50)], 1_000);
        assert_eq!(c.cached, 1000);
        // 1000 × 0.1 + 360 × 1.25 = 100 + 450
        assert!((c.cost - 550.0).abs() < 1e-9, "{}", c.cost);
        assert!(c.broke, "cached 1000 < previous 1500");
    }

    #[test]
    fn past_the_ttl_nothing_is_cached() {
        let mut m = CacheMeter::new(ANTHROPIC);
        m.charge(vec![p(1, 1000)], 0);
        let at_ttl = m.charge(vec![p(1, 1000)], 300_000);
        assert_eq!(at_ttl.cached, 1000, "exactly the TTL is still warm");
        let c = m.charge(vec![p(1, 1000)], 600_001);
        assert_eq!(c.cached, 0);
        assert!((c.cost - 1250.0).abs() < 1e-9);
        assert!(c.broke, "an expiry re-writes the prefix too");
    }

    #[test]
    fn openai_has_no_write_premium_and_none_costs_the_tokens() {
        let mut o = CacheMeter::new(CacheModel::OPENAI);
        o.charge(vec![p(1, 1000)], 0);
        let c = o.charge(vec![p(1, 1000), p(2, 100)], 1);
        assert!((c.cost - 200.0).abs() < 1e-9, "1000 × 0.1 + 100 × 1.0");
        let mut n = CacheMeter::new(CacheModel::NONE);
        n.charge(vec![p(1, 1000)], 0);
        let c = n.charge(vec![p(1, 1000), p(2, 100)], 1);
        assert!((c.cost - 1100.0).abs() < 1e-9);
    }

    /// A flat model caches nothing worth keeping, so no request breaks it. Before, the
    /// `none` model's zero TTL made every request after the first a break.
    #[test]
    fn no_request_breaks_a_flat_model() {
        let mut n = CacheMeter::new(CacheModel::NONE);
        n.charge(vec![p(1, 1000)], 0);
        let c = n.charge(vec![p(1, 1000)], 60_000);
        assert!(!c.broke, "{c:?}");
    }

    #[test]
    fn a_fixed_prefix_is_read_from_the_cache_in_every_request() {
        // The system prompt and tool definitions (key 0) lead every prompt.
        let mut m = CacheMeter::new(ANTHROPIC);
        let first = m.charge(vec![p(0, 5000), p(1, 100)], 0);
        assert!((first.cost - 5100.0 * 1.25).abs() < 1e-9);
        let c = m.charge(vec![p(0, 5000), p(7, 40)], 10);
        assert_eq!(c.cached, 5000, "only the fixed prefix survives the change");
        assert!((c.cost - (500.0 + 50.0)).abs() < 1e-9);
    }

    #[test]
    fn custom_prices_apply() {
        let model = CacheModel {
            read: 0.5,
            write: 2.0,
            ttl_ms: 10,
        };
        let mut m = CacheMeter::new(model);
        m.charge(vec![p(1, 10)], 0);
        let c = m.charge(vec![p(1, 10), p(2, 10)], 10);
        assert!((c.cost - 25.0).abs() < 1e-9, "10 × 0.5 + 10 × 2");
    }
}
