"""Reinforcement learning: GRPO settings, joint RL's refiner settings, advantages, rollouts, workflows of stages, the
RL losses."""
