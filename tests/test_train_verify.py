"""``tidal verify-resume``'s planning and comparison, on made-up records, and where its segments run
(no processes)."""

from __future__ import annotations

import pytest

from tidal.bench.runs import Segment, SegmentResult, per_step, segment_devices
from tidal.bench.verify import VerifyConfig, compare, parse_plan
from tidal.train.data import BatchSizeError


def result(seg: Segment, steps: dict[int, tuple[list[list[int]], float]], codes=None) -> SegmentResult:
    """A finished segment whose rank r consumed ``steps[s][0][r]`` at step s; rank 0 reports the loss."""
    res = SegmentResult(seg, codes or [0] * seg.world, 0.0, None, 1.0)
    for r in range(seg.world):
        res.records[r] = [{"event": "step", "time": 0.5, "rank": r, "step": s, "loss": loss, "data_rank": r,
                           "indices": idx[r]}
                          for s, (idx, loss) in sorted(steps.items())]
    return res


def test_plan_parsing_and_checks():
    assert parse_plan("4:fsdp, 2:ddp,3") == [(4, "fsdp"), (2, "ddp"), (3, "fsdp")]
    with pytest.raises(ValueError, match="plan item 'x:ddp': expected WORLD:LAYOUT"):
        parse_plan("x:ddp")
    with pytest.raises(BatchSizeError, match="global batch 24 cannot be split over 5"):
        VerifyConfig(plan=[(4, "fsdp"), (5, "ddp")]).check()
    with pytest.raises(ValueError, match="layout 'single' runs on 1 rank, not 2"):
        VerifyConfig(plan=[(2, "single"), (1, "single")]).check()
    with pytest.raises(ValueError, match="layout 'tp' .* needs an even world size"):
        VerifyConfig(plan=[(3, "tp"), (2, "ddp")]).check()
    with pytest.raises(ValueError, match=r"segment ddp x2: no rank 2 \(it has 2: 0..1\)"):
        Segment(2, "ddp", stop_at=1, notice_ranks=[2])
    with pytest.raises(ValueError, match="segment notice 'mail': expected 'sigterm' or 'file'"):
        Segment(2, "ddp", stop_at=1, notice="mail")


def test_notices_are_spread_and_alternate_between_sigterm_and_the_file():
    segs = VerifyConfig(steps=24).segments()
    assert [(s.world, s.layout, s.stop_at, s.notice, s.notice_ranks) for s in segs] == [
        (4, "fsdp", 7, "sigterm", [3]), (2, "ddp", 15, "file", None), (3, "fsdp", None, "sigterm", None)]


def test_compare_checks_every_step_s_global_batch_and_the_loss():
    cfg = VerifyConfig(steps=3, baseline=(2, "fsdp"), plan=[(2, "fsdp"), (1, "ddp")], rtol=1e-3)
    base = [result(Segment(2, "fsdp"), {1: ([[0, 1], [2, 3]], 5.0), 2: ([[4, 5], [6, 7]], 4.0),
                                        3: ([[8, 9], [10, 11]], 3.0)})]
    ok = [
        result(
            Segment(2, "fsdp", stop_at=1), {1: ([[0, 1], [2, 3]], 5.0), 2: ([[4, 5], [6, 7]], 4.0)}, [75, 75]
        ),
        result(Segment(1, "ddp"), {3: ([[8, 9, 10, 11]], 3.0 * (1 + 1e-5))}),
    ]
    assert per_step(ok)[3] == {"indices": [8, 9, 10, 11], "loss": 3.0 * (1 + 1e-5), "segment": 1}
    r = compare(cfg, base, ok)
    assert r["ok"] and r["indices_identical"] and r["bitwise_equal_before_first_change"]
    assert r["max_rel_loss_diff"] == pytest.approx(1e-5) and r["max_rel_loss_diff_step"] == 3

    swapped = ok[:1] + [result(Segment(1, "ddp"), {3: ([[8, 9, 11, 10]], 3.0)})]
    r = compare(cfg, base, swapped)
    assert not r["ok"] and r["first_index_mismatch_step"] == 3

    missing = ok[:1]
    r = compare(cfg, base, missing)
    assert not r["ok"] and r["missing_steps"]["resumed"] == [3]

    drift = ok[:1] + [result(Segment(1, "ddp"), {3: ([[8, 9, 10, 11]], 3.01)})]
    r = compare(cfg, base, drift)
    assert not r["ok"] and r["indices_identical"] and r["max_rel_loss_diff"] > 1e-3


def test_a_segment_runs_on_the_gpus_this_process_sees_when_there_are_enough(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert segment_devices(2) == [2, 3] and segment_devices(1) == [2]
    assert segment_devices(3) is None  # too few: CPU slots (gloo)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert segment_devices(1) is None
