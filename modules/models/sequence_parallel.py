"""Ulysses sequence parallelism for a generator's self-attention: k processes share one sample's tokens.

Each process of a sequence-parallel group holds 1/k of a video's tokens through the transformer blocks (patch
embedding, norms, feed-forward and cross-attention to the replicated text are per token); around self-attention an
all-to-all turns the sequence shards into head shards (every process then attends over the whole sequence for 1/k
of the heads) and back. The output is gathered before the final projection, so the model's result is the
one-process result on every process of the group.

This is diffusers' own context parallelism (``ContextParallelConfig(ulysses_degree=k)``, the model's ``_cp_plan``,
its Ulysses attention over the ``native`` SDPA backend): the maintained implementation that already knows where a
Wan transformer's sequence is split (hidden states entering ``blocks.0``, the RoPE tables) and gathered
(``proj_out``), and a FLUX transformer's (image and text tokens and their position ids at the input: its joint
attention then attends over both after the all-to-all). ``enable_parallelism`` itself cannot run on the CPU (it places the model on
``rank % accelerator count`` devices, zero there), so ``enable_sequence_parallel`` does its three steps with the
mesh given: the config set up on it, every attention processor pointed at it, the split/gather hooks applied.
(yunchang 0.6.4's ``UlyssesAttention`` was the other candidate: its CPU attention types run its *ring* kernel over
the whole world group, which is wrong inside an all-to-all; its ``SeqAllToAll4D`` alone would have meant writing the
Wan processor and the split/gather by hand.)

Gradients: every process backpropagates its own tokens, so a parameter's gradient is the sum over the group
(``reduce_sequence_gradients``), as DDP would average it over data-parallel processes. The process grid is
data-parallel × sequence-parallel (``sequence_mesh``): processes ``d·k … d·k+k-1`` share samples.

Composes with LoRA, gradient checkpointing, ZeRO-2/3, the SDE rollout and the KV-cached block-causal student (its own
plan and exchange: ``modules/models/causal_wan.py``) (tests/test_sequence_parallel.py). ``posttrain estimate`` traces one process of a group on a
fake process group (``traced_mesh``) and adds the all-to-all's buffers (``all_to_all_bytes``).
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

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
    """Make ``model`` (a diffusers transformer with a ``_cp_plan``: Wan, FLUX) run Ulysses over the ``ulysses`` dimension of
    ``mesh`` (``sequence_mesh``). The token count of every input must then divide by the degree (as must ``heads``,
    the attention heads, checked here)."""
    from diffusers import ContextParallelConfig, ParallelConfig
    from diffusers.hooks.context_parallel import apply_context_parallel

    degree = mesh["ulysses"].size()
    plan = getattr(model, "_cp_plan", None)
    if plan is None:
        raise ValueError(f"{type(model).__name__} has no context-parallel plan in diffusers: sequence parallelism "
                         f"needs a transformer diffusers can split (Wan, FLUX); set `sequence_parallel: 1`")
    heads = heads if heads is not None else getattr(model.config, "num_attention_heads", None)
    if heads is not None and heads % degree:
        raise ValueError(f"sequence_parallel={degree} must divide the model's {heads} attention heads (Ulysses gives "
                         f"each process whole heads)")
    # Wan's plan splits Wan 2.2's per-token timesteps (rows x tokens) at the model's input; this package's Wan
    # adapters give one timestep per row, which diffusers would leave whole after a warning: leave that one out
    plan = {module: {k: v for k, v in inputs.items() if k != "timestep"} if module == "" else inputs
            for module, inputs in plan.items()}
    plan = {module: inputs for module, inputs in plan.items() if inputs}
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


@contextlib.contextmanager
def traced_mesh(degree: int) -> Iterator:
    """``sequence_mesh(degree)`` of ``degree`` processes on torch's fake process group, this process being rank 0 and
    every collective a no-op: what one process of a sequence group saves for backward can then be traced under
    ``FakeTensorMode`` in a single process (``posttrain estimate``; torchtitan's memory estimator does the same)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("estimating sequence parallelism traces on a fake process group of its own: run "
                           "`posttrain estimate` outside a distributed run")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=degree)
    try:
        yield sequence_mesh(degree)
    finally:
        dist.destroy_process_group()


def all_to_all_bytes(rows: int, tokens: int, inner_dim: int, degree: int, element_size: int) -> int:
    """Transient bytes of the Ulysses all-to-all around one self-attention (diffusers' ``TemplatedUlyssesAttention``):
    the send copies and the receive buffers of query, key and value of this process's ``tokens / degree`` tokens are
    alive together (the gradients' all-to-all in backward is the same size); one layer at a time. Nothing when
    ``degree`` is 1."""
    if degree == 1:
        return 0
    if tokens % degree:
        raise ValueError(f"sequence_parallel={degree} must divide the {tokens} tokens of a sample (frames x height x "
                         f"width after the patches); change the video size or the degree")
    return 2 * 3 * rows * (tokens // degree) * inner_dim * element_size
