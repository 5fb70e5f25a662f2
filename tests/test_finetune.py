"""finetune learns the synthetic videos; iterations, versions and the cache behave."""
from __future__ import annotations

import pytest
import torch

from posttrain.callbacks.checkpoints import ModelCheckpoint
from posttrain.datamodules.synthetic import SyntheticVideos
from posttrain.lit.finetune import Finetune
from posttrain.modules.models.cards import Expert
from posttrain.modules.flow.losses import flow_matching_loss, noised
from tests.conftest import TINY_WAN, adamw, wan_card
from tests.helpers import TwoExperts, assert_one_metric_scheme, quick_trainer


def held_out_loss(module: Finetune, dm: SyntheticVideos) -> float:
    """Flow-matching loss on fixed held-out videos, fixed σ grid and fixed noise."""
    batch = next(iter(dm.val_dataloader()))
    with torch.no_grad():
        x0 = module.stage.encode(batch["video"])
        cond = module.stage.condition(list(batch["prompt"]))
        g = torch.Generator().manual_seed(0)
        losses = []
        for s in (0.2, 0.4, 0.6, 0.8):
            noise = torch.randn(x0.shape, generator=g)
            sigma = torch.full((x0.shape[0],), s)
            with module.stage.velocity("transformer") as velocity:
                v = velocity(noised(x0, noise, sigma), sigma * 1000, cond)
            losses.append(flow_matching_loss(v, x0, noise)[0].mean())
    return torch.stack(losses).mean().item()


@pytest.mark.slow
@pytest.mark.parametrize("lr", [3e-3, 0.0])
def test_finetune_loss_falls_and_zero_lr_control_does_not(lr):
    torch.manual_seed(0)
    module = Finetune(wan_card(lr=lr), caption_dropout=0.0)
    module.configure_model()
    dm = SyntheticVideos(num_samples=64, val_samples=8, batch_size=4)
    before = held_out_loss(module, dm)
    weights = {k: v.clone() for k, v in module.card["transformer"].state_dict().items()}
    frozen = {k: v.clone() for k, v in module.card["text_encoder"].state_dict().items()}
    quick_trainer(max_steps=80).fit(module, dm)
    after = held_out_loss(module, dm)
    assert all(torch.equal(v, module.card["text_encoder"].state_dict()[k]) for k, v in frozen.items())
    if lr > 0:  # 80 steps from random weights halve it (1.87 -> 0.94 measured on the 4x VAE's latents)
        assert after < 0.6 * before, f"held-out loss {before:.3f} -> {after:.3f}"
    else:  # control: nothing learns, nothing moves
        assert after == pytest.approx(before, abs=1e-6)
        assert all(torch.equal(v, module.card["transformer"].state_dict()[k]) for k, v in weights.items())


def test_two_experts_global_step_counts_iterations(tmp_path):
    """Two optimizers stepping every iteration: max_steps, versions and checkpoint cadence count iterations."""
    card = wan_card(extra={"critic": Expert(arch="wan_t2v", preset=TINY_WAN, trainable=True, optimizer=adamw(),
                                            accumulate=2)})
    module = TwoExperts(card)
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, filename="{step}")
    trainer = quick_trainer(max_steps=6, enable_checkpointing=True, callbacks=[ckpt])
    trainer.fit(module, SyntheticVideos(num_samples=32, batch_size=2))
    assert module.calls == 6 and trainer.global_step == 6
    assert card.versions["transformer"] == 6 and card.versions["critic"] == 3  # critic accumulates 2
    assert card.versions["text_encoder"] == 0 and card.versions["vae"] == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step=2.ckpt", "step=4.ckpt", "step=6.ckpt"]
    logged = trainer.callback_metrics
    assert "train/grad_norm/transformer" in logged and "train/grad_norm/critic" in logged
    assert logged["train/version/critic"] == 3.0


