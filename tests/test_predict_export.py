"""`posttrain predict` writes media; `posttrain export` writes folders the diffusers clients load on their
own, and the exported pipeline reproduces the package's own serving from the same noise."""
from __future__ import annotations

import os
import subprocess
import sys

import imageio.v2 as imageio
import pytest
import torch
from diffusers import UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel

import launch
from posttrain.callbacks.writer import MediaWriter
from posttrain.datamodules.prompts import Prompts
from posttrain.datamodules.synthetic import SyntheticVideos
from posttrain.lit.tools.export import export
from posttrain.lit.base import RunArgs
from posttrain.lit.finetune import Finetune
from posttrain.modules.models.cards import LoraConfig
from tests.conftest import wan_card
from tests.helpers import quick_trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_predict_writes_one_video_per_prompt(tmp_path):
    module = Finetune(wan_card(), sampler=None, run=RunArgs(frames=5, height=16, width=16))
    writer = MediaWriter(output_dir=str(tmp_path), format="mp4")
    trainer = quick_trainer(max_steps=1, callbacks=[writer])
    prompts = ["a red circle moving left on a blue background", "a green square moving up on a cyan background",
               "a yellow triangle moving down on a magenta background"]
    trainer.predict(module, Prompts(prompts=prompts, batch_size=2))
    files = sorted(os.listdir(tmp_path))
    assert len(files) == 3 and all(f.endswith(".mp4") for f in files)
    frames = imageio.mimread(os.path.join(tmp_path, files[0]))
    assert len(frames) == 5 and frames[0].shape[2] == 3


def test_generate_is_seeded():
    module = Finetune(wan_card(), run=RunArgs(frames=5, height=16, width=16))
    module.configure_model()
    a = module.generate(["a red circle"], seed=1)
    b = module.generate(["a red circle"], seed=1)
    c = module.generate(["a red circle"], seed=2)
    assert a.shape == (1, 3, 5, 16, 16) and torch.equal(a, b) and not torch.equal(a, c)


PROMPTS = ["a red circle moving left on a blue background", "a yellow square moving down on a magenta background"]
SIZE = RunArgs(frames=5, height=16, width=16)


def trained(tmp_path, name: str, guidance: float = 1.0, scheduler=None, ema: bool | None = None, **card_kwargs):
    """A finetune of 2 iterations (lr 1e-2, EMA 0.9 unless ``ema`` is false — by default only without ``card_kwargs``
    on the transformer —, 4 sampler steps; the sampler's default scheduler unless one is given) and its checkpoint."""
    from posttrain.modules.flow.samplers import FlowMatchSampler

    card = wan_card(lr=1e-2)
    for key, value in card_kwargs.items():
        setattr(card.specs["transformer"], key, value)
    sampler = FlowMatchSampler(num_steps=4, guidance_scale=guidance, scheduler=scheduler)
    module = Finetune(card, sampler=sampler, caption_dropout=0.0,
                      ema_decay=0.9 if (not card_kwargs if ema is None else ema) else None, run=SIZE)
    trainer = quick_trainer(max_steps=2, default_root_dir=tmp_path)
    trainer.fit(module, SyntheticVideos(num_samples=8, batch_size=2))
    ckpt = tmp_path / f"{name}.ckpt"
    trainer.save_checkpoint(ckpt)
    return module.eval(), str(ckpt)


def pipeline_latents(pipe: WanPipeline, module: Finetune, seed: int) -> torch.Tensor:
    """WanPipeline's latents for PROMPTS from the noise ``module.generate(seed=seed)`` starts from."""
    shape = module.stage.latent_shape(module.video)
    noise = torch.randn((len(PROMPTS), *shape), generator=torch.Generator().manual_seed(seed))
    settings = module.serving_settings()
    return pipe(PROMPTS, latents=noise, num_inference_steps=settings["num_inference_steps"],
                guidance_scale=settings["guidance_scale"], max_sequence_length=settings["max_sequence_length"],
                num_frames=SIZE.frames, height=SIZE.height, width=SIZE.width, output_type="latent").frames


