"""Each node's validate_inputs, declared on its class: which inputs a check of their own reads (a file name resolved
in ComfyUI's folders, free text parsed) and which are combos (a value from the node's declared options).

ComfyUI calls a V3 node's validate_inputs at /prompt, before any node runs (a linked input arrives as None), with
the inputs its parameters name; it shows a refusal under each input named and switches its own checks (min/max, a
combo's list) off for them. So the validate_inputs made here names the checked inputs, and the combos only where
core does not check a V3 combo's value itself; a node with nothing to name gets none.
"""

from __future__ import annotations

import inspect
import reprlib
from collections.abc import Callable
from typing import Any, TypeVar

from .. import compat

# check(value) raises ValueError (safe_paths.PathRefused is one) saying why the value is refused; what it returns is
# not looked at
Check = Callable[[Any], object]
Node = TypeVar("Node", bound=type)

MAX_SHOWN_CHOICES = 12  # choices a combo refusal lists (then "... and N more")

# ComfyUI checks a V3 combo's value (io.Combo, type "COMBO" with its options) at /prompt from the release that made
# io.DynamicCombo public (Comfy-Org/ComfyUI#11345; 0.33 here); 0.3.64 checks only V1 combos (a list as the type) and
# passes any string on. Where core checks, a node leaves its combos to core (naming one in validate_inputs would
# switch core's check of it off); where it does not, validate_inputs names them and checks them with
# `validated_choices`. The pack's stand-in io (no ComfyUI) has no core either.
CORE_CHECKS_V3_COMBOS = hasattr(compat.io, "DynamicCombo")

_SHOWN = reprlib.Repr()  # bounded text for any value an API client sends (a long string, a nested object)
_SHOWN.maxstring = _SHOWN.maxother = 120
_SHOWN.maxlevel, _SHOWN.maxlist, _SHOWN.maxdict = 2, 4, 4


def checks_inputs(*, combos: tuple[str, ...] = (), **checks: Check) -> Callable[[Node], Node]:
    """Class decorator: the node's validate_inputs runs each of `checks` (input name -> check) on its value and,
    where core does not, checks `combos` against the options the node's schema declares; it returns True or every
    refusal. The parameters it shows ComfyUI (inspect.getfullargspec) are exactly the inputs it checks."""
    combos = () if CORE_CHECKS_V3_COMBOS else combos
    named = dict.fromkeys([*checks, *combos])  # an input may have a check and be a combo (a file dropdown)
    param = inspect.Parameter.POSITIONAL_OR_KEYWORD
    signature = inspect.Signature(
        [inspect.Parameter("cls", param), *(inspect.Parameter(name, param, default=None) for name in named)]
    )

    def declare(node: Node) -> Node:
        if not named:
            return node  # core checks all: no validate_inputs, as if the node had none

        def validate_inputs(cls, *args, **kwargs) -> bool | str:
            values = signature.bind(cls, *args, **kwargs).arguments
            return refusals(
                *(_validated(check, values.get(name)) for name, check in checks.items()),
                validated_choices(cls, **{name: values.get(name) for name in combos}),
            )

        validate_inputs.__signature__ = signature  # type: ignore[attr-defined]
        validate_inputs.__qualname__ = f"{node.__qualname__}.validate_inputs"
        node.validate_inputs = classmethod(validate_inputs)  # type: ignore[attr-defined]
        return node

    return declare


def unless_blank(check: Check) -> Check:
    """`check` for an optional text input that is unset when empty or spaces, as the node's execute reads it."""

    def checked(value) -> None:
        if isinstance(value, str) and value.strip():
            check(value)

    return checked


def _validated(check: Check, value) -> bool | str:
    """True when `check` accepts `value` (or the input is linked: None at validation time), else its refusal."""
    if value is None:
        return True
    try:
        check(value)
    except ValueError as err:
        return str(err)
    return True


def validated_choices(node, **values) -> bool | str:
    """True when each of `values` (input name -> value received) is one of the options the node's own schema
    declares now (define_schema, so a file list is the current one) or None (linked), else a refusal naming the
    input, the value and the choices (the first MAX_SHOWN_CHOICES)."""
    given = {name: value for name, value in values.items() if value is not None}
    if not given:
        return True
    declared = {i.id: _choices(i) for i in node.define_schema().inputs if getattr(i, "id", None) in given}
    refused = []
    for name, value in given.items():
        choices = declared.get(name)
        if choices is None:
            raise TypeError(f"{node.__name__} has no combo input {name!r}")
        if value not in choices:
            shown = ", ".join(_SHOWN.repr(c) for c in choices[:MAX_SHOWN_CHOICES])
            more = f" and {len(choices) - MAX_SHOWN_CHOICES} more" if len(choices) > MAX_SHOWN_CHOICES else ""
            offered = f"the choices are {shown}{more}" if choices else "there is nothing to choose from"
            refused.append(f"{name} {_SHOWN.repr(value)} was refused: it is not in the list; {offered}.")
    return refusals(*refused)


def refusals(*results: bool | str) -> bool | str:
    """Several validate_inputs checks as one result: True when all passed, else every refusal (ComfyUI shows the one
    message under each input validate_inputs names, so each problem must be in it)."""
    refused = [str(r) for r in results if r is not True]
    return " ".join(refused) if refused else True


def _choices(port) -> list | None:
    """The options of a combo input, or None for any other input."""
    options = getattr(port, "options", None)
    if isinstance(options, dict):  # the pack's stand-in io keeps an input's keyword arguments
        options = options.get("options") if getattr(port, "io_type", None) == "COMBO" else None
    return list(options) if isinstance(options, (list, tuple)) else None
