//! The metrics recorder keeps every histogram sample (one per update) until it folds
//! them into their buckets. A scrape folds them; so must the metrics endpoint's upkeep,
//! or a server whose metrics no one scrapes grows without end, outside the memory
//! budget.
//!
//! Its own test binary because it installs a counting global allocator (the bytes the
//! samples hold are read from it) and the process-wide metrics recorder.

use std::time::Duration;

use counting_alloc::allocated;

#[path = "support/counting_alloc.rs"]
mod counting_alloc;

/// Samples recorded per round: at about 8 bytes each, megabytes the recorder would hold
/// unfolded after a few rounds.
const SAMPLES: usize = 200_000;
/// Rounds of recording, each followed by a few upkeep periods.
const ROUNDS: usize = 6;
/// The upkeep period the test serves with (the server's is `UPKEEP_EVERY`, 5 s).
const EVERY: Duration = Duration::from_millis(100);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn histogram_samples_are_folded_without_a_scrape() {
    let handle = compactd::telemetry::install().expect("the recorder");
    let record = || {
        for _ in 0..SAMPLES {
            let _ = compactd::telemetry::update("upsert_part", || Ok::<(), ()>(()));
        }
    };
    // Every kind registers its handle once; later samples are what the recorder keeps.
    let _ = compactd::telemetry::update("upsert_part", || Ok::<(), ()>(()));
    let start = allocated();
    record();
    let first = allocated().saturating_sub(start);
    assert!(
        first >= SAMPLES * 4,
        "the samples hold {first} bytes: too few to tell an upkeep from none"
    );
    // The endpoint and its upkeep start only now: the first round, measured above, is
    // what samples hold unfolded however slowly the machine recorded them (an upkeep
    // that ran during the round made it look smaller).
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("a port");
    let stop = tokio_util::sync::CancellationToken::new();
    let served = tokio::spawn(compactd::telemetry::serve(
        listener,
        handle,
        || {},
        stop.clone().cancelled_owned(),
        compactd::telemetry::EndpointLimits {
            upkeep_every: EVERY,
            ..Default::default()
        },
    ));
    // No one scrapes. Folded, the samples' memory is given back (when the epoch GC of
    // the recorder's buckets gets to it) and what is held stays about one round's;
    // unfolded, every round adds as much again.
    for _ in 1..ROUNDS {
        tokio::time::sleep(EVERY * 3).await;
        record();
    }
    tokio::time::sleep(EVERY * 3).await;
    let held = allocated().saturating_sub(start);
    assert!(
        held < first * 3,
        "{ROUNDS} rounds of {SAMPLES} samples: the first took {first} bytes, all hold {held}"
    );
    stop.cancel();
    served.await.expect("no panic").expect("served");
}
