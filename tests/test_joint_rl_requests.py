"""Joint RL on user requests with the shipped refiner and generator (configs/unified_rl.yaml): what its rewrites
reach in the video, judged by the request's facts under fixed noise (``bench/served.py``)."""
from __future__ import annotations

import os

import pytest
import torch

from bench.served import served_verdicts
from posttrain.datamodules.requests import RequestDataset
from posttrain.lit.tools.config import PosttrainCLI
from posttrain.modules.world.world import FACTS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.usefixtures("one_thread")


def shipped(*options: str):
    """configs/unified_rl.yaml's system as shipped (built from the repository root: the refiner's relative path)."""
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        cli = PosttrainCLI(args=["--config", os.path.join(ROOT, "configs", "unified_rl.yaml"),
                                 "--trainer.logger=false", *options], run=False)
    finally:
        os.chdir(cwd)
    cli.model.configure_model()
    return cli


def test_a_rewrite_that_is_the_caption_gets_the_captions_verdicts_under_the_same_noise():
    """Served with the same noise seed, a prompt list that agrees with the captions at rows 0 and 2 gives exactly the
    captions' videos there (so their verdicts), whatever rows 1 and 3 hold; a reworded caption at row 1 draws another
    video from the same noise: the measurement tells a rewrite from its caption by wording alone."""
    from posttrain.lit.base import ExpertModule
    from posttrain.modules.world.geneval import judge_facts

    module = shipped().model.eval()
    requests = [RequestDataset(4, seed=11).request(i) for i in range(4)]
    captions, facts = [r.caption for r in requests], [r.facts for r in requests]
    mixed = [captions[0], "please make " + captions[1], captions[2], requests[3].text]
    with torch.no_grad():
        a = ExpertModule.generate(module, captions, seed=5000)
        b = ExpertModule.generate(module, mixed, seed=5000)
    assert torch.equal(a[0], b[0]) and torch.equal(a[2], b[2])
    assert not torch.equal(a[1], b[1])  # wording alone changes the video
    # in batches of 2: batch i from seed 5000 + i, so request j gets the same noise whatever it is served
    va = served_verdicts(module, captions, facts, 5000, batch=2)
    vb = served_verdicts(module, mixed, facts, 5000, batch=2)
    assert va.shape == (4, len(FACTS))
    assert torch.equal(va[[0, 2]].nan_to_num(-1), vb[[0, 2]].nan_to_num(-1))
    with torch.no_grad():
        videos = torch.cat([ExpertModule.generate(module, captions[:2], seed=5000),
                            ExpertModule.generate(module, captions[2:], seed=5001)]).float()
    judged = judge_facts(videos, facts)
    assert torch.equal(va.nan_to_num(-1), torch.stack([judged[f] for f in FACTS], dim=1).nan_to_num(-1))
    # the joint RL rollout's SDE samples from the same noise: the same rule
    sa = served_verdicts(module, captions, facts, 5000, batch=2, sde=True)
    sb = served_verdicts(module, mixed, facts, 5000, batch=2, sde=True)
    assert torch.equal(sa[[0, 2]].nan_to_num(-1), sb[[0, 2]].nan_to_num(-1))


def test_faithful_generator_rows_are_the_rewrites_that_name_what_was_asked():
    """``generator_rows: faithful`` keeps the refined samples whose served prompt names every asked fact (a fact the
    request leaves out may be named or not) and drops the ones that name another shape or colour; a batch without
    facts is refused with the fix."""
    from posttrain.lit.joint_rl import JointRL

    batch = {"prompt": ["i want a crimson disc", "a box drifting up"], "shape": ["circle", "square"],
             "colour": ["red", ""], "background": ["", ""], "motion": ["", "up"]}
    served = ["a red circle", "a blue circle", "a red circle moving left on a blue background", "a red circle",
              "a square moving up", "a green square moving up", "a square moving down", "a square"]
    refined = torch.tensor([0, 1, 2, 4, 5, 6, 7])  # sample 3 was served its request verbatim
    kept = JointRL._faithful(batch, refined, served, repeats=4)
    assert kept.tolist() == [0, 2, 4, 5]
    with pytest.raises(ValueError, match="generator_rows='faithful'.*datamodules.Requests"):
        JointRL._faithful({"prompt": batch["prompt"]}, refined, served, repeats=4)


