"""Files on disk: the checkpoint protocol and its one verified loader, media, precomputed rows, the batch schema,
LoRA adapter files."""