@pytest.mark.parametrize("guidance,unipc", [(1.0, False), (3.0, False), (3.0, True)],
                         ids=["no_cfg", "cfg3", "unipc_cfg3"])
def test_exported_pipeline_reproduces_predict(tmp_path, guidance, unipc):
    """The exported folder run by the real WanPipeline gives the package's own samples (EMA transformer,
    scheduler, text stack, VAE) from the same noise: max |Δ| < 1e-4 in float32, latents and pixels. With UniPC
    (the multistep solver Wan ships) serving, the exported scheduler is UniPC with the same settings."""
    scheduler = UniPCMultistepScheduler(use_flow_sigmas=True, prediction_type="flow_prediction", flow_shift=3.0) \
        if unipc else None
    module, ckpt = trained(tmp_path, "run", guidance=guidance, scheduler=scheduler)
    out = export(ckpt, str(tmp_path / "pipe"))
    assert sorted(os.listdir(out)) == ["model_index.json", "scheduler", "serving.json", "text_encoder", "tokenizer",
                                       "transformer", "vae"]
    pipe = WanPipeline.from_pretrained(out)
    assert type(pipe.scheduler) is type(module.sampler.scheduler)
    assert pipe.scheduler.config.get("flow_shift") == module.sampler.scheduler.config.get("flow_shift")
    ours = module.generate(PROMPTS, seed=7, latents_only=True)
    theirs = pipeline_latents(pipe, module, seed=7)
    gap = (ours - theirs).abs().max().item()
    print(f"WanPipeline ({type(pipe.scheduler).__name__}) vs predict, guidance {guidance}: "
          f"max |Δ latents| = {gap:.2e}")
    assert gap < 1e-4
    pixels = module.stage.decode(ours)
    video = pipe.vae.decode(theirs / (1.0 / torch.tensor(pipe.vae.config.latents_std).view(1, -1, 1, 1, 1))
                            + torch.tensor(pipe.vae.config.latents_mean).view(1, -1, 1, 1, 1), return_dict=False)[0]
    assert (pixels - video.clamp(-1, 1)).abs().max() < 1e-4
    # the serving transformer (EMA) is what was exported, not the raw one
    ema, raw = module.card["transformer_ema"].state_dict(), module.card["transformer"].state_dict()
    exported = pipe.transformer.state_dict()
    assert all(torch.equal(exported[k], ema[k]) for k in ema)
    assert any(not torch.equal(exported[k], raw[k]) for k in raw)


