//! A session using every strategy at once.

use super::*;

#[test]
fn every_strategy_applies_once_in_a_rich_session() {
    let mut s = import(&rich_messages(), SessionOverrides::default());
    let run = commit(&mut s, NOW);
    assert_eq!(marks(&s), rich_marks());
    // Every strategy that marks, plus the input-leak fix, reports a saving.
    assert_eq!(
        saved_by(&run.report),
        [
            St::PruneToolInputs,
            St::PruneSourceUrls,
            St::StateQuerySupersede,
            St::PruneSnapshots,
            St::PruneRetryParts,
            St::PruneFiles,
            St::PruneUserCodeBlocks,
            St::TruncateOldErrors,
            St::AggressiveFilePrune,
            St::SupersedeDuplicates,
            St::SupersedeTodos,
            St::SupersedeSearches,
        ]
    );
    // Protected `task` calls are identical but never superseded.
    assert!(!marks(&s).contains_key("k1"));
    // The context keeps every message and every call: only contents are shorter.
    assert_eq!(ids(&run.before), ids(&run.after));
    assert!(run.after.tokens < run.before.tokens);
}
