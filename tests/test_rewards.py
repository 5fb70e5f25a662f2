"""Rewards: values on hand-made videos, terms, combination, validation errors."""
import pytest
import torch

from posttrain.datamodules.synthetic import COLOURS, render
from posttrain.modules.rewards.image import CLIPScore, JpegCompressibility
from posttrain.modules.rewards.synthetic import ColourAlignment, PALETTE, RefinementKeyword
from posttrain.modules.rewards.base import ConstantReward, RewardOutput, WeightedReward, score, term_of

PROMPT = "a red circle moving left on a blue background"


def solid(rgb, frames=1, size=8):
    return (torch.tensor(rgb).view(1, 3, 1, 1, 1) * 2 - 1).expand(1, 3, frames, size, size).clone()


def test_palette_matches_synthetic_data():
    assert PALETTE == COLOURS


def test_colour_alignment_prefers_the_named_colours():
    """The rendered synthetic video of the prompt scores near 1 (its mean is about the 15/85 mix);
    a solid video of the background scores a little less, one of an unnamed colour much less."""
    reward = ColourAlignment()
    video = render("circle", "red", "left", "blue", 5, 32, 32)[None]
    media = torch.cat([video, solid(COLOURS["blue"], 5, 32), solid(COLOURS["yellow"], 5, 32)])
    out = score(reward, media, [PROMPT] * 3)
    assert out.total[0] > 0.95
    assert out.total[0] > out.total[1] > out.total[2] + 0.3
    assert set(out.terms) == {"distance"}


def test_colour_alignment_reads_the_original_prompt_and_unnamed_prompts():
    reward = ColourAlignment(no_colour_reward=0.25)
    media = torch.cat([solid(COLOURS["green"]), solid(COLOURS["green"])])
    out = reward(media, ["a green square", "a plain square"])
    assert out.total[0].item() == pytest.approx(1.0)
    assert out.total[1].item() == 0.25
    # joint RL: a refined prompt ("... magenta ...") is scored against the user's original prompt
    refined = reward(media[:1], ["a magenta square"], {"original_prompts": ["a green square"]})
    assert refined.total[0].item() == pytest.approx(1.0)


def test_jpeg_compressibility_flat_beats_noise():
    flat = torch.zeros(1, 3, 2, 32, 32)
    noise = torch.rand(1, 3, 2, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    media = torch.cat([flat, noise])
    comp = score(JpegCompressibility(), media, ["x", "x"])
    incomp = score(JpegCompressibility(incompressible=True), media, ["x", "x"])
    assert comp.total[0] > comp.total[1]
    assert incomp.total[1] > incomp.total[0]
    torch.testing.assert_close(comp.terms["kb"], incomp.terms["kb"])
    assert JpegCompressibility(incompressible=True).name == "JpegIncompressibility"


def test_refinement_keyword_one_term_per_expert():
    """refiner_0 targets 'a': 'aab' → 2/3, 'xyz' → 0; refiner_1 targets 'sunset' (contains)."""
    reward = RefinementKeyword({"refiner_0": "a", "refiner_1": "sunset"}, mode="fraction")
    context = {"refinements": {"refiner_0": ["aab", "xyz"], "refiner_1": ["a sunset", "noon"]}}
    out = score(reward, torch.zeros(2, 3, 1, 8, 8), ["p", "q"], context)
    torch.testing.assert_close(out.terms["refiner_0"], torch.tensor([2 / 3, 0.0]))
    torch.testing.assert_close(out.terms["refiner_1"], torch.tensor([6 / 8, 0.0]))
    torch.testing.assert_close(out.total, (out.terms["refiner_0"] + out.terms["refiner_1"]) / 2)
    contains = RefinementKeyword({"refiner_1": "SUNSET"}, mode="contains")(None, ["p", "q"], context)
    torch.testing.assert_close(contains.terms["refiner_1"], torch.tensor([1.0, 0.0]))
    with pytest.raises(ValueError, match=r"needs context\['refinements'\] for experts \['refiner_0', 'refiner_1'\]"):
        reward(torch.zeros(2, 3, 1, 8, 8), ["p", "q"])


def test_weighted_reward_prefixes_terms_and_term_of_finds_experts():
    reward = WeightedReward({"colour": ColourAlignment(), "keyword": RefinementKeyword({"refiner_0": "a"})},
                            weights={"colour": 2.0, "keyword": 0.5})
    media = solid(COLOURS["green"])
    out = score(reward, media, ["a green square"], {"refinements": {"refiner_0": ["aa"]}})
    assert set(out.terms) == {"colour", "colour/distance", "keyword", "keyword/refiner_0"}
    torch.testing.assert_close(out.total, 2.0 * out.terms["colour"] + 0.5 * out.terms["keyword"])
    torch.testing.assert_close(term_of(out, "refiner_0"), torch.tensor([1.0]))
    with pytest.raises(KeyError, match="refiner_7"):
        term_of(out, "refiner_7")
    with pytest.raises(ValueError, match=r"weights name rewards \['jpeg'\]"):
        WeightedReward({"colour": ColourAlignment()}, weights={"jpeg": 1.0})


class HoldsAModel(ConstantReward):
    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(4, 1)

    def models(self):
        return {"head": self.head}


def test_a_reward_names_its_models_and_combinations_name_their_parts():
    """``Reward.models``: none by default, a reward's own, a ``WeightedReward``'s parts under their keys, a
    ``StageReward``'s part as is; ``reward_models`` prefixes them (``posttrain estimate``'s rows) and takes any
    callable."""
    from posttrain.modules.rewards.base import StageReward, reward_models

    held = HoldsAModel()
    assert ColourAlignment().models() == {} and held.models() == {"head": held.head}
    both = WeightedReward({"colour": ColourAlignment(), "pick": held, "image": StageReward(held, "t2i")})
    assert both.models() == {"pick/head": held.head, "image/head": held.head}
    assert reward_models(both) == {"reward/pick/head": held.head, "reward/image/head": held.head}
    assert reward_models(lambda media, prompts, context=None: None) == {}


def test_every_reward_file_is_exported_by_the_package():
    """``modules/rewards/__init__.py`` finds the rewards by reading its folder: every ``Reward`` subclass of every
    file is a name of the package (what a short ``class_path`` resolves)."""
    import importlib
    import pkgutil

    import posttrain.modules.rewards as rewards
    from posttrain.modules.rewards.base import Reward

    defined = {name for info in pkgutil.iter_modules(rewards.__path__)
               for name, value in vars(importlib.import_module(f"{rewards.__name__}.{info.name}")).items()
               if isinstance(value, type) and issubclass(value, Reward) and value.__module__.endswith(info.name)}
    assert {"PickScore", "RemoteReward", "ColourAlignment", "IntentReward", "CLIPScore"} <= defined
    assert defined <= set(rewards.__all__) and all(getattr(rewards, name).__name__ == name for name in defined)


class NaNReward(ConstantReward):
    def __call__(self, media, prompts, context=None):
        return RewardOutput(torch.tensor([0.5, float("nan")]), {})


class WrongShapeReward(ConstantReward):
    def __call__(self, media, prompts, context=None):
        return torch.zeros(len(prompts), 1)


def test_bad_reward_outputs_are_named_errors():
    media = torch.zeros(2, 3, 1, 8, 8)
    with pytest.raises(ValueError, match=r"reward 'NaNReward': total is not finite for samples \[1\]"):
        score(NaNReward(), media, ["a", "b"])
    with pytest.raises(ValueError, match=r"reward 'WrongShapeReward': total has shape \(2, 1\), expected \(2,\)"):
        score(WrongShapeReward(), media, ["a", "b"])
    with pytest.raises(ValueError, match=r"reward 'nan \(NaNReward\)': total is not finite"):
        score(WeightedReward({"nan": NaNReward()}), media, ["a", "b"])
    with pytest.raises(ValueError, match="rewards take"):
        score(ConstantReward(), torch.zeros(2, 3, 8, 8), ["a", "b"])


def test_clip_score_needs_a_local_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="CLIPScore: path='openai/clip-vit-base-patch32' is not a local"):
        CLIPScore("openai/clip-vit-base-patch32")
    with pytest.raises(FileNotFoundError, match="is not a local folder"):
        CLIPScore(str(tmp_path / "missing"))


