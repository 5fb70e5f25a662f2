"""Block-causal Wan transformer: diffusers' ``WanTransformer3DModel`` with chunked causal self-attention,
per-frame noise levels and a KV cache of finished chunks (the Self-Forcing / CausVid student).

Latent frames come in chunks of ``num_frames_per_chunk`` (anchor 3; Self-Forcing
``wan/modules/causal_model.py``, ``num_frame_per_block``). A token of chunk ``c`` attends to every token of
chunks ``<= c`` and to nothing later, in every transformer block, so no output of an earlier chunk depends
on a later chunk's input. Generation runs chunk by chunk (Self-Forcing
``pipeline/self_forcing_training.py``): each chunk is denoised in a few steps while attending to the
keys/values of the finished chunks held in a :class:`WanKVCache`; then the finished chunk is run once more
at its context noise level (σ = 0) with ``update_cache=True`` to store its keys/values. Generating chunk
``k`` thus costs one chunk's forward plus attention over the cache, instead of a forward over all ``k``
chunks.

Built on diffusers, not beside it (diffusers 0.42, ``models/transformers/transformer_wan.py``):

- ``CausalWanTransformer3DModel`` subclasses ``WanTransformer3DModel`` and reuses its ``forward`` whole.
  It adds no parameters and no config keys: the state dict is the base class's, ``from_pretrained`` loads a
  ``WanTransformer3DModel`` folder, and ``save_pretrained`` writes one (``_class_name`` of the base class),
  so the bidirectional teacher's weights start the student and an exported student serves in ``WanPipeline``.
- Per-frame noise levels use the base forward's per-token timestep path (``timestep`` of shape
  ``(B, seq_len)``, added for Wan 2.2 TI2V): a ``(B, F)`` timestep is repeated over each frame's tokens.
- Block causality and the cache live in the self-attention processor (:class:`CausalWanAttnProcessor`, a
  ``WanAttnProcessor`` subclass on every block's ``attn1``). The block calls ``attn1`` with no attention mask,
  so the per-call state (mask, cache, frame offset) travels inside the rotary embedding the base forward
  hands to every block: :class:`ChunkedWanRotaryPosEmbed` (a ``WanRotaryPosEmbed`` subclass, no weights)
  returns the ``(cos, sin)`` pair of the chunk's *absolute* frame positions as a tuple that also carries
  that state. Being an argument of the block call, it survives gradient checkpointing's recomputation.

Version-fragile (checked by ``tests/test_causal_wan.py``): the base forward passes ``self.rope(...)``'s
output unchanged to ``block(...)`` and on to ``attn1``'s processor; ``WanAttnProcessor`` applies RoPE as
re-stated in :func:`apply_wan_rotary` (the cached path projects q/k/v itself); a ``(B, seq_len)`` timestep
gives per-token modulation.

Sequence parallelism (Ulysses, ``modules/models/sequence_parallel.py``): the model's own ``_cp_plan`` splits the tokens at
the first block and gathers them after ``proj_out`` as Wan's does, but leaves the rotary embedding whole (it carries
the chunk state). Each process's self-attention exchanges its tokens' queries, keys and values for whole heads over
the whole sequence (:func:`sequence_to_heads`, an all-to-all), rotates them there, and keeps its KV cache in that
layout — ``(B, stored tokens, heads / k, head_dim)``: every cache operation (store, truncate, the rolling eviction) is
by frames over the whole sequence as without parallelism, and each process holds 1/k of the cache. The block-causal
mask is the one-process mask. A per-frame ``(B, F)`` timestep is cut to the process's tokens.

At full scale (Wan 1.3B, 21 latent frames x 1560 tokens): the full-video block-causal mask is a dense
(L, L) bool tensor (about 1 GB; Self-Forcing uses a flex-attention ``BlockMask`` there), and a (B, F)
timestep makes (B, L, 6, dim) modulation tensors; the chunk-by-chunk path with a (B,) timestep needs neither.
"""
from __future__ import annotations

import inspect
import json
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from diffusers import WanTransformer3DModel
from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers.transformer_wan import (
    WanAttention,
    WanAttnProcessor,
    WanRotaryPosEmbed,
    _get_qkv_projections,
)


