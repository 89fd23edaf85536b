"""Defaults of the server, in one place. Each is also a flag and a ``VISION_SERVE_*`` environment
variable (see service/settings.py). The client has its own (service/client/_defaults.py)."""

from compile._defaults import DEFAULT_MODEL, DEFAULT_WEIGHTS
from preprocessing._defaults import MAX_IMAGE_PIXELS as _PREPROCESS_MAX_IMAGE_PIXELS

# A compile-trt artifact directory; empty: serve the eager model named by MODEL and WEIGHTS.
ARTIFACT = ""
MODEL = DEFAULT_MODEL
WEIGHTS = DEFAULT_WEIGHTS
DEVICE = "auto"  # cuda if a GPU is visible, else cpu
PREPROCESS = "auto"
# What turns the model's logits into the scores answered (softmax, sigmoid, none); auto: the model's own
# (compile/_defaults.py ACTIVATIONS: a transformers folder's problem_type, an artifact's manifest).
ACTIVATION = "auto"
MAX_BATCH_SIZE = 32
# How long the first request of a batch waits for others once the queue is drained. 0 (greedy, as
# Triton's default max_queue_delay): an idle server runs a lone request at once, and under load
# batches fill anyway from the requests that queue while the model is busy (service/worker/collector.py).
# A window helps only when arrivals are sparse and a bigger batch costs little more than a small one.
BATCH_TIMEOUT_MS = 0.0
# Inference worker processes per device; 0: chosen at start from the engine and the machine
# (service/supervisor/planning/sizing.py; the startup log, /info and --print-config say what and why).
WORKERS_PER_DEVICE = 0
# Threads each worker's engine runs on (torch's intra-op pool, ONNX Runtime's); 0: chosen with the
# workers, so that workers x threads fits the cores this process may use.
ENGINE_THREADS = 0
# The most a flag may ask for each: past these a machine runs out of threads or processes (ENOMEM at
# the workers' start) before it serves, and no machine that vision-serve runs on has more cores.
MAX_ENGINE_THREADS = 1024
MAX_WORKERS_PER_DEVICE = 256
MAX_API_SERVERS = 256
# The rule behind those zeros (service/supervisor/planning/sizing.py). A model under SMALL_MODEL_GMACS
# multiply-accumulates per image (EfficientNet-Lite0 0.39, MobileNetV3 0.22, ResNet-18 1.8) gets a
# worker per core on a CPU; a larger one (ResNet-50 4.1, ResNet-152 11.5) a worker per
# CPU_LARGE_MODEL_THREADS cores, and at least MIN_CPU_WORKERS (one decodes while another runs its
# engine). Never more than MAX_CPU_WORKERS workers on a CPU: each holds its own engine and
# interpreter, and past it more threads per worker pay better than more processes.
SMALL_MODEL_GMACS = 2.0
CPU_LARGE_MODEL_THREADS = 8
MIN_CPU_WORKERS = 2
MAX_CPU_WORKERS = 16
# A model file's (ONNX, exported program) cost is estimated from its size: 4 bytes a parameter, and
# this many GMACs per million parameters (the upper end of image classifiers: ResNet-152 0.19).
GMACS_PER_MILLION_PARAMETERS = 0.2
GPU_WORKERS_PER_DEVICE = 1
# Host threads of each GPU worker's torch (the engine runs on the GPU; these run what stays on the host).
GPU_WORKER_MAX_THREADS = 4
# Batches in flight in each worker: 1 runs each batch start to end; 2 prepares the next batch
# (decode, resize, upload on a CUDA stream of its own) while the model runs this one. 0: auto,
# see service.settings.resolve_pipeline_depth.
PIPELINE_DEPTH = 0
# HTTP processes (each parses, checks and queues requests, and turns answers into JSON); 0: auto,
# see service.settings.resolve_api_servers.
API_SERVERS = 0
# Loopback by default, like TorchServe; containers pass --host 0.0.0.0.
HOST = "127.0.0.1"
PORT = 8000
# The Open Inference Protocol's gRPC service (KServe v2 / Triton's GRPCInferenceService); 0: off.
GRPC_PORT = 0
LOG_LEVEL = "info"
# text for a terminal; containers set json (one object per line, with the request id).
LOG_FORMAT = "text"

ENV_PREFIX = "VISION_SERVE_"

TOP_K = 5
MAX_TOP_K = 1000

# Input limits, checked in the HTTP process before a request is queued.
# Largest request body accepted (a 12 MP JPEG is ~5 MB; base64 adds a third).
MAX_BODY_BYTES = 32 * 1024 * 1024
MAX_IMAGE_PIXELS = _PREPROCESS_MAX_IMAGE_PIXELS

# Images one POST /predict (several "image" fields or a JSON "images" list) or one OIP infer request
# may carry; each is its own batch item and takes its own --max-queue slot.
MAX_IMAGES_PER_REQUEST = 64

