"""A small name → function table for interchangeable algorithm variants.

Variants of one idea (DPO, IPO, SimPO, ...) share a signature and live in one ``Registry`` that a
config names by string, so a trainer never grows an ``if loss_type == ...`` ladder. Registering a
name twice is an error: the second registration would silently shadow the first.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

F = TypeVar("F", bound=Callable)


class UnknownNameError(LookupError):
    """A name that is not in the registry; the message names the nearest valid one."""


class Registry(Generic[F]):
    """Maps names to functions. ``kind`` names the table in error messages ("preference loss")."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator: ``@LOSSES.register("sigmoid")`` adds the function under ``name``."""

        def add(function: F) -> F:
            self.add(name, function)
            return function

        return add

    def add(self, name: str, function: F) -> None:
        if not name or not isinstance(name, str):
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")
        if name in self._entries:
            existing = self._entries[name]
            raise ValueError(
                f"{self.kind} {name!r} is already registered "
                f"(by {existing.__module__}.{existing.__qualname__}); pick another name"
            )
        self._entries[name] = function

    def get(self, name: str) -> F:
        """The function registered as ``name``; ``UnknownNameError`` with the nearest name otherwise."""
        try:
            return self._entries[name]
        except KeyError:
            guess = difflib.get_close_matches(str(name), list(self._entries), n=1, cutoff=0.5)
            hint = f"did you mean {guess[0]!r}?" if guess else f"valid names: {', '.join(self.names())}"
            raise UnknownNameError(f"unknown {self.kind} {name!r}; {hint}") from None

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"
