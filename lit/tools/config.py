"""Reading a config: the LightningCLI every command parses with, and what follows from a config by rule.

- ``PosttrainCLI``: LightningCLI over ``ExpertModule`` subclasses and any ``LightningDataModule``, optimizers on
  the card (none configured by Lightning), the whole config logged, a progress bar in iterations and one
  summary row per expert;
- one run folder: ``trainer.default_root_dir`` is the only setting; the W&B logger's ``save_dir`` and every
  ``ModelCheckpoint.dirpath`` default to it (``<root>/checkpoints``), and the run is named after it;
- one video size: ``model.init_args.run.{frames,height,width}`` is linked into a video datamodule;
- W&B runs: a resumed fit continues the checkpoint's W&B run (its id travels in the checkpoint's manifest);
  validate and predict runs are tagged by ``job_type`` and grouped with the fit run;
- nothing written before the launch is accepted: the loggers are held (no W&B run, no folder) and ``config.yaml``
  waits until the run starts, after the config is parsed, the model built and a checkpoint restored, so a launch
  refused at start-up leaves the run folder as it was (``LoggedConfig``);
- ``--ckpt_path last`` with nothing to resume names the (absolute) folder it looked in and starts a new run;
- ``--preset tiny``: a real-model recipe at the embedded default's size;
- ``--random_weights true``: a real-model recipe at real size with random weights, without the weights' folders;
- ``--data PrecomputedVideos``: the frozen text encoders whose rows the folder holds are not loaded
  (``apply_precomputed``);
- ``parse`` / ``instantiate_part``: a fit YAML checked and one part of it built alone, for the tools
  (``estimate``, ``preprocess``) that need no trainer.
"""
from __future__ import annotations

import functools
import importlib
import inspect
import json
import os
import sys
from dataclasses import asdict
from typing import Any, Literal, Optional
from unittest import mock

import yaml
from jsonargparse import Namespace
from lightning.pytorch import LightningDataModule
from lightning.pytorch.cli import LightningCLI, SaveConfigCallback
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning.pytorch.utilities.seed import isolate_rng

import posttrain.callbacks  # noqa: F401  (short class names in YAML: SampleVideos, LogProbParityCheck, ...)
import posttrain.datamodules  # noqa: F401
import posttrain.lit  # noqa: F401  (the methods, for `model: {class_path: Finetune}`)
from posttrain.callbacks.progress import ExpertSummary, IterationProgressBar
from posttrain.lit.base import ExpertModule, RunArgs
from posttrain.modules.models import presets


class LoggedConfig(SaveConfigCallback):
    """Writes ``config.yaml`` beside the run and puts the whole config into the loggers (W&B config), once the
    launch is accepted: when the run starts (its sanity check, training, validation or prediction), after the
    config is parsed, the model built and a checkpoint verified and restored. Until then the loggers are held
    (``WandbLogger.hold``): a launch refused at start-up starts no W&B run and leaves the run folder as it was."""

    def setup(self, trainer, pl_module, stage: str) -> None:
        pass  # nothing is written before the run starts

    def on_sanity_check_start(self, trainer, pl_module) -> None:
        self._start(trainer, pl_module)

    def on_train_start(self, trainer, pl_module) -> None:
        self._start(trainer, pl_module)

    def on_validation_start(self, trainer, pl_module) -> None:
        self._start(trainer, pl_module)

    def on_predict_start(self, trainer, pl_module) -> None:
        self._start(trainer, pl_module)

    def _start(self, trainer, pl_module) -> None:
        if self.already_saved:
            return
        with isolate_rng():  # the training's random streams are the same whether W&B starts here or not
            for logger in trainer.loggers:
                if hasattr(logger, "release"):
                    logger.release()
        # config.yaml is written by ``parser.save``, which would validate again the config validated when parsed
        with mock.patch.object(self.parser, "save", functools.partial(self.parser.save, skip_validation=True)):
            super().setup(trainer, pl_module, trainer.state.fn)

    def save_config(self, trainer, pl_module, stage: str) -> None:
        for logger in trainer.loggers:
            logger.log_hyperparams(self.config.as_dict())


