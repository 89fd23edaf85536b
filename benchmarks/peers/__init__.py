"""The servers the experiments measure vision-serve against: TorchServe and NVIDIA Triton (PyTriton, in a
virtualenv of its own: triton_env) on the same model, and the front end's no-op peers (LitServe, Triton,
a bare ASGI endpoint)."""
