"""The ids Sluice answers with, minted here alone: a prefix per kind of object (OpenAI's and
Anthropic's spelling), then a random hex part of its own."""

from __future__ import annotations

import uuid

PREFIXES: dict[str, str] = {
    "chat": "chatcmpl-",  # a chat completion (and its chunks)
    "completion": "cmpl-",  # a text completion
    "response": "resp_",  # the Responses API's
    "message": "msg_",  # Anthropic's Messages API's, and a conversation's message items
    "function_call": "fc_",  # a conversation's items (OpenAI's Conversations API)
    "function_call_output": "fco_",
    "reasoning": "rs_",
    "conversation": "conv_",
    "batch": "batch_",
    "batch_request": "batch_req_",  # one line's answer in a batch's output
    "file": "file-",
}

_LONGEST_FIRST = sorted(PREFIXES.values(), key=len, reverse=True)


def own_id() -> str:
    """A new id's own part: what follows its prefix."""
    return uuid.uuid4().hex


def public_id(kind: str, own: str) -> str:
    """The id of `kind` whose own part is `own`."""
    return PREFIXES[kind] + own


def new_id(kind: str) -> str:
    """A new id of `kind`."""
    return public_id(kind, own_id())


def own_part(public: str) -> str:
    """What follows a public id's prefix."""
    for prefix in _LONGEST_FIRST:  # ("batch_req_" before "batch_")
        if public.startswith(prefix):
            return public[len(prefix) :]
    return public
