"""What ``/v1/responses`` sends, as pydantic models (``gateway/response_models.py``'s kind: not
used to build answers; the tests hold real ones to them, and ``/openapi.json`` publishes them),
and the endpoints' entries in ``/openapi.json`` (``PATHS``).

A stream's events are described by their ``data``: each is an object with ``type`` and
``sequence_number``, and the ``response.created`` / ``in_progress`` / ``completed`` /
``incomplete`` / ``failed`` ones carry a whole ``Response``; the others are OpenAI's item, part
and delta events (``gateway/responses/output.py``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from pdserve.gateway.response_models import ResponseModel, omitted

Status = Literal["in_progress", "completed", "incomplete"]


class OutputTextOut(ResponseModel):
    type: Literal["output_text", "input_text"]
    text: str
    annotations: list[Any] | None = Field(None, description="always empty")
    logprobs: list[Any] | None = Field(None, description="always empty")


class MessageOut(ResponseModel):
    id: str = Field(description="msg_...")
    type: Literal["message"]
    status: Status
    role: Literal["assistant", "user", "system", "developer"]
    content: list[OutputTextOut]


class FunctionCallOut(ResponseModel):
    id: str = Field(description="fc_...")
    type: Literal["function_call"]
    status: Status
    call_id: str = Field(description="what a function_call_output names to answer it")
    name: str
    arguments: str = Field(description="JSON text, as the model wrote it")


class FunctionResultIn(ResponseModel):
    id: str = Field(description="fco_...")
    type: Literal["function_call_output"]
    status: Status
    call_id: str
    output: str | list[OutputTextOut]


class ReasoningTextOut(ResponseModel):
    type: Literal["reasoning_text"]
    text: str


class ReasoningOut(ResponseModel):
    id: str = Field(description="rs_...")
    type: Literal["reasoning"]
    status: Status | None = None
    summary: list[Any]
    content: list[ReasoningTextOut] | None = None


OutputItem = MessageOut | FunctionCallOut | ReasoningOut


class InputTokensDetails(ResponseModel):
    cached_tokens: int = Field(description="prompt tokens served from a prefix cache")
    cache_write_tokens: int = Field(description="always 0")


class OutputTokensDetails(ResponseModel):
    reasoning_tokens: int = Field(description="the reasoning text's tokens")


class ResponseUsage(ResponseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseError(ResponseModel):
    code: Literal["server_error"]
    message: str


class IncompleteDetails(ResponseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(ResponseModel):
    """A response: as answered, as each lifecycle event carries it, and as stored."""

    id: str = Field(description="resp_...")
    object: Literal["response"]
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    background: Literal[False]
    error: ResponseError | None
    incomplete_details: IncompleteDetails | None
    model: str
    output: list[OutputItem]
    reasoning: dict[str, Any]
    service_tier: str
    store: bool = Field(description="whether it was stored (false without a usable store)")
    instructions: str | None
    max_output_tokens: int | None
    metadata: dict[str, str]
    parallel_tool_calls: bool
    previous_response_id: str | None
    temperature: float
    top_p: float
    text: dict[str, Any]
    tool_choice: Any
    tools: list[dict[str, Any]]
    truncation: Literal["disabled"]
    user: str | None
    usage: ResponseUsage | None = Field(description="null while in progress")


class ResponseEvent(ResponseModel):
    """One event's data; which fields it has depends on its type."""

    type: str = Field(description="response.created, response.output_text.delta, ...")
    sequence_number: int = Field(description="0, 1, 2, ... in the order sent")
    response: ResponseObject | None = omitted("response.created, in_progress and the last event")
    output_index: int | None = omitted("the output item the event is about")
    item: OutputItem | None = omitted("output_item.added (as it starts) and .done (whole)")
    item_id: str | None = omitted("the id of the item a part, delta or done event is about")
    content_index: int | None = omitted("the item's content part (always 0)")
    part: OutputTextOut | ReasoningTextOut | None = omitted("content_part.added and .done")
    delta: str | None = omitted("output_text, reasoning_text or function_call_arguments delta")
    text: str | None = omitted("output_text.done and reasoning_text.done: the whole text")
    logprobs: list[Any] | None = omitted("output_text events: always empty")
    name: str | None = omitted("function_call_arguments.done: the function")
    arguments: str | None = omitted("function_call_arguments.done: the whole arguments")


class DeletedResponse(ResponseModel):
    id: str
    object: Literal["response"]
    deleted: Literal[True]


class InputItemList(ResponseModel):
    object: Literal["list"]
    data: list[MessageOut | FunctionCallOut | FunctionResultIn | ReasoningOut]
    first_id: str | None
    last_id: str | None
    has_more: bool


MODELS: dict[str, type[BaseModel]] = {
    "Response": ResponseObject,
    "ResponseStreamEvent": ResponseEvent,
    "DeletedResponse": DeletedResponse,
    "ResponseInputItemList": InputItemList,
}


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": f"#/components/schemas/{name}"}


def _answer(description: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


ERROR = {"content": {"application/json": {"schema": _ref("Error")}}}
STORE_ERRORS = {
    "400": {"description": "invalid, or the store is unavailable (no JetStream)", **ERROR},
    "401": {"description": "missing or wrong API key", **ERROR},
    "404": {"description": "no such stored response (or model)", **ERROR},
    "503": {"description": "the response store failed for now (see Retry-After)", **ERROR},
}
ID_PARAMETER = {"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}
SECURITY = [{"bearer": []}, {}]

PATHS: dict[str, Any] = {
    "/v1/responses": {
        "post": {
            "summary": "A response (OpenAI's Responses API), stored unless store is false",
            "security": SECURITY,
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": _ref("ResponsesRequest")}},
            },
            "responses": {
                "200": {
                    "description": "the response, or with stream=true server-sent events "
                    "('event: <type>', 'data: <event>') from response.created to "
                    "response.completed / incomplete / failed",
                    "content": {
                        "application/json": {"schema": _ref("Response")},
                        "text/event-stream": {"schema": _ref("ResponseStreamEvent")},
                    },
                },
                **STORE_ERRORS,
                "409": {"description": "x-request-id already in flight", **ERROR},
                "413": {"description": "request body too large", **ERROR},
                "502": {"description": "a worker failed the request", **ERROR},
                "504": {"description": "deadline passed", **ERROR},
            },
        }
    },
    "/v1/responses/{response_id}": {
        "get": {
            "summary": "A stored response",
            "security": SECURITY,
            "parameters": [ID_PARAMETER],
            "responses": {"200": _answer("the response", _ref("Response")), **STORE_ERRORS},
        },
        "delete": {
            "summary": "Forget a stored response",
            "security": SECURITY,
            "parameters": [ID_PARAMETER],
            "responses": {"200": _answer("deleted", _ref("DeletedResponse")), **STORE_ERRORS},
        },
    },
    "/v1/responses/{response_id}/input_items": {
        "get": {
            "summary": "The conversation a stored response answered (earlier turns included)",
            "security": SECURITY,
            "parameters": [
                ID_PARAMETER,
                {
                    "name": "limit",
                    "in": "query",
                    "schema": {"type": "integer", "minimum": 1, "maximum": 100, "default": 20},
                },
                {
                    "name": "order",
                    "in": "query",
                    "schema": {"enum": ["asc", "desc"], "default": "desc"},
                },
                {
                    "name": "after",
                    "in": "query",
                    "schema": {"type": "string"},
                    "description": "an item id",
                },
            ],
            "responses": {
                "200": _answer("a page of items", _ref("ResponseInputItemList")),
                **STORE_ERRORS,
            },
        }
    },
}
