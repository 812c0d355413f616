//! Property-based fuzzing of every decoder a client reaches through the server: protobuf
//! bytes to domain values (see issue 13). Targets are added here.
