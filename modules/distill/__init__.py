"""Distillation: the DMD2 losses, the GAN heads on the critic, and the settings of DMD2's GAN and regression terms."""