class PosttrainCLI(LightningCLI):
    def __init__(self, args: Optional[list[str]] = None, exit_on_error: bool = True, **kwargs):
        kwargs.setdefault("parser_kwargs", {"exit_on_error": exit_on_error})
        super().__init__(
            model_class=ExpertModule, subclass_mode_model=True,
            datamodule_class=LightningDataModule, subclass_mode_data=True,
            save_config_callback=LoggedConfig, save_config_kwargs={"overwrite": True},
            auto_configure_optimizers=False,  # every expert's optimizer is on the card
            args=args, **kwargs,
        )

    def init_parser(self, **kwargs: Any):
        # argparse takes a unique prefix of an option for the option: `--trainer.max_step 3` would set max_steps and
        # `--seed_everythin 3` the seed, silently. A key is spelt out, or refused with the closest valid one.
        kwargs.setdefault("allow_abbrev", False)
        return super().init_parser(**kwargs)

    def parse_arguments(self, parser, args) -> None:
        if args is None:
            return super().parse_arguments(parser, args)
        saved = sys.argv  # given `args`, the process's own argv (e.g. pytest's) is not the command line
        sys.argv = saved[:1]
        try:
            super().parse_arguments(parser, args)
        finally:
            sys.argv = saved

    def before_fit(self) -> None:
        trainer = self.trainer
        if trainer.max_steps == 0 or trainer.max_epochs == 0:
            raise ValueError(f"trainer.max_steps={trainer.max_steps}, max_epochs={trainer.max_epochs}: this run would "
                             f"train nothing; set trainer.max_steps to the iterations to train (or -1 with max_epochs)")
        self._resolve_last("fit")

    def before_validate(self) -> None:
        self._resolve_last("validate")

    def before_predict(self) -> None:
        self._resolve_last("predict")

    def _resolve_last(self, subcommand: str) -> None:
        """``--ckpt_path last`` with nothing to resume: a fit says where it looked (``runs/`` is relative to the
        working folder, so a launch from another folder finds nothing there) and starts a new run; validate and
        predict stop, as they were asked for trained weights. Lightning's own note ("no last checkpoint
        available", with a ``save_last=True`` hint that does not apply here) is not reached."""
        config = self.config_init[subcommand]
        if config.get("ckpt_path") != "last" or any(has_checkpoints(self.trainer, c)
                                                     for c in self.trainer.checkpoint_callbacks):
            return
        folders = [os.path.abspath(checkpoint_folder(self.trainer, c)) for c in self.trainer.checkpoint_callbacks]
        where = f"no checkpoint in {', '.join(folders)}" if folders else "this config writes no checkpoints"
        root = self.trainer.default_root_dir
        if folders and not os.path.isabs(root):
            where += f" (trainer.default_root_dir {root} is relative to the working folder {os.getcwd()})"
        if subcommand != "fit":
            raise ValueError(f"--ckpt_path last: {where}; give the trained run's folder as trainer.default_root_dir "
                             f"(or --ckpt_path <checkpoint>), or drop --ckpt_path to {subcommand} the config's own "
                             f"weights")
        config["ckpt_path"] = None
        if rank_zero_only.rank == 0:
            print(f"--ckpt_path last: {where}; starting a new run", file=sys.stderr, flush=True)

    def _dump_config(self) -> None:
        """LightningCLI's (the config as plain data, for the hyper-parameters its instantiator hands a class), without
        validating again the config it validated when it parsed it (half a CPU-second a process)."""
        if hasattr(self, "config_dump"):
            return
        self.config_dump = yaml.safe_load(self.parser.dump(self.config, skip_link_targets=False, skip_none=False,
                                                           skip_validation=True, format="yaml"))
        if "subcommand" in self.config:
            self.config_dump = self.config_dump[self.config.subcommand]

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        return {"fit": {"model", "train_dataloaders", "val_dataloaders", "datamodule"},
                "validate": {"model", "dataloaders", "datamodule"},
                "predict": {"model", "dataloaders", "datamodule"}}

    def add_arguments_to_parser(self, parser) -> None:
        # one video size: a datamodule with frames/height/width takes the method's (others are left alone)
        for key in VIDEO_SIZE:
            parser.link_arguments(("model.init_args.run", "data"), f"data.init_args.{key}", compute_fn=run_size(key))
        parser.add_argument("--preset", type=Optional[Literal["tiny"]], default=None,
                            help="tiny: run a real-model recipe at the embedded default's size — every expert from "
                                 "its tiny preset (the pretrained world's weights where an asset is shipped, no "
                                 "recipe weights read), one CPU process, the default video size")
        parser.add_argument("--random_weights", type=bool, default=False,
                            help="true: every expert with a `pretrained` folder is built as the published model the "
                                 "folder's name names (`published`: real size, random weights from a fixed seed; "
                                 "modules/models/published.py), its tokenizer folder used only where it exists")

    def _parse_ckpt_path(self) -> None:
        """LightningCLI reads a single-file ``ckpt_path`` itself, unverified, for hyper-parameters saved in it. A
        posttrain method saves none (the config is the YAML), so the checkpoint is read once, by the strategy
        through the one verified loader (``posttrain.modules.io.checkpoints.load``), which names a refused file in
        its own words."""

    def before_instantiate_classes(self) -> None:
        subcommand = self.config.get("subcommand")  # None when built with run=False
        config = self.config[subcommand] if subcommand else self.config
        random_weights = bool(config.get("random_weights"))
        if config.get("preset") == "tiny" and random_weights:
            raise ValueError("`--preset tiny` builds every expert from its tiny preset, `--random_weights true` at "
                             "the published model's real size: give one of the two")
        if config.get("preset") == "tiny":
            apply_tiny_preset(config)
        elif random_weights:
            apply_random_weights(config)
        apply_precomputed(config)
        seed_run(config)
        derive_run_folder(config.trainer, subcommand or "fit", config.get("ckpt_path"))

    def instantiate_trainer(self, **kwargs: Any):
        extra = [self._get(self.config_init, c) for c in self._parser(self.subcommand).callback_keys]
        config = {**self._get(self.config_init, "trainer", default={}), **kwargs}
        if config.get("enable_progress_bar", True) is not False:
            extra.append(IterationProgressBar())
        if config.get("enable_model_summary", True) is not False:
            extra.append(ExpertSummary())
        trainer = self._instantiate_trainer(config, extra)
        if any(isinstance(c, LoggedConfig) for c in trainer.callbacks):  # it releases them when the run starts
            for logger in trainer.loggers:
                if hasattr(logger, "hold"):
                    logger.hold()
        return trainer


