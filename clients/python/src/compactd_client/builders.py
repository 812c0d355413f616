"""Short constructors for the protobuf messages a host sends.

Every function returns a plain generated message (``pb.Part``, ``pb.MessageInfo``, ...),
so anything they do not cover can be set on the result or built with ``pb`` directly.
Timestamps are epoch milliseconds; the ones left out default to now, since compactd's
cache scheduler reads the host's timestamps.
"""

from __future__ import annotations

import time
from typing import Any, Iterable, Mapping, Optional, Union

from google.protobuf import struct_pb2

from . import pb

__all__ = [
    "now_ms",
    "to_struct",
    "limits",
    "model_ref",
    "session_config",
    "session_info",
    "tokens",
    "tokens_from_openai",
    "user_message",
    "assistant_message",
    "text_part",
    "reasoning_part",
    "tool_part",
    "step_start_part",
    "step_finish_part",
]

_STRING_LISTS = ("protected_tools", "strategy_protected_tools", "protected_file_globs", "snapshot_tools")
_CACHE_COUNTING = {
    "separate": pb.CACHE_COUNTING_SEPARATE,
    "included": pb.CACHE_COUNTING_INCLUDED,
}
_PRESETS = {
    "compactd": pb.OVERFLOW_PRESET_COMPACTD,
    "opencode": pb.OVERFLOW_PRESET_OPENCODE,
}

Config = Union[pb.SessionConfig, Mapping[str, Any], None]


def now_ms() -> int:
    """The current time in epoch milliseconds."""
    return int(time.time() * 1000)


def to_struct(value: Optional[Mapping[str, Any]]) -> struct_pb2.Struct:
    """A ``google.protobuf.Struct`` from a JSON-like dict (``None`` gives an empty one)."""
    s = struct_pb2.Struct()
    if value:
        s.update(dict(value))
    return s


def limits(context: int, output: int = 0, input: int = 0) -> pb.ModelLimits:
    """The model's limits in tokens: its window, output limit and (optional) input limit."""
    return pb.ModelLimits(context=context, output=output, input=input)


def model_ref(provider_id: str, model_id: str) -> pb.ModelRef:
    """The model a session talks to (``model_id`` picks the ``auto`` tokenizer)."""
    return pb.ModelRef(provider_id=provider_id, model_id=model_id)


def session_config(config: Config = None, **fields: Any) -> pb.SessionConfig:
    """A ``pb.SessionConfig`` from keyword fields (or a dict, or an existing message).

    Plain Python values are accepted where the proto wraps them: lists for the
    ``StringList`` fields (``protected_tools=["skill"]``), a dict for ``strategies``, and
    ``"separate"``/``"included"`` for ``cache_counting``, ``"compactd"``/``"opencode"``
    for ``preset``. Unknown names raise ``ValueError``.
    """
    if isinstance(config, pb.SessionConfig):
        out = pb.SessionConfig()
        out.CopyFrom(config)
        if not fields:
            return out
    else:
        out = pb.SessionConfig()
        fields = {**dict(config or {}), **fields}
    for name, value in fields.items():
        if value is None:
            continue
        if name not in pb.SessionConfig.DESCRIPTOR.fields_by_name:
            raise ValueError(f"SessionConfig has no field {name!r}")
        if name in _STRING_LISTS:
            getattr(out, name).values[:] = list(value)
        elif name == "strategies":
            out.strategies.update({str(k): bool(v) for k, v in dict(value).items()})
        elif name == "cache_counting" and isinstance(value, str):
            out.cache_counting = _CACHE_COUNTING[value.lower()]
        elif name == "preset" and isinstance(value, str):
            out.preset = _PRESETS[value.lower()]
        else:
            setattr(out, name, value)
    return out


def session_info(
    id: str,
    *,
    title: str = "",
    model: Optional[pb.ModelRef] = None,
    limits: Optional[pb.ModelLimits] = None,
    config: Config = None,
    todos: Iterable[pb.Todo] = (),
) -> pb.SessionInfo:
    """A session's info: id, title, model, limits, per-session config and todos."""
    info = pb.SessionInfo(id=id, title=title, todos=list(todos))
    if model is not None:
        info.model.CopyFrom(model)
    if limits is not None:
        info.limits.CopyFrom(limits)
    if config is not None:
        info.config.CopyFrom(session_config(config))
    return info


def tokens(
    input: int = 0,
    output: int = 0,
    *,
    reasoning: int = 0,
    cache_read: int = 0,
    cache_write: int = 0,
    total: Optional[int] = None,
) -> pb.TokenUsage:
    """Token usage as OpenCode stores it: ``input`` excludes cache reads by default."""
    t = pb.TokenUsage(
        input=input,
        output=output,
        reasoning=reasoning,
        cache=pb.CacheTokens(read=cache_read, write=cache_write),
    )
    if total is not None:
        t.total = total
    return t


