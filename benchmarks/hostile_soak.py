"""Rounds of hostile traffic against a live server: is memory retained once, or does it grow?

    python -m benchmarks.hostile_soak                   # 10 rounds against efficientnet-lite0
    python -m benchmarks.hostile_soak --rounds 20 --repeats 3

Each round sends every hostile case ``--repeats`` times: the bad-input corpus over /predict (decode
cost bombs included), raw-socket faults (a client leaving mid-body, malformed chunked bodies,
oversized headers, slow headers and bodies cut off by the connection limits) and raw gRPC (bytes
that are not protobuf, a megabyte model name, unimplemented RPCs), with an ordinary request between
them. After each round, on an idle server, it records the RSS of every server process. Verdict:
the highest RSS of every process in the later half of the rounds within ``--max-growth-pct`` of its
highest in the earlier half (the first rounds fill caches and allocator arenas once, and an HTTP
process's RSS then moves with the large bodies it last held; a leak keeps rising), no 5xx answered, no
traceback logged, every ordinary request answered 200. Results under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
from tritonclient.grpc import service_pb2

from benchmarks.harness.common import machine_record, results_dir, write_results
from benchmarks.soak import rss_mb, server_processes
from compile import sample_photo_file
from service.client.launcher import ServerProcess, free_port
from tests.bad_inputs import bad_inputs

logger = logging.getLogger(__name__)

MODEL = "efficientnet-lite0"
CUT_OFF_S = 1.0  # --header-timeout-s and --body-timeout-s of the soaked server
MAX_HEADER_BYTES = 8192
SETTLE_S = 2.0
GRPC_SERVICE = "/inference.GRPCInferenceService/"


def raw_exchange(port: int, payload: bytes, *, reset_after_send: bool = False, wait_s: float = 10.0) -> bytes:
    """Send ``payload`` on a new connection; what the server sends until it closes (or ``wait_s``).
    ``reset_after_send``: leave at once with a TCP reset, as a client that crashed mid-upload."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as sock:
        if payload:
            sock.sendall(payload)
        if reset_after_send:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            return b""
        received = b""
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except TimeoutError:
            received += b"<still open>"
        except ConnectionResetError:
            received += b"<reset>"
        return received


def predict_head(length: int, extra: str = "") -> bytes:
    return (
        f"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\nContent-Length: {length}\r\n{extra}\r\n"
    ).encode()


