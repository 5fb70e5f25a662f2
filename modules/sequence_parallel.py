"""Ulysses sequence parallelism for a generator's self-attention: k processes share one sample's tokens.

Each process of a sequence-parallel group holds 1/k of a video's tokens through the transformer blocks (patch
embedding, norms, feed-forward and cross-attention to the replicated text are per token); around self-attention an
all-to-all turns the sequence shards into head shards (every process then attends over the whole sequence for 1/k
of the heads) and back. The output is gathered before the final projection, so the model's result is the
one-process result on every process of the group.

This is diffusers' own context parallelism (``ContextParallelConfig(ulysses_degree=k)``, the model's ``_cp_plan``,
its Ulysses attention over the ``native`` SDPA backend): the maintained implementation that already knows where a
Wan transformer's sequence is split (hidden states entering ``blocks.0``, the RoPE tables) and gathered
(``proj_out``). ``enable_parallelism`` itself cannot run on the CPU (it places the model on
``rank % accelerator count`` devices, zero there), so ``enable_sequence_parallel`` does its three steps with the
mesh given: the config set up on it, every attention processor pointed at it, the split/gather hooks applied.
(yunchang 0.6.4's ``UlyssesAttention`` was the other candidate: its CPU attention types run its *ring* kernel over
the whole world group, which is wrong inside an all-to-all; its ``SeqAllToAll4D`` alone would have meant writing the
Wan processor and the split/gather by hand.)

Gradients: every process backpropagates its own tokens, so a parameter's gradient is the sum over the group
(``reduce_sequence_gradients``), as DDP would average it over data-parallel processes. The process grid is
data-parallel × sequence-parallel (``sequence_mesh``): processes ``d·k … d·k+k-1`` share samples.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn


def sequence_mesh(degree: int, device_type: str = "cpu"):
    """The ``(data, ring, ulysses)`` device mesh of this world for sequence-parallel degree ``degree``: consecutive
    ranks form a sequence group. Every process must call it."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if degree < 1 or world % degree:
        raise ValueError(f"sequence_parallel={degree} must divide the {world} processes of this run "
                         f"(devices x num_nodes); set it to a divisor, or change the process count")
    return init_device_mesh(device_type, (world // degree, 1, degree), mesh_dim_names=("data", "ring", "ulysses"))


def enable_sequence_parallel(model: nn.Module, mesh, heads: Optional[int] = None) -> None:
    """Make ``model`` (a diffusers transformer with a ``_cp_plan``: Wan) run Ulysses over the ``ulysses`` dimension of
    ``mesh`` (``sequence_mesh``). The token count of every input must then divide by the degree (as must ``heads``,
    the attention heads, checked here)."""
    from diffusers import ContextParallelConfig, ParallelConfig
    from diffusers.hooks.context_parallel import apply_context_parallel

    degree = mesh["ulysses"].size()
    plan = getattr(model, "_cp_plan", None)
    if plan is None:
        raise ValueError(f"{type(model).__name__} has no context-parallel plan in diffusers: sequence parallelism "
                         f"needs a Wan transformer; set `sequence_parallel: 1` for this expert")
    heads = heads if heads is not None else getattr(model.config, "num_attention_heads", None)
    if heads is not None and heads % degree:
        raise ValueError(f"sequence_parallel={degree} must divide the model's {heads} attention heads (Ulysses gives "
                         f"each process whole heads)")
    cp = ContextParallelConfig(ulysses_degree=degree, mesh=mesh["ring", "ulysses"])
    config = ParallelConfig(context_parallel_config=cp)
    config.setup(dist.get_rank(), dist.get_world_size(), next(model.parameters()).device, mesh=cp.mesh)
    model._parallel_config = config
    for module in model.modules():
        processor = getattr(module, "processor", None)
        if processor is not None and hasattr(processor, "_parallel_config"):
            processor._parallel_config = config
    apply_context_parallel(model, cp, plan)


def reduce_sequence_gradients(model: nn.Module, mesh) -> None:
    """Sum every parameter's gradient over the sequence group (each process backpropagated its own tokens)."""
    group = mesh["ulysses"].get_group()
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad, group=group)
