"""A form field's raw value as a number, or a ValueError naming the field and its limits.

Gradio hands a number widget's value over as it was typed: None when emptied, a float as
large as 1e308, text where a textbox holds a number. `int(None)` and `int(1e308)` answered
with Python's wording ("int() argument must be ... not 'NoneType'") or a 309-digit echo;
these say which field, what it holds (as typed, in short), and what it may hold.
"""

import math


def _limits(low: float | None, high: float | None) -> str:
    if low is not None and high is not None:
        return f"a number from {low:g} to {high:g}"
    if low is not None:
        return f"a number of {low:g} or more"
    return "a number"


def form_number(name: str, value, *, integer: bool = False, low: float | None = None,
                high: float | None = None) -> int | float:
    """`value` as an int (`integer`) or a float within [low, high] (either may be open)."""
    wanted = ("a whole " + _limits(low, high)[2:]) if integer else _limits(low, high)
    if value is None or (isinstance(value, str) and not value.strip()):
        raise ValueError(f"{name} is empty: enter {wanted}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}={str(value)[:40]!r} is not a number: enter {wanted}") \
            from None
    if not math.isfinite(number) or (integer and number != int(number)):
        kind = "a whole number" if integer else "a finite number"
        raise ValueError(f"{name}={number:g} is not {kind}: enter {wanted}")
    if (low is not None and number < low) or (high is not None and number > high):
        raise ValueError(f"{name}={number:g} is out of range: enter {wanted}")
    return int(number) if integer else number