def seed_run(config) -> None:
    """The method's noise seed (``model.init_args.run.seed``) follows ``seed_everything`` where the config gives
    none: Lightning's seed reaches the global RNGs only, and the method draws its noise from its own generators."""
    init_args = config.model.get("init_args") if config.get("model") is not None else None
    seed = config.get("seed_everything")
    if init_args is None or "run" not in init_args or isinstance(seed, bool) or seed is None:  # a model without
        return  # `run`; seed_everything False: unseeded, the run keeps its 0
    if init_args.run is None:  # the whole dataclass, as the parser holds one the config gives
        init_args.run = Namespace(**asdict(RunArgs(seed=int(seed))))
    elif init_args.run.get("seed") is None:
        init_args.run.seed = int(seed)


def checkpoint_folder(trainer, callback) -> str:
    """The folder a checkpoint callback writes to, and where ``--ckpt_path last`` looks."""
    if callback.dirpath is not None:
        return str(callback.dirpath)
    return str(callback._ModelCheckpoint__resolve_ckpt_dir(trainer))  # Lightning's (private) default folder


def has_checkpoints(trainer, callback) -> bool:
    """Whether ``--ckpt_path last`` has anything to resume from this callback's folder (nothing is verified or
    read here beyond the manifests: the resume itself does that)."""
    from posttrain.callbacks.checkpoints import ModelCheckpoint
    from posttrain.modules.io import checkpoints as ckpt

    if isinstance(callback, ModelCheckpoint):
        folder = checkpoint_folder(trainer, callback)
        return ckpt.last_target(folder) is not None or bool(ckpt.entries(folder))
    return any(os.path.exists(path) for path in callback._find_last_checkpoints(trainer))


# ---------------------------------------------------------------------- one video size
VIDEO_SIZE = ("frames", "height", "width")


