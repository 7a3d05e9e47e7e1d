"""OpenAI's Responses API on the wire: the request, its translation to a chat request,
and the response object and typed stream events built from chat chunks.

bourse runs every Responses request as a chat generation on the same book, money and
relay. This package is pure (no I/O); its names are imported from here, each owned by
one module:

- :mod:`.request`: :func:`parse_request` checks a ``POST /v1/responses`` body
  (:class:`ResponsesRequest`); a field this gateway does not serve (built-in tools,
  ``conversation``, ``prompt``…) is a 400 that names it;
- :mod:`.chat`: :func:`input_items` gives the request's input as stored items (with
  ids), and :func:`chat_body` the chat request that runs it: ``instructions`` first,
  then the stored conversation of ``previous_response_id``, then the input (messages,
  function calls and their outputs), with ``tools``, ``tool_choice``, ``text.format``,
  the output budget and bourse's own ``max_price``, ``timeout``, ``deadline_s`` and ``sim``;
- :mod:`.events`: :class:`ResponseBuilder` folds the chat chunks of a run into the
  response's output items and, for a stream, into OpenAI's typed events, each with its
  ``sequence_number``: ``response.created``, ``response.in_progress``,
  ``response.output_item.added``, ``response.content_part.added``,
  ``response.output_text.delta`` … ``response.output_item.done`` (reasoning as a
  reasoning item's summary, tool calls as ``function_call`` items with
  ``response.function_call_arguments.delta``), and the final ``response.completed``,
  ``response.incomplete`` or ``response.failed``. :func:`event_frames` writes them as
  SSE (``event: <type>`` and ``data: <json>``);
- :mod:`.document`: the stored response document: :func:`response_object` (the
  request's settings echoed), :func:`response_usage` (the chat usage in the Responses
  API's names, with bourse's receipt: ``cost``, ``cost_micros``, ``x_market``), the
  final states and the items' ids (:func:`referenced`);
- :mod:`.upstream`: an ``openai`` deployment with ``api = "responses"``: a chat request
  as a Responses request (:func:`upstream_request`) and its typed events back as chat
  chunks (:class:`UpstreamEvents`).
"""

from bourse.wire.responses.chat import chat_body, chat_messages, input_items
from bourse.wire.responses.document import (
    FINAL_STATUSES,
    new_id,
    output_text,
    referenced,
    response_object,
    response_usage,
)
from bourse.wire.responses.events import ResponseBuilder, event_frames
from bourse.wire.responses.request import ResponsesRequest, parse_item, parse_request
from bourse.wire.responses.upstream import UpstreamEvents, upstream_request

__all__ = [
    "FINAL_STATUSES",
    "ResponseBuilder",
    "ResponsesRequest",
    "UpstreamEvents",
    "chat_body",
    "chat_messages",
    "event_frames",
    "input_items",
    "new_id",
    "output_text",
    "parse_item",
    "parse_request",
    "referenced",
    "response_object",
    "response_usage",
    "upstream_request",
]
