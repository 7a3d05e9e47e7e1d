"""How chat messages become a llama.cpp prompt, by a deployment's ``chat_format``:
``base`` (the default) for a pretrained model such as the shipped gemma-3-270m, a
few-shot question-and-answer frame whose answer ends at the next question or a blank
line (:func:`base_prompt`); or one of llama-cpp-python's chat templates (``gemma``,
``chatml``, …) for an instruction-tuned model (:func:`chat_format`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return ""


def chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Messages as the chat template takes them: text content only; system messages
    (which Gemma's template has no place for) are folded into the next user turn."""
    out: list[dict[str, str]] = []
    pending_system: list[str] = []
    for m in messages:
        role = m.get("role")
        text = _text_of(m.get("content"))
        if role in ("system", "developer"):
            pending_system.append(text)
            continue
        if role == "user" and pending_system:
            text = "\n\n".join([*pending_system, text])
            pending_system = []
        out.append({"role": "assistant" if role == "assistant" else "user", "content": text})
    if pending_system:
        out.append({"role": "user", "content": "\n\n".join(pending_system)})
    return out


BASE_FORMAT = "base"
"""The ``chat_format`` for a pretrained (base) model: a few-shot question-and-answer
frame (:func:`base_prompt`) that ends at :data:`BASE_STOPS`."""

BASE_SHOTS = (
    ("What is the capital of Spain?", "The capital of Spain is Madrid."),
    ("How many hours are there in a day?", "There are 24 hours in a day."),
    ('Translate the word "good night" into German.', '"Good night" in German is "Gute Nacht".'),
    ("Name a fruit that is yellow.", "A banana is a yellow fruit."),
)
"""The worked examples that open every base-format prompt: a base model continues
text, so it answers a question in the manner of the answers before it."""

BASE_STOPS = ("\nQ:", "\n\n")
"""Where a base-format answer ends: the model starting the next question, or a blank line."""


def base_prompt(messages: list[dict[str, Any]]) -> str:
    """Chat messages as a base model's few-shot prompt: the :data:`BASE_SHOTS`, then the
    conversation (system text as a paragraph, user turns as ``Q:``, assistant turns as
    ``A:``), ending with an open ``A:`` for the model to complete. The examples come first
    so that every prompt shares them as a prefix (llama.cpp reuses its evaluation)."""
    parts = [f"Q: {q}\nA: {a}" for q, a in BASE_SHOTS]
    asked = False  # the last part is a question without its answer
    for m in messages:
        role, text = m.get("role"), _text_of(m.get("content")).strip()
        if role == "assistant" and asked:
            parts[-1] += f"\nA: {text}"
        elif role == "assistant":
            parts.append(f"A: {text}")
        elif role in ("system", "developer"):
            parts.append(text)
        else:
            parts.append(f"Q: {text}")
        asked = role not in ("assistant", "system", "developer")
    if asked:
        parts[-1] += "\nA:"
    else:
        parts.append("A:")
    return "\n\n".join(parts)


class ChatFormat(NamedTuple):
    """How chat messages become the prompt, and where the answer ends."""

    render: Callable[[list[dict[str, Any]]], str]
    stop: tuple[str, ...]
    """Strings the answer ends at (besides the request's own); one that is a single
    special token (``<end_of_turn>``) also stops on that token."""
    strip_lead: bool = False
    """Drop the whitespace the answer starts with (the space after ``A:``)."""


def chat_format(name: str) -> ChatFormat:
    """The chat format ``name``: :data:`BASE_FORMAT`, or one of llama-cpp-python's
    (``gemma``, ``chatml``, ``llama-3``, ``mistral-instruct``, …) for an
    instruction-tuned model; an unknown name raises ``ValueError`` listing the known ones."""
    if name == BASE_FORMAT:
        return ChatFormat(base_prompt, BASE_STOPS, strip_lead=True)
    from llama_cpp import llama_chat_format

    handler = getattr(llama_chat_format, "format_" + name.replace("-", "_"), None) or getattr(
        llama_chat_format, "format_" + name.replace("-", ""), None
    )  # "llama-3": format_llama3
    if handler is None:
        known = sorted(n.removeprefix("format_") for n in dir(llama_chat_format) if n.startswith("format_"))
        raise ValueError(f"unknown chat_format {name!r} (known: {', '.join([BASE_FORMAT, *known])})")
    stop = handler(messages=[{"role": "user", "content": "x"}]).stop

    def render(messages: list[dict[str, Any]]) -> str:
        return str(handler(messages=chat_messages(messages)).prompt)

    return ChatFormat(render, tuple([stop] if isinstance(stop, str) else stop or ()))