def run_size(key: str):
    """The link ``model.init_args.run.<key> --> data.init_args.<key>``. jsonargparse replaces a linked init
    argument of a subclass silently, even one the YAML or the command line gives; so a data size other than both
    the run's and the datamodule's own default (it can only have been written there) is refused, with both named."""
    def video_size_of_run(run, data):
        size = _run_video_size(run)
        args = data.get("init_args") if data is not None else None
        given = {k: args[k] for k in VIDEO_SIZE if args is not None and args.get(k) is not None}
        defaults = _signature_defaults(data.class_path) if given else {}
        conflicts = [k for k, v in given.items() if v != size[k] and v != defaults.get(k)]
        if conflicts:
            data_side = ", ".join(f"data.init_args.{k}={given[k]}" for k in conflicts)
            run_side = ", ".join(f"model.init_args.run.{k}={size[k]}" for k in conflicts)
            raise ValueError(f"{data_side} but {run_side}: the video size is set once, on the method, and the data "
                             f"follows it; drop {', '.join(f'data.init_args.{k}' for k in conflicts)} and set "
                             f"{', '.join(f'model.init_args.run.{k}' for k in conflicts)} to the size you want")
        return size[key]
    video_size_of_run.__name__ = f"run_{key}"  # `--help` lists the link as run_frames(model.init_args.run, data)
    return video_size_of_run


def _run_video_size(run) -> dict[str, int]:
    """(frames, height, width) of ``model.init_args.run`` as the parser holds it: None (``RunArgs``' defaults), or
    the dataclass as its fields or as ``{class_path, init_args}``."""
    default = RunArgs()
    fields = {} if run is None else run.get("init_args", run)
    return {k: fields.get(k, getattr(default, k)) for k in VIDEO_SIZE}


def _signature_defaults(class_path: str) -> dict[str, Any]:
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
        return {k: p.default for k, p in inspect.signature(cls).parameters.items() if k in VIDEO_SIZE}
    except (ImportError, AttributeError, TypeError, ValueError):
        return {}


# ---------------------------------------------------------------------- --preset tiny
def experts_of(config) -> list:
    """The card's experts (and its refiner template) of a parsed config, as their argument namespaces."""
    def args(ns):
        return ns.init_args if "init_args" in ns else ns

    card = args(config.model.init_args.card)
    return [args(e) for e in list((card.get("experts") or {}).values()) + ([card.refiner] if card.get("refiner") else [])]


def apply_tiny_preset(config) -> None:
    """A recipe at the embedded default's size: every expert from its tiny preset, i.e. the shipped asset where
    there is one (the sources, dtypes, attention backends, swapped blocks and offloading of real weights dropped; LoRA,
    sharding stage and roles kept), one CPU process, the default video size (one frame for an image generator)
    and text length. The method, its settings and the data stay."""
    def args(ns):  # a class given as {class_path, init_args} or as its arguments
        return ns.init_args if "init_args" in ns else ns

    def assign(ns, **values):
        for key, value in values.items():
            setattr(ns, key, value)

    for expert in experts_of(config):
        assign(expert, pretrained=None, published=None, subfolder=None, tokenizer=None, preset={}, dtype="float32",
               attention_backend=None, compile=False)
        if expert.get("swap_blocks"):  # a published model's block count: the tiny preset has fewer
            expert.swap_blocks = 0
        if expert.get("zero") is not None:
            assign(args(expert.zero), offload_optimizer=False, offload_params=False, precision="fp32")
    card = args(config.model.init_args.card)
    card.text_max_length = min(card.get("text_max_length") or 64, 64)
    run = config.model.init_args.get("run")
    if run is not None:
        default = RunArgs()
        still = args(run).get("frames") == 1  # an image generator stays one frame
        assign(args(run), frames=1 if still else default.frames, height=default.height, width=default.width)
        data = args(config.data) if config.get("data") is not None else {}
        assign(data, **{k: getattr(args(run), k) for k in VIDEO_SIZE if data.get(k) is not None})  # still one size
    assign(config.trainer, accelerator="cpu", devices=1, num_nodes=1, precision="32-true")
    strategy = config.trainer.get("strategy")
    if isinstance(strategy, str):
        config.trainer.strategy = "auto"
    elif strategy is not None and args(strategy).get("sequence_parallel") is not None:
        args(strategy).sequence_parallel = 1  # one process shares its tokens with no other


