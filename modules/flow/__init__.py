"""Flow matching: the one sampler (ODE and SDE steps with log-probabilities), conditioning, the flow-matching losses."""