def test_generator_step_keeps_text_encoder_cache(tiny_card):
    """A generator update bumps only its version; the frozen encoder's cached embeddings survive."""
    module = Finetune(wan_card(), caption_dropout=0.0)
    module.configure_model()
    dm = SyntheticVideos(num_samples=8, batch_size=4)
    quick_trainer(max_steps=2).fit(module, dm)  # epoch 0: 2 batches, 8 prompts encoded
    card = module.card
    keys = card.cache.keys_of("text_encoder")
    assert len(keys) == 8 and all(version == 0 for _, version, _ in keys)
    misses = card.cache.misses
    quick_trainer(max_steps=2).fit(module, dm)  # a new trainer, same 8 prompts again: all hits
    assert card.cache.misses == misses
    assert card.versions["transformer"] == 4 and card.versions["text_encoder"] == 0


def test_ema_sync_plan_versions_and_blend():
    module = Finetune(wan_card(lr=1e-2), caption_dropout=0.0, ema_decay=0.5)
    module.configure_model()
    card = module.card
    quick_trainer(max_steps=3).fit(module, SyntheticVideos(num_samples=16, batch_size=2))
    assert card.versions["transformer"] == 3 and card.versions["transformer_ema"] == 3
    p = next(card["transformer"].parameters())
    p_ema = next(card["transformer_ema"].parameters())
    assert not torch.equal(p, p_ema) and not p_ema.requires_grad
    assert module.serving_transformer == "transformer_ema"
    assert "train/loss/transformer" in module.trainer.callback_metrics
    assert_one_metric_scheme(module.trainer.callback_metrics, card)


def test_per_expert_scheduler_steps_with_its_optimizer():
    """StepLR(γ=0.5) on the generator: after 3 generator steps its lr is lr0/8, logged per expert."""
    card = wan_card(lr=1e-3)
    card.specs["transformer"].scheduler = lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    module = Finetune(card, caption_dropout=0.0)
    trainer = quick_trainer(max_steps=3)
    trainer.fit(module, SyntheticVideos(num_samples=16, batch_size=2))
    assert module.optimizer_of("transformer").param_groups[0]["lr"] == pytest.approx(1e-3 / 8)
    assert trainer.callback_metrics["train/lr/transformer"] == pytest.approx(1e-3 / 8)


def test_cache_encodes_a_group_once():
    """K copies of one prompt in a call: one encode (a miss), K-1 hits; the rows are identical."""
    from posttrain.modules.models.cache import EmbeddingCache

    cache, calls = EmbeddingCache(), []

    def encode(texts):
        calls.append(list(texts))
        return torch.randn(len(texts), 3, 2)

    rows = cache.get_or_compute("text_encoder", 0, ["a", "a", "a", "b"], encode)
    assert calls == [["a", "b"]] and (cache.hits, cache.misses) == (2, 2)
    assert torch.equal(rows[0], rows[2]) and not torch.equal(rows[0], rows[3])
    cache.get_or_compute("text_encoder", 1, ["a"], encode)  # a new encoder version: encoded again
    assert calls[-1] == ["a"] and cache.invalidate("text_encoder", keep_version=1) == 2


def test_concept_mixing_puts_the_concept_in_its_fraction_and_leaves_the_default_data_alone():
    """concept=[magenta], concept_fraction=f: ⌊n·f⌋ of the first n indices show magenta (here 24 of 64 at
    f = 3/8, spread evenly: every 8 consecutive indices hold 3), the others never do, and a shuffled epoch of
    batches carries exactly those 24; without the options the data is what it always was (captions pinned)."""
    mixed = SyntheticVideos(num_samples=64, frames=1, height=8, width=8, batch_size=8, concept=["magenta"],
                            concept_fraction=3 / 8)
    epoch = list(mixed.train_dataloader())
    prompts = [p for batch in epoch for p in batch["prompt"]]
    assert len(prompts) == 64 and sum("magenta" in p for p in prompts) == 24
    data = mixed.train_dataset()
    flags = ["magenta" in data[i]["prompt"] for i in range(64)]
    assert all(sum(flags[i:i + 8]) == 3 for i in range(0, 64, 8))  # even spread, not a block at the end
    assert [data.shows_concept(i) for i in range(64)] == flags
    plain = SyntheticVideos(seed=0).train_dataset()
    assert [plain[i]["prompt"] for i in range(4)] == [
        "a blue triangle moving left on a cyan background", "a green circle moving left on a cyan background",
        "a red triangle moving left on a yellow background", "a magenta square moving down on a yellow background"]
    assert plain.shows_concept(0) is None
    with pytest.raises(ValueError, match="come together"):
        SyntheticVideos(concept=["magenta"])
    with pytest.raises(ValueError, match=r"concept_fraction=1.5 must be in \[0, 1\]"):
        SyntheticVideos(concept=["magenta"], concept_fraction=1.5)


