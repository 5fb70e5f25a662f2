"""The ``posttrain`` command: LightningCLI (``fit``, ``validate``, ``predict``) plus ``export``, ``estimate`` and
``preprocess``.

    posttrain fit --config configs/finetune.yaml
    posttrain fit --config configs/finetune.yaml --ckpt_path last      # resume (same W&B run)
    posttrain predict --config configs/finetune.yaml --ckpt_path last
    posttrain export --ckpt runs/finetune/checkpoints/last.ckpt --out exported/finetune
    posttrain preprocess --config configs/finetune.yaml --out runs/precomputed   # encode the data once

What this adds to LightningCLI:
- one run folder: ``trainer.default_root_dir`` is the only setting; the W&B logger's ``save_dir`` and
  every ``ModelCheckpoint.dirpath`` default to it (``<root>/checkpoints``), and the run is named after it;
- one video size: ``model.init_args.run.{frames,height,width}`` is linked into a video datamodule;
- W&B runs: a resumed fit continues the checkpoint's W&B run (its id travels in the checkpoint);
  validate and predict runs are tagged by ``job_type`` and grouped with the fit run;
- a console that says what matters: one progress bar in iterations (``max_steps``) with loss, reward and
  learning rates; one summary row per expert; no avoidable warnings;
- errors as one short message that names the option and the fix (``POSTTRAIN_DEBUG=1`` shows the
  traceback).
"""
from __future__ import annotations

import difflib
import logging
import os
import re
import sys
import warnings
from typing import Any, Literal, Optional

from jsonargparse import ArgumentParser
from lightning.pytorch import LightningDataModule
from lightning.pytorch.cli import LightningCLI, SaveConfigCallback

import posttrain.callbacks  # noqa: F401  (short class names in YAML: SampleVideos, C2Check, ...)
import posttrain.datamodules  # noqa: F401
import posttrain.lit  # noqa: F401  (the methods, for `model: {class_path: Finetune}`)
from posttrain.callbacks.progress import ExpertSummary, IterationProgressBar
from posttrain.lit.base import ExpertModule

SUBCOMMANDS = ("fit", "validate", "predict")
TOOLS = ("export", "estimate", "preprocess")


class LoggedConfig(SaveConfigCallback):
    """Writes ``config.yaml`` beside the run and puts the whole config into the loggers (W&B config)."""

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

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        return {"fit": {"model", "train_dataloaders", "val_dataloaders", "datamodule"},
                "validate": {"model", "dataloaders", "datamodule"},
                "predict": {"model", "dataloaders", "datamodule"}}

    def _add_subcommands(self, parser, **kwargs) -> None:
        super()._add_subcommands(parser, **kwargs)
        # listed in --help; `main` runs them before LightningCLI is built
        for name, parser_of in (("export", export_parser), ("estimate", estimate_parser),
                                ("preprocess", preprocess_parser)):
            tool = parser_of()
            parser._subcommands_action.add_subcommand(name, tool, help=tool.description.splitlines()[0])

    def add_arguments_to_parser(self, parser) -> None:
        # one video size: a video datamodule takes the method's (datamodules without the option are left alone)
        for key in ("frames", "height", "width"):
            parser.link_arguments(f"model.init_args.run.{key}", f"data.init_args.{key}")
        parser.add_argument("--preset", type=Optional[Literal["tiny"]], default=None,
                            help="tiny: run a real-model recipe at the embedded default's size — every expert from "
                                 "its tiny preset (the pretrained world's weights where an asset is shipped, no "
                                 "recipe weights read), one CPU process, the default video size")

    def before_instantiate_classes(self) -> None:
        subcommand = self.config.get("subcommand")  # None when built with run=False
        config = self.config[subcommand] if subcommand else self.config
        if config.get("preset") == "tiny":
            apply_tiny_preset(config)
        derive_run_folder(config.trainer, subcommand or "fit", config.get("ckpt_path"))

    def instantiate_trainer(self, **kwargs: Any):
        extra = [self._get(self.config_init, c) for c in self._parser(self.subcommand).callback_keys]
        config = {**self._get(self.config_init, "trainer", default={}), **kwargs}
        if config.get("enable_progress_bar", True) is not False:
            extra.append(IterationProgressBar())
        if config.get("enable_model_summary", True) is not False:
            extra.append(ExpertSummary())
        return self._instantiate_trainer(config, extra)


