"""``posttrain.lit.tools.estimate``: figures against measured ones, and clear errors for broken cards.

Stated margins:
- model states (weights + gradients + optimizer state) of a ZeRO-3 expert, per process, 2 processes:
  within 10% of the peak ``bench/memory.py`` measures in a real 2-process DeepSpeed run (fp32 and bf16);
- activations: within 5% of the bytes a real forward saves for backward at the same size (the estimate
  traces fake tensors with 1 and 2 layers and extrapolates to 3).
"""
from __future__ import annotations

import argparse
import os
import socket

import pytest
import torch
import yaml

import launch
from bench import memory  # the measured side
from bench import sequence_parallel  # the bytes a forward saves for backward
from posttrain.lit.tools.estimate import _inputs, estimate, meta_model, weight_bytes
from posttrain.modules.models import presets
from posttrain.modules.models.cards import Expert, LoraConfig
from tests.conftest import TINY_WAN

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ADAMW = {"class_path": "torch.optim.AdamW", "init_args": {"lr": 1e-4}}
# bench/memory.py's preset at layers=2, heads=8, head_dim=64 (10.6M parameters)
MEMORY_PRESET = {"num_attention_heads": 8, "attention_head_dim": 64, "ffn_dim": 2048, "num_layers": 2}


def write_config(tmp_path, generator: dict | None, devices=1, sharded=False, batch_size=1, drop=(),
                 experts: dict | None = None, strategy_args: dict | None = None, run: dict | None = None) -> str:
    """A finetune config: tiny text encoder and VAE, a trainable Wan transformer with ``generator``'s
    settings (None: leave it to ``experts``), ``experts`` written over the card as given; ``strategy_args``: the
    ``ShardedExpertsStrategy``'s (with ``sharded``), ``run``: the method's video size."""
    card = {"text_encoder": {"arch": "umt5"}, "vae": {"arch": "wan_vae"}}
    if generator is not None:
        card["transformer"] = {"arch": "wan_t2v", "trainable": True, "optimizer": ADAMW, **generator}
    card.update(experts or {})
    for name in drop:
        card.pop(name)
    cfg = {
        "trainer": {"accelerator": "cpu", "devices": devices, "logger": False,
                    **({"strategy": {"class_path": "posttrain.lit.engine.strategy.ShardedExpertsStrategy",
                                     **({"init_args": strategy_args} if strategy_args else {})}} if sharded else {})},
        "model": {"class_path": "posttrain.lit.finetune.Finetune",
                  "init_args": {"card": {"experts": card}, **({"run": run} if run else {})}},
        "data": {"class_path": "posttrain.datamodules.synthetic.SyntheticVideos",
                 "init_args": {"batch_size": batch_size}},
    }
    path = os.path.join(tmp_path, "config.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_zero3_model_states_match_a_measured_two_process_run(tmp_path, precision):
    path = write_config(tmp_path, {"preset": MEMORY_PRESET, "sharded": True,
                                   "zero": {"stage": 3, "precision": precision}}, devices=2, sharded=True)
    estimated = estimate(path, activations=False)["transformer"]
    assert estimated.placement == f"ZeRO-3 {precision}" and estimated.params == pytest.approx(10.6e6, rel=0.01)

    args = argparse.Namespace(layers=2, heads=8, head_dim=64, precision=precision, port=free_port())
    out = launch.context().SimpleQueue()
    launch.spawn(memory.worker, args=(args, "zero3", out), nprocs=2)
    measured = max(out.get()["peaks"])
    assert estimated.model_state_bytes == pytest.approx(measured, rel=0.10), \
        f"estimate {estimated.model_state_bytes / 2**20:.1f} MiB vs measured {measured / 2**20:.1f} MiB"


@pytest.mark.slow
def test_activation_estimate_matches_a_real_forward(tmp_path):
    """3 layers, 2 rows: the fake-tensor extrapolation from 1 and 2 layers against real saved tensors."""
    preset = {"num_layers": 3, "num_attention_heads": 4, "attention_head_dim": 32, "ffn_dim": 256}
    path = write_config(tmp_path, {"preset": preset}, batch_size=2)
    result = estimate(path)
    estimated = result["transformer"].activation_bytes

    assert_matches_a_real_forward(path, "wan_t2v", preset, estimated)


def shipped_config_estimate_matches_a_real_forward(tmp_path, config: str, arch: str, preset: dict,
                                                  **expert_keys) -> None:
    """``posttrain estimate`` of ``configs/<config>`` with the transformer's ``preset`` and 2 rows a batch
    (``expert_keys``: {expert: {key: value}} more settings) against a real forward (``assert_matches_a_real_forward``)."""
    with open(os.path.join(ROOT, "configs", config)) as f:
        cfg = yaml.safe_load(f)
    experts = cfg["model"]["init_args"]["card"]["experts"]
    experts["transformer"]["preset"] = preset
    for name, keys in expert_keys.items():
        experts[name].update(keys)
    cfg["data"]["init_args"]["batch_size"] = 2
    path = os.path.join(tmp_path, config)
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    estimated = estimate(path)["transformer"].activation_bytes
    assert estimated > 0
    assert_matches_a_real_forward(path, arch, preset, estimated)


def assert_matches_a_real_forward(path: str, arch: str, preset: dict, estimated: int) -> None:
    """The bytes a real 2-row training forward of ``arch`` (``preset``, config ``path``'s card and size) saves for
    backward, outside the parameters, are ``estimated`` within 5%."""
    from posttrain.lit.tools.config import instantiate_part, parse
    from posttrain.lit.tools.estimate import input_shapes

    method = instantiate_part(parse(path), "model", path, "estimate")
    for name, spec in method.card.specs.items():  # the meta card estimate builds
        method.card.models[name] = meta_model(spec)
    model = presets.build_model(arch, preset=preset).train()
    inputs = _inputs(input_shapes(arch, dict(model.config), method.card, method, rows=2), torch.float32)
    measured = sequence_parallel.saved_bytes(model, inputs)
    assert measured > 0
    assert estimated == pytest.approx(measured, rel=0.05), f"estimate {estimated} vs measured {measured} bytes"


@pytest.mark.slow
def test_flux_activation_estimate_matches_a_real_forward(tmp_path):
    """FLUX has two kinds of block (double- and single-stream): each is extrapolated from its own trace; 3 + 3
    blocks, 2 rows of 32x32 images, against the real saved tensors."""
    shipped_config_estimate_matches_a_real_forward(tmp_path, "finetune_flux.yaml", "flux",
                                                   {"num_layers": 3, "num_single_layers": 3})


@pytest.mark.slow
def test_sequence_parallel_divides_the_activations_per_process(tmp_path):
    """``sequence_parallel: 2`` of the strategy, read from the config: each process traces half of every sample's
    tokens (half of the heads inside attention), so the generator's activations lose about half (less: the text and
    the time embedding stay whole on every process, and one layer's all-to-all buffers are added); the model states
    and everything else are unchanged. A degree that does not divide the processes is refused."""
    preset = {"num_layers": 3, "num_attention_heads": 4, "attention_head_dim": 32, "ffn_dim": 256}
    path = write_config(tmp_path, {"preset": preset}, devices=2, sharded=True,
                        strategy_args={"sequence_parallel": 2}, run={"frames": 17, "height": 128, "width": 128})
    two, one = estimate(path), estimate(path, sequence_parallel=1)
    shared, whole = two["transformer"], one["transformer"]
    assert shared.model_state_bytes == whole.model_state_bytes
    assert one.device_bytes - two.device_bytes == whole.activation_bytes - shared.activation_bytes
    saved = whole.activation_bytes - shared.activation_bytes
    assert 0.4 * whole.activation_bytes < saved < 0.5 * whole.activation_bytes, (saved, whole.activation_bytes)
    assert "sequence parallel 2" in two.table() and "all-to-all buffers" in two.table()
    assert "sequence parallel" not in one.table()
    with pytest.raises(ValueError, match=r"sequence_parallel=2 must divide the 3 processes"):
        estimate(path, devices=3, activations=False)
    # the block-causal student (its own exchange, modules/models/causal_wan.py; 3 latent frames, one chunk) divides alike
    causal = write_config(tmp_path, {"arch": "wan_t2v_causal", "preset": preset}, devices=2, sharded=True,
                          strategy_args={"sequence_parallel": 2}, run={"frames": 9, "height": 128, "width": 128})
    shared, whole = estimate(causal)["transformer"], estimate(causal, sequence_parallel=1)["transformer"]
    saved = whole.activation_bytes - shared.activation_bytes
    assert 0.4 * whole.activation_bytes < saved < 0.5 * whole.activation_bytes, (saved, whole.activation_bytes)


@pytest.mark.slow
def test_sequence_parallel_estimate_splits_flux_image_and_text_tokens(tmp_path):
    """FLUX under ``sequence_parallel: 2``: its image and text tokens are split alike (joint attention), so its
    activations per process are about half too, with the all-to-all of the joint sequence added."""
    with open(os.path.join(ROOT, "configs", "finetune_flux.yaml")) as f:
        cfg = yaml.safe_load(f)
    cfg["trainer"].update(devices=2, strategy={"class_path": "posttrain.lit.engine.strategy.ShardedExpertsStrategy",
                                               "init_args": {"sequence_parallel": 2}})
    path = os.path.join(tmp_path, "flux.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    shared, whole = (estimate(path, sequence_parallel=k)["transformer"] for k in (2, 1))
    assert any("all-to-all buffers" in note for note in shared.notes), shared.notes
    assert 0.45 * whole.activation_bytes < shared.activation_bytes < 0.6 * whole.activation_bytes


def test_activation_rows_follow_the_rl_batching():
    """One training forward's rows: the data batch (finetune); prompts × K over minibatches (RL), × 2 with CFG;
    at most ``micro_batch_size``."""
    from types import SimpleNamespace

    from posttrain.lit.tools.estimate import activation_rows

    from posttrain.modules.rl.grpo import GRPOArgs
    from posttrain.modules.flow.samplers import FlowMatchSampler

    assert activation_rows(SimpleNamespace(), 4)[0] == 4
    rl = dict(grpo=GRPOArgs(num_samples_per_prompt=8), rollout_sampler=FlowMatchSampler())
    assert activation_rows(SimpleNamespace(**rl), 1)[0] == 8
    rl["grpo"].micro_batch_size = 2
    assert activation_rows(SimpleNamespace(**rl), 1)[0] == 2
    rows, text = activation_rows(SimpleNamespace(**{**rl, "rollout_sampler": FlowMatchSampler(guidance_scale=4.5)}), 1)
    assert rows == 4 and "micro-batches of 2" in text and "CFG" in text
    # a method whose update is a plain forward of the policy (DiffusionNFT) says so: no second CFG row
    guided = {**rl, "rollout_sampler": FlowMatchSampler(guidance_scale=4.5)}
    rows, text = activation_rows(SimpleNamespace(**guided, update_runs_rollout_cfg=False), 1)
    assert rows == 2 and "CFG" not in text
    from posttrain.lit.diffusion_nft import DiffusionNFT
    from posttrain.lit.flow_grpo import FlowGRPO

    assert DiffusionNFT.update_runs_rollout_cfg is False and FlowGRPO.update_runs_rollout_cfg is True


@pytest.mark.slow
def test_roles_lora_and_offload_are_counted(tmp_path):
    # EMA: a frozen full copy of the generator's weights
    path = write_config(tmp_path, {})
    with open(path) as f:
        cfg = yaml.safe_load(f)
    cfg["model"]["init_args"]["ema_decay"] = 0.9
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    result = estimate(path, activations=False)
    ema, gen = result["transformer_ema"], result["transformer"]
    assert ema.param_bytes == gen.param_bytes and ema.grad_bytes == 0 and ema.optimizer_bytes == 0
    assert gen.optimizer_bytes == 2 * gen.param_bytes  # AdamW: two fp32 moments per fp32 parameter
    # LoRA: only the adapter trains
    path = write_config(tmp_path, {"lora": {"rank": 4}})
    lora = estimate(path, activations=False)["transformer"]
    assert 0 < lora.trainable < 0.2 * lora.params and lora.grad_bytes == 4 * lora.trainable
    # ZeRO-3 with both offloads: the device keeps only gathered parameters, gradients and buckets
    path = write_config(tmp_path, {"preset": MEMORY_PRESET, "sharded": True,
                                   "zero": {"stage": 3, "offload_optimizer": True, "offload_params": True}},
                        devices=4, sharded=True)
    off = estimate(path, activations=False)["transformer"]
    assert off.optimizer_bytes == 0 and off.deepspeed_bytes is not None
    part = off.trainable / 4
    assert off.host_bytes == pytest.approx(part * 4 + part * (4 + 8 + 4), rel=0.15)  # weights, master, Adam, grads
    assert off.grad_bytes < part * 4  # only the reduce bucket stays on the device


@pytest.mark.slow
def test_devices_scale_the_sharded_share(tmp_path):
    spec = {"preset": MEMORY_PRESET, "sharded": True, "zero": {"stage": 2, "precision": "bf16"}}
    two = estimate(write_config(tmp_path, spec, devices=2, sharded=True), activations=False)["transformer"]
    eight = estimate(write_config(tmp_path, spec, devices=2, sharded=True), devices=8, activations=False)["transformer"]
    assert eight.param_bytes == two.param_bytes  # ZeRO-2 keeps full weights
    assert eight.optimizer_bytes < 0.3 * two.optimizer_bytes  # master + Adam: 1/8 instead of 1/2


def test_missing_and_odd_experts_give_clear_errors(tmp_path):
    path = write_config(tmp_path, {}, drop=("vae",))
    with pytest.raises(ValueError, match=r"the card has no 'vae'"):
        estimate(path)
    path = write_config(tmp_path, None, experts={"transformer": {"arch": "wan_t3v", "trainable": True}, "vae": None})
    with pytest.raises(ValueError) as err:
        estimate(path)
    message = str(err.value)
    assert "expert 'transformer': arch 'wan_t3v' is not one of" in message
    assert "expert 'transformer' is trainable but has no optimizer" in message
    assert "expert 'vae' has no settings" in message
    path = write_config(tmp_path, {})
    with open(path) as f:
        cfg = yaml.safe_load(f)
    cfg["trainer"]["devices"] = "auto"
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    with pytest.raises(ValueError, match=r"trainer.devices is 'auto'.*devices=8"):
        estimate(path)
    with pytest.raises(FileNotFoundError, match="no config file"):
        estimate(os.path.join(tmp_path, "missing.yaml"))


SHIPPED = sorted(name for name in os.listdir(os.path.join(ROOT, "configs"))
                 if name.endswith(".yaml") and "folder" not in name)  # a folder config needs its data folder to parse


@pytest.mark.slow
@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_config_estimates(name):
    result = estimate(os.path.join(ROOT, "configs", name), activations=False)
    assert result.device_bytes > 0 and "total" in result.table()


@pytest.mark.slow
def test_trainer_precision_applies_to_plain_experts(tmp_path):
    """bf16-true: Lightning casts every plain expert (weights, gradients, AdamW state in bf16: half of fp32);
    bf16-mixed: fp32 weights, fewer activation bytes (autocast)."""
    results = {}
    for precision in ("32-true", "bf16-mixed", "bf16-true"):
        path = write_config(tmp_path, {}, batch_size=8)  # at 1 row autocast's bf16 weight copies outweigh
        with open(path) as f:
            cfg = yaml.safe_load(f)
        cfg["trainer"]["precision"] = precision
        with open(path, "w") as f:
            yaml.safe_dump(cfg, f)
        results[precision] = estimate(path)
    full, mixed, half = (results[p]["transformer"] for p in ("32-true", "bf16-mixed", "bf16-true"))
    assert half.model_state_bytes * 2 == full.model_state_bytes and mixed.model_state_bytes == full.model_state_bytes
    assert results["bf16-true"]["vae"].param_bytes * 2 == results["32-true"]["vae"].param_bytes
    assert mixed.activation_bytes < 0.9 * full.activation_bytes


def with_card(path: str, **card: object) -> str:
    """The config at ``path`` with ``card`` options added (``offload_encoders``...)."""
    with open(path) as f:
        cfg = yaml.safe_load(f)
    cfg["model"]["init_args"]["card"].update(card)
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    return path


def test_fp8_counts_a_byte_per_block_linear_weight_and_its_scales(tmp_path):
    """fp8 on a frozen text encoder and a LoRA base: each Linear weight inside the blocks (T5's ``encoder.block``,
    Wan's ``blocks``; not a norm's, not the adapter's) 1 byte a parameter + one float32 scale per output row, the
    rest unchanged; the adapter's AdamW state is 2 float32 moments per adapter parameter alone."""
    experts = {"text_encoder": {"arch": "umt5"}}
    plain = estimate(write_config(tmp_path, {"lora": {"rank": 4}}, experts=experts), activations=False)
    experts = {"text_encoder": {"arch": "umt5", "fp8": True}}
    fp8 = estimate(write_config(tmp_path, {"lora": {"rank": 4}, "fp8": True}, experts=experts), activations=False)
    for name, blocks in (("text_encoder", "encoder.block."), ("transformer", "blocks.")):
        spec = {"text_encoder": {"arch": "umt5"}, "transformer": {"arch": "wan_t2v", "lora": {"rank": 4}}}[name]
        model = meta_model(Expert(arch=spec["arch"], trainable="lora" in spec,
                                  lora=LoraConfig(rank=4) if "lora" in spec else None))
        saved = sum(m.weight.numel() * 3 - m.weight.shape[0] * 4 for n, m in model.named_modules()
                    if type(m) is torch.nn.Linear and n.startswith(blocks) and "norm" not in n and "lora_" not in n)
        assert saved > 0 and plain[name].param_bytes - fp8[name].param_bytes == saved, name
    lora = fp8["transformer"]
    assert lora.optimizer_bytes == 8 * lora.trainable and lora.grad_bytes == 4 * lora.trainable
    assert (lora.trainable, lora.grad_bytes) == (plain["transformer"].trainable, plain["transformer"].grad_bytes)


def test_the_weight_bytes_of_an_fp8_expert_are_those_the_quantized_model_holds():
    """The estimate's weight bytes of an fp8 expert (counted on its meta model) equal the bytes of the parameters
    of the real quantized model's state dict (quanto's float8 data and scales; its activation scales are buffers):
    a change of quanto's layout fails here. A LoRA Wan over a bf16 float8 base, and UMT5 (tied embeddings, ``wo``
    in float32)."""
    for spec in (Expert(arch="wan_t2v", preset=TINY_WAN, dtype="bfloat16", fp8=True, trainable=True,
                        lora=LoraConfig(rank=4)),
                 Expert(arch="umt5", dtype="bfloat16", fp8=True)):
        real = presets.build_model(spec.arch, preset=spec.preset, dtype=torch.bfloat16, fp8=True, lora=spec.lora)
        buffers = {name for name, _ in real.named_buffers()}
        held = {(t.data_ptr(), t.numel()): t.numel() * t.element_size()  # a tied tensor once
                for k, t in real.state_dict().items() if k not in buffers}
        assert weight_bytes(spec, meta_model(spec)) == sum(held.values()) > 0, spec.arch


def test_offloaded_encoders_and_activations_move_to_the_host_column(tmp_path):
    """offload_encoders: the text encoder's weights move to the host column (and the VAE's encoder only when the
    batches bring latents; SyntheticVideos brings videos). offload_activations (with gradient checkpointing): the
    saved block inputs move to the host, the device keeps one block's recompute, so the two add up to the
    activations without it."""
    generator = {"gradient_checkpointing": True, "preset": {"num_layers": 3}}
    plain = estimate(write_config(tmp_path, generator))
    off = estimate(with_card(write_config(tmp_path, {**generator, "offload_activations": True}),
                             offload_encoders=True, cache_device="cpu"))
    assert off["text_encoder"].param_bytes == 0 and off["text_encoder"].host_bytes == plain["text_encoder"].param_bytes
    assert off["vae"].param_bytes == plain["vae"].param_bytes and off["vae"].host_bytes == 0
    gen, before = off["transformer"], plain["transformer"]
    assert 0 < gen.activation_bytes < before.activation_bytes
    assert gen.activation_bytes + gen.host_bytes == before.activation_bytes
    assert off.device_bytes == plain.device_bytes - plain["text_encoder"].param_bytes - gen.host_bytes


def test_offloaded_encoders_keep_the_vae_encoder_on_the_host_when_the_batches_bring_latents(tmp_path):
    """With latents in the batches (``PrecomputedVideos``, a ``latents_cache``) offload_encoders keeps the VAE's
    encoder in host memory too, as the run parks it (``ModelCard.offload_paths``): its weights move to the host
    column, the decoder's stay on the device."""
    path = with_card(write_config(tmp_path, {}), offload_encoders=True, cache_device="cpu")
    plain = estimate(path, activations=False)
    with open(path) as f:
        cfg = yaml.safe_load(f)
    cfg["data"] = {"class_path": "posttrain.datamodules.precomputed.PrecomputedVideos",
                   "init_args": {"path": str(tmp_path / "rows"), "batch_size": 1}}
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    latents = estimate(path, activations=False)
    encoder = meta_model(Expert(arch="wan_vae")).encoder
    moved = sum(p.numel() * p.element_size() for p in encoder.parameters())
    assert moved > 0 and latents["vae"].host_bytes == moved and plain["vae"].host_bytes == 0
    assert latents["vae"].param_bytes == plain["vae"].param_bytes - moved > 0
    assert latents["text_encoder"].host_bytes == plain["text_encoder"].host_bytes > 0
    assert any("its encoder" in note for note in latents["vae"].notes)


def test_estimate_is_a_subcommand(capsys):
    from posttrain.lit.tools.cli import main

    main(["estimate", "--config", os.path.join(ROOT, "configs", "finetune.yaml"), "--devices", "2",
          "--activations", "false"])
    out = capsys.readouterr().out
    assert "2 process(es)" in out and "transformer" in out and "total" in out, out
