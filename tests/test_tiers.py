"""Tier lists without a server: spec errors at construction, per-tier schedule and retention across
several directory tiers, restore from the fastest tier that holds a step, and the status file."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest
import torch

from tidal import ckpt
from tidal.ckpt.format import manifest as mf
from tidal.ckpt.tiers.config import resolve
from tidal.ckpt.tiers.directory import shm_root_for


@pytest.fixture(autouse=True)
def _shm(tmp_path, monkeypatch):
    monkeypatch.setenv("TIDAL_SHM_DIR", str(tmp_path / "shm"))


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(16, 6, generator=g), "step": step}


def blank() -> dict:
    return {"w": torch.zeros(16, 6), "step": -1}


def flip(path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x01
    path.write_bytes(bytes(raw))


# -- spec errors: at construction, naming the spec and what was expected ---------------------------

BAD = [
    (["shm", "shmm"], r"tiers\[1\] 'shmm': not a tier; expected 'shm', a directory"),
    (["shm", "ckpt"], r"'ckpt': not a tier"),
    (["shm", "s3:/bucket/run"], r"'s3:/bucket/run': unknown scheme 's3:'; expected s3://bucket/prefix"),
    (["shm", "S3://bucket/run"], r"unknown scheme 'S3:'"),
    (["shm", "gs://bucket/run"], r"unknown scheme 'gs:'"),
    (["shm", "s3://My_Bucket/run"], r"'My_Bucket' is not a valid bucket name"),
    (["shm", "s3://bucket//run"], r"prefix 'run' has an empty|empty, '\.' or '\.\.' segment"),
    (["shm", "s3://bucket/a/../b"], r"'\.\.' segment"),
    (["shm", "peer"], r"nothing names this job's checkpoints.*'peer://NAME', set TIDAL_JOB_ID"),
    (["shm", {"kind": "peer", "agent": "localhost"}, "/x"], r"agent 'localhost': expected host:port"),
    (["shm", {"kind": "pear"}, "/x"], r"tiers\[1\].*unknown kind 'pear'; expected one of shm, dir, s3, peer"),
    (["shm", {"kind": "peer", "agnet": "h:1"}, "/x"], r"unknown option 'agnet'.*agent, peers"),
    (["shm", "peer://a b"], r"namespace 'a b' must be letters"),
    (
        ["shm", {"url": "/x", "evry": 5}],
        r"tiers\[1\] '/x': unknown option 'evry'; expected one of: url, every",
    ),
    (["shm", {"url": "s3://bucket/run", "endpiont": "http://x"}], r"unknown option 'endpiont'.*endpoint"),
    (["shm", {"url": "/x", "every": 0}], r"'every' must be an integer >= 1"),
    (["shm", {"url": "/x", "every": "5"}], r"'every' must be an integer >= 1"),
    (["shm", {"url": "/x", "keep": -1}], r"'keep' must be an integer >= 0"),
    ([{"url": "shm", "keep": 3}, "/x"], r"the shm tier keeps one step per staging slot"),
    (["shm", {"every": 2}], r"tiers\[1\].*a dict tier needs 'url'"),
    (["shm", 42], r"tiers\[1\] 42: expected a string"),
    (["shm", "/x", {"url": "/y", "name": "disk"}], r"two tiers are named 'disk'"),
    (["shm", "/x", "file:///x"], r"'/x' appears twice"),
    (["shm", "shm", "/x"], r"'shm' appears twice"),
    ([], r"tiers is empty"),
    ("shm,/x", r"tiers must be a list"),
    (["shm"], r"a list of only 'shm' needs a url"),
    (["shm", {"url": "s3://bucket/run", "part_size_bytes": 1024}], r"part_size_bytes must be >= 5 MiB"),
]


@pytest.mark.parametrize(("tiers", "match"), BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_tier_spec_errors_are_raised_at_construction(tmp_path, monkeypatch, tiers, match):
    monkeypatch.chdir(tmp_path)  # a relative directory a typo could create would land here
    monkeypatch.delenv("TIDAL_JOB_ID", raising=False)
    with pytest.raises(ckpt.TierSpecError, match=match):
        ckpt.Checkpointer(tiers=tiers)
    assert sorted(os.listdir(tmp_path)) == []  # nothing created, nothing written


def test_url_must_be_the_first_durable_tier(tmp_path):
    with pytest.raises(ckpt.TierSpecError, match=r"must be the first non-shm tier.*reorder"):
        ckpt.Checkpointer(tmp_path / "a", tiers=["shm", str(tmp_path / "b"), str(tmp_path / "a")])
    with pytest.raises(ckpt.TierSpecError, match="not both"):
        ckpt.Checkpointer(["shm", str(tmp_path / "a")], tiers=["shm", str(tmp_path / "a")])
    with pytest.raises(TypeError, match="needs a url or tiers"):
        ckpt.Checkpointer()


def test_a_relative_url_still_works(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with ckpt.Checkpointer("ckpt") as cp:
        cp.save(1, state(1)).wait()
    assert ckpt.steps("ckpt") == [1] and (tmp_path / "ckpt" / mf.step_dirname(1)).is_dir()


def test_defaults_names_and_schedule():
    home, cfgs = resolve(
        ["shm", "/a", "./b", {"url": "s3://bkt/run", "every": 5}, "s3://bkt/other"], default_keep=3
    )
    assert home == "/a"
    assert [(c.name, c.kind, c.every, c.keep) for c in cfgs] == [
        ("shm", "shm", 1, 3),
        ("disk", "dir", 1, 3),
        ("disk-2", "dir", 1, 3),
        ("s3", "s3", 5, 3),
        ("s3-2", "s3", 1, 3),
    ]
    assert cfgs[2].location == os.path.abspath("b")
    assert [i for i in range(12) if cfgs[3].due(i)] == [0, 5, 10]


# -- several directory tiers -----------------------------------------------------------------------

def test_schedule_retention_and_restore_across_directory_tiers(tmp_path):
    near, far = tmp_path / "near", tmp_path / "far"
    tiers = ["shm", {"url": str(near), "keep": 1}, {"url": str(far), "every": 2, "keep": 0, "name": "nfs"}]
    with ckpt.Checkpointer(tiers=tiers) as cp:
        hs = [cp.save(s, state(s)) for s in range(1, 6)]  # saves 0..4: nfs gets 0, 2, 4 (steps 1, 3, 5)
        for h in hs:
            h.wait()
        assert [h.committed for h in hs[:2]] == [["shm", "disk", "nfs"], ["shm", "disk"]]
    assert ckpt.steps([str(near)]) == [5] and ckpt.steps([str(far)]) == [1, 3, 5]  # a list: just those tiers
    assert ckpt.steps(tiers) == [1, 3, 4, 5]  # shm still holds 4 (one step per slot)
    st = cp.status()
    assert [(s.step, s.tiers) for s in st.steps] == [
        (1, ("nfs",)), (3, ("nfs",)), (4, ("shm",)), (5, ("shm", "disk", "nfs"))]
    assert st.newest_durable_step == 5 and st.durable_lag_steps == 0
    # Restore: the fastest tier holding the step serves it; the shm tier is keyed by the first durable one.
    stats = ckpt.LoadStats()
    target = blank()
    assert ckpt.load(tiers, target, stats=stats) == 5 and set(stats.bytes_by_tier) == {"shm"}
    shutil.rmtree(shm_root_for(near))  # node reboot
    stats = ckpt.LoadStats()
    assert ckpt.load(tiers, blank(), stats=stats) == 5 and set(stats.bytes_by_tier) == {"disk"}
    # A corrupt near copy falls back to the far one.
    man = mf.read(near / mf.step_dirname(5))
    flip(near / mf.step_dirname(5) / man.files[0]["name"], man.tensors["w"].pieces[0].start + 3)
    stats = ckpt.LoadStats()
    target = blank()
    assert ckpt.load(tiers, target, stats=stats) == 5
    assert torch.equal(target["w"], state(5)["w"]) and set(stats.bytes_by_tier) == {"disk", "nfs"}
    assert len(stats.fallbacks) == 1 and "tier 'disk'" in stats.fallbacks[0]
    assert ckpt.load(tiers, blank(), step=3) == 3  # only the far tier has it


def test_a_checkpointer_given_only_a_tier_list_and_the_url_form(tmp_path):
    d = tmp_path / "run"
    with ckpt.Checkpointer(["shm", str(d)]) as cp:
        assert cp.url == str(d) and cp.home == str(d)
        cp.save(1, state(1)).wait()
    assert ckpt.steps(d) == [1] and (shm_root_for(d) / mf.step_dirname(1)).exists()
    with ckpt.Checkpointer(d, tiers=["shm", str(d)]) as cp:  # the url may repeat the first durable tier
        assert cp.steps() == [1]


def test_without_shm_in_the_list_staging_stays_private(tmp_path):
    d = tmp_path / "run"
    with ckpt.Checkpointer(tiers=[str(d)]) as cp:
        h = cp.save(1, state(1))
        h.wait()
        assert h.committed == ["disk"] and cp.shm_tier is None
    assert not (shm_root_for(d) / mf.step_dirname(1)).exists()


# -- status ----------------------------------------------------------------------------------------

def test_status_file_is_written_atomically_and_reads_back(tmp_path):
    d = tmp_path / "run"
    t0 = time.time()
    with ckpt.Checkpointer(d, keep=2) as cp:
        for s in (1, 2, 3):
            cp.save(s, state(s)).wait()
        path = cp.status_path
    assert path == shm_root_for(d) / "status.json"
    assert [p.name for p in path.parent.iterdir() if p.name.endswith(".tmp")] == []
    doc = json.loads(path.read_text())
    assert doc["format"] == "tidal-ckpt-status" and doc["job"] == str(d)
    st = ckpt.read_status(path)
    assert st == ckpt.CheckpointStatus.from_dict(doc)
    assert [t.name for t in st.tiers] == ["shm", "disk"] and st.tier("disk").steps == (2, 3)
    assert st.tier("shm").steps == (2, 3) and st.tier("shm").keep == 2 and not st.tier("shm").durable
    assert st.newest_step == 3 and st.newest_durable_step == 3
    assert t0 <= st.newest_durable_unix_s <= time.time() and 0 <= st.durable_age_s < 60
    assert st.steps[-1].tiers == ("shm", "disk")


def test_status_counts_the_durable_lag_and_seeds_from_storage(tmp_path):
    d = tmp_path / "run"
    tiers = ["shm", {"url": str(d), "every": 3}]
    with ckpt.Checkpointer(tiers=tiers) as cp:
        for s in (1, 2, 3):
            cp.save(s, state(s)).wait()
        st = cp.status()
    assert st.newest_step == 3 and st.newest_durable_step == 1 and st.durable_lag_steps == 2
    assert [s.tiers for s in st.steps] == [("disk",), ("shm",), ("shm",)]
    with ckpt.Checkpointer(tiers=tiers, status_path=tmp_path / "elsewhere.json") as cp2:  # a new process
        st2 = cp2.status()
    assert st2.tier("disk").steps == (1,) and st2.tier("shm").steps == (2, 3)
    assert ckpt.read_status(tmp_path / "elsewhere.json").newest_durable_step == 1


def test_fast_only_wait_and_close_timeout_without_slow_tiers(tmp_path):
    with ckpt.Checkpointer(tmp_path / "run") as cp:
        h = cp.save(1, state(1))
        h.wait(timeout=30, fast_only=True)
        assert h.committed == ["shm", "disk"] and h.pending == []
        cp.wait(timeout_s=30)
        assert h.done()
    cp.close(timeout_s=1)  # closing twice is fine


def test_adjacent_runs_are_merged_and_gaps_kept():
    from tidal.ckpt.engine.reader import coalesce

    assert coalesce([0, 8, 16], 8, 100) == [(100, 24)]  # contiguous rows: one range (one GET)
    assert coalesce([0, 40, 80], 8, 100) == [(100, 8), (140, 8), (180, 8)]  # a column slice: never the gaps
    assert coalesce([0, 8, 40, 48], 8, 0) == [(0, 16), (40, 16)]


def test_s3_urls_parse_or_name_the_problem():
    from tidal.ckpt.tiers.s3 import parse_s3_url

    assert parse_s3_url("s3://bucket/a/b/") == ("bucket", "a/b")
    assert parse_s3_url("s3://my.bucket-1") == ("my.bucket-1", "")
    for bad in ("s3://ab/x", "s3://-bucket/x", "s3://bucket/a//b"):
        with pytest.raises(ckpt.TierSpecError, match=repr(bad)):
            parse_s3_url(bad)
