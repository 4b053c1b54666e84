"""Keeping ``storage_options`` out of messages: every string value in them is a secret.

Credentials hide under many names (``key``, ``aws_session_token``, an endpoint with a password
in it), so no value of the options may appear in an error message, log record or stored object.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

SECRET_MIN_LEN = 4  # shorter option values ("s3", "us") are not worth redacting from text


def secret_strings(options: Mapping[str, Any], where: str = "storage_options") -> dict[str, str]:
    """Every string value in ``options`` (nested dicts and lists included), mapped to the
    placeholder that replaces it in messages: ``<storage_options.secret>``. Every value is
    treated as a secret — credentials hide under many names (``key``, ``aws_session_token``,
    an endpoint with a password in it)."""
    found: dict[str, str] = {}

    def walk(value: Any, label: str) -> None:
        if isinstance(value, str):
            if len(value) >= SECRET_MIN_LEN:
                found.setdefault(value, f"<{label}>")
        elif isinstance(value, Mapping):
            for key, item in value.items():
                walk(item, f"{label}.{key}")
        elif isinstance(value, (list, tuple, set, frozenset)):
            for item in value:
                walk(item, label)

    walk(options, where)
    return found


def redact(text: str, secrets: Mapping[str, str]) -> str:
    """``text`` with every value of ``secrets`` (from :func:`secret_strings`) replaced by its
    placeholder, longest first so that a value containing another is replaced whole."""
    for value in sorted(secrets, key=len, reverse=True):
        text = text.replace(value, secrets[value])
    return text
