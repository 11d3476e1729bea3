"""Valid ranges of numeric settings, declared in the type hint: ``coef: NonNegative = 0.05``.

A settings dataclass says each number's range once, where the field is declared; the YAML loader
(``tasks.typed_yaml``) refuses a value outside it in one line naming the dotted key, the value, where it came
from and the range, and :func:`check_ranges` (called by each dataclass's ``__post_init__``) holds the same rule
for configs built in Python. NaN and infinities are outside every range.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from dataclasses import dataclass
from typing import Annotated, Any


@dataclass(frozen=True)
class Range:
    """Bounds of a number (any left None is open); NaN and infinities never pass."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    note: str = ""
    """Why, or what the edge values mean (shown after the range: '0 = off')."""
    allow_inf: bool = False
    """Infinity (within the bounds) is a meaningful value here ('inf = no clipping'); NaN never is."""

    def problem(self, value: Any) -> str | None:
        """None when ``value`` is in range, else what it must be ('must be > 0')."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return None  # another arm of a union (a preset name, None): not a number to bound
        if math.isnan(value) or (math.isinf(value) and not self.allow_inf):
            return f"must be a finite number {self}"
        inside = ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                  and (self.le is None or value <= self.le) and (self.lt is None or value < self.lt))
        return None if inside else f"must be {self}"

    def __str__(self) -> str:
        low = f"[{_num(self.ge)}" if self.ge is not None else f"({_num(self.gt)}" if self.gt is not None else None
        high = f"{_num(self.le)}]" if self.le is not None else f"{_num(self.lt)})" if self.lt is not None else None
        if low and high:
            text = f"in {low}, {high}"
        elif low:
            text = f">= {low[1:]}" if low[0] == "[" else f"> {low[1:]}"
        elif high:
            text = f"<= {high[:-1]}" if high[-1] == "]" else f"< {high[:-1]}"
        else:
            text = "finite"
        return f"{text} ({self.note})" if self.note else text


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


Positive = Annotated[float, Range(gt=0)]
"""A number > 0 (learning rates, clip ranges, temperatures)."""
NonNegative = Annotated[float, Range(ge=0)]
"""A number >= 0 (coefficients, weight decay)."""
Fraction = Annotated[float, Range(ge=0, le=1)]
"""A number in [0, 1]."""
PositiveInt = Annotated[int, Range(ge=1)]
"""An integer >= 1 (sizes, counts of steps)."""
Count = Annotated[int, Range(ge=0)]
"""An integer >= 0 (0 usually means off)."""
ClipNorm = Annotated[float, Range(gt=0, allow_inf=True, note="inf = no clipping")]
"""A gradient-norm clip: > 0, or infinity to report the norm without clipping."""


@dataclass(frozen=True)
class Retention:
    """Marks a setting that decides only how much is kept on disk (checkpoints, resume states), never what is
    computed: artifact keys leave it out, so changing it reuses every finished stage."""


KeptCount = Annotated[int, Range(ge=1), Retention()]
"""How many of something are kept on disk (>= 1); not part of any artifact key."""


def is_retention(hint: Any) -> bool:
    """Whether a type hint carries the :class:`Retention` mark."""
    return typing.get_origin(hint) is Annotated and any(isinstance(m, Retention) for m in typing.get_args(hint)[1:])


def range_of(hint: Any) -> Range | None:
    """The :class:`Range` in an ``Annotated`` hint (also inside ``X | None``), or None."""
    if typing.get_origin(hint) is Annotated:
        return next((m for m in typing.get_args(hint)[1:] if isinstance(m, Range)), None)
    return next((r for arg in typing.get_args(hint) if (r := range_of(arg)) is not None), None)


@functools.cache
def _ranges(cls: type) -> dict[str, Range]:
    hints = typing.get_type_hints(cls, include_extras=True)
    return {f.name: r for f in dataclasses.fields(cls) if (r := range_of(hints[f.name])) is not None}


def check_ranges(instance: Any, section: str) -> None:
    """ValueError naming ``<section>.<field>`` for the first field of a settings dataclass outside its range."""
    for name, bounds in _ranges(type(instance)).items():
        value = getattr(instance, name)
        why = bounds.problem(value)
        if why is not None:
            raise ValueError(f"{section}.{name} {why}, got {value!r}")
