"""The two ways a tune ends early: settings that do not fit (a usage error), or a tune without an answer."""

from __future__ import annotations

from compile.settings_errors import SettingsError


class TuneSetupError(SettingsError):
    """The settings do not fit this machine or the work folder: what to change (a usage error, as
    every ``SettingsError``)."""


class TuneFailed(RuntimeError):
    """The tune ended without an answer; the message says why and what to change."""
