"""Hugging Face Accelerate integration of lightning-incremental.

A thin adapter over :mod:`lightning_incremental.core`; importing it never imports Lightning.
"""

from __future__ import annotations

from lightning_incremental._version import __version__

__all__ = ["__version__"]
