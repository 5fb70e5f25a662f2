"""Distillation: the DMD2 losses and the GAN heads on the critic."""
