# The official vLLM 0.33.0 image with the oomguard plugin (and `oomguard serve`) added
# (deploy/docker/README.md). Build from the repository root:
#   docker build -f deploy/docker/vllm.Dockerfile -t ghcr.io/oomguard/vllm-oomguard:0.33.0 .
FROM python:3.11-slim AS wheel
WORKDIR /src
COPY . .
RUN pip install --no-cache-dir build && python -m build --wheel --outdir /wheels .

FROM vllm/vllm-openai:v0.33.0
COPY --from=wheel /wheels/ /wheels/
# the plain install: everything it needs is already in the image, so pip adds oomguard and
# changes no package of vLLM's (tests/test_packaging.py resolves this against vLLM 0.33)
RUN python3 -m pip install --no-cache-dir /wheels/oomguard-0.1.0-py3-none-any.whl && rm -rf /wheels
ENV VLLM_PLUGINS=oomguard
