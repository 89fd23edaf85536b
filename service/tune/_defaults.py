"""Defaults of vision-tune, in one place: the grids it searches and how it measures a configuration."""

from __future__ import annotations

OBJECTIVES = ("throughput", "latency")
DEFAULT_OBJECTIVE = "throughput"
SEARCHES = ("quick", "full")
DEFAULT_SEARCH = "quick"

# The grid on a CPU. Engines: ONNX Runtime and AOTInductor at fp32, and AOTInductor at bf16 where the
# CPU has bf16 units (machine.py drops it elsewhere: it would run emulated). Max batch 32 and the rest
# of the server's defaults are in the grid, so the defaults are one of its points. Pipeline depth and
# HTTP processes stay at their automatic values: on a CPU both stages of a pipeline want the same
# cores (docs/benchmarks.md), and a few hundred images per second need no second HTTP process.
CPU_ENGINES = ("onnx-fp32", "inductor-fp32", "inductor-bf16")
# Added to the CPU grid when --calibration DIR is given (int8 needs calibration images, so without them
# these are left out, and the notes say so): ONNX Runtime's QDQ int8 and PT2E int8 through AOTInductor.
# Each goes through compile-trt's gate like any engine, at int8's thresholds; one that fails to build
# or to pass is dropped.
CPU_INT8_ENGINES = ("onnx-int8", "inductor-int8")
CPU_MAX_BATCH_SIZES = (1, 4, 8, 32)
CPU_BATCH_TIMEOUTS_MS = (0.0,)
# 0: what vision-serve chooses for the engine and the machine (its default, the tune's baseline).
CPU_WORKERS_PER_DEVICE = (0, 1, 2)
CPU_API_SERVERS = (0,)
CPU_PIPELINE_DEPTHS = (0,)
# DALI runs its CPU pipelines here too; machine.py keeps the backends that import.
CPU_PREPROCESS = ("pil", "dali")

# The grid on a GPU: the engines to try (compile-trt reports those whose libraries are not there,
# TensorRT without torch_tensorrt, ONNX without its CUDA provider, and they are dropped), every GPU
# preprocessing backend that imports, and the device itself: one GPU, or all of them where there
# are several.
GPU_ENGINES = ("tensorrt-fp16", "tensorrt-fp32", "inductor-fp16", "inductor-bf16", "onnx-fp16")
# Added to the GPU grid with --calibration DIR: TensorRT's int8. Not fp8 (only compute capability 8.9 and
# later has it): --engines tensorrt-fp8 asks for it.
GPU_INT8_ENGINES = ("tensorrt-int8",)
GPU_MAX_BATCH_SIZES = (8, 32, 64, 128)
GPU_BATCH_TIMEOUTS_MS = (0.0, 2.0)
GPU_WORKERS_PER_DEVICE = (0, 1, 2)
GPU_API_SERVERS = (0, 2)  # 0: a quarter of the cores (service/settings.py: resolve_api_servers)
GPU_PIPELINE_DEPTHS = (1, 2)
GPU_PREPROCESS = ("torch", "dali", "cvcuda")

# The engines' batch range, MIN,OPT,MAX: compile-trt's default (1,8,32) when the grid's largest batch
# fits it, so that the defaults' artifact is exactly what `compile-trt --model X` builds.
ENGINE_BATCH_MIN = 1
ENGINE_BATCH_OPT = 8
ENGINE_BATCH_MAX_AT_LEAST = 32

# Measuring one configuration (measure.py). First a warm-up: WARMUP_ROUNDS rounds of requests at the
# concurrency the workers batch at once (at most WARMUP_MAX_CONCURRENCY, at least WARMUP_MIN_REQUESTS
# requests), so that first runs of each batch shape are not measured. Then a closed loop at rising
# concurrency (1, 2, 4, ...) up to MAX_CONCURRENCY_PER_SLOT x max batch x workers x devices: beyond
# twice what the workers batch at once, batches are full and only the queue grows. Each step runs
# STEP_SECONDS of requests, at least MIN_REQUESTS (the p99 of 50 is their largest: coarse, and time
# is what a tune costs; --step-seconds buys precision).
WARMUP_ROUNDS = 2
WARMUP_MAX_CONCURRENCY = 16
WARMUP_MIN_REQUESTS = 8
STEP_SECONDS = 4.0
MIN_REQUESTS = 50
MAX_REQUESTS_PER_STEP = 20_000
MAX_CONCURRENCY_PER_SLOT = 2
MAX_CONCURRENCY_CAP = 512
# A step that gains less than this share of throughput over the best one so far counts as flat; after
# FLAT_STEPS of them the configuration is saturated and the ladder stops.
FLAT_GAIN = 0.05
FLAT_STEPS = 2
# Then Poisson arrivals, as real traffic comes (in bursts, not one request per answer), first at
# LOAD_FACTOR of the closed loop's throughput at the target: the highest Poisson rate whose p99 meets
# the target is the throughput a configuration is judged by.
LOAD_FACTOR = 0.8
POISSON_SECONDS = 8.0
# Poisson runs per configuration at most (RateSearch in ladder.py): the first at LOAD_FACTOR of the
# capacity, then a bisection between the rates that met the target and those that did not, until
# they are within RATE_RESOLUTION of each other: 0.8, then 0.9 or 0.4, 0.6, 0.7 or 0.5 of the capacity.
MAX_POISSON_RUNS = 4
RATE_RESOLUTION = 0.125
# A load run stops sending after RUN_LIMIT_FACTOR x its planned length + RUN_LIMIT_EXTRA_S, so that a
# configuration far slower than planned still ends.
RUN_LIMIT_FACTOR = 4
RUN_LIMIT_EXTRA_S = 30.0
# Load generator processes: one Python client carries a CPU server's few hundred requests per second,
# not a GPU's thousands.
CPU_CLIENT_PROCESSES = 1
GPU_CLIENT_PROCESSES = 4
# Memory of the server's processes is sampled this often while it is loaded.
MEMORY_SAMPLE_S = 1.0
# The servers a tune starts raise the queue limit and deadline, so that a slow configuration shows as
# latency and low throughput rather than as 503s and 504s (benchmarks/harness/suite.py does the same).
BENCH_REQUEST_TIMEOUT_S = 600
BENCH_MAX_QUEUE = 4096

# Quick search (search.py): coordinate descent from the defaults, measuring at most this share of the
# grid (the defaults included), or one pass over every dimension where that is more (a few points).
QUICK_MAX_SHARE = 0.3
QUICK_MAX_PASSES = 3
# A move along a dimension must beat the current configuration by this much (noise, not a gain).
QUICK_MIN_GAIN = 0.02

# After the search: the defaults and the tuned configuration, alternating, this many rounds each.
CONFIRM_ROUNDS = 2

# What vision-tune writes beside --output: the report, the plot, every measurement, and its work folder.
REPORT_SUFFIX = ".md"
PLOT_SUFFIX = ".png"
CSV_SUFFIX = ".csv"
WORK_SUFFIX = ".work"
JOURNAL_FILE = "journal.jsonl"
