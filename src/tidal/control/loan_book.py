"""The serving adapter's actions the loan step has sent and not seen carried out: :class:`Actions`.

Until its outcome comes back a release's GPUs are in neither pool and a restore's do not end their warm-up; a
refused restore is owed and sent again each step. ``releasing``, ``restoring`` and ``owed`` are stored with
the loan document and sent again after a restart (``resend``); ``queued`` and ``stale`` (outcomes to ignore,
sent before the node was lost) live only with the running adapter.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any


def _book(raw: Any) -> dict[str, int]:
    return {str(n): int(g) for n, g in (raw or {}).items() if g}


class Actions:
    """The books of actions in flight and owed, node -> GPUs (see the module docstring). Mutated only by
    the loan step (:class:`tidal.control.loans.LiveLoans`)."""

    def __init__(self) -> None:
        self.releasing: dict[str, int] = {}  # releases the adapter has not reported carried out
        self.restoring: dict[str, int] = {}  # restores the adapter has not reported carried out
        self.owed: dict[str, int] = {}  # restores the adapter refused: sent again each step
        self.queued: dict[str, int] = {}  # outcomes still to come, per node (not stored)
        self.stale: dict[str, int] = {}  # of those, outcomes to ignore: sent before the node was lost
        self.resend = False  # books loaded from the store: sent again on the first step

    def book(self, action: str) -> dict[str, int]:
        """The in-flight book of ``action`` (``"release"`` or ``"restore"``)."""
        return self.releasing if action == "release" else self.restoring

    def busy(self, node: str) -> bool:
        """Whether a restore is owed or in flight on ``node`` (its GPUs do not serve again until it is
        carried out)."""
        return bool(self.restoring.get(node) or self.owed.get(node))

    def add(self, book: dict[str, int], node: str, gpus: int) -> None:
        """``gpus`` more on ``node`` in ``book`` (dropped at zero or below)."""
        left = book.get(node, 0) + gpus
        if left > 0:
            book[node] = left
        else:
            book.pop(node, None)

    def sent(self, action: str, node: str, gpus: int) -> None:
        """A queued ``action`` was sent: in flight until its outcome comes."""
        self.add(self.book(action), node, gpus)
        self.add(self.queued, node, 1)

    def outcome_came(self, node: str) -> bool:
        """An outcome for ``node`` came back: counted off; True when it is one to ignore (sent before
        the node was lost)."""
        self.add(self.queued, node, -1)
        if self.stale.get(node):
            self.add(self.stale, node, -1)
            return True
        return False

    def drop_node(self, node: str) -> tuple[int, int, int]:
        """``node`` was lost: its actions are dropped and the outcomes still to come from it will be
        ignored. Returns (GPUs releasing, restoring, owed) there."""
        releasing, restoring = self.releasing.pop(node, 0), self.restoring.pop(node, 0)
        owed = self.owed.pop(node, 0)
        self.add(self.stale, node, self.queued.pop(node, 0))
        return releasing, restoring, owed

    def take(self, book: dict[str, int]) -> list[tuple[str, int]]:
        """Empty ``book``, returning what it held (to send again)."""
        out = list(book.items())
        book.clear()
        return out

    def to_doc(self) -> dict[str, Any]:
        return {"pending_restores": dict(self.owed), "releasing": dict(self.releasing),
                "restoring": dict(self.restoring)}

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any], lent_on: Callable[[str], int], cap: Mapping[str, int],
                 away: set[str]) -> Actions:
        """The books of a stored loan document, checked against the stored ledger (``lent_on``, ``cap``)
        and the serving nodes lost or not back yet (``away``); ``ValueError`` naming what is wrong."""
        out = cls()
        out.owed = _book(doc.get("pending_restores"))
        out.releasing, out.restoring = _book(doc.get("releasing")), _book(doc.get("restoring"))
        for what, book in (("releasing", out.releasing), ("restoring", out.restoring)):
            for n, g in book.items():
                top = lent_on(n) if what == "releasing" else cap.get(n, 0)
                if n in away:
                    raise ValueError(f"{what}[{n!r}]: the node is lost or not back in the pool")
                if not 1 <= g <= top:
                    raise ValueError(f"{what}[{n!r}] = {g} GPUs, outside 1..{top}")
        out.resend = bool(out.releasing or out.restoring)
        return out
