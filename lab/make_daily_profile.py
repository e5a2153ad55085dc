"""Derive the small daily serving profile shipped for the demo from a public trace (not the trace itself).

    python lab/make_daily_profile.py ../shared/traces/servegen-language-m-large.csv \\
        src/tidal/serving/data/daily-profile.csv

Per 10-minute slot of the day, the median request rate over the trace's days (gap rows, under 1 % of
the median load, left out), smoothed by a centered one-hour circular mean, normalized to the
profile's peak (1.0), written as one day of ``seconds,load`` rows. m-large's median day has the
shape the demo shows: a night trough (0.67 of peak, 06-09 h trace time) and a steep morning rise.
The source (alibaba/ServeGen, Apache-2.0) is named in the data folder's README.
"""

from __future__ import annotations

import sys

import numpy as np

from tidal.serving.traces import load_trace


def main(src: str, out: str) -> None:
    trace = load_trace(src)
    step = trace.step_s
    slots = int(round(86400 / step))
    days = len(trace.load) // slots
    load = np.where(trace.gap, np.nan, trace.load)[: days * slots].reshape(days, slots)
    prof = np.nanmedian(load, axis=0)
    k = max(1, int(round(3600 / step)))
    prof = np.mean([np.roll(prof, s) for s in range(-(k // 2), k - k // 2)], axis=0)
    prof = prof / np.nanmax(prof)
    with open(out, "w") as f:
        f.write("seconds,load\n")
        for i, v in enumerate(prof):
            f.write(f"{int(i * step)},{v:.4f}\n")
    print(f"{out}: {slots} slots of {step:g} s from {days} days of {src}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
