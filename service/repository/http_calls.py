"""The repository API's calls as the HTTP processes make them (HTTP and gRPC alike): ``RepositoryCalls``
checks the arguments, sends the call to the main process (service/transport/control_channel.py) and
turns its reply into an answer or a ``ServiceError``. Loads run there
(service/supervisor/pool/repository_operations.py)."""

from __future__ import annotations

from service.errors import InvalidInput, error_of_status
from service.repository.layout import RepositoryError, check_model_name
from service.transport.control_channel import INDEX, LOAD, UNLOAD, ControlReply, ControlRequest, call_main_process

# The reply to a load may take the whole load timeout; the rest covers planning and the switch.
REPLY_MARGIN_S = 30.0
REPOSITORY_OFF = (
    "The repository API (index, load, unload) is off: start the server with --model-repository DIR "
    "--model-control explicit --admin-api-key KEY."
)
# Beyond the request deadline: the drain's grace and the stop of a late worker.
DRAIN_MARGIN_S = 15.0
# A load's config override is a model config, not an upload.
MAX_CONFIG_CHARS = 64 * 1024


class RepositoryCalls:
    def __init__(self, channels_directory: str, load_timeout_s: float, request_timeout_s: float) -> None:
        """An unload waits for a drain, which may last a request deadline (and a grace) after it."""
        self.directory = channels_directory
        self.timeout_s = max(load_timeout_s, request_timeout_s + DRAIN_MARGIN_S) + REPLY_MARGIN_S

    async def index(self, ready_only: bool = False) -> list[dict]:
        reply = await self._call(ControlRequest(INDEX, ready_only=ready_only))
        return reply.index

    async def load(self, model: str, config: str = "", files: list[str] | None = None) -> None:
        """``ServiceError`` 400 with the reason when the load fails (the old version still serves)."""
        _check_name(model)
        if files:
            raise InvalidInput(
                f"Loading model files sent with the call ({', '.join(files[:3])}) is not supported: put the "
                "compile-trt artifact in the repository as <name>/<version>/ and load it by name.",
            )
        if len(config) > MAX_CONFIG_CHARS:
            raise InvalidInput(f"parameters.config is longer than {MAX_CONFIG_CHARS:,} characters.")
        await self._call(ControlRequest(LOAD, model, config))

    async def unload(self, model: str) -> None:
        _check_name(model)
        await self._call(ControlRequest(UNLOAD, model))

    async def _call(self, request: ControlRequest) -> ControlReply:
        reply = await call_main_process(self.directory, request, self.timeout_s)
        if reply.status != 200:
            raise error_of_status(reply.status, reply.error)
        return reply


def _check_name(model: str) -> None:
    try:
        check_model_name(model)
    except RepositoryError as exc:
        raise InvalidInput(str(exc)) from None
