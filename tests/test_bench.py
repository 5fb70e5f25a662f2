"""Benchmarks that hold on a noisy machine, and the fit loop's per-iteration savings.

- ``bench/timing.py``: the median's interval, the "too noisy" verdict and the goal verdict on hand-made
  block timings; blocks refuse to be recorded out of turn.
- ``ExpertModule.log``: skipping per-iteration metrics in iterations whose metrics reach no logger
  changes nothing a logger receives, and saves the calls.
- ``SyncPlan``'s fused lerp equals the per-tensor lerp.
- Every bench and experiment runs end to end at a tiny size, as its command runs it from the repository root
  (``python -m bench.<name>``, ``python -m experiments.<name>``); the measures they share are checked in ``bench/``.
"""
from __future__ import annotations

import copy
import os

import pytest
import torch
from lightning.pytorch import Callback, LightningModule
from lightning.pytorch.loggers import Logger

import launch
from bench import timing
from posttrain.modules.models.versions import SyncPlan, constant
from posttrain.datamodules.synthetic import SyntheticVideos
from posttrain.lit.base import ExpertModule
from posttrain.lit.finetune import Finetune
from tests.conftest import wan_card
from tests.helpers import quick_trainer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------------- timing.py
def blocks_of(baseline: list[float], candidate: list[float]) -> timing.Blocks:
    """Alternating blocks with these seconds per item (wall = cpu)."""
    out = timing.Blocks("base", "cand")
    for k, c in enumerate(candidate):
        out.record("base", baseline[k], baseline[k], 1)
        out.record("cand", c, c, 1)
    out.record("base", baseline[-1], baseline[-1], 1)
    return out


@pytest.mark.slow
def test_median_interval_order_statistics():
    """n = 20: P(Binomial(20, 1/2) <= 5) = 21700/2^20 = 0.0207, so the 6th smallest and 6th largest
    bound the median with 1 - 2·0.0207 = 0.9586 >= 95% (the 7th would give 0.885)."""
    lo, hi, coverage = timing.median_interval([float(i) for i in range(1, 21)])
    assert (lo, hi) == (6.0, 15.0)
    assert coverage == pytest.approx(1 - 2 * 21700 / 2**20)
    # below 6 values no interval reaches 95%: min-max, with its true coverage 1 - 2/2^n
    lo, hi, coverage = timing.median_interval([3.0, 1.0, 2.0, 5.0, 4.0])
    assert (lo, hi, coverage) == (1.0, 5.0, pytest.approx(1 - 2 / 32))


@pytest.mark.slow
def test_paired_ratio_brackets_each_candidate_block():
    """Baseline drifts 10 -> 12 -> 14; candidate 11 and 13 sit exactly on the drift: ratios 1, 1."""
    b = blocks_of([10.0, 12.0, 14.0], [11.0, 13.0])
    assert timing.paired_ratios(b, "wall") == [1.0, 1.0]


@pytest.mark.slow
def test_verdict_says_too_noisy_when_the_interval_holds_one():
    # ratios 0.8, 1.3, 0.9, 1.2, 1.0, 1.25, 0.85: median 1.0, noise +-30%
    cand = [0.8, 1.3, 0.9, 1.2, 1.0, 1.25, 0.85]
    c = timing.compare(blocks_of([1.0] * 8, cand), goal=1.03)
    assert not c.ratios["wall"].resolved
    verdict = c.verdict("wall")
    assert "too noisy" in verdict and "undecided" in verdict and "= " not in verdict.split(";")[0]


@pytest.mark.slow
def test_verdict_gives_ratio_and_goal_when_resolved():
    cand = [1.10, 1.12, 1.11, 1.13, 1.09, 1.10, 1.12]  # all above 1: resolved, and above 1.03: missed
    c = timing.compare(blocks_of([1.0] * 8, cand), goal=1.03)
    assert c.ratios["wall"].resolved and c.ratios["wall"].median == pytest.approx(1.11)
    assert "= 1.110" in c.verdict("wall") and "missed" in c.verdict("wall")
    c = timing.compare(blocks_of([1.0] * 8, [1.01, 1.02, 1.01, 1.02, 1.015, 1.01, 1.02]), goal=1.03)
    assert "met" in c.verdict("wall")
    # higher is better (a speed-up): 5.8-6.2 straddles 6
    c = timing.compare(blocks_of([1.0] * 8, [5.8, 6.1, 6.2, 5.9, 6.0, 6.05, 5.95]), goal=6.0, higher_is_better=True)
    assert "undecided" in c.verdict("wall")


