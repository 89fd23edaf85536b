"""Each HTTP process: its channel to the workers, its routes and its gRPC server (process.py,
routes.py), over one shared base (base/) and a folder per protocol: ``/predict`` and the upload page
(predict/), the Open Inference Protocol over HTTP (oip/), and over gRPC (grpc/). Imports run one way:
base <- predict, oip <- grpc <- routes, process."""
