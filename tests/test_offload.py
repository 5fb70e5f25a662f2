"""Frozen encoders kept in host memory once their prompts are cached, and saved activations offloaded to the host.

On a CPU-only machine host and device are the same memory, so "the encoder is off the device" cannot be read from
``parameter.device``. The encoder tests read what the offload does instead: the card's bookkeeping (``card.parked``:
what lives on the host and the device it runs on), the parameters pointing at the host copies between calls, and
``Parked.calls`` (how many calls brought the encoder to the device: none while the cache holds every prompt, one for
a new prompt). On CUDA ``test_encoders_leave_the_gpu`` checks the parameters' device itself.
"""
from __future__ import annotations

import pytest
import torch
from lightning.pytorch import seed_everything

from posttrain.datamodules.synthetic import SyntheticVideos
from posttrain.lit.base import RunArgs
from posttrain.lit.engine.encoders import run_prompts
from posttrain.lit.finetune import Finetune
from posttrain.modules.flow.losses import flow_matching_loss, noised
from posttrain.modules.models.cards import Expert
from tests.conftest import TINY_WAN, adamw, wan_card
from tests.helpers import quick_trainer

PROMPTS = ["a red circle moving left", "a blue square"]


def fit_and_sample(offload: bool, accelerator: str = "cpu") -> tuple[Finetune, torch.Tensor, torch.Tensor]:
    """Two iterations of the tiny finetune, then samples of a data prompt (cached) and of a new one (a miss)."""
    seed_everything(0)
    module = Finetune(wan_card(offload_encoders=offload, cache_device="cpu"), caption_dropout=0.0,
                      run=RunArgs(frames=5, height=32, width=32))
    data = SyntheticVideos(num_samples=8, val_samples=2, batch_size=2, frames=5, height=32, width=32)
    quick_trainer(max_steps=2, accelerator=accelerator).fit(module, data)
    cached = data.prompt_list()[:1]
    return module, module.generate(cached, seed=1).cpu(), module.generate(PROMPTS[:1], seed=1).cpu()


def test_encoders_go_to_the_host_after_caching_and_samples_do_not_change():
    plain, cached_plain, new_plain = fit_and_sample(offload=False)
    module, cached, new = fit_and_sample(offload=True)
    card = module.card
    assert plain.card.parked == {} and set(card.parked) == {"text_encoder"}  # SyntheticVideos gives videos: VAE stays
    parked = card.parked["text_encoder"]
    encoder = card.models["text_encoder"]
    assert all(p.data.data_ptr() == h.data_ptr() for p, h in zip(encoder.parameters(), parked.host))
    # DDP leaves it alone (NCCL broadcasts and DDP's one-device check would meet host tensors)
    ignored = set(module._ddp_params_and_buffers_to_ignore)
    assert {f"card.models.text_encoder.{n}" for n, _ in encoder.named_parameters()} <= ignored
    assert not any(n.startswith("card.models.transformer.") for n in ignored)
    # the data's prompts were encoded before training with the encoder on the device once (``resident``, not a
    # call): training and sampling a training prompt read the cache only; the new prompt brought it over once
    assert parked.calls == 1
    assert torch.equal(cached, cached_plain) and torch.equal(new, new_plain)  # bitwise
    assert card.weights_digest("text_encoder") == plain.card.weights_digest("text_encoder")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: host and device differ only there")
def test_encoders_leave_the_gpu():
    module, _, _ = fit_and_sample(offload=True, accelerator="gpu")
    assert {p.device.type for p in module.card.models["text_encoder"].parameters()} == {"cpu"}
    assert {p.device.type for p in module.card.models["transformer"].parameters()} == {"cuda"}


def test_run_prompts_lists_the_data_and_callback_prompts_once():
    class Sampler:
        prompts = ["a blue square", "a green moon"]

    data = SyntheticVideos(num_samples=4, batch_size=2)
    prompts = run_prompts(data, [Sampler()])
    assert prompts[0] == "" and len(prompts) == len(set(prompts))
    assert set(data.prompt_list()) | {"a green moon"} <= set(prompts)
    assert run_prompts(object(), []) is None  # data that lists no prompts


def test_a_trained_expert_cannot_be_parked():
    card = wan_card()
    card.build()
    with pytest.raises(ValueError, match="'transformer' trains"):
        card.park("transformer", torch.device("cpu"))


@pytest.mark.parametrize("checkpointing", [False, True])
def test_offloaded_activations_give_the_same_loss_and_gradients(monkeypatch, checkpointing):
    """With ``offload_activations`` the training forward's saved tensors go through ``save_on_cpu`` (counted here:
    with gradient checkpointing these are the inputs of the checkpointed blocks), and the loss and every
    gradient are bitwise those without it (on CPU the copies are exact)."""
    packed = []
    original = torch.autograd.graph.save_on_cpu

    class Counting(original):
        def __init__(self, pin_memory: bool = False, device_type: str = "cuda"):
            super().__init__(pin_memory, device_type)
            pack = self.pack_hook

            def counting(tensor):
                packed.append(tensor.shape)
                return pack(tensor)

            self.pack_hook = counting

    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", Counting)
    results = []
    for offload in (False, True):
        torch.manual_seed(0)
        generator = Expert(arch="wan_t2v", preset=TINY_WAN, trainable=True, optimizer=adamw(),
                           gradient_checkpointing=checkpointing, offload_activations=offload)
        card = wan_card(extra={"transformer": generator})
        card.build()
        module = Finetune(card)
        latents = torch.randn(2, *module.stage.latent_shape(module.video))
        cond = module.stage.condition(PROMPTS)
        sigma = torch.tensor([0.3, 0.8])
        noise = torch.randn_like(latents)
        with module.stage.velocity() as velocity:
            loss = flow_matching_loss(velocity(noised(latents, noise, sigma), sigma * 1000, cond), latents,
                                      noise)[0].mean()
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in card.models["transformer"].named_parameters()}))
        if not offload:
            assert packed == []
    assert len(packed) >= (TINY_WAN["num_layers"] if checkpointing else 10)
    (loss, grads), (loss_off, grads_off) = results
    assert torch.equal(loss, loss_off)
    assert grads.keys() == grads_off.keys() and all(torch.equal(grads[n], grads_off[n]) for n in grads)