# ---------------------------------------------------------------------- --preset tiny
def apply_tiny_preset(config) -> None:
    """A recipe at the embedded default's size: every expert from its tiny preset, i.e. the shipped asset where
    there is one (the sources, dtypes, attention backends and offloading of real weights dropped; LoRA,
    sharding stage and roles kept), one CPU process, the default video size (one frame for an image generator)
    and text length. The method, its settings and the data stay."""
    from posttrain.lit.base import RunArgs

    def args(ns):  # a class given as {class_path, init_args} or as its arguments
        return ns.init_args if "init_args" in ns else ns

    def assign(ns, **values):
        for key, value in values.items():
            setattr(ns, key, value)

    card = args(config.model.init_args.card)
    experts = list((card.get("experts") or {}).values()) + ([card.refiner] if card.get("refiner") else [])
    for expert in map(args, experts):
        assign(expert, pretrained=None, subfolder=None, tokenizer=None, preset={}, dtype="float32",
               attention_backend=None, compile=False)
        if expert.get("zero") is not None:
            assign(args(expert.zero), offload_optimizer=False, offload_params=False, precision="fp32")
    card.text_max_length = min(card.get("text_max_length") or 64, 64)
    run = config.model.init_args.get("run")
    if run is not None:
        default = RunArgs()
        still = args(run).get("frames") == 1  # an image generator stays one frame
        assign(args(run), frames=1 if still else default.frames, height=default.height, width=default.width)
    assign(config.trainer, accelerator="cpu", devices=1, num_nodes=1, precision="32-true")
    if isinstance(config.trainer.get("strategy"), str):
        config.trainer.strategy = "auto"


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
    from posttrain.lit.base import read_run_meta

    path = os.path.join(checkpoints, "last.ckpt") if ckpt_path == "last" else ckpt_path
    return (read_run_meta(path) or {}).get("wandb_id")


# ---------------------------------------------------------------------- tools beside LightningCLI
def export_parser() -> ArgumentParser:
    from posttrain.lit.export import export

    parser = ArgumentParser(prog="posttrain export", description=export.__doc__, exit_on_error=False)
    parser.add_function_arguments(export, as_positional=False)
    return parser


def estimate_parser() -> ArgumentParser:
    from posttrain.lit.estimate import estimate

    parser = ArgumentParser(prog="posttrain estimate", description=estimate.__doc__, exit_on_error=False)
    parser.add_function_arguments(estimate, as_positional=False)
    return parser


def preprocess_parser() -> ArgumentParser:
    from posttrain.lit.preprocess import preprocess

    parser = ArgumentParser(prog="posttrain preprocess", description=preprocess.__doc__, exit_on_error=False)
    parser.add_function_arguments(preprocess, as_positional=False)
    return parser


# ---------------------------------------------------------------------- errors a user can act on
NOISE = (
    re.compile(r"^\s*-?\s*Does not validate against any of the Union subtypes\s*$"),
    re.compile(r"^\s*Subtypes: \["),
    re.compile(r"^\s*Errors:\s*$"),
    re.compile(r"^\s*Given value type:"),
    re.compile(r"^\s*Given value:"),
    re.compile(r"^\s*-?\s*Expected a <class 'NoneType'>"),
    re.compile(r"^\s*-?\s*Expected a path but .* either not accessible or invalid"),
    re.compile(r"^\s*-?\s*Problem with given class_path '.*':\s*$"),
    re.compile(r"^\s*-?\s*Not a valid subclass of "),
    re.compile(r"^\s*-?\s*Import path .* does not"),
    re.compile(r"^\s*$"),
)
TOP_LEVEL = ("config", "seed_everything", "trainer", "model", "data", "ckpt_path", "weights_only", "print_config")


def condense(message: str) -> str:
    """A jsonargparse / LightningCLI error as what names the option and the fix: the nested
    ``Parser key "x":`` lines become one dotted key, Union/type dumps are dropped."""
    keys, lines = [], []
    message = re.sub(r"\x1b\[[0-9;]*m", "", message)  # terminal colours (torch's weights-only note has them)
    for line in message.splitlines():
        key = re.match(r'^\s*(?:-\s*)?Parser key "([^"]+)":\s*(.*)$', line)
        if key:
            keys.append(key.group(1))
            if key.group(2).strip():
                lines.append(key.group(2).strip())
            continue
        if any(p.match(line) for p in NOISE):
            continue
        unknown_class = re.match(r"^\s*-?\s*Expected a dot import path string: (\S+)", line)
        if unknown_class:
            name = unknown_class.group(1)
            line = (f"class_path {name!r} is not a class posttrain knows by that name: give its full import path "
                    f"(e.g. `diffusers.{name}`, `torch.optim.{name}`, `posttrain.modules.rewards.{name}`)")
        line = re.sub(r"Expected a <class '(\w+)'>\. Got value: (.*)$", r"expected type \1, got \2", line)
        lines.append(line.strip().lstrip("- ").strip())
    seen, kept = set(), []
    for line in lines:
        if line and line not in seen:
            seen.add(line)
            kept.append(line)
    unknown = re.search(r"unrecognized arguments: (\S+)", message) \
        or re.search(r"[Kk]ey \"?([\w.]+)\"? is not expected", message) \
        or re.search(r"does not accept option '([\w.]+)'", message)
    if unknown:
        kept.append(_suggestion(unknown.group(1)))
    nested = re.search(r"Option '(\w+)' is not accepted", message)
    if nested:
        kept.append(_nested_suggestion(nested.group(1)))
    where = ".".join(k for k in keys if k not in ("init_args",))
    if where == "config" and "File does not exist" in message:
        kept.append("check the path; the shipped configs are in configs/ (e.g. configs/finetune.yaml)")
    body = "\n  ".join(k for k in kept if k)
    return f"{where}: {body}" if where else body