# ---------------------------------------------------------------------- --random_weights true
def apply_random_weights(config) -> None:
    """A real-model recipe at real size with random weights: every expert's ``pretrained`` folder becomes the
    published model the folder's name names (``/models/Wan2.1-T2V-14B-Diffusers`` -> ``published:
    Wan2.1-T2V-14B``; an unknown name is refused listing the known ones), its ``subfolder`` kept; a ``tokenizer``
    folder that does not exist is dropped (ByT5 ids, within every published vocabulary). Asked for explicitly only:
    a missing folder without this flag stays an error."""
    from posttrain.modules.models.published import name_of_folder

    for expert in experts_of(config):
        if expert.get("pretrained") is None:
            continue
        expert.published, expert.pretrained = name_of_folder(expert.pretrained), None
        if expert.get("tokenizer") is not None and not os.path.isdir(expert.tokenizer):
            expert.tokenizer = None


# ---------------------------------------------------------------------- --data PrecomputedVideos
def apply_precomputed(config) -> list[str]:
    """With ``PrecomputedVideos`` data, ``precomputed: true`` on each frozen text encoder of the card whose rows the
    folder holds (its manifest's ``sources``, a small JSON read here; a folder without one sets nothing: ``posttrain
    estimate`` then counts the encoders loaded, and fit stops at the datamodule, which names the missing manifest)
    and whose weights a source names (a ``pretrained`` folder, the shipped asset, ``published``): it is built on
    the meta device, never loaded. An expert's own ``precomputed`` (true or false) stands; an encoder of random
    preset weights is still built, as only its weights tell whether the rows are its. Without ``PrecomputedVideos``
    an expert set ``precomputed: true`` is refused. Returns the experts set. ``posttrain fit`` / ``validate`` and the
    tools that parse a config (``estimate``) apply it alike."""
    if config.get("model") is None or "card" not in (config.model.get("init_args") or {}):
        return []
    card = config.model.init_args.card
    card = card.init_args if "init_args" in card else card
    experts = {name: (e.init_args if "init_args" in e else e) for name, e in (card.get("experts") or {}).items()}
    data = config.get("data")
    if data is None or not str(data.get("class_path", "")).endswith("PrecomputedVideos"):
        given = [name for name, e in experts.items() if e.get("precomputed")]
        if given:
            raise ValueError(f"experts {given} have precomputed: true, which reads their rows from `--data "
                             f"PrecomputedVideos --data.path <folder of posttrain preprocess>`; give that data, or "
                             f"drop precomputed")
        return []
    from posttrain.modules.io.precomputed import MANIFEST

    path = os.path.join(str(data.init_args.get("path")), MANIFEST)
    if not os.path.isfile(path):  # not written yet: sized as loaded by the tools; fit stops at the datamodule
        return []
    with open(path) as f:
        sources = json.load(f).get("sources") or {}
    chosen = []
    for name, e in experts.items():
        arch = e.get("arch")
        if name not in sources or arch not in presets.PRESETS or e.get("precomputed") is not None:
            continue
        frozen_encoder = presets.architecture(arch).kind == "text_encoder" and not e.get("trainable") \
            and e.get("lora") is None and not e.get("sharded") and e.get("init_from") is None
        named = e.get("published") is not None or presets.loads_weights(arch, e.get("pretrained"), e.get("preset"))
        if frozen_encoder and named:
            e.precomputed = True
            chosen.append(name)
    return chosen


# ---------------------------------------------------------------------- one run folder, W&B runs
def _entries(value) -> list:
    if value is None or isinstance(value, bool):
        return []
    return list(value) if isinstance(value, list) else [value]


def derive_run_folder(trainer, subcommand: str, ckpt_path: Optional[str]) -> None:
    """Fill what follows from ``trainer.default_root_dir``: the W&B logger's folder, name and run id, and
    the checkpoint folder (``<root>/checkpoints``: ``--ckpt_path last`` looks only there)."""
    root = trainer.get("default_root_dir")
    if not root:
        return
    checkpoints = os.path.join(root, "checkpoints")
    for callback in _entries(trainer.get("callbacks")):
        if "ModelCheckpoint" in str(callback.get("class_path", "")) and callback.init_args.get("dirpath") is None:
            callback.init_args.dirpath = checkpoints
    for logger in _entries(trainer.get("logger")):
        if "Wandb" not in str(logger.get("class_path", "")):
            continue
        args = logger.init_args
        if args.get("save_dir") in (None, "."):
            args.save_dir = root
        name = args.get("name") or os.path.basename(os.path.normpath(root))
        args.name = name if subcommand == "fit" else f"{name}-{subcommand}"
        args.job_type = subcommand
        run = wandb_run_of(ckpt_path, checkpoints)
        if run and subcommand == "fit":
            args.id = run  # a resumed fit continues its W&B run
        elif run:
            args.group = run  # validate / predict runs sit beside the fit run they evaluate


