//! The replay's lanes and what each request of a lane sent: the prompt as a sequence of
//! rendered parts (for the prompt-cache cost model) and the references it had hidden
//! (the fidelity proxy). Figures are derived after the replay, under any cache model.

use std::collections::HashSet;
use std::hash::{DefaultHasher, Hash, Hasher};

use serde_json::{Value, json};

use super::cost::{CacheMeter, Piece, RequestCost};
use super::references::{ReferenceIndex, part_text};
use crate::config::{CacheModel, EngineConfig, Strategy, StrategySet};
use crate::engine::ContextView;

/// The lanes every replay runs, in report order.
pub const LANES: [&str; 4] = ["none", "opencode", "masking-10", "compactd"];

/// Settings of a reference lane derived from the replayed config: `none` (no management
/// at all), `opencode` (OpenCode's prune alone, applied at once), `masking-10` (outputs
/// older than the newest 10 tool results masked every request, nothing else), or the
/// config itself (`compactd`).
pub fn lane_config(lane: &str, config: &EngineConfig) -> EngineConfig {
    match lane {
        "none" => EngineConfig {
            prune: false,
            auto_compact: false,
            strategies: StrategySet::NONE,
            ..config.clone()
        },
        "opencode" => EngineConfig {
            strategies: StrategySet::NONE,
            auto_compact: false,
            cache_model: CacheModel::NONE,
            ..config.clone()
        },
        "masking-10" => EngineConfig {
            strategies: StrategySet::NONE.with(Strategy::MaskObservations, true),
            mask_keep: 10,
            auto_compact: false,
            cache_model: CacheModel::NONE,
            // The commit runs after every finished message, but prune never clears.
            prune_minimum: u64::MAX,
            ..config.clone()
        },
        _ => config.clone(),
    }
}

/// What one lane sent over a replay.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LaneRecord {
    /// Lane name.
    pub name: String,
    /// Per request: the prompt, part by part (the fixed prefix not included), as a change
    /// of the request before: its first `.0` pieces, then `.1` (the cache model compares
    /// a prompt with the previous one only, so this is all a replay needs to keep).
    pub prompts: Vec<(usize, Vec<Piece>)>,
    /// The last request's prompt whole, what the next one is kept as a change of.
    last: Vec<Piece>,
    /// Per request: when it was sent (the host's timestamp, ms).
    pub times: Vec<i64>,
    /// Per request: references the lane's prompt did not hold.
    pub dangling: Vec<usize>,
    /// Compactions that completed in this lane.
    pub compactions: usize,
}

/// A lane's figures under one cache model; the names are a contract (`replay --json`).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LaneFigures {
    /// Prompt tokens summed over every request, fixed prefix included.
    pub prompt_tokens: u64,
    /// Cost in fresh-token units.
    pub cost: f64,
    /// Requests whose cached prefix is shorter than the previous prompt.
    pub cache_breaks: u64,
    /// References the agent made (the same in every lane).
    pub references: u64,
    /// References the lane's prompt did not hold.
    pub dangling_references: u64,
    /// Completed compactions.
    pub compactions: u64,
}

impl LaneFigures {
    /// Adds another trace's figures.
    pub fn add(&mut self, o: &LaneFigures) {
        self.prompt_tokens = self.prompt_tokens.saturating_add(o.prompt_tokens);
        self.cost += o.cost;
        self.cache_breaks += o.cache_breaks;
        self.references += o.references;
        self.dangling_references += o.dangling_references;
        self.compactions += o.compactions;
    }

    /// The JSON object of the `replay --json` contract.
    pub fn to_json(&self) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "cost": (self.cost * 10.0).round() / 10.0,
            "cache_breaks": self.cache_breaks,
            "references": self.references,
            "dangling_references": self.dangling_references,
            "compactions": self.compactions,
        })
    }

    /// Dangling references per reference (0 when there are none).
    pub fn dangling_rate(&self) -> f64 {
        if self.references == 0 {
            0.0
        } else {
            self.dangling_references as f64 / self.references as f64
        }
    }
}

impl LaneRecord {
    /// A lane with nothing sent yet.
    pub fn new(name: &str) -> LaneRecord {
        LaneRecord {
            name: name.to_string(),
            ..LaneRecord::default()
        }
    }

