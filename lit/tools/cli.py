"""The ``posttrain`` command: LightningCLI (``fit``, ``validate``, ``predict``) plus ``export``, ``estimate``,
``preprocess``, ``reward`` and ``serve-reward``.

    posttrain fit --config configs/finetune.yaml
    posttrain fit --config configs/finetune.yaml --ckpt_path last      # resume (same W&B run)
    posttrain predict --config configs/finetune.yaml --ckpt_path last
    posttrain export --ckpt runs/finetune/checkpoints/last.ckpt --out exported/finetune
    posttrain preprocess --config configs/finetune.yaml --out runs/precomputed   # encode the data once
    posttrain reward --config configs/flow_grpo.yaml --out runs/reward_check     # check a reward before training
    posttrain serve-reward --reward SyntheticGenEvalReward --port 8000           # a reward for RemoteReward

What a config means beyond LightningCLI (run folder, video size, W&B runs, ``--preset tiny``) is in
``lit/tools/config.py``; this file adds:
- the tools beside LightningCLI's subcommands, listed in ``--help``, which opens with what posttrain does
  (``DESCRIPTION``);
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
import subprocess
import sys
import threading
import time
import warnings
from typing import Optional

from jsonargparse import ArgumentParser, DefaultHelpFormatter

from posttrain.lit.tools import estimate as estimate_tool
from posttrain.lit.tools import export as export_tool
from posttrain.lit.tools import preprocess as preprocess_tool
from posttrain.lit.tools import reward as reward_tool
from posttrain.lit.tools import serve_reward as serve_reward_tool
from posttrain.lit.tools.config import PosttrainCLI

SUBCOMMANDS = ("fit", "validate", "predict")
TOOLS = ("export", "estimate", "preprocess", "reward", "serve-reward")
DESCRIPTION = """\
posttrain post-trains video and image generators, and the prompt-refiner language models around them:
finetuning and LoRA, few-step distillation (DMD2, Self-Forcing) and reinforcement learning (Flow-GRPO,
DiffusionNFT, joint RL of refiners and a generator). A run is one YAML file; configs/ holds one per method.

  fit           train: posttrain fit --config configs/finetune.yaml (resume: --ckpt_path last)
  validate      run a config's validation (a trained run's with --ckpt_path)
  predict       generate with a trained run: posttrain predict --config C --ckpt_path last
  export        write a checkpoint as a diffusers pipeline folder (or one expert's weights)
  estimate      memory per process of a config's experts, before any run
  preprocess    encode a config's data once: VAE latents and frozen text-encoder rows
  reward        score a config's data with its reward, before training on it
  serve-reward  serve a reward over HTTP for RemoteReward

`posttrain <command> --help` lists a command's options."""


class HelpFormatter(DefaultHelpFormatter):
    """jsonargparse's help, with the description printed as written (its table kept)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "".join(indent + line for line in text.splitlines(keepends=True))


class CommandLine(PosttrainCLI):
    """``PosttrainCLI`` whose ``--help`` says what posttrain does and lists the tools too (``main`` runs them before
    LightningCLI is built)."""

    def setup_parser(self, add_subcommands: bool, main_kwargs: dict, subparser_kwargs: dict) -> None:
        super().setup_parser(add_subcommands, main_kwargs, subparser_kwargs)
        self.parser.description, self.parser.formatter_class = DESCRIPTION, HelpFormatter

    def _add_subcommands(self, parser, **kwargs) -> None:
        super()._add_subcommands(parser, **kwargs)
        for name, parser_of in (("export", export_parser), ("estimate", estimate_parser),
                                ("preprocess", preprocess_parser), ("reward", reward_parser),
                                ("serve-reward", serve_reward_parser)):
            tool = parser_of()
            parser._subcommands_action.add_subcommand(name, tool, help=tool.description.splitlines()[0])


# ---------------------------------------------------------------------- tools beside LightningCLI
def export_parser() -> ArgumentParser:
    export = export_tool.export
    parser = ArgumentParser(prog="posttrain export", description=export.__doc__, exit_on_error=False)
    parser.add_function_arguments(export, as_positional=False)
    return parser


def estimate_parser() -> ArgumentParser:
    estimate = estimate_tool.estimate
    parser = ArgumentParser(prog="posttrain estimate", description=estimate.__doc__, exit_on_error=False)
    parser.add_function_arguments(estimate, as_positional=False)
    return parser


def preprocess_parser() -> ArgumentParser:
    preprocess = preprocess_tool.preprocess
    parser = ArgumentParser(prog="posttrain preprocess", description=preprocess.__doc__, exit_on_error=False)
    parser.add_function_arguments(preprocess, as_positional=False)
    return parser


def function_parser(function, prog: str) -> ArgumentParser:
    """A tool's parser: its function's typed arguments, its docstring as ``--help``."""
    parser = ArgumentParser(prog=prog, description=function.__doc__, exit_on_error=False)
    parser.add_function_arguments(function, as_positional=False)
    return parser


def reward_parser() -> ArgumentParser:
    return function_parser(reward_tool.reward, "posttrain reward")


def serve_reward_parser() -> ArgumentParser:
    return function_parser(serve_reward_tool.serve_reward, "posttrain serve-reward")


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
        # a link's own check (one video size): its message, without the link's arguments dumped around it
        line = re.sub(r"^.*Call to compute_fn of link '[^']*' with args \(.*\) failed: ", "", line)
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
    """Where a method's setting went when its settings were grouped (joint_rl's ``refiners``, dmd2's ``gan`` and
    ``regression``), else the closest setting of an expert, a card's ZeRO or LoRA block, or ``run`` to a misspelt
    one."""
    import dataclasses

    from posttrain.lit.base import RunArgs
    from posttrain.modules.distill import args as distill_args
    from posttrain.modules.models.cards import Expert, LoraConfig, ZeroConfig
    from posttrain.modules.rl import refiner_args

    for method, moved in (("joint_rl", refiner_args.MOVED), ("dmd2", distill_args.MOVED)):
        if name in moved:
            group, key = moved[name].split(".")
            return f"{method}'s `{name}` is now `{moved[name]}` (under model.init_args: `{group}: {{{key}: ...}}`)"
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
    if command in ("export", "estimate"):
        # their DeepSpeed code is CPU-side (ZeRO shards gathered into full weights, memory formulas): say so, instead
        # of DeepSpeed probing for an accelerator when imported and warning that it fell back to the CPU
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        if command == "export":
            print(export_tool.export(**export_parser().parse_args(argv[1:]).as_dict()))
            return
        if command == "preprocess":
            print(preprocess_tool.preprocess(**preprocess_parser().parse_args(argv[1:]).as_dict()))
            return
        if command == "estimate":
            print(estimate_tool.estimate(**estimate_parser().parse_args(argv[1:]).as_dict()))
            return
        if command == "reward":
            print(reward_tool.reward(**reward_parser().parse_args(argv[1:]).as_dict()))
            return
        if command == "serve-reward":
            parser = serve_reward_parser()
            serve_reward_tool.serve_reward(**parser.instantiate_classes(parser.parse_args(argv[1:])).as_dict())
            return
        # LightningCLI reads sys.argv itself (given both it warns); Lightning's launcher re-runs sys.argv for the other
        # processes. A call with `args` therefore runs as if they were the command line.
        saved = sys.argv
        sys.argv = [saved[0], *argv]
        try:
            CommandLine(args=None, exit_on_error=False)
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
        children = _stand_down_child_observer()
        if sys.stderr.isatty():  # a progress bar may hold the line (it ends without a newline): start a fresh one
            sys.stderr.write("\n")
        sys.stderr.write(f"posttrain {command}: error: {text}\n"
                         f"(POSTTRAIN_DEBUG=1 shows the traceback)\n")
        _await(children, timeout=60.0)
        sys.exit(2)


def _stand_down_child_observer() -> list:
    """On the process that launched the others (Lightning's subprocess launcher), the processes it started, and
    its watcher stopped. The watcher (``_ChildProcessObserver``, a thread polling every 5 s) SIGKILLs this process
    as soon as a child exits non-zero: the other processes stop with the same error and their own message, and a
    child exiting first would otherwise kill this one while it writes its message or exits. None elsewhere."""
    for thread in threading.enumerate():
        if thread.name == "child-process-observer" and hasattr(thread, "_child_processes"):
            thread._run = lambda: True  # its next poll ends the thread instead of killing
            return list(thread._child_processes)
    return []


def _await(children: list, timeout: float) -> None:
    """Wait for the launched processes to stop (each says its own error); kill one still running after ``timeout``
    seconds (a child hanging in a collective the failed process left)."""
    deadline = time.monotonic() + timeout
    for child in children:
        try:
            child.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()


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
