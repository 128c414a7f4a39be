# Redis for machines with no image registry: Debian's redis-server on a local Debian base
# (scripts/compose_e2e.sh passes the debootstrapped one). compose.yaml starts it with
# --protected-mode no, so the other containers can reach it.
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
ENV DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
    && apt-get install -y --no-install-recommends redis-server \
    && rm -rf /var/lib/apt/lists/*
USER redis
EXPOSE 6379
CMD ["redis-server", "--protected-mode", "no"]
