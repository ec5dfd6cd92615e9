"""The library's environment switches (README, "Environment variables"), parsed in one place.

Each is read at each call (``os.environ``: tests change them between calls with ``monkeypatch.setenv``), and a value
outside the documented ones raises ValueError naming the variable, the value and the accepted ones: a typo such as
``SONICMOE_GLUON=false`` or ``SONICMOE_POISON_OUTPUTS=true`` used to mean on or off silently. Unset always means
the default (an empty value is not unset: it raises too). The documented values keep their meaning bit for bit.

A read costs an environment lookup and a string compare or two (the launch paths read several per kernel): the
parsing of a value that is not a plain ``0`` / ``1`` is cached per raw string. No torch, no triton here: the CLIs
and the CPU paths import this module without them.
"""

from __future__ import annotations

import functools
import os

ON_OFF = ("0", "1")

# TRITON_INTERPRET: the values Triton's own parser (triton.knobs' env_bool, any case) reads as true; it reads every
# other value as false. Of those this module accepts only the common spellings of "off" (and empty) and raises on
# the rest (" 1", "2", ...), where Triton silently runs compiled kernels while the caller meant the interpreter.
INTERPRET_ON = ("1", "true", "on", "yes", "y")
INTERPRET_OFF = ("", "0", "false", "off", "no", "n")


def _bad(name: str, value: str, accepted: str) -> ValueError:
    return ValueError(f"{name}={value!r}: expected {accepted} (unset for the default)")


def _listing(values: tuple[str, ...]) -> str:
    return " or ".join(", ".join(repr(v) for v in values).rsplit(", ", 1))


def env_switch(name: str, default: bool) -> bool:
    """The on/off switch ``name``: ``1`` on, ``0`` off, ``default`` where unset. Read at each call.

    Raises:
        ValueError: any other value (``true``, ``off``, ``" 1"``, an empty string, ...).
    """
    value = os.environ.get(name)
    if value is None:
        return default
    if value == "1":
        return True
    if value == "0":
        return False
    raise _bad(name, value, "'0' (off) or '1' (on)")


def env_choice(name: str, default: str, accepted: tuple[str, ...]) -> str:
    """The setting ``name``, one of ``accepted``, or ``default`` where unset. Read at each call.

    Raises:
        ValueError: a value not in ``accepted``.
    """
    value = os.environ.get(name)
    if value is None:
        return default
    if value in accepted:
        return value
    raise _bad(name, value, _listing(accepted))


def env_count(name: str, default: int, most: int | None = None, multiple: int = 1) -> int:
    """The non-negative integer setting ``name`` (decimal digits only; at most ``most`` where given; 0 or a multiple
    of ``multiple``), or ``default`` where unset. Read at each call.

    Raises:
        ValueError: anything else (a sign, spaces, a word, a larger number, a width off the multiple).
    """
    value = os.environ.get(name)
    if value is None:
        return default
    return _count(name, value, most, multiple)


@functools.lru_cache(maxsize=256)
def _count(name: str, value: str, most: int | None, multiple: int) -> int:
    if value.isascii() and value.isdigit():
        n = int(value)
        if (most is None or n <= most) and n % multiple == 0:
            return n
    accepted = "an integer" if most is None else f"an integer 0..{most}"
    if multiple > 1:
        accepted = f"0 or a positive multiple of {multiple}" + ("" if most is None else f" up to {most}")
    raise _bad(name, value, accepted)


def interpreting() -> bool:
    """True when Triton kernels run through its CPU interpreter: ``TRITON_INTERPRET`` as Triton reads it (``1``,
    ``true``, ``on``, ``yes``, ``y``, any case: on; unset, empty, ``0``, ``false``, ``off``, ``no``, ``n``: off).
    Read at each call; the one parser of the variable in the library, its CLIs and scripts.

    Raises:
        ValueError: any other value (``2``, ``" 1"``, ...), which Triton reads as off.
    """
    value = os.environ.get("TRITON_INTERPRET")
    if value is None or value == "0":
        return False
    if value == "1":
        return True
    return _interpret_value(value)


@functools.lru_cache(maxsize=64)
def _interpret_value(value: str) -> bool:
    folded = value.lower()
    if folded in INTERPRET_ON:
        return True
    if folded in INTERPRET_OFF:
        return False
    raise _bad("TRITON_INTERPRET", value, f"{_listing(INTERPRET_ON)} (on) or {_listing(INTERPRET_OFF)} (off), "
               "any case, as Triton reads it")
