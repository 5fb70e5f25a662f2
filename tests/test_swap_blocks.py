"""Swapped blocks (``Expert.swap_blocks``): the frozen weights of an expert's last blocks in host memory, one block at a
time on the device.

On a CPU-only machine host and device are the same memory, so "the weights are on the device when they are read"
cannot be read from a device. ``Poisoned`` makes it readable: a block sent home has its weights replaced by NaN until
it is brought back (the host copies keep the real values), so a forward or a backward that reads a block's weights
while they are away gives NaN, and a training step that never does gives the gradients of a run without swapping,
bitwise. Without gradient checkpointing it does read them (the forward's graph keeps the weights for backward): the
test that shows it is why ``swap_blocks`` requires checkpointing.
"""
from __future__ import annotations

import os

import pytest
import torch

from posttrain.datamodules.synthetic import SyntheticVideos
from posttrain.lit.base import RunArgs
from posttrain.lit.finetune import Finetune
from posttrain.modules.flow.losses import flow_matching_loss, noised
from posttrain.modules.models import fp8
from posttrain.modules.models.cards import Expert, LoraConfig, ModelCard, ZeroConfig
from posttrain.modules.models.parked import SwappedBlocks
from tests.conftest import adamw, wan_card
from tests.helpers import quick_trainer

FOUR_BLOCKS = {"num_attention_heads": 2, "ffn_dim": 128, "num_layers": 4}
PROMPTS = ["a red circle moving left", "a blue square"]


class Poisoned(SwappedBlocks):
    """Swapped blocks whose weights are NaN while they are away from the device (``_home`` also patched onto
    ``SwappedBlocks`` where a run builds its own)."""

    def _home(self, index: int) -> None:
        for tensor, host in zip(self.groups[index], self.host[index]):
            tensor.data = torch.full_like(host, float("nan"))


def lora_wan(checkpointing: bool = True, use_fp8: bool = False, swap: int = 0) -> Expert:
    return Expert(arch="wan_t2v", preset=FOUR_BLOCKS, trainable=True, optimizer=adamw(), lora=LoraConfig(rank=4),
                  gradient_checkpointing=checkpointing, fp8=use_fp8, swap_blocks=swap)


def step(swap: int, checkpointing: bool = True, use_fp8: bool = False, poisoned: bool = True):
    """Loss and LoRA gradients of one training forward and backward of a 4-block LoRA Wan, its last ``swap`` blocks
    swapped (``Poisoned`` unless ``poisoned`` is false), and the ``SwappedBlocks``."""
    torch.manual_seed(0)
    card = wan_card(extra={"transformer": lora_wan(checkpointing, use_fp8)})
    card.build()
    module = Finetune(card)
    swapped = None
    if swap:
        model = card.models["transformer"]
        kind = Poisoned if poisoned else SwappedBlocks
        blocks = [model.get_submodule(p) for p in fp8.blocks(model)[-swap:]]
        swapped = kind([[b] for b in blocks], [[t for t in b.parameters() if not t.requires_grad] for b in blocks],
                       torch.device("cpu"))
    latents = torch.randn(2, *module.stage.latent_shape(module.video))
    cond = module.stage.condition(PROMPTS)
    sigma, noise = torch.tensor([0.3, 0.8]), torch.randn_like(latents)
    with module.stage.velocity() as velocity:
        loss = flow_matching_loss(velocity(noised(latents, noise, sigma), sigma * 1000, cond), latents, noise)[0].mean()
    loss.backward()
    grads = {n: p.grad for n, p in card.models["transformer"].named_parameters() if p.requires_grad}
    return loss.detach(), grads, swapped


