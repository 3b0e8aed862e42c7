# oomguard: the exporter, the remediator and the other commands (deploy/docker/README.md).
# Build from the repository root:
#   docker build -f deploy/docker/oomguard.Dockerfile -t ghcr.io/oomguard/oomguard:0.1.0 .
FROM python:3.11-slim AS wheel
WORKDIR /src
COPY . .
RUN pip install --no-cache-dir build && python -m build --wheel --outdir /wheels .

FROM python:3.11-slim
COPY --from=wheel /wheels/ /wheels/
COPY requirements/lock.txt /wheels/lock.txt
# the tested versions (the lock) of the remediator's and the Kubernetes backend's dependencies
RUN pip install --no-cache-dir -c /wheels/lock.txt "/wheels/oomguard-0.1.0-py3-none-any.whl[remediator,kubernetes]" && rm -rf /wheels
# non-root, as the manifests run it (securityContext.runAsNonRoot)
USER 65532:65532
ENTRYPOINT ["oomguard"]
CMD ["--help"]