def test_faithful_generator_rows_bound_what_the_generator_trains_on(monkeypatch):
    """One iteration of the shipped system with ``generator_rows: faithful``: the generator's update keeps no more rows
    than the refined samples whose served prompt names what was asked, fewer than all refined ones here."""
    from lightning.pytorch import Callback

    from posttrain.lit.joint_rl import JointRL
    from tests.helpers import quick_trainer

    faithful: list[int] = []
    select = JointRL._faithful
    monkeypatch.setattr(JointRL, "_faithful", staticmethod(
        lambda *args, **kwargs: faithful.append(len(select(*args, **kwargs))) or select(*args, **kwargs)))
    kept: list[float] = []

    class Kept(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            kept.append(float(trainer.callback_metrics["train/kept_samples/transformer"]))

    # at temperature 1.5 some of the iteration's rewrites name another fact than the one asked
    cli = shipped("--model.init_args.generator_rows=faithful", "--model.init_args.refiners.temperature=1.5")
    module = cli.model
    refined = cli.datamodule.batch_size * (module.grpo.num_samples_per_prompt - module.refiner_args.num_unrefined)
    quick_trainer(1, log_every_n_steps=1, callbacks=[Kept()]).fit(module, cli.datamodule)
    assert len(faithful) == len(kept) == 1 and kept[0] <= faithful[0] < refined, (kept, faithful, refined)


def system_scores(module, num: int = 48, seed: int = 101, noise_seed: int = 9000) -> dict[str, float]:
    """The test's own evaluation set (``num`` requests of the training wording drawn with ``seed``, none of the
    configs' or ``rl_compare``'s seeds, and the captions of all four facts of the same videos): request-GenEval
    through the system (refiner, then generator), caption GenEval and shape of the generator alone, and the refiner's
    greedy rewrite accuracy."""
    from posttrain.datamodules.synthetic import PRETRAIN_EXCLUDE, ShapesDataset
    from posttrain.modules.world.geneval import judge_facts
    from posttrain.modules.world.requests import accuracy, refine, rewrite_verdicts
    from posttrain.modules.world.world import caption, parse_caption

    requests = [RequestDataset(num, seed=seed, exclude=PRETRAIN_EXCLUDE).request(i) for i in range(num)]
    texts, facts = [r.text for r in requests], [r.facts for r in requests]
    shapes = ShapesDataset(num, 1, 8, 8, seed=seed, exclude=PRETRAIN_EXCLUDE)
    captions = [caption(*shapes.facts(i)) for i in range(num)]
    with torch.no_grad():
        videos = torch.cat([module.generate(texts[i:i + 16], seed=noise_seed + k).float()
                            for k, i in enumerate(range(0, num, 16))])
    table = served_verdicts(module, captions, [parse_caption(c) for c in captions], noise_seed)
    name = module.card.refiners[0]
    rewrites = refine(module.card[name], module.card.tokenizers[name], texts, module.templates[name],
                      max_new_tokens=module.max_new_tokens[name])
    shown = accuracy({f: table[:, i] for i, f in enumerate(FACTS)})
    return {"request": accuracy(judge_facts(videos, facts))["all"], "caption": shown["all"],
            "caption_shape": shown["shape"], "rewrite": accuracy(rewrite_verdicts(rewrites, facts))["all"]}


@pytest.mark.slow
def test_joint_rl_on_requests_lifts_the_video_and_keeps_the_generator():
    """configs/unified_rl.yaml, 60 iterations (480 videos), served greedy (``refiners.serve``), judged on the test's
    own 48 requests and the captions of the same videos, with fixed noise. Learning: the refiner's greedy rewrites get
    more requests right, and that gain shows in the video: request-GenEval rises by at least half of what the
    rewrites' gain is worth at the generator's caption accuracy (a right rewrite is the caption,
    ``docs/rl/rewrite_gap.md``; served sampled at temperature 1, 0.354 → 0.375 while the rewrites went 0.50 → 0.73,
    this fails). The generator does not get worse: caption GenEval, all four facts and the shape, falls by no more
    than one evaluation's noise (√(p(1 − p) / 48) at its start)."""
    import math

    from tests.helpers import quick_trainer

    cli = shipped("--model.init_args.refiners.serve=greedy")
    module = cli.model
    before = system_scores(module.eval())
    quick_trainer(60).fit(module.train(), cli.datamodule)
    after = system_scores(module.eval())
    print(f"joint RL on requests: before {before}, after {after}")
    noise = {k: math.sqrt(before[k] * (1 - before[k]) / 48) for k in before}
    assert after["caption"] >= before["caption"] - noise["caption"], (before, after)
    assert after["caption_shape"] >= before["caption_shape"] - noise["caption_shape"], (before, after)
    assert after["rewrite"] > before["rewrite"] + noise["rewrite"], (before, after)
    worth = (after["rewrite"] - before["rewrite"]) * before["caption"]
    assert after["request"] - before["request"] >= worth / 2, (before, after, worth)


def test_greedy_serving_serves_each_refiners_most_likely_rewrite():
    """``refiners.serve: greedy``: the system serves ``requests.refine``'s greedy rewrite whatever the seed (what the
    bench's rewrite accuracy reads); ``sample`` (the default) draws at the temperature, seeded."""
    from posttrain.modules.world.requests import refine

    module = shipped("--model.init_args.refiners.serve=greedy").model.eval()
    requests = [r.text for r in (RequestDataset(6, seed=11).request(i) for i in range(6))]
    greedy = refine(module.card["refiner_0"], module.card.tokenizers["refiner_0"], requests,
                    module.templates["refiner_0"], max_new_tokens=module.max_new_tokens["refiner_0"])
    assert module.refine(requests, seed=0)[1] == module.refine(requests, seed=1)[1] == [g.strip() for g in greedy]
    module.refiner_args.serve = "sample"
    assert module.refine(requests, seed=0) == module.refine(requests, seed=0)
    assert module.refine(requests, seed=0)[1] != module.refine(requests, seed=1)[1]  # drawn: the seed matters
