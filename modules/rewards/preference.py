"""Preference and quality rewards from **local** folders: PickScore, HPSv2.1 and the LAION aesthetic predictor.

Each is a ``Reward`` (``modules/rewards/``) that scores images; a video is scored frame-wise on up to
``frames`` evenly spaced frames (``frame_indices``: frames ``round(linspace(0, F-1, n))``, the first and the last
included, as ``CLIPScore``) and its score is the **mean over those frames** (an image is a one-frame video).
Frames reach the model as the reference implementations read a picture: quantized to uint8 RGB (what saving a
PNG does) and put through the reference's own preprocessing.

| reward | library | score (the reference's) |
|---|---|---|
| ``PickScore`` | transformers ``CLIPModel`` + ``CLIPProcessor`` | ``logit_scale.exp() · cos(image, text)`` (PickScore's README) |
| ``HPSv21`` | transformers ``CLIPModel`` (the open_clip ViT-H-14 in transformers' layout) | ``cos(image, text)`` on HPSv2's ``preprocess_val`` (``hpsv2/img_score.py``) |
| ``LaionAesthetic`` | transformers ``CLIPModel`` (its image tower) + the predictor's MLP head in torch | ``MLP(image_embedding / ‖image_embedding‖)`` (``simple_inference.py``) |

HPSv2's own library is open_clip, whose package (``open-clip-torch``) needs ``torchvision``; the registry's torchvision
wheels are built for CUDA torch and do not import beside the CPU torch this package is tested on (nor would pip
keep that torch), so HPSv2.1 runs on transformers' CLIP, which holds the same ViT-H-14 exactly (PickScore is that
architecture too); ``hps_state_dict`` maps HPSv2's open_clip checkpoint onto it. ImageReward is not built: its
package pins ``timm==0.6.13``, needs torchvision, unpickles its checkpoint with a bare ``torch.load`` and downloads
``bert-base-uncased`` while it builds the model.

Every folder is checked and loaded when the reward is built, so a folder that cannot serve (missing, another
model class, missing files or weights) stops the run at start-up with the fix named. Nothing is downloaded:
every ``from_pretrained`` reads a local folder with ``local_files_only=True`` and safetensors weights only. The
models are frozen (eval mode, no gradients) and move to the media's device on first use.
"""
from __future__ import annotations

import os
from typing import Any, Literal, Optional

import numpy as np
import torch
from torch import nn

from posttrain.modules.rewards.base import Reward, RewardOutput, prompts_for_scoring

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# OpenAI CLIP's normalisation, which open_clip's ViT-H-14 (HPSv2) uses too (open_clip/constants.py)
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
AESTHETIC_HEAD = "aesthetic_head.safetensors"


def frame_indices(num_frames: int, frames: int) -> torch.Tensor:
    """Indices of up to ``frames`` evenly spaced frames of a ``num_frames``-frame video (first and last kept)."""
    return torch.linspace(0, num_frames - 1, min(frames, num_frames)).round().long()


