"""The serving adapter a ``serving:`` block names (docs/loaning.md): ``adapter: ray-serve`` (a Ray Serve
application, :mod:`tidal.serving.ray_serve`), ``adapter: llama.cpp`` (replicas of a real engine,
:mod:`tidal.serving.engine_adapter`), else a replay of ``trace`` (:class:`ReplayAdapter`), else
the hook adapter (Prometheus demand, webhook or command actions: :class:`HookAdapter`)."""

from __future__ import annotations

from pathlib import Path

from tidal.serving.adapters import HookAdapter, ReplayAdapter, ServingAdapter, parse_nodes
from tidal.serving.watch import WatchConfig


def build_adapter(cfg: WatchConfig, ray_address: str | None = None, workdir: Path | None = None
                  ) -> tuple[ServingAdapter, list[tuple[float, float]]]:
    """The adapter for ``cfg`` (Ray Serve's joins ``ray_address`` unless connected already; an engine's
    replicas work in ``workdir``) and a replay's earlier days (time, GPUs) to warm the forecast with;
    ``ValueError`` (``OSError``) naming what is wrong."""
    from tidal.serving.sources import PrometheusQuery, replay_of
    from tidal.serving.traces import load_trace

    nodes = parse_nodes(cfg.nodes)
    gpus = sum(nodes.values())
    adapter: ServingAdapter
    history: list[tuple[float, float]] = []
    if cfg.adapter == "ray-serve":
        from tidal.serving.ray_serve import RayServeAdapter, RayServeSettings

        settings, earlier = RayServeSettings.from_config(cfg), None
        if cfg.trace is not None:  # earlier days' requests/s: read now, so tidal up names what is wrong
            earlier = load_trace(cfg.trace)
            if not (~earlier.gap).any():
                raise ValueError(f"serving.trace {cfg.trace}: no request rate outside gaps to learn from")
            earlier.request_demand_gpus(settings.model(settings.service_rate_per_replica or 0.0))
        rs = RayServeAdapter(settings, address=ray_address, trace=earlier)
        rs.check()
        adapter = rs
    elif cfg.adapter == "llama.cpp":
        from tidal.serving.engine_adapter import EngineAdapter, EngineSettings

        engine = EngineSettings.from_config(cfg)
        if not Path(engine.model).is_file():
            raise ValueError(f"serving.engine.model {engine.model}: no such file")
        if workdir is None:
            raise ValueError("adapter llama.cpp needs a work directory for its replicas")
        back = replay_of(cfg.trace, gpus, None, None) if cfg.trace is not None else None
        adapter = EngineAdapter(engine, workdir, history=back, history_days=cfg.history_days)
    elif cfg.trace is not None:
        source = replay_of(cfg.trace, gpus, None, cfg.requests())
        first = source.start_s
        start = cfg.start_s if cfg.start_s is not None else first + cfg.history_days * 86400.0
        replay = ReplayAdapter(source, nodes, speedup=cfg.speedup, start_s=start)
        history = replay.history(cfg.history_days * 86400.0, cfg.step_s)
        adapter = replay
    else:
        prom = PrometheusQuery(cfg.prometheus or "", cfg.query or "", cfg.gpus_per_unit,
                               requests=cfg.requests(), client_label=cfg.client_label)
        adapter = HookAdapter(prom, nodes, url=cfg.actions_url, command=cfg.actions_command,
                              timeout_s=cfg.actions_timeout_s)
    return adapter, history
