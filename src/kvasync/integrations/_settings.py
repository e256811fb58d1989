"""An engine plugin's settings (vLLM's, SGLang's), read from the environment of the engine's
process: the same ``KVASYNC_*`` variables for every engine, and one switch per engine."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from .._share_names import check_share
from .._sizes import parse_size

__all__ = ["PluginSettings", "read_settings"]

# Each variable the plugin reads; an unknown KVASYNC_* variable is not an error (the core and
# other integrations read their own).
ENABLE = "KVASYNC_VLLM"  # vLLM's switch (the default)
SGLANG_ENABLE = "KVASYNC_SGLANG"
SHARE = "KVASYNC_SHARE"
DEVICE_BUDGET = "KVASYNC_DEVICE_BUDGET"
MEMORY_LIMIT = "KVASYNC_MEMORY_LIMIT"
NAME = "KVASYNC_NAME"
PREFIX_CACHE = "KVASYNC_PREFIX_CACHE"
HOST_POOL = "KVASYNC_VLLM_HOST_POOL"
LINGER = "KVASYNC_LINGER"


@dataclass(frozen=True)
class PluginSettings:
    """What the environment asks of the plugin.

    Args:
        enabled: whether the plugin changes vLLM at all.
        share: the kvasync device share to join (``kvasync top`` shows the engine there).
        device_budget: bytes all engines of the share may map together.
        memory_limit: bytes this engine may map.
        name: the engine's name in the share's ledger.
        prefix_cache_bytes: bytes of freed blocks that keep their prefix-cache entry while they
            stay mapped; None = all that the budget allows (vLLM's own behaviour).
        host_pool: the scheduler's pool opens its own host-backend allocator when no worker
            registered one (vLLM's scheduler tests, which run with no worker).
        linger: seconds the KV pages in use at a recent peak stay mapped after use falls
            (``Config.linger``; ``KVASYNC_LINGER``, e.g. ``2`` or ``2s``); 0 = none.
    """

    enabled: bool
    share: str | None = None
    device_budget: int | None = None
    memory_limit: int | None = None
    name: str | None = None
    prefix_cache_bytes: int | None = None
    host_pool: bool = False
    linger: float = 0.0

    @property
    def capacity_bytes(self) -> int:
        """The KV bytes the engine's virtual range holds: the memory limit, else the budget.

        Raises:
            ValueError: neither is set.
        """
        for value in (self.memory_limit, self.device_budget):
            if value is not None:
                return value
        raise ValueError(
            f"kvasync's engine plugin needs {MEMORY_LIMIT} or {DEVICE_BUDGET} (with {SHARE}) to "
            "size the KV cache, e.g. KVASYNC_MEMORY_LIMIT=12GiB"
        )


def _flag(value: str, name: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"{name} must be 1 or 0, got {value!r}")


def _size(env: Mapping[str, str], name: str) -> int | None:
    text = env.get(name)
    if text is None or not text.strip():
        return None
    try:
        return parse_size(text)
    except ValueError as error:
        raise ValueError(f"{name}: {error}") from None


def _seconds(env: Mapping[str, str], name: str) -> float:
    text = env.get(name, "").strip()
    if not text:
        return 0.0
    number = text[:-1] if text.endswith("s") else text
    try:
        value = float(number)
    except ValueError:
        raise ValueError(
            f"{name} must be a number of seconds (e.g. 2 or 2s), got {text!r}"
        ) from None
    if not 0.0 <= value <= 86400.0:  # NaN fails too
        raise ValueError(f"{name} must be between 0 and 86400 seconds, got {text!r}")
    return value


def read_settings(env: Mapping[str, str] | None = None, *, switch: str = ENABLE) -> PluginSettings:
    """The settings in ``env`` (``os.environ`` when None).

    The plugin is enabled by its ``switch`` (``KVASYNC_VLLM=1``, ``KVASYNC_SGLANG=1``), or by
    setting any of ``KVASYNC_SHARE``, ``KVASYNC_DEVICE_BUDGET`` or ``KVASYNC_MEMORY_LIMIT``; the
    switch at 0 disables it whatever else is set (the entry points are installed with kvasync, so
    they must be inert by default).

    Raises:
        ValueError: a malformed value, naming the variable.
    """
    env = os.environ if env is None else env
    share = env.get(SHARE) or None
    if share is not None:
        check_share(share, SHARE)
    budget = _size(env, DEVICE_BUDGET)
    if budget is not None and share is None:
        raise ValueError(f"{DEVICE_BUDGET} needs {SHARE} (the share it budgets)")
    limit = _size(env, MEMORY_LIMIT)
    asked = share is not None or budget is not None or limit is not None
    value = env.get(switch)
    enabled = asked if value is None else _flag(value, switch)
    prefix = env.get(PREFIX_CACHE)
    prefix_bytes: int | None = None
    if prefix is not None and prefix.strip().lower() not in ("", "all"):
        prefix_bytes = 0 if prefix.strip() == "0" else _size(env, PREFIX_CACHE)
    return PluginSettings(
        enabled=enabled,
        share=share,
        device_budget=budget,
        memory_limit=limit,
        name=env.get(NAME) or None,
        prefix_cache_bytes=prefix_bytes,
        host_pool=_flag(env.get(HOST_POOL, "0"), HOST_POOL),
        linger=_seconds(env, LINGER),
    )
