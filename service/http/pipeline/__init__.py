"""One request's way through an HTTP process, the same for ``POST /predict``, the Open Inference
Protocol over HTTP and gRPC. ``RequestPipeline.run`` (pipeline.py) is the one owner that calls the
steps in order; each step calls down and never back:

1. route: the model version asked for, 404 before the upload (base/worker_watch.py's routing table);
2. parse: the protocol's own, within the limits (base/limits.py; predict/parsing.py, oip/routes.py,
   grpc/service.py); the route is resolved again once the body is in;
3. check: each image's header (checks.py), refused before any lookup or queue slot; the protocol's
   rule says whether one refusal fails the whole request (``Ask.on_refused``, ask.py);
4. look up the cache (cache/front.py): hits are answered here; the route is checked once more;
5. admit: the server-wide bound on queued images (base/admission.py): 413, or 503 with Retry-After;
6. submit: to the version's ready workers, waiting by one deadline, dropped if the client leaves
   (submit.py); the misses' answers are kept in the cache (cache/front.py);
7. answer: the protocol renders the ``Outcome`` (predict/render.py, oip/routes.py, grpc/service.py).
"""
