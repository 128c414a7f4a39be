"""The measured speculation rule on CUDA (graphs on, async scheduling on): with every draft
rejected (replay, p = 0) most steps run as plain decodes (the decode CUDA graphs), with every
draft right (p = 1) most steps verify drafts; greedy tokens equal the run without."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.test_spec_decode_rule import rule_shares_in_engine

pytestmark = pytest.mark.gpu


def test_rule_switches_speculation_by_acceptance_on_cuda(tiny_model_path, tmp_path: Path) -> None:
    shares = rule_shares_in_engine(
        tiny_model_path("llama"), tmp_path, device="cuda", gpu_memory_utilization=0.2
    )
    print("share of steps with drafts by p:", shares)
    assert shares[0.0] < 0.3
    assert shares[1.0] > 0.65
