"""``python -m tidal.train.torchrun ARGS``: ``torchrun ARGS`` that exits 75 when its ranks were preempted
(plain ``torchrun`` exits 1; docs/train.md, Exit codes)."""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterable

from tidal.contract import EXIT_PREEMPTED


def preempted(exit_codes: Iterable[int]) -> bool:
    """Whether failed ranks with these codes mean "preempted": at least one 75, the rest 75 or SIGTERM."""
    codes = set(exit_codes)
    return EXIT_PREEMPTED in codes and codes <= {EXIT_PREEMPTED, -int(signal.SIGTERM)}


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        run(args)
    except ChildFailedError as e:
        codes = [f.exitcode for f in e.failures.values()]
        if preempted(codes):
            print(f"tidal.train.torchrun: ranks exited {sorted(set(codes))}: preempted "
                  f"(exit {EXIT_PREEMPTED})", file=sys.stderr)
            return EXIT_PREEMPTED
        print(f"tidal.train.torchrun: ranks failed with exit codes {sorted(set(codes))}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
