"""The cached value: a 200 ``Answer``'s predictions, model and engine as compact JSON.

Never pickle: a Redis shared by several servers (or reachable by anyone else) must not be able to make
a server run code by what it stores. A value that does not decode to exactly this shape is a miss
(``None``), never an exception: it may come from another version of the server, or from anyone.
"""

from __future__ import annotations

import json
import math

from service.wire import Answer, Prediction

VERSION = 1
# Far above any real value (top_k entries of an index, a label and a float); a larger one is not ours.
MAX_VALUE_BYTES = 1 << 20


def encode(answer: Answer) -> bytes:
    """``answer``'s cached form; only for a 200 with predictions."""
    if answer.status_code != 200 or answer.predictions is None:
        raise ValueError(f"only a 200 answer with predictions is cached, got status {answer.status_code}")
    value = {
        "v": VERSION,
        "m": answer.model,
        "e": answer.engine,
        "p": [[int(index), str(label), float(probability)] for index, label, probability in answer.predictions],
    }
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def decode(value: bytes) -> Answer | None:
    """A new ``Answer`` from ``value`` (its ``timings_ms`` a new dict: callers add to it), or ``None``
    when ``value`` is not a value ``encode`` made."""
    if not isinstance(value, (bytes, bytearray)) or len(value) > MAX_VALUE_BYTES:
        return None
    try:
        parsed = json.loads(value)
    except (ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return None
    if not isinstance(parsed, dict) or parsed.get("v") != VERSION:
        return None
    model, engine, listed = parsed.get("m"), parsed.get("e"), parsed.get("p")
    if not isinstance(model, str) or not isinstance(engine, str) or not isinstance(listed, list):
        return None
    predictions = [_prediction(item) for item in listed]
    if any(prediction is None for prediction in predictions):
        return None
    return Answer(200, predictions=tuple(predictions), model=model, engine=engine, batch_size=0, timings_ms={})


def _prediction(item: object) -> Prediction | None:
    if not isinstance(item, list) or len(item) != 3:
        return None
    index, label, probability = item
    if type(index) is not int or not isinstance(label, str):  # bool is an int: not an index
        return None
    if type(probability) not in (int, float) or not math.isfinite(probability):
        return None
    return index, label, float(probability)