def to_pictures(images: torch.Tensor) -> list[np.ndarray]:
    """(N, 3, H, W) in [-1, 1] -> N uint8 (H, W, 3) arrays: a frame as a saved picture holds it."""
    pixels = ((images.detach().float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return list(pixels.permute(0, 2, 3, 1).cpu().numpy())


def features(out: Any) -> torch.Tensor:
    """The projected embedding of ``get_image_features``/``get_text_features`` (an output object in transformers 5)."""
    return out if isinstance(out, torch.Tensor) else out.pooler_output


def cosines(model: nn.Module, pixel_values: torch.Tensor, tokens) -> torch.Tensor:
    """(N,) cosine of each picture's and its text's projected CLIP embeddings, in float32."""
    image = features(model.get_image_features(pixel_values=pixel_values)).float()
    text = features(model.get_text_features(input_ids=tokens["input_ids"],
                                            attention_mask=tokens["attention_mask"])).float()
    return ((image / image.norm(dim=-1, keepdim=True)) * (text / text.norm(dim=-1, keepdim=True))).sum(-1)


def _fix(expected: str) -> str:
    return (f"give `path:` a local folder holding {expected} (`huggingface-cli download <repo> --local-dir <folder>` "
            f"once, then the folder; nothing is downloaded at run time)")


def load_checked(cls, path: str, what: str, model_types: tuple[str, ...], expected: str, **kwargs) -> nn.Module:
    """``cls.from_pretrained(path)`` of a local folder, frozen, refused unless its ``config.json`` names one of
    ``model_types`` and every weight of ``cls`` is in the folder's safetensors (a missing one would stay random)."""
    from transformers import AutoConfig

    if not os.path.isdir(path):
        raise FileNotFoundError(f"{what}: path={path!r} is not a local folder; {_fix(expected)}")
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as err:
        raise ValueError(f"{what}: {path!r} holds no readable transformers config.json ({str(err).splitlines()[0]}); "
                         f"{_fix(expected)}") from err
    if config.model_type not in model_types:
        raise ValueError(f"{what}: {path!r} holds a {type(config).__name__} (model_type {config.model_type!r}), not "
                         f"{expected} (model_type {' or '.join(repr(t) for t in model_types)}); {_fix(expected)}")
    try:
        model, info = cls.from_pretrained(path, local_files_only=True, use_safetensors=True, output_loading_info=True,
                                          **kwargs)
    except (OSError, ValueError) as err:
        raise ValueError(f"{what}: {path!r} has no loadable safetensors weights ({str(err).splitlines()[0]}); "
                         f"{_fix(expected)}") from err
    if info.get("missing_keys"):
        missing = sorted(info["missing_keys"])
        raise ValueError(f"{what}: {path!r} lacks {len(missing)} weights of {cls.__name__} (e.g. {missing[:3]}); they "
                         f"would stay random. {_fix(expected)}")
    return model.eval().requires_grad_(False)


# a CLIP tokenizer's vocabulary: transformers 5 builds an empty tokenizer (every word unknown) from a folder without it
TOKENIZER_FILES = (("tokenizer.json",), ("vocab.json", "merges.txt"))


def load_part(cls, path: str, what: str, part: str, option: str):
    """A tokenizer / image processor of a local folder, with an error naming the files that are missing."""
    try:
        if part == "tokenizer" and not any(all(os.path.isfile(os.path.join(path, f)) for f in files)
                                           for files in TOKENIZER_FILES):
            raise OSError("neither tokenizer.json nor vocab.json + merges.txt is there")
        return cls.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError) as err:
        raise ValueError(f"{what}: {option}={path!r} holds no {part} ({str(err).splitlines()[0]}); give a folder with "
                         f"its files (the base CLIP model's tokenizer.json or vocab.json + merges.txt, "
                         f"preprocessor_config.json)") from err


class FrameReward(Reward):
    """A reward on pictures, applied to up to ``frames`` evenly spaced frames of each video and averaged over them.

    Subclasses give ``picture_scores(pictures, texts) -> (N,)`` for N uint8 (H, W, 3) pictures and their prompts;
    the total of a sample is the mean of its frames' scores and is also its term ``term``.
    """

    term = "score"

    def __init__(self, frames: int, dtype: Literal["float32", "bfloat16"]):
        if frames < 1:
            raise ValueError(f"{self.name}: frames={frames} must be >= 1 (how many frames of a video are scored)")
        if dtype not in DTYPES:
            raise ValueError(f"{self.name}: dtype={dtype!r}; choose one of {sorted(DTYPES)}")
        self.frames, self.dtype = frames, DTYPES[dtype]

    def models(self) -> dict[str, nn.Module]:
        """The frozen models the reward holds (``estimate`` counts them)."""
        raise NotImplementedError

    def picture_scores(self, pictures: list[np.ndarray], texts: list[str], device: torch.device) -> torch.Tensor:
        raise NotImplementedError

    def on(self, device: torch.device) -> None:
        for model in self.models().values():
            if next(model.parameters()).device != device:
                model.to(device)

    def __call__(self, media, prompts, context=None) -> RewardOutput:
        prompts = prompts_for_scoring(prompts, context)
        B, _, num_frames, _, _ = media.shape
        idx = frame_indices(num_frames, self.frames).to(media.device)
        images = media[:, :, idx].permute(0, 2, 1, 3, 4).flatten(0, 1)  # (B·f, 3, H, W), frames of a sample together
        texts = [p for p in prompts for _ in range(len(idx))]
        self.on(media.device)
        with torch.no_grad():
            per_frame = self.picture_scores(to_pictures(images), texts, media.device).float().view(B, len(idx))
        total = per_frame.mean(1).to(media.device)
        return RewardOutput(total, {self.term: total})


class PickScore(FrameReward):
    """PickScore (Kirstain et al. 2023, "Pick-a-Pic"): ``logit_scale.exp() · cos(image, text)`` of a CLIP model
    finetuned on human preferences, computed as the reference (``yuvalkirstain/PickScore`` README): the
    ``CLIPProcessor`` (padding, truncation to 77 tokens), ``get_image_features``/``get_text_features``, both L2-
    normalized. About 20-23 on real images; Flow-GRPO divides it by 26 (a ``WeightedReward`` weight of 1/26 does).
    Term ``pickscore`` (the same value); ``cosine`` is the cosine itself.

    Args:
        path: a local transformers ``CLIPModel`` folder (``yuvalkirstain/PickScore_v1``).
        processor: the folder of its ``CLIPProcessor`` (tokenizer + image processor; PickScore uses
            ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K``'s); None = ``path``.
        frames: evenly spaced frames scored per video (the mean is the sample's score).
        dtype: the model's dtype (scores are float32).
    """

    term = "pickscore"

    def __init__(self, path: str, processor: Optional[str] = None, frames: int = 4,
                 dtype: Literal["float32", "bfloat16"] = "float32"):
        super().__init__(frames, dtype)
        from transformers import CLIPModel, CLIPTokenizer
        from transformers.models.clip import CLIPImageProcessorPil

        self.model = load_checked(CLIPModel, path, "PickScore", ("clip",), "a CLIP model (yuvalkirstain/PickScore_v1)",
                                  dtype=self.dtype)
        # the PIL backend: the processor PickScore's reference ran (transformers' torchvision one resizes differently)
        self.image_processor = load_part(CLIPImageProcessorPil, processor or path, "PickScore", "image processor",
                                         "processor")
        self.tokenizer = load_part(CLIPTokenizer, processor or path, "PickScore", "tokenizer", "processor")

    def models(self) -> dict[str, nn.Module]:
        return {"pickscore": self.model}

    def cosines(self, pictures: list[np.ndarray], texts: list[str], device: torch.device) -> torch.Tensor:
        pixels = self.image_processor(images=pictures, return_tensors="pt")["pixel_values"]
        tokens = self.tokenizer(texts, padding=True, truncation=True, max_length=77, return_tensors="pt")
        return cosines(self.model, pixels.to(device, self.dtype), tokens.to(device))

    def picture_scores(self, pictures, texts, device):
        return self.model.logit_scale.float().exp() * self.cosines(pictures, texts, device)

    def __call__(self, media, prompts, context=None) -> RewardOutput:
        out = super().__call__(media, prompts, context)
        out.terms["cosine"] = out.total / self.model.logit_scale.float().exp().to(out.total.device)
        return out


def resize_max_size(picture: np.ndarray, size: int) -> np.ndarray:
    """HPSv2's ``ResizeMaxSize`` (its open_clip ``transform.py``) on a uint8 (H, W, 3) picture: the longest side to
    ``size`` with PIL's bicubic (as torchvision's resize of a PIL image), the other side rounded, then zero-padded
    to ``size`` x ``size``, centred (the extra pixel right/below). The reference skips the pad when the longest side
    is already ``size``, which only a square picture survives; here any non-square picture is padded."""
    from PIL import Image

    h, w = picture.shape[:2]
    scale = size / max(h, w)
    new_h, new_w = round(h * scale), round(w * scale)
    image = Image.fromarray(picture)
    if (new_h, new_w) != (h, w):
        image = image.resize((new_w, new_h), Image.BICUBIC)
    canvas = Image.new("RGB", (size, size), (0, 0, 0))
    canvas.paste(image, ((size - new_w) // 2, (size - new_h) // 2))
    return np.asarray(canvas)


class HPSv21(FrameReward):
    """Human Preference Score v2.1 (Wu et al. 2023, "Human Preference Score v2"): ``cos(image, text)`` of the
    HPSv2.1-finetuned ViT-H-14, computed as ``hpsv2/img_score.py``: its ``preprocess_val`` (``resize_max_size``,
    then ``/255`` and OpenAI CLIP's mean/std), the tokenized prompt, normalized features, their dot product (no
    logit scale). About 0.25-0.35 on real images. Term ``hps``.

    Args:
        path: a local transformers ``CLIPModel`` folder holding HPSv2.1's weights (``hps_state_dict`` converts
            ``HPS_v2.1_compressed.pt`` into the ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K`` folder's model).
        tokenizer: the folder of its CLIP tokenizer; None = ``path``.
        frames: evenly spaced frames scored per video (the mean is the sample's score).
        dtype: the model's dtype (scores are float32).
    """

    term = "hps"

    def __init__(self, path: str, tokenizer: Optional[str] = None, frames: int = 4,
                 dtype: Literal["float32", "bfloat16"] = "float32"):
        super().__init__(frames, dtype)
        from transformers import CLIPModel, CLIPTokenizer

        self.model = load_checked(CLIPModel, path, "HPSv21", ("clip",),
                                  "a CLIP ViT-H-14 with HPSv2.1's weights (see hps_state_dict)", dtype=self.dtype)
        self.tokenizer = load_part(CLIPTokenizer, tokenizer or path, "HPSv21", "tokenizer", "tokenizer")
        self.size = self.model.config.vision_config.image_size

    def models(self) -> dict[str, nn.Module]:
        return {"hps": self.model}

    def preprocess(self, pictures: list[np.ndarray]) -> torch.Tensor:
        """(N, 3, S, S) pixel values of ``preprocess_val``."""
        x = torch.from_numpy(np.stack([resize_max_size(p, self.size) for p in pictures])).permute(0, 3, 1, 2)
        mean, std = torch.tensor(OPENAI_CLIP_MEAN).view(1, 3, 1, 1), torch.tensor(OPENAI_CLIP_STD).view(1, 3, 1, 1)
        return (x.float() / 255 - mean) / std

    def picture_scores(self, pictures, texts, device):
        tokens = self.tokenizer(texts, padding="max_length", truncation=True, max_length=77, return_tensors="pt")
        return cosines(self.model, self.preprocess(pictures).to(device, self.dtype), tokens.to(device))


def hps_state_dict(open_clip: dict[str, torch.Tensor], num_vision_layers: int, num_text_layers: int
                   ) -> dict[str, torch.Tensor]:
    """An open_clip CLIP state dict (HPSv2's checkpoint's ``state_dict``, OpenAI CLIP's layout: ``visual.*``,
    ``transformer.resblocks.*``, ``token_embedding``, ``ln_final``, ``text_projection``, ``logit_scale``) as a
    transformers ``CLIPModel`` state dict: fused ``in_proj`` split into q/k/v, ``proj`` matrices transposed.

        sd = torch.load("HPS_v2.1_compressed.pt", weights_only=True)["state_dict"]   # your own download
        model = CLIPModel.from_pretrained("<laion/CLIP-ViT-H-14-laion2B-s32B-b79K folder>")
        model.load_state_dict(hps_state_dict(sd, 32, 24)); model.save_pretrained("<HPSv2.1 folder>")
    """
    out: dict[str, torch.Tensor] = {}

    def blocks(src: str, dst: str, layers: int) -> None:
        for i in range(layers):
            s, d = f"{src}.{i}", f"{dst}.{i}"
            for name, t in zip(("q", "k", "v"), open_clip[f"{s}.attn.in_proj_weight"].chunk(3)):
                out[f"{d}.self_attn.{name}_proj.weight"] = t
            for name, t in zip(("q", "k", "v"), open_clip[f"{s}.attn.in_proj_bias"].chunk(3)):
                out[f"{d}.self_attn.{name}_proj.bias"] = t
            pairs = {"attn.out_proj": "self_attn.out_proj", "ln_1": "layer_norm1", "ln_2": "layer_norm2",
                     "mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2"}
            for a, b in pairs.items():
                for p in ("weight", "bias"):
                    out[f"{d}.{b}.{p}"] = open_clip[f"{s}.{a}.{p}"]

    v = "vision_model"
    out[f"{v}.embeddings.patch_embedding.weight"] = open_clip["visual.conv1.weight"]
    out[f"{v}.embeddings.class_embedding"] = open_clip["visual.class_embedding"]
    out[f"{v}.embeddings.position_embedding.weight"] = open_clip["visual.positional_embedding"]
    for a, b in (("visual.ln_pre", f"{v}.pre_layrnorm"), ("visual.ln_post", f"{v}.post_layernorm"),
                 ("ln_final", "text_model.final_layer_norm")):
        for p in ("weight", "bias"):
            out[f"{b}.{p}"] = open_clip[f"{a}.{p}"]
    blocks("visual.transformer.resblocks", f"{v}.encoder.layers", num_vision_layers)
    blocks("transformer.resblocks", "text_model.encoder.layers", num_text_layers)
    out["visual_projection.weight"] = open_clip["visual.proj"].t().contiguous()
    out["text_projection.weight"] = open_clip["text_projection"].t().contiguous()
    out["text_model.embeddings.token_embedding.weight"] = open_clip["token_embedding.weight"]
    out["text_model.embeddings.position_embedding.weight"] = open_clip["positional_embedding"]
    out["logit_scale"] = open_clip["logit_scale"].reshape(())
    return out


class AestheticHead(nn.Module):
    """The LAION aesthetic predictor's MLP (``improved-aesthetic-predictor/simple_inference.py``), as the
    reference defines it: five linear layers with dropout between and **no** activation (its ReLUs are commented
    out), so its state-dict keys are ``layers.{0,2,4,6,7}.{weight,bias}``."""

    def __init__(self, input_size: int = 768):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(input_size, 1024), nn.Dropout(0.2), nn.Linear(1024, 128),
                                    nn.Dropout(0.2), nn.Linear(128, 64), nn.Dropout(0.1), nn.Linear(64, 16),
                                    nn.Linear(16, 1))

    def forward(self, embedding: torch.Tensor) -> torch.Tensor:
        return self.layers(embedding)


class LaionAesthetic(FrameReward):
    """The LAION aesthetic predictor v2 (``sac+logos+ava1-l14-linearMSE``): its MLP head on the L2-normalized CLIP
    ViT-L/14 image embedding, a predicted rating of about 1-10 (most real images 4-7), computed as
    ``simple_inference.py`` (``normalized(encode_image(x))`` then the MLP); the CLIP model and its preprocessing are
    transformers' (``CLIPImageProcessor``, PIL backend), as Flow-GRPO's and DDPO's aesthetic scorers read it. The
    prompt is not read. Term ``aesthetic``.

    Args:
        path: a local transformers ``CLIPModel`` folder (``openai/clip-vit-large-patch14``) with its
            ``preprocessor_config.json``.
        head: the head's safetensors (keys ``layers.{0,2,4,6,7}.{weight,bias}``; the reference ships a ``.pth``:
            ``safetensors.torch.save_file(torch.load(pth, weights_only=True), head)`` converts it once);
            None = ``<path>/aesthetic_head.safetensors``.
        frames: evenly spaced frames scored per video (the mean is the sample's score).
        dtype: the CLIP model's dtype (the head and the scores are float32).
    """

    term = "aesthetic"

    def __init__(self, path: str, head: Optional[str] = None, frames: int = 4,
                 dtype: Literal["float32", "bfloat16"] = "float32"):
        super().__init__(frames, dtype)
        from safetensors import SafetensorError
        from safetensors.torch import load_file
        from transformers import CLIPModel
        from transformers.models.clip import CLIPImageProcessorPil

        self.model = load_checked(CLIPModel, path, "LaionAesthetic", ("clip",),
                                  "a CLIP ViT-L/14 model (openai/clip-vit-large-patch14)", dtype=self.dtype)
        self.image_processor = load_part(CLIPImageProcessorPil, path, "LaionAesthetic", "image processor", "path")
        head = head or os.path.join(path, AESTHETIC_HEAD)
        if not os.path.isfile(head):
            raise FileNotFoundError(f"LaionAesthetic: no head weights at {head!r}; convert the predictor's .pth once "
                                    f"(safetensors.torch.save_file(torch.load(pth, weights_only=True), {head!r})) or "
                                    f"give `head:` its safetensors file")
        self.head = AestheticHead(self.model.config.projection_dim)
        try:
            self.head.load_state_dict(load_file(head))
        except (RuntimeError, SafetensorError) as err:
            raise ValueError(f"LaionAesthetic: {head!r} is not the aesthetic MLP for {self.model.config.projection_dim}-d "
                             f"embeddings ({str(err).splitlines()[0]}); give sac+logos+ava1-l14-linearMSE's weights "
                             f"with CLIP ViT-L/14") from err
        self.head.eval().requires_grad_(False)

    def models(self) -> dict[str, nn.Module]:
        return {"aesthetic_clip": self.model, "aesthetic_head": self.head}

    def picture_scores(self, pictures, texts, device):
        pixels = self.image_processor(images=pictures, return_tensors="pt")["pixel_values"]
        embedding = features(self.model.get_image_features(pixel_values=pixels.to(device, self.dtype))).float()
        return self.head(embedding / embedding.norm(dim=-1, keepdim=True)).squeeze(-1)
