"""What a generator family provides: the adapter interface it implements, the VAE codec it registers, the
architectures it declares, and the video size.

A family file (``wan.py``, ``flux.py``, ``sd3.py``, …) subclasses ``GeneratorAdapter`` after its diffusers
pipeline, subclasses ``VAECodec`` for a VAE of its own, and declares ``ARCHITECTURES``: name -> ``Architecture``
(the real class, its tiny preset, its shipped asset, its adapter or codec, and what estimate, export and the card
need to know of it). ``modules.models.generators`` collects the ``ARCHITECTURES`` of every module of the package and
``modules.models.presets`` adds the shared components (text encoders, the image encoder, LMs): a new family, with its
VAE, is one new file here.

Nothing here imports the card: an adapter reads a card and a stage through the two protocols below (``Card``,
``Stage``: what a family reads of ``cards.ModelCard`` and ``GeneratorStage``), so imports run one way, from the card
to the families that build its experts.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Literal, Mapping, Optional, Protocol

import torch

from posttrain.modules.flow.conditioning import Conditioning
from posttrain.modules.flow.samplers import CleanLatents, FlowMatchSampler, guided

# ByT5 ids are byte + 3 (pad 0, eos 1, unk 2) plus 125 extra ids: 384 in all. Every tiny text model uses this
# vocabulary so that ``ByT5Tokenizer()`` (no vocabulary file) serves all of them; their width is TEXT_DIM, which
# the tiny generators read as their text width.
BYT5_VOCAB = 384
TEXT_DIM = 32


class Card(Protocol):
    """What a generator family reads of a card (``modules.models.cards.ModelCard`` is the one implementation)."""

    specs: Mapping[str, Any]  # expert name -> ``Expert`` (its ``arch``)
    tokenizers: Mapping[str, Any]
    text_max_length: int
    boundary_ratio: Optional[float]  # where a pair of noise experts hands over; None: one generator
    roles: Mapping[str, tuple[str, str]]  # role component name -> (source expert, role)

    def __getitem__(self, name: str) -> torch.nn.Module: ...

    def has(self, name: str) -> bool: ...

    def use(self, name: str) -> ContextManager[torch.nn.Module]: ...

    def text_embeds(self, encoder: str, prompts: list[str],
                    compute: Callable[[list[str]], torch.Tensor]) -> torch.Tensor: ...


class Stage(Protocol):
    """What an adapter reads of the stage that drives it (``modules.models.generators.GeneratorStage``): the card and
    the names of the experts it runs."""

    card: Card
    transformer: str
    vae: str
    image_encoder: Optional[str]
    embedded_guidance: Optional[float]

    @property
    def encoders(self) -> tuple[str, ...]: ...


@dataclass(frozen=True)
class TrainingForward:
    """The size of one training forward, for ``posttrain estimate``'s activation trace: ``rows`` samples,
    ``text_length`` tokens per prompt (``card.text_max_length``; an LM: prompt plus generated tokens), and for a
    generator its ``latent_shape`` (C, F', h, w) and its ``stage`` (on the meta card: configs, no weights)."""

    rows: int
    text_length: int
    latent_shape: Optional[tuple[int, ...]] = None
    stage: Optional[Stage] = None


@dataclass(frozen=True)
class Architecture:
    """One architecture a card can build by name (``arch:``): a real diffusers/transformers class and what the
    package must know of it.

    Args:
        cls: the model class (a diffusers ``ModelMixin`` or a transformers ``PreTrainedModel``).
        preset: its constructor config, shrunk so the embedded default trains on a CPU in seconds.
        kind: ``generator`` (driven by ``adapter``), ``vae``, ``text_encoder``, ``image_encoder`` or ``lm``.
            Text encoders and LMs get a tokenizer on the card.
        adapter: how a generator is driven (one instance may serve several architectures).
        codec: how a VAE maps pixels to the normalized latents every adapter works in (``VAECodec``; every ``vae``
            declares one).
        asset: ``modules/assets/<name>`` ships trained weights of exactly this preset, loaded when the expert has
            no ``preset`` overrides; a folder name instead of True: that folder of ``modules/assets`` (another
            architecture's weights that this class loads key for key, e.g. the world's Wan VAE as Qwen-Image's).
        causal: a block-causal generator (samples chunk by chunk through a KV cache: ``sampler.chunk_frames``).
        layer_keys: the config keys that count identical blocks (estimate traces 1 and 2 of each kind).
        blocks: the name of the ``ModuleList`` of identical blocks, and ``residual_outputs`` the Linear layers inside
            a block whose outputs are its residual branches: with them zeroed a block is the identity, so an
            expert ``init_from`` a shallower one of the same architecture starts as exactly its function (block
            expansion, LLaMA Pro: each source block followed by copies of itself whose residual outputs are zero).
        widths: the config keys that set its width (Wan: the head count and ``ffn_dim``), and ``hidden_size`` its
            residual stream's width from a config: an expert ``init_from`` one of the same architecture that differs
            from it only in these (and ``layer_keys``), by integer multiples, starts as exactly its function
            (widening: every unit copied, each copy's outgoing weights a random share of the source's).
        tokenizer_length_key: the config key a tokenizer built for it pads to (``model_max_length``; CLIP's
            position table), None for none.
        inputs: a non-generator's training-forward input shapes, ``(config, TrainingForward) -> {name: shape}``
            (a generator's come from its adapter).
    """

    cls: type
    preset: dict[str, Any]
    kind: Literal["generator", "vae", "text_encoder", "image_encoder", "lm"]
    adapter: Optional["GeneratorAdapter"] = None
    codec: Optional["VAECodec"] = None
    asset: bool | str = False
    causal: bool = False
    layer_keys: tuple[str, ...] = ()
    blocks: Optional[str] = None
    residual_outputs: tuple[str, ...] = ()
    widths: tuple[str, ...] = ()
    hidden_size: Optional[Callable[[Any], int]] = field(default=None, repr=False)
    tokenizer_length_key: Optional[str] = None
    inputs: Optional[Callable[[dict, TrainingForward], dict[str, tuple]]] = field(default=None, repr=False)

    @property
    def tokenized(self) -> bool:
        return self.kind in ("text_encoder", "lm")

    def training_inputs(self, config: dict, forward: TrainingForward) -> dict[str, tuple]:
        """Shapes of one training forward's inputs (keyword -> shape; ``input_ids`` are integers, ``timestep`` a
        timestep, the rest floats)."""
        if self.adapter is not None:
            return self.adapter.training_inputs(config, forward)
        if self.inputs is not None:
            return self.inputs(config, forward)
        raise ValueError(f"no training-forward inputs are known for a {self.cls.__name__}")


@dataclass(frozen=True)
class LoraName:
    """One rule of a family's original LoRA naming (``OriginalLoraNames``): the diffusers module whose name fully
    matches the regex ``diffusers`` is the original checkpoint's module ``original`` (a template: ``\\1`` is the
    regex's first group, a block number).

    Args:
        part, parts: the original module fuses ``parts`` diffusers modules (FLUX's ``img_attn.qkv`` is ``to_q``,
            ``to_k``, ``to_v``), stacked on its output rows in that order; this one is part ``part``.
        alpha: the original file's ``.alpha`` of this module is read by diffusers' converter (else its scale is
            folded into ``lora_up`` / ``lora_B`` and no ``.alpha`` is written).
        swap_halves: the original module's output holds the two halves of the diffusers one swapped (FLUX's final
            modulation: shift, scale against diffusers' scale, shift).
    """

    diffusers: str
    original: str
    part: int = 0
    parts: int = 1
    alpha: bool = True
    swap_halves: bool = False


@dataclass(frozen=True)
class OriginalLoraNames:
    """How LoRA files in the original checkpoint's key names (what ComfyUI and the model's own repository load)
    name a family's layers: ``<prefix><original module>.<down|up>.weight`` and ``<prefix><original module>.alpha``.
    ``modules/io/lora.py`` writes them; diffusers' ``load_lora_weights`` converts them back
    (``diffusers/loaders/lora_conversion_utils.py``)."""

    prefix: str
    down: str
    up: str
    names: tuple[LoraName, ...]


@dataclass(frozen=True)
class VideoSize:
    """Pixel size of what a method generates (rollouts, sample videos, ``predict``). An image is a
    one-frame video. Wan's VAE needs ``frames = 4k + 1``; height and width must be multiples of the VAE's
    spatial factor times the transformer's patch size (both read from the models' configs)."""

    frames: int = 9
    height: int = 32
    width: int = 32


class VAECodec:
    """How one VAE class turns pixels into the normalized latents every adapter works in, and back, as its diffusers
    pipeline does. Video is (B, C, F, H, W) in [-1, 1]; an image is a one-frame video; latents are
    (B, z, F', h, w) float32. A family with a VAE of its own subclasses this beside its adapter and names it in the
    VAE's ``Architecture(codec=...)``; ``modules.models.vae`` (what callers use) finds it by the VAE's class."""

    def encode(self, vae: torch.nn.Module, video: torch.Tensor, sample: bool = False,
               generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """(B, C, F, H, W) pixels -> (B, z, F', h, w) normalized float32 latents (mode unless ``sample``)."""
        raise NotImplementedError

    def decode(self, vae: torch.nn.Module, latents: torch.Tensor) -> torch.Tensor:
        """(B, z, F', h, w) normalized latents -> (B, C, F, H, W) pixels clamped to [-1, 1]."""
        raise NotImplementedError

    def scale_factors(self, vae: torch.nn.Module) -> tuple[int, int]:
        """(temporal, spatial) compression of ``vae``, from its config (as the diffusers pipelines read it)."""
        raise NotImplementedError

    def latent_channels(self, vae: torch.nn.Module) -> int:
        raise NotImplementedError

    def preset(self, config: dict, given: dict) -> dict:
        """The preset a card builds: ``config`` (the tiny preset with the user's overrides ``given`` merged in),
        completed where the VAE's config must follow its layers."""
        return config

    def latent_shape(self, vae: torch.nn.Module, frames: int, height: int, width: int,
                     patch: tuple[int, int] = (1, 1)) -> tuple[int, int, int, int]:
        """(C, F', h, w) latents of a (frames, height, width) video; a size the VAE (times the transformer's
        spatial ``patch``) cannot take is an error that names the option and a size that works."""
        temporal, spatial = self.scale_factors(vae)
        problems = []
        if (frames - 1) % temporal:
            problems.append(f"frames={frames} must be {temporal}k+1 (the VAE compresses time by {temporal}); "
                            f"e.g. {-(-max(frames - 1, 0) // temporal) * temporal + 1}")
        for name, value, p in (("height", height, patch[0]), ("width", width, patch[1])):
            if value < 1 or value % (spatial * p):
                problems.append(f"{name}={value} must be a multiple of {spatial * p} (VAE factor {spatial}"
                                f"{f' × patch {p}' if p > 1 else ''}); e.g. "
                                f"{max(1, -(-value // (spatial * p))) * spatial * p}")
        if problems:
            raise ValueError("video size: " + "; ".join(problems))
        return self.latent_channels(vae), (frames - 1) // temporal + 1, height // spatial, width // spatial


# VAE class -> its codec, from the ``codec`` of every family's VAE architectures (``modules.models.generators``
# fills it as it collects the families; importing anything of this package runs that first)
CODECS: dict[type, VAECodec] = {}


def codec_of(vae: torch.nn.Module) -> VAECodec:
    """The codec registered for ``vae``'s class (or the nearest class it derives from; ``__class__``, which a card's
    routed expert reports as its model's)."""
    for cls in vae.__class__.__mro__:
        if cls in CODECS:
            return CODECS[cls]
    raise TypeError(f"no latent codec for {vae.__class__.__name__}; a VAE family declares one beside its architecture "
                    f"(`Architecture(cls, preset, 'vae', codec=...)` in modules/models/generators/<family>.py)")


def _config(model: torch.nn.Module):
    return model.config


def _dtype(model: torch.nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype


class GeneratorAdapter:
    """How one architecture is driven. Subclasses follow their diffusers pipeline."""

    #: text-encoder experts the architecture reads, in the pipeline's order (``text_encoder``, ``text_encoder_2``)
    text_encoders: tuple[str, ...] = ("text_encoder",)
    #: the ``arch`` of each of them (what a card must give, and what a start-up message suggests); every family sets it
    text_encoder_archs: tuple[str, ...] = ()
    #: the text encoders in words, for a message about them
    reads: str = "its text encoders"
    #: whether the conditioning holds an image (the first frame of the video to generate)
    takes_image: bool = False
    #: the original checkpoint's names of its LoRA layers (``posttrain export --format comfyui``); None: not known
    original_lora: Optional[OriginalLoraNames] = None

    def text_encoder_problems(self, stage: Stage, archs: list[str]) -> list[str]:
        """Problems of the stage's text encoders, whose ``arch`` are ``archs`` (in the order of ``text_encoders``)."""
        if len(archs) != len(self.text_encoder_archs) or list(archs) == list(self.text_encoder_archs):
            return []
        give = " and ".join(f"`arch: {arch}`" for arch in self.text_encoder_archs)
        return [f"{type(self).__name__} ({stage.transformer!r}) reads {self.reads}; {list(stage.encoders)} are "
                f"{list(archs)}: give {give}"]

    def text(self, stage: Stage, prompts: list[str]) -> dict[str, torch.Tensor]:
        """The text part of the conditioning of ``prompts`` (rows cached by encoder version and prompt)."""
        raise NotImplementedError

    def image(self, stage: Stage, images: torch.Tensor, size: VideoSize) -> dict[str, torch.Tensor]:
        """The image part of the conditioning: ``images`` (B, 3, H, W) in [-1, 1] for a ``size`` output."""
        raise ValueError(f"{type(self).__name__} generates from text alone; it takes no conditioning image")

    def image_from_latents(self, stage: Stage, latents: torch.Tensor) -> Optional[dict[str, torch.Tensor]]:
        """The image part of the conditioning read off the clips' clean latents (B, C, F', h, w), for batches of
        precomputed latents without pixels (a ``latents_cache``, ``PrecomputedVideos``); None (the default) where the
        image must come as pixels."""
        return None

    def extra(self, stage: Stage, batch_size: int) -> dict[str, torch.Tensor]:
        """Further per-row inputs that are neither text nor image (FLUX's embedded guidance)."""
        return {}

    def guided(self, v_cond: torch.Tensor, v_uncond: Optional[torch.Tensor], scale, rescale: float = 0.0
               ) -> torch.Tensor:
        """The guided velocity its pipeline computes from the conditional and unconditional ones: plain CFG
        (``samplers.guided``) unless the pipeline does otherwise."""
        return guided(v_cond, v_uncond, scale, rescale)

    def velocity(self, transformer: torch.nn.Module, x: torch.Tensor, timestep: torch.Tensor,
                 cond: Conditioning, **model_kwargs) -> torch.Tensor:
        """``model_kwargs``: what a block-causal transformer takes besides (``kv_cache``, ``update_cache``)."""
        raise NotImplementedError

    def clean_latents(self, cond: Conditioning, latent_shape: tuple[int, ...]) -> Optional[CleanLatents]:
        """Latents the sampler holds clean at every step for ``cond`` and latents of ``latent_shape`` (C, F', h, w):
        an image-to-video model whose first latent frame is the image's (Wan 2.2 TI2V). None: none."""
        return None

    def new_cache(self, transformer: torch.nn.Module):
        """An empty KV cache of a block-causal ``transformer`` (chunked sampling); None if it has none."""
        new_cache = getattr(transformer, "new_cache", None)
        return new_cache() if callable(new_cache) else None

    def latent_shape(self, transformer: torch.nn.Module, vae: torch.nn.Module, size: VideoSize) -> tuple[int, ...]:
        raise NotImplementedError

    def schedule_kwargs(self, sampler: FlowMatchSampler, latent_shape: tuple[int, ...]) -> dict:
        """What the pipeline passes to ``scheduler.set_timesteps`` besides the step count."""
        return {}

    def attention_tokens(self, config: dict, shapes: dict[str, tuple]) -> int:
        """Tokens per sample the transformer's self-attention sees in a forward of inputs ``shapes``
        (``training_inputs``), for ``posttrain estimate``'s sequence-parallel all-to-all buffers."""
        raise NotImplementedError(f"{type(self).__name__} does not say how many tokens its attention sees")

    def training_inputs(self, config: dict, forward: "TrainingForward") -> dict[str, tuple]:
        """Shapes of the transformer's inputs in one training forward (``forward.latent_shape`` latents, as the
        velocity call passes them), for ``posttrain estimate``; nothing is allocated."""
        raise NotImplementedError

    def pipeline_class(self) -> type:
        """The diffusers pipeline that serves this architecture (what export writes a folder for)."""
        raise NotImplementedError

    def pipeline_components(self, transformer: torch.nn.Module, vae: torch.nn.Module,
                            text_encoders: list[tuple[torch.nn.Module, Any]],
                            image_encoder: Optional[torch.nn.Module] = None) -> dict:
        """The pipeline's components but the scheduler: ``text_encoders`` as (model, tokenizer) pairs, in the
        order of ``text_encoders``, under the pipeline's names (``text_encoder``, ``tokenizer``,
        ``text_encoder_2``, ``tokenizer_2``, …)."""
        if image_encoder is not None:
            raise ValueError(f"{type(self).__name__} takes no image encoder")
        components = {"transformer": transformer, "vae": vae}
        for i, (encoder, tokenizer) in enumerate(text_encoders):
            suffix = "" if i == 0 else f"_{i + 1}"
            components[f"text_encoder{suffix}"], components[f"tokenizer{suffix}"] = encoder, tokenizer
        return components

    def pipeline(self, components: dict):
        """The pipeline object of exported ``components`` (transformer, vae, text_encoder[_2], tokenizer[_2],
        scheduler, image_encoder, image_processor), ready for ``save_pretrained``."""
        return self.pipeline_class()(**components)

    def pipeline_call(self, serving: dict) -> dict:
        """The keyword arguments that make the pipeline sample as ``predict`` does (written to ``serving.json``),
        from a run's ``serving_settings``."""
        return {"num_inference_steps": serving["num_inference_steps"], "guidance_scale": serving["guidance_scale"],
                **({"guidance_scale_2": serving["guidance_scale_2"]} if "guidance_scale_2" in serving else {}),
                "max_sequence_length": serving["max_sequence_length"], "num_frames": serving["num_frames"],
                "height": serving["height"], "width": serving["width"]}
