# syntax=docker/dockerfile:1
# Build stage: install compactd and its dependencies into a virtual environment.
FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY server ./server
RUN python -m venv /opt/compactd \
 && /opt/compactd/bin/pip install .

# Runtime stage: the venv only, a non-root user with a numeric UID (Kubernetes' runAsNonRoot can
# verify a number, not a name), the log on a volume.
FROM python:3.11-slim
RUN groupadd --system --gid 10001 compactd \
 && useradd --system --uid 10001 --gid 10001 --home /data --no-create-home compactd \
 && mkdir -p /data && chown 10001:10001 /data
COPY --from=build /opt/compactd /opt/compactd
ENV PATH=/opt/compactd/bin:$PATH \
    COMPACTD_LISTEN=0.0.0.0:50051 \
    COMPACTD_STORE=sqlite:////data/compactd.db \
    PYTHONUNBUFFERED=1
USER 10001:10001
WORKDIR /data
VOLUME ["/data"]
EXPOSE 50051
HEALTHCHECK --interval=15s --timeout=5s --start-period=10s --retries=3 \
  CMD ["python", "-c", "import grpc,sys; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g; c=grpc.insecure_channel('127.0.0.1:50051'); r=g.HealthStub(c).Check(h.HealthCheckRequest(), timeout=4); sys.exit(0 if r.status==h.HealthCheckResponse.SERVING else 1)"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["compactd"]
CMD ["serve"]
