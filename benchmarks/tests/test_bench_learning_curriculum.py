"""The math_gain suite's arms for learning more per sample: present, loadable, one change each."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from veriloop.configs.loader import load_config

ROOT = Path(__file__).resolve().parents[2]
NEW = ("grpo_p16_gate", "opsd_p16", "opsd_gate_p16", "semi_opd_p16", "opsd_p16_v2")


def _suite() -> dict:
    sys.path.insert(0, str(ROOT / "benchmarks"))  # it imports its sibling learning_report
    try:
        spec = importlib.util.spec_from_file_location(
            "bench_learning", ROOT / "benchmarks" / "bench_learning.py"
        )
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return module.SUITES["math_gain"]


def test_the_arms_share_grpo_p16_v2s_setting_and_load():
    spec = _suite()
    arms = {label: (config, overrides) for label, config, overrides in spec["arms"]}
    base_config, base = arms["grpo_p16_v2"]
    common = [o for o in spec["common"] if "vllm" not in o]  # the sampler choice needs vLLM installed
    loaded = {}
    for label in ("grpo_p16_v2", *NEW):
        config, overrides = arms[label]
        assert config == base_config and overrides[: len(base)] == base  # the same setting, then the change
        loaded[label] = load_config(config, [*overrides, *common])
    assert loaded["grpo_p16_gate"].curriculum.gate and loaded["grpo_p16_gate"].curriculum.pools_enabled
    assert loaded["opsd_p16"].algo.distill_coef > 0 and not loaded["opsd_p16"].curriculum.enabled
    assert loaded["opsd_gate_p16"].algo.distill_coef > 0 and loaded["opsd_gate_p16"].curriculum.gate
    assert not loaded["grpo_p16_v2"].curriculum.enabled and loaded["grpo_p16_v2"].algo.distill_coef == 0
    # semi_opd_p16 is opsd_p16 but for the sampler: the initial student's weights, frozen
    semi, opsd = loaded["semi_opd_p16"].algo, loaded["opsd_p16"].algo
    assert semi.frozen_sampler and not opsd.frozen_sampler and semi.distill_coef == opsd.distill_coef
    assert arms["semi_opd_p16"][1] == [*arms["opsd_p16"][1][:-1], "algo.preset=semi_opd"]
    # its on-policy control is opsd_p16 re-run with the same code: the same overrides
    assert arms["opsd_p16_v2"] == arms["opsd_p16"]