@pytest.mark.parametrize("use_fp8", [False, True])
def test_swapped_blocks_train_as_resident_ones_and_never_read_weights_that_are_away(use_fp8, one_thread):
    """Three of four blocks swapped: the loss and every LoRA gradient are bitwise those without swapping (with
    float8 weights too, whose quanto tensors are swapped whole: not poisoned, as NaN has no float8 e4m3 scale to
    hide in). Each swapped block came once in the forward and once for its recompute but the last two, still
    resident when backward starts: 3 + 1 copies."""
    loss, grads, _ = step(0, use_fp8=use_fp8)
    loss_swapped, grads_swapped, swapped = step(3, use_fp8=use_fp8, poisoned=not use_fp8)
    assert torch.isfinite(loss) and torch.equal(loss, loss_swapped)
    assert len(grads) == 4 * 8 * 2 and grads.keys() == grads_swapped.keys()  # q, k, v, out of both attentions; A, B
    assert all(torch.equal(grads[n], grads_swapped[n]) for n in grads)
    assert swapped.copies == 3 + 1 and len(swapped.resident) == SwappedBlocks.RESIDENT


def test_without_checkpointing_backward_would_read_weights_that_are_away(one_thread):
    """Why ``swap_blocks`` requires gradient checkpointing: without it the forward's graph keeps each block's weights
    for backward, which runs after the block was sent home."""
    _, grads, _ = step(3, checkpointing=False)
    assert any(torch.isnan(g).any() for g in grads.values())
    with pytest.raises(ValueError, match="set gradient_checkpointing: true"):
        wan_card(extra={"transformer": lora_wan(checkpointing=False, swap=3)})


def test_moving_the_model_moves_the_adapter_and_not_the_swapped_weights():
    """Lightning moves the module to its device after ``configure_model``, where the blocks are swapped: the swapped
    frozen tensors stay in host memory, the LoRA adapter inside the same blocks moves (bf16 here: on a CPU-only
    machine a dtype is the move that shows)."""
    card = wan_card(extra={"transformer": lora_wan(swap=2)})
    card.build()
    swapped = card.swap("transformer", torch.device("cpu"))
    model = card.models["transformer"]
    card.to(torch.bfloat16)
    kept = {id(t) for group in swapped.groups for t in group}
    assert kept and {t.dtype for group in swapped.groups for t in group} == {torch.float32}
    last = model.get_submodule(fp8.blocks(model)[-1])
    assert {p.dtype for n, p in last.named_parameters() if "lora_" in n} == {torch.bfloat16}
    assert {p.dtype for p in model.get_submodule(fp8.blocks(model)[0]).parameters()} == {torch.bfloat16}
    assert swapped.host_bytes == sum(t.numel() * 4 for group in swapped.groups for t in group)


def test_a_fit_with_swapped_blocks_trains_the_weights_of_one_without(monkeypatch, one_thread):
    """Two iterations of the LoRA finetune with three of four blocks swapped (set up by the method before the module
    moves, as a run does; poisoned while away) end with the adapter of the same run without swapping, bitwise; DDP
    leaves the swapped tensors alone and syncs the adapter; a sample after training is the same."""
    trained, samples = {}, {}
    for swap in (0, 3):
        if swap:
            monkeypatch.setattr(SwappedBlocks, "_home", Poisoned._home)
        torch.manual_seed(0)
        module = Finetune(wan_card(extra={"transformer": lora_wan(swap=swap)}), caption_dropout=0.0,
                          run=RunArgs(frames=5, height=32, width=32))
        data = SyntheticVideos(num_samples=4, batch_size=2, frames=5, height=32, width=32)
        quick_trainer(max_steps=2).fit(module, data)
        model = module.card.models["transformer"]
        trained[swap] = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        samples[swap] = module.generate(PROMPTS[:1], seed=1)
    assert set(module.card.swapped) == {"transformer"} and module.card.swapped["transformer"].copies > 3
    ignored = set(module._ddp_params_and_buffers_to_ignore)
    last = fp8.blocks(model)[-1]
    assert f"card.models.transformer.{last}.attn1.to_q.base_layer.weight" in ignored
    assert not any("lora_" in name for name in ignored)
    assert not any(name.startswith(f"card.models.transformer.{fp8.blocks(model)[0]}.") for name in ignored)
    assert all(torch.equal(trained[0][n], trained[3][n]) for n in trained[0])
    assert torch.equal(samples[0], samples[3])