@dataclass
class WanKVCache:
    """Self-attention keys and values of the finished chunks, one entry per transformer block.

    ``keys[i]``/``values[i]``: (B, stored_frames · tokens_per_frame, heads, head_dim), after the q/k RMSNorm and
    RoPE (diffusers' processor layout). ``num_frames`` latent frames are finished (the next input starts at that
    absolute frame, its RoPE position). The cache holds constants: entries are stored detached, as Self-Forcing
    fills its cache under ``torch.no_grad`` (gradient reaches a chunk only through its own exit step, never through
    a later chunk's attention).

    Rolling (Self-Forcing++, Cui et al. 2025; Self-Forcing's ``local_attn_size``/``sink_size`` in
    ``wan/modules/causal_model.py``): with ``window_frames`` set, once a forward has stored its frames only the
    first ``sink_frames`` and the last ``window_frames`` finished frames stay, older ones are evicted, so the
    stored frames never exceed ``sink_frames + window_frames`` between calls whatever the video's length. Keys keep
    the RoPE angles of their absolute frames; RoPE scores depend on the query–key distance only, so a window no
    longer than the training clip keeps every distance the student was trained on (a sink does not). None: keep
    every frame.
    """

    num_layers: int
    keys: list[Optional[torch.Tensor]] = field(default_factory=list)
    values: list[Optional[torch.Tensor]] = field(default_factory=list)
    num_frames: int = 0
    tokens_per_frame: Optional[int] = None
    window_frames: Optional[int] = None
    sink_frames: int = 0
    evicted_frames: int = 0  # frames dropped from between the sink and the window

    def __post_init__(self):
        if self.window_frames is not None and self.window_frames < 1:
            raise ValueError(f"window_frames={self.window_frames} must be >= 1 finished frame (or None: keep all)")
        if self.sink_frames < 0 or (self.sink_frames and self.window_frames is None):
            raise ValueError(f"sink_frames={self.sink_frames} must be >= 0 and needs window_frames (a sink is what "
                             f"a rolling cache keeps besides its window)")
        if not self.keys:
            self.reset()

    @property
    def stored_frames(self) -> int:
        return self.num_frames - self.evicted_frames

    def stored_positions(self) -> torch.Tensor:
        """(stored_frames,) absolute latent frame of each stored frame, in storage order."""
        if not self.evicted_frames:
            return torch.arange(self.num_frames)
        return torch.cat([torch.arange(self.sink_frames), torch.arange(self.sink_frames + self.evicted_frames,
                                                                       self.num_frames)])

    def reset(self) -> None:
        self.keys = [None] * self.num_layers
        self.values = [None] * self.num_layers
        self.num_frames = 0
        self.tokens_per_frame = None
        self.evicted_frames = 0

    def truncate(self, num_frames: int) -> None:
        """Keep the first ``num_frames`` frames (e.g. to regenerate the chunks after them)."""
        kept_from = self.sink_frames + self.evicted_frames if self.evicted_frames else 0
        if not kept_from <= num_frames <= self.num_frames:
            raise ValueError(f"cannot truncate a cache of {self.num_frames} frames to {num_frames}"
                             + (f" (frames {self.sink_frames}..{self.sink_frames + self.evicted_frames - 1} were "
                                f"evicted)" if self.evicted_frames else ""))
        end = (num_frames - self.evicted_frames) * (self.tokens_per_frame or 0)
        self.keys = [None if k is None or end == 0 else k[:, :end] for k in self.keys]
        self.values = [None if v is None or end == 0 else v[:, :end] for v in self.values]
        self.num_frames = num_frames

    def store(self, layer: int, start: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Write ``key``/``value`` (B, L, heads, head_dim) at stored token ``start``, dropping anything after it.

        Idempotent: writing the same chunk twice (gradient checkpointing's recomputation) leaves the same cache.
        """
        old_k, old_v = self.keys[layer], self.values[layer]
        if start == 0 or old_k is None:
            self.keys[layer], self.values[layer] = key.detach(), value.detach()
        else:
            self.keys[layer] = torch.cat([old_k[:, :start], key.detach()], dim=1)
            self.values[layer] = torch.cat([old_v[:, :start], value.detach()], dim=1)

    def evict(self) -> None:
        """Drop the finished frames between the sink and the window (after a forward stored its frames)."""
        if self.window_frames is None:
            return
        drop = self.stored_frames - self.sink_frames - self.window_frames
        if drop <= 0:
            return
        sink, cut = self.sink_frames * self.tokens_per_frame, (self.sink_frames + drop) * self.tokens_per_frame
        self.keys = [None if k is None else torch.cat([k[:, :sink], k[:, cut:]], dim=1) for k in self.keys]
        self.values = [None if v is None else torch.cat([v[:, :sink], v[:, cut:]], dim=1) for v in self.values]
        self.evicted_frames += drop


@dataclass
class _Chunking:
    """Per-call state of one causal forward, read by every block's ``attn1`` processor."""

    frame_offset: int  # absolute latent frame of the input's first frame (= frames already finished)
    attn_mask: Optional[torch.Tensor]  # (1, 1, L_q, L_k) bool, True = attend; None = every key visible
    kv_cache: Optional[WanKVCache]
    cache_tokens: int  # cached tokens the input attends to (stored_frames · tokens_per_frame)
    update_cache: bool


class _ChunkRotary(tuple):
    """The ``(freqs_cos, freqs_sin)`` pair diffusers passes to each block, carrying the call's chunking state.

    Still a 2-tuple, so ``WanAttnProcessor``'s ``apply_rotary_emb(query, *rotary_emb)`` reads it unchanged.
    """

    chunking: _Chunking

    def __new__(cls, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor, chunking: _Chunking):
        pair = super().__new__(cls, (freqs_cos, freqs_sin))
        pair.chunking = chunking
        return pair


class ChunkedWanRotaryPosEmbed(WanRotaryPosEmbed):
    """diffusers' Wan 3D RoPE evaluated at the input's absolute frame positions.

    A chunk generated after ``frame_offset`` cached frames takes the temporal rotary angles of frames
    ``frame_offset .. frame_offset + F - 1`` (Self-Forcing's ``causal_rope_apply`` with ``start_frame``), so
    chunk-by-chunk generation sees the same positions as one forward over the whole video. Buffers only
    (``persistent=False`` in the base class): the state dict is unchanged.
    """

    pending: Optional[_Chunking] = None  # set by CausalWanTransformer3DModel.forward around one call

    def forward(self, hidden_states: torch.Tensor):
        chunking = self.pending
        if chunking is None:
            return super().forward(hidden_states)
        _, _, num_frames, height, width = hidden_states.shape
        total = chunking.frame_offset + num_frames
        if total // self.patch_size[0] > self.max_seq_len:
            raise ValueError(
                f"frames up to {total} exceed the rotary table (rope_max_seq_len={self.max_seq_len}); build the "
                f"model with a larger rope_max_seq_len or generate fewer frames"
            )
        # The base RoPE reads only the shape: evaluate it over frames [0, total) without allocating, keep the
        # tokens of the input's frames (tokens are frame-major after the patch embedding's flatten).
        whole = hidden_states[:1, :1, :1].expand(1, 1, total, height, width)
        freqs_cos, freqs_sin = super().forward(whole)  # (1, total · tokens_per_frame, 1, head_dim)
        start = freqs_cos.shape[1] - (num_frames // self.patch_size[0]) * (height // self.patch_size[1]) * (
            width // self.patch_size[2])
        return _ChunkRotary(freqs_cos[:, start:], freqs_sin[:, start:], chunking)


def apply_wan_rotary(hidden_states: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    """RoPE on interleaved pairs, as ``WanAttnProcessor.__call__`` applies it (diffusers 0.42
    ``transformer_wan.py``, a local function there). hidden_states (B, L, heads, head_dim); freqs (1, L, 1, head_dim)."""
    x1, x2 = hidden_states.unflatten(-1, (-1, 2)).unbind(-1)
    cos = freqs_cos[..., 0::2]
    sin = freqs_sin[..., 1::2]
    out = torch.empty_like(hidden_states)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(hidden_states)


def sequence_group(parallel_config) -> Optional[Any]:
    """The process group of a diffusers ``ParallelConfig``'s Ulysses dimension, or None without one."""
    cp = getattr(parallel_config, "context_parallel_config", None)
    return None if cp is None else cp.mesh["ulysses"].get_group()


def _exchange(send: torch.Tensor, group) -> torch.Tensor:
    """All-to-all over ``group`` along dim 0 (piece j goes to rank j), with its gradient (the inverse exchange)."""
    import torch.distributed._functional_collectives as funcol

    return funcol.wait_tensor(funcol.all_to_all_single_autograd(send, None, None, group))


def sequence_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """Ulysses' first all-to-all: (B, L / k, heads, d) of this process's tokens -> (B, L, heads / k, d) of every
    token for this process's heads (the k processes' token shards in rank order)."""
    k = torch.distributed.get_world_size(group)
    b, tokens, heads, d = x.shape
    send = x.reshape(b, tokens, k, heads // k, d).permute(2, 0, 1, 3, 4).contiguous()  # piece j: rank j's heads
    received = _exchange(send, group)  # piece i: rank i's tokens
    return received.permute(1, 0, 2, 3, 4).reshape(b, k * tokens, heads // k, d)


def heads_to_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """The inverse all-to-all: (B, L, heads / k, d) -> (B, L / k, heads, d) of this process's tokens."""
    k = torch.distributed.get_world_size(group)
    b, tokens, heads, d = x.shape
    send = x.reshape(b, k, tokens // k, heads, d).permute(1, 0, 2, 3, 4).contiguous()  # piece j: rank j's tokens
    received = _exchange(send, group)  # piece i: rank i's heads
    return received.permute(1, 2, 0, 3, 4).reshape(b, tokens // k, k * heads, d)


class CausalWanAttnProcessor(WanAttnProcessor):
    """Self-attention of block ``layer`` with a block-causal mask and, when given, a KV cache.

    Without chunking state (a plain call) or for cross-attention it is ``WanAttnProcessor`` unchanged. Without a
    cache the block-causal mask goes to the stock processor. With a cache, the input's queries attend to the
    cached keys/values of earlier chunks followed by the input's own (block-causal among the input's chunks).
    Under sequence parallelism (``_parallel_config`` set) the exchange for whole heads comes first (module
    docstring), with or without a cache.
    """

    def __init__(self, layer: int):
        super().__init__()
        self.layer = layer

    def __call__(self, attn: WanAttention, hidden_states: torch.Tensor,
                 encoder_hidden_states: Optional[torch.Tensor] = None, attention_mask: Optional[torch.Tensor] = None,
                 rotary_emb: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> torch.Tensor:
        chunking = getattr(rotary_emb, "chunking", None)
        if chunking is None or encoder_hidden_states is not None:
            return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)
        group = sequence_group(self._parallel_config)
        if chunking.kv_cache is None and group is None:
            return super().__call__(attn, hidden_states, None, chunking.attn_mask, rotary_emb)

        # (B, L, heads, head_dim) queries/keys/values of the input tokens, normalized and rotated exactly as
        # the stock processor does (under sequence parallelism: of every token, for this process's heads).
        query, key, value = _get_qkv_projections(attn, hidden_states, None)
        query, key = attn.norm_q(query), attn.norm_k(key)
        query, key, value = (t.unflatten(2, (attn.heads, -1)) for t in (query, key, value))
        if group is not None:
            query, key, value = (sequence_to_heads(t, group) for t in (query, key, value))
        query = apply_wan_rotary(query, *rotary_emb)
        key = apply_wan_rotary(key, *rotary_emb)

        cache, start = chunking.kv_cache, chunking.cache_tokens
        if cache is not None and chunking.update_cache:
            cache.store(self.layer, start, key, value)
        if start:
            # Only the first ``start`` cached tokens: a later write (the next chunk's context pass) must not
            # change what a checkpointed recomputation of this call reads.
            key = torch.cat([cache.keys[self.layer][:, :start], key], dim=1)
            value = torch.cat([cache.values[self.layer][:, :start], value], dim=1)

        hidden_states = dispatch_attention_fn(query, key, value, attn_mask=chunking.attn_mask, dropout_p=0.0,
                                              is_causal=False, backend=self._attention_backend, parallel_config=None)
        if group is not None:
            hidden_states = heads_to_sequence(hidden_states, group)
        hidden_states = hidden_states.flatten(2, 3).type_as(query)
        hidden_states = attn.to_out[0](hidden_states)
        return attn.to_out[1](hidden_states)


def block_causal_mask(num_frames: int, frame_offset: int, num_frames_per_chunk: int, tokens_per_frame: int,
                      device: torch.device, key_frames: Optional[torch.Tensor] = None,
                      window_frames: Optional[int] = None, sink_frames: int = 0) -> Optional[torch.Tensor]:
    """(1, 1, L_q, L_k) bool mask, True = attend, or None when every key is visible.

    Queries are the input's frames ``[frame_offset, frame_offset + num_frames)``, keys the frames ``key_frames``
    (absolute positions of the cached keys; default all of ``[0, frame_offset)``) followed by the input's; query
    frame ``f`` sees key frame ``g`` iff ``g // n <= f // n`` (n = frames per chunk), as SkyReels-V2's
    diffusion-forcing mask and Self-Forcing's block mask. With ``window_frames`` it also needs ``g`` among the
    ``window_frames`` frames before ``f``'s chunk, or in it, or among the first ``sink_frames`` (Self-Forcing's
    ``local_attn_size`` mask, the rolling cache's view). Tokens are frame-major, each frame ``tokens_per_frame`` long.
    """
    # frames, not tokens, in Python: a few hundred entries, and no data-dependent branch on a tensor (the mask is
    # also built under `posttrain estimate`'s fake tensors)
    n = num_frames_per_chunk
    queries = range(frame_offset, frame_offset + num_frames)
    keys = [*(range(frame_offset) if key_frames is None else key_frames.tolist()), *queries]

    def visible(query: int, key: int) -> bool:
        in_window = window_frames is None or key >= (query // n) * n - window_frames or key < sink_frames
        return key // n <= query // n and in_window

    frames = [[visible(q, k) for k in keys] for q in queries]  # (F_q, F_k)
    if all(all(row) for row in frames):
        return None
    mask = torch.tensor(frames, device=device).repeat_interleave(tokens_per_frame, 0)
    return mask.repeat_interleave(tokens_per_frame, 1)[None, None]


class CausalWanTransformer3DModel(WanTransformer3DModel):
    """``WanTransformer3DModel`` with block-causal self-attention over chunks of latent frames and a KV cache.

    Same constructor, config and state dict as the base class (``from_pretrained`` / ``from_config`` / a
    base ``state_dict`` load as they are). ``num_frames_per_chunk`` is an attribute, not a config key, so an
    exported folder is a plain ``WanTransformer3DModel`` folder; set it after loading or pass it to ``forward``.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.num_frames_per_chunk = 3  # Self-Forcing's anchor (num_frame_per_block)
        # Same rotary table as the base (buffers only, not in the state dict), chunk-aware forward.
        self.rope = ChunkedWanRotaryPosEmbed(self.config.attention_head_dim, self.config.patch_size,
                                             self.config.rope_max_seq_len)
        for i, block in enumerate(self.blocks):
            block.attn1.set_processor(CausalWanAttnProcessor(i))

    # Wan's plan without the rotary split: the rope output carries the chunk state and is applied after the exchange
    _cp_plan = {
        "blocks.0": {"hidden_states": ContextParallelInput(split_dim=1, expected_dims=3, split_output=False)},
        "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
    }

    # diffusers builds the model from ``inspect.signature(cls.__init__)`` (ConfigMixin.extract_init_dict): keep
    # the base class's signature so that from_config / from_pretrained pass every config key.
    __init__.__signature__ = inspect.signature(WanTransformer3DModel.__init__)

    @classmethod
    def from_bidirectional(cls, model: WanTransformer3DModel, num_frames_per_chunk: int = 3
                           ) -> "CausalWanTransformer3DModel":
        """A causal copy of ``model``'s weights (the teacher's weights start the Self-Forcing student)."""
        causal = cls.from_config(model.config)
        causal.load_state_dict(model.state_dict(), strict=True)
        causal.num_frames_per_chunk = num_frames_per_chunk
        causal.train(model.training)
        param = next(model.parameters())
        causal.to(param.device)
        return causal if param.dtype == torch.float32 else causal.to(param.dtype)

    def to_json_string(self) -> str:
        # Export as the base class: causality is in processors, not weights or config, and the folder must load
        # with WanTransformer3DModel.from_pretrained (and so in WanPipeline) without this package.
        config = json.loads(super().to_json_string())
        config["_class_name"] = WanTransformer3DModel.__name__
        return json.dumps(config, indent=2, sort_keys=True) + "\n"  # ConfigMixin.to_json_string's format

    def forward(
        self,
        hidden_states: torch.Tensor,
        timestep: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        encoder_hidden_states_image: Optional[torch.Tensor] = None,
        return_dict: bool = True,
        attention_kwargs: Optional[dict[str, Any]] = None,
        kv_cache: Optional[WanKVCache] = None,
        update_cache: bool = False,
        num_frames_per_chunk: Optional[int] = None,
        window_frames: Optional[int] = None,
        sink_frames: int = 0,
    ):
        """Velocity of the input frames, block-causally.

        Args:
            hidden_states: (B, C, F, H, W) latents. Without ``kv_cache`` they are frames ``[0, F)`` of a video;
                with it, frames ``[kv_cache.num_frames, kv_cache.num_frames + F)``. F is a multiple of the chunk.
            timestep: (B,) one level per sample, or (B, F) one per latent frame (e.g. each chunk its own σ·1000,
                or 0 on clean context frames). (B,) is cheaper: (B, F) takes the base forward's per-token path,
                whose modulation tensors are (B, F·H·W/4, 6, dim).
            encoder_hidden_states: (B, text_len, text_dim).
            kv_cache: keys/values of the finished frames; the input attends to all of them.
            update_cache: store the input's keys/values as the next finished frames (Self-Forcing's context pass
                on the denoised chunk, at σ = 0); needs ``kv_cache``.
            num_frames_per_chunk: overrides ``self.num_frames_per_chunk`` for this call.
            window_frames, sink_frames: without a cache, the rolling cache's view in one forward (a frame sees the
                ``window_frames`` frames before its chunk, its chunk and the first ``sink_frames``); a cache brings
                its own (``WanKVCache.window_frames``).
        """
        chunk = num_frames_per_chunk or self.num_frames_per_chunk
        batch_size, _, num_frames, height, width = hidden_states.shape
        p_t, p_h, p_w = self.config.patch_size
        if p_t != 1:
            raise ValueError(f"block-causal chunks need a temporal patch size of 1, got patch_size={self.config.patch_size}")
        if chunk < 1 or num_frames % chunk:
            raise ValueError(f"{num_frames} latent frames do not split into chunks of num_frames_per_chunk={chunk}")
        if update_cache and kv_cache is None:
            raise ValueError("update_cache=True needs a kv_cache to write to")
        wrong = [i for i, b in enumerate(self.blocks) if not isinstance(b.attn1.processor, CausalWanAttnProcessor)]
        if wrong:
            raise RuntimeError(f"blocks {wrong} lost their CausalWanAttnProcessor (set_attn_processor?): attention "
                               f"would silently see the future")

        if kv_cache is not None and (window_frames is not None or sink_frames):
            raise ValueError(f"window_frames={window_frames}, sink_frames={sink_frames} shape a forward without a "
                             f"cache; a cache rolls by its own (WanKVCache(window_frames=..., sink_frames=...))")
        tokens_per_frame = (height // p_h) * (width // p_w)
        frame_offset, key_frames = 0, None
        if kv_cache is not None:
            frame_offset = kv_cache.num_frames
            if frame_offset % chunk:
                raise ValueError(f"the cache holds {frame_offset} frames, not whole chunks of {chunk}")
            if kv_cache.tokens_per_frame not in (None, tokens_per_frame):
                raise ValueError(f"the cache holds {kv_cache.tokens_per_frame} tokens per frame, the input has "
                                 f"{tokens_per_frame}")
            if len(kv_cache.keys) != len(self.blocks):
                raise ValueError(f"the cache has {len(kv_cache.keys)} layers, the model {len(self.blocks)}")
            key_frames, window_frames, sink_frames = \
                kv_cache.stored_positions(), kv_cache.window_frames, kv_cache.sink_frames

        if timestep.ndim == 2:
            if tuple(timestep.shape) != (batch_size, num_frames):
                raise ValueError(f"timestep of shape {tuple(timestep.shape)}: give (B,) or (B, F) = "
                                 f"{(batch_size, num_frames)}, one per latent frame")
            timestep = timestep.repeat_interleave(tokens_per_frame, dim=1)  # (B, F·tokens_per_frame)
            group = sequence_group(self._parallel_config)
            if group is not None:  # the modulation of this process's tokens (Wan's plan splits it so)
                timestep = timestep.chunk(torch.distributed.get_world_size(group), dim=1)[
                    torch.distributed.get_rank(group)]

        chunking = _Chunking(
            frame_offset=frame_offset,
            attn_mask=block_causal_mask(num_frames, frame_offset, chunk, tokens_per_frame, hidden_states.device,
                                        key_frames, window_frames, sink_frames),
            kv_cache=kv_cache,
            cache_tokens=0 if kv_cache is None else kv_cache.stored_frames * tokens_per_frame,
            update_cache=update_cache,
        )
        self.rope.pending = chunking
        try:
            out = super().forward(hidden_states, timestep, encoder_hidden_states, encoder_hidden_states_image,
                                  return_dict=return_dict, attention_kwargs=attention_kwargs)
        finally:
            self.rope.pending = None
        if update_cache:
            kv_cache.num_frames = frame_offset + num_frames
            kv_cache.tokens_per_frame = tokens_per_frame
            kv_cache.evict()
        return out

    def new_cache(self, window_frames: Optional[int] = None, sink_frames: int = 0) -> WanKVCache:
        """An empty cache for one generation (one per batch of samples); ``window_frames``: a rolling one."""
        return WanKVCache(num_layers=len(self.blocks), window_frames=window_frames, sink_frames=sink_frames)
