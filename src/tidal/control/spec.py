"""The job spec: what a user submits (YAML on the command line, JSON over the API; fields in docs/control.md).

Validation is pydantic v2 with ``extra="forbid"``: an invalid field is an error naming its path (``gpus.min``)
and what was expected; the API answers 422, the CLI prints :func:`spec_errors`' lines.
"""

from __future__ import annotations

import math
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
from pydantic_core import InitErrorDetails, PydanticCustomError

from tidal.contract import DEFAULT_GRACE_S, RESERVED_ENV  # RESERVED_ENV: set by the platform, not by a job

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")

# Size limits (the API also caps the whole request body: api.MAX_BODY_BYTES).
MAX_ARGS = 1024  # command arguments
MAX_ARG_CHARS = 32768  # one argument (Linux allows 128 KiB per argument)
MAX_ENV = 256  # env entries
MAX_ENV_NAME_CHARS = 256
MAX_ENV_VALUE_CHARS = 32768
MAX_PATH_CHARS = 4096  # workdir, checkpoint.url, a tier's url
MAX_TIERS = 8
MAX_TEXT_CHARS = 32768  # any other string anywhere in a spec (a tier's options)
MAX_DEPTH = 6  # nesting of lists and mappings
MAX_GPUS = 65536
MAX_INTERVAL_S = 7 * 86400.0
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class GpuRange(_Strict):
    """GPUs a job runs on: a gang of ``min`` (all or nothing), elastic up to ``max``, sizes multiples
    of ``multiple_of`` (e.g. the tensor x pipeline parallel degree)."""

    min: int = Field(ge=1, le=MAX_GPUS, description="gang minimum, GPUs")
    max: int | None = Field(
        default=None, ge=1, le=MAX_GPUS, description="elastic maximum, GPUs (default: min)"
    )
    multiple_of: int = Field(default=1, ge=1, le=MAX_GPUS, description="every size is a multiple of this")

    @model_validator(mode="after")
    def _sizes(self) -> GpuRange:
        mx = self.min if self.max is None else self.max
        object.__setattr__(self, "max", mx)
        if mx < self.min:
            raise ValueError(f"max ({mx}) must be >= min ({self.min})")
        for name in ("min", "max"):
            if getattr(self, name) % self.multiple_of:
                raise ValueError(f"{name} ({getattr(self, name)}) must be a multiple of multiple_of "
                                 f"({self.multiple_of})")
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
    url: str | None = Field(default=None, max_length=MAX_PATH_CHARS,
                            description="checkpoint location (path, file://, s3://); default: "
                            "<state dir>/jobs/<job>/ckpt; explicit ones under the tenant's prefix "
                            "<state dir>/tenants/<tenant>/ or one the admin granted")
    tiers: list[str | dict[str, Any]] | None = Field(
        default=None, min_length=1, max_length=MAX_TIERS,
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
            ok = not isinstance(v, bool) and math.isfinite(float(v)) and float(v) > 0
        except (TypeError, ValueError, OverflowError):
            ok = False
        if not ok:
            raise ValueError(f"expected a number of seconds > 0 or 'auto', got {v!r}")
        if v > MAX_INTERVAL_S:
            raise ValueError(f"expected at most {MAX_INTERVAL_S:g} seconds, got {v!r}")
        return float(v)

    @field_validator("tiers")
    @classmethod
    def _tiers(cls, v: list[Any] | None) -> list[Any] | None:
        if v is not None:
            from tidal.ckpt.errors import TierSpecError
            from tidal.ckpt.tiers.config import resolve

            try:
                resolve(v, default_keep=3)
            except TierSpecError as e:
                raise ValueError(str(e)) from None
        return v

    resume_from: str | None = Field(
        default=None, max_length=80,
        description="the id of an ended job of the same tenant whose checkpoint location this job takes over "
                    "(and resumes from); without it a job never shares a location with another job")

    @model_validator(mode="after")
    def _one_location(self) -> CheckpointSpec:
        if self.url is not None and self.tiers is not None:
            raise ValueError("give the location once: 'url' (one directory or bucket) or 'tiers' (a list)")
        if self.resume_from is not None and (self.url is not None or self.tiers is not None):
            raise ValueError("give 'resume_from' alone: the job uses the checkpoint location of the job it "
                             "resumes")
        return self


class JobSpec(_Strict):
    name: str = Field(description="a name: letters, digits, '.', '_', '-' (the job id is <name>-<n>)")
    kind: Literal["spot", "dedicated"] = "spot"
    priority: int = Field(default=0, ge=-1000, le=1000)
    gpus: Annotated[GpuRange, BeforeValidator(
        _gpus, json_schema_input_type=Annotated[int, Field(ge=1)] | GpuRange)]  # declared as accepted
    command: list[Annotated[str, Field(max_length=MAX_ARG_CHARS)]] | None = Field(
        default=None, min_length=1, max_length=MAX_ARGS,
        description="argument list; never run through a shell (give this or run)")
    run: str | None = Field(default=None, min_length=1, max_length=MAX_ARG_CHARS,
                            description="a shell script, instead of command: run as [bash, -c, RUN]")
    workdir: str | None = Field(default=None, max_length=MAX_PATH_CHARS,
                                description="absolute directory the ranks start in")
    env: dict[Annotated[str, Field(max_length=MAX_ENV_NAME_CHARS), AfterValidator(_env_name)],
              Annotated[str, Field(max_length=MAX_ENV_VALUE_CHARS)]] = Field(default_factory=dict,
                                                                              max_length=MAX_ENV)
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    max_restarts: int = Field(default=3, ge=0, le=1000)
    grace_s: float = Field(default=DEFAULT_GRACE_S, gt=0, le=3600,
                           description="seconds from a stop notice to SIGKILL")

    @model_validator(mode="wrap")
    @classmethod
    def _text(cls, data: Any, handler: Any) -> Any:
        """Refuse NUL bytes, lone surrogates, oversized strings and deep nesting anywhere, each error at
        its own path (``command[1]: NUL byte``), before the fields are looked at."""
        problems = text_problems(data)
        if problems:
            raise ValidationError.from_exception_data("JobSpec", [
                InitErrorDetails(type=PydanticCustomError("text", msg), loc=loc, input=None)
                for loc, msg in problems])
        return handler(data)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME_RE.match(v):
            raise ValueError("expected 1-63 letters, digits, '.', '_' or '-', starting with a letter or "
                             "digit")
        return v

    @field_validator("command", mode="before")
    @classmethod
    def _command(cls, v: Any) -> Any:
        if isinstance(v, str):
            raise ValueError("expected a list of arguments, e.g. [python, train.py, --steps, '100'] "
                             "(a command is never run through a shell; for a shell script, use run: instead)")
        return v

    @field_validator("command")
    @classmethod
    def _command_items(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and not v[0]:
            raise ValueError("the program (first argument) must not be empty")
        return v

    @model_validator(mode="after")
    def _run_or_command(self) -> JobSpec:
        """Exactly one of ``command`` and ``run``; a ``run`` script becomes ``command: [bash, -c, RUN]``."""
        if (self.command is None) == (self.run is None):
            both = "give command (an argument list) or run (a shell script), not both"
            none = "Field required: an argument list, e.g. [python, train.py] (or run: a shell script)"
            msg = both if self.run is not None else none
            raise ValidationError.from_exception_data("JobSpec", [
                InitErrorDetails(type=PydanticCustomError("command", msg), loc=("command",), input=None)])
        if self.run is not None:
            object.__setattr__(self, "command", ["bash", "-c", self.run])
        return self

    @field_validator("workdir")
    @classmethod
    def _workdir(cls, v: str | None) -> str | None:
        if v is not None and not v.startswith("/"):
            raise ValueError(f"expected an absolute path, got {v!r} (the CLI resolves paths relative to the "
                             "YAML file)")
        return v


def text_problems(data: Any, loc: tuple = (), depth: int = 0) -> list[tuple[tuple, str]]:
    """Where ``data`` holds text no spec may hold: ``[(loc, message)]``: a NUL byte, a lone surrogate, a
    string over ``MAX_TEXT_CHARS``, nesting deeper than ``MAX_DEPTH``."""
    out: list[tuple[tuple, str]] = []
    if depth > MAX_DEPTH:
        return [(loc, f"nested deeper than {MAX_DEPTH} levels")]
    if isinstance(data, str):
        if "\x00" in data:
            out.append((loc, "NUL byte"))
        if _SURROGATE.search(data):
            out.append((loc, "lone UTF-16 surrogate (not valid Unicode)"))
        if len(data) > MAX_TEXT_CHARS and (not loc or loc[0] not in ("command", "run")):
            out.append((loc, f"longer than {MAX_TEXT_CHARS} characters"))
    elif isinstance(data, dict):
        for k, v in data.items():
            key_loc = (*loc, str(k) if isinstance(k, str) and not text_problems(k) else "[key]")
            for kloc, msg in text_problems(k, key_loc, depth + 1):
                out.append((kloc, f"key: {msg}"))
            if not isinstance(k, str) or not text_problems(k):
                out.extend(text_problems(v, (*loc, k if isinstance(k, str) else str(k)), depth + 1))
    elif isinstance(data, list | tuple):
        for i, v in enumerate(data):
            out.extend(text_problems(v, (*loc, i), depth + 1))
    elif isinstance(data, float) and not math.isfinite(data):
        out.append((loc, f"{data!r} is not a number"))
    return out


_SURROGATE = re.compile("[\ud800-\udfff]")


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
