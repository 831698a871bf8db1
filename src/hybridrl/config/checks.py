"""ConfigError and the two checks every section's __post_init__ uses."""
from __future__ import annotations


class ConfigError(ValueError):
    """A configuration problem; the message names the key and the fix."""


def check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def one_of(key: str, value: str, choices: tuple) -> None:
    check(value in choices, f"{key}={value!r} is not one of {', '.join(choices)}")
