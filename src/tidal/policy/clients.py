"""Client-level serving demand: the heavy clients one by one, the long tail as one aggregate. Pure.

Each heavy client is on (it sends requests) or off. Its switches are a two-state Markov chain whose
probabilities depend on the hour of day and the day type (weekday, weekend; Unix time), counted with a
fading memory and shrunk towards the client's hour, then its overall rate (run lengths follow from
them); its rate when on is its mean when on. The total's center and its usual error scale stay the
aggregate forecaster's (:mod:`tidal.policy.forecast`, which sees the sum: the tail and the clients' rates
while on); the clients that are off add the risk of switching on by the horizon, ``p (1 - p) rate^2``
each, to the scale's square (docs/loaning.md, "Client-level demand").

Observations are vectors: the heavy clients' demand in GPUs, the tail last (columns past
``ClientConfig.heavy`` join the tail); a NaN anywhere makes the step missing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from tidal.policy.forecast import Forecast, ForecastConfig, decay

DAY_S = 86400.0
HOURS = 24


@dataclass(frozen=True)
class ClientConfig:
    """Knobs of the client model."""

    heavy: int = 32
    """Clients modelled one by one; columns past these join the tail."""
    memory_half_life_s: float = 7 * DAY_S
    """Memory of the switch counts and of the rate when on."""
    prior_s: float = 3600.0
    """Each (day type, hour) estimate counts this much time of its client's hour estimate, and each
    hour this much of the client's overall rate."""
    on_gpus: float = 1e-9
    """A client with more demand than this is on."""
    reserve_floor: float = 1.0
    """The tail reserve follows the switch-on risk at the lead time over its mean, within
    ``[reserve_floor, 1 / reserve_floor]`` (1 = the reserve as without clients)."""

    def __post_init__(self) -> None:
        if self.heavy < 1 or not self.memory_half_life_s > 0 or not self.prior_s > 0 \
                or not self.on_gpus >= 0 or not 0 < self.reserve_floor <= 1:
            raise ValueError(f"ClientConfig: heavy >= 1, memory_half_life_s and prior_s > 0, on_gpus >= 0, "
                             f"reserve_floor in (0, 1]; got {self}")


@dataclass(frozen=True, eq=False)
class ClientState:
    """Per heavy client (arrays of ``heavy`` rows): ``last`` demand, its mean when on (``mean_on``);
    switch counts per (client, day type, hour): ``up`` / ``off_n`` (off -> on / steps off), ``down`` /
    ``on_n``. Arrays read-only."""

    t_s: float
    n_obs: int
    last: np.ndarray
    mean_on: np.ndarray
    up: np.ndarray
    off_n: np.ndarray
    down: np.ndarray
    on_n: np.ndarray
    risk_mean: float = math.nan
    """The mean switch-on variance at the lead time (GPUs squared), kept by the loan policy."""


def initial_clients(config: ClientConfig) -> ClientState:
    z, c = _ro(np.zeros(config.heavy)), _ro(np.zeros((config.heavy, 2, HOURS)))
    return ClientState(math.nan, 0, z, z, c, c, c, c)


