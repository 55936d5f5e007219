"""Checkpoints: Hugging Face safetensors directories, native torch.distributed.checkpoint directories, audits."""
