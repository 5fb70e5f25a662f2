"""Performance benches: what one part of the package costs, measured against a baseline in the same run.

Each bench runs from the repository root as ``python -m bench.<name>`` (``--help`` lists its options; its docstring
says what it compares and how); their figures are in docs/benchmarks.md. The scripts that reproduce the papers'
claims live in ``experiments/``.

How they measure. Two things timed one after the other measure the load of the machine as much as themselves, so a
timing bench runs both sides in one process in alternating blocks (baseline, candidate, baseline, …), pairs each
candidate block with the baseline blocks around it, and reports the median ratio with a distribution-free 95%
interval and a verdict: "too noisy" when the interval holds 1, met / missed / undecided against a goal
(``timing.py``). Memory benches measure per-process peaks in real multi-process runs (gloo on the CPU).

- ``cache_fill``: a folder's latents cache filled by one process against two processes, each its share.
- ``checkpoint_write``: one checkpoint of the default finetune, the atomic hashed folder against Lightning's write.
- ``compile``: a finetune training step eager against ``compile: true``.
- ``decode``: the shipped Wan VAE decoding a batch, its weights as stored against ``channels_last: true``.
- ``gpu``: a prepared one-GPU check at Wan2.1-1.3B shape: s/iteration and MFU, peak memory plain / ZeRO-3 / offload,
  an RL step, the causal student's frames per second, few-step sampling, attention kernels (``--tiny`` on a CPU).
- ``kv_cache``: the block-causal student's k-th chunk with the KV cache against recomputing chunks 1..k.
- ``memory``: per-process parameters + gradients + optimizer state, ZeRO-3 against DDP, two processes.
- ``optimizer``: AdamW's step, torch's default implementation against ``fused=True``.
- ``overhead``: a finetune iteration through ``posttrain fit`` against a plain PyTorch loop.
- ``reward_server``: a reward behind ``posttrain serve-reward`` against the same reward in-process.
- ``rollout``: a group of K samples rolled out as one batched forward against K sequential rollouts; the
  prompt-embedding cache's hit rate over a joint_rl run.
- ``sequence_parallel``: activation memory and step time of one generator step at sequence parallelism 1 and 2.

Measures that benches, ``experiments/`` and the tests share (imported, never run):

- ``timing``: alternating blocks, the median's interval, the verdict.
- ``fewstep``: a few-step student against its teacher: the unrun CLI, samples from fixed noise, closeness, held-out
  prompts, per-seed verdict files joined with a paired bootstrap.
- ``noise_scale``: the gradient noise scale of n gradient estimates (McCandlish et al. 2018) and its interval.
- ``seeds``: one seed on a run's three RNGs, the zero-learning-rate control, a ``before → mean [min, max]`` cell.
- ``sheet``: a before/after PNG of the prompts whose verdict training changed.
"""
