"""The job spec: what a user submits (YAML on the command line, JSON over the API).

    name: gpt-small
    kind: spot                 # spot | dedicated
    priority: 0                # higher first
    gpus: 4                    # or {min: 2, max: 8, multiple_of: 2} (elastic)
    command: [python, train.py, --steps, "2000"]   # an argument list, never a shell string
    workdir: .                 # relative to the YAML file (the CLI resolves it); default: its folder
    env: {WANDB_MODE: offline}
    checkpoint: {url: /ckpt/gpt-small, interval_s: 300}   # default url: the job's folder in the state dir;
                               # or tiers: [shm, /ckpt/gpt-small, s3://bucket/gpt-small]; interval_s: auto
    max_restarts: 3            # failures restarted from the newest checkpoint (exit 75 is not a failure)
    grace_s: 30                # notice (SIGTERM) to SIGKILL, seconds (tidal.contract.DEFAULT_GRACE_S)

Validation is pydantic v2 with ``extra="forbid"``: an unknown or invalid field is an error naming
its path (``gpus.min``, ``env.RANK``) and what was expected. The API returns it as HTTP 422; the CLI
prints it line by line. :func:`spec_errors` turns a ``ValidationError`` into those lines.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from tidal.contract import DEFAULT_GRACE_S, RESERVED_ENV  # RESERVED_ENV: set by the platform, not by a job

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class GpuRange(_Strict):
    """GPUs a job runs on: a gang of ``min`` (all or nothing), elastic up to ``max``, sizes multiples
    of ``multiple_of`` (e.g. the tensor x pipeline parallel degree)."""

    min: int = Field(ge=1, description="gang minimum, GPUs")
    max: int | None = Field(default=None, ge=1, description="elastic maximum, GPUs (default: min)")
    multiple_of: int = Field(default=1, ge=1, description="every size is a multiple of this")

    @model_validator(mode="after")
    def _sizes(self) -> GpuRange:
        if self.max is None:
            object.__setattr__(self, "max", self.min)
        if self.max < self.min:  # type: ignore[operator]
            raise ValueError(f"max ({self.max}) must be >= min ({self.min})")
        for name in ("min", "max"):
            if getattr(self, name) % self.multiple_of:
                raise ValueError(f"{name} ({getattr(self, name)}) must be a multiple of multiple_of ({self.multiple_of})")
        return self


def _gpus(v: Any) -> Any:
    if isinstance(v, bool):
        raise ValueError("expected a GPU count (e.g. 4) or {min, max, multiple_of}")
    if isinstance(v, int):
        return {"min": v}
    if isinstance(v, dict | GpuRange):
        return v
    raise ValueError(f"expected a GPU count (e.g. 4) or {{min, max, multiple_of}}, got {type(v).__name__}")


def _env_name(k: str) -> str:
    if not ENV_NAME_RE.match(k):
        raise ValueError(f"{k!r} is not a valid environment variable name")
    if k in RESERVED_ENV:
        raise ValueError(f"{k} is set by the platform for every rank and cannot be overridden")
    return k


class CheckpointSpec(_Strict):
    url: str | None = Field(default=None, description="checkpoint location (path, file://, s3://); "
                                                      "default: <state dir>/jobs/<job>/ckpt")
    tiers: list[str | dict[str, Any]] | None = Field(
        default=None, min_length=1,
        description="tier list, fastest first, instead of url, e.g. [shm, /ckpt/run1, s3://bucket/run1]")
    interval_s: float | Literal["auto"] = Field(
        default="auto", description="seconds between periodic checkpoints, or 'auto': the control plane sets "
                                    "it from the job's measured save stall and its interruption risk")

    @field_validator("interval_s", mode="before")
    @classmethod
    def _interval(cls, v: Any) -> Any:
        if v == "auto":
            return v
        try:
            ok = not isinstance(v, bool) and float(v) > 0
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"expected a number of seconds > 0 or 'auto', got {v!r}")
        return float(v)

    @field_validator("tiers")
    @classmethod
    def _tiers(cls, v: list[Any] | None) -> list[Any] | None:
        if v is not None:
            from tidal.ckpt.config import resolve
            from tidal.ckpt.errors import TierSpecError

            try:
                resolve(v, default_keep=3)
            except TierSpecError as e:
                raise ValueError(str(e)) from None
        return v

    @model_validator(mode="after")
    def _one_location(self) -> CheckpointSpec:
        if self.url is not None and self.tiers is not None:
            raise ValueError("give the location once: 'url' (one directory or bucket) or 'tiers' (a list)")
        return self


class JobSpec(_Strict):
    name: str = Field(description="a name: letters, digits, '.', '_', '-' (the job id is <name>-<n>)")
    kind: Literal["spot", "dedicated"] = "spot"
    priority: int = Field(default=0, ge=-1000, le=1000)
    gpus: Annotated[GpuRange, BeforeValidator(_gpus)]
    command: list[str] = Field(min_length=1, description="argument list; never run through a shell")
    workdir: str | None = Field(default=None, description="absolute directory the ranks start in")
    env: dict[Annotated[str, AfterValidator(_env_name)], str] = Field(default_factory=dict)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    max_restarts: int = Field(default=3, ge=0, le=1000)
    grace_s: float = Field(default=DEFAULT_GRACE_S, gt=0, le=3600,
                           description="seconds from a stop notice to SIGKILL")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME_RE.match(v):
            raise ValueError("expected 1-63 letters, digits, '.', '_' or '-', starting with a letter or digit")
        return v

    @field_validator("command", mode="before")
    @classmethod
    def _command(cls, v: Any) -> Any:
        if isinstance(v, str):
            raise ValueError("expected a list of arguments, e.g. [python, train.py, --steps, '100'] "
                             "(a command is never run through a shell)")
        return v

    @field_validator("command")
    @classmethod
    def _command_items(cls, v: list[str]) -> list[str]:
        if not v[0]:
            raise ValueError("the program (first argument) must not be empty")
        return v

    @field_validator("workdir")
    @classmethod
    def _workdir(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith("/"):
            raise ValueError(f"expected an absolute path, got {v!r} (the CLI resolves paths relative to the YAML file)")
        return v


def spec_errors(err: ValidationError, prefix: str = "") -> list[str]:
    """``ValidationError`` -> ``["gpus.min: Input should be greater than or equal to 1", ...]``."""
    return [f"{prefix}{error_path(e['loc']) or '(spec)'}: {clean_msg(e['msg'])}" for e in err.errors()]


def error_path(loc: tuple | list) -> str:
    """``("body", "gpus", "min")`` -> ``"gpus.min"``; list indices as ``command[2]``."""
    out = ""
    for part in loc:
        if part == "body" and not out:
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        elif part == "[key]" or str(part).startswith("function-"):  # pydantic's names for wrappers
            continue
        else:
            out += ("." if out else "") + str(part)
    return out


def clean_msg(msg: str) -> str:
    return msg.removeprefix("Value error, ")


def parse_spec(data: Any) -> JobSpec:
    """Validate a spec given as plain data (parsed YAML or JSON); raises ``ValidationError``."""
    return JobSpec.model_validate(data)
