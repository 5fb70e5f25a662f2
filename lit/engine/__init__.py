"""Training plumbing behind the methods; nothing here is a method's algorithm.

- ``strategy.py``: one DeepSpeed ZeRO engine per sharded expert (kept here; the card runs their forward through
  them), DDP for the rest, sharded checkpoint folders;
- ``checkpoint_io.py``: Lightning's checkpoint I/O over the on-disk protocol of ``posttrain.modules.io.checkpoints``;
- ``resume.py``: what a checkpoint holds beyond Lightning's state, and the RNG discipline of exact resume;
- ``log_cadence.py``: per-iteration metrics logged at the loggers' cadence;
- ``startup.py``: the checks of precision, strategy and DDP that stop a run before anything is built.
"""
