"""The Open Inference Protocol (KServe v2, Triton), in each HTTP process: its tensors, the infer call
shared by both transports, the HTTP/REST routes and the gRPC service."""
