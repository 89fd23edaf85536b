"""The guard of each HTTP connection, inside uvicorn: every use of uvicorn's internals is in this
package, checked against the versions it was written for (uvicorn_version.py).

Limits on each HTTP connection that uvicorn does not set: how long a request's headers and body may
take to arrive, how large its headers may be, how much one connection may have parsed and waiting,
and how a chunked body may be framed. Runs in each HTTP process, inside uvicorn.

uvicorn (with httptools) accepts headers of any size and number and waits for them, and for a body,
forever; its only timer closes idle kept-alive connections. A server without a proxy in front would
be held by slow or idle sockets and grown by huge headers. ``guarded_http_protocol`` is uvicorn's
httptools protocol with:

- a deadline for each request's headers, from the connection's opening or the request's first byte
  (``--header-timeout-s``): past it, 408 and the connection closes;
- a cap on the bytes of a request's headers (``--max-header-bytes``) and on their number
  (``MAX_HEADER_FIELDS``), for every request, pipelined ones too: past it, 431 and close;
- a deadline for the body, from the end of the headers (``--body-timeout-s``): past it, 408 and
  close (neither deadline runs while the server itself does not read the connection). The route
  reading the body then sees the connection gone and counts the request by the refusal's status
  (service/http/base/limits.py);
- a chunked body framed to cost the server per byte what a plain one does: chunks of at least
  ``MIN_MEAN_CHUNK_BYTES`` on average once there are more than ``FREE_CHUNKS``, and framing (chunk
  sizes, extensions) within ``FRAMING_ALLOWANCE_BYTES`` plus ``FRAMING_BYTES_PER_CHUNK`` a chunk:
  else 400 and close;
- pipelining bounded without refusing it: while a request runs, the connection reads on only until
  one more request is parsed (the rest waits in the socket, as in uvicorn itself), and at most
  ``MAX_PIPELINED`` requests parsed from what was already read wait behind it. The rest of that read
  is held unparsed (one read: ``MAX_HELD_BYTES`` at most) and fed to the parser as the requests
  ahead are answered, so every pipelined request is answered, in order, at a bounded cost;
- a ``Departure`` in each request's scope, told when the connection is lost before that request's
  answer is complete: the request running and those parsed behind it alike, so that work for a
  client that left is dropped (service/http/base/request_scope.py). A connection whose reading is paused
  (a request parsed behind the running one) does not see the client close, so the sweep asks the
  kernel whether the peer hung up (``POLLRDHUP``).

One sweep per process every ``SWEEP_INTERVAL_S`` (sweep.py) checks the deadlines of every open connection, so
a request pays for a few clock reads, not for timers of its own.

The modules: refusals.py (the limits and what the guard answers), pipelining.py (``PipelineHold``:
how many requests a connection may have parsed and held), guard.py (``GuardedHttpToolsProtocol``
and ``guarded_http_protocol``), sweep.py.

It subclasses uvicorn's non-public ``HttpToolsProtocol`` and reads its ``cycle``, ``connections``,
``transport``, ``loop``, ``flow`` and ``pipeline``: its first import checks the installed uvicorn against the
range pyproject.toml pins, and tests/unit/test_uvicorn_bridge.py holds a contract test per internal
used, so an upgrade that moves one fails there, by name.
"""
