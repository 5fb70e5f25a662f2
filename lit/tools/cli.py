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
  traceback): a misspelt key gets the closest valid key at its level, a key that moved into an argument group
  names its new place, a value of the wrong type names the key, the value and the type expected.
"""
from __future__ import annotations

import ast
import dataclasses
import difflib
import importlib
import inspect
import logging
import os
import re
import subprocess
import sys
import threading
import time
import typing
import warnings
from typing import Optional, Sequence

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
  export        write a LoRA run's adapter (diffusers and ComfyUI keys), or a diffusers pipeline folder
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
    re.compile(r"^\s*-?\s*Subclass types expect one of:"),
    re.compile(r"^\s*-?\s*(a class path \(str\)|a dict with(out)? class_path|a dict with parameters accepted)"),
    re.compile(r"^\s*-?\s*Import path .* does not"),
    re.compile(r"^\s*$"),
)
TOP_LEVEL = ("config", "seed_everything", "trainer", "model", "data", "ckpt_path", "weights_only", "print_config",
             "preset")
PRINT_CONFIG = "`posttrain fit --config C --print_config` shows every key a config accepts"


def condense(message: str, argv: Sequence[str] = ()) -> str:
    """A jsonargparse / LightningCLI error as what names the option and the fix. A misspelt or moved key and a
    value of the wrong type are read from the parser's nested report (``config_problem``); anything else keeps its
    own words, the nested ``Parser key "x":`` lines made one dotted key and the Union/type dumps dropped. ``argv``:
    the command line, for the key as the user wrote it."""
    message = re.sub(r"\x1b\[[0-9;]*m", "", message)  # terminal colours (torch's weights-only note has them)
    problem = config_problem(message, argv)
    if problem:
        return problem
    keys, lines = [], []
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
        # a link's own check (one video size): its message, without the link's arguments dumped around it
        line = re.sub(r"^.*Call to compute_fn of link '[^']*' with args \(.*\) failed: ", "", line)
        lines.append(line.strip().lstrip("- ").strip())
    seen, kept = set(), []
    for line in lines:
        if line and line not in seen:
            seen.add(line)
            kept.append(line)
    where = ".".join(k for k in keys if k not in ("init_args",))
    if re.search(r"unrecognized arguments|is not accepted|does not accept", message):
        kept.append(f"`posttrain fit --help` lists the options; {PRINT_CONFIG}")
    if where == "config" and "File does not exist" in message:
        kept.append("check the path; the shipped configs are in configs/ (e.g. configs/finetune.yaml)")
    body = "\n  ".join(k for k in kept if k)
    return f"{where}: {body}" if where else body


# ---------------------------------------------------------------------- a key the parser refused
# jsonargparse reports a refused key as a tree: `Parser key "card":` and `Problem with given class_path 'C':` lines
# nest down to the leaf that says what is wrong (`Option 'x' is not accepted`, `Expected a <class 'float'>`, ...).
# The tree gives the class that owns the key, so the valid keys at that level are its own arguments.
@dataclasses.dataclass
class _Leaf:
    keys: list[str]  # the Parser keys above it, outermost first ("trainer.precision" split at its dots)
    classes: list[tuple[int, str]]  # (how many keys were above it, class path) of the classes above it
    text: str


def _read_report(message: str) -> list[_Leaf]:
    stack: list[tuple[int, str, str]] = []  # (indent, "key" | "class", name)
    leaves = []
    for line in message.splitlines():
        body = line.lstrip(" ")
        indent = len(line) - len(body)
        if body.startswith("- "):
            body, indent = body[2:], indent + 2
        if not body.strip():
            continue
        while stack and stack[-1][0] >= indent:
            stack.pop()
        # a callable (an optimizer) reports its class's keys inline: "Type ... expects a function or a callable
        # class: Parser key "lr":" or "...: Option 'lrr' is not accepted. Got value: Namespace(..., class_path='C')"
        body = re.sub(r"^Type .* expects a function or a callable class: ", "", body)
        key = re.match(r'Parser key "([^"]+)":\s*(.*)$', body)
        if key:
            stack.append((indent, "key", key.group(1)))
            if not key.group(2).strip():
                continue
            body, indent = key.group(2).strip(), indent + 1
        given_class = re.match(r"Problem with given class_path '([^']+)':\s*$", body)
        if given_class:
            stack.append((indent, "class", given_class.group(1)))
            continue
        keys, classes = [], []
        for _, kind, name in stack:
            if kind == "key":
                keys += name.split(".")
            else:
                classes.append((len(keys), name))
        leaves.append(_Leaf(keys, classes, body.strip()))
    return leaves


def config_problem(message: str, argv: Sequence[str] = ()) -> Optional[str]:
    """A misspelt or moved key, or a value of the wrong type, as one line: the key as written, and the fix (the
    closest valid key at that level, the key's new place, or the type expected and the value given). None for
    any other error."""
    first = message.strip().splitlines()[0] if message.strip() else ""
    unrecognized = re.match(r"unrecognized arguments: (.*)$", first)
    options = re.findall(r"(?:^| )--([\w.]+)", unrecognized.group(1)) if unrecognized else []
    if options:  # argparse names every option it did not know
        return "\n  ".join(_unknown_top_level(option, "--") for option in options)
    top = re.search(r"does not accept option '([\w.]+)'", first)
    if top and not first.startswith("Parser key"):
        return _unknown_top_level(top.group(1), "")
    leaves = _read_report(message)
    for leaf in leaves:
        unknown = re.match(r"Option '(\w+)' is not accepted(?:\. Got value: (.*class_path='([^']+)'.*))?", leaf.text)
        group = re.match(r"Group '(\w+)' does not accept option '(\w+)'", leaf.text)
        if unknown or group:
            keys = leaf.keys + [group.group(1)] if group else leaf.keys
            name = group.group(2) if group else unknown.group(1)
            owner = unknown.group(3) if unknown and unknown.group(3) else None
            return _unknown_key(keys, name, leaf.classes, owner, message, argv)
    for leaf in leaves:
        wrong = _wrong_type(leaf, leaves, message, argv)
        if wrong:
            return wrong
    return None


def _unknown_top_level(option: str, dashes: str) -> str:
    """A key of the command itself, or of ``trainer``: the closest one by name (``dashes``: "--" for an option of
    the command line, "" for a key of a YAML file)."""
    parts = option.split(".")
    if parts[0] not in TOP_LEVEL:
        names, prefix, name, rest = TOP_LEVEL, "", parts[0], ".".join(parts[1:])
    elif parts[0] == "trainer" and len(parts) == 2:
        from lightning.pytorch import Trainer

        names, prefix, name, rest = _parameters(Trainer), "trainer.", parts[1], ""
    else:
        return f"{dashes}{option}: no such option\n  `posttrain fit --help` lists the options; {PRINT_CONFIG}"
    fix = _closest(name, names, lambda n: f"--{prefix}{n}{'.' + rest if rest else ''}")
    return f"{dashes}{option}: no such option; {fix} (`posttrain fit --help` lists the options)"


def _unknown_key(keys: list[str], name: str, classes: list[tuple[int, str]], owner: Optional[str], message: str,
                 argv: Sequence[str]) -> str:
    """``name`` is not an argument of the class that owns the level ``keys`` leads to: where it moved (an
    argument group of that class holds it now), else the closest argument by name."""
    where = _user_key(keys + [name], message, argv) or ".".join(keys + [name])
    cls = _owner(keys, classes, owner)
    if cls is None:
        return f"{where}: no such key\n  {PRINT_CONFIG}"
    moved = _moved(cls, name)
    if moved:
        group, key = moved[0].split(".", 1)
        at = where[: -len(name)]  # the same level, as the user wrote it
        return (f"{where}: {cls.__name__}'s `{name}` is now `{moved[0]}`" +
                (f" (or {', '.join(f'`{m}`' for m in moved[1:])})" if len(moved) > 1 else "") +
                f"; write `{group}: {{{key}: ...}}` there (on the command line --{at}{moved[0]})")
    fix = _closest(name, _parameters(cls), lambda n: f"`{n}`")
    return f"{where}: {cls.__name__} has no setting `{name}`; {fix} ({PRINT_CONFIG})"


def _closest(name: str, names: Sequence[str], shown) -> str:
    close = difflib.get_close_matches(name, list(names), n=1)
    if close:
        return f"did you mean {shown(close[0])}?"
    nearest = difflib.get_close_matches(name, list(names), n=8, cutoff=0.0)
    return "valid here: " + ", ".join(shown(n) for n in nearest) + (", ..." if len(names) > len(nearest) else "")


def _moved(cls: type, name: str) -> list[str]:
    """Where a setting of ``cls`` went when its settings were grouped: ``<group>.<key>`` for every argument group
    of ``cls`` (an argument typed by a dataclass: GRPO's ``grpo``, joint RL's ``refiners``, DMD2's ``gan`` and
    ``regression``, every method's ``run``) that has a key ``name``, or that a renamed key went to (the tables of
    ``modules.rl.refiner_args`` and ``modules.distill.args``)."""
    from posttrain.modules.distill import args as distill_args
    from posttrain.modules.rl import refiner_args

    groups = {arg: kind for arg, kind in _argument_types(cls).items() if dataclasses.is_dataclass(kind)}
    renamed = {**refiner_args.MOVED, **distill_args.MOVED}.get(name)
    if renamed and renamed.split(".")[0] in groups:
        return [renamed]
    return [f"{group}.{name}" for group, kind in groups.items() if name in _parameters(kind)]


def _owner(keys: list[str], classes: list[tuple[int, str]], owner: Optional[str]) -> Optional[type]:
    """The class whose arguments are the valid keys at the level ``keys`` leads to: the innermost class the
    report names, followed through the type of each key below it (a dataclass group, an expert of a dict)."""
    if owner is not None:
        return _import(owner)
    if not classes:
        if keys[:1] == ["trainer"] and len(keys) == 1:
            from lightning.pytorch import Trainer

            return Trainer
        return None
    depth, path = classes[-1]
    cls = _import(path)
    for key in keys[depth:]:
        cls = _argument_types(cls).get(key) if cls is not None else None
    return cls


def _import(path: str) -> Optional[type]:
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None


def _parameters(cls: type) -> list[str]:
    """The keys ``cls`` takes: a dataclass's fields, or its arguments and, where it passes ``**kwargs`` on, its
    base classes' (as jsonargparse reads them)."""
    if dataclasses.is_dataclass(cls):
        return [f.name for f in dataclasses.fields(cls) if f.init]
    names: dict[str, None] = {}
    for base in cls.__mro__ if isinstance(cls, type) else (cls,):
        if base is object or (isinstance(cls, type) and "__init__" not in vars(base)):
            continue
        try:
            params = list(inspect.signature(base.__init__ if isinstance(cls, type) else base).parameters.values())
        except (TypeError, ValueError):
            break
        names.update((p.name, None) for p in params if p.name != "self" and p.kind not in (p.VAR_POSITIONAL,
                                                                                               p.VAR_KEYWORD))
        if not any(p.kind == p.VAR_KEYWORD for p in params):
            break
    return list(names)


def _argument_types(cls: type) -> dict[str, type]:
    """Each argument of ``cls`` -> the class it takes (``Optional[X]``, ``dict[str, X]``, ``list[X]`` -> X)."""
    try:
        hints = typing.get_type_hints(cls if dataclasses.is_dataclass(cls) else cls.__init__)
    except Exception:  # noqa: BLE001 - a hint that does not resolve: that argument is not followed
        return {}

    def inner(hint):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if typing.get_origin(hint) in (dict, typing.Union, list, tuple) or type(hint).__name__ == "UnionType":
            return inner(args[-1]) if args else None
        return hint if isinstance(hint, type) else None

    return {name: kind for name, hint in hints.items() if (kind := inner(hint)) is not None}


def _wrong_type(leaf: _Leaf, leaves: list[_Leaf], message: str, argv: Sequence[str]) -> Optional[str]:
    """``Expected a <class 'int'>. Got value: many``, or a Union's expectations beside its ``Given value``; and a
    class name that is no class (``Expected a dot import path string``) where no plain value was expected."""
    if not leaf.keys:
        return None
    same = [other.text for other in leaves if other.keys == leaf.keys and other.classes == leaf.classes]
    expectation = r"Expected a (?:<class '(\w+)'>|typing\.Literal\[(.*)\])"
    single = re.match(expectation + r"\. Got value: (.*)$", leaf.text)
    if single:
        expected, value = [single.groups()[:2]], single.group(3)
    else:
        expected = [k.groups() for text in same if (k := re.fullmatch(expectation, text))
                    and (k.group(2) is not None or k.group(1) in ("int", "float", "bool", "str", "NoneType"))]
        given = [re.sub(r"\. Got value: .*$", "", text[len("Given value: "):]) for text in same
                 if text.startswith("Given value: ")]
        if not given:
            return None
        value = given[0]
        if all(kind == "NoneType" for kind, _ in expected):
            unknown_class = re.match(r"Expected a dot import path string: (\S+)", leaf.text)
            if not unknown_class:
                return None
            name = unknown_class.group(1)
            where = _user_key(leaf.keys + ["class_path"], message, argv) or ".".join(leaf.keys)
            return (f"{where}: {name!r} is not a class posttrain knows by that name: give its full import path "
                    f"(e.g. `diffusers.{name}`, `torch.optim.{name}`, `posttrain.modules.rewards.{name}`)")
    types = list(dict.fromkeys(kind for kind, _ in expected if kind not in (None, "NoneType")))
    choices = list(dict.fromkeys(str(v) for _, literal in expected if literal is not None for v in _literal(literal)))
    wanted = ([f"type {' or '.join(types)}"] if types else []) + ([f"one of {', '.join(choices)}"] if choices else [])
    wanted += ["null"] if any(kind == "NoneType" for kind, _ in expected) else []
    where = _user_key(leaf.keys, message, argv) or ".".join(leaf.keys)
    close = difflib.get_close_matches(value, choices, n=1) if choices else []
    return f"{where}: expected {' or '.join(wanted)}, got {value}" + (f"; did you mean {close[0]}?" if close else "")


def _literal(values: str) -> tuple:
    try:
        return ast.literal_eval(f"({values},)")
    except (ValueError, SyntaxError):
        return (values,)


def _user_key(keys: list[str], message: str, argv: Sequence[str]) -> Optional[str]:
    """The refused key as the user wrote it (``model.init_args.card.experts.transformer.optimizer.init_args.lr``):
    the command-line option, or the YAML path in the value the parser was given, that leads through ``keys``
    (the report leaves out ``init_args`` and the expert's name); None if neither does."""
    def leads_through(path: list[str]) -> bool:
        it = iter(p for p in path if p != "init_args")
        return path[-1] == keys[-1] and all(any(p == k for p in it) for k in keys)

    for arg in argv:
        if arg.startswith("--"):
            option = arg[2:].split("=", 1)[0]
            if leads_through(option.split(".")):
                return option
    given = re.findall(r"^\s*Given value: (\{.*\}|\[.*\])$", message, flags=re.MULTILINE)
    if given:
        try:
            value = ast.literal_eval(given[-1])
        except (ValueError, SyntaxError):
            value = None
        top = re.match(r'\s*Parser key "([^"]+)"', message)
        head = top.group(1).split(".") if top else []
        for path in _paths(value):
            if leads_through(head + path):
                return ".".join(head + path).replace(".[", "[")
    return None


def _paths(value, prefix: Optional[list[str]] = None) -> list[list[str]]:
    prefix = prefix or []
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in [prefix + [str(k)], *_paths(v, prefix + [str(k)])]]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _paths(v, prefix + [f"[{i}]"])]
    return []


