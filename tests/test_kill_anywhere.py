"""Kill anywhere, resume, end bitwise equal: the real ``posttrain fit`` command on shrunken copies of
configs/finetune.yaml (also with a LoRA adapter), tests/configs/joint_rl_keywords.yaml (N=3) and
configs/finetune_zero.yaml (2 processes, ZeRO-2).

Each config runs once uninterrupted and once as a chain of attempts: every attempt but the last is killed (the
whole job, SIGKILL) at one moment drawn from a seeded RNG — inside a checkpoint write, right after an epoch's last
checkpoint, during the resume itself, or after some iteration — and the next attempt resumes with
``--ckpt_path last``. The final checkpoints must be equal in every file and every tensor: weights, optimizer
states (ZeRO shards included), versions, method generators, global RNGs, loop counters and data position.

``pytest tests/test_kill_anywhere.py --kills 12`` draws 12 moments per config instead of the CI set.
"""
from __future__ import annotations

import os
import random

import pytest
import yaml

import helpers_kill as hk

pytestmark = pytest.mark.timeout(3600)

# (config file, iterations, checkpoint every, batches per epoch per process, shrinking of the config)
FINETUNE = dict(frames=5, height=16, width=16)


def finetune(cfg: dict) -> None:
    cfg["model"]["init_args"]["run"] = dict(FINETUNE)
    cfg["data"]["init_args"].update(num_samples=6, val_samples=2, batch_size=2)


def joint_rl(cfg: dict) -> None:
    cfg["model"]["init_args"].update(table_every_n_iterations=4, run=dict(FINETUNE))
    cfg["model"]["init_args"]["refiners"]["max_new_tokens"] = 3
    cfg["model"]["init_args"]["grpo"]["num_samples_per_prompt"] = 2
    cfg["model"]["init_args"]["sampler"]["init_args"]["num_steps"] = 3
    cfg["data"]["init_args"].update(num_synthetic=6, batch_size=2)


def lora(cfg: dict) -> None:
    """The finetune with the transformer trained through a LoRA adapter on the shipped weights: its checkpoints hold
    the adapter, and every resume rebuilds the base from the asset."""
    finetune(cfg)
    cfg["model"]["init_args"]["card"]["experts"]["transformer"]["lora"] = {"rank": 4, "alpha": 4.0}


def zero(cfg: dict) -> None:
    finetune(cfg)
    cfg["data"]["init_args"].update(num_samples=12)  # 6 per process: 3 batches an epoch


CONFIGS = {
    "finetune": ("configs/finetune.yaml", 10, 2, 3, finetune),
    "joint_rl": ("tests/configs/joint_rl_keywords.yaml", 8, 2, 3, joint_rl),
    "lora": ("configs/finetune.yaml", 8, 2, 3, lora),
    "zero": ("configs/finetune_zero.yaml", 8, 2, 3, zero),
}
WRITE_PHASES = ["start", "bytes", "state", "manifest", "committed", "linked"]
ZERO_PHASES = ["shards", "torn"]