def socket_faults(port: int, photo: bytes) -> list[tuple[str, bytes, bool]]:
    """(name, bytes, reset after sending) of each raw-HTTP fault."""
    chunked = b"POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\nTransfer-Encoding: chunked\r\n\r\n"
    return [
        ("left mid-body", predict_head(len(photo)) + photo[: len(photo) // 3], True),
        ("bad chunk size", chunked + b"4\r\nabcd\r\nzz\r\n", False),
        ("overflowing chunk size", chunked + b"ffffffffffffffffffff\r\nx\r\n", False),
        ("oversized header", predict_head(0, "X-Padding: " + "a" * (MAX_HEADER_BYTES + 100) + "\r\n"), False),
        ("slow headers", b"POST /predict HTTP/1.1\r\nHost: x\r\n", False),
        ("slow body", predict_head(len(photo)) + photo[:100], False),
        # HTTP/1.1 framing abuse: request smuggling shapes, and framing that costs more than its data.
        (
            "content-length and chunked",
            predict_head(4, "Transfer-Encoding: chunked\r\n") + b"4\r\nabcd\r\n0\r\n\r\n",
            False,
        ),
        ("duplicate content-length", predict_head(4, "Content-Length: 4\r\n") + b"abcd", False),
        ("thousands of tiny headers", b"GET /info HTTP/1.1\r\nHost: x\r\n" + b"a:b\r\n" * 1000 + b"\r\n", False),
        ("huge chunk extension", chunked + b"5;e=" + b"e" * 1_000_000 + b"\r\nhello\r\n0\r\n\r\n", False),
        ("one byte per chunk", chunked + b"1\r\nx\r\n" * 100_000 + b"0\r\n\r\n", False),
        # Answered in full, in order; the last one closes, so the exchange ends with its answer.
        (
            "pipelined flood",
            b"GET /info HTTP/1.1\r\nHost: x\r\n\r\n" * 1999
            + b"GET /info HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
            False,
        ),
    ]


def grpc_faults() -> list[tuple[str, str, bytes]]:
    """(name, method, request bytes) of each raw-gRPC fault."""
    huge_name = service_pb2.ModelInferRequest(model_name="m" * 1_000_000).SerializeToString()
    return [
        ("random bytes", "ModelInfer", bytes(range(256)) * 4),
        ("deep nesting", "ModelInfer", b"\x7b" * 500),
        ("megabyte model name", "ModelInfer", huge_name),
        ("unimplemented", "RepositoryIndex", b""),
    ]


def one_round(server: ServerProcess, grpc_url: str, repeats: int, photo: bytes) -> Counter:
    """Every hostile case ``repeats`` times, four at a time; what came back, by case and outcome."""
    seen: Counter = Counter()
    corpus = [item for item in bad_inputs() if len(item.body) <= 2 * 1024 * 1024]

    def post(body: bytes, content_type: str) -> int:
        return httpx.post(
            f"{server.url}/predict", content=body, headers={"Content-Type": content_type}, timeout=60
        ).status_code

    with grpc.insecure_channel(grpc_url) as channel, ThreadPoolExecutor(4) as pool:

        def grpc_call(method: str, body: bytes) -> str:
            try:
                channel.unary_unary(GRPC_SERVICE + method)(body, timeout=30)
            except grpc.RpcError as error:
                return error.code().name
            return "OK"

        for _ in range(repeats):
            jobs = [(f"http {i.name}", pool.submit(post, i.body, i.content_type)) for i in corpus]
            jobs += [(f"socket {name}", pool.submit(raw_exchange, server.port, payload, reset_after_send=reset))
                     for name, payload, reset in socket_faults(server.port, photo)]  # fmt: skip
            jobs += [(f"grpc {name}", pool.submit(grpc_call, method, body)) for name, method, body in grpc_faults()]
            jobs += [("ordinary", pool.submit(post, photo, "image/jpeg"))]
            for name, job in jobs:
                outcome = job.result()
                if isinstance(outcome, bytes):
                    outcome = outcome.split(b"\r\n", 1)[0].decode("latin-1")[9:12] or "closed"
                seen[(name, str(outcome))] += 1
    return seen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3, help="times each case is sent per round")
    parser.add_argument("--max-growth-pct", type=float, default=5.0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)

    photo = sample_photo_file("chelsea")
    grpc_port = free_port()
    flags = ["--model", MODEL, "--grpc-port", str(grpc_port), "--max-header-bytes", str(MAX_HEADER_BYTES)]
    flags += ["--header-timeout-s", str(CUT_OFF_S), "--body-timeout-s", str(CUT_OFF_S), "--log-level", "warning"]
    with tempfile.TemporaryDirectory() as workdir:
        log_path = Path(workdir) / "server.log"
        with ServerProcess(flags, log_path=log_path) as server:
            processes = server_processes(server.process.pid)
            rounds = []
            for number in range(1, args.rounds + 1):
                started = time.monotonic()
                seen = one_round(server, f"127.0.0.1:{grpc_port}", args.repeats, photo)
                time.sleep(SETTLE_S)
                rss = rss_mb(processes)
                rounds.append({"round": number, "seconds": time.monotonic() - started, "outcomes": seen, "rss_mb": rss})
                logger.info(
                    "round %d: %.1f s, RSS %s", number, rounds[-1]["seconds"], {p: round(m) for p, m in rss.items()}
                )
            log = server.log_text()
    roles = {pid: role for pid, (role, _) in processes.items()}
    record, text, failures = summarize(rounds, roles, log, args)
    write_results(results_dir(args.out), "hostile_soak", record, text, ".md")
    print(text)
    return 1 if failures else 0


def summarize(rounds: list[dict], roles: dict[int, str], log: str, args: argparse.Namespace) -> tuple[dict, str, list]:
    # Growth, not retention: the highest RSS of the later half of the rounds against the highest of
    # the earlier half (the first rounds fill caches and allocator arenas once, and an HTTP process's
    # RSS then moves up and down with the large bodies it last held).
    half = max(1, len(rounds) // 2)
    first = {pid: max(r["rss_mb"].get(pid, 0.0) for r in rounds[:half]) for pid in rounds[0]["rss_mb"]}
    later = {pid: max(r["rss_mb"].get(pid, 0.0) for r in rounds[half:]) for pid in rounds[0]["rss_mb"]}
    last = rounds[-1]["rss_mb"]
    outcomes: Counter = sum((r["outcomes"] for r in rounds), Counter())
    failures = []
    for pid, role in roles.items():
        if pid not in last:
            failures.append(f"{role} {pid} exited")
        elif (later[pid] / first[pid] - 1) * 100 > args.max_growth_pct:
            failures.append(f"{role} {pid} grew: {first[pid]:.1f} MiB at most earlier, {later[pid]:.1f} later")
    server_errors = {k: n for k, n in outcomes.items() if k[1].startswith("5") or k[1] in ("UNKNOWN", "INTERNAL")}
    if server_errors:
        failures.append(f"server errors: {server_errors}")
    if any(k[0] == "ordinary" and k[1] != "200" for k in outcomes):
        failures.append("an ordinary request was not answered 200")
    tracebacks = sum("Traceback" in line for line in log.splitlines())
    if tracebacks:
        failures.append(f"{tracebacks} tracebacks in the server log")
    header = "| process | pid | " + " | ".join(f"{r['round']}" for r in rounds) + " | later max / earlier max |"
    lines = [
        "# Hostile traffic in rounds: RSS per process (MiB) after each round (columns), idle",
        "",
        f"`python -m benchmarks.hostile_soak --rounds {args.rounds} --repeats {args.repeats}`: {MODEL}, CPU, each "
        f"round every case {args.repeats} times, 4 at a time ({sum(outcomes.values()) // len(rounds)} requests "
        "a round).",
        "",
        header,
        "|" + "---|" * (len(rounds) + 3),
    ]
    for pid, role in sorted(roles.items(), key=lambda item: (item[1], item[0])):
        values = [r["rss_mb"].get(pid) for r in rounds]
        cells = " | ".join(f"{v:.1f}" if v is not None else "gone" for v in values)
        ratio = f"{later[pid] / first[pid]:.3f}" if first.get(pid) and pid in later else "-"
        lines.append(f"| {role} | {pid} | {cells} | {ratio} |")
    lines += ["", "Outcomes over all rounds (case: answer x count):", ""]
    lines += [f"- {name}: {answer} x {n}" for (name, answer), n in sorted(outcomes.items())]
    lines += ["", f"Verdict: {'PASS' if not failures else 'FAIL: ' + '; '.join(failures)}"]
    record = {
        "machine": machine_record(),
        "rounds": [{**r, "outcomes": {f"{k[0]} -> {k[1]}": n for k, n in r["outcomes"].items()}} for r in rounds],
        "roles": roles,
        "failures": failures,
    }
    return record, "\n".join(lines), failures


if __name__ == "__main__":
    sys.exit(main())
