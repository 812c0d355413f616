//! Engine unit and property tests (written against the seeds, beside the pure code).