def _nested_suggestion(name: str) -> str:
    """The closest setting of an expert, a card's ZeRO or LoRA block, or ``run`` to a misspelt one."""
    import dataclasses

    from posttrain.lit.base import RunArgs
    from posttrain.modules.cards import Expert, LoraConfig, ZeroConfig

    known = {f.name for cls in (Expert, ZeroConfig, LoraConfig, RunArgs) for f in dataclasses.fields(cls)}
    close = difflib.get_close_matches(name, sorted(known), n=1)
    hint = f"did you mean `{close[0]}`? " if close else ""
    return f"{hint}(`posttrain fit --config C --print_config` shows every key a config accepts)"


def _suggestion(option: str) -> str:
    name = option.lstrip("-").split("=")[0]
    head = name.split(".")[0]
    close = difflib.get_close_matches(head, TOP_LEVEL, n=1)
    if close and close[0] != head:
        return f"did you mean --{close[0]}{name[len(head):]}? (`posttrain fit --help` lists the options)"
    return "`posttrain fit --help` lists the options; `--print_config` shows the whole config"


def _yaml_location(err: Exception, argv: list[str]) -> Optional[str]:
    """A YAML syntax error as ``file:line:column: problem`` of the --config file."""
    try:
        import yaml
    except ImportError:
        return None
    for i, arg in enumerate(argv[:-1]):
        if arg in ("--config", "-c") and os.path.isfile(argv[i + 1]):
            try:
                yaml.safe_load(open(argv[i + 1]))
            except yaml.YAMLError as yerr:
                mark = getattr(yerr, "problem_mark", None)
                where = f"{argv[i + 1]}:{mark.line + 1}:{mark.column + 1}" if mark else argv[i + 1]
                return f"{where}: invalid YAML: {getattr(yerr, 'problem', None) or yerr}"
    return None


def main(args: Optional[list[str]] = None) -> None:
    argv = sys.argv[1:] if args is None else list(args)
    debug = bool(os.environ.get("POSTTRAIN_DEBUG"))
    quiet_dependencies()
    command = argv[0] if argv and not argv[0].startswith("-") else "posttrain"
    try:
        if command == "export":
            from posttrain.lit.export import export

            print(export(**export_parser().parse_args(argv[1:]).as_dict()))
            return
        if command == "preprocess":
            from posttrain.lit.preprocess import preprocess

            print(preprocess(**preprocess_parser().parse_args(argv[1:]).as_dict()))
            return
        if command == "estimate":
            from posttrain.lit.estimate import estimate

            print(estimate(**estimate_parser().parse_args(argv[1:]).as_dict()))
            return
        # LightningCLI reads sys.argv itself (given both it warns); Lightning's launcher re-runs sys.argv for the other
        # processes. A call with `args` therefore runs as if they were the command line.
        saved = sys.argv
        sys.argv = [saved[0], *argv]
        try:
            PosttrainCLI(args=None, exit_on_error=False)
        finally:
            sys.argv = saved
    except SystemExit:
        raise
    except KeyboardInterrupt:
        raise
    except Exception as err:  # noqa: BLE001 - every error reaches the user as one message; traceback on demand
        if debug:
            raise
        text = _yaml_location(err, argv) or condense(str(err)) or type(err).__name__
        sys.stderr.write(f"posttrain {command}: error: {text}\n"
                         f"(POSTTRAIN_DEBUG=1 shows the traceback)\n")
        sys.exit(2)


def quiet_dependencies() -> None:
    """Drop the dependencies' console notes that say nothing about this run (targeted, by message)."""

    class _DropNotes(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            message = record.getMessage()
            return "litlogger" not in message and not message.startswith("Trainer already configured with model summary")

    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_DropNotes())

    class _DropBackendNote(logging.Filter):
        # transformers notes once that its image processors fall back to PIL without torchvision (the FLUX and
        # Wan I2V pipeline modules import them); nothing here uses torchvision
        def filter(self, record: logging.LogRecord) -> bool:
            return "requires torchvision (not installed)" not in record.getMessage()

    logging.getLogger("transformers.utils.import_utils").addFilter(_DropBackendNote())
    # Lightning 2.6's CombinedLoader builds torch pytree LeafSpecs, which torch >= 2.10 deprecates: a
    # dependency's note about its own internals, not about this run
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning)


if __name__ == "__main__":
    main()
