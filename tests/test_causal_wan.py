"""Block-causal Wan transformer (modules/models/causal_wan.py) on the tiny ``wan_t2v`` preset, CPU.

Latents (B, C, F, H, W) = (2, 16, 6, 8, 8): patch (1, 2, 2) gives 16 tokens per frame; chunks of 2 frames give
3 chunks, 96 tokens.
"""
import json
import os

import pytest
import torch
from diffusers import WanTransformer3DModel
from diffusers.models.transformers.transformer_wan import WanAttnProcessor, WanRotaryPosEmbed

from posttrain.modules.models.causal_wan import CausalWanTransformer3DModel, WanKVCache
from posttrain.modules.models.presets import PRESETS

B, C, F, H, W = 2, 16, 6, 8, 8
CHUNK = 2
TEXT_LEN = 7


@pytest.fixture(scope="module")
def teacher(one_thread) -> WanTransformer3DModel:
    torch.manual_seed(0)
    return WanTransformer3DModel(**PRESETS["wan_t2v"]).eval()


@pytest.fixture
def causal(teacher) -> CausalWanTransformer3DModel:
    return CausalWanTransformer3DModel.from_bidirectional(teacher, num_frames_per_chunk=CHUNK)


def inputs(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, C, F, H, W, generator=g)
    cond = torch.randn(B, TEXT_LEN, PRESETS["wan_t2v"]["text_dim"], generator=g)
    return x, cond


def frame_timesteps(per_chunk: list[float]) -> torch.Tensor:
    """(B, F) timesteps, one level per chunk."""
    return torch.tensor(per_chunk).repeat_interleave(CHUNK).expand(B, -1).contiguous()


# ------------------------------------------------------------------------------------------- causality
def test_later_chunk_changes_no_earlier_output(causal, teacher):
    """Changing chunk 2's latents and noise level leaves chunks 0-1 bit for bit; chunk 2 itself moves. Changing
    chunk 1 moves chunks 1-2 but not chunk 0. The bidirectional teacher (same weights) is the control: there the
    same change does reach chunk 0, so the comparison can fail."""
    x, cond = inputs()
    t = frame_timesteps([900.0, 600.0, 300.0])
    x_late, t_late = x.clone(), t.clone()
    x_late[:, :, 4:] += torch.randn_like(x_late[:, :, 4:])
    t_late[:, 4:] = 50.0
    x_mid = x.clone()
    x_mid[:, :, 2:4] *= -1
    with torch.no_grad():
        y = causal(x, t, cond).sample
        y_late = causal(x_late, t_late, cond).sample
        y_mid = causal(x_mid, t, cond).sample
        tb = torch.full((B,), 600.0)
        yb, yb_late = teacher(x, tb, cond).sample, teacher(x_late, tb, cond).sample
    assert torch.equal(y[:, :, :4], y_late[:, :, :4])
    assert (y[:, :, 4:] - y_late[:, :, 4:]).abs().max() > 1e-2
    assert torch.equal(y[:, :, :2], y_mid[:, :, :2])
    assert (y[:, :, 2:] - y_mid[:, :, 2:]).abs().amax(dim=(0, 1, 3, 4)).min() > 1e-3
    assert (yb[:, :, :4] - yb_late[:, :, :4]).abs().max() > 1e-3


def test_single_chunk_equals_bidirectional_teacher(causal, teacher):
    """One chunk over all frames is the full (non-causal) mask: the causal model loaded from the teacher's state
    dict gives the teacher's output, exactly with a (B,) timestep, and within float error with a uniform
    per-frame (B, F) timestep (diffusers' per-token path)."""
    x, cond = inputs(2)
    t = torch.tensor([700.0, 250.0])
    with torch.no_grad():
        expected = teacher(x, t, cond).sample
        got = causal(x, t, cond, num_frames_per_chunk=F).sample
        got_frames = causal(x, t[:, None].expand(B, F), cond, num_frames_per_chunk=F).sample
        got_causal = causal(x, t, cond).sample
    assert torch.equal(got, expected)
    assert (got_frames - expected).abs().max() < 1e-5
    # With 3 chunks the first chunk still matches the teacher run on that chunk alone; later chunks do not
    # equal the teacher's full-video output (they do not see the future).
    with torch.no_grad():
        first = teacher(x[:, :, :CHUNK], t, cond).sample
    assert (got_causal[:, :, :CHUNK] - first).abs().max() < 1e-5
    assert (got_causal[:, :, CHUNK:] - expected[:, :, CHUNK:]).abs().max() > 1e-3


