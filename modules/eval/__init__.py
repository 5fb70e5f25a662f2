"""Evaluation: held-out sampling runs scored by GenEval, and Fréchet distance."""