def test_swap_blocks_is_refused_where_it_cannot_work():
    def problems(**options):
        with pytest.raises(ValueError) as err:
            ModelCard({"transformer": Expert(arch="wan_t2v", preset=FOUR_BLOCKS, **options)})
        return str(err.value)

    assert "must be a number of blocks >= 0" in problems(swap_blocks=-1)
    assert "trains all of them" in problems(swap_blocks=2, trainable=True, optimizer=adamw(),
                                            gradient_checkpointing=True)
    assert "DeepSpeed places" in problems(swap_blocks=2, sharded=True, zero=ZeroConfig(stage=2),
                                          gradient_checkpointing=True)
    assert "already off the device" in problems(swap_blocks=2, offload_weights=True, gradient_checkpointing=True)
    card = wan_card(extra={"transformer": lora_wan(swap=5)})
    card.build()
    with pytest.raises(ValueError, match="swap_blocks=5, but WanTransformer3DModel has 4 blocks"):
        card.swap("transformer", torch.device("cpu"))


@pytest.mark.parametrize("use_fp8", [False, True])
def test_the_estimate_moves_the_bytes_the_swap_holds(use_fp8):
    """``posttrain estimate``'s host column gains what ``SwappedBlocks`` holds in host memory (float8 weights: their
    data and scales), and its device column loses that but two blocks."""
    from posttrain.lit.tools.estimate import meta_model, swapped_block_bytes

    spec = lora_wan(swap=3, use_fp8=use_fp8)
    card = wan_card(extra={"transformer": spec})
    card.build()
    swapped = card.swap("transformer", torch.device("cpu"))
    host, resident = swapped_block_bytes(spec, meta_model(spec))
    # quanto keeps two float32 scalars of activation scales a float8 Linear (10 a block), which the estimate leaves out
    assert swapped.host_bytes - host == (3 * 10 * 2 * 4 if use_fp8 else 0)
    assert resident == 2 * host // 3


def test_diffusion_nft_swaps_its_old_copy_with_the_expert(monkeypatch, one_thread):
    """DiffusionNFT keeps an ``old`` copy of a LoRA expert (its own adapter, the expert's base): the copy's blocks
    swap with the expert's, block by block; an iteration (rollouts by the old copy, training of the expert) with three
    blocks swapped and poisoned while away trains the adapter and blends the old one as without swapping."""
    from posttrain.datamodules.prompts import Prompts
    from posttrain.lit.diffusion_nft import DiffusionNFT
    from posttrain.modules.flow.samplers import FlowMatchSampler
    from posttrain.modules.rewards.synthetic import ColourAlignment
    from posttrain.modules.rl.grpo import GRPOArgs

    states = {}
    for swap in (0, 3):
        if swap:
            monkeypatch.setattr(SwappedBlocks, "_home", Poisoned._home)
        torch.manual_seed(0)
        module = DiffusionNFT(wan_card(extra={"transformer": lora_wan(swap=swap)}), reward=ColourAlignment(),
                              grpo=GRPOArgs(num_samples_per_prompt=2), sampler=FlowMatchSampler(num_steps=4),
                              run=RunArgs(frames=5, height=16, width=16))
        quick_trainer(max_steps=1).fit(module, Prompts(prompts=PROMPTS, batch_size=2))
        states[swap] = {k: v.clone() for k, v in module.card.state_dict().items() if "lora_" in k}
    card = module.card
    swapped, model, old = card.swapped["transformer"], card.models["transformer"], card.models["transformer_old"]
    last = fp8.blocks(model)[-1]
    base = {id(t) for n, t in model.get_submodule(last).named_parameters() if "lora_" not in n}
    old_base = {id(t) for n, t in old.get_submodule(last).named_parameters() if "lora_" not in n}
    assert {id(t) for t in swapped.groups[-1]} == base | old_base and base != old_base  # float32 base: copied
    assert any("transformer_old" in k for k in states[0])
    assert states[0].keys() == states[3].keys() and all(torch.equal(states[0][k], states[3][k]) for k in states[0])


