"""The two line formats a trace file may hold, as pydantic models, so that a user's trace is
refused with its line and field before any engine starts (a string arrival time, a NaN, a
missing Mooncake timestamp, a negative ``max_tokens``), instead of failing inside a replay.

Strict types: JSON ``true`` is not a token id, ``"5"`` is not a length; a float field takes
an integer. Keys the token-id form does not know are kept as the request's tags; the
Mooncake form ignores them.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError

from kvcompose.bench.workloads import WorkloadError

M = TypeVar("M", bound=BaseModel)

#: A finite number at least 0 (times: seconds in the token-id form, ms in Mooncake's).
Finite = Annotated[float, Field(ge=0, allow_inf_nan=False, strict=True)]
TokenIds = Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1)]


class TokenRow(BaseModel):
    """``{"id": "r1", "arrival_s": 0.0, "prompt_token_ids": [...], "max_tokens": 16}``, or a
    line ``{"prefill": "<store>", "prompt_token_ids": [...]}`` put in a store before the run."""

    model_config = ConfigDict(extra="allow", frozen=True)

    id: StrictStr | StrictInt | None = None
    arrival_s: Finite = 0.0
    prompt_token_ids: TokenIds
    max_tokens: Annotated[StrictInt, Field(ge=1)] = 16
    prefill: Annotated[StrictStr, Field(min_length=1)] | None = None

    @property
    def tags(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class MooncakeRow(BaseModel):
    """A Mooncake FAST'25 trace line: ``timestamp`` in ms, lengths in tokens, one hash id per
    512-token block."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    timestamp: Finite
    input_length: Annotated[StrictInt, Field(ge=1)]
    output_length: Annotated[StrictInt, Field(ge=0)] = 1
    hash_ids: Annotated[list[StrictInt], Field(min_length=1)]


def parse_row(model: type[M], row: Any, where: str) -> M:
    """``row`` as ``model``; a ``WorkloadError`` naming ``where`` and the first bad field."""
    if isinstance(row, model):
        return row
    try:
        return model.model_validate(row)
    except ValidationError as exc:
        error = exc.errors()[0]
        field = ".".join(str(part) for part in error["loc"])
        more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
        raise WorkloadError(f"{where}: {field}: {error['msg']}{more}") from None
