# The CPU image: vision-serve with ONNX Runtime on any x86-64 or arm64 host, no GPU. It serves your own
# classifier (a torchvision or timm name, a .onnx or .pt2 file) or, out of the box and with no download,
# efficientnet-lite0, a pretrained ImageNet classifier whose weights ship in a Python package.
#
#   docker build -t vision-serve-cpu .                  # or: make image (podman, a base made locally)
#   docker run -d --init --stop-timeout 60 -p 8000:8000 -v vision-serve:/var/lib/vision-serve vision-serve-cpu
#   curl --data-binary @cat.jpg http://localhost:8000/predict
#
# The first start compiles VISION_SERVE_ARTIFACT (an ONNX Runtime engine, with the accuracy gate) into the
# volume; every later start is a cache hit. Your model instead, e.g.:
#   -e VISION_SERVE_ARTIFACT=/var/lib/vision-serve/artifacts/convnext \
#   -e VISION_SERVE_COMPILE_ARGS="--model timm:convnext_tiny --weights /models/convnext.pth --backend onnx"
#
# BASE_IMAGE: any Debian-like image with Python >= 3.10 and its venv module. The default is the public
# Python image; where no registry is reachable, `make image` builds one from Debian packages (mmdebstrap)
# and passes it here (docs/deployment.md).
# TORCH_INDEX_URL: where torch and torchvision come from. PyTorch's CPU builds by default (a few hundred
# MB); PyPI's builds carry CUDA's libraries (several GB) but run on a CPU just the same.
ARG BASE_IMAGE=docker.io/library/python:3.12-slim-bookworm
FROM ${BASE_IMAGE}

# A fixed UID, so that a bind-mounted host folder can be chowned to it, and not root: the server
# parses untrusted image bytes. No lastlog entry (-l): a high UID would otherwise bloat the layer.
ARG APP_UID=10001
RUN groupadd --gid "${APP_UID}" vision \
 && useradd -l --uid "${APP_UID}" --gid vision --create-home --home-dir /home/vision --shell /usr/sbin/nologin vision

# A virtualenv, so that the image's Python packages never mix with the base's (Debian's Python refuses
# pip installs outside one).
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:${PATH}
RUN python3 -m venv "${VIRTUAL_ENV}"

WORKDIR /opt/vision-serve
# The dependencies first, from pyproject.toml alone, so that a code or README change does not reinstall
# them (several GB of torch: a new layer on every rebuild).
COPY pyproject.toml ./
COPY deploy/docker/requirements.py deploy/docker/requirements.py

# torch and torchvision (pyproject's ranges) from TORCH_INDEX_URL; then everything else of the demo
# extra (ONNX Runtime, the offline classifier, the gate's photos) and timm, keeping that torch.
# PIP_CERT, if given, names a CA bundle mounted for this build (a host behind a TLS-intercepting proxy):
#   podman build -v /etc/ssl/certs/ca-certificates.crt:/run/host-ca.crt:ro --build-arg PIP_CERT=/run/host-ca.crt
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG PIP_CERT
RUN --mount=type=cache,target=/root/.cache/pip \
    python deploy/docker/requirements.py --only torch,torchvision >/tmp/torch.txt \
 && pip install --quiet --index-url "${TORCH_INDEX_URL}" --requirement /tmp/torch.txt \
 && python deploy/docker/requirements.py --installed torch,torchvision >/tmp/keep.txt \
 && python deploy/docker/requirements.py --extras demo,timm,quantize,cache,tracing --without torch,torchvision >/tmp/deps.txt \
 && pip install --quiet --requirement /tmp/deps.txt --constraint /tmp/keep.txt \
 && rm /tmp/torch.txt /tmp/keep.txt /tmp/deps.txt

# The code, installed as root into the virtualenv and read-only to the server's user (pip writes the
# bytecode as it installs, since that user cannot write __pycache__ there). The sources are removed
# after, so that `python` in this folder imports the installed package, not a copy beside it.
COPY README.md ./
COPY service service
COPY compile compile
COPY preprocessing preprocessing
RUN pip install --quiet --no-cache-dir --no-deps . \
 && rm -rf build ./*.egg-info service compile preprocessing

COPY deploy/docker/entrypoint.sh /opt/vision-serve/deploy/docker/entrypoint.sh

# Everything that should outlive the container lives on one volume (created owned by the app user, so a
# new named volume mounted on it starts with that owner):
#   /var/lib/vision-serve/artifacts  compile-trt artifacts (engine + manifest.json), built on first start
#   /var/lib/vision-serve/torch      TORCH_HOME: weights torchvision downloads once, if any
# `artifacts` in the working directory points there, so that compile-trt without --output writes there too.
RUN mkdir -p /var/lib/vision-serve/artifacts /var/lib/vision-serve/torch \
 && ln -s /var/lib/vision-serve/artifacts artifacts \
 && chown -R vision:vision /var/lib/vision-serve
VOLUME ["/var/lib/vision-serve"]

# Containers listen on every interface (the server's own default is loopback) and log one JSON object
# per line. The default artifact is the offline classifier on ONNX Runtime; set both variables for yours.
# HOME=/tmp: with a read-only root filesystem (--read-only --tmpfs /tmp), libraries that cache under ~
# write to /tmp.
ENV VISION_SERVE_HOST=0.0.0.0 \
    VISION_SERVE_PORT=8000 \
    VISION_SERVE_LOG_FORMAT=json \
    VISION_SERVE_ARTIFACT=/var/lib/vision-serve/artifacts/efficientnet-lite0-onnx-fp32 \
    VISION_SERVE_COMPILE_ARGS="--model efficientnet-lite0 --backend onnx --precision fp32 --device cpu" \
    TORCH_HOME=/var/lib/vision-serve/torch \
    HOME=/tmp \
    PYTHONUNBUFFERED=1

# Numeric, so that Kubernetes' runAsNonRoot can verify it without reading /etc/passwd.
USER ${APP_UID}:${APP_UID}
EXPOSE 8000

# Liveness: /health answers while the HTTP server does (see Dockerfile.gpu for why not /ready). The start
# period covers a first start's compile.
HEALTHCHECK --interval=10s --timeout=5s --retries=3 --start-period=10m \
    CMD ["python", "-c", "import os, urllib.request as u; u.urlopen('http://127.0.0.1:%s/health' % os.environ.get('VISION_SERVE_PORT', '8000'), timeout=4)"]

# SIGTERM starts the graceful stop: stop accepting, answer the requests held (up to the request timeout,
# 30 s), stop the workers, exit 0. Give it time (`docker stop -t 60`) and an init as PID 1 (`--init`).
STOPSIGNAL SIGTERM
# No arguments (or flags only) serve, compiling VISION_SERVE_ARTIFACT first; any other command runs as it is.
ENTRYPOINT ["/opt/vision-serve/deploy/docker/entrypoint.sh"]
CMD []
