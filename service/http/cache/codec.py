"""The cached value: a 200 ``Answer``'s class indices and probabilities, as compact JSON.

A value read back is untrusted input: a Redis shared by several servers (or reachable by anyone
else) may hold anything, and a value may come from another version of the server. So it is never
pickle (reading it must not run code), it holds only what the model's own facts cannot give (the
labels, model name and engine come from the route that answers: a planted label cannot be served),
and ``decode`` checks it against the model and the request: exactly as many predictions as ``top_k``
asks of this model, each a distinct class index of the model, scores finite, in descending order and,
for a model answering probabilities (softmax, sigmoid: its ``activation``), in [0, 1]; raw logits
(``none``) may be any finite number. Anything else, and any exception on the way, is a miss (``None``), never an error.
"""

from __future__ import annotations

import json
import math

from service.model_info import ModelInfo
from service.wire import Answer, Prediction

VERSION = 2
# Far above any real value (top_k <= 1,000 pairs of an index and a float); a larger one is not ours.
MAX_VALUE_BYTES = 64 * 1024


def encode(answer: Answer) -> bytes:
    """``answer``'s cached form; only for a 200 with predictions."""
    if answer.status_code != 200 or answer.predictions is None:
        raise ValueError(f"only a 200 answer with predictions is cached, got status {answer.status_code}")
    value = {"v": VERSION, "p": [[int(index), float(probability)] for index, _, probability in answer.predictions]}
    return json.dumps(value, separators=(",", ":")).encode()


def decode(value: object, model: ModelInfo, top_k: int) -> Answer | None:
    """A new ``Answer`` (its ``timings_ms`` a new dict: callers add to it) from ``value`` for ``model``
    asked for ``top_k`` labels, or ``None`` when ``value`` is not what ``encode`` makes for them."""
    try:
        predictions = _predictions(value, model.labels, top_k, model.activation != "none")
    except Exception:  # whatever an untrusted value makes the checks raise, it is a miss
        return None
    if predictions is None:
        return None
    return Answer(200, predictions=predictions, model=model.model, engine=model.engine, batch_size=0, timings_ms={})


def _predictions(
    value: object, labels: tuple[str, ...], top_k: int, probabilities: bool = True
) -> tuple[Prediction, ...] | None:
    if not isinstance(value, (bytes, bytearray)) or len(value) > MAX_VALUE_BYTES or not labels:
        return None
    parsed = json.loads(value)
    if not isinstance(parsed, dict) or parsed.keys() != {"v", "p"} or parsed["v"] != VERSION:
        return None
    listed = parsed["p"]
    if not isinstance(listed, list) or len(listed) != min(top_k, len(labels)):
        return None
    predictions, seen, previous = [], set(), 1.0 if probabilities else math.inf
    for item in listed:
        if not isinstance(item, list) or len(item) != 2:
            return None
        index, probability = item
        if type(index) is not int or not 0 <= index < len(labels) or index in seen:  # bool is an int: not an index
            return None
        if type(probability) not in (int, float):
            return None
        probability = float(probability)  # OverflowError for a huge integer: a miss like the rest
        if not math.isfinite(probability) or probability > previous or (probabilities and probability < 0.0):
            return None
        seen.add(index)
        previous = probability
        predictions.append((index, labels[index], probability))
    return tuple(predictions)
