"""The fenced folded accept as the GPU tests (tests/test_fence_gpu.py) and the fence's
benchmark (bench/fence_cost.py) drive it."""

from __future__ import annotations

import torch

from sglang_dsv41_adapters import folded_fence
from sglang_dsv41_adapters.framework import runtime

STRIDE = 4  # verify tokens per request (gamma 3)


def fence_on():
    """Switch the fence on in this process, as the launcher and every rank do; its plan."""
    decision = runtime.decide({folded_fence.FLAG: "1"}, names=(folded_fence.NAME,))
    runtime.apply(decision)
    return decision.plans[folded_fence.NAME]



def folded_kwargs(bs: int, device) -> dict:
    """The worker's keyword arguments; the folded path reads only folded_accept and bs."""
    ids = torch.zeros(bs, STRIDE, dtype=torch.int64, device=device)
    return dict(
        folded_accept=True, bs=bs, verify_ids_2d=ids, target_logits=None, draft_block=None, sampling_info=None,
        draft_input=None, layout=None, prefix_lens=torch.zeros(bs, dtype=torch.int64, device=device),
        draft_tokens=ids[:, 1:],
    )
