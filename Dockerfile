# One image with every kvroute binary; the chart picks one with `command`:
#   /usr/local/bin/kvroute-router      the data plane
#   /usr/local/bin/kvroute-operator    the control plane
#   /usr/local/bin/kvroute-agent       the vLLM sidecar
#   /usr/local/bin/kvroute-engine-sim  the vLLM-style engine for demos and tests
#   /usr/local/bin/kvroute             the CLI (`kvroute probe` for `helm test`)
# Build: docker build -t kvroute:dev .

# --- build ------------------------------------------------------------------
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
# The release profile keeps line tables; the image does not need them.
RUN cargo build --release --locked \
        -p kvroute-router -p kvroute-operator -p kvroute-agent \
        -p kvroute-engine-sim -p kvroute-cli \
    && mkdir /out \
    && for bin in kvroute-router kvroute-operator kvroute-agent kvroute-engine-sim kvroute; do \
         strip --strip-debug -o "/out/$bin" "target/release/$bin"; \
       done

# --- runtime ----------------------------------------------------------------
# Distroless with glibc and libgcc (the binaries link them dynamically; TLS
# is rustls, so no OpenSSL), no shell, running as the nonroot user.
FROM gcr.io/distroless/cc-debian12:nonroot
LABEL org.opencontainers.image.title="kvroute" \
      org.opencontainers.image.description="Cache-aware router, operator and vLLM agent for LLM inference on Kubernetes" \
      org.opencontainers.image.source="https://github.com/kvroute/kvroute" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /out/ /usr/local/bin/
USER 65532:65532
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/kvroute-router"]