def _name_the_download(text: str, argv: Sequence[str]) -> str:
    """A missing ``pretrained`` folder's download command (the card's message: `huggingface-cli download <repo>
    --local-dir <folder>`) with the hub id that the header of a ``--config`` file names for that folder, as the
    recipes' headers do."""
    if "huggingface-cli download <repo>" not in text:
        return text
    repos = {}
    for i, arg in enumerate(argv[:-1]):
        if arg in ("--config", "-c") and os.path.isfile(argv[i + 1]):
            with open(argv[i + 1]) as f:
                header = " ".join(line.lstrip("#").strip() for line in f.read().splitlines()
                                  if line.startswith("#"))
            for repo, folder in re.findall(r"huggingface-cli download (\S+)\s+--local-dir\s+([^\s`;,)]+)", header):
                repos[os.path.normpath(folder)] = repo

    def named(match: re.Match) -> str:
        folder = os.path.normpath(match.group(1))
        repo = next((r for f, r in repos.items() if folder == f or folder.startswith(f + os.sep)), "<repo>")
        return f"huggingface-cli download {repo} --local-dir {match.group(1)}`"

    text = re.sub(r"huggingface-cli download <repo> --local-dir (\S+?)`", named, text)
    if "download <repo>" not in text:
        text = text.replace(" (<repo>: the model's hub id, as a recipe's header names it)", "")
    return text


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
        text = _yaml_location(err, argv) or condense(str(err), argv) or type(err).__name__
        text = _name_the_download(text, argv)
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