def wandb_run_of(ckpt_path: Optional[str], checkpoints: str) -> Optional[str]:
    """The W&B run id recorded in the checkpoint ``ckpt_path`` resolves to, if any."""
    if not ckpt_path:
        return None
    from posttrain.modules.io import checkpoints as ckpt

    path = checkpoints if ckpt_path == "last" else ckpt_path
    if not os.path.exists(path):
        return None  # a missing checkpoint is reported by the load itself
    return ckpt.wandb_run_id(path)


# ---------------------------------------------------------------------- a config for the tools
def parse(config: str, tool: str = "estimate", random_weights: bool = False):
    """The parsed fit config ``config`` (checked by LightningCLI's parser; nothing built); ``random_weights``: as
    ``posttrain fit --random_weights true`` reads it."""
    class ParseOnly(PosttrainCLI):
        def instantiate_classes(self) -> None:  # parse and check the YAML; build nothing
            pass

        def _set_seed(self) -> None:  # leave the global RNGs alone
            pass

    if not os.path.isfile(config):
        raise FileNotFoundError(f"{tool}: no config file {config!r}")
    check_experts(config, tool)
    try:  # LightningCLI warns when a caller's own command line is there too: hide it for the parse
        with mock.patch.object(sys, "argv", sys.argv[:1]):
            args = ["--config", config] + (["--random_weights", "true"] if random_weights else [])
            return ParseOnly(args=args, run=False, parser_kwargs={"exit_on_error": False}).config
    except Exception as err:  # jsonargparse's ArgumentError names the key and the value
        raise ValueError(f"{tool}: {config!r} is not a valid fit config: {err}") from err


def check_experts(config: str, tool: str = "estimate") -> None:
    """The card's experts as written in the YAML, before the parser: every problem in one message."""
    import yaml

    with open(config) as f:
        raw = yaml.safe_load(f) or {}

    def args(node: Any) -> dict:
        node = node if isinstance(node, dict) else {}
        return node.get("init_args", node) if "class_path" in node else node

    card = args(args(raw.get("model")).get("card"))
    experts = card.get("experts")
    if not isinstance(experts, dict) or not experts:
        raise ValueError(f"{tool}: {config!r} names no experts (model.init_args.card.experts is {experts!r})")
    named = dict(experts)
    if card.get("num_refiners"):
        named["refiner"] = card.get("refiner")
    problems = []
    for name, spec in named.items():
        spec = args(spec)
        if not spec:
            problems.append(f"expert {name!r} has no settings: give at least `arch:` (one of {sorted(presets.PRESETS)})")
            continue
        if spec.get("arch") not in presets.PRESETS:
            problems.append(f"expert {name!r}: arch {spec.get('arch')!r} is not one of {sorted(presets.PRESETS)}")
        if spec.get("trainable") and not spec.get("optimizer"):
            problems.append(f"expert {name!r} is trainable but has no optimizer; add `optimizer: {{class_path: "
                            f"torch.optim.AdamW, init_args: {{lr: 1e-4}}}}`")
    if problems:
        raise ValueError(f"{tool}: the card of {config!r}:\n  - " + "\n  - ".join(problems))


def instantiate_part(cfg, part: str, config: str, tool: str):
    """One part of a parsed fit config (``"model"`` or ``"data"``) built alone, by its class's own arguments."""
    from jsonargparse import ArgumentParser

    section = cfg.get(part)
    if section is None:
        raise ValueError(f"{tool}: {config!r} has no `{part}:`")
    module, _, name = section.class_path.rpartition(".")
    cls = getattr(importlib.import_module(module or f"posttrain.{'lit' if part == 'model' else 'datamodules'}"), name)
    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(cls, part)
    instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes
    try:
        return getattr(instantiate(parser.parse_object({part: section.init_args.as_dict()})), part)
    except Exception as err:  # the method's, the card's and the datamodule's own checks name the problem and the fix
        raise ValueError(f"{tool}: the {part} of {config!r} does not build: {err}") from err


