# compactd container image: a release build on Debian 12, run from distroless (glibc,
# libgcc_s and CA certificates, no shell, no package manager) as a non-root user.
#
#   docker build -t compactd:0.1.0 .
#   docker run --rm -p 50051:50051 compactd:0.1.0
#
# No protoc is needed: build.rs compiles proto/ in pure Rust (protox).

# ---- builder ---------------------------------------------------------------------------
FROM rust:1-bookworm AS builder
WORKDIR /build

# 1. Dependencies only, cached until Cargo.toml or Cargo.lock changes. The stubs stand in
#    for every target the manifest names (Cargo refuses a manifest whose bench or test
#    file is missing); build.rs is stubbed too, which still builds the build-dependencies.
#    This layer is only a cache: if a target is added to Cargo.toml without a stub here,
#    it warns and the full build below still does all the work.
COPY Cargo.toml Cargo.lock ./
RUN mkdir -p src benches tests \
 && echo 'fn main() {}' > build.rs \
 && echo 'fn main() {}' > src/main.rs \
 && touch src/lib.rs benches/engine.rs tests/all.rs \
 && { cargo build --release --locked \
      || echo "WARNING: dependency pre-build failed (a Cargo.toml target without a stub?)" >&2; } \
 && rm -rf build.rs src benches tests

# 2. The crate itself. COPY keeps the files' own modification times, which can be older
#    than the stub build above: touch the entry points so Cargo rebuilds them for certain.
COPY . .
RUN touch build.rs src/main.rs src/lib.rs \
 && cargo build --release --locked \
 && ./target/release/compactd --version | grep -q '^compactd '

# ---- runtime ---------------------------------------------------------------------------
FROM gcr.io/distroless/cc-debian12:nonroot
COPY --from=builder /build/target/release/compactd /compactd

# distroless's "nonroot" user, given by number so that Kubernetes' runAsNonRoot can verify
# it (a user name in the image makes the kubelet refuse to start the container).
USER 65532:65532

# gRPC: compactd.v1.Sessions, grpc.health.v1.Health and reflection, all on one port.
EXPOSE 50051
# Prometheus GET /metrics, served with --metrics-listen 0.0.0.0:9464 (plain HTTP, no auth).
EXPOSE 9464

ENTRYPOINT ["/compactd"]
# Inside a container the default 127.0.0.1 would be unreachable from outside it (and from
# kubelet probes): listen on all interfaces. Any other setting: COMPACTD_* env or flags.
CMD ["serve", "--listen", "0.0.0.0:50051"]
