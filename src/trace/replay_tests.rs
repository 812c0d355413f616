//! Replay's own helpers on handmade values.

use super::*;
use crate::domain::{MessageInfo, TokenUsage};
use crate::engine::used_tokens;

/// `usage` as a message's report, lowered by `saved` under `rule`.
fn lowered(usage: TokenUsage, saved: u64, rule: CacheCounting) -> TokenUsage {
    let mut info = MessageInfo::new("a1", Role::Assistant);
    info.tokens = Some(usage);
    match usage_less(Update::UpsertMessage(info), saved, rule) {
        Update::UpsertMessage(m) => m.tokens.unwrap_or_default(),
        other => panic!("not a message: {other:?}"),
    }
}

/// What the compactd lane saved lowers the report under either counting rule. Before,
/// the saving came off the cache reads first, which `Included` does not count (its input
/// already holds them): with no provider total, the prompt stayed as recorded.
#[test]
fn a_saving_lowers_the_prompt_under_either_counting_rule() {
    let usage = TokenUsage {
        input: 100_000,
        cache_read: 90_000,
        output: 1_000,
        ..TokenUsage::default()
    };
    let included = lowered(usage, 30_000, CacheCounting::Included);
    assert_eq!(used_tokens(&included, CacheCounting::Included).0, 71_000);
    assert!(included.cache_read <= included.input, "{included:?}");
    let separate = lowered(usage, 30_000, CacheCounting::Separate);
    assert_eq!(used_tokens(&separate, CacheCounting::Separate).0, 161_000);
    // More than the prompt leaves none of it.
    let all = lowered(usage, 500_000, CacheCounting::Included);
    assert_eq!((all.input, all.cache_read), (0, 0));
    // Reads above the input were counted apart (Anthropic's counts under `Included`): the
    // saving comes off them, as under `Separate`, and the prompt reads lower by it.
    let apart = TokenUsage {
        input: 50,
        cache_read: 180_000,
        ..usage
    };
    let lowered_apart = lowered(apart, 30_000, CacheCounting::Included);
    assert_eq!(
        (lowered_apart.input, lowered_apart.cache_read),
        (50, 150_000)
    );
    assert_eq!(
        used_tokens(&lowered_apart, CacheCounting::Included).0,
        151_050
    );
}