# ------------------------------------------------------------------------------------------- KV cache
SIGMAS = [1.0, 0.75, 0.5, 0.0]  # a 3-step list, Euler


def generate_cached(model, noise, cond):
    """Chunk by chunk: denoise with the cache (read only), then store the finished chunk at σ = 0."""
    cache = model.new_cache()
    done = []
    for k in range(F // CHUNK):
        x = noise[:, :, k * CHUNK:(k + 1) * CHUNK]
        for s, s_next in zip(SIGMAS[:-1], SIGMAS[1:]):
            v = model(x, torch.full((B,), 1000 * s), cond, kv_cache=cache).sample
            x = x + (s_next - s) * v
        model(x, torch.zeros(B), cond, kv_cache=cache, update_cache=True)
        done.append(x)
    return torch.cat(done, dim=2), cache


def generate_recomputed(model, noise, cond):
    """The same rollout without a cache: every step runs the finished chunks (clean, t = 0) and the current
    chunk in one block-causal forward and keeps the current chunk's velocity."""
    done = []
    for k in range(F // CHUNK):
        x = noise[:, :, k * CHUNK:(k + 1) * CHUNK]
        for s, s_next in zip(SIGMAS[:-1], SIGMAS[1:]):
            video = torch.cat([*done, x], dim=2)
            t = torch.cat([torch.zeros(B, k * CHUNK), torch.full((B, CHUNK), 1000 * s)], dim=1)
            v = model(video, t, cond).sample[:, :, -CHUNK:]
            x = x + (s_next - s) * v
        done.append(x)
    return torch.cat(done, dim=2)


def test_cached_generation_equals_recomputation(causal):
    noise, cond = inputs(3)
    with torch.no_grad():
        cached, cache = generate_cached(causal, noise, cond)
        full = generate_recomputed(causal, noise, cond)
    assert cache.num_frames == F and cache.tokens_per_frame == 16
    heads, head_dim = PRESETS["wan_t2v"]["num_attention_heads"], PRESETS["wan_t2v"]["attention_head_dim"]
    assert cache.keys[0].shape == (B, F * 16, heads, head_dim)
    diff = (cached - full).abs().max().item()
    assert diff < 1e-5, diff
    assert cached.abs().max() > 0.1  # a real video, not zeros


def test_cache_prefill_of_several_chunks_equals_chunk_by_chunk(causal):
    """Storing two clean chunks in one call (block-causal among themselves) fills the cache as two calls do."""
    x, cond = inputs(4)
    one, two = causal.new_cache(), causal.new_cache()
    with torch.no_grad():
        causal(x[:, :, :4], torch.zeros(B), cond, kv_cache=one, update_cache=True)
        for k in range(2):
            causal(x[:, :, 2 * k:2 * k + 2], torch.zeros(B), cond, kv_cache=two, update_cache=True)
    assert one.num_frames == two.num_frames == 4
    for a, b in zip(one.keys + one.values, two.keys + two.values):
        assert (a - b).abs().max() < 1e-5


def test_rope_positions_are_absolute(causal):
    """A chunk after 2 cached frames takes the base RoPE table's rows of frames 2-3 (tokens 32-63), not frames
    0-1: chunk-by-chunk generation sees the positions of one forward over the whole video."""
    x = torch.zeros(1, C, F, H, W)
    cos_all, sin_all = WanRotaryPosEmbed.forward(causal.rope, x)  # the stock table, frames 0..5
    cache = causal.new_cache()
    seen = {}
    hook = causal.rope.register_forward_hook(lambda module, args, out: seen.update(out=out))
    try:
        with torch.no_grad():
            causal(torch.zeros(1, C, 2, H, W), torch.zeros(1), torch.zeros(1, 1, 32), kv_cache=cache,
                   update_cache=True)
            causal(torch.zeros(1, C, 2, H, W), torch.zeros(1), torch.zeros(1, 1, 32), kv_cache=cache)
    finally:
        hook.remove()
    cos, sin = seen["out"]
    assert torch.equal(cos, cos_all[:, 32:64]) and torch.equal(sin, sin_all[:, 32:64])
    assert not torch.equal(cos, cos_all[:, :32])


# ------------------------------------------------------------------------------------------- weights
def init_config(model) -> dict:
    """The constructor keys of a diffusers config, JSON-normalized (tuples become lists)."""
    return json.loads(json.dumps({k: v for k, v in model.config.items() if not k.startswith("_")}))


def test_state_dict_round_trip_both_ways(teacher, causal, tmp_path):
    """Same keys and tensors as the base class; save_pretrained writes a WanTransformer3DModel folder that the
    base class loads, and a base folder loads into the causal class."""
    assert causal.state_dict().keys() == teacher.state_dict().keys()
    for key, value in teacher.state_dict().items():
        assert torch.equal(causal.state_dict()[key], value), key

    out = tmp_path / "causal"
    causal.save_pretrained(out)
    assert json.loads((out / "config.json").read_text())["_class_name"] == "WanTransformer3DModel"
    back = WanTransformer3DModel.from_pretrained(out)
    assert type(back) is WanTransformer3DModel
    x, cond = inputs(5)
    t = torch.tensor([400.0, 800.0])
    with torch.no_grad():
        assert torch.equal(back(x, t, cond).sample, teacher(x, t, cond).sample)

    base_dir = tmp_path / "base"
    teacher.save_pretrained(base_dir)
    loaded = CausalWanTransformer3DModel.from_pretrained(base_dir)
    loaded.num_frames_per_chunk = CHUNK
    assert init_config(loaded) == init_config(teacher)
    with torch.no_grad():
        assert torch.equal(loaded(x, t, cond).sample, causal(x, t, cond).sample)
    assert os.path.exists(base_dir / "diffusion_pytorch_model.safetensors")


# ------------------------------------------------------------------------------------------- gradients
def _grads(model, fn):
    model.zero_grad(set_to_none=True)
    fn(model).square().mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("cached", [False, True], ids=["full_mask", "kv_cache"])
def test_gradient_checkpointing_same_gradients(causal, cached):
    """Checkpointing recomputes each block in backward; the chunk state rides in the block's arguments, so the
    recomputation sees the same mask and cache and the gradients match."""
    x, cond = inputs(6)
    t = frame_timesteps([800.0, 500.0, 200.0])

    def fn(model):
        if not cached:
            return model(x, t, cond).sample
        cache = model.new_cache()
        with torch.no_grad():
            model(x[:, :, :4], torch.zeros(B), cond, kv_cache=cache, update_cache=True)
        # the exit step of chunk 2 with grad; then its context pass writes the cache before backward runs
        out = model(x[:, :, 4:], torch.full((B,), 500.0), cond, kv_cache=cache).sample
        with torch.no_grad():
            model(out.detach(), torch.zeros(B), cond, kv_cache=cache, update_cache=True)
        return out

    causal.train()
    plain = _grads(causal, fn)
    causal.enable_gradient_checkpointing()
    assert causal.gradient_checkpointing
    checkpointed = _grads(causal, fn)
    causal.disable_gradient_checkpointing()
    assert plain.keys() == checkpointed.keys() and len(plain) > 10
    worst = max((plain[k] - checkpointed[k]).abs().max().item() for k in plain)
    assert worst < 1e-6, worst
    assert max(g.abs().max().item() for g in plain.values()) > 1e-4


# ------------------------------------------------------------------------------------------- errors
def test_bad_input_errors(causal):
    x, cond = inputs(7)
    t = torch.full((B,), 500.0)
    with pytest.raises(ValueError, match="num_frames_per_chunk=4"):
        causal(x, t, cond, num_frames_per_chunk=4)
    with pytest.raises(ValueError, match="update_cache=True needs a kv_cache"):
        causal(x, t, cond, update_cache=True)
    with pytest.raises(ValueError, match=r"\(B, F\)"):
        causal(x, torch.zeros(B, F + 1), cond)
    cache = causal.new_cache()
    with torch.no_grad():
        for _ in range(5):  # 30 frames; the tiny preset's rope_max_seq_len is 32
            causal(x, torch.zeros(B), cond, kv_cache=cache, update_cache=True)
        with pytest.raises(ValueError, match="rope_max_seq_len=32"):
            causal(x, t, cond, kv_cache=cache)
    with pytest.raises(ValueError, match="tokens per frame"):
        causal(x[..., :4], t, cond, kv_cache=cache)
    causal.blocks[1].attn1.set_processor(WanAttnProcessor())
    with pytest.raises(RuntimeError, match=r"blocks \[1\]"):
        causal(x, t, cond)


def test_kv_cache_store_is_idempotent():
    """Rewriting the chunk at token 4 replaces it and drops what followed (a checkpoint recomputation or a
    re-run of the same chunk leaves the same cache)."""
    cache = WanKVCache(num_layers=1)
    k = torch.arange(8.0).view(1, 8, 1, 1)
    cache.store(0, 0, k, k)
    cache.store(0, 4, -k[:, :2], -k[:, :2])
    cache.store(0, 4, -k[:, :2], -k[:, :2])
    assert cache.keys[0].flatten().tolist() == [0, 1, 2, 3, 0, -1]


def test_kv_cache_truncate_then_regenerate(causal):
    """Truncating to the first chunk and re-storing the second gives the cache of the straight run."""
    x, cond = inputs(8)
    cache = causal.new_cache()
    with torch.no_grad():
        causal(x[:, :, :4], torch.zeros(B), cond, kv_cache=cache, update_cache=True)
        keys = [k.clone() for k in cache.keys]
        causal(x[:, :, 4:], torch.zeros(B), cond, kv_cache=cache, update_cache=True)
        cache.truncate(2)
        assert cache.num_frames == 2 and cache.keys[0].shape[1] == 32
        causal(x[:, :, 2:4], torch.zeros(B), cond, kv_cache=cache, update_cache=True)
    assert max((a - b).abs().max().item() for a, b in zip(cache.keys, keys)) < 1e-5
    with pytest.raises(ValueError, match="truncate a cache of 4 frames to 6"):
        cache.truncate(6)


# ------------------------------------------------------------------------------------------- rolling KV cache
def roll_out(model, noise, cond, chunk: int, cache=None, **window):
    """Chunk by chunk as ``generate_cached`` (``chunk`` frames each), through ``cache`` (default: the model's plain
    one). With ``window`` (``window_frames``, ``sink_frames``) and no cache: the same rollout recomputed, every step
    one forward over the finished chunks (clean) and the current one under the rolling cache's mask. Returns the
    video and the stored frames after each chunk (cached path)."""
    done, stored = [], []
    for k in range(noise.shape[2] // chunk):
        x = noise[:, :, k * chunk:(k + 1) * chunk]
        for s, s_next in zip(SIGMAS[:-1], SIGMAS[1:]):
            if cache is not None:
                v = model(x, torch.full((B,), 1000 * s), cond, kv_cache=cache, num_frames_per_chunk=chunk).sample
            else:
                video = torch.cat([*done, x], dim=2)
                t = torch.cat([torch.zeros(B, k * chunk), torch.full((B, chunk), 1000 * s)], dim=1)
                v = model(video, t, cond, num_frames_per_chunk=chunk, **window).sample[:, :, -chunk:]
            x = x + (s_next - s) * v
        if cache is not None:
            model(x, torch.zeros(B), cond, kv_cache=cache, update_cache=True, num_frames_per_chunk=chunk)
            stored.append((cache.stored_frames, max(k.shape[1] for k in cache.keys)))
        done.append(x)
    return torch.cat(done, dim=2), stored


@pytest.mark.parametrize("chunk, window, sink", [(1, 2, 0), (1, 2, 1), (2, 2, 0)])
def test_rolling_cache_is_bounded_and_equals_the_windowed_forward(causal, chunk, window, sink):
    """Self-Forcing++'s rolling cache over 6 frames: after every chunk it holds at most ``sink + window`` frames
    (16 tokens each), and the rolled rollout equals one forward per step over the whole history under the rolling
    cache's mask (Self-Forcing's ``local_attn_size`` mask, within 1e-5). It differs from the plain cache's rollout,
    so the window is really applied (a cache that ignored it would fail here)."""
    noise, cond = inputs(9)
    with torch.no_grad():
        rolled, stored = roll_out(causal, noise, cond, chunk, WanKVCache(len(causal.blocks), window_frames=window,
                                                                         sink_frames=sink))
        recomputed, _ = roll_out(causal, noise, cond, chunk, window_frames=window, sink_frames=sink)
        plain, plain_stored = roll_out(causal, noise, cond, chunk, causal.new_cache())
    assert all(frames <= sink + window and tokens == frames * 16 for frames, tokens in stored), stored
    assert stored[-1][0] == sink + window and plain_stored[-1][0] == F  # the plain cache grows with the video
    assert (rolled - recomputed).abs().max() < 1e-5
    first_evicted = (sink + window) // chunk  # chunks up to here see every earlier chunk: bitwise the plain cache
    assert torch.equal(rolled[:, :, :(first_evicted + 1) * chunk], plain[:, :, :(first_evicted + 1) * chunk])
    assert (rolled[:, :, (first_evicted + 1) * chunk:] - plain[:, :, (first_evicted + 1) * chunk:]).abs().max() > 1e-3


def test_rolling_cache_within_its_window_is_the_plain_cache(causal):
    """A window as long as the video never evicts: the rollout and every stored key equal the plain cache's."""
    noise, cond = inputs(10)
    with torch.no_grad():
        rolling = WanKVCache(len(causal.blocks), window_frames=F)
        rolled, _ = roll_out(causal, noise, cond, CHUNK, rolling)
        plain_cache = causal.new_cache()
        plain, _ = roll_out(causal, noise, cond, CHUNK, plain_cache)
    assert torch.equal(rolled, plain) and rolling.evicted_frames == 0
    assert all(torch.equal(a, b) for a, b in zip(rolling.keys + rolling.values, plain_cache.keys + plain_cache.values))


def test_rolling_cache_bad_settings_name_the_option(causal):
    with pytest.raises(ValueError, match=r"window_frames=0 must be >= 1"):
        WanKVCache(2, window_frames=0)
    with pytest.raises(ValueError, match=r"sink_frames=1 must be >= 0 and needs window_frames"):
        WanKVCache(2, sink_frames=1)
    x, cond = inputs(11)
    with pytest.raises(ValueError, match=r"window_frames=2, sink_frames=0 shape a forward without a cache"):
        causal(x[:, :, :2], torch.zeros(B), cond, kv_cache=causal.new_cache(), window_frames=2)
    cache = causal.new_cache(window_frames=2)
    with torch.no_grad():
        for k in range(3):
            causal(x[:, :, 2 * k:2 * k + 2], torch.zeros(B), cond, kv_cache=cache, update_cache=True)
    assert cache.stored_frames == 2 and cache.evicted_frames == 4 and cache.num_frames == 6
    with pytest.raises(ValueError, match=r"truncate a cache of 6 frames to 2 \(frames 0..3 were evicted\)"):
        cache.truncate(2)
