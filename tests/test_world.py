"""The shipped pretrained world: its generator follows the prompt on the concepts it saw, not on the one
held out, and its samples are closer to the data than an untrained generator's."""
from __future__ import annotations

import pytest
import torch

from posttrain.datamodules.synthetic import PRETRAIN_EXCLUDE, ShapesDataset
from posttrain.modules.models import presets
from posttrain.modules.eval.evaluation import evaluate_generator, generate
from posttrain.modules.eval.frechet import VAEFrameFeatures, VideoFrechetDistance
from posttrain.modules.world.geneval import chance
from posttrain.modules.flow.samplers import FlowMatchSampler

FRAMES, SIZE = 5, 32


def prompts(n: int, seed: int, **kwargs) -> list[str]:
    dataset = ShapesDataset(n, 1, 8, 8, seed=seed, **kwargs)
    return [dataset[i]["prompt"] for i in range(n)]


@pytest.fixture(scope="module")
def world():
    """The shipped assets, loaded as ``build_model`` loads a preset without overrides."""
    for arch in ("wan_vae", "umt5", "wan_t2v"):
        assert presets.build_model(arch).config is not None
    return {
        "transformer": presets.build_model("wan_t2v").eval(),
        "text_encoder": presets.build_model("umt5").eval(),
        "tokenizer": presets.build_tokenizer(),
        "vae": presets.build_model("wan_vae").eval(),
    }


def geneval(world: dict, eval_prompts: list[str], transformer=None, sampler=None) -> dict[str, float]:
    scores = evaluate_generator(transformer or world["transformer"], world["text_encoder"], world["tokenizer"],
                                world["vae"], eval_prompts, frames=FRAMES, height=SIZE, width=SIZE, sampler=sampler)
    return {k: float(v) for k, v in scores.items()}


def test_presets_without_overrides_load_the_shipped_assets():
    """A preset without overrides is the trained asset (from_pretrained); with overrides, random weights."""
    shipped = presets.build_model("wan_t2v")
    again = presets.build_model("wan_t2v")
    random_ = presets.build_model("wan_t2v", preset={"num_layers": 4})
    p_shipped, p_again, p_random = (next(m.parameters()) for m in (shipped, again, random_))
    assert torch.equal(p_shipped, p_again)
    assert not torch.equal(p_shipped, p_random)
    assert presets.build_model("umt5").config.d_model == shipped.config.text_dim


@pytest.mark.slow
def test_pretrained_generator_follows_seen_prompts(world, one_thread):
    """Samples (20 Euler steps, shift 3) of 64 prompts of the concepts it was pretrained on read back far above
    chance (shape 1/3, colours 1/6, motion 1/4): with CFG 4.5 (how Wan serves, and the distillation teacher) each
    fact >= 0.8 and all four >= 0.5 (the world's targets); without CFG (how the RL configs roll out) less, which
    is the room RL has to climb."""
    eval_prompts = prompts(64, seed=21, exclude=PRETRAIN_EXCLUDE)
    guided = geneval(world, eval_prompts, sampler=FlowMatchSampler(num_steps=20, guidance_scale=4.5))
    for fact in ("shape", "colour", "background", "motion"):
        assert guided[fact] >= 0.8, guided
    assert guided["all"] >= 0.5, guided
    plain = geneval(world, eval_prompts)
    assert chance("shape") < plain["shape"] and plain["all"] < guided["all"], (plain, guided)


@pytest.mark.slow
def test_held_out_concept_is_not_known(world, one_thread):
    """Prompts with the held-out colour (magenta, as the shape or the background): the generator never
    saw it, so the facts naming it read back near 0 (below the 1/6 of a random colour: it draws one of
    the colours it knows), and all four together are rare; finetuning on data teaches it."""
    shape_magenta = prompts(24, seed=22, include=["colour:magenta"])
    background_magenta = prompts(24, seed=23, include=["background:magenta"])
    assert geneval(world, shape_magenta)["colour"] <= chance("colour")
    assert geneval(world, background_magenta)["background"] <= chance("background")
    assert geneval(world, shape_magenta + background_magenta)["all"] <= 0.1


@pytest.mark.slow
def test_frechet_distance_ranks_the_pretrained_generator_closer_to_data(world, one_thread):
    """The data's frames against samples of the same prompts: the pretrained generator's are closer
    than an untrained generator's (same architecture, random weights)."""
    eval_prompts = prompts(32, seed=24, exclude=PRETRAIN_EXCLUDE)
    data = ShapesDataset(32, FRAMES, SIZE, SIZE, seed=24, exclude=PRETRAIN_EXCLUDE)
    real = torch.stack([data[i]["video"] for i in range(32)])
    untrained = presets.build_model("wan_t2v", preset=dict(presets.PRESETS["wan_t2v"])).eval()
    fd = VideoFrechetDistance(VAEFrameFeatures(world["vae"]), reset_real_features=False)
    fd.update(real, real=True)
    distances = {}
    for name, transformer in {"pretrained": world["transformer"], "untrained": untrained}.items():
        fd.reset()
        for i in range(0, 32, 16):
            fd.update(generate(transformer, world["text_encoder"], world["tokenizer"], world["vae"],
                               eval_prompts[i:i + 16], seed=i, frames=FRAMES, height=SIZE, width=SIZE), real=False)
        distances[name] = float(fd.compute())
    assert distances["pretrained"] < 0.5 * distances["untrained"], distances


