"""Can this machine serve an artifact? Device type, device capability, library versions, and files that
stay within the artifact."""

from __future__ import annotations

from pathlib import Path

from compile import _defaults
from compile.backends import BACKENDS
from compile.devices import cpu_capability_runs_here, cpu_isa_runs_here
from compile.manifest import Manifest
from compile.settings_errors import SettingsError
from compile.versions import major_minor

RECOMPILE = "Compile it again with compile-trt; an artifact is served as compile-trt wrote it."


def version_problems(manifest: Manifest, versions_here: dict[str, str]) -> list[str]:
    """Libraries the engine needs at the version it was compiled with (major.minor, or exactly), where they differ."""
    backend = BACKENDS.get(manifest.backend)
    if backend is None:
        return [f"the artifact's backend {manifest.backend!r} is unknown to this vision-serve; recompile it."]
    problems = []
    for library in backend.runtime_libraries:
        built = manifest.versions.get(library)
        here = versions_here.get(library)
        if built is None:
            continue
        if here is None:
            hint = f" {backend.install_hint}" if backend.install_hint else ""
            problems.append(f"it needs {library} {built}, which is not installed here.{hint}")
            continue
        exact = library in backend.exact_version_libraries
        if (built != here) if exact else (major_minor(built) != major_minor(here)):
            required = built if exact else "{}.{}.x".format(*major_minor(built))
            problems.append(
                f"it was compiled with {library} {built} and this environment has {here}; "
                f"{manifest.backend} engines only load under {library} {required}. Recompile it here with compile-trt."
            )
    return problems


def device_problems(manifest: Manifest, device_type: str, device_info: dict[str, str] | None = None) -> list[str]:
    """Problems serving ``manifest`` on a ``device_type`` device (described by ``device_info`` if known)."""
    if manifest.device_type != device_type:
        return [
            f"it was compiled for {manifest.device_type} and the server runs on {device_type}. "
            f"Serve it with --device {manifest.device_type} (or auto), or compile one for {device_type} "
            f"with compile-trt --device {device_type}."
        ]
    if device_info is None:
        return []
    backend = BACKENDS.get(manifest.backend)
    if backend is not None and not backend.native_code:
        return []  # weights or a portable graph: the runtime picks its kernels for the device it runs on
    built, here = manifest.device_capability, device_info.get("capability", "")
    if device_type == "cpu":
        isa_built, isa_here = manifest.device_isa, device_info.get("isa", "")
        if not cpu_capability_runs_here(built, here) or not cpu_isa_runs_here(isa_built, isa_here):
            return [
                f"its CPU code uses {built} ({isa_built}) instructions and this CPU offers {here} ({isa_here}). "
                "Recompile it on this machine."
            ]
    if device_type == "cuda" and built != here:
        return [
            f"it was compiled for {manifest.device_name} ({built}) and this GPU is {device_info.get('name')} "
            f"({here}); GPU engines are built for one architecture. Recompile it on this GPU."
        ]
    return []


def describe_problems(directory: str, problems: list[str]) -> str:
    return f"Cannot serve the artifact {directory}: " + " ".join(problems)


def check_artifact_files(manifest: Manifest, directory: str | Path) -> None:
    """``SettingsError`` where loading the artifact would read outside its folder or reach the Hub: an
    ONNX engine's external data elsewhere, or a timm architecture with a source (docs/security.md).
    An artifact is compile-trt's output; these are the parts of it a hand-edited one could point away."""
    directory = Path(directory)
    if manifest.backend == "onnx":
        import onnx

        from compile.onnx_external_data import check_external_data

        engine = directory / manifest.engine_file
        try:
            model = onnx.load(str(engine), load_external_data=False)
        except Exception as exc:  # protobuf's DecodeError, OSError
            raise SettingsError(
                "--artifact", str(directory), f"Could not read {engine} as an ONNX model ({str(exc)[:200]}).", RECOMPILE
            ) from None
        check_external_data(model, engine, "--artifact")
    if manifest.model_family == "timm":
        from compile.timm_support import check_timm_architecture

        name = manifest.model.removeprefix(_defaults.TIMM_PREFIX)
        check_timm_architecture(name, str(directory / _defaults.MANIFEST_FILE), str(directory))
