"""The chat template of the byte model: how ``/v1/chat/completions`` turns messages into a prompt.

The model's tokens are bytes and it has no special tokens, so the template is plain text. Each
message becomes one line ``<role>: <content>``, in order, and the prompt ends with
``assistant:``; the model's output is the assistant's reply::

    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]

    ->  "system: Be brief.\\nuser: Hi\\nassistant:"

Roles are ``system``, ``developer``, ``user`` and ``assistant``; a content given as text parts is
their texts joined. A content may span lines: the template does not escape it.
"""

from __future__ import annotations

from collections.abc import Sequence

from ._openai_protocol import ChatMessage

__all__ = ["render_chat"]

_REPLY = "assistant:"


def render_chat(messages: Sequence[ChatMessage]) -> str:
    """The prompt for ``messages`` under the byte model's chat template (module docstring).

    Args:
        messages: the chat so far, oldest first.

    Returns:
        The prompt text, ending with ``assistant:``.
    """
    return "".join(f"{message.role}: {message.text()}\n" for message in messages) + _REPLY
