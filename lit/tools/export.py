"""``posttrain export``: what a run trained, as folders the diffusers / transformers clients load.

By default a generator exports as a **whole pipeline folder** — ``model_index.json``, ``scheduler/`` (the
scheduler the run sampled with), ``tokenizer/``, ``text_encoder/``, ``vae/``, ``transformer/`` (FLUX adds
``tokenizer_2/``, ``text_encoder_2/``; a Wan 2.1 I2V ``image_encoder/``, ``image_processor/``) — that the
generator's pipeline (``WanPipeline``, ``WanImageToVideoPipeline``, ``FluxPipeline``) loads with
``from_pretrained(out)`` and that, from the same noise, reproduces ``posttrain predict`` (tested). A
workflow exports one stage per call (``--expert t2i_transformer``). The exported transformer is the one the run *serves* (``transformer_ema`` when the method
keeps an EMA), unless ``--expert`` names another. ``serving.json`` beside it records the settings to
call the pipeline with (steps, guidance, text length, size).

- ``--pipeline false`` writes one model folder (``WanTransformer3DModel.from_pretrained(out)``); any
  expert exports this way (``--expert refiner_0`` gives a ``Qwen2ForCausalLM`` folder).
- A LoRA-trained generator exports its **adapter alone** (``modules/io/lora.py``), bfloat16:
  ``pytorch_lora_weights.safetensors`` (PEFT keys, what ``pipe.load_lora_weights(out)`` reads),
  ``comfyui_lora.safetensors`` (the original checkpoint's key names, what ComfyUI loads; ``--format`` picks) and
  ``adapter.json`` (rank, alpha, target modules, the base weights' source). ``--with_base true`` writes the base
  weights (pipeline or model folder) with the adapter files beside them; ``--lora merged`` fuses the adapter into them.
- ``--dtype``: the adapter is bfloat16 and whole weights float32 unless it is given; ``bfloat16`` keeps in float32
  the modules the class keeps there (``_keep_in_fp32_modules``), as ``from_pretrained(torch_dtype=...)`` does.

    posttrain export --ckpt runs/finetune/checkpoints/last.ckpt --out exported/finetune
"""
from __future__ import annotations

import json
import os
from typing import Any, Literal, Optional

import torch

from posttrain.modules.io import checkpoints
from posttrain.modules.io import lora as adapter_lora
from posttrain.modules.models import presets
from posttrain.modules.models.cards import dtype_of
from posttrain.modules.models.generators import ADAPTERS


