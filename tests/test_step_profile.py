"""``slake bench --profile-steps``: where a decode step's time goes (:mod:`slake.engines.transformers.step_profile`)."""

from __future__ import annotations

import json

import pytest

from slake.cli import main
from slake.engines.transformers.step_profile import CATEGORIES, category, profile_markdown, summarize


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("_evict_attend_kernel", "slake fused step"),
        ("_append_logits_kernel_0d1d2d", "slake fused step"),
        ("slake::fused_decode_step", "slake fused step"),
        ("nvjet_tst_64x8_64x16_4x1_v_bz_TNT", "matmul"),
        ("void gemv2T_kernel_val<int, int, __nv_bfloat16>", "matmul"),
        ("aten::mm", "matmul"),
        ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128>>", "attention"),
        ("fmha_cutlassF_bf16_aligned_64x128_rf_sm80", "attention"),  # memory-efficient attention, a cutlass kernel
        ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
        ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "other"),
    ],
)
def test_kernel_names_fall_in_their_category(name, expected):
    assert category(name) == expected


def test_a_summary_is_per_step_and_its_categories_add_up_to_the_busy_time():
    events = [
        ("_append_logits_kernel", 64, 400.0),
        ("_evict_attend_kernel", 64, 1600.0),
        ("void gemv2T_kernel_val<float>", 448, 11200.0),
        ("triton_poi_fused_mul_silu_0", 64, 128.0),
    ]
    p = summarize(events, steps=2, wall_ms=30.0, cuda=True)
    assert p["clock"] == "device" and p["steps"] == 2
    assert p["wall_ms_per_step"] == 15.0 and p["busy_ms_per_step"] == pytest.approx(6.664)
    assert p["launches_per_step"] == 320
    assert p["ms_per_step"]["slake fused step"] == pytest.approx(1.0)
    assert p["ms_per_step"]["matmul"] == pytest.approx(5.6)
    assert p["launches_per_category"]["slake fused step"] == 64
    assert sum(p["ms_per_step"].values()) == pytest.approx(p["busy_ms_per_step"])
    assert [k["name"] for k in p["top"]][:2] == ["void gemv2T_kernel_val<float>", "_evict_attend_kernel"]
    assert sum(k["share"] for k in p["top"]) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="at least one step"):
        summarize(events, steps=0, wall_ms=1.0, cuda=True)


def test_an_empty_device_profile_says_the_profiler_recorded_no_kernel():
    row = {"method": "snapkv", "budget": 8, "length": 64, "batch": 1, "compile": True, "kernels": "triton"}
    row["step_profile"] = summarize([], steps=1, wall_ms=1.0, cuda=True)
    md = profile_markdown([row])
    assert "snapkv@8, 64 tokens, batch 1, compiled, kernels triton" in md and "recorded no kernel" in md


def test_bench_profiles_the_decode_steps_it_is_asked_to(tmp_path, capsys):
    """Eager and compiled steps of a tiny model on the CPU: every profiled configuration has its summary in its row
    and in step_profile.md, with the compressed step's operators and the matrix products among them."""
    out = tmp_path / "b"
    argv = ["bench", "--methods", "full,snapkv", "--budget", "40", "--lengths", "96", "--random-model", "tiny"]
    argv += ["--device", "cpu", "--decode-steps", "2", "--warmup", "1", "--no-plots", "--no-progress", "--json"]
    assert main([*argv, "--profile-steps", "3", "--out", str(out)]) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    assert len(rows) == 2
    for r in rows:
        p = r["step_profile"]
        assert p["steps"] == 3 and p["clock"] == "cpu" and r["decode_steps"] == 2
        assert p["launches_per_step"] > 0 and p["busy_ms_per_step"] > 0 and p["wall_ms_per_step"] > 0
        assert set(p["ms_per_step"]) == set(CATEGORIES) and p["ms_per_step"]["matmul"] > 0
    names = {k["name"] for k in rows[1]["step_profile"]["top"]}
    assert "aten::mm" in names or "aten::bmm" in names
    md = (out / "step_profile.md").read_text()
    assert "## full, 96 tokens, batch 1, eager, kernels sdpa" in md  # one SDPA call per step, no kernel choice
    assert "## snapkv@40, 96 tokens, batch 1, eager, kernels torch" in md
    # rows without --profile-steps carry no profile, and the file is not written
    assert main([*argv, "--out", str(tmp_path / "c")]) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    assert all(r["step_profile"] is None for r in rows)
    assert not (tmp_path / "c" / "step_profile.md").exists()


def test_profile_steps_are_checked(tmp_path, capsys):
    base = ["bench", "--methods", "full", "--random-model", "tiny", "--lengths", "48", "--out", str(tmp_path)]
    assert main([*base, "--profile-steps", "-1"]) == 2
    assert "--profile-steps" in capsys.readouterr().err
    assert main([*base, "--engine", "vllm", "--profile-steps", "2"]) == 2
    assert "--profile-steps" in capsys.readouterr().err
