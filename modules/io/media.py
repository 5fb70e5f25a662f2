"""Writing generated media: mp4 through imageio-ffmpeg, GIF and PNG through Pillow (no moviepy)."""
from __future__ import annotations

import io
import os
import re

import numpy as np
import torch
from PIL import Image, ImageDraw


def to_frames(video: torch.Tensor) -> np.ndarray:
    """(C, F, H, W) in [-1, 1] -> (F, H, W, C) uint8."""
    if video.ndim != 4 or video.shape[0] != 3:
        raise ValueError(f"expected a (3, F, H, W) video, got shape {tuple(video.shape)}")
    frames = ((video.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return frames.permute(1, 2, 3, 0).cpu().numpy()


def slug(text: str, max_len: int = 48) -> str:
    return re.sub(r"[^a-zA-Z0-9]+", "_", text).strip("_")[:max_len] or "empty"


def gif_bytes(video: torch.Tensor, fps: int = 8) -> io.BytesIO:
    frames = [Image.fromarray(f) for f in to_frames(video)]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:], duration=int(1000 / fps), loop=0)
    buf.seek(0)
    return buf


def write_media(path: str, video: torch.Tensor, fps: int = 8) -> str:
    """Write a (3, F, H, W) video as .mp4/.gif, or its first frame as .png; returns the path."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    ext = os.path.splitext(path)[1].lower()
    if ext == ".png":
        Image.fromarray(to_frames(video)[0]).save(path)
    elif ext == ".gif":
        with open(path, "wb") as f:
            f.write(gif_bytes(video, fps).getvalue())
    elif ext == ".mp4":
        import imageio.v2 as imageio

        frames = to_frames(video)
        # H.264 wants even sizes and macro blocks of 16; tiny videos are upscaled by pixel repetition
        scale = max(1, 16 // min(frames.shape[1:3]))
        frames = frames.repeat(scale, axis=1).repeat(scale, axis=2)
        imageio.mimwrite(path, list(frames), fps=fps, codec="libx264", macro_block_size=16)
    else:
        raise ValueError(f"unsupported media extension {ext!r} for {path}; use .mp4, .gif or .png")
    return path


def grid(rows: list[tuple[str, torch.Tensor]], scale: int) -> Image.Image:
    """A sheet of videos to look at: one row per (label, (3, F, H, W) video), the label above the F frames side
    by side (rows of fewer frames end early), each frame enlarged ``scale`` times (nearest neighbour)."""
    frames = [to_frames(video) for _, video in rows]  # (F, H, W, 3) uint8 each
    f, h, w = max(video.shape[0] for video in frames), *frames[0].shape[1:3]
    label_h, pad = 14, 4
    canvas = Image.new("RGB", (f * (w * scale + pad) + pad, len(rows) * (h * scale + label_h + pad) + pad), "white")
    draw = ImageDraw.Draw(canvas)
    for r, ((label, _), video) in enumerate(zip(rows, frames)):
        top = pad + r * (h * scale + label_h + pad)
        draw.text((pad, top), label, fill="black")
        for i, frame in enumerate(video):
            image = Image.fromarray(frame).resize((w * scale, h * scale), Image.NEAREST)
            canvas.paste(image, (pad + i * (w * scale + pad), top + label_h))
    return canvas
