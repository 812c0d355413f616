//! The README's grpcurl walk-through, run against the real binary. (Being written.)