def _bucket(t_s: float | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(day type: 1 on Saturday and Sunday, hour) of Unix time ``t_s``."""
    days = np.floor_divide(t_s, DAY_S)
    return ((days + 3) % 7 >= 5).astype(int), (np.mod(t_s, DAY_S) // 3600).astype(int) % HOURS


def split(config: ClientConfig, gpus: np.ndarray) -> tuple[np.ndarray, float]:
    """(heavy clients padded to ``heavy``, tail) of an observation vector."""
    y = np.asarray(gpus, dtype=float)
    if y.ndim != 1 or y.size < 1:
        raise ValueError(f"client demand must be a non-empty vector, got shape {y.shape}")
    h = np.zeros(config.heavy)
    k = min(config.heavy, y.size - 1)
    h[:k] = y[:k]
    return h, float(y[-1] + y[k:-1].sum())


def observe_clients(config: ClientConfig, fconfig: ForecastConfig, state: ClientState, t_s: float,
                    gpus: np.ndarray) -> ClientState:
    """The state after the per-client demand ``gpus`` at ``t_s``; ``ValueError`` if negative or infinite."""
    y, tail = split(config, gpus)
    if np.isnan(y).any() or math.isnan(tail):
        return state
    if (y < 0).any() or tail < 0 or not np.isfinite(y).all() or math.isinf(tail):
        raise ValueError("client demand must be finite and >= 0")
    on = y > config.on_gpus
    if state.n_obs == 0:
        return replace(state, t_s=t_s, n_obs=1, last=_ro(y), mean_on=_ro(y.copy()))
    keep = decay(t_s - state.t_s, config.memory_half_life_s)
    w = 1.0 - decay(fconfig.step_s, config.memory_half_life_s)
    was = state.last > config.on_gpus
    d, hr = _bucket(t_s)
    idx = (np.arange(config.heavy), int(d), int(hr))
    up, off_n, down, on_n = (a * keep for a in (state.up, state.off_n, state.down, state.on_n))
    off_n[idx] += ~was
    up[idx] += ~was & on
    on_n[idx] += was
    down[idx] += was & ~on
    first = on & (state.mean_on <= config.on_gpus)
    mean_on = np.where(first, y, np.where(on, state.mean_on + w * (y - state.mean_on), state.mean_on))
    return replace(state, t_s=t_s, n_obs=state.n_obs + 1, last=_ro(y), mean_on=_ro(mean_on), up=_ro(up),
                   off_n=_ro(off_n), down=_ro(down), on_n=_ro(on_n))


def _ro(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


def _rates(config: ClientConfig, fconfig: ForecastConfig, ev: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Switch probability per (client, day type, hour), shrunk: bucket -> the client's hour -> overall."""
    k = config.prior_s / fconfig.step_s
    overall = (ev.sum(axis=(1, 2)) + 0.5) / (n.sum(axis=(1, 2)) + 1.0)
    hour = (ev.sum(axis=1) + k * overall[:, None]) / (n.sum(axis=1) + k)
    return (ev + k * hour[:, None, :]) / (n + k)


def client_forecast(config: ClientConfig, fconfig: ForecastConfig, state: ClientState,
                    aggregate: Forecast) -> Forecast:
    """``aggregate`` (the forecast of the total) with the switch-on risk of the clients off now added to
    its scale; itself before any per-client observation."""
    if state.n_obs == 0:
        return aggregate
    a = _rates(config, fconfig, state.up, state.off_n)
    b = _rates(config, fconfig, state.down, state.on_n)
    d, hr = _bucket(aggregate.times_s)
    off = state.last <= config.on_gpus
    up = a[:, d, hr].T  # (step, client): P(off -> on); and P(on) kept: 1 - P(on -> off) - P(off -> on)
    stay = 1.0 - b[:, d, hr].T - up
    p = np.empty_like(up)
    on = np.zeros(config.heavy)
    for j in range(d.size):  # the chain from off now: P(on at step j)
        on = on * stay[j] + up[j]
        p[j] = on
    var = (p * (1.0 - p)) @ (np.where(off, state.mean_on, 0.0) ** 2)
    scale = np.sqrt(aggregate.scale_gpus ** 2 + var)
    return Forecast(t_s=aggregate.t_s, times_s=aggregate.times_s, center_gpus=aggregate.center_gpus,
                    scale_gpus=_ro(scale))


def reserve_factor(config: ClientConfig, fconfig: ForecastConfig, state: ClientState, aggregate: Forecast,
                   widened: Forecast, lead_i: int, update: bool) -> tuple[float, ClientState]:
    """The tail reserve's factor (the switch-on risk at step ``lead_i`` over its mean) and the state with
    that mean updated (if ``update``: a new observation)."""
    v = max(float(widened.scale_gpus[lead_i] ** 2 - aggregate.scale_gpus[lead_i] ** 2), 0.0)
    w = max(1.0 - decay(fconfig.step_s, config.memory_half_life_s), 1.0 / state.n_obs)
    m = state.risk_mean
    if update:
        m = v if math.isnan(m) else m + w * (v - m)
    f = math.sqrt(v / m) if m > 0 else 1.0
    return min(1.0 / config.reserve_floor, max(config.reserve_floor, f)), replace(state, risk_mean=m)


__all__ = ["ClientConfig", "ClientState", "client_forecast", "initial_clients", "observe_clients", "split"]