def test_held_out_concepts_filter_the_data():
    """exclude drops every sample showing a value, include keeps those showing one, fact:word names a
    role; unfiltered data is what it always was; an unknown word is refused with the vocabulary."""
    plain = ShapesDataset(50, 1, 8, 8, seed=0)
    held = ShapesDataset(50, 1, 8, 8, seed=0, exclude=["magenta"])
    only = ShapesDataset(50, 1, 8, 8, seed=0, include=["colour:magenta"])
    assert not any("magenta" in held[i]["prompt"] for i in range(50))
    assert all(only[i]["prompt"].startswith("a magenta ") for i in range(50))
    kept = [i for i in range(50) if "magenta" not in plain[i]["prompt"]]
    assert kept and all(held[i]["prompt"] == plain[i]["prompt"] for i in kept)  # accepted draws unchanged
    with pytest.raises(ValueError, match=r"exclude: 'colour:mauve': 'mauve' is not a value of colour"):
        ShapesDataset(1, 1, 8, 8, exclude=["colour:mauve"])
    with pytest.raises(ValueError, match="no sample can pass"):
        ShapesDataset(1, 1, 8, 8, exclude=["red"], include=["red"])


def test_long_clips_at_the_worlds_pace_continue_the_motion():
    """``speed=PACE``: a 21-frame clip is the 5-frame world's motion continued — its first 5 frames are the 5-frame
    clip of the same sample, every 5-frame window of it (frames 4(p-1) .. 4p, what one latent frame adds) reads
    back all four facts, and the whole clip travels 20 · PACE = 1.25 frames. Without ``speed`` a clip of any length
    moves SPEED in all (the shipped world, unchanged), so its windows move 4x less. A bad speed names the option."""
    from posttrain.modules.world.geneval import read_facts
    from posttrain.modules.world.world import PACE, SPEED, parse_caption

    short, long = ShapesDataset(12, 5, 32, 32, seed=4), ShapesDataset(12, 21, 32, 32, seed=4, speed=PACE)
    stretched = ShapesDataset(12, 21, 32, 32, seed=4)
    for i in range(12):
        clip, facts = long[i]["video"], parse_caption(long[i]["prompt"])
        assert torch.equal(clip[:, :5], short[i]["video"])
        assert all(read_facts(clip[:, 4 * (p - 1):4 * p + 1]) == facts for p in range(1, 6)), long[i]["prompt"]
        assert torch.equal(stretched[i]["video"][:, -1], short[i]["video"][:, -1])  # SPEED over the whole clip
    assert PACE * 20 == 1.25 and SPEED == 4 * PACE
    with pytest.raises(ValueError, match=r"speed=0.5 must be in \(0, 0.5\).*PACE"):
        ShapesDataset(1, 21, 8, 8, speed=0.5)


@pytest.mark.slow
def test_the_long_worlds_codec_decodes_the_whole_clip_where_the_5_frame_codec_loses_it(one_thread):
    """16 held-out 21-frame clips of the long world (the 5-frame world's pace continued), encoded and decoded: the
    5-frame codec's reconstructions lose the facts after the first 5 frames (all four 0.02-0.17 per later window in
    scripts/train_vae.py's check), the long world's codec (its decoder finetuned on 21-frame clips, the encoder the
    same) keeps them (0.89-0.98); both encode to the same latents, and configs/self_forcing_long.yaml reads it."""
    import yaml
    from diffusers import AutoencoderKLWan

    from posttrain.modules.models.vae import decode, encode
    from posttrain.modules.world.world import PACE
    from tests.helpers import late_windows

    data = ShapesDataset(16, 21, SIZE, SIZE, seed=777, speed=PACE)
    videos = torch.stack([data[i]["video"] for i in range(16)])
    clip_prompts = [data[i]["prompt"] for i in range(16)]
    short = presets.build_model("wan_vae").eval()
    long = AutoencoderKLWan.from_pretrained("modules/assets/world21", subfolder="wan_vae").eval()
    z = encode(short, videos)
    assert torch.equal(z, encode(long, videos))

    long_score, short_score = (late_windows(decode(vae, z), clip_prompts)["all"] for vae in (long, short))
    with open("configs/self_forcing_long.yaml") as f:  # the long world's config reads it
        experts = yaml.safe_load(f)["model"]["init_args"]["card"]["experts"]
    assert experts["vae"] == {"arch": "wan_vae", "pretrained": "modules/assets/world21", "subfolder": "wan_vae"}
    print(f"late windows, all four: long codec {long_score:.3f}, 5-frame codec {short_score:.3f}")
    assert long_score >= 0.75 and short_score <= 0.3, (long_score, short_score)
