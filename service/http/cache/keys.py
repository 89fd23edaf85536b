"""The response cache's keys: which model answered, which image, which ``top_k``.

A key is ``vs2:<model fingerprint>:<top_k>:<sha256 of the image's bytes>``. The fingerprint digests the
route's name, version and what its ``ModelInfo`` says that can change an answer (``answer_identity``:
its ``activation`` among them; for an artifact: the manifest's ``compiled_at``, ``cache_key``,
``weights_sha256`` ...), so a model swapped or reloaded under another version or another build never
shares a key with the one before it.
Nothing in a key depends on the process, so every replica computes the same key for the same image,
model and ``top_k``, and they share Redis entries.

What is cached under a key is the model's answer (its predictions), not a response body: each protocol
(/predict, the Open Inference Protocol over HTTP and gRPC) renders it itself, so the output form is no
part of the key. A request for the model's whole output (LOGITS, ``/predict?logits=true``) bypasses the
cache both ways (service/http/pipeline/pipeline.py): it is never answered a cached top-k, and its answer
is not kept. ``vs2`` names the value's encoding (codec.py): a new encoding takes a new prefix.
"""

from __future__ import annotations

import hashlib
import json

from service.repository.table import VersionRoute

KEY_PREFIX = "vs2"
# ModelInfo fields (and an artifact's facts) that do not change an answer.
NOT_IN_FINGERPRINT = frozenset({"max_batch_size", "batch_timeout_ms", "preprocess_reason", "sizing"})
NOT_IN_ARTIFACT_FINGERPRINT = frozenset({"directory", "batch", "validation"})
FINGERPRINT_CHARS = 32  # of the 64 hex digits of a sha256: 128 bits, no collision among models in practice
# Routes are few (one per served version) and live as long as the routing table: the memo is cleared
# when it grows past this, so replaced routes are not kept forever.
MAX_MEMOISED_ROUTES = 64

# id(route) -> (route, fingerprint). VersionRoute is unhashable (a dataclass holding a dict); the route is
# kept beside its fingerprint so that its id cannot be reused by another object while it is memoised.
_fingerprints: dict[int, tuple[VersionRoute, str]] = {}


def answer_identity(model: dict) -> dict:
    """What of a ``ModelInfo`` (``to_dict``) can change an answer: not how it is batched, where its files
    lie, or which GPU of a kind runs it; so replicas that differ only there share entries."""
    identity = {key: value for key, value in model.items() if key not in NOT_IN_FINGERPRINT}
    identity["device"] = str(model.get("device", "")).split(":")[0]  # cuda:1 answers as cuda:0 does
    if isinstance(model.get("artifact"), dict):
        identity["artifact"] = {k: v for k, v in model["artifact"].items() if k not in NOT_IN_ARTIFACT_FINGERPRINT}
    return identity


def model_fingerprint(route: VersionRoute) -> str:
    """A hex digest of what ``route`` serves: its name, version and ``ModelInfo``; memoised per route."""
    memoised = _fingerprints.get(id(route))
    if memoised is not None and memoised[0] is route:
        return memoised[1]
    described = {"name": route.name, "version": route.version, "model": answer_identity(route.model.to_dict())}
    digest = hashlib.sha256(
        json.dumps(described, sort_keys=True, default=str, separators=(",", ":")).encode()
    ).hexdigest()
    if len(_fingerprints) >= MAX_MEMOISED_ROUTES:
        _fingerprints.clear()
    _fingerprints[id(route)] = (route, digest)
    return digest


def cache_key(image: bytes, fingerprint: str, top_k: int) -> str:
    """The key of ``image``'s answer from the model ``fingerprint`` names, with its ``top_k`` labels."""
    return f"{KEY_PREFIX}:{fingerprint[:FINGERPRINT_CHARS]}:{top_k}:{hashlib.sha256(image).hexdigest()}"
