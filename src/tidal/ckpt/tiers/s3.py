"""The S3 tier: committed steps in S3-compatible object storage, through obstore.

The layout mirrors the directory tiers under ``s3://bucket/prefix/`` (manifest PUT last). Credentials
and endpoint from the ``AWS_*`` variables or the tier's options (``OPTIONS``); writes are one PUT or a
multipart upload, reads ranged GETs, each request retried by the client; what still fails raises
``TierError`` (docs/checkpoint.md, "S3")."""

from __future__ import annotations

import datetime as _dt
import os
import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from tidal.ckpt.errors import TierError, TierSpecError
from tidal.ckpt.format import manifest as mf
from tidal.ckpt.tiers.protocol import TruncatedRead

if TYPE_CHECKING:
    from obstore import ObjectMeta
    from obstore.store import ClientConfig, RetryConfig, S3Config

_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")
MIB = 1 << 20

OPTIONS = {
    "endpoint": "endpoint URL (default: AWS_ENDPOINT_URL)",
    "region": "region (default: AWS_REGION, else us-east-1)",
    "part_size_bytes": "multipart part size and parallel GET split, bytes (default 16 MiB)",
    "concurrency": "parallel requests per upload or read (default 8)",
    "retries": "client retries per request (default 3)",
    "retry_timeout_s": "give up retrying one request after this many seconds (default 20)",
    "connect_timeout_s": "TCP connect timeout, seconds (default 2)",
}


