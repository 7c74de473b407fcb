"""Conditions on a request: what a route rule and a store's ``admit_when`` test.

A route sends a request to a child when its rule's conditions hold; a store admits a
request's saves when its ``admit_when`` conditions hold. Both read the same few facts of
vLLM's ``Request`` (``kv_transfer_params``, the prompt length, or a user predicate), so the
model and the one evaluation live here, below the runtime and the stores that use them.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvcompose.tree.fields import custom_error

Predicate = Callable[[Any], bool]


class RequestCondition(BaseModel):
    """Holds for a request when every condition given here holds.

    - ``param``: a key of the request's ``kv_transfer_params`` must be present
      (and equal ``equals`` when that is given, ``null`` included);
    - ``min_prompt_tokens`` / ``max_prompt_tokens``: inclusive bounds on the prompt length;
    - ``predicate``: ``"package.module:function"``, called as ``function(request) -> bool``.
    """

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    #: What the error says when no condition is given (a subclass names its own remedy).
    EMPTY_HINT: ClassVar[str] = (
        "a condition needs at least one of param, min_prompt_tokens, max_prompt_tokens or predicate"
    )

    param: str | None = Field(
        None, description="A key that must be present in the request's `kv_transfer_params`."
    )
    equals: Any = Field(
        None, description="With `param`: the value that key must have (any JSON value)."
    )
    min_prompt_tokens: int | None = Field(
        None, ge=0, description="The prompt must have at least this many tokens."
    )
    max_prompt_tokens: int | None = Field(
        None, ge=0, description="The prompt must have at most this many tokens."
    )
    predicate: str | None = Field(
        None,
        description="`package.module:function`, called as `function(request) -> bool` inside "
        "the scheduler's step, at each lookup of the request: it must be quick and must not "
        "block (nothing times it there). One that raises is no match, logged once per rule.",
    )

    @property
    def has_equals(self) -> bool:
        return "equals" in self.model_fields_set

    @model_validator(mode="after")
    def _conditions(self) -> RequestCondition:
        if self.has_equals and self.param is None:
            raise custom_error("'equals' needs 'param' (the kv_transfer_params key to compare)")
        if (
            self.param is None
            and self.min_prompt_tokens is None
            and self.max_prompt_tokens is None
            and self.predicate is None
        ):
            raise custom_error(self.EMPTY_HINT)
        if (
            self.min_prompt_tokens is not None
            and self.max_prompt_tokens is not None
            and self.min_prompt_tokens > self.max_prompt_tokens
        ):
            raise custom_error(
                f"min_prompt_tokens ({self.min_prompt_tokens}) is greater than "
                f"max_prompt_tokens ({self.max_prompt_tokens})"
            )
        if self.predicate is not None:
            module, _, attr = self.predicate.partition(":")
            if (
                not module
                or not attr
                or not all(part.isidentifier() for part in module.split(".") + attr.split("."))
            ):
                raise custom_error(
                    f"predicate {self.predicate!r} is not of the form 'package.module:function'"
                )
        return self


def describe_condition(cond: RequestCondition) -> str:
    """The conditions in words, for ``kvcompose explain``."""
    parts = []
    if cond.param is not None:
        has = f"kv_transfer_params has {cond.param!r}"
        parts.append(f"{has} == {cond.equals!r}" if cond.has_equals else has)
    if cond.min_prompt_tokens is not None:
        parts.append(f"prompt >= {cond.min_prompt_tokens} tokens")
    if cond.max_prompt_tokens is not None:
        parts.append(f"prompt <= {cond.max_prompt_tokens} tokens")
    if cond.predicate is not None:
        parts.append(f"{cond.predicate}(request)")
    return " and ".join(parts)


def load_predicate(path: str | None) -> Predicate | None:
    """The function a ``predicate`` names (imported once, when the user of the condition is
    built; an import error surfaces there, at engine start)."""
    return None if path is None else import_named(path)


def import_named(path: str) -> Any:
    """The object ``"package.module:attr.attr"`` names (raises ImportError/AttributeError)."""
    module_name, _, attr = path.partition(":")
    target: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        target = getattr(target, part)
    return target


def matches(cond: RequestCondition, predicate: Predicate | None, request: Any) -> bool:
    """Whether ``request`` (vLLM's ``Request``) meets ``cond``; ``predicate`` is
    ``load_predicate(cond.predicate)``. Raises when the request cannot be judged (a
    ``kv_transfer_params`` that is not a mapping, a predicate that raises): callers decide
    what a broken condition means for them."""
    if cond.param is not None:
        params = request.kv_transfer_params
        if params is None:
            return False
        if not isinstance(params, Mapping):
            raise TypeError(f"kv_transfer_params is {type(params).__name__}, not a dict")
        if cond.param not in params:
            return False
        if cond.has_equals and params[cond.param] != cond.equals:
            return False
    num_prompt = request.num_prompt_tokens
    if cond.min_prompt_tokens is not None and num_prompt < cond.min_prompt_tokens:
        return False
    if cond.max_prompt_tokens is not None and num_prompt > cond.max_prompt_tokens:
        return False
    return predicate is None or bool(predicate(request))