def test_results_bench_seeds_and_zero_lr_control():
    """bench/seeds.py (experiments/results.py's runs): a seed reaches the run's three RNGs, the control zeroes every
    optimizer's lr of a config (finetune's transformer; joint_rl's transformer and refiner template) and the CLI takes
    it, and a cell reads before → after (one seed) or before → mean [min, max] (several)."""
    import os
    import sys
    from unittest import mock

    from bench import seeds
    from posttrain.lit.tools.config import PosttrainCLI

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    assert seeds.seed_overrides(2) == ["--seed_everything=2", "--data.init_args.seed=2",
                                       "--model.init_args.run.seed=2"]
    finetune = os.path.join(root, "configs", "finetune.yaml")
    control = seeds.zero_lr_overrides(finetune)
    assert control == ["--model.init_args.card.experts.transformer.optimizer.init_args.lr=0.0"]
    assert seeds.zero_lr_overrides(os.path.join(root, "configs", "joint_rl.yaml")) == [
        "--model.init_args.card.experts.transformer.optimizer.init_args.lr=0.0",
        "--model.init_args.card.refiner.optimizer.init_args.lr=0.0"]
    with mock.patch.object(sys, "argv", sys.argv[:1]):
        cli = PosttrainCLI(args=["--config", finetune, *control, *seeds.seed_overrides(2)], run=False)
    optimizer = cli.model.card.specs["transformer"].optimizer([torch.nn.Parameter(torch.zeros(1))])
    assert optimizer.param_groups[0]["lr"] == 0.0 and cli.datamodule.seed == 2 and cli.model.run.seed == 2
    assert seeds.cell(0.5, [0.6]) == "0.500 → 0.600"
    assert seeds.cell(0.5, [0.8, 0.6, 0.7]) == "0.500 → 0.700 [0.600, 0.800]"


def test_exclude_captions_holds_an_evaluations_captions_out():
    """exclude_captions: no sample of any split has one of them (here the 3 magenta captions the first 40 mixed
    samples show most), the others stay what they were; a string that is not a world caption is refused."""
    from collections import Counter

    mixed = dict(frames=1, height=8, width=8, concept=["magenta"], concept_fraction=0.5)
    plain = SyntheticVideos(num_samples=40, **mixed).train_dataset()
    prompts = [plain[i]["prompt"] for i in range(40)]
    held = [p for p, _ in Counter(p for p in prompts if "magenta" in p).most_common(3)]
    data = SyntheticVideos(num_samples=40, exclude_captions=held, **mixed)
    kept = data.train_dataset()
    assert not any(kept[i]["prompt"] in held for i in range(40))
    assert all(kept[i]["prompt"] == p for i, p in enumerate(prompts) if p not in held)
    assert sum("magenta" in kept[i]["prompt"] for i in range(40)) == 20  # the mixing holds
    assert not any(b in held for batch in data.val_dataloader() for b in batch["prompt"])
    with pytest.raises(ValueError, match="exclude_captions: .*'a red blob moving left on a blue background'.* are "
                                         "not captions of the world"):
        SyntheticVideos(exclude_captions=["a red blob moving left on a blue background"])
