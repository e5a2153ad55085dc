"""Serving side: where Tidal learns how many GPUs serving needs, and how it lends them.

Tidal does not serve models. It reads serving load (a recorded trace, or live metrics), turns it into
demand in GPUs for the forecast and loan plan in :mod:`tidal.policy`, and carries out loans through a
serving adapter (:mod:`tidal.serving.adapters`).
"""