def export(ckpt: str, out: str, expert: Optional[str] = None, pipeline: bool = True,
           lora: Literal["adapter", "merged"] = "adapter", with_base: bool = False,
           format: Optional[Literal["diffusers", "comfyui", "both"]] = None,
           dtype: Optional[Literal["float32", "bfloat16"]] = None, overwrite: bool = False) -> str:
    """Write what checkpoint ``ckpt`` trained to folder ``out``.

    Args:
        ckpt: a ``.ckpt`` file or a sharded checkpoint folder written by ``posttrain fit``.
        out: the folder to write (must be empty or new unless ``overwrite``).
        expert: the component to export; None = the transformer the run serves (its EMA when kept).
        pipeline: a generator as a whole diffusers pipeline folder; false writes the model alone.
        lora: a LoRA-trained generator as its adapter (``adapter``) or fused into its weights (``merged``).
        with_base: with ``lora: adapter``, write the base weights too (a pipeline or model folder, as ``pipeline``
            says) with the adapter files beside them; false writes the adapter alone.
        format: the adapter's files: ``diffusers`` (PEFT keys), ``comfyui`` (the original checkpoint's key names),
            or ``both``; None = every format its family has (both for Wan and FLUX, diffusers for SD3).
        dtype: dtype of the written weights (float32-kept modules stay float32); None = bfloat16 for an adapter,
            float32 for whole weights.
        overwrite: allow writing into a non-empty ``out``.
    """
    if os.path.isdir(out) and os.listdir(out) and not overwrite:
        raise FileExistsError(f"export: {out!r} is not empty; choose a new folder or pass --overwrite true")
    if os.path.exists(out) and not os.path.isdir(out):
        raise FileExistsError(f"export: {out!r} is a file; give a folder path")
    checkpoint = checkpoints.load(ckpt)  # verified; ZeRO shards gathered; weights only
    meta = checkpoint.get("posttrain")
    if meta is None:
        raise ValueError(f"export: {ckpt!r} was not written by posttrain fit (no 'posttrain' entry)")
    parts = _Parts(checkpoint, ckpt)
    serving = meta.get("serving") or {}
    stages = serving.get("stages")  # a workflow: one generator stage per export, named by its component
    if stages is not None and expert is None:
        raise ValueError(f"export: {ckpt!r} is a workflow; export one stage at a time with --expert, one of "
                         f"{sorted(stages)} (or any other component with --pipeline false)")
    name = expert or serving.get("transformer") or "transformer"
    if name not in meta["configs"]:
        raise ValueError(f"export: checkpoint has no component {name!r}; --expert is one of {sorted(meta['configs'])}")
    if stages is not None:
        serving = stages.get(name, {})
    weights_dtype = dtype_of(dtype or "float32")
    adapter = ADAPTERS.get(parts.arch(name))
    adapter_files = parts.lora(name) is not None and lora != "merged"  # the adapter as its own files
    if adapter_files and adapter is None:
        raise ValueError(f"export: {name!r} ({parts.arch(name)}) has a LoRA adapter; export it with --lora merged")
    pair = serving.get("transformer_2") if name == serving.get("transformer") else None  # Wan 2.2's noise experts
    if pair and adapter_files and pipeline and not with_base:  # one adapter alone would serve half of the steps
        raise ValueError(f"export: {name!r} is the high-noise expert of a pair with {pair!r}; export the pair whole "
                         f"with --lora merged, or each expert's adapter alone with --expert {name} --pipeline false "
                         f"and --expert {pair} --pipeline false")
    if pair and pipeline and adapter is not None and parts.lora(pair) is not None and lora != "merged":
        raise ValueError(f"export: the low-noise expert {pair!r} carries a LoRA adapter; export the pair with "
                         f"--lora merged, or each adapter alone with --expert {pair} --pipeline false")
    model = parts.model(name)
    lora_files = None  # the adapter's files, ready to write
    if adapter_files:
        formats = {None: adapter_lora.formats_of(parts.arch(name)), "both": adapter_lora.FORMATS}.get(
            format, (format,))
        trained = adapter_lora.adapter_of(model, name, parts.arch(name), parts.source(name))
        lora_files = adapter_lora.prepare(trained, formats, dtype_of(dtype or "bfloat16"))
    if parts.lora(name) is not None:
        _unload_adapter(model, fuse=lora == "merged")
    os.makedirs(out, exist_ok=True)
    if lora_files is not None and not with_base:  # the adapter alone, and the settings to serve it with
        lora_files.write(out)
        _write_serving(out, adapter, adapter.pipeline_class(), name, serving)
        return out
    if not (pipeline and adapter is not None):
        presets.cast(model, weights_dtype).save_pretrained(out, safe_serialization=True)
        if lora_files is not None:
            lora_files.write(out)
        return out
    # the whole pipeline: the serving transformer with the card's VAE, text stack (and image encoder) and the
    # run's scheduler, under the pipeline's component names (the adapter's: text_encoder, tokenizer_2, ...)
    encoders = serving.get("text_encoders", adapter.text_encoders)
    text_encoders = [parts.model(encoder) for encoder in encoders]
    tokenizers = [presets.tokenizer_of(parts.arch(encoder), parts.source(encoder)["tokenizer"], text_encoder.config)
                  for encoder, text_encoder in zip(encoders, text_encoders)]
    image_encoder = parts.model(serving["image_encoder"]) if serving.get("image_encoder") else None
    components = adapter.pipeline_components(model, parts.model(serving.get("vae", "vae")),
                                             list(zip(text_encoders, tokenizers)), image_encoder)
    if pair:  # the low-noise expert whole (a LoRA one's adapter fused in: refused above unless --lora merged)
        transformer_2 = parts.model(pair)
        if parts.lora(pair) is not None:
            _unload_adapter(transformer_2, fuse=True)
        components.update(transformer_2=transformer_2, boundary_ratio=serving["boundary_ratio"])
    for key, value in components.items():
        if isinstance(value, torch.nn.Module):
            presets.cast(value, weights_dtype)
    components["scheduler"] = _scheduler(serving)
    pipe = adapter.pipeline(components)
    pipe.save_pretrained(out, safe_serialization=True)
    if lora_files is not None:
        lora_files.write(out)
    _write_serving(out, adapter, type(pipe), name, serving)
    return out


