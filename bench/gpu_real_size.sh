#!/usr/bin/env bash
# Wan2.1-T2V-1.3B LoRA (the configs/recipes/wan2.1_t2v_1.3b_lora.yaml expert: rank 32 on attention and FFN, bf16
# base, gradient checkpointing, AdamW) at real size on one GPU, at the recipe's video size 81 x 480 x 832 (21 x 60 x
# 104 latents, 32,760 tokens) and 512 text tokens: seconds per iteration, peak GPU memory
# (torch.cuda.max_memory_allocated) beside `posttrain estimate`'s figure for the same expert, and MFU (model FLOPs =
# 3 x the transformer forward's FLOPs counted by torch.utils.flop_counter; HFU adds the checkpointed recompute), from
# bench/real_size.py --device cuda. Random weights from the published seed, or the downloaded weights where
# /models/Wan2.1-T2V-1.3B-Diffusers holds them. About 2 minutes on an H100 (build ~30 s on the host, 10 iterations
# of ~3 s). Then Wan2.1-T2V-14B LoRA as configs/recipes/wan2.1_t2v_14b_lora_24gb.yaml trains it (fp8 base, the last 24
# of 40 blocks swapped to host memory: `--swap-blocks 24`), random weights, at the same size, 3 iterations: its peak
# GPU memory beside the estimate (without offload_activations, which this bench does not set: the block inputs stay
# on the GPU, ~14 GiB more than the recipe's 21.3). The two stop themselves after 3 and 5 minutes.
#
#   bash bench/gpu_real_size.sh                 # from the repository root
#   ITERATIONS=20 VIDEO=33x480x832 bash bench/gpu_real_size.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ITERATIONS="${ITERATIONS:-10}"
VIDEO="${VIDEO:-81x480x832}"
WEIGHTS=/models/Wan2.1-T2V-1.3B-Diffusers
args=(--device cuda --cases wan1.3b_lora --video "$VIDEO" --iterations "$ITERATIONS"
      --out runs/bench_real_size/gpu_wan1.3b_lora.json)
if [ -f "$WEIGHTS/transformer/config.json" ]; then
  args+=(--pretrained "$WEIGHTS")
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 180 python -m bench.real_size "${args[@]}"
timeout 300 python -m bench.real_size --device cuda --cases wan14b_lora_fp8 --video "$VIDEO" --iterations 3 \
  --swap-blocks 24 --out runs/bench_real_size/gpu_wan14b_lora_fp8_swap24.json