def test_a_parked_fp8_text_encoder_and_vae_encoder_give_the_same_outputs():
    """Parking works on quanto's float8 weights (``Expert.fp8``) and on part of an expert (the VAE's encoder, whose
    causal feature cache is a list the encoder fills in place across calls)."""
    torch.manual_seed(0)
    card = wan_card(extra={"text_encoder": Expert(arch="umt5", fp8=True)})
    card.build()
    module = Finetune(card)
    video = torch.rand(1, 3, 5, 32, 32) * 2 - 1
    text, latents = module.stage.adapter.text(module.stage, PROMPTS), module.stage.encode(video)
    card.park("text_encoder", torch.device("cpu"))
    card.park("vae.encoder", torch.device("cpu"))
    card.versions["text_encoder"] += 1  # a fresh cache key: the parked encoder runs
    again = module.stage.adapter.text(module.stage, PROMPTS)
    assert card.parked["text_encoder"].calls == 1 and card.parked["vae.encoder"].calls == 0
    assert torch.equal(module.stage.encode(video), latents) and card.parked["vae.encoder"].calls > 0
    assert all(torch.equal(text[k], again[k]) for k in text)


def test_a_parked_encoder_stays_on_the_host_when_the_card_moves():
    """Lightning moves the whole module to its device after ``configure_model``, where the encoders are parked: a
    parked module ignores ``.to`` (bf16 here: on a CPU-only machine a dtype is the move that shows)."""
    card = wan_card()
    card.build()
    card.park("text_encoder", torch.device("cpu"))
    card.to(torch.bfloat16)
    assert {p.dtype for p in card.models["text_encoder"].parameters()} == {torch.float32}
    assert {p.dtype for p in card.models["transformer"].parameters()} == {torch.bfloat16}


def test_offload_encoders_needs_host_rows():
    with pytest.raises(ValueError, match="set `cache_device: cpu`"):
        wan_card(offload_encoders=True)


@pytest.mark.slow
def test_precomputed_rows_leave_the_encoders_parked_and_unused(tmp_path):
    """With ``PrecomputedVideos`` the text encoder and the VAE's encoder are parked before training and never
    called (their rows and latents come with the batches); the weights trained are bitwise those without it."""
    from posttrain.datamodules.precomputed import PrecomputedVideos
    from posttrain.lit.tools.preprocess import preprocess
    from tests.test_precomputed import method_and_data, small_config, train

    config = small_config(tmp_path)
    preprocess(config, str(tmp_path / "rows"))
    trained = {}
    for offload in ("false", "true"):
        model, data = method_and_data(config, "--model.init_args.card.cache_device", "cpu",
                                      "--model.init_args.card.offload_encoders", offload)
        trained[offload] = train(model, PrecomputedVideos(str(tmp_path / "rows"), batch_size=data.batch_size))
    assert set(model.card.parked) == {"text_encoder", "vae.encoder"}
    assert [model.card.parked[p].calls for p in ("text_encoder", "vae.encoder")] == [0, 0]
    assert all(torch.equal(trained["false"][k], trained["true"][k]) for k in trained["false"])


def test_sharded_experts_strategy_leaves_parked_encoders_out_of_ddp(monkeypatch):
    """Under ShardedExpertsStrategy (one gloo process here) a ZeRO-2 LoRA generator and parked encoders: DDP's
    ignore list holds the engine's and the parked modules' tensors (NCCL could not broadcast host tensors), and a
    step trains."""
    from posttrain.lit.engine.strategy import ShardedExpertsStrategy
    from tests.helpers_strategy import LAUNCH_VARIABLES, close_process_group

    for variable in LAUNCH_VARIABLES:  # Lightning sets them for its one process: gone again after the test
        monkeypatch.setenv(variable, "")
        monkeypatch.delenv(variable)
    from posttrain.modules.models.cards import LoraConfig, ModelCard, ZeroConfig

    experts = {"text_encoder": Expert(arch="umt5"), "vae": Expert(arch="wan_vae"),
               "transformer": Expert(arch="wan_t2v", preset=TINY_WAN, trainable=True, optimizer=adamw(), sharded=True,
                                     zero=ZeroConfig(stage=2), lora=LoraConfig(rank=4))}
    module = Finetune(ModelCard(experts, text_max_length=32, offload_encoders=True, cache_device="cpu"),
                      run=RunArgs(frames=5, height=32, width=32))
    try:
        trainer = quick_trainer(max_steps=1, strategy=ShardedExpertsStrategy(process_group_backend="gloo"))
        trainer.fit(module, SyntheticVideos(num_samples=4, batch_size=2, frames=5, height=32, width=32))
    finally:
        close_process_group()
    ignored = set(module._ddp_params_and_buffers_to_ignore)
    encoder = module.card.models["text_encoder"]
    assert {f"card.models.text_encoder.{n}" for n, _ in encoder.named_parameters()} <= ignored
    assert any(n.startswith("card.models.transformer.") for n in ignored)  # the engine's
    assert trainer.global_step >= 1 and module.card.parked["text_encoder"].calls == 0
