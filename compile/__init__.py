"""The compile stage and what it stands on, a module each:

- the model catalog (catalog.py) and the models' weights (weights.py);
- compile-trt: its flags and settings (cli.py, cli_flags.py, settings.py; settings_errors.py, the
  refusal of a setting that all three commands share), its stages (build.py,
  progress.py), the engine builders (backends/, libstdcxx.py), the accuracy gate (gate.py, on the
  photos of sample_photos.py);
- where loaded engines are unpacked (unpacking.py);
- the artifact: its manifest (manifest.py) and whether this machine can serve it (compat.py), judged
  by the device (devices.py) and the library versions (versions.py).
"""