def _unload_adapter(model: torch.nn.Module, fuse: bool) -> None:
    """Take ``model``'s LoRA adapter off, fused into its weights first with ``fuse`` (``--lora merged``)."""
    if fuse:
        model.fuse_lora(lora_scale=1.0)
    model.unload_lora()


def _write_serving(out: str, adapter, pipeline_class: type, name: str, serving: dict[str, Any]) -> None:
    """``serving.json``: the pipeline's call that samples as ``predict`` does. ``sigmas``: a few-step student's list
    (pass it to ``scheduler.set_timesteps``); ``chunk_frames``: a block-causal student's chunk, which the
    bidirectional pipeline does not reproduce."""
    if "num_inference_steps" not in serving:  # a checkpoint without serving settings (no generator stage)
        return
    extra = {k: serving[k] for k in ("sigmas", "chunk_frames") if serving.get(k) is not None}
    with open(os.path.join(out, "serving.json"), "w") as f:
        json.dump({"pipeline": pipeline_class.__name__, "transformer": name, **adapter.pipeline_call(serving),
                   **extra}, f, indent=1)


def _scheduler(serving: dict[str, Any]):
    import diffusers

    spec = serving.get("scheduler") or {"class": "FlowMatchEulerDiscreteScheduler", "config": {"shift": 3.0}}
    config = {k: v for k, v in spec["config"].items() if not k.startswith("_")}
    return getattr(diffusers, spec["class"]).from_config(config)


class _Parts:
    """Components of a checkpoint rebuilt as their real classes: config from the checkpoint, weights from
    its state dict (or, for an expert the checkpoint does not hold, from the expert's source)."""

    def __init__(self, checkpoint: dict, path: str):
        self.meta, self.state, self.path = checkpoint["posttrain"], checkpoint["state_dict"], path
        self.roles = {n: sig["role_of"] for n, sig in self.meta["signature"].items() if "role_of" in sig}

    def _of(self, name: str) -> str:
        return self.roles.get(name, name)

    def arch(self, name: str) -> str:
        return self.meta["arch"][self._of(name)]

    def source(self, name: str) -> dict[str, Any]:
        sources = self.meta.get("sources") or {}
        return sources.get(self._of(name)) or {"arch": self.arch(name), "tokenizer": None, "lora": None}

    def lora(self, name: str) -> Optional[dict]:
        """The LoRA adapter component ``name`` carries: a LoRA expert's and its role copies' (an EMA, an ``old``
        copy: each carries its own adapter weights); a LoRA reference is the expert with its adapter off."""
        role = self.meta["signature"].get(name, {}).get("role")
        return None if role == "reference" else self.source(name).get("lora")

    def model(self, name: str) -> torch.nn.Module:
        """Component ``name`` through the one model recipe (``presets.build_model``): its config and weights from the
        checkpoint (with its LoRA adapter, if it carries one); a frozen expert the checkpoint leaves out from its own
        source; a LoRA expert (or its EMA / ``old`` copy) whose base the checkpoint leaves out from the base's source
        with the checkpoint's adapter loaded on top."""
        prefix = f"card.models.{name}."
        state = {k[len(prefix):]: v for k, v in self.state.items() if k.startswith(prefix)}
        if not state or name in (self.meta.get("frozen") or {}):
            # from the expert's source: a frozen expert the checkpoint does not hold; a LoRA base it left out, in the
            # dtype it trained in, with the checkpoint's adapter loaded on top
            source = self.source(name)
            model = presets.build_model(source["arch"], source.get("pretrained"), source.get("subfolder"),
                                        source.get("preset") or None,
                                        dtype_of(source.get("dtype") or "float32") if state else None,
                                        lora=self.lora(name) if state else None, published=source.get("published"))
            if not state:
                return model
            try:
                return presets.load_onto_base(model, state).eval()
            except ValueError as err:
                raise ValueError(f"export: {name!r} in {self.path!r}: {err}") from err
        try:
            model = presets.build_model(self.arch(name), config=self.meta["configs"][name], weights=state,
                                        lora=self.lora(name))
        except ValueError as err:
            raise ValueError(f"export: {name!r} in {self.path!r}: {err}") from err
        return model.eval()