@pytest.mark.slow
def test_export_loads_without_posttrain(tmp_path):
    """The single-model export through the CLI, loaded by a fresh interpreter that never imports posttrain."""
    module, ckpt = trained(tmp_path, "run")
    out = tmp_path / "exported"
    done = launch.posttrain("export", "--ckpt", ckpt, "--out", str(out), "--pipeline", "false", cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    code = ("import sys, torch; from diffusers import WanTransformer3DModel; "
            f"m = WanTransformer3DModel.from_pretrained({str(out)!r}); "
            "assert not any(k.startswith('posttrain') for k in sys.modules); "
            f"torch.save(m.state_dict(), {str(tmp_path / 'sd.pt')!r})")
    loaded = subprocess.run([sys.executable, "-c", code], cwd=str(tmp_path), capture_output=True, text=True,
                            timeout=120)
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    state = torch.load(tmp_path / "sd.pt")
    trained_weights = module.card["transformer_ema"].state_dict()
    assert state.keys() == trained_weights.keys()
    assert all(torch.equal(state[k], trained_weights[k]) for k in state)
    # any expert by name; an unknown one is refused naming the choices; a non-empty target is refused
    export(ckpt, str(tmp_path / "gen"), expert="transformer", pipeline=False)
    assert WanTransformer3DModel.from_pretrained(tmp_path / "gen").config.num_layers == 2
    with pytest.raises(ValueError, match=r"no component 'critic'; --expert is one of \['text_encoder'"):
        export(ckpt, str(tmp_path / "x"), expert="critic")
    with pytest.raises(FileExistsError, match="is not empty; choose a new folder or pass --overwrite true"):
        export(ckpt, str(tmp_path / "gen"), pipeline=False)
    export(ckpt, str(tmp_path / "gen"), pipeline=False, overwrite=True)


@pytest.mark.parametrize("ema", [False, True], ids=["raw", "ema"])
def test_lora_exports_as_the_adapter_file_and_merged(tmp_path, ema):
    """A LoRA-trained generator exported ``with_base`` in float32: the pipeline folder holds the base weights and the
    adapter file that ``pipe.load_lora_weights`` reads — together they reproduce predict (max |Δ latents| < 1e-4);
    ``--lora merged`` alone does too. With EMA (``configs/finetune.yaml``'s default) the run serves
    ``transformer_ema``, a copy that carries its own adapter: that adapter is what is exported."""
    module, ckpt = trained(tmp_path, "lora", ema=ema, lora=LoraConfig(rank=4, alpha=4.0))
    assert module.serving_transformer == ("transformer_ema" if ema else "transformer")
    ours = module.generate(PROMPTS, seed=3, latents_only=True)
    if ema:  # the EMA adapter is not the raw one: exporting the raw adapter would not reproduce predict
        with module.card.use("transformer") as raw:
            assert any(not torch.equal(a, b) for (k, a), b in zip(raw.state_dict().items(),
                                                                   module.card["transformer_ema"].state_dict().values())
                       if "lora_" in k)
    with _adapters_off(module.card[module.serving_transformer]):
        base = module.generate(PROMPTS, seed=3, latents_only=True)
    assert (ours - base).abs().max() > 1e-4  # the adapter trained: it matters
    pipe = WanPipeline.from_pretrained(export(ckpt, str(tmp_path / "adapter"), with_base=True, dtype="float32"))
    assert "pytorch_lora_weights.safetensors" in os.listdir(tmp_path / "adapter")
    assert (pipeline_latents(pipe, module, seed=3) - base).abs().max() < 1e-4  # base weights alone
    pipe.load_lora_weights(str(tmp_path / "adapter"))
    adapter_gap = (pipeline_latents(pipe, module, seed=3) - ours).abs().max().item()
    merged = WanPipeline.from_pretrained(export(ckpt, str(tmp_path / "merged"), lora="merged"))
    merged_gap = (pipeline_latents(merged, module, seed=3) - ours).abs().max().item()
    print(f"LoRA ({'EMA' if ema else 'raw'}) export vs predict: max |Δ latents| adapter file {adapter_gap:.2e}, "
          f"merged {merged_gap:.2e}")
    assert adapter_gap < 1e-4 and merged_gap < 1e-4


class _adapters_off:
    def __init__(self, model):
        self.model = model

    def __enter__(self):
        self.model.disable_adapters()

    def __exit__(self, *exc):
        self.model.enable_adapters()


def test_bfloat16_export_keeps_the_float32_modules(tmp_path):
    _, ckpt = trained(tmp_path, "run")
    out = export(ckpt, str(tmp_path / "bf16"), pipeline=False, dtype="bfloat16")
    model = WanTransformer3DModel.from_pretrained(out, torch_dtype=torch.bfloat16)
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    assert dtypes["blocks.0.attn1.to_q.weight"] == torch.bfloat16
    assert dtypes["scale_shift_table"] == torch.float32
    assert all(dtype == torch.float32 for name, dtype in dtypes.items() if "time_embedder" in name)
    from safetensors import safe_open

    with safe_open(os.path.join(out, "diffusion_pytorch_model.safetensors"), "pt") as f:
        assert f.get_tensor("scale_shift_table").dtype == torch.float32
        assert f.get_tensor("blocks.0.attn1.to_q.weight").dtype == torch.bfloat16
