"""The errors a request of the serving engine can end with.

Bad input (an empty prompt, a prompt longer than the model allows, a bad max_tokens) is a plain
``ValueError`` raised at submission: nothing is queued then.
"""

from __future__ import annotations

from .._errors import KVAsyncError

__all__ = ["DeadlineExceeded", "EngineClosed", "RequestFailed"]


class RequestFailed(KVAsyncError):
    """A request ended without finishing; the message says why (its KV cache can never fit the
    memory limit, the allocator failed, ...)."""


class DeadlineExceeded(RequestFailed, TimeoutError):
    """The request's deadline passed while it waited for admission or while it ran."""


class EngineClosed(RequestFailed):
    """The engine was closed before the request finished (or it was submitted after)."""
