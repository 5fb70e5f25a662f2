"""Reinforcement learning: GRPO settings, advantages, rollouts, workflows of stages, the RL losses."""