def test_a_pair_with_a_frozen_expert_swapped_whole_trains_and_samples_as_without(monkeypatch, one_thread):
    """The one-GPU recipe of a Wan 2.2 pair: the trained low-noise expert (LoRA) with its last block swapped, the frozen
    high-noise expert with every block swapped. Two finetune iterations and a sample through both experts (poisoned
    while away) equal those without swapping, bitwise; the frozen expert came over for its sampling steps only."""
    def card(swap: bool) -> ModelCard:
        high = Expert(arch="wan_t2v", preset=FOUR_BLOCKS, gradient_checkpointing=True, swap_blocks=4 if swap else 0)
        return ModelCard({"text_encoder": Expert(arch="umt5"), "vae": Expert(arch="wan_vae"), "transformer": high,
                          "transformer_2": lora_wan(swap=1 if swap else 0)}, text_max_length=32, boundary_ratio=0.875)

    trained, samples = {}, {}
    for swap in (False, True):
        if swap:
            monkeypatch.setattr(SwappedBlocks, "_home", Poisoned._home)
        torch.manual_seed(0)
        module = Finetune(card(swap), caption_dropout=0.0, run=RunArgs(frames=5, height=16, width=16))
        quick_trainer(max_steps=2).fit(module, SyntheticVideos(num_samples=4, batch_size=2, frames=5, height=16,
                                                               width=16))
        trained[swap] = {n: p.detach().clone() for n, p in module.card.models["transformer_2"].named_parameters()
                         if p.requires_grad}
        copies_after_training = module.card.swapped["transformer"].copies if swap else None
        samples[swap] = module.generate(PROMPTS[:1], seed=1)
    assert copies_after_training == 0 and module.card.swapped["transformer"].copies > 0
    assert all(torch.equal(trained[False][n], trained[True][n]) for n in trained[False])
    assert torch.isfinite(samples[True]).all() and torch.equal(samples[False], samples[True])


@pytest.mark.parametrize("use_fp8", [False, True])
def test_flow_grpo_keeps_log_probability_parity_with_swapped_blocks(use_fp8, one_thread):
    """The rollout (no grad) and the training recompute (grad, checkpointed) of a LoRA expert with three of four
    blocks swapped read the same weights: FlowGRPO's log-probability check holds, float32 and fp8 bases alike."""
    from posttrain.callbacks.parity import LogProbParityCheck
    from posttrain.datamodules.prompts import Prompts
    from posttrain.lit.flow_grpo import FlowGRPO
    from posttrain.modules.flow.samplers import FlowMatchSampler
    from posttrain.modules.rewards.synthetic import ColourAlignment
    from posttrain.modules.rl.grpo import GRPOArgs

    torch.manual_seed(0)
    module = FlowGRPO(wan_card(extra={"transformer": lora_wan(use_fp8=use_fp8, swap=3)}), reward=ColourAlignment(),
                      grpo=GRPOArgs(num_samples_per_prompt=2), sampler=FlowMatchSampler(num_steps=4),
                      run=RunArgs(frames=5, height=16, width=16))
    parity = LogProbParityCheck(tolerance=1e-5)
    quick_trainer(max_steps=2, callbacks=[parity]).fit(module, Prompts(prompts=PROMPTS, batch_size=2))
    assert module.card.swapped["transformer"].copies > 0
    assert parity.checks == 2 and parity.last_gap < 1e-5


def test_the_estimate_of_the_24gb_recipe_counts_its_swapped_blocks_in_host_memory():
    """``posttrain estimate`` applies ``swap_blocks`` to the expert's row: the one-GPU 14B recipe (24 of 40 blocks)
    has the swapped blocks' bytes in its host column and all but two of them out of its weights."""
    from posttrain.lit.tools.estimate import GIB, estimate

    recipe = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "recipes",
                          "wan2.1_t2v_14b_lora_24gb.yaml")
    row = estimate(recipe, devices=1, activations=False, random_weights=True)["transformer"]
    assert "blocks swapped" in row.placement
    assert 7.5 * GIB < row.host_bytes < 8.2 * GIB  # 24 blocks of 0.33 GiB in float8
    assert 6.5 * GIB < row.param_bytes < 7.4 * GIB  # 16 resident blocks + 2 of the swapped, embeddings and norms
