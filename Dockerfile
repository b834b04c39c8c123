# syntax=docker/dockerfile:1
#
# pgsluice container image: a Rust build stage and a small Debian runtime stage.
#
#   docker build -t pgsluice .
#   docker run --rm -p 6432:6432 -p 127.0.0.1:9930:9930 -e PGSLUICE_BACKEND_PASSWORD \
#       pgsluice --backend postgres://app@db.example:5432/appdb
#
# The same with the environment only (flags win over it):
#   docker run --rm -p 6432:6432 -p 127.0.0.1:9930:9930 -e PGSLUICE_BACKEND_PASSWORD \
#       -e PGSLUICE_BACKEND_URL=postgres://app@db.example:5432/appdb pgsluice
#
# The image's defaults are environment variables, so flags given to `docker run` add to them
# instead of replacing them: PGSLUICE_CONFIG (config/pgsluice.yaml, copied in; the compose
# stack mounts ./config over /etc/pgsluice), PGSLUICE_LISTEN and PGSLUICE_ADMIN_LISTEN (all
# interfaces of the container). Any `pgsluice` subcommand works as the command too:
# `docker run --rm pgsluice check-config /etc/pgsluice/pgsluice.yaml`. Needs BuildKit (the default builder of current Docker) for the
# cache mounts, which keep the crates.io downloads and the target directory between builds.

ARG RUST_IMAGE=rust:1.95-slim-bookworm
ARG RUNTIME_IMAGE=debian:bookworm-slim

FROM ${RUST_IMAGE} AS build
WORKDIR /src
# Only what the build reads: the manifest and lock file, the sources, the bench targets the
# manifest declares, and docs/ (the admin API embeds docs/openapi.json at compile time).
COPY Cargo.toml Cargo.lock ./
COPY src ./src
COPY benches ./benches
COPY docs ./docs
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked --bin pgsluice \
    && install -D -m 0755 target/release/pgsluice /out/pgsluice

FROM ${RUNTIME_IMAGE} AS runtime
# ca-certificates: for TLS to the backend. Nothing else is needed at run time.
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 pgsluice \
    && useradd --system --uid 10001 --gid pgsluice --home-dir /var/lib/pgsluice \
        --no-create-home --shell /usr/sbin/nologin pgsluice \
    && install -d -o pgsluice -g pgsluice -m 0750 /var/lib/pgsluice
COPY --from=build /out/pgsluice /usr/local/bin/pgsluice
COPY config/pgsluice.yaml /etc/pgsluice/pgsluice.yaml

# Runtime rules (admin.rules_file, relative) are written here; mount a volume to keep them.
WORKDIR /var/lib/pgsluice
VOLUME ["/var/lib/pgsluice"]
USER pgsluice:pgsluice

# 6432: Postgres clients. 9930: admin API and /metrics.
EXPOSE 6432 9930

# pgsluice is PID 1 and handles SIGTERM itself: stop accepting, let in-flight transactions
# finish for limits.shutdown_timeout_ms (30 s by default), then exit. Give it that long.
STOPSIGNAL SIGTERM

# Inside a container the proxy must listen on all interfaces to be reachable at all.
ENV PGSLUICE_CONFIG=/etc/pgsluice/pgsluice.yaml \
    PGSLUICE_LISTEN=0.0.0.0:6432 \
    PGSLUICE_ADMIN_LISTEN=0.0.0.0:9930

# Liveness from the admin API, with bash's /dev/tcp (the slim image has no curl), on the
# admin port PGSLUICE_ADMIN_LISTEN names (move the admin port with that variable, not with
# --admin-listen, or this check looks at the old one).
HEALTHCHECK --interval=10s --timeout=3s --start-period=5s --retries=3 \
    CMD ["bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/${PGSLUICE_ADMIN_LISTEN##*:} && printf 'GET /healthz HTTP/1.0\\r\\nHost: localhost\\r\\n\\r\\n' >&3 && head -n 1 <&3 | grep -q ' 200 '"]

ENTRYPOINT ["/usr/local/bin/pgsluice"]
