"""The Open Inference Protocol over gRPC, in each HTTP process: the servicer over the infer call and
tensors of service/http/oip/."""