@pytest.mark.slow
def test_blocks_refuse_out_of_turn():
    b = timing.Blocks("base", "cand")
    with pytest.raises(RuntimeError, match="out of turn"):
        b.record("cand", 1.0, 1.0, 1)
    b.record("base", 1.0, 1.0, 1)
    with pytest.raises(RuntimeError, match="'cand' is next"):
        b.record("base", 1.0, 1.0, 1)


@pytest.mark.slow
def test_interleave_alternates_and_counts():
    calls: list[str] = []
    b = timing.interleave(lambda: calls.append("b"), lambda: calls.append("c"), blocks=3, per_block=2, warmup=1)
    assert calls == ["b", "c"] + ["b", "b", "c", "c"] * 3 + ["b", "b"]
    assert b.order == ["base", "cand"] * 3 + ["base"] or b.order == ["baseline", "candidate"] * 3 + ["baseline"]
    assert len(b.samples[b.baseline]) == 4 and len(b.samples[b.candidate]) == 3


# ---------------------------------------------------------------------- per-iteration logging
class Recorder(Logger):
    """Everything that reaches a logger: (step, metrics) per call."""

    def __init__(self):
        super().__init__()
        self.rows: list[tuple[int, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "recorder"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        self.rows.append((step, {k: float(v) for k, v in metrics.items()}))


class Sporadic(Callback):
    """Logs ``train/sporadic`` in iterations 2 and 7 only, neither of them one whose metrics reach a logger
    (as LogProbParityCheck logs every n-th iteration): Lightning hands the loggers its latest value at the next one."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx in (2, 7):
            pl_module.log("train/sporadic", float(batch_idx), on_step=True)


def finetune_logged(monkeypatch, gate: bool, iterations: int = 12, every: int = 5):
    """(what the logger got, Lightning log calls, final callback metrics) of a short finetune with EMA."""
    calls = []
    original = LightningModule.log

    def counting(self, name, *args, **kwargs):
        calls.append(name)
        return original(self, name, *args, **kwargs)

    monkeypatch.setattr(LightningModule, "log", counting)
    if not gate:
        monkeypatch.setattr(ExpertModule, "log_due", property(lambda self: True))
    torch.manual_seed(0)
    module = Finetune(wan_card(), ema_decay=0.9)
    recorder = Recorder()
    trainer = quick_trainer(max_steps=iterations, logger=recorder, log_every_n_steps=every, callbacks=[Sporadic()])
    trainer.fit(module, SyntheticVideos(num_samples=32, batch_size=2))
    monkeypatch.undo()
    return recorder.rows, calls, {k: float(v) for k, v in trainer.callback_metrics.items()}


@pytest.mark.slow
def test_skipped_logs_change_nothing_a_logger_gets(monkeypatch, one_thread):
    """12 iterations, log_every_n_steps=5: the logger gets the same steps and values either way, a metric
    logged in other iterations too; Lightning's log runs in iterations 5, 10 and 12 (the last) only."""
    rows, calls, final = finetune_logged(monkeypatch, gate=True)
    rows_all, calls_all, final_all = finetune_logged(monkeypatch, gate=False)
    assert [step for step, _ in rows_all] == [4, 9]  # Lightning's steps are 0-based
    assert rows == rows_all
    assert "train/loss/transformer" in rows[0][1] and "train/version/transformer_ema" in rows[0][1]
    assert rows[0][1]["train/sporadic"] == 2.0 and rows[1][1]["train/sporadic"] == 7.0
    assert final == final_all and final["train/version/transformer"] == 12.0
    per_iteration = (len(calls_all) - 2) / 12
    assert per_iteration == 8  # loss, cache hit rate, grad norm, lr, 4 versions
    assert len(calls) == 3 * per_iteration + 2, calls  # + the two sporadic values, each logged once


@pytest.mark.slow
def test_logs_outside_training_steps_are_never_skipped(monkeypatch, one_thread):
    """Validation metrics (on_epoch) reach callback_metrics whatever the iteration."""
    module = Finetune(wan_card(), ema_decay=None)
    trainer = quick_trainer(max_steps=3, log_every_n_steps=50, limit_val_batches=1, val_check_interval=3)
    trainer.fit(module, SyntheticVideos(num_samples=16, val_samples=4, batch_size=2))
    assert "val/loss" in trainer.callback_metrics and "train/loss/transformer" in trainer.callback_metrics


# ---------------------------------------------------------------------- sync plans
@pytest.mark.slow
@pytest.mark.parametrize("decay", [0.0, 0.9])
def test_fused_sync_plan_equals_per_tensor_lerp(decay):
    card = wan_card()
    card.build()
    ema = card.add_role("ema", of="transformer")
    with torch.no_grad():
        for p in card["transformer"].parameters():
            p.add_(torch.randn_like(p))
    expected = {n: t.lerp(dict(card["transformer"].named_parameters())[n], 1 - decay)
                for n, t in card[ema].named_parameters()}
    assert SyncPlan("transformer", ema, constant(decay)).apply(card, 1)
    got = dict(card[ema].named_parameters())
    assert all(torch.equal(got[n], expected[n]) for n in expected)
    if decay == 0.0:
        assert all(torch.equal(got[n], p) for n, p in card["transformer"].named_parameters())


@pytest.mark.slow
def test_sync_plan_follows_a_module_the_card_replaced():
    """The plan resolves its tensor pairs once per pair of modules: a second apply writes into the same EMA, and
    after the card holds a new EMA module the plan writes into that one, not into the old module's tensors."""
    card = wan_card()
    card.build()
    ema = card.add_role("ema", of="transformer")
    plan = SyncPlan("transformer", ema, constant(0.0))
    assert plan.apply(card, 1) and plan.apply(card, 2)
    old = card.models[ema]
    card.models[ema] = copy.deepcopy(old)
    with torch.no_grad():
        for p in card["transformer"].parameters():
            p.add_(1.0)
    old_before = {n: t.clone() for n, t in old.state_dict().items()}
    assert plan.apply(card, 3)
    assert all(torch.equal(t, dict(card["transformer"].named_parameters())[n])
               for n, t in card.models[ema].named_parameters())
    assert all(torch.equal(t, old_before[n]) for n, t in old.state_dict().items())


# ---------------------------------------------------------------------- noise_scale.py
@pytest.mark.slow
def test_gradient_noise_scale_recovers_a_known_one():
    """Gradients g_i = G + unit noise in P dimensions have B = P / |G|² exactly: the estimate lands near it, its
    interval holds it, the cosine of two draws is about 1 / (1 + B), and pure noise gives an interval open to ∞."""
    from bench.noise_scale import gram_of, interval, mean_cosine, noise_scale

    gen = torch.Generator().manual_seed(0)
    P = 4000
    G = torch.randn(P, generator=gen, dtype=torch.float64) * 0.1  # |G|² ≈ 40: B ≈ 100
    true_B = P / (G ** 2).sum().item()
    grads = G + torch.randn(200, P, generator=gen, dtype=torch.float64)
    gram = gram_of(grads.float(), rows=64)  # float32 gradients, as experiments/gradient_noise.py keeps them
    B, trace, _ = noise_scale(gram)
    low, high = interval(gram)
    assert trace == pytest.approx(P, rel=0.02)
    assert B == pytest.approx(true_B, rel=0.25) and low <= true_B <= high < 2 * true_B
    assert mean_cosine(gram) == pytest.approx(1 / (1 + true_B), rel=0.3)
    # the closed-form leave-one-out equals recomputing without each gradient
    n = 30
    small = gram_of(grads[:n])
    drop = [noise_scale(small[keep][:, keep])[2]
            for keep in (torch.tensor([j for j in range(n) if j != i]) for i in range(n))]
    se = (((torch.tensor(drop) - torch.tensor(drop).mean()) ** 2).sum() * (n - 1) / n).sqrt().item()
    _, trace30, signal30 = noise_scale(small)
    assert interval(small)[0] == pytest.approx(trace30 / (signal30 + 2 * se), rel=1e-6)
    noise = torch.randn(40, P, generator=gen, dtype=torch.float64)
    assert interval(gram_of(noise))[1] == float("inf")


# ---------------------------------------------------------------------- the benches run
def run_bench(name: str, *args: str, timeout: int = 600) -> str:
    """``python -m name *args`` from the repository root (``bench.overhead``, ``experiments.distill``)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline")
    result = launch.module(name, *args, cwd=ROOT, env=env, timeout=timeout)
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


@pytest.mark.slow
def test_overhead_bench_runs(tmp_path):
    out = run_bench("bench.overhead", "--blocks", "3", "--per-block", "2", "--warmup", "2",
                    "--workdir", str(tmp_path))
    assert "3 fit blocks between 4 plain blocks" in out
    assert out.count("verdict:") == 2 and "goal <= 1.03" in out


@pytest.mark.slow
def test_rollout_bench_runs():
    out = run_bench("bench.rollout", "--group-sizes", "2", "--blocks", "2", "--steps", "2", "--iterations", "4")
    assert "speed-up K=2 (sequential/batched)" in out and "forward of 2 rows" in out
    assert "hit rate" in out  # the cache part ran


@pytest.mark.slow
def test_memory_bench_runs():
    import socket

    with socket.socket() as s:  # a free port, not a fixed one another job on the machine may hold
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = run_bench("bench.memory", "--layers", "1", "--heads", "2", "--head_dim", "32", "--blocks", "2",
                    "--steps", "1", "--port", str(port))
    assert "memory ratio ZeRO-3 / DDP" in out and "step time ZeRO-3/DDP" in out


@pytest.mark.slow
def test_distill_bench_runs():
    out = run_bench("experiments.distill", "--steps", "2", "--prompts", "8", "--batch", "4", "--blocks", "1")
    assert "time student/teacher" in out
    assert "| teacher = student before training |" in out and "| student after 2 iterations of DMD2 |" in out


@pytest.mark.slow
def test_first_frame_bench_runs():
    out = run_bench("experiments.first_frame", "--prompts", "1")
    assert "1 prompts; chunks of 1 latent frame(s)" in out
    assert "per-channel mean, student's first latent frame:" in out and "first pixel frame" in out


@pytest.mark.slow
def test_decode_bench_runs():
    out = run_bench("bench.decode", "--batch", "1", "--blocks", "1", "--per-block", "1")
    assert "largest pixel difference" in out and "channels_last / stored" in out and "linalg_vector_norm" in out


@pytest.mark.slow
def test_cache_fill_bench_runs():
    """One process and two fill the same cache (the bench asserts every entry, once each) and the ratio is said."""
    out = run_bench("bench.cache_fill", "--clips", "4", "--frames", "5", "--size", "32", "--blocks", "1")
    assert "latents cache of 4 clips of 5 x 32 x 32" in out and "two processes / one" in out


@pytest.mark.slow
def test_optimizer_bench_runs():
    out = run_bench("bench.optimizer", "--tiny", "--blocks", "1", "--per-block", "1")
    assert "fused/default" in out and "largest difference" in out


@pytest.mark.slow
def test_distill_bench_students_rows(tmp_path):
    """``--students``: a row per student step count on held-out prompts, and the sheet."""
    sheet = tmp_path / "students.png"
    out = run_bench("experiments.distill", "--students", "1", "2", "--steps", "1", "--prompts", "4", "--batch", "4",
                    "--blocks", "1", "--grid", str(sheet))
    assert "held-out prompts" in out and out.count("| 1 | ") == 1 and out.count("| 2 | ") == 1
    assert sheet.is_file()


@pytest.mark.slow
def test_distill_bench_times_channels_last_alone():
    """``--channels-last --time-only``: both timings and the channels-last line, no fit and no scores."""
    out = run_bench("experiments.distill", "--students", "2", "--prompts", "2", "--batch", "2", "--blocks", "1",
                    "--channels-last", "--time-only")
    assert "VAE channels-last" in out and "| 2 | " in out and "| – | – | – | – |" in out and "steps, seed 0:" not in out


@pytest.mark.slow
def test_reward_server_bench_runs():
    out = run_bench("bench.reward_server", "--reward", "ColourAlignment", "--batch", "4", "--blocks", "1",
                    "--per-block", "1", "--iterations", "1")
    assert "remote/local time per batch (wall)" in out and "videos/s" in out
    assert "of which waiting on the reward server" in out


@pytest.mark.slow
def test_gpu_bench_tiny_runs_every_part(tmp_path):
    """The prepared GPU check at its tiny size on the CPU: every part yields figures, none an error."""
    import json

    out_file = tmp_path / "gpu.json"
    out = run_bench("bench.gpu", "--tiny", "--out", str(out_file))
    assert "flow_grpo step, K=8" in out
    figures = json.loads(out_file.read_text())
    for part in ("fewstep", "plain", "zero3", "offload", "rl", "causal", "attention"):
        assert "error" not in figures[part], figures[part]
    assert figures["plain"]["seconds_per_iteration"] > 0 and figures["plain"]["model_tflops_per_iteration"] > 0
    assert figures["plain"]["params"] == pytest.approx(0.2e6, rel=0.5)  # the tiny shape, not 1.3B
    assert figures["zero3"]["estimate_model_state_bytes"] > 0
    assert set(figures["rl"]["seconds"]) == {"rollout", "decode", "update"}
    causal = figures["causal"]
    assert causal["chunks"] == causal["latent_frames"] > 1 and 0 < causal["fps_with_decode"] < causal["fps"]
    assert figures["attention"]["kernels"], "the profiler saw no attention kernel"
    few = figures["fewstep"]
    assert few["latent_shape"] == [16, 3, 4, 4]  # 9x32x32 through the 8x VAE of --tiny
    import yaml  # the teacher as configs/dmd2.yaml samples it, read from the config, not restated by the bench

    with open(os.path.join(ROOT, "configs", "dmd2.yaml")) as f:
        teacher = yaml.safe_load(f)["model"]["init_args"]["teacher_sampler"]["init_args"]
    assert few["teacher"]["steps"] == teacher["num_steps"]
    assert few["teacher"]["guidance_scale"] == teacher["guidance_scale"]
    for n in (1, 2, 4):  # figures, not timings checked: the speed-ups are the bench's to report
        student = few[f"student_{n}"]
        assert student["steps"] == n and student["seconds"] > 0 and 0 < student["decode_share"] < 1
        assert student["speedup"] == pytest.approx((few["teacher"]["seconds"] + few["decode_seconds"])
                                                   / (student["seconds"] + few["decode_seconds"]))


@pytest.mark.slow
def test_a_metric_logged_between_logging_iterations_reaches_callback_metrics_at_epoch_end(one_thread):
    """Iteration 2 of a 4-batch epoch logs, log_every_n_steps=50: Lightning kept that value in
    callback_metrics through the epoch's end, so the deferred value is logged at the epoch's last batch."""

    class Once(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if trainer.current_epoch == 0 and batch_idx == 2:
                pl_module.log("train/once", 2.0, on_step=True)

    module = Finetune(wan_card(), ema_decay=None)
    trainer = quick_trainer(max_steps=6, log_every_n_steps=50, callbacks=[Once()])
    trainer.fit(module, SyntheticVideos(num_samples=8, batch_size=2))  # 4 batches per epoch
    assert trainer.callback_metrics["train/once"] == 2.0


@pytest.mark.slow
def test_gradient_noise_bench_runs():
    """experiments/gradient_noise.py on both shipped caption-RL configs at learning rate 0, 6 iterations each."""
    out = run_bench("experiments.gradient_noise", "--iterations", "6", "--set", "trainer.log_every_n_steps=1")
    assert "flow_grpo: noise scale in rollouts" in out
    for config in ("diffusion_nft", "flow_grpo"):  # gradients were recorded: steps counted, tr Σ > 0
        row = next(line for line in out.splitlines() if line.startswith(f"| {config} "))
        cells = [c.strip() for c in row.split("|")[1:-1]]
        steps, of = map(int, cells[1].split(" of "))
        assert 3 <= steps <= of == 6 and float(cells[6]) > 0, row


@pytest.mark.slow
def test_the_request_sheet_judges_the_requests_facts_and_shows_what_was_served(tmp_path):
    """``experiments/request_sheet.py``'s drawing (``bench/sheet.py`` with ``facts`` and ``served``): a request's
    video is judged against the facts the request asks (a fact it leaves out is not judged), so a request fixed by
    training and one broken by it are counted as such, whatever text was served."""
    from bench.sheet import sheet
    from posttrain.modules.world.world import Facts, render

    asked = [Facts("circle", "red", "blue", None), Facts("square", "green", None, "up"),
             Facts("triangle", "cyan", "red", "left")]
    right = torch.stack([render("circle", "red", "right", "blue", 5, 32, 32),
                         render("square", "green", "up", "yellow", 5, 32, 32),
                         render("triangle", "cyan", "left", "red", 5, 32, 32)])
    wrong = torch.stack([render("circle", "green", "right", "blue", 5, 32, 32), right[1],
                         render("triangle", "yellow", "left", "red", 5, 32, 32)])
    requests = ["a teal circle on a navy backdrop", "a jade box heading up", "a turquoise wedge moving left on red"]
    served = (["a green circle on a blue background"] * 3, ["a red circle on a blue background"] * 3)
    png = tmp_path / "sheet.png"
    fixed, broken = sheet(str(png), requests, wrong, right, facts=asked, served=served, what="held-out requests")
    assert (fixed, broken) == ([0, 2], []) and png.stat().st_size > 0
    assert sheet(str(png), requests, right, wrong, facts=asked, served=served) == ([], [0, 2])


@pytest.mark.slow
def test_distill_held_out_beyond_scores_a_smaller_caption_set_on_a_larger_ones_held_out_set():
    """experiments/distill.py --held-out-beyond N: a config on 64 training captions is scored on the held-out captions
    of one on N = 256 (the synthetic captions of a seed are a prefix of a longer draw), and never on its own."""
    from types import SimpleNamespace

    from bench import fewstep
    from posttrain.datamodules.prompts import Prompts

    small, large = Prompts(num_synthetic=64), Prompts(num_synthetic=256)
    assert large.prompt_list()[:64] == small.prompt_list()
    beyond = fewstep.held_out_prompts(SimpleNamespace(datamodule=small), 32, beyond=256)
    assert beyond == fewstep.held_out_prompts(SimpleNamespace(datamodule=large), 32)
    assert not set(beyond) & set(large.prompt_list())
    own = fewstep.held_out_prompts(SimpleNamespace(datamodule=small), 32)
    assert not set(own) & set(small.prompt_list()) and set(own) != set(beyond)
    with pytest.raises(SystemExit, match="names a prompt file or list"):
        fewstep.held_out_prompts(SimpleNamespace(datamodule=Prompts(prompts=["a red circle"])), 4, beyond=256)


@pytest.mark.slow
def test_gpu_bench_samplers_follow_the_config_they_read(tmp_path):
    """``bench/gpu.py``'s few-step part builds its teacher and student samplers from the DMD2 YAML: a copy with
    other steps, CFG and shifts gives those, not the shipped config's."""
    import yaml

    from bench import gpu

    with open(os.path.join(ROOT, "configs", "dmd2.yaml")) as f:
        config = yaml.safe_load(f)
    init = config["model"]["init_args"]
    init["teacher_sampler"]["init_args"].update(num_steps=7, guidance_scale=2.5)
    init["teacher_sampler"]["init_args"]["scheduler"]["init_args"]["shift"] = 5.0
    init["sampler"]["init_args"]["scheduler"]["init_args"]["shift"] = 2.0
    path = tmp_path / "dmd2.yaml"
    path.write_text(yaml.safe_dump(config))
    student, teacher = gpu.dmd2_samplers(str(path))
    assert (teacher.num_steps, teacher.guidance_scale, teacher.scheduler.config.shift) == (7, 2.5, 5.0)
    assert student.scheduler.config.shift == 2.0 and student.scheduler.config.stochastic_sampling


@pytest.mark.slow
def test_gan_pull_bench_follows_the_weight():
    """``experiments/gan_pull.py``: a row per GAN weight from the fits' logged ``train/gan_to_dmd_grad``; the first
    student iteration of both fits is the same forward, so the ratio follows the weight (×100 for 100 times it)."""
    out = run_bench("experiments.gan_pull", "--steps", "1", "--weights", "3e-3", "3e-1")
    rows = [line for line in out.splitlines() if line.startswith("| 0.")]
    assert len(rows) == 2 and "×1.0 (weight ×1)" in rows[0] and "×100.0 (weight ×100)" in rows[1], out


# ---------------------------------------------------------------------- experiments/distill.py --join
@pytest.mark.slow
def test_distill_join_bootstraps_the_students_ratio_to_the_teacher(tmp_path, capsys):
    """``--join`` of per-seed ``--json`` files: a student that shows every prompt the teacher shows reads ratio 1 with
    every draw at or above the 0.95 line; one that shows half the prompts reads 0.5 / 0.9 with none; the interval
    brackets the ratio; the breakdown by what the prompts ask gives each side's share; against a baseline that shows
    half, the difference is +0.4 with every draw above 0. Files scored on other prompts, and files of another kind,
    are refused by name."""
    import json

    from bench import fewstep

    prompts = [f"a red circle moving left on a green background {i}" for i in range(40)]
    teacher = [1.0] * 36 + [0.0] * 4
    half = [1.0 if i % 2 else 0.0 for i in range(40)]
    paths = []
    for seed, (good, bad) in enumerate([(teacher, half), (teacher, half)]):
        path = tmp_path / f"{seed}.json"
        path.write_text(json.dumps({"prompts": prompts, "teacher": teacher, "students": {
            "2": {"before": [0.0] * 40, "after": {str(seed): good}},
            "1": {"before": [0.0] * 40, "after": {str(seed): bad}}}}))
        paths.append(str(path))
    fewstep.join(paths, draws=2000)
    out = capsys.readouterr().out
    one, two = [line for line in out.splitlines() if line.startswith(("| 1 |", "| 2 |"))]
    assert two.startswith("| 2 | 0 1 | 0.000 → 0.900 [0.900, 0.900] | 1.000 [1.000, 1.000] | 100% |"), two
    ratio, interval = one.split(" | ")[3].split(" [")
    low, high = map(float, interval.rstrip("]").split(", "))
    assert abs(float(ratio) - 0.5 / 0.9) < 1e-3 and low < float(ratio) < high and high < 0.95, one
    assert one.endswith("| 0% |"), one
    assert "- shape: circle (40): 0.900 / 1-step 0.500 / 2-step 0.900" in out  # by what the prompts ask
    base = tmp_path / "base.json"  # a baseline whose 2-step student shows half the prompts
    base.write_text(json.dumps({"prompts": prompts, "teacher": teacher, "students": {
        "2": {"before": [0.0] * 40, "after": {"7": half}}}}))
    fewstep.join(paths, draws=2000, baseline=[str(base)])
    out = capsys.readouterr().out
    assert "| 2 | 7 | 0.500 | +0.400 [+0." in out and out.count("| 100% |") == 2, out  # and no row for 1 step
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"prompts": prompts[::-1], "teacher": teacher, "students": {}}))
    with pytest.raises(SystemExit, match="other held-out prompts"):
        fewstep.join([paths[0], str(other)])
    chunks = tmp_path / "chunks.json"  # a --per-chunk file
    chunks.write_text(json.dumps({"target": {}, "teacher_windows": [], "runs": {}}))
    with pytest.raises(SystemExit, match=r"chunks.json is not a `--students ... --json` file"):
        fewstep.join([str(chunks)])


