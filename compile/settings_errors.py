"""The error of a setting refused, one way for the three commands (compile-trt, vision-serve, vision-tune).

``SettingsError`` names the setting (the flag, or the env var or config-file key it came from), the
value refused and what to do instead. ``exit_on_settings_error`` turns it into what a usage error is
on the command line: one line on stderr, ``PROG: error: MESSAGE``, and exit status 2.

Here, in compile/, because compile-trt imports nothing of the server while vision-serve and
vision-tune stand on compile/ already (compile/cli_flags.py). Imports nothing but the standard library.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

USAGE_EXIT_STATUS = 2  # argparse's own, for a usage error
# Shown instead of a secret's value (API keys, a Redis URL that may carry a password).
HIDDEN = "(hidden)"

Main = TypeVar("Main", bound=Callable[..., Any])


def shown(value: object) -> str:
    """A value as the messages quote it: strings quoted, numbers as typed."""
    return repr(value) if isinstance(value, str) else str(value)


class SettingsError(ValueError):
    """A setting refused: ``flag`` (``--max-batch-size``; ``VISION_SERVE_PORT`` or a config-file key
    when that is where it came from; several flags, comma-separated, when their combination is refused),
    ``value`` (``HIDDEN`` for a secret; None when the value is missing), ``message`` (what is wrong,
    naming the flag and the value) and ``fix`` (what to do instead; empty only where the message came
    from elsewhere and already says it). ``str()``: the message, then the fix.

    A ValueError still, so that whatever catches ValueError (a load call, pydantic, LitServe) goes on
    catching it."""

    def __init__(self, flag: str, value: object, message: str, fix: str) -> None:
        super().__init__(flag, value, message, fix)  # args: so that it pickles and reprs as made
        self.flag = flag
        self.value = value
        self.message = message
        self.fix = fix

    @classmethod
    def must(cls, flag: str, value: object, rule: str, fix: str) -> SettingsError:
        """The common shape: ``--port must be in 1024..65535, got 80.`` then the fix."""
        return cls(flag, value, f"{flag} must {rule}, got {shown(value)}.", fix)

    @classmethod
    def of(cls, error: Exception) -> SettingsError:
        """``error`` as this class: its fields if it is a SettingsError, else its message alone (for a
        refusal from a layer that does not know the flag, e.g. a model file that does not load)."""
        if isinstance(error, SettingsError):
            return cls(error.flag, error.value, error.message, error.fix)
        return cls("", None, str(error), "")

    def __str__(self) -> str:
        return " ".join(part for part in (self.message, self.fix) if part)

    def with_message(self, message: str, flag: str | None = None) -> SettingsError:
        """The same error (same class, value, fix) with ``message`` instead, and ``flag`` if given: to say
        where it came from."""
        return type(self)(self.flag if flag is None else flag, self.value, message, self.fix)

    def to_dict(self) -> dict[str, object]:
        """Its fields as JSON, to cross to another process (the planner's answer)."""
        value = self.value if isinstance(self.value, (str, int, float, bool, type(None))) else str(self.value)
        return {"flag": self.flag, "value": value, "message": self.message, "fix": self.fix}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SettingsError:
        return cls(data["flag"], data["value"], data["message"], data["fix"])


def one_line(text: str) -> str:
    """``text`` on one line: a usage error is a line of a terminal or of a log, never a block."""
    return " ".join(text.split())


def usage_exit(prog: str, error: Exception | str) -> NoReturn:
    """``PROG: error: MESSAGE`` on stderr (argparse's words for a usage error, without the usage), exit 2."""
    sys.stderr.write(f"{prog}: error: {one_line(str(error))}\n")
    sys.stderr.flush()
    raise SystemExit(USAGE_EXIT_STATUS)


def exit_on_settings_error(prog: str) -> Callable[[Main], Main]:
    """Decorate a command's ``main``: a ``SettingsError`` it raises exits as a usage error (``usage_exit``)."""

    def decorate(main: Main) -> Main:
        @functools.wraps(main)
        def run(*args: Any, **kwargs: Any) -> Any:
            try:
                return main(*args, **kwargs)
            except SettingsError as error:
                usage_exit(prog, error)

        return run  # type: ignore[return-value]

    return decorate
