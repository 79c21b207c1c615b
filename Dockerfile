# kvroute: the image the Helm chart (helm/kvroute) runs.
#   docker build -t kvroute/kvroute:0.1.0 .
# Two stages: the build stage installs kvroute and its dependencies into a virtualenv;
# the runtime stage copies only that virtualenv onto a slim Python, with no compiler, no
# pip cache and no source tree, and runs as an unprivileged user.

FROM python:3.11-slim-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/kvroute
WORKDIR /src
COPY pyproject.toml README.md LICENSE ./
COPY kvroute ./kvroute
COPY router ./router
COPY policies ./policies
COPY loadtest ./loadtest
RUN /opt/kvroute/bin/pip install --no-compile ".[precise]" \
    && /opt/kvroute/bin/python -m compileall -q /opt/kvroute

FROM python:3.11-slim-bookworm
LABEL org.opencontainers.image.title="kvroute" \
      org.opencontainers.image.description="Cache-aware router for LLM inference engines (vLLM, SGLang)" \
      org.opencontainers.image.licenses="Apache-2.0"
# The numeric user matches the chart's podSecurityContext.runAsUser, so runAsNonRoot can verify it.
RUN groupadd --system --gid 10001 kvroute \
    && useradd --system --uid 10001 --gid kvroute --no-create-home --shell /usr/sbin/nologin kvroute
COPY --from=build /opt/kvroute /opt/kvroute
# Bytecode was compiled at build time: the root filesystem can be mounted read-only.
ENV PATH=/opt/kvroute/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 10001:10001
EXPOSE 8080
ENTRYPOINT ["kvroute"]
CMD ["serve", "--config", "/etc/kvroute/config.yaml"]
