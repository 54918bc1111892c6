"""Rank code for tests/test_graph_key.py and bench/graph_key_cost.py (harness.ranks.run_ranks,
sglang 0.5.23): the report's site 30:pack-decode-graph-key on real decode forwards.

Each step is the real `ModelRunner._forward_raw` on a model runner holding the real
`DecodeCudaGraphRunner` (both built with object.__new__ and only the state their code reads):
the real `can_run_graph` decides replay or eager from the batch size, the real `execute`
calls the real `load_batch`, whose key is the engine's own (the batch size padded to the
captured sizes). What the runner would do on the device (buffer fills, attention metadata,
the replay itself, the eager forward) is a stand-in that does nothing. The TP group is a real
sglang GroupCoordinator over gloo, installed as the runtime context's TP group (what the
report's compare takes without DP attention: graph_key.batch_group).

Skews on rank 1, at the steps listed: "tier" a batch one request larger (5 instead of 4:
key 8 instead of 4), "eager" a batch larger than the largest captured size (20: can_run_graph
refuses, the forward runs eager).
"""

from __future__ import annotations

import contextlib
import io
import time
from types import SimpleNamespace

import torch
from tests.log_lines import untimed

CAPTURE_BS = [1, 2, 4, 8, 16]
BS = 4
SKEWED_BS = {"tier": 5, "eager": 20}


def _replayed_logits(key, forward_batch):
    """What a replay of the graph captured for `key` returns: logits for its padded rows."""
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput

    return LogitsProcessorOutput(next_token_logits=torch.zeros(key.size, 1))


def _graph_runner(model_runner):
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner

    gr = object.__new__(DecodeCudaGraphRunner)
    state = dict(
        model_runner=model_runner, capture_bs=CAPTURE_BS, max_bs=CAPTURE_BS[-1], captured_req_width=1,
        disable_padding=False, require_mlp_tp_gather=False, require_mlp_sync=False, ragged_verify_mode=False,
        enable_pdmux=False, enable_two_batch_overlap=False, is_encoder_decoder=False, record_nolora_graph=False,
        attention_graph_variants=None, dllm_uses_input_embeds=False, dllm_input_preparation=None,
        capture_forward_mode=None, capture_hidden_mode=0, _early_verify_metadata=None, _skips_prefilled_inputs=False,
        _draft_metadata_glue=False, _target_metadata_glue=False, in_graph_metadata_prep_done=None,
        is_dllm=False, attn_backend=SimpleNamespace(shared_read_ends=lambda mode: None),
        deepep_adapter=SimpleNamespace(replay=lambda: None),
        buffers=SimpleNamespace(num_token_non_padded=None),
        # the device work: nothing to do on this CPU stand-in
        buffer_registry=SimpleNamespace(fill_from=lambda *a, **k: None),
        backend=SimpleNamespace(replay_session=contextlib.nullcontext, replay=_replayed_logits),
        _init_replay_attn_metadata=lambda *a, **k: None,
    )
    for name, value in state.items():
        setattr(gr, name, value)
    gr.model_context = contextlib.nullcontext
    return gr


def _model_runner():
    from sglang.srt.model_executor.model_runner import ModelRunner

    mr = object.__new__(ModelRunner)
    state = dict(
        device="cpu", is_draft_worker=False, hisparse_coordinator=None, attn_backend=None, device_timer=None,
        model=SimpleNamespace(shared_experts_config=None),
        spec_algorithm=SimpleNamespace(is_dflash_family=lambda: False, is_ngram=lambda: False),
        pp_group=SimpleNamespace(is_last_rank=True),
        prefill_cuda_graph_runner=None,
        eager_runner=SimpleNamespace(execute=lambda fb, pp_proxy_tensors=None: "eager"),
        _prepare_eager_forward_batch=lambda fb: None, _maybe_execute_deferred_mamba_cow_and_clear=lambda fb: None,
    )
    for name, value in state.items():
        setattr(mr, name, value)
    mr.decode_cuda_graph_runner = _graph_runner(mr)
    return mr


