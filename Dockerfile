# The gateway image the Helm chart runs (`args: ["serve", ...]`); non-root, no writes outside
# the data dir and /tmp, so it runs with a read-only root filesystem.
#   docker build -t ghcr.io/polyroute/polyroute:0.1.0 .
FROM python:3.11-slim AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 CMAKE_ARGS=-DGGML_NATIVE=OFF
RUN apt-get update && apt-get install -y --no-install-recommends build-essential cmake \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml requirements.lock README.md ./
COPY gateway gateway
COPY router router
COPY retrieval retrieval
COPY policies policies
COPY polyroute polyroute
RUN python -m venv /opt/polyroute \
    && /opt/polyroute/bin/pip install torch==2.13.0 \
    && /opt/polyroute/bin/pip install -c requirements.lock .

FROM python:3.11-slim
COPY --from=build /opt/polyroute /opt/polyroute
ENV PATH=/opt/polyroute/bin:$PATH HF_HUB_OFFLINE=1 LITELLM_LOCAL_MODEL_COST_MAP=True \
    POLYROUTE_HOST=0.0.0.0 POLYROUTE_DATA_DIR=/var/lib/polyroute HOME=/tmp
RUN useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin polyroute \
    && mkdir -p /var/lib/polyroute && chown 10001 /var/lib/polyroute
USER 10001
EXPOSE 8400
ENTRYPOINT ["polyroute"]
CMD ["serve"]
