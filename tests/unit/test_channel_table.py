"""Every channel between the server's processes has a row in docs/development.md's channel table
(issue 63): a module of ``service/`` that makes one (a ZeroMQ socket, shared memory, a child process
it talks to or spawns, environment variables set for children, LitServe's manager, Redis) must be
named in the section "Processes and what they share", or listed below with why it is not a channel
between the server's processes. Read from the source, so a new channel in a new module fails here
until it has its row."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVICE = ROOT / "service"
DOCS = ROOT / "docs" / "development.md"
SECTION = "## Processes and what they share"

# What makes a channel between processes, as the code writes it.
CHANNEL_MAKERS = {
    "a ZeroMQ socket": re.compile(r"\.socket\(zmq\."),
    "shared memory": re.compile(r"\b(?:multiprocessing|mp)\.(?:Array|Value|RawArray|RawValue)\(|shared_memory"),
    "a child process": re.compile(r"\bsubprocess\.Popen\(|get_context\(\"spawn\"\)"),
    "a pipe": re.compile(r"\.Pipe\("),
    "environment for children": re.compile(r"os\.environ\[[^\]]+\]\s*=|os\.environ\.update\("),
    "a manager process": re.compile(r"\bSyncManager\("),
    "Redis": re.compile(r"^import redis|^from redis", re.MULTILINE),
}
# Modules that match but make no channel between the server's own processes.
NOT_SERVER_CHANNELS = {
    "service/client/launcher.py": "starts vision-serve for a caller (tests, benchmarks): the caller's process",
    "service/tune/loadgen.py": "vision-tune's load-generating client processes: clients of the server, not part of it",
}


def section_text() -> str:
    text = DOCS.read_text()
    start = text.index(SECTION)
    end = text.index("\n## ", start + len(SECTION))
    return text[start:end]


def channel_modules() -> dict[str, list[str]]:
    found = {}
    for path in sorted(SERVICE.rglob("*.py")):
        source = path.read_text()
        kinds = [kind for kind, pattern in CHANNEL_MAKERS.items() if pattern.search(source)]
        if kinds:
            found[path.relative_to(ROOT).as_posix()] = kinds
    return found


def test_every_module_that_makes_a_channel_is_in_the_table() -> None:
    table = section_text()
    missing = {
        module: kinds
        for module, kinds in channel_modules().items()
        if module not in NOT_SERVER_CHANNELS and module not in table
    }
    assert not missing, (
        f"these modules make channels that {DOCS.name}'s channel table does not name: {missing}. Add a row "
        f"(written by, read by, why, its message type's file) under '{SECTION}', or list the module in "
        "NOT_SERVER_CHANNELS with why it is not a channel between the server's processes."
    )


def test_the_scan_finds_the_channels_it_is_meant_to() -> None:
    """The patterns still match the known channels: a rename that blinds them fails here."""
    found = channel_modules()
    for module, kind in (
        ("service/transport/channels.py", "a ZeroMQ socket"),
        ("service/supervisor/server.py", "shared memory"),
        ("service/supervisor/pool/hosts.py", "a child process"),
        ("service/supervisor/pool/hosts.py", "a pipe"),
        ("service/supervisor/planning/launch.py", "a child process"),
        ("service/metrics.py", "environment for children"),
        ("service/supervisor/litserve_bridge.py", "a manager process"),
        ("service/http/cache/redis_store.py", "Redis"),
    ):
        assert kind in found.get(module, []), (module, kind, found.get(module))
    assert set(NOT_SERVER_CHANNELS) <= set(found), "an exemption for a module that makes no channel: remove it"
