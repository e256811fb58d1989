"""The errors a request of the serving engine can end with.

Bad input (an empty prompt, a prompt longer than the model allows, a bad max_tokens or sampling
parameter) is a plain ``ValueError`` raised at submission: nothing is queued then. A request whose
KV can never fit the cache is refused at submission too, with ``RequestTooLarge`` (a
``ValueError``, so an HTTP server answers 400).
"""

from __future__ import annotations

from .._errors import KVAsyncError

__all__ = ["DeadlineExceeded", "EngineClosed", "RequestFailed", "RequestTooLarge"]


class RequestFailed(KVAsyncError):
    """A request ended without finishing; the message says why (its KV cache can never fit the
    memory limit, the allocator failed, ...)."""


class DeadlineExceeded(RequestFailed, TimeoutError):
    """The request's deadline passed while it waited for admission or while it ran."""


class EngineClosed(RequestFailed):
    """The engine was closed before the request finished (or it was submitted after)."""


class RequestTooLarge(RequestFailed, ValueError):
    """The request's prompt plus ``max_tokens`` needs more KV blocks than the cache can ever hold
    (its capacity, its memory limit, its share's budget): refused at submission, nothing queued.
    Bad input, so a ``ValueError`` too; a ``RequestFailed`` as a request that outgrows a limit
    lowered while it runs is."""