    /// Records one request: the prompt `view`, sent at `at_ms` by the assistant message at
    /// position `msg` of the export, whose references `refs` checks.
    pub fn request(
        &mut self,
        view: &ContextView,
        at_ms: i64,
        msg: usize,
        refs: &ReferenceIndex,
        originals: &HashSet<String>,
    ) {
        let mut pieces = Vec::new();
        let mut verbatim: HashSet<&str> = HashSet::new();
        let mut rendered = String::new();
        for m in &view.messages {
            for p in &m.parts {
                let mut h = DefaultHasher::new();
                p.part.id.hash(&mut h);
                p.part.message_id.hash(&mut h);
                p.context_tokens().hash(&mut h);
                p.reduced.hash(&mut h);
                p.part.mark.as_ref().map(|m| m.strategy).hash(&mut h);
                p.is_compacted().hash(&mut h);
                pieces.push(Piece {
                    key: h.finish(),
                    tokens: p.context_tokens(),
                });
                if p.reduced.is_none() && originals.contains(&p.part.id) {
                    verbatim.insert(p.part.id.as_str());
                } else if !refs.of_request(msg).is_empty() {
                    rendered.push_str(&part_text(&p.part));
                    rendered.push('\n');
                }
            }
        }
        let dangling = refs.dangling(msg, &|id| verbatim.contains(id), &rendered);
        let shared = self
            .last
            .iter()
            .zip(&pieces)
            .take_while(|(a, b)| a == b)
            .count();
        self.prompts.push((shared, pieces[shared..].to_vec()));
        self.last = pieces;
        self.times.push(at_ms);
        self.dangling.push(dangling);
    }

    /// Tokens of the last request's prompt (the fixed prefix not included).
    pub fn last_prompt_tokens(&self) -> u64 {
        self.last
            .iter()
            .fold(0u64, |a, x| a.saturating_add(x.tokens))
    }

    /// Every request charged under `model`, in order, with `prefix` tokens of fixed
    /// prompt (system prompt, tool definitions) leading each.
    fn charged(&self, model: CacheModel, prefix: u64) -> impl Iterator<Item = RequestCost> + '_ {
        let mut meter = CacheMeter::new(model);
        // The fixed prefix, then the prompt rebuilt request by request from its changes.
        let mut pieces = vec![Piece {
            key: 0,
            tokens: prefix,
        }];
        self.prompts
            .iter()
            .enumerate()
            .map(move |(i, (shared, rest))| {
                pieces.truncate(shared.saturating_add(1));
                pieces.extend_from_slice(rest);
                meter.charge(pieces.clone(), self.times.get(i).copied().unwrap_or(0))
            })
    }

    /// The lane's figures under `model` with `prefix` tokens of fixed prompt; `references`
    /// per request.
    pub fn figures(&self, model: CacheModel, prefix: u64, references: &[usize]) -> LaneFigures {
        let mut f = LaneFigures {
            compactions: self.compactions as u64,
            ..LaneFigures::default()
        };
        for (i, c) in self.charged(model, prefix).enumerate() {
            f.prompt_tokens = f.prompt_tokens.saturating_add(c.tokens);
            f.cost += c.cost;
            f.cache_breaks += u64::from(c.broke);
            f.references += references.get(i).copied().unwrap_or(0) as u64;
            f.dangling_references += self.dangling.get(i).copied().unwrap_or(0) as u64;
        }
        f
    }

    /// Pieces held for all the requests (what the record's memory grows with).
    pub fn stored_pieces(&self) -> usize {
        self.prompts.iter().map(|(_, rest)| rest.len()).sum()
    }

    /// Per request: its cost under `model` (for the chart).
    pub fn costs(&self, model: CacheModel, prefix: u64) -> Vec<f64> {
        self.charged(model, prefix).map(|c| c.cost).collect()
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use crate::domain::ModelLimits;
    use crate::trace::{from_value, replay::replay};

    /// `turns` user/assistant turns of one text part each.
    fn turns(turns: usize) -> crate::trace::Export {
        let mut messages = Vec::new();
        for n in 0..turns {
            let at = 1_000 * (n as i64 + 1);
            for (role, id) in [("user", format!("u{n}")), ("assistant", format!("a{n}"))] {
                let mut info = json!({"id": id, "sessionID": "ses_t", "role": role,
                    "time": {"created": at, "completed": at + 1}});
                if role == "assistant" {
                    info["finish"] = json!("stop");
                    info["parentID"] = json!(format!("u{n}"));
                }
                let text = json!({"id": format!("{id}_t"), "type": "text", "text": format!("turn {n} of {role}")});
                messages.push(json!({"info": info, "parts": [text]}));
            }
        }
        from_value(
            json!({"info": {"id": "ses_t", "title": "t", "time": {"created": 1}},
            "messages": messages}),
        )
        .expect("a valid export")
    }

    /// A lane keeps of each request only what changed since the one before (the cache
    /// model compares a prompt with the previous one alone): what a replay holds grows
    /// with the session, not with its square. Before, every request's whole prompt was
    /// kept in every lane (a 1.4 MB export took 824 MB).
    #[test]
    fn a_lane_keeps_each_request_as_a_change_of_the_one_before() {
        let report = replay(
            &turns(300),
            ModelLimits::default(),
            &crate::config::EngineConfig::default(),
        );
        for lane in &report.lanes {
            assert!(
                lane.times.len() >= 299,
                "{}: {} requests",
                lane.name,
                lane.times.len()
            );
            assert!(
                lane.stored_pieces() <= 4 * 600,
                "{}: {} pieces kept for 600 parts",
                lane.name,
                lane.stored_pieces()
            );
        }
    }
}