# ---------------------------------------------------------------------- the two rooms
def python_files(folder: str) -> list[str]:
    """The .py files of a folder of the repository."""
    return [os.path.join(parent, f) for parent, _, files in os.walk(os.path.join(ROOT, folder))
            for f in sorted(files) if f.endswith(".py")]


def commands(room: str) -> list[str]:
    """``room.<name>`` of every script in ``room`` that runs as a command (it has a ``__main__`` block)."""
    return sorted(f"{room}.{os.path.basename(path)[:-3]}" for path in python_files(room)
                  if 'if __name__ == "__main__":' in open(path).read())


@pytest.mark.slow
def test_neither_room_edits_sys_path():
    """Benches and experiments run from the repository root as ``python -m``: they import ``bench`` and each other
    as packages, and neither edits ``sys.path`` (tests/test_layout.py: nothing imports ``experiments/``)."""
    files = python_files("bench") + python_files("experiments")
    assert len(files) > 20  # the walk found them
    edits = [os.path.relpath(p, ROOT) for p in files if "sys.path" in open(p).read()]
    assert not edits, edits


@pytest.mark.slow
@pytest.mark.parametrize("name", commands("bench") + commands("experiments"))
def test_every_bench_and_experiment_runs_as_its_command(name):
    """``python -m <room>.<name> --help`` from the repository root: the script imports as its command runs it (the
    package, ``bench/``'s measures, another experiment) and shows its options."""
    out = run_bench(name, "--help")
    assert out.startswith("usage: ") and "--" in out, out[:2000]
