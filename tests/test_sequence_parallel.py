"""Ulysses sequence parallelism (``modules/sequence_parallel.py``): 2 CPU processes over gloo share one video's
tokens, and a Wan transformer's forward and backward equal the one-process result.

Tolerances: the output to 1e-6 absolute (observed: bitwise) — every head still attends over the whole sequence with
the same SDPA kernel after the all-to-all, and everything else is per token; the gradients, summed over the group,
to 1e-5 of their largest entry (observed ~1e-7 of it) — each process accumulates its own tokens' share and the sum
adds the two partial float32 sums in another order than one process does.
"""
from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.conftest import TINY_WAN

pytestmark = pytest.mark.timeout(300)


def _forward_backward(model, latents, timesteps, text):
    out = model(latents, timesteps, text, return_dict=False)[0]
    (out.double() ** 2).mean().backward()
    return out.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def _compare(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from posttrain.modules import presets
        from posttrain.modules.sequence_parallel import enable_sequence_parallel, reduce_sequence_gradients, \
            sequence_mesh

        torch.manual_seed(0)
        alone = presets.build_model("wan_t2v", preset=TINY_WAN)
        shared = copy.deepcopy(alone)
        mesh = sequence_mesh(world)
        enable_sequence_parallel(shared, mesh)
        noise = torch.Generator().manual_seed(1)  # the same sample on both processes: they share it
        latents = torch.randn(2, 16, 3, 8, 8, generator=noise)  # 3 x 4 x 4 = 48 tokens after the 1x2x2 patches
        timesteps, text = torch.tensor([300.0, 700.0]), torch.randn(2, 7, 32, generator=noise)
        out, grads = _forward_backward(alone, latents, timesteps, text)
        out_sp, grads_sp = _forward_backward(shared, latents, timesteps, text)
        partial = max((grads[k] - grads_sp[k]).abs().max().item() for k in grads)
        reduce_sequence_gradients(shared, mesh)
        grads_sp = {name: p.grad for name, p in shared.named_parameters()}
        scale = max(g.abs().max().item() for g in grads.values())
        worst = max((grads[k] - grads_sp[k]).abs().max().item() for k in grads)
        assert (out - out_sp).abs().max().item() <= 1e-6
        assert worst <= 1e-5 * scale, (worst, scale)
        assert partial > 1e-2 * scale, partial  # one process's tokens alone are not the gradient
        # Ulysses gives each process whole heads: 3 heads over 2 processes are refused, naming the setting
        with pytest.raises(ValueError, match=r"sequence_parallel=2 must divide the model's 3 attention heads"):
            enable_sequence_parallel(presets.build_model("wan_t2v", preset={**TINY_WAN, "num_attention_heads": 3}),
                                     mesh)
    finally:
        dist.destroy_process_group()


def test_wan_forward_and_backward_under_two_way_sequence_parallelism_equal_one_process():
    """A tiny Wan T2V transformer, 48 tokens of a 3x8x8 latent video, 2 heads: the same sample on both processes,
    each holding 24 tokens; output and (group-summed) gradients equal one process's (tolerances above). A degree
    that does not divide the heads is refused."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_compare, args=(2, port), nprocs=2)



def test_finetune_under_two_way_sequence_parallelism_follows_one_process(tmp_path):
    """``ShardedExpertsStrategy(sequence_parallel: 2)`` on 2 processes is one data-parallel rank: both processes draw
    the same samples and noise and share each video's tokens, so 2 finetune iterations end where one process ends
    (to 5e-5, the tolerance of ZeRO against DDP: other reduction orders, amplified by Adam for the smallest
    gradients), generator and EMA."""
    import helpers_strategy as h

    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    for folder, devices, degree in ((one, 1, 1), (two, 2, 2)):
        done = h.fit(h.config(folder, zero_stage=None, max_steps=2, devices=devices, sharding_strategy=True,
                              sequence_parallel=degree, ema_decay=0.9))
        assert done.returncode == 0, done.stderr[-5000:]
    said = "sequence parallel: groups of 2 processes share each sample's tokens in ['transformer'"
    assert said in done.stdout + done.stderr, done.stderr[-3000:]
    for component in ("transformer", "transformer_ema"):
        a, b = (h.weights(os.path.join(f, "ckpt", "last.ckpt"), component) for f in (one, two))
        assert a.keys() == b.keys() and a
        worst = max((a[k] - b[k]).abs().max().item() for k in a)
        assert worst <= 5e-5, (component, worst)