def parse_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` -> (bucket, "some/prefix"); TierSpecError naming the URL if malformed."""
    if not url.startswith("s3://"):
        raise TierSpecError(f"tier {url!r}: expected s3://bucket/prefix")
    rest = url[len("s3://"):]
    bucket, _, prefix = rest.partition("/")
    if not _BUCKET.match(bucket) or ".." in bucket:
        raise TierSpecError(f"tier {url!r}: {bucket!r} is not a valid bucket name (3-63 characters: "
                            "lowercase letters, digits, '.', '-'); expected s3://bucket/prefix")
    prefix = prefix[:-1] if prefix.endswith("/") else prefix
    parts = prefix.split("/") if prefix else []
    if any(p in ("", ".", "..") for p in parts):
        raise TierSpecError(f"tier {url!r}: prefix {prefix!r} has an empty, '.' or '..' segment")
    return bucket, prefix


def _seconds(v: float) -> _dt.timedelta:
    return _dt.timedelta(seconds=float(v))


def _brief(e: BaseException) -> str:
    """obstore's messages carry a multi-line debug dump; keep the first line, plus the S3 error code."""
    text = str(e)
    first = text.split("\n", 1)[0].strip()
    code = re.search(r"<Code>([^<]+)</Code>", text)
    if code and code.group(1) not in first:
        first += f" ({code.group(1)})"
    return first[:400]


class S3Tier:
    """Committed steps under ``s3://bucket/prefix``. Thread-safe (the obstore client is)."""

    kind = "s3"
    durable = True
    fast = False  # an upload queue feeds it (remote.RemoteQueue)
    poll_s = (0.02, 0.5)

    def __init__(self, url: str, *, name: str = "s3", endpoint: str | None = None, region: str | None = None,
                 part_size_bytes: int = 16 * MIB, concurrency: int = 8, retries: int = 3,
                 retry_timeout_s: float = 20.0, connect_timeout_s: float = 2.0) -> None:
        import obstore
        from obstore.store import S3Store

        self._ob = obstore  # imported here: the control plane parses s3:// URLs without loading it
        self.name = name
        self.bucket, self.prefix = parse_s3_url(url)
        self.location = f"s3://{self.bucket}/{self.prefix}".rstrip("/")
        if part_size_bytes < 5 * MIB:
            raise TierSpecError(f"tier {url!r}: part_size_bytes must be >= 5 MiB (an S3 limit), got "
                                f"{part_size_bytes}")
        if concurrency < 1:
            raise TierSpecError(f"tier {url!r}: concurrency must be >= 1, got {concurrency}")
        self.part_size_bytes, self.concurrency = int(part_size_bytes), int(concurrency)
        env = os.environ
        self.endpoint = endpoint or env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
        config: S3Config = {}
        if self.endpoint:
            config["endpoint"] = self.endpoint
        config["region"] = region or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1"
        client: ClientConfig = {
            "allow_http": bool(self.endpoint and self.endpoint.startswith("http://")),
            "connect_timeout": _seconds(connect_timeout_s),
            "timeout": _seconds(max(60.0, retry_timeout_s)),
        }
        retry: RetryConfig = {"max_retries": int(retries), "retry_timeout": _seconds(retry_timeout_s),
                 "backoff": {"init_backoff": _seconds(0.05), "max_backoff": _seconds(2.0), "base": 2}}
        try:
            self._store = S3Store(self.bucket, prefix=self.prefix or None, config=config,
                                  client_options=client, retry_config=retry)
        except Exception as e:  # obstore raises its own configuration errors
            raise TierSpecError(f"tier {url!r}: {_brief(e)}") from None
        self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix=f"tidal-s3-{name}")

    def __repr__(self) -> str:
        return f"S3Tier({self.name!r}, {self.location!r})"

    def _key(self, step: int, name: str) -> str:
        return f"{mf.step_dirname(step)}/{name}"

    def where(self, step: int, name: str | None = None) -> str:
        return f"{self.location}/{mf.step_dirname(step)}" + (f"/{name}" if name else "")

    def _fail(self, e: BaseException, what: str) -> OSError:
        if isinstance(e, FileNotFoundError):
            return FileNotFoundError(2, f"{what}: not found", what)
        text = _brief(e)
        hint = ""
        if "error sending request" in text or "onnect" in text or "imed out" in text:
            hint = f"; is the endpoint {self.endpoint or '(AWS default)'} reachable? (AWS_ENDPOINT_URL)"
        elif "NoSuchBucket" in text:
            hint = f"; bucket '{self.bucket}' does not exist at {self.endpoint or 'AWS'}"
        elif re.search(r"InvalidAccessKeyId|SignatureDoesNotMatch|AccessDenied|\b403 Forbidden", text):
            hint = "; check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY"
        return TierError(f"tier '{self.name}' ({what}): {text}{hint}")

    def check(self) -> None:
        try:
            self._ob.list_with_delimiter(self._store, None)
        except Exception as e:
            raise self._fail(e, self.location) from None

    # -- listing -----------------------------------------------------------------------------------
    def _objects(self, prefix: str | None = None) -> list[ObjectMeta]:
        try:
            return [o for batch in self._ob.list(self._store, prefix=prefix, chunk_size=1000) for o in batch]
        except Exception as e:
            raise self._fail(e, self.location + ("/" + prefix if prefix else "")) from None

    def _by_step(self) -> dict[int, dict[str, ObjectMeta]]:
        out: dict[int, dict[str, ObjectMeta]] = {}
        for o in self._objects():
            d, _, n = o["path"].partition("/")
            s = mf.parse_step_dirname(d)
            if s is not None and n and "/" not in n:
                out.setdefault(s, {})[n] = o
        return out

    def step_files(self) -> dict[int, set[str]]:
        return {s: set(objs) for s, objs in self._by_step().items()}

    def committed(self) -> dict[int, float]:
        return {s: objs[mf.MANIFEST]["last_modified"].timestamp()
                for s, objs in self._by_step().items() if mf.MANIFEST in objs}

    def committed_steps(self) -> list[int]:
        return sorted(self.committed())

    def list_files(self, step: int) -> set[str]:
        return set(self.file_sizes(step))

    def file_sizes(self, step: int) -> dict[str, int]:
        """Object name -> size in bytes, for one step (one LIST)."""
        objects = self._objects(mf.step_dirname(step) + "/")
        return {o["path"].rsplit("/", 1)[-1]: int(o["size"]) for o in objects}

    # -- small objects -----------------------------------------------------------------------------
    def read_bytes(self, step: int, name: str) -> bytes:
        try:
            return bytes(self._ob.get(self._store, self._key(step, name)).bytes())
        except Exception as e:
            raise self._fail(e, self.where(step, name)) from None

    def write_bytes(self, step: int, name: str, data: bytes) -> None:
        self.write_top(self._key(step, name), data)

    def read_top(self, name: str, limit: int = 1 << 16) -> bytes | None:
        """A small object beside the steps (``<prefix>/<name>``, e.g. the fence); None when there is none.
        ``TierError`` when it cannot be read, ``ValueError`` when it is larger than ``limit`` bytes."""
        where = f"{self.location}/{name}"
        try:
            got = self._ob.get(self._store, name)
            size = int(got.meta["size"])
            if size > limit:
                raise ValueError(f"{where}: {size} bytes, more than {limit}")
            return bytes(got.bytes())
        except ValueError:
            raise
        except Exception as e:
            err = self._fail(e, where)
            if isinstance(err, FileNotFoundError):
                return None
            raise err from None

    def write_top(self, name: str, data: bytes) -> None:
        """Write a small object beside the steps (``<prefix>/<name>``), in one PUT (atomic on S3)."""
        try:
            self._ob.put(self._store, name, data, use_multipart=False)
        except Exception as e:
            raise self._fail(e, f"{self.location}/{name}") from None

    def read_manifest(self, step: int) -> mf.Manifest:
        return mf.read_object(lambda: self.read_bytes(step, mf.MANIFEST), self.where(step, mf.MANIFEST), step)

    # -- data --------------------------------------------------------------------------------------
    def write_file(self, step: int, name: str, data: memoryview) -> None:
        big = len(data) > self.part_size_bytes
        try:
            self._ob.put(self._store, self._key(step, name), data, use_multipart=big,
                        chunk_size=self.part_size_bytes, max_concurrency=self.concurrency)
        except Exception as e:
            raise self._fail(e, self.where(step, name)) from None

    def open_file(self, step: int, name: str) -> _S3Reader:
        return _S3Reader(self, self._key(step, name), self.where(step, name))

    # -- removal -----------------------------------------------------------------------------------
    def _delete(self, keys: list[str]) -> None:
        for i in range(0, len(keys), 1000):
            try:
                self._ob.delete(self._store, keys[i : i + 1000])
            except Exception as e:
                raise self._fail(e, f"{self.location}/{keys[i]}") from None

    def remove_file(self, step: int, name: str) -> None:
        self._delete([self._key(step, name)])

    def remove_step(self, step: int) -> None:
        self.remove_file(step, mf.MANIFEST)
        self._delete([o["path"] for o in self._objects(mf.step_dirname(step) + "/")])


class _S3Reader:
    """Ranged GETs of one object: each range exactly, long ones split and fetched in parallel."""

    def __init__(self, tier: S3Tier, key: str, where: str) -> None:
        self.tier, self.key, self.where = tier, key, where

    def _get(self, offset: int, out: memoryview) -> None:
        try:
            b = self.tier._ob.get_range(self.tier._store, self.key, start=offset, end=offset + len(out))
        except Exception as e:
            if "InvalidRange" in str(e) or "416" in str(e):  # the range starts past the end
                raise TruncatedRead(offset, len(out), 0) from None
            raise self.tier._fail(e, self.where) from None
        got = memoryview(b)
        if len(got) != len(out):
            raise TruncatedRead(offset, len(out), len(got))
        out[:] = got

    def read_ranges(self, ranges: Sequence[tuple[int, int]], out: memoryview) -> None:
        part = self.tier.part_size_bytes
        jobs, pos = [], 0
        for offset, length in ranges:
            for a in range(0, length, part):
                n = min(part, length - a)
                jobs.append((offset + a, out[pos + a : pos + a + n]))
            pos += length
        if len(jobs) == 1:
            self._get(*jobs[0])
            return
        for f in [self.tier._pool.submit(self._get, o, mv) for o, mv in jobs]:
            f.result()

    def close(self) -> None:
        pass
