"""Pydantic models of structured outputs and tool calls at the HTTP edge (OpenAI's shapes):
`response_format`, `tools` / `tool_choice`, and the tool calls of an answer."""

from __future__ import annotations

import json
from typing import Any, Dict, List, Literal, Optional, Tuple

from pydantic import BaseModel, ConfigDict, Field, model_validator


class JsonSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`: the output must match `schema` (always enforced:
    constrained decoding makes `strict` true whatever the request says)."""

    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)

    name: str = Field(default="response", max_length=64)
    description: Optional[str] = None
    schema_: Optional[Dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class TagStructure(BaseModel):
    """One structure of SGLang's legacy structural tag: `begin`, JSON following `schema`, `end`."""

    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)

    begin: str
    schema_: Optional[Dict[str, Any]] = Field(default=None, alias="schema")
    end: str


class ResponseFormat(BaseModel):
    """OpenAI's response_format, plus SGLang's `structural_tag` type in its two shapes: the legacy
    `structures` + `triggers` (+ `at_least_one`), or xgrammar's `format`."""

    model_config = ConfigDict(extra="ignore", strict=True)

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: Optional[JsonSchemaFormat] = None
    structures: Optional[List[TagStructure]] = None
    triggers: Optional[List[str]] = None
    at_least_one: bool = False
    format: Optional[Dict[str, Any]] = None

    @model_validator(mode="after")
    def _check_schema(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type 'json_schema' needs a json_schema object")
        if self.type == "structural_tag":
            legacy = self.structures is not None or self.triggers is not None
            if legacy == (self.format is not None) or (legacy and not (self.structures and self.triggers)):
                raise ValueError("response_format of type 'structural_tag' needs either non-empty 'structures' "
                                 "and 'triggers' or a 'format'")
        return self

    def to_constraint(self) -> Optional[Tuple[str, str]]:
        """(sampling parameter, its text) the output is constrained by; None for plain text."""
        if self.type == "json_object":
            return "json_schema", '{"type": "object"}'
        if self.type == "json_schema":
            assert self.json_schema is not None  # _check_schema
            schema = self.json_schema.schema_
            return "json_schema", '{"type": "object"}' if schema is None else json.dumps(schema)
        if self.type == "structural_tag":
            if self.format is not None:
                return "structural_tag", json.dumps({"type": "structural_tag", "format": self.format})
            structures = [{"begin": s.begin, "schema": s.schema_, "end": s.end} for s in self.structures or []]
            return "structural_tag", json.dumps({"structures": structures, "triggers": self.triggers,
                                                 "at_least_one": self.at_least_one})
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