# Load shedding: images admitted (queued or in a batch) and not yet answered, across the whole
# server. Beyond it /predict answers 503 with Retry-After at once instead of queueing. Size it as
# throughput x the queueing delay you accept: 256 is ~0.1 s of a GPU doing 2,500 img/s, but 25 s of
# ResNet-152 on 2 CPU cores, where a lower value suits better.
MAX_QUEUE = 256
# Seconds from admission to answer (queue + preprocessing + inference); beyond it the request gets
# 504, and work still queued for it is dropped instead of run. Always on: it is also what answers a
# request lost with a crashed worker.
REQUEST_TIMEOUT_S = 30.0
# A worker that stops answering (service/supervisor/pool/hangs.py). Each serving worker beats twice a
# second from a thread of its own, also in the middle of a long batch. One silent for
# WORKER_HEARTBEAT_TIMEOUT_S (stopped, or frozen in a native call that holds the GIL) is marked
# unresponsive: /ready answers 503, no request goes to it, and what it holds is answered 503; silent
# for twice that, it is killed and restarted (back to ready if it beats again before). 0: off.
WORKER_HEARTBEAT_TIMEOUT_S = 5.0
WORKER_BEAT_INTERVAL_S = 0.5  # not a flag: how often workers beat (service/transport/heartbeats.py)
MIN_WORKER_HEARTBEAT_TIMEOUT_S = 1.0  # two beats
# One batch that runs this long while its worker still beats (an engine that never returns, a
# deadlocked library) gets the worker killed and restarted the same way; 0: BATCH_HANG_REQUEST_TIMEOUTS
# x --request-timeout-s, when every request of that batch got its 504 long ago, and never under
# MIN_BATCH_HANG_S: a short request deadline must not make a slow batch (ResNet-152's 32 images on one
# core take 10 s and more) look hung, since restarting its worker costs a model load and saves nothing.
BATCH_HANG_TIMEOUT_S = 0.0
BATCH_HANG_REQUEST_TIMEOUTS = 4
MIN_BATCH_HANG_S = 120.0
# Each HTTP connection (service/http/connection/): a request's headers must arrive within
# HEADER_TIMEOUT_S of the connection's opening (or of the request's first byte) and be at most
# MAX_HEADER_BYTES; its body within BODY_TIMEOUT_S of the headers (a 32 MB upload at 1 MB/s takes 32 s).
# An idle kept-alive connection is closed after KEEP_ALIVE_TIMEOUT_S (uvicorn's timer).
MAX_HEADER_BYTES = 16 * 1024
HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 60.0
KEEP_ALIVE_TIMEOUT_S = 5.0
# What a 503 tells the client to wait before retrying, in seconds.
RETRY_AFTER_S = 1
# Longest error message the server sends; quotes of what the client sent are cut to fit.
MAX_ERROR_MESSAGE_CHARS = 1000
# Clients must send this key (X-API-Key or Authorization: Bearer) to /predict and /info; empty:
# no key. /health and /ready stay open for orchestrator probes.
API_KEY = ""

# A model repository (service/repository/layout.py): DIR/<name>/<version>/ artifacts; empty: serve
# the one --model or --artifact.
MODEL_REPOSITORY = ""
# "none": serve what the repository holds at start; "explicit": also Triton's load/unload API.
MODEL_CONTROL = "none"
MODEL_CONTROL_MODES = ("none", "explicit")
# The model /predict serves without ?model=; empty: the only model, if there is one.
DEFAULT_MODEL = ""
# The key of the repository API (load, unload, index): separate from API_KEY, and required with
# --model-control explicit.
ADMIN_API_KEY = ""
# Longest a load may take, from the call to a new version's workers all warm; then it fails and the
# old version keeps serving.
LOAD_TIMEOUT_S = 300.0
# Where a model version's workers run: "shared" (the engines of many models in each worker process,
# one per device and --workers-per-device) or "process" (worker processes of its own).
WORKER_ISOLATION = "shared"
WORKER_ISOLATION_MODES = ("shared", "process")
# MiB the resident models' loads may take (their engines, workspace and warm-up; the worker processes'
# own base is apart); 0: MEMORY_BUDGET_SHARE of the free memory at start, less the processes' base
# (service/supervisor/pool/budget.py). A repository that holds more is served on demand: a model not
# resident loads on its first request, and the least recently used idle model makes room.
MEMORY_BUDGET_MIB = 0
MEMORY_BUDGET_SHARE = 0.85
# Whatever the budget says, a load on demand leaves this share of the memory free at start unused
# (another process may have taken memory since).
MEMORY_RESERVE_SHARE = 0.05
# An evicted model has run no batch for this long (it is idle, not between two batches of a stream)
# and has been resident at least EVICT_MIN_RESIDENT_S (the request that loaded it gets it).
EVICT_IDLE_GRACE_S = 1.0
EVICT_MIN_RESIDENT_S = 2.0

# The response cache (service/http/cache/): answers kept per HTTP process, keyed on the image's bytes,
# the model version and the options that change the answer; 0 MiB: off. A hit is answered before any
# decode. Optional Redis shared by several replicas (redis://[:password@]host:port/db; empty: none),
# asked with a bounded timeout: a slow or dead Redis is a miss, never an error or a stall, and after a
# failure it is left alone for REDIS_RETRY_AFTER_S.
RESPONSE_CACHE_MB = 0
RESPONSE_CACHE_REDIS = ""
RESPONSE_CACHE_REDIS_TIMEOUT_MS = 20.0
RESPONSE_CACHE_REDIS_TTL_S = 86400.0
RESPONSE_CACHE_REDIS_RETRY_AFTER_S = 5.0

# OpenTelemetry tracing (service/tracing/): the share of requests traced (0: off, and free), and the
# OTLP/gRPC collector the spans go to (e.g. http://127.0.0.1:4317). A client's W3C traceparent is
# honoured: its sampled flag decides for its request.
TRACE_SAMPLE_RATE = 0.0
OTLP_ENDPOINT = ""