def _batch(bs: int):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return SimpleNamespace(
        forward_mode=ForwardMode.DECODE, batch_size=bs, replace_embeds=None, spec_info=None, encoder_lens=None,
        capture_hidden_mode=0, input_ids=torch.zeros(bs, dtype=torch.int64), positions=torch.zeros(bs, dtype=torch.int64),
        needs_forward_metadata_init=lambda: True, global_num_tokens_cpu=None, lora_ids=None,
        input_embeds=None, can_run_decode_cuda_graph=True, moe_num_token_non_padded=None)


def _as_engine_tp_group(group):
    """The runtime context's TP and attention-TP group (what get_tp_group() and graph_key.batch_group read)."""
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(tp_group=group, attn_tp_group=group)  # no DP attention: one batch


def _no_published_config():
    """_forward_raw selects the model's layout in the runtime config the server publishes at
    start-up (get_model().override(...)); none is published here: a layout that selects nothing."""
    from sglang.srt.model_executor import model_runner

    model_runner.get_model = lambda: SimpleNamespace(override=lambda **kwargs: contextlib.nullcontext())


def graph_key_case(rank, world_size, n, skews, every=50):
    """skews: [[kind or None, [skewed steps]]]; each run once with the report off, once on.
    Returns, per run, what each step's forward did on this rank and the site's counters."""
    from sglang.srt.model_executor.model_runner import ModelRunner

    from harness.nccl import make_group
    from sglang_dsv41_adapters import tp_divergence as t
    from sglang_dsv41_adapters.framework import runtime
    from sglang_dsv41_adapters.tp_divergence import divergence, graph_key

    _as_engine_tp_group(make_group(rank, world_size, nccl=False)[0])
    _no_published_config()
    runner = _model_runner()
    out = {}
    for report in (False, True):
        runtime.revert()
        decision = runtime.decide({t.FLAG: "1", t.EVERY_FLAG: str(every)} if report else {},
                                  names=("rank0_broadcast", t.NAME))
        runtime.apply(decision)
        patched = hasattr(vars(ModelRunner)["_forward_raw"], "__wrapped__")
        for kind, skewed in skews:
            divergence.reset()
            printed = io.StringIO()
            keys = []
            with contextlib.redirect_stderr(printed):
                for i in range(n):
                    bs = SKEWED_BS[kind] if rank == 1 and i in skewed else BS
                    done = ModelRunner._forward_raw(runner, _batch(bs), None)
                    keys.append(runner.decode_cuda_graph_runner._replay_graph_key.size
                                if done.can_run_graph else graph_key.EAGER)
                divergence.flush()
            out[f"{kind}/{report}"] = {
                "state": decision.outcomes[1].state, "patched": patched, "keys": keys,
                "totals": divergence.totals() if report else {},
                "lines": [line for line in untimed(printed.getvalue()) if "tp_divergence site=" in line]}
    runtime.revert()
    return out


def cost_case(rank, world_size, steps, reps):
    """Host time per decode step (us, median of reps): the forward above with the report
    off and on, and the bare collective (one int64 broadcast on the same group), interleaved."""
    import statistics

    from sglang.srt.model_executor.model_runner import ModelRunner

    from harness.nccl import make_group
    from sglang_dsv41_adapters import tp_divergence as t
    from sglang_dsv41_adapters.framework import runtime

    group, _ = make_group(rank, world_size, nccl=False)
    _as_engine_tp_group(group)
    _no_published_config()
    runner, batch = _model_runner(), _batch(BS)
    value = torch.zeros(1, dtype=torch.int64)
    times = {"forward off": [], "forward on": [], "bare broadcast": []}

    def timed(step):
        start = time.perf_counter()
        for _ in range(steps):
            step()
        return (time.perf_counter() - start) / steps * 1e6

    with contextlib.redirect_stderr(io.StringIO()):
        for _ in range(reps):
            for report in (False, True):
                runtime.revert()
                runtime.apply(runtime.decide({t.FLAG: "1"} if report else {}, names=("rank0_broadcast", t.NAME)))
                times[f"forward {'on' if report else 'off'}"].append(
                    timed(lambda: ModelRunner._forward_raw(runner, batch, None)))
            times["bare broadcast"].append(timed(lambda: group.broadcast(value, src=0)))
    runtime.revert()
    return {k: statistics.median(v) for k, v in times.items()}
