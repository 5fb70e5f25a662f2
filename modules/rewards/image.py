"""Rewards on images that need no synthetic world: JPEG compressibility (FlowGRPO's), and CLIPScore on a local CLIP
folder."""
from __future__ import annotations

import io
import os

import torch

from posttrain.modules.rewards.base import Reward, RewardOutput, prompts_for_scoring


class JpegCompressibility(Reward):
    """JPEG size of the frames (Flow-GRPO's compressibility reward): ``-kB`` per frame, or ``+kB``
    with ``incompressible``. Frames are encoded with Pillow at ``quality``; the size is averaged over
    frames. Term: ``kb``."""

    def __init__(self, quality: int = 95, incompressible: bool = False):
        if not 1 <= quality <= 100:
            raise ValueError(f"JpegCompressibility: quality={quality} must be in [1, 100]")
        self.quality, self.incompressible = quality, incompressible

    @property
    def name(self) -> str:
        return "JpegIncompressibility" if self.incompressible else "JpegCompressibility"

    def __call__(self, media, prompts, context=None) -> RewardOutput:
        from PIL import Image

        frames = ((media.detach().float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
        frames = frames.permute(0, 2, 3, 4, 1).cpu().numpy()  # (B, F, H, W, 3)
        kb = torch.zeros(media.shape[0])
        for b in range(frames.shape[0]):
            sizes = []
            for frame in frames[b]:
                buf = io.BytesIO()
                Image.fromarray(frame).save(buf, format="JPEG", quality=self.quality)
                sizes.append(buf.tell() / 1000)
            kb[b] = sum(sizes) / len(sizes)
        kb = kb.to(media.device)
        return RewardOutput(kb if self.incompressible else -kb, {"kb": kb})


class CLIPScore(Reward):
    """Cosine similarity of CLIP image and text embeddings, averaged over frames, from a **local**
    ``transformers`` CLIP folder (``CLIPModel`` + ``CLIPProcessor``; nothing is downloaded), computed as
    torchmetrics' ``CLIPScore`` computes it per sample (``modules/rewards/clip.py``; the ``Evaluate`` callback's
    ``clip_score`` metric reads the same folder the same way). The model loads on first use. Scores the
    original prompt under joint RL.

    Args:
        path: a local folder holding a CLIP model and its processor.
        frames: how many evenly spaced frames to score per video.
    """

    def __init__(self, path: str, frames: int = 4):
        if not os.path.isdir(path):
            raise FileNotFoundError(f"CLIPScore: path={path!r} is not a local folder; give the folder of a "
                                    f"transformers CLIP model (CLIPModel.save_pretrained), nothing is downloaded")
        self.path, self.frames = path, frames
        self._clip = None

    def __call__(self, media, prompts, context=None) -> RewardOutput:
        from posttrain.modules.rewards.clip import clip_cosines, load_clip

        if self._clip is None:
            self._clip = load_clip(self.path)
        prompts = prompts_for_scoring(prompts, context)
        B, _, n_frames, _, _ = media.shape
        idx = torch.linspace(0, n_frames - 1, min(self.frames, n_frames)).round().long().to(media.device)
        images = media[:, :, idx].permute(0, 2, 1, 3, 4).flatten(0, 1)  # (B·f, 3, H, W)
        texts = [p for p in prompts for _ in range(len(idx))]
        total = clip_cosines(*self._clip, images, texts).view(B, len(idx)).mean(1).to(media.device)
        return RewardOutput(total, {"cosine": total})

    def models(self) -> dict[str, torch.nn.Module]:
        """The CLIP model; before its first use (it loads then), built from its folder's config on the meta device."""
        if self._clip is not None:
            return {"clip": self._clip[0].model}
        from transformers import CLIPConfig, CLIPModel

        with torch.device("meta"):
            return {"clip": CLIPModel(CLIPConfig.from_pretrained(self.path, local_files_only=True))}


# ---------------------------------------------------------------------------------------- text rewards