def write_config(root: str, name: str, config: str, steps: int, every: int, shrink, moment: str | None) -> str:
    with open(os.path.join(hk.ROOT, config)) as f:
        cfg = yaml.safe_load(f)
    shrink(cfg)
    trainer = cfg["trainer"]
    trainer.update(max_steps=steps, val_check_interval=4, check_val_every_n_epoch=None, limit_val_batches=1,
                   num_sanity_val_steps=0, enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=2)
    trainer["default_root_dir"] = os.path.join(root, name)
    callbacks = [c for c in trainer["callbacks"] if not c["class_path"].endswith("ModelCheckpoint")]
    for c in callbacks:  # samples, log-probability parity checks: every other iteration, so resumes cross them too
        if "every_n_iterations" in c.get("init_args", {}):
            c["init_args"]["every_n_iterations"] = 4
    callbacks.append({"class_path": "posttrain.callbacks.checkpoints.ModelCheckpoint",
                      "init_args": {"dirpath": os.path.join(root, name, "checkpoints"), "every_n_train_steps": every,
                                    "save_last": True, "save_top_k": -1}})
    if moment is not None:
        callbacks.append({"class_path": "helpers_kill.Chaos", "init_args": {"moment": moment}})
    trainer["callbacks"] = callbacks
    path = os.path.join(root, f"{name}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    return path


def draw_moments(rng: random.Random, steps: int, every: int, per_epoch: int, zero_config: bool,
                 kills: int | None) -> list[str]:
    """Kill moments in the order they happen. The CI set: one inside a checkpoint write, one right after an
    epoch's last checkpoint, one during a resume; ``kills`` draws that many (those three kinds first, then any).
    Iterations strictly increase, so every moment lies after the previous attempt's resume point."""
    saves = list(range(every, steps, every))  # the final save is followed by nothing to resume
    boundaries = [k for k in saves if k % per_epoch == 0]
    phases = WRITE_PHASES + (ZERO_PHASES if zero_config else [])
    if zero_config and kills is None:
        phases = ZERO_PHASES  # the CI set of the ZeRO config tears its shard files
    kinds = ["write", "boundary", "resume"]
    if kills is not None:
        kinds = (kinds + [rng.choice(["write", "iteration", "resume"]) for _ in range(kills)])[:kills]
    taken: dict[int, str] = {}
    for kind in sorted((k for k in kinds if k != "resume"), key=lambda k: k != "boundary"):
        pool = {"boundary": boundaries, "write": saves, "iteration": range(1, steps)}[kind]
        free = [k for k in pool if k not in taken]
        if free:
            step = rng.choice(free)
            taken[step] = f"write:{step}:{rng.choice(phases)}" if kind == "write" else f"iteration:{step}"
    moments = [taken[k] for k in sorted(taken)]

    def leaves_checkpoint(moment: str) -> bool:
        _, step, *phase = moment.split(":")
        return int(step) > every or (int(step) == every and (not phase or phase[0] in ("committed", "linked")))

    # a resume kill needs a checkpoint to resume: only after a moment that leaves one
    first = next(i for i, m in enumerate(moments) if leaves_checkpoint(m)) + 1
    for _ in range(kinds.count("resume")):
        moments.insert(rng.randint(first, len(moments)), f"resume:{rng.choice(['verified', 'started'])}")
    return moments


def sizes(name: str, kills: int | None) -> tuple[int, int, int]:
    """(iterations, checkpoint every, batches an epoch): longer runs for more kills."""
    _, steps, every, per_epoch, _ = CONFIGS[name]
    if kills is not None:
        steps = max(steps, every * (kills + 2))
    return steps, every, per_epoch


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_kill_anywhere_resumes_bitwise(name, tmp_path, request):
    config, _, _, _, shrink = CONFIGS[name]
    kills = request.config.getoption("--kills")
    steps, every, per_epoch = sizes(name, kills)
    moments = draw_moments(random.Random(f"{name}-{kills}"), steps, every, per_epoch, name == "zero", kills)
    root = str(tmp_path)

    straight = hk.run(write_config(root, "straight", config, steps, every, shrink, None))
    assert straight.returncode == 0, straight.stderr[-4000:]

    log = []
    for attempt, moment in enumerate(moments):
        args = ("--ckpt_path", "last") if attempt else ()
        done = hk.run(write_config(root, "killed", config, steps, every, shrink, moment), *args)
        log.append(f"{moment}: rc {done.returncode}")
        assert done.returncode != 0, f"{moment} never happened ({log}):\n{done.stderr[-3000:]}"
        assert "Traceback" not in done.stderr, f"{moment}: failed instead of being killed:\n{done.stderr[-4000:]}"
    final = hk.run(write_config(root, "killed", config, steps, every, shrink, None), "--ckpt_path", "last")
    assert final.returncode == 0, f"{log}\n{final.stderr[-4000:]}"

    a = hk.checkpoint_contents(os.path.join(root, "straight", "checkpoints", "last.ckpt"))
    b = hk.checkpoint_contents(os.path.join(root, "killed", "checkpoints", "last.ckpt"))
    assert a["lightning.pt"]["global_step"] == steps and len(a) == len(b)
    if name == "lora":  # the checkpoints hold the adapter: the base is left out, rebuilt from the asset
        held = a["lightning.pt"]["state_dict"]
        assert "transformer" in a["lightning.pt"]["posttrain"]["frozen"]
        assert any(k.startswith("card.models.transformer.") for k in held)
        assert not [k for k in held if k.startswith("card.models.transformer.") and "lora_" not in k]
    differ = hk.differences(a, b)
    assert not differ, f"after kills {moments}: {len(differ)} differences, e.g. {differ[:5]}"
    leftovers = [n for n in os.listdir(os.path.join(root, "killed", "checkpoints")) if n.startswith((".tmp-", ".old-"))]
    assert not leftovers, f"stale temporary checkpoints left: {leftovers}"
    print(f"{name}: {len(moments)} kills survived bitwise: {moments}")
