"""K3 checkpoints: the HF reader, the transformation table (HF → TensorRT-LLM names and
layouts), the in-memory loader, the converted-checkpoint format, and synthetic checkpoints."""
