"""Small, never-raising helpers the platform probes share."""
from __future__ import annotations

import ctypes.util
import glob
import importlib.metadata
import importlib.util
import os
from typing import Optional

import torch


def torch_version() -> str:
    return str(torch.__version__)


def module_present(name: str) -> bool:
    """Whether `name` can be imported, without importing it."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def dist_version(*names: str) -> Optional[str]:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def major_minor(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("+")[0].split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def device_nodes(*patterns: str) -> list[str]:
    found: list[str] = []
    for pattern in patterns:
        found.extend(sorted(glob.glob(pattern)))
    return found


def shared_library(name: str) -> Optional[str]:
    try:
        return ctypes.util.find_library(name)
    except Exception:
        return None


def env(name: str) -> Optional[str]:
    return os.environ.get(name)


def exc_text(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")
