"""Training plumbing behind the methods: the strategy (one DeepSpeed engine per sharded expert, DDP for the rest),
Lightning's checkpoint I/O over the on-disk protocol of ``posttrain.modules.checkpoints``, exact resume and the
logging cadence. Nothing here is a method's algorithm."""
