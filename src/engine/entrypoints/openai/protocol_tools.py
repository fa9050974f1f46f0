"""Pydantic models of structured outputs and tool calls at the HTTP edge (OpenAI's shapes):
`response_format`, `tools` / `tool_choice`, and the tool calls of an answer."""

from __future__ import annotations

import json
from typing import Any, Dict, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator


class JsonSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`: the output must match `schema` (always enforced:
    constrained decoding makes `strict` true whatever the request says)."""

    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)

    name: str = Field(default="response", max_length=64)
    description: Optional[str] = None
    schema_: Optional[Dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None

    @model_validator(mode="after")
    def _check_schema(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type 'json_schema' needs a json_schema object")
        return self

    def to_json_schema(self) -> Optional[str]:
        """The JSON schema text the output is constrained by (None for plain text)."""
        if self.type == "json_object":
            return '{"type": "object"}'
        if self.type == "json_schema":
            assert self.json_schema is not None  # _check_schema
            schema = self.json_schema.schema_
            return '{"type": "object"}' if schema is None else json.dumps(schema)
        return None


_FUNCTION_NAME = r"^[A-Za-z0-9_.\-]{1,64}$"


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    name: str = Field(pattern=_FUNCTION_NAME)
    description: Optional[str] = None
    parameters: Optional[Dict[str, Any]] = None
    strict: Optional[bool] = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["function"] = "function"
    function: FunctionDefinition


class ToolChoiceFunction(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    name: str


class ToolChoice(BaseModel):
    """A named function the model must call."""

    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["function"] = "function"
    function: ToolChoiceFunction


class FunctionCall(BaseModel):
    name: Optional[str] = None
    arguments: Optional[str] = None


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaToolCall(BaseModel):
    index: int
    id: Optional[str] = None
    type: Optional[Literal["function"]] = None
    function: FunctionCall
