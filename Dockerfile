# syntax=docker/dockerfile:1
# Build stage: install compactd into a virtual environment, its dependencies at the versions and
# hashes of the lock (requirements/runtime.txt, made by scripts/lock), so that two builds of one
# commit install the same packages.
FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY requirements/runtime.txt ./requirements/
RUN python -m venv /opt/compactd \
 && /opt/compactd/bin/pip install --require-hashes -r requirements/runtime.txt
COPY pyproject.toml README.md ./
COPY server ./server
RUN /opt/compactd/bin/pip install --no-deps . \
 && /opt/compactd/bin/pip check

# Runtime stage: the venv only, a non-root user with a numeric UID (Kubernetes' runAsNonRoot can
# verify a number, not a name), the log on a volume.
FROM python:3.11-slim
RUN groupadd --system --gid 10001 compactd \
 && useradd --system --uid 10001 --gid 10001 --home /data --no-create-home compactd \
 && mkdir -p /data && chown 10001:10001 /data
COPY --from=build /opt/compactd /opt/compactd
# Listening beyond loopback needs TLS (COMPACTD_TLS_CERT_FILE and COMPACTD_TLS_KEY_FILE, mounted
# files) or, behind a mesh sidecar that terminates mTLS, COMPACTD_INSECURE_PLAINTEXT=true: without
# either the server refuses to start and says so. Health is also served in plaintext on 8081, for
# probes that speak neither TLS nor tokens (health reveals nothing).
ENV PATH=/opt/compactd/bin:$PATH \
    COMPACTD_LISTEN=0.0.0.0:50051 \
    COMPACTD_HEALTH_LISTEN=0.0.0.0:8081 \
    COMPACTD_STORE=sqlite:////data/compactd.db \
    PYTHONUNBUFFERED=1
USER 10001:10001
WORKDIR /data
VOLUME ["/data"]
EXPOSE 50051 8081
HEALTHCHECK --interval=15s --timeout=5s --start-period=10s --retries=3 \
  CMD ["python", "-c", "import grpc,sys; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g; c=grpc.insecure_channel('127.0.0.1:8081'); r=g.HealthStub(c).Check(h.HealthCheckRequest(), timeout=4); sys.exit(0 if r.status==h.HealthCheckResponse.SERVING else 1)"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["compactd"]
CMD ["serve"]
