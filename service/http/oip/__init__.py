"""The Open Inference Protocol (KServe v2, Triton) in each HTTP process: its tensors and the infer
call both transports share (tensors.py, infer.py), its HTTP/REST routes (routes.py) and Triton's
repository extension over HTTP (repository_routes.py)."""