def tokens_from_openai(usage: Mapping[str, Any]) -> pb.TokenUsage:
    """Converts an OpenAI chat-completions ``usage`` object to ``pb.TokenUsage``.

    OpenAI's ``prompt_tokens`` include the cached ones
    (``prompt_tokens_details.cached_tokens``); they are split out so the session's default
    ``cache_counting`` (separate) adds them back once. ``total_tokens`` becomes ``total``.
    """
    prompt = int(usage.get("prompt_tokens") or 0)
    completion = int(usage.get("completion_tokens") or 0)
    cached = int(((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0)
    reasoning = int(((usage.get("completion_tokens_details") or {}).get("reasoning_tokens")) or 0)
    total = usage.get("total_tokens")
    return tokens(
        input=max(prompt - cached, 0),
        output=completion,
        reasoning=reasoning,
        cache_read=cached,
        total=int(total) if total is not None else None,
    )


def user_message(id: str, *, created: Optional[int] = None, agent: str = "") -> pb.MessageInfo:
    """A user message's info (its text goes in a :func:`text_part`)."""
    return pb.MessageInfo(
        id=id, role="user", agent=agent, time=pb.MessageTime(created=created or now_ms())
    )


def assistant_message(
    id: str,
    parent_id: str,
    *,
    finish: str = "",
    tokens: Optional[pb.TokenUsage] = None,
    created: Optional[int] = None,
    completed: Optional[int] = None,
    model: Optional[pb.ModelRef] = None,
    cost: float = 0.0,
) -> pb.MessageInfo:
    """An assistant message's info.

    Send it once when the reply starts (no ``finish``), and again with ``finish``
    (``"stop"``, ``"tool-calls"``) and ``tokens`` when it ends: a finished assistant message
    is what triggers compactd's automatic prune and overflow check. ``completed`` defaults
    to now when ``finish`` is given.
    """
    info = pb.MessageInfo(
        id=id,
        role="assistant",
        parent_id=parent_id,
        finish=finish,
        cost=cost,
        time=pb.MessageTime(created=created or now_ms()),
    )
    if finish:
        info.time.completed = completed or now_ms()
    elif completed is not None:
        info.time.completed = completed
    if tokens is not None:
        info.tokens.CopyFrom(tokens)
    if model is not None:
        info.model.CopyFrom(model)
    return info


def text_part(message_id: str, id: str, text: str, *, synthetic: bool = False) -> pb.Part:
    """A text part of a user or assistant message."""
    return pb.Part(id=id, message_id=message_id, text=pb.TextPart(text=text, synthetic=synthetic))


def reasoning_part(message_id: str, id: str, text: str) -> pb.Part:
    """A reasoning part of an assistant message."""
    return pb.Part(id=id, message_id=message_id, reasoning=pb.ReasoningPart(text=text))


def tool_part(
    message_id: str,
    id: str,
    *,
    call_id: str,
    tool: str,
    status: str = "completed",
    input: Optional[Mapping[str, Any]] = None,
    output: str = "",
    error: str = "",
    title: str = "",
    start: Optional[int] = None,
    end: Optional[int] = None,
) -> pb.Part:
    """A tool call of an assistant message.

    ``status`` is ``"pending"``, ``"running"``, ``"completed"`` or ``"error"``; upsert the
    same ``id`` again as the call progresses (running, then completed with its
    ``output``). ``end`` defaults to now for a completed or failed call.
    """
    state = pb.ToolState(status=status, output=output, error=error, title=title)
    state.input.CopyFrom(to_struct(input))
    state.time.start = start or now_ms()
    if status in ("completed", "error"):
        state.time.end = end or now_ms()
    elif end is not None:
        state.time.end = end
    return pb.Part(
        id=id, message_id=message_id, tool=pb.ToolPart(call_id=call_id, tool=tool, state=state)
    )


def step_start_part(message_id: str, id: str) -> pb.Part:
    """Marks the start of a model request (step) inside an assistant message."""
    return pb.Part(id=id, message_id=message_id, step_start=pb.StepStartPart())


def step_finish_part(
    message_id: str, id: str, *, reason: str = "", tokens: Optional[pb.TokenUsage] = None
) -> pb.Part:
    """Marks the end of a step, with its finish reason and usage."""
    p = pb.Part(id=id, message_id=message_id, step_finish=pb.StepFinishPart(reason=reason))
    if tokens is not None:
        p.step_finish.tokens.CopyFrom(tokens)
    return p