def test_clip_score_reward_is_torchmetrics_clip_score_per_sample(tmp_path):
    """The reward and the evaluation metric read one local CLIP folder the same way: the reward of a one-frame
    sample is torchmetrics' CLIPScore of it / 100 (before the metric's clamp at 0)."""
    from helpers import tiny_clip_folder

    from posttrain.modules.rewards.clip import clip_score_metric, to_uint8

    folder = tiny_clip_folder(str(tmp_path / "clip"))
    media = torch.rand(3, 3, 2, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    prompts = ["a red circle moving left on a blue background", "a green square", "a cyan triangle"]
    out = score(CLIPScore(folder, frames=1), media, prompts)
    assert out.total.shape == (3,) and bool(((out.total >= -1) & (out.total <= 1)).all())
    metric = clip_score_metric(folder)
    for b in range(3):
        metric.reset()
        metric.update([to_uint8(media[b, :, 0])], [prompts[b]])
        assert float(metric.compute()) == pytest.approx(max(float(out.total[b]) * 100, 0.0), abs=1e-3)
    with pytest.raises(ValueError, match="does not hold a CLIP model with its processor"):
        clip_score_metric(str(tmp_path))  # a folder, but no CLIP in it


def test_term_problems_name_the_option_the_terms_and_the_fix():
    """The start-up dry run of credit by reward term (joint_rl, workflow_rl): each missing term is named with the
    option that asked for it and the terms the reward has; a reward that fails on the dry run is reported once."""
    from posttrain.modules.rewards.base import credited_term, term_problems

    reward = WeightedReward({"colour": ColourAlignment(), "keyword": RefinementKeyword({"refiner_0": "x"})})
    context = {"original_prompts": ["a red circle"], "refinements": {"refiner_0": [""]}}
    media = torch.zeros(1, 3, 1, 8, 8)
    needed = [("refiner_0", "credit='per_expert'", "fix A"), ("refiner_1", "credit='per_expert'", "fix B"),
              ("motion", "generator_term", "fix C")]
    assert term_problems(reward, needed, media, ["a red circle"], context) == [
        "credit='per_expert' needs a reward term for 'refiner_1', but the reward's terms are ['colour', "
        "'colour/distance', 'keyword', 'keyword/refiner_0']: fix B",
        "generator_term needs a reward term for 'motion', but the reward's terms are ['colour', 'colour/distance', "
        "'keyword', 'keyword/refiner_0']: fix C"]
    failing = term_problems(reward, needed, media, ["a red circle"], None)
    assert len(failing) == 1 and failing[0].startswith("credit='per_expert', generator_term: the reward failed on a "
                                                       "dry run (")
    out = score(reward, media, ["a red circle"], context)
    assert torch.equal(credited_term(out, "refiner_0", "joint_rl"), out.terms["keyword/refiner_0"])
    with pytest.raises(ValueError, match="joint_rl credit by reward term: per-expert credit needs exactly one"):
        credited_term(out, "refiner_1", "joint_rl")
