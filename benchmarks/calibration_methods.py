"""Which calibration method for int8 (compile-trt --calibration-method): every method of each engine,
compiled with the same calibration set and gated on the same evaluation set.

    python -m benchmarks.calibration_methods                       # efficientnet-lite0, onnx and inductor
    python -m benchmarks.calibration_methods --model resnet152 --weights random --engines onnx

Each (engine, method) is one compile-trt run (a cache hit when the work folder holds it already);
the table gives its compile time, the gate's figures against eager fp32 (measured with the gate's
thresholds at zero, so that a failing method has figures too) and what the default int8 gate says.
``--calibration-method auto`` is each engine's first method in compile/backends: what this table
supports. Results:
``calibration-methods-<model>.json`` and ``.md`` in the results folder.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
from pathlib import Path

from benchmarks.harness.common import machine_record, results_dir, write_results
from benchmarks.harness.suite import markdown_table
from compile import CompileSettings, get_backend, threshold_failures, write_sample_calibration_set

logger = logging.getLogger("benchmarks.calibration_methods")
MEASURES = ("top1_agreement", "top5_agreement", "mean_prob_drop", "top5_overlap", "cosine")


def compile_one(model: str, weights: str, engine: str, method: str, calibration: Path, output: Path) -> dict:
    command = [sys.executable, "-m", "compile.cli", "--model", model, "--weights", weights, "--device", "cpu"]
    command += ["--backend", engine, "--precision", "int8", "--calibration", str(calibration)]
    command += ["--calibration-method", method, "--output", str(output), "--log-level", "warning"]
    # Every method's figures, a failing one's too: the gate is opened here and judged below (gate_verdict).
    command += ["--gate-min-top1-agreement", "0", "--gate-min-top5-agreement", "0", "--gate-max-prob-drop", "1"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    record: dict = {"engine": engine, "method": method, "exit_code": done.returncode, "command": command[1:]}
    manifest_path = output / "manifest.json"
    if done.returncode != 0 or not manifest_path.is_file():
        record["message"] = done.stderr.strip().splitlines()[-12:]
        return record
    manifest = json.loads(manifest_path.read_text())
    record["compile_seconds"] = manifest["compile_seconds"]
    record["gate_seconds"] = manifest["validation"]["seconds"]
    record["metrics"] = manifest["validation"]["metrics"]
    record["default_gate"] = gate_verdict(record["metrics"], weights)
    return record


def gate_verdict(metrics: dict, weights: str) -> str:
    """What compile-trt's default int8 gate says of these figures: "pass", or the measures that fail it."""
    thresholds = CompileSettings(precision="int8", calibration=".", weights=weights).gate_thresholds()
    failures = threshold_failures(metrics, thresholds)
    return "pass" if not failures else "; ".join(failures)


def table(records: list[dict]) -> str:
    rows = []
    for r in records:
        if "metrics" not in r:
            rows.append([r["engine"], r["method"], f"exit {r['exit_code']}", *["-"] * (len(MEASURES) + 2)])
            continue
        figures = [f"{r['metrics'][m]:.4f}" for m in MEASURES]
        times = [f"{r['compile_seconds']:.1f}", f"{r['gate_seconds']:.1f}"]
        rows.append([r["engine"], r["method"], *times, *figures, r["default_gate"]])
    return markdown_table(["engine", "method", "compile s", "gate s", *MEASURES, "default int8 gate"], rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="efficientnet-lite0")
    parser.add_argument("--weights", default="imagenet")
    parser.add_argument("--engines", default="onnx,inductor")
    parser.add_argument("--calibration", type=Path, help="calibration images (default: the sample set, written)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/vision-serve-calibration-methods"))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    calibration = args.calibration
    if calibration is None:
        calibration = args.work / "calibration"
        write_sample_calibration_set(calibration)
    records = []
    for engine in args.engines.split(","):
        for method in get_backend(engine).calibration_methods:
            output = args.work / f"{args.model}-{engine}-int8-{method}"
            logger.info("%s %s: compiling ...", engine, method)
            records.append(compile_one(args.model, args.weights, engine, method, calibration, output))
            logger.info("%s", json.dumps({k: v for k, v in records[-1].items() if k != "command"}))
    text = f"# int8 calibration methods: {args.model} ({args.weights} weights)\n\n{table(records)}\n"
    record = {"model": args.model, "weights": args.weights, "machine": machine_record(), "runs": records}
    write_results(results_dir(args.out), f"calibration-methods-{args.model}", record, text, ".md")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
